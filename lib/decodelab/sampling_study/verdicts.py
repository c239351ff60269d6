"""Verdicts of a paired comparison: one row per claim "a > b" with its bootstrap interval, the
minimum detectable difference (MDD) of the sample, the units a half-width target needs, and the
sentences a notebook prints, all generated from the numbers.

    row = verdicts.claim("tuned min-p beats tuned top-p at T=2", a, b, key={...}, main=True,
                         target_half_width=0.10)
    print(verdicts.verdict_text(row))          # "...: +8.3 points, 95% CI [...] over 128 units: holds."
    print(verdicts.verdict_summary(rows))      # "Of 4 main verdicts, 2 hold, ..."

The power arithmetic (z * sd / sqrt(n), the MDD, required pairs) is in `decodelab.common.stats`.
Notebook 02's own claims are built here too (`accuracy_claims`, `writing_claims`): settings are looked
up by their structured keys (`grid.setting_key`, `tables.tuned_per_unit`'s (sampler, temperature,
order)), never by formatting a label string.
"""
from __future__ import annotations

import math

import numpy as np

from decodelab.common.stats import (
    mdd_from_interval,
    minimum_detectable_difference,
    paired_bootstrap_diff,
    planning_sd,
    required_pairs,
    sd_of_differences,
    z_value,
)
from decodelab.sampling_study.grid import setting_key

# --- verdict rows ----------------------------------------------------------------------------------


