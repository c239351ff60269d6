"""A fair comparison of samplers: run a task under a grid of sampler settings, then tabulate, tune
and judge the settings with intervals over units.

`run_grid` runs a task under a grid of sampler settings (`sampler_grid`): every (setting, prompt,
sample) is a row of shared batches with per-row sampler configs and a per-(prompt, sample) generator
stream that is the same under every setting, so comparisons between samplers are paired.

Sections: the grid runner; per-setting tables of `run_grid` frames (cross-fitted tuning); quality vs
diversity on open-ended writing (Pareto frontiers, matched-diversity differences). The verdict rows
built from these tables (paired intervals, minimum detectable differences, generated sentences) are
in `verdicts`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from decodelab.common.stats import bootstrap_ci, interpolate_at, pareto_frontier
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
from decodelab.workloads.tasks import ArithmeticProblem, extract_answer

if TYPE_CHECKING:  # annotations only: pandas is imported where a function needs it
    import pandas as pd

# --- running a task under a grid of sampler settings ---------------------------------------------

# Sampler names (the suite's plot names) -> the SamplerConfig field their grid values set.
SAMPLER_FIELDS = {
    "top_p": "top_p", "min_p": "min_p", "top_k": "top_k", "typical": "typical_p", "eta": "eta", "epsilon": "epsilon",
}
BASELINES = ("temperature", "greedy")  # plain softmax sampling at T; argmax (T = 0)


@dataclass(frozen=True)
class Setting:
    """One cell of the grid: a sampler, its parameter value, a temperature, and the order of stages."""

    sampler: str  # a SAMPLER_FIELDS key or a BASELINES name
    param: float | None  # the sampler's own knob (None for the baselines)
    temperature: float
    order: str | tuple = "hf"  # Sampler order: "hf", "vllm", or stage names (e.g. truncate first)

    @property
    def config(self):
        from decodelab.core.sampling import SamplerConfig

        if self.sampler == "greedy":
            return SamplerConfig(temperature=0.0)
        if self.sampler == "temperature":
            return SamplerConfig(temperature=self.temperature)
        value = int(self.param) if self.sampler == "top_k" else self.param
        return SamplerConfig(temperature=self.temperature, **{SAMPLER_FIELDS[self.sampler]: value})

    @property
    def order_name(self) -> str:
        return self.order if isinstance(self.order, str) else "truncate_first"

    @property
    def key(self) -> tuple:
        """The structured key verdicts use (setting_key): (sampler, param, temperature, order name)."""
        return setting_key(self.sampler, self.param, self.temperature, self.order_name)

    @property
    def label(self) -> str:
        if self.sampler == "greedy":
            return "greedy"
        knob = "" if self.param is None else f"={self.param:g}"
        suffix = "" if self.order == "hf" else f",{self.order_name}"
        return f"{self.sampler}{knob},T={self.temperature:g}{suffix}"


# Every filter on the T = 1 distribution, then temperature on what survives (one order for all samplers,
# so truncate-first rows of different samplers can share a batch).
TRUNCATE_FIRST = ("top_k", "top_p", "min_p", "typical_p", "epsilon", "eta", "temperature")


def truncate_first_order(sampler: str | None = None) -> tuple[str, ...]:
    """Stage order that truncates on the T = 1 distribution, then applies temperature to the kept set."""
    return TRUNCATE_FIRST


def sampler_grid(
    samplers: dict[str, list], temperatures: list[float], *, baselines: bool = True, greedy: bool = True, order="hf"
) -> list[Setting]:
    """Every sampler x each of its values x each temperature, plus (baselines) plain temperature
    sampling at each temperature and greedy once (unless greedy=False). Fairness by construction:
    every sampler must list the same number of values (the same tuning budget)."""
    unknown = set(samplers) - set(SAMPLER_FIELDS)
    if unknown:
        raise ValueError(f"samplers has unknown names {sorted(unknown)}; allowed: {sorted(SAMPLER_FIELDS)}")
    sizes = {name: len(values) for name, values in samplers.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"samplers={sizes} (values per sampler): every sampler needs the same number of settings")
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures={temperatures!r} must all be > 0 (greedy is added separately)")
    grid = [Setting(name, float(v), float(t), order)
            for t in temperatures for name, values in samplers.items() for v in values]
    if baselines:
        grid += [Setting("temperature", None, float(t), order) for t in temperatures]
        grid += [Setting("greedy", None, 0.0)] if greedy else []
    return grid


def order_grid(settings: dict[str, float], temperatures: list[float]) -> list[Setting]:
    """Each {sampler: value} at each temperature twice: temperature first (Hugging Face and vLLM) and
    truncation first (the kept set chosen on the T = 1 distribution, then temperature applied to it)."""
    return [Setting(name, float(value), float(t), order)
            for name, value in settings.items() for t in temperatures
            for order in ("hf", truncate_first_order(name))]


def row_seed(seed: int, unit: int, sample: int) -> int:
    """The generator seed of (unit, sample): shared by every setting, so draws are paired across samplers.
    A hash, so streams of different (seed, unit, sample) never coincide in practice."""
    digest = hashlib.sha256(f"decodelab-row-{seed}-{unit}-{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch seeds are < 2**64; keep it positive


def run_grid(
    model, prompts: list[list[int]], settings: list[Setting], *, n_samples: int = 1, max_new_tokens: int = 128,
    seed: int = 0, batch_size: int = 64, n_units: Sequence[int] | None = None, progress: bool = True,
):
    """Generate for every (setting, prompt, sample) as rows of shared batches (per-row sampler configs).

    Row (setting s, unit u, sample j) draws its uniforms from a generator seeded with row_seed(seed, u, j),
    the same for every setting: differences between settings are not seed noise. Greedy settings run
    one sample per unit (more would be copies). n_units: per setting, how many of the leading units it
    runs on (None = all), so secondary settings can run on a prefix of the units that main ones use;
    on the units two settings share they stay paired. Rows are batched unit by unit, greedy rows with
    the sampled rows of their unit, so a batch holds the rows of one or a few prompts and each prompt is
    prefilled once per stage order (`shared_prefix.generate_shared`).
    Returns (DataFrame, one row per generation: setting, sampler, param, temperature, order, label,
    unit, sample, tokens, n_tokens, finished, logprob (sum of log p_model(token), T = 1, over the
    tokens); list of DecodeStats).
    """
    import pandas as pd
    import torch

    from decodelab.core.sampling import Sampler
    from decodelab.core.shared_prefix import generate_shared

    n_units = [len(prompts)] * len(settings) if n_units is None else [int(n) for n in n_units]
    if len(n_units) != len(settings) or any(not 1 <= n <= len(prompts) for n in n_units):
        raise ValueError(f"n_units={n_units!r} must give each of the {len(settings)} settings a count in "
                         f"1..{len(prompts)} (the number of prompts)")
    rows = [
        (s, u, j)
        for s, setting in enumerate(settings)
        for u in range(n_units[s])
        for j in range(1 if setting.sampler == "greedy" else n_samples)
    ]
    # one stage order per batch (a Sampler has one); the rows of a unit stay together, greedy rows
    # included (a mixed batch masks greedy rows to their argmax), so each prompt is prefilled once per order
    rows.sort(key=lambda r: (settings[r[0]].order_name, r[1], r[0], r[2]))
    batches = [chunk[i : i + batch_size] for chunk in _split_by_order(rows, settings)
               for i in range(0, len(chunk), batch_size)]
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=f"{len(rows)} generations")
    records, stats = [], []
    for batch in batches:
        units = list(dict.fromkeys(u for _, u, _ in batch))
        counts = [sum(1 for _, u, _ in batch if u == unit) for unit in units]
        sampler = Sampler([settings[s].config for s, _, _ in batch], order=settings[batch[0][0]].order)
        gens = [torch.Generator(device=model.device).manual_seed(row_seed(seed, u, j)) for _, u, j in batch]
        result = generate_shared(model, [prompts[u] for u in units], counts, max_new_tokens=max_new_tokens,
                                 sampler=sampler, generator=gens)
        stats.append(result.stats)
        for (s, u, j), tokens, finished, logprob in zip(batch, result.tokens, result.finished, result.logprobs):
            st = settings[s]
            records.append(dict(setting=s, sampler=st.sampler, param=st.param, temperature=st.temperature,
                                order=st.order_name, label=st.label, unit=u, sample=j, tokens=tokens,
                                n_tokens=len(tokens), finished=finished, logprob=logprob))
    return pd.DataFrame.from_records(records).sort_values(["setting", "unit", "sample"], ignore_index=True), stats


def _split_by_order(rows, settings):
    """Rows (already sorted) -> runs of rows sharing the stage order."""
    chunks: dict = {}
    for r in rows:
        chunks.setdefault(settings[r[0]].order_name, []).append(r)
    return list(chunks.values())


def units_per_setting(settings: list[Setting], main_temperatures: Sequence[float], n_main: int,
                      n_secondary: int) -> list[int]:
    """How many leading units each setting runs on (run_grid's n_units): the main comparisons (every
    truncation sampler in the temperature-first order at a main temperature, and greedy) on all
    n_main units, everything else (other temperatures, plain temperature sampling, other stage
    orders) on the first n_secondary."""
    if not 1 <= n_secondary <= n_main:
        raise ValueError(f"n_secondary={n_secondary!r} must be in 1..n_main={n_main}")
    main = {float(t) for t in main_temperatures}
    missing = main - {s.temperature for s in settings if s.sampler in SAMPLER_FIELDS and s.order_name == "hf"}
    if missing:
        raise ValueError(f"main_temperatures has {sorted(missing)}, where no truncation sampler runs; allowed: the "
                         f"sweep's temperatures {sorted({s.temperature for s in settings if s.sampler != 'greedy'})}")

    def is_main(s: Setting) -> bool:
        return s.sampler == "greedy" or (s.sampler in SAMPLER_FIELDS and s.order_name == "hf" and s.temperature in main)

    return [n_main if is_main(s) else n_secondary for s in settings]


def check_settings(temperatures: Sequence[float]) -> list[tuple[Setting, Setting]]:
    """(check, reference) pairs that must generate identical rows in one run_grid call, whatever the
    model: top_p = 1 disables the filter, so it is plain temperature sampling at the lowest temperature
    (the common random numbers: equal uniforms -> equal tokens); min_p = 1 keeps only the argmax, so it
    is greedy at the highest temperature (temperature never moves the argmax)."""
    lo, hi = float(min(temperatures)), float(max(temperatures))
    return [(Setting("top_p", 1.0, lo), Setting("temperature", None, lo)),
            (Setting("min_p", 1.0, hi), Setting("greedy", None, 0.0))]


def rows_of(frame, setting: Setting):
    """The rows of run_grid's frame that `setting` generated (matched on its structured key)."""
    keys = [setting_key(*k) for k in zip(frame.sampler, frame.param, frame.temperature, frame.order)]
    return frame[[k == setting.key for k in keys]]


