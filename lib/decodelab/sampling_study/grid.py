"""A fair comparison of samplers, part one: the grid of sampler settings and the runner that generates
under all of them in shared batches.

`run_grid` runs a task under a grid of sampler settings (`sampler_grid`): every (setting, prompt,
sample) is a row of shared batches with per-row sampler configs and a per-(prompt, sample) generator
stream (`decodelab.common.seeding.row_seed`) that is the same under every setting, so comparisons
between samplers are paired. A setting is named by its structured key (`setting_key`), never by
formatting a label string.

The per-setting tables and cross-fitted tuning of `run_grid` frames are in `tables`; quality vs
diversity on open-ended writing in `writing`; the verdict rows in `verdicts`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from decodelab.common.seeding import row_generator
from decodelab.workloads.tasks import ArithmeticProblem, extract_answer

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
        gens = [row_generator(seed, u, j, device=model.device) for _, u, j in batch]
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


# --- the frame run_grid returns ----------------------------------------------------------------------
# One row per generation: the setting's columns below, then unit, sample and the metric columns.

SETTING_COLUMNS = ["setting", "sampler", "param", "temperature", "order", "label"]


def setting_key(sampler: str, param: float | None, temperature: float, order: str = "hf") -> tuple:
    """A setting's structured key (sampler, param, temperature, order name): how verdicts look settings
    up (never by formatting a label string). Numbers as floats, a missing param as None."""
    return (sampler, None if is_missing(param) else float(param), float(temperature), order)


def is_missing(value) -> bool:
    """Whether a frame's param cell holds no value (None, or the NaN pandas stores for it)."""
    return value is None or (isinstance(value, float) and math.isnan(value))
