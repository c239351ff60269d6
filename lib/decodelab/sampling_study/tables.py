"""Per-setting tables of `grid.run_grid` frames and cross-fitted tuning: a sampler's accuracy with
its bootstrap interval over units, and its tuned accuracy without selection bias.

A frame has one row per generation with columns setting, sampler, param, temperature, order, label,
unit, sample and the metric columns. The unit of resampling is always the unit (problem / prompt):
samples of one unit share it, so they are averaged first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from decodelab.common.stats import bootstrap_ci
from decodelab.sampling_study.grid import SETTING_COLUMNS, is_missing, setting_key

if TYPE_CHECKING:  # annotations only: pandas is imported where a function needs it
    import pandas as pd


def unit_matrix(frame, value: str) -> tuple[list[int], np.ndarray]:
    """(setting ids, (S, U) array): the mean of `value` over samples, per setting and unit."""
    table = frame.groupby(["setting", "unit"])[value].mean().unstack("unit")
    return list(table.index), table.to_numpy(dtype=float)


def setting_table(frame, value: str, *, n_boot: int = 2000, seed: int = 0):
    """One row per setting: its columns, `value` averaged over units, and a bootstrap CI over units."""
    import pandas as pd

    ids, matrix = unit_matrix(frame, value)
    info = frame.drop_duplicates("setting").set_index("setting")
    rows = []
    for sid, per_unit in zip(ids, matrix):
        ran = per_unit[~np.isnan(per_unit)]  # the units this setting ran on
        est, low, high = bootstrap_ci(ran, n_boot=n_boot, seed=seed)
        row = {c: info.loc[sid, c] for c in SETTING_COLUMNS if c != "setting"}
        rows.append(dict(setting=sid, **row, **{value: est, "ci_low": low, "ci_high": high, "n_units": len(ran)}))
    return pd.DataFrame(rows)


def cross_fit_best(matrix: np.ndarray, *, seed: int = 0, folds: int = 2) -> tuple[np.ndarray, list[int]]:
    """Tuned performance without selection bias. matrix: (k settings, n units), higher is better.

    Units are split into `folds` random folds; each fold is scored with the setting that is best on the
    other folds (first on ties). Returns (per-unit values (n,), the setting chosen for each fold).
    Every sampler gets the same k, so the tuning budget is equal by construction.
    """
    k, n = matrix.shape
    if n < folds:
        raise ValueError(f"units={n} must be >= folds={folds} for cross-fitting")
    fold_of = np.random.default_rng(seed).permutation(n) % folds
    values, chosen = np.empty(n), []
    for f in range(folds):
        best = int(np.argmax(matrix[:, fold_of != f].mean(axis=1)))
        values[fold_of == f] = matrix[best, fold_of == f]
        chosen.append(best)
    return values, chosen


def per_unit_values(frame, value: str) -> dict[tuple, "pd.Series"]:
    """{setting_key: pd.Series of `value` averaged over samples, indexed by unit} for every setting in
    `frame` (a setting's series holds only the units it ran on)."""
    out = {}
    for (sampler, param, temperature, order), group in frame.groupby(
            ["sampler", "param", "temperature", "order"], dropna=False, sort=False):
        out[setting_key(sampler, param, temperature, order)] = group.groupby("unit")[value].mean()
    return out


def tuned_per_unit(frame, value: str, *, seed: int = 0) -> dict[tuple[str, float, str], tuple["pd.Series", list]]:
    """{(sampler, temperature, order): (cross-fitted per-unit values as a Series indexed by unit, chosen
    params)} over each sampler's grid at each temperature (baselines have a one-setting grid). Every
    setting of one grid must have run on the same units."""
    import pandas as pd

    out = {}
    for (sampler, temperature, order), group in frame.groupby(["sampler", "temperature", "order"], sort=False):
        ids, matrix = unit_matrix(group, value)
        units = group.groupby(["setting", "unit"])[value].mean().unstack("unit").columns.to_numpy()
        ran = ~np.isnan(matrix).all(axis=0)
        if np.isnan(matrix[:, ran]).any():
            raise ValueError(f"the {sampler} grid at T={temperature} ({order}) ran its settings on different "
                             f"units: cross-fitting needs every setting on the same units")
        values, chosen = cross_fit_best(matrix[:, ran], seed=seed)
        params = group.drop_duplicates("setting").set_index("setting").loc[[ids[c] for c in chosen], "param"]
        out[(sampler, float(temperature), order)] = (pd.Series(values, index=units[ran]),
                                                     [None if is_missing(p) else float(p) for p in params])
    return out


def tuned_table(tuned: dict, *, n_boot: int = 2000, seed: int = 0):
    """tuned_per_unit's dict -> one row per (sampler, temperature, order): the cross-fitted value, its
    bootstrap CI over units, the number of units, and the parameter chosen in each fold."""
    import pandas as pd

    rows = []
    for (sampler, temperature, order), (values, chosen) in tuned.items():
        est, low, high = bootstrap_ci(np.asarray(values, dtype=float), n_boot=n_boot, seed=seed)
        rows.append({"sampler": sampler, "temperature": temperature, "order": order, "value": est,
                     "ci_low": low, "ci_high": high, "n_units": len(values), "chosen": chosen})
    return pd.DataFrame(rows)
