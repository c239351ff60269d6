"""Quality vs diversity on open-ended writing: per-generation quality scores, per-prompt diversity
of a setting's samples, each sampler's Pareto frontier, and quality differences at matched diversity.

Input: `grid.run_grid` frames of writing prompts (several samples per prompt and setting).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from decodelab.common.stats import interpolate_at, pareto_frontier
from decodelab.sampling_study.grid import SETTING_COLUMNS, is_missing
from decodelab.sampling_study.metrics import (
    Embedder,
    coherence,
    distinct_n,
    embedding_diversity,
    judge_nll,
    load_embedder,
    self_bleu,
    words,
)


def writing_scores(frame, prompt_texts: Sequence[str], tokenizer, *, embedder: Embedder | None = None,
                   judge=None, judge_batch_size: int = 16):
    """Per generation: text, n_words, coherence (cos of prompt and continuation embeddings) and
    judge_nll: mean token NLL under `judge` (a LoadedModel), or with judge=None under the generating
    model itself from run_grid's `logprob` column. Returns a copy of run_grid's frame with these columns."""
    frame = frame.copy()
    frame["text"] = [tokenizer.decode(t, skip_special_tokens=True) for t in frame["tokens"]]
    frame["n_words"] = [len(words(t)) for t in frame["text"]]
    embedder = embedder or load_embedder()
    cont = embedder(list(frame["text"]))
    prompt_emb = embedder(list(prompt_texts))
    frame["coherence"] = coherence(prompt_emb[list(frame["unit"])], cont).numpy()
    frame["_embedding"] = list(cont.numpy())
    if judge is not None:
        frame["judge_nll"] = judge_nll(judge, [prompt_texts[u] for u in frame["unit"]], list(frame["text"]),
                                       batch_size=judge_batch_size).numpy()
    elif "logprob" in frame:
        # the generating model as its own judge: its T = 1 log-probs were recorded while sampling, so
        # the NLL costs no extra forward pass (it counts the EOS token when one was produced)
        frame["judge_nll"] = -frame["logprob"] / frame["n_tokens"].clip(lower=1)
    return frame


def diversity_per_unit(frame):
    """Per (setting, unit), over the unit's samples: embedding diversity, self-BLEU, distinct-1/2/3,
    and the mean quality columns present (coherence, judge_nll). Needs n_samples >= 2."""
    import pandas as pd

    rows = []
    quality = [c for c in ("coherence", "judge_nll", "n_words") if c in frame]
    for (_setting, unit), group in frame.groupby(["setting", "unit"]):
        if len(group) < 2:
            continue
        texts = [words(t) for t in group["text"]]
        row = {c: group[c].iloc[0] for c in SETTING_COLUMNS}
        row.update(unit=unit, embedding_diversity=embedding_diversity(torch.tensor(np.stack(group["_embedding"]))),
                   self_bleu=self_bleu(texts), **{f"distinct_{n}": distinct_n(texts, n) for n in (1, 2, 3)},
                   **{c: float(group[c].mean()) for c in quality})
        rows.append(row)
    return pd.DataFrame(rows)


def setting_points(per_unit, x: str, y: str):
    """Mean of x and y per setting (a point of the quality-diversity plane), with setting columns."""
    cols = [c for c in SETTING_COLUMNS if c in per_unit]
    return per_unit.groupby(cols, dropna=False)[[x, y]].mean().reset_index()


def frontiers(points, x: str, y: str, *, maximize_y: bool = True) -> dict[str, list[dict]]:
    """{sampler: its Pareto frontier points [{param, temperature, x, y}] sorted by x}, x maximized,
    y maximized (or minimized with maximize_y=False, e.g. judge NLL)."""
    out = {}
    for sampler, group in points.groupby("sampler", sort=False):
        group = group.reset_index(drop=True)
        ys = group[y] if maximize_y else -group[y]
        keep = pareto_frontier(group[x], ys)
        out[sampler] = [
            {"param": None if is_missing(group.loc[i, "param"]) else float(group.loc[i, "param"]),
             "temperature": float(group.loc[i, "temperature"]), x: float(group.loc[i, x]), y: float(group.loc[i, y])}
            for i in keep
        ]
    return out


def matched_target(front_a: list[dict], front_b: list[dict], x: str) -> float:
    """Middle of the x-range both frontiers cover (NaN when they do not overlap)."""
    lo = max(min(p[x] for p in front_a), min(p[x] for p in front_b))
    hi = min(max(p[x] for p in front_a), max(p[x] for p in front_b))
    return (lo + hi) / 2 if lo <= hi else float("nan")


def _frontier_value(xs: np.ndarray, ys: np.ndarray, target: float, maximize_y: bool) -> float:
    """y at x = target on the Pareto frontier of the points (xs, ys)."""
    signed = ys if maximize_y else -ys
    keep = pareto_frontier(xs, signed)
    value = interpolate_at(xs[keep], signed[keep], target)
    return value if maximize_y else -value


def _config_unit_matrices(per_unit, sampler: str, x: str, y: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(units,), X (configs, units), Y (configs, units) for one sampler's settings."""
    g = per_unit[per_unit["sampler"] == sampler]
    X = g.pivot_table(index="setting", columns="unit", values=x)
    Y = g.pivot_table(index="setting", columns="unit", values=y).loc[X.index, X.columns]
    return X.columns.to_numpy(), X.to_numpy(dtype=float), Y.to_numpy(dtype=float)


def matched_quality_diff(per_unit, a: str, b: str, x: str, y: str, target: float, *, maximize_y: bool = True,
                         n_boot: int = 1000, seed: int = 0) -> dict:
    """Quality y of sampler a minus sampler b at the same diversity x = target, each read off its own
    Pareto frontier (linear between frontier points, no extrapolation). Paired bootstrap over units:
    both samplers' points are recomputed from the same resampled units. Returns {difference, ci_low,
    ci_high, n_valid (bootstrap draws where both frontiers reach the target)}."""
    ua, Xa, Ya = _config_unit_matrices(per_unit, a, x, y)
    ub, Xb, Yb = _config_unit_matrices(per_unit, b, x, y)
    if not np.array_equal(ua, ub):
        raise ValueError(f"samplers {a!r} and {b!r} were not run on the same units: cannot pair them")

    def diff(idx):
        va = _frontier_value(np.nanmean(Xa[:, idx], 1), np.nanmean(Ya[:, idx], 1), target, maximize_y)
        vb = _frontier_value(np.nanmean(Xb[:, idx], 1), np.nanmean(Yb[:, idx], 1), target, maximize_y)
        return va - vb

    n = len(ua)
    estimate = diff(np.arange(n))
    rng = np.random.default_rng(seed)
    boots = np.array([diff(rng.integers(0, n, size=n)) for _ in range(n_boot)])
    boots = boots[~np.isnan(boots)]
    low, high = np.quantile(boots, [0.025, 0.975]) if len(boots) else (float("nan"), float("nan"))
    return {"difference": float(estimate), "ci_low": float(low), "ci_high": float(high), "n_valid": int(len(boots))}


def flip(diff: dict) -> dict:
    """{difference, ci_low, ci_high} of a - b -> the same for b - a."""
    return {**diff, "difference": -diff["difference"], "ci_low": -diff["ci_high"], "ci_high": -diff["ci_low"]}
