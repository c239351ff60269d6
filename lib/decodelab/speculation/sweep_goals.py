"""Notebook 01's goal rows and generated sentences, from the method sweep's rows (`bench.run_methods`), the
transformers side by side (`bench.hf_side_by_side`) and the roofline's validation."""
from __future__ import annotations

from decodelab.speculation.bench import K0_TRIM
from decodelab.speculation.speedup_stats import SPIKE

# The notebook's stated goals: name -> (op, target). Targets are defined once, here.
GOAL_TARGETS = {
    "ngram_speedup_b1_code": (">=", 1.7),
    "ngram_ours_over_hf_prompt_lookup": (">=", 1.0),
    "adaptive_vs_plain_at_largest_batch": (">=", 0.97),
    "adaptive_fraction_of_best_fixed_k_b1": (">=", 0.8),
    "roofline_heldout_error": ("<=", 0.15),
    "adaptive_vs_plain_every_batch": (">=", 0.98),  # judged on the worst batch's lower CI bound
    "adaptive_fraction_of_best_fixed_k_every_batch": (">=", 0.95),
    "k0_overhead": ("<=", 0.01),
}


def best_speedup(rows: list[dict], drafter: str, batch: int, k=None) -> float | None:
    """The best fixed-k speedup of `drafter` at `batch` (k=None), or that of the cell with k (e.g.
    "adaptive"); None when the sweep has no such cell."""
    cells = [r["speedup"] for r in rows if r["drafter"] == drafter and r["batch"] == batch
             and (r["k"] != "adaptive" if k is None else r["k"] == k)]
    return float(max(cells)) if cells else None


def hf_ratio(hf_rows: list[dict], num=("ours", "ngram"), den=("hf", "ngram")) -> float | None:
    """Mean tokens/s of (impl, method) `num` over that of `den` in `hf_side_by_side` rows (None: none)."""
    def mean(impl, method):
        v = [r["tokens_per_s"] for r in hf_rows if r["impl"] == impl and r["method"] == method]
        return sum(v) / len(v) if v else None

    a, b = mean(*num), mean(*den)
    return a / b if a is not None and b else None


def speculation_goals(rows: list[dict], *, drafters, grid_category: str, hf_rows: list[dict] = (),
                      heldout_error: float | None = None, insample_error: float | None = None,
                      n_heldout: int = 0, k0: dict | None = None) -> list:
    """Notebook 01's goals as `decodelab.common.goals.Goal` rows from the sweep rows (run_methods' rows), the
    transformers side by side and the roofline's held-out error. A goal the run could not measure
    (no batch 1, not code editing, transformers off, adaptive off, no held-out cell) has value None."""
    from decodelab.common.goals import Goal

    def goal(name, value, **kw):
        op, target = GOAL_TARGETS[name.split(":")[0]]
        return Goal.check(name.replace(":", "_"), value, op, target, **kw)

    batches = sorted({r["batch"] for r in rows})
    on_code = grid_category == "code_edit" and 1 in batches
    out = [goal("ngram_speedup_b1_code", best_speedup(rows, "ngram", 1) if on_code else None, unit="x",
                label="n-gram speedup at batch 1 on code editing (best fixed k)",
                note="" if on_code
                else f"needs grid_category 'code_edit' and batch 1 (got {grid_category!r}, {batches})"),
           goal("ngram_ours_over_hf_prompt_lookup", hf_ratio(list(hf_rows)), unit="x",
                label="our n-gram vs transformers' prompt lookup at batch 1 (tokens/s ratio)",
                note="" if hf_rows else "the transformers side by side did not run (hf_compare off)")]
    for d in drafters:
        swept = sorted({r["batch"] for r in rows if r["drafter"] == d and r["k"] == "adaptive"})
        top, low = (swept[-1], swept[0]) if swept else (None, None)
        why = "" if swept else "the adaptive policy did not run (adaptive off)"
        note = why or ("" if top == max(batches)
                       else f"largest batch this drafter was swept at (sweep: {max(batches)})")
        out.append(goal(f"adaptive_vs_plain_at_largest_batch:{d}",
                        best_speedup(rows, d, top, "adaptive") if swept else None, unit="x",
                        label=f"adaptive policy ({d}) vs plain decoding at batch {top}", note=note))
        best, adaptive = (best_speedup(rows, d, low), best_speedup(rows, d, low, "adaptive")) if swept else (None, None)
        out.append(goal(f"adaptive_fraction_of_best_fixed_k_b1:{d}",
                        adaptive / best if low == 1 and best and adaptive is not None else None, unit="%",
                        label=f"adaptive policy ({d}) as a fraction of the best fixed k at batch 1",
                        note=why or ("" if low == 1 else f"the sweep has no batch 1 (smallest: {low})")))
    out += never_loses_goals(rows, drafters=drafters, goal=goal)
    out.append(goal("k0_overhead", None if k0 is None else k0["overhead"], unit="%",
                    label="all-k=0 speculative decode time over engine.generate's (same prompts)",
                    note="the k=0 benchmark did not run" if k0 is None
                    else f"batch {k0['batch']}, {k0['repeats']} rounds stepped side by side: paired per-step log "
                    f"ratios, {K0_TRIM:.0%} trimmed at each tail (geometric mean of the paired rounds: "
                    f"{k0['overhead_rounds']:+.2%})"))
    insample = "n/a" if insample_error is None else f"{insample_error:.0%}"
    out.append(goal("roofline_heldout_error", heldout_error, unit="%",
                    label="roofline median relative error on held-out cells",
                    note=f"{n_heldout} held-out cells; in-sample error {insample} (a metric, not a goal)"
                    + ("" if heldout_error is not None else "; no held-out cell could be predicted")))
    return out