def paired(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Per-unit values of two settings on the units both ran: Series are aligned on their shared unit
    index; arrays must already be paired (same shape)."""
    if hasattr(a, "index") and hasattr(b, "index"):
        common = a.index.intersection(b.index)
        return a.loc[common].to_numpy(dtype=float), b.loc[common].to_numpy(dtype=float)
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"a.shape={a.shape} != b.shape={b.shape}: paired values need one value per unit in each")
    return a, b


def _finding(low: float, high: float) -> str:
    return "a > b" if low > 0 else "a < b" if high < 0 else "inconclusive"


def claim(text: str, a, b, *, key: dict | None = None, main: bool = False, unit: str = "points",
          target_half_width: float | None = None, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
          power: float = 0.8) -> dict:
    """A verdict row for "a > b" on paired per-unit values (Series aligned on shared units, or paired
    arrays): it holds only when the CI of mean(a - b) is above zero; `finding` says which way the
    evidence points, or "inconclusive".

    Row: claim, key (structured: what is compared), main, unit, estimate, lo, hi (percentile bootstrap
    over units), half_width ((hi - lo) / 2), n_units, sd_diff (sd of per-unit differences),
    normal_half_width (z * sd / sqrt(n) with the planning sd), mdd (the difference this many units
    detect with probability `power`, stats.minimum_detectable_difference), required_units (units for
    a half-width of target_half_width), finding, holds. For values in [0, 1] the MDD, normal_half_width
    and required_units use stats.planning_sd (at least one discordant unit's spread), so a sample
    with no observed disagreement never claims to resolve every difference."""
    a, b = paired(a, b)
    if len(a) == 0:
        raise ValueError(f"claim {text!r}: the two settings share no units")
    d = paired_bootstrap_diff(a, b, n_boot=n_boot, seed=seed, level=level)
    n, sd = len(a), sd_of_differences(a, b)
    bounded = bool(np.all((a >= 0) & (a <= 1)) and np.all((b >= 0) & (b <= 1)))
    plan = planning_sd(sd, n, bounded=bounded)
    row = _row(text, key, main, unit, d["difference"], d["ci_low"], d["ci_high"], n, sd,
               minimum_detectable_difference(plan, n, level=level, power=power),
               None if target_half_width is None or not math.isfinite(plan)
               else required_pairs(plan, target_half_width, level=level))
    row["normal_half_width"] = _float(z_value(level) * plan / math.sqrt(n)) if n >= 2 else None
    return row


def claim_from_diff(text: str, diff: dict, *, n_units: int, key: dict | None = None, main: bool = False,
                    unit: str = "", target_half_width: float | None = None, level: float = 0.95,
                    power: float = 0.8) -> dict:
    """A verdict row (as `claim`) from a {difference, ci_low, ci_high} dict whose claim is "difference
    > 0", e.g. a bootstrap of a frontier statistic: the MDD comes from the interval's width
    (stats.mdd_from_interval) and required_units scales n_units by (half_width / target)^2."""
    low, high = diff["ci_low"], diff["ci_high"]
    if not (math.isfinite(low) and math.isfinite(high)):
        return {**_row(text, key, main, unit, diff["difference"], None, None, n_units, None, None, None),
                "normal_half_width": None}
    half = (high - low) / 2
    needed = (None if target_half_width is None or half == 0
              else max(2, math.ceil(n_units * (half / target_half_width) ** 2 - 1e-9)))
    row = _row(text, key, main, unit, diff["difference"], low, high, n_units, None,
               mdd_from_interval(low, high, level=level, power=power), needed)
    row["normal_half_width"] = float(half)
    return row


def _row(text, key, main, unit, estimate, low, high, n, sd, mdd, needed) -> dict:
    finding = "not measured" if low is None else _finding(low, high)
    return {"claim": text, "key": dict(key or {}), "main": bool(main), "unit": unit,
            "estimate": _float(estimate), "lo": _float(low), "hi": _float(high),
            "half_width": None if low is None else float((high - low) / 2), "n_units": int(n),
            "sd_diff": _float(sd), "mdd": _float(mdd), "required_units": needed,
            "finding": finding, "holds": bool(low is not None and low > 0)}


def _float(value) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


# --- notebook 02's claims ------------------------------------------------------------------------------

PAPER_SETTINGS = (("min_p", 0.1), ("top_p", 0.9))  # the min-p paper's own pair of untuned settings


def accuracy_claims(tuned: dict, untuned: dict, *, temperatures, main_temperatures, order_settings: dict,
                    order_temperatures, n_boot: int = 2000, seed: int = 0,
                    target_half_width: float | None = None) -> list[dict]:
    """The accuracy verdict rows of notebook 02, in order: tuned min-p vs tuned top-p at each temperature
    (main at `main_temperatures`); the paper's settings (PAPER_SETTINGS) at each temperature above 1 where
    both ran; greedy vs tuned min-p and top-p at T = 1 (when 1 is a temperature); and for each
    {sampler: value} of `order_settings` at each of `order_temperatures`, truncation first vs temperature
    first.

    tuned: `tables.tuned_per_unit` of the frame ({(sampler, temperature, order): (per-unit Series, chosen)});
    untuned: `tables.per_unit_values` of it ({setting_key: per-unit Series})."""
    def per_unit(sampler, temperature, order="hf"):
        return tuned[(sampler, float(temperature), order)][0]

    options = dict(n_boot=n_boot, seed=seed, target_half_width=target_half_width)
    rows = [claim(f"tuned min-p beats tuned top-p on accuracy at T={t:g}", per_unit("min_p", t), per_unit("top_p", t),
                  key={"kind": "tuned", "a": "min_p", "b": "top_p", "temperature": t},
                  main=t in main_temperatures, **options)
            for t in temperatures]
    (name_a, value_a), (name_b, value_b) = PAPER_SETTINGS
    for t in temperatures:
        a, b = setting_key(name_a, value_a, t), setting_key(name_b, value_b, t)
        if t > 1 and a in untuned and b in untuned:
            rows.append(claim(
                f"untuned {name_a}={value_a:g} beats {name_b}={value_b:g} at T={t:g} (the min-p paper's settings)",
                untuned[a], untuned[b], main=t in main_temperatures, **options,
                key={"kind": "paper_settings", "a": f"{name_a}={value_a:g}", "b": f"{name_b}={value_b:g}",
                     "temperature": t}))
    if 1.0 in temperatures:
        rows += [claim(f"greedy beats tuned {name} at T=1", per_unit("greedy", 0.0), per_unit(name, 1.0),
                       key={"kind": "greedy", "a": "greedy", "b": name, "temperature": 1.0}, **options)
                 for name in ("min_p", "top_p")]
    for name, value in order_settings.items():
        for t in order_temperatures:
            rows.append(claim(
                f"{name}={value:g} at T={t:g}: truncating before temperature beats temperature first",
                untuned[setting_key(name, value, t, "truncate_first")], untuned[setting_key(name, value, t)],
                key={"kind": "order", "a": "truncate_first", "b": "hf", "sampler": name, "param": value,
                     "temperature": t}, **options))
    return rows


def writing_claims(per_prompt, pareto: dict, quality, *, n_units: int, x: str = "embedding_diversity",
                   n_boot: int = 1000, seed: int = 0) -> list[dict]:
    """Per quality column of `quality`: "min-p is better than top-p at matched diversity x", read off
    each sampler's Pareto frontier (`writing.matched_quality_diff` at the middle of the x-range both
    frontiers cover). Lower is better for judge_nll (the difference is flipped so that "> 0" still
    means min-p is better), higher for the others. pareto: {quality: `writing.frontiers`}."""
    from decodelab.sampling_study.writing import flip, matched_quality_diff, matched_target

    rows = []
    for q in quality:
        target = matched_target(pareto[q]["min_p"], pareto[q]["top_p"], x)
        d = matched_quality_diff(per_prompt, "min_p", "top_p", x, q, target, maximize_y=(q != "judge_nll"),
                                 n_boot=n_boot, seed=seed)
        d = flip(d) if q == "judge_nll" else d  # the claim is always "min-p is better": lower NLL
        sense = "lower judge NLL" if q == "judge_nll" else "higher coherence"
        at = f"{target:.3f}" if np.isfinite(target) else "(none: the frontiers do not overlap)"
        rows.append(claim_from_diff(
            f"min-p has {sense} than top-p at matched {x.replace('_', ' ')} {at}", d, n_units=n_units,
            key={"kind": "writing", "a": "min_p", "b": "top_p", "quality": q, "diversity": target}))
    return rows


# --- verdicts as text, generated from the rows ---------------------------------------------------------


def format_difference(value: float | None, unit: str = "") -> str:
    """A difference as a reader sees it: accuracy ("points") 0.083 -> "+8.3 points"; else "+0.083"."""
    if value is None:
        return "n/a"
    return f"{value * 100:+.1f} points" if unit == "points" else f"{value:+.3g}"


def _magnitude(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:.1f} points" if unit == "points" else f"{value:.3g}"


def verdict_text(row: dict) -> str:
    """One verdict row -> one sentence: the claim, estimate, 95% CI and finding; an inconclusive row
    also names its half-width and minimum detectable difference (what this sample could have seen)."""
    u = row.get("unit", "")
    if row["lo"] is None:
        return f"{row['claim']}: not measured (the interval could not be computed)."
    text = (f"{row['claim']}: {format_difference(row['estimate'], u)}, 95% CI [{format_difference(row['lo'], u)}, "
            f"{format_difference(row['hi'], u)}] over {row['n_units']} units")
    if row["finding"] == "a > b":
        return text + ": holds."
    if row["finding"] == "a < b":
        return text + ": the reverse holds."
    return text + (f": inconclusive (CI half-width {_magnitude(row['half_width'], u)}; minimum detectable "
                   f"difference {_magnitude(row['mdd'], u)})." if row["mdd"] is not None else ": inconclusive.")


def effective_half_width(row: dict) -> float | None:
    """How finely a verdict row resolves a difference: the larger of its bootstrap half-width and the
    normal-approximation one from the planning sd (a degenerate bootstrap of a few units reads 0)."""
    widths = [w for w in (row.get("half_width"), row.get("normal_half_width")) if w is not None]
    return max(widths) if widths else None


def verdict_summary(rows: list[dict], *, target_half_width: float | None = None) -> str:
    """A generated answer from the main verdict rows: how many hold, are reversed, are inconclusive
    (with their MDDs), and the widest CI half-width against its target."""
    main = [r for r in rows if r["main"]] or list(rows)
    if not main:
        return "No verdicts were computed."
    held = [r for r in main if r["finding"] == "a > b"]
    reversed_ = [r for r in main if r["finding"] == "a < b"]
    open_ = [r for r in main if r["finding"] == "inconclusive"]
    text = (f"Of {len(main)} main verdicts, {len(held)} hold, {len(reversed_)} are reversed "
            f"and {len(open_)} are inconclusive")
    if open_:
        mdds = [r["mdd"] for r in open_ if r["mdd"] is not None]
        if mdds:
            lo, hi = (_magnitude(v, open_[0]["unit"]) for v in (min(mdds), max(mdds)))
            text += f" (minimum detectable difference {lo})" if lo == hi else \
                f" (minimum detectable differences {lo} to {hi})"
    widths = [w for w in map(effective_half_width, main) if w is not None]
    if widths:
        text += f"; widest 95% CI half-width {_magnitude(max(widths), main[0]['unit'])}"
        if target_half_width is not None:
            text += f" (target <= {_magnitude(target_half_width, main[0]['unit'])}: " \
                    f"{'met' if max(widths) <= target_half_width else 'not met'})"
    return text + "."


def verdict_table(rows: list[dict]):
    """Verdict rows -> a display table: claim, main, estimate, CI, finding, MDD (inconclusive rows only),
    units used and units needed for the half-width target."""
    import pandas as pd

    return pd.DataFrame([{
        "claim": r["claim"], "main": "yes" if r["main"] else "",
        "estimate": format_difference(r["estimate"], r["unit"]),
        "95% CI": "n/a" if r["lo"] is None else
        f"[{format_difference(r['lo'], r['unit'])}, {format_difference(r['hi'], r['unit'])}]",
        "finding": r["finding"],
        "MDD": _magnitude(r["mdd"], r["unit"]) if r["finding"] == "inconclusive" else "",
        "units": r["n_units"], "units for target": r["required_units"],
    } for r in rows])