def identical_rows(frame, check: Setting, reference: Setting) -> dict:
    """Fraction of (unit, sample) rows of `check` whose tokens equal the `reference` row with the same
    unit (and sample; greedy has sample 0 only). -> {check, reference, n_rows, fraction_identical}."""
    a = rows_of(frame, check).set_index(["unit", "sample"]).tokens
    b = rows_of(frame, reference).set_index(["unit", "sample"]).tokens
    keys = [k for k in a.index if (k if reference.sampler != "greedy" else (k[0], 0)) in b.index]
    same = [a[k] == b[k if reference.sampler != "greedy" else (k[0], 0)] for k in keys]
    return {"check": check.label, "reference": reference.label, "n_rows": len(keys),
            "fraction_identical": float(np.mean(same)) if same else None}


def decode_texts(tokenizer, token_lists: list[list[int]]) -> list[str]:
    return [tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]


def score_arithmetic(frame, problems: list[ArithmeticProblem], tokenizer):
    """Add text, pred (extracted integer or None), answer and correct (0/1) columns to run_grid's frame."""
    frame = frame.copy()
    frame["text"] = decode_texts(tokenizer, list(frame["tokens"]))
    frame["pred"] = [extract_answer(t) for t in frame["text"]]
    frame["answer"] = [problems[u].answer for u in frame["unit"]]
    frame["correct"] = [int(p is not None and p == a) for p, a in zip(frame["pred"], frame["answer"])]
    return frame


# --- per-setting tables from run_grid frames ---------------------------------------------------------
# A frame has one row per generation with columns setting, sampler, param, temperature, order, label,
# unit, sample and the metric columns. The unit of resampling is always the unit (problem / prompt):
# samples of one unit share it, so they are averaged first.

SETTING_COLUMNS = ["setting", "sampler", "param", "temperature", "order", "label"]


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


def setting_key(sampler: str, param: float | None, temperature: float, order: str = "hf") -> tuple:
    """A setting's structured key (sampler, param, temperature, order name): how verdicts look settings
    up (never by formatting a label string). Numbers as floats, a missing param as None."""
    return (sampler, None if _is_missing(param) else float(param), float(temperature), order)


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
                                                     [None if _is_missing(p) else float(p) for p in params])
    return out


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


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


def flip(diff: dict) -> dict:
    """{difference, ci_low, ci_high} of a - b -> the same for b - a."""
    return {**diff, "difference": -diff["difference"], "ci_low": -diff["ci_high"], "ci_high": -diff["ci_low"]}


# --- quality vs diversity on open-ended writing ------------------------------------------------------


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
            {"param": None if _is_missing(group.loc[i, "param"]) else float(group.loc[i, "param"]),
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