def never_loses_goals(rows: list[dict], *, drafters, goal) -> list:
    """Per drafter: the adaptive policy's worst lower CI bound over the swept batches (vs plain) and its
    worst fraction of the best fixed k (point estimates) over the batches that have a fixed-k cell."""
    out = []
    for d in drafters:
        cells = sorted((r for r in rows if r["drafter"] == d and r["k"] == "adaptive"), key=lambda r: r["batch"])
        bounded = [r for r in cells if r.get("speedup_low") is not None]
        worst = min(bounded, key=lambda r: r["speedup_low"]) if bounded else None
        out.append(goal(f"adaptive_vs_plain_every_batch:{d}", None if worst is None else worst["speedup_low"],
                        unit="x", label=f"adaptive policy ({d}) vs plain, lower 95% bound at its worst batch",
                        note=("the adaptive policy did not run" if not cells
                              else "no interval: the sweep needs >= 2 timing rounds (sweep_repeats)" if worst is None
                              else f"worst batch {worst['batch']} of {[r['batch'] for r in cells]}; paired by "
                                   f"{worst['repeats']} interleaved rounds, noise pooled over the batch's runs of "
                                   f"like length, {worst.get('capped_steps', 0)} interrupted steps of its runs "
                                   "capped")))
        fractions = [(r["speedup"] / b, r["batch"]) for r in cells
                     if (b := best_speedup(rows, d, r["batch"])) is not None and b > 0]
        low = min(fractions) if fractions else None
        out.append(goal(f"adaptive_fraction_of_best_fixed_k_every_batch:{d}", None if low is None else low[0],
                        unit="%", label=f"adaptive policy ({d}) as a fraction of the best fixed k, worst batch",
                        note="no batch with both adaptive and fixed-k cells" if low is None
                        else f"worst batch {low[1]}"))
    return out


def trend_sentences(best_rows: list[dict]) -> list[str]:
    """One generated sentence per drafter on how its best fixed-k speedup moves with batch, from rows
    {drafter, batch, speedup} (one per drafter and batch)."""
    out = []
    for d in dict.fromkeys(r["drafter"] for r in best_rows):
        pts = sorted((r["batch"], float(r["speedup"])) for r in best_rows if r["drafter"] == d)
        s = [v for _, v in pts]
        above = [b for b, v in pts if v > 1.0]
        where = f"above plain (> 1x) at batch {', '.join(map(str, above))}" if above else "never above plain"
        if len(pts) < 2:
            out.append(f"{d}: measured at batch {pts[0][0]} only ({s[0]:.2f}x, {where}); no trend with batch.")
            continue
        trend = ("falls at every larger batch" if all(b < a for a, b in zip(s, s[1:]))
                 else "rises at every larger batch" if all(b > a for a, b in zip(s, s[1:]))
                 else "does not move monotonically with batch")
        out.append(f"{d}: best fixed-k speedup {s[0]:.2f}x at batch {pts[0][0]}, {s[-1]:.2f}x at batch {pts[-1][0]}; "
                   f"it {trend}; {where}.")
    return out


def noise_sentence(rows: list[dict]) -> str:
    """One generated sentence on the measurement's noise floor: plain decoding against itself (the A/A
    pair of `run_methods`) per batch, from the sweep rows; says so when there were too few rounds."""
    plain = sorted((r for r in rows if r["drafter"] == "plain"), key=lambda r: r["batch"])
    bounded = [r for r in plain if r.get("speedup_low") is not None]
    if not bounded:
        rounds = plain[0]["repeats"] if plain else 0
        return (f"No speedup intervals: the sweep ran {rounds} timing round(s) per batch; an interval over rounds "
                "needs at least 2.")
    cells = ", ".join(f"batch {r['batch']} [{r['speedup_low']:.3f}, {r['speedup_high']:.3f}]" for r in bounded)
    capped = sum(r.get("capped_steps", 0) for r in rows)
    return (f"Noise floor: plain decoding against itself (A/A, {bounded[0]['repeats']} interleaved rounds, noise "
            f"pooled over the batch's runs of like length) gives 95% intervals {cells}; a method as long as plain gets "
            "sqrt(3/4) of that width, its reference being the mean of plain's two runs per round. Steps taking more "
            f"than {1 + SPIKE:.2f}x their median over the rounds were capped there before the rounds were summed "
            f"(interrupted: {capped} steps over the sweep's runs).")
