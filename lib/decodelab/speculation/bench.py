"""Experiments around `decodelab.speculation.decode`: workloads, step-time calibration, the method grid,
transformers side by side, and notebook 01's goal rows and generated sentences. Notebook 01 calls
these; the decoding itself lives in `decodelab.speculation.decode`.

Timing on a shared machine is noisy (other processes steal whole time slices), and noise only ever
adds time. So every measurement here repeats and keeps the *minimum*, and runs being compared are
interleaved (plain, A, B, plain, A, B, ...) so a burst of background load hits every method alike.
"""
from __future__ import annotations

import numpy as np
import torch

from decodelab.common.timing import timed
from decodelab.core.engine import as_transformer, verify_step
from decodelab.speculation.decode import SpecStats, generate, prefill
from decodelab.speculation.speedup_stats import pooled_speedup_intervals, round_rates


@torch.inference_mode()
def measure_step_times(model, batch_sizes, n_tokens=(1, 2, 3, 5, 9), *, context: int = 256, repeats: int = 5,
                       max_tokens: int = 0, layers=None, progress: bool = False) -> list[dict]:
    """Time forward steps of n tokens per row at each batch size with `context` cached positions.
    max_tokens > 0 skips points with batch * n > max(max_tokens, 2 * batch) (n = 1, 2 always run).

    Repeats are interleaved over the n of one batch (n=1, 2, 3, ..., n=1, 2, 3, ...) and each point keeps
    the minimum: background load only adds time, so the minimum is the machine's own step time, and
    interleaving keeps a burst of load from landing on one n only. The cache is filled by advancing its
    lengths over zeros (which cost the same as real keys), so no prefill is paid; each step is rolled back.
    -> rows {batch, n_tokens, context, seconds (min of repeats), seconds_median}.
    """
    import statistics

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    tr = as_transformer(model)
    n_layers = None if layers is None else len(layers)
    batches = list(batch_sizes)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="calibrate", leave=False)
    rows = []
    for b in batches:
        ns = [n for n in n_tokens if not max_tokens or b * n <= max(max_tokens, 2 * b)]
        cache = tr.new_cache(b, context + max(n_tokens) + 1, n_layers=n_layers)
        base = torch.full((b,), context, dtype=torch.long, device=tr.device)
        cache.advance(base)
        tokens = {}
        for n in ns:
            gen = torch.Generator(device=tr.device).manual_seed(b * 100 + n)
            tokens[n] = torch.randint(3, tr.vocab_size, (b, n), device=tr.device, generator=gen)
        times = {n: [] for n in ns}
        for rep in range(repeats + 1):  # round 0 warms up
            for n in ns:
                cache.truncate(base)
                _, seconds = timed(lambda n=n: verify_step(tr, cache, tokens[n], layers=layers), tr.device)
                if rep:
                    times[n].append(seconds)
        rows += [{"batch": b, "n_tokens": n, "context": context, "seconds": min(times[n]),
                  "seconds_median": statistics.median(times[n])} for n in ns]
    return rows


def _row(stats: SpecStats, **labels) -> dict:
    d = stats.as_dict()
    steps_with_drafts = [k for k in stats.step_k if k > 0]
    d["draft_s_per_token"] = d["draft_s"] / sum(steps_with_drafts) if steps_with_drafts else 0.0
    d["acceptance"] = stats.acceptance_per_position
    d["context"] = stats.prompt_tokens / stats.batch_size + stats.new_tokens / stats.batch_size / 2
    return {**labels, **d}


WARMUP_TOKENS = 4  # new tokens of the untimed plain decode that warms a sweep's shared prefill up


def run_methods(model, prompts: list[list[int]], methods: list[tuple], *, max_new_tokens: int, sampler=None,
                seed: int = 0, eos_token_ids=None, repeats: int = 1, prefilled=None, warmup: bool = True,
                aa_check: bool = True) -> list[dict]:
    """Run plain decoding and each method on one shared prefill of `prompts`, `repeats` interleaved rounds.
    prefilled: a `decode.prefill` of these prompts to share (e.g. with `k0_overhead`), None = prefill here.

    methods: (drafter_name, make_drafter() -> Drafter, k: int or make_policy(batch) -> AdaptivePolicy).
    warmup: an untimed plain decode of WARMUP_TOKENS first (the first decode after a prefill runs on cold
    caches and allocator state: with one round and plain always first, plain was the slow outlier).
    Each round then runs plain, method 1, method 2, ... (and, with aa_check, plain a second time) in turn,
    the order rotated by one per round, so no run always comes first. Each method keeps its fastest round
    (least decode time: background load only slows a run down); `speedup` = its decode tokens/s over
    plain's fastest round's.
    The interval (`speedup_stats.pooled_speedup_intervals`) pairs a method's run with plain's run of the
    same round, one wall clock per run, its noise scale pooled over the batch's runs; it needs repeats >= 2
    (else None). aa_check: plain's second run per
    round gives plain's own row the interval of plain vs itself (an A/A check: it should cover 1 and be
    narrow; its width is the noise floor of every other interval).
    -> one row per method (+ "plain" first) with SpecStats fields of that round, `speedup`, `speedup_low`,
    `speedup_high`, `round_speedups` (the paired per-round ratios), `repeats`, and `tokens` (new tokens
    per row, to check greedy equality; identical across rounds when greedy).
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    pre = prefilled if prefilled is not None else prefill(model, prompts, max_new_tokens=max_new_tokens)
    B = len(prompts)

    def one(drafter, k, n_new=max_new_tokens):
        gen = torch.Generator(device=as_transformer(model).device).manual_seed(seed)
        return generate(model, drafter=drafter, k=k, max_new_tokens=n_new, sampler=sampler,
                        generator=gen, eos_token_ids=eos_token_ids, prefilled=pre)

    runs = [("plain", lambda: None, 0)] + list(methods) + ([("plain", lambda: None, 0)] if aa_check else [])
    if warmup:  # a few steps suffice: what is cold is the first forwards after the prefill, not the length
        one(None, 0, min(WARMUP_TOKENS, max_new_tokens))
    best: list = [None] * len(runs)
    rounds: list[list[tuple]] = [[] for _ in runs]  # per run: (step_tokens, step_s) of every round
    for rnd in range(repeats):
        # rotate the order each round so no method always runs first after the prefill (or after another)
        for i in [(rnd + j) % len(runs) for j in range(len(runs))]:
            _, make, k = runs[i]
            res = one(make(), k(B) if callable(k) else k)
            rounds[i].append((res.stats.step_tokens, res.stats.step_s))
            if best[i] is None or res.stats.decode_s < best[i].stats.decode_s:
                best[i] = res
    plain_tps = best[0].stats.decode_tokens_per_s
    plain_rates = round_rates(rounds[0])
    # plain's own row pairs plain with its A/A twin; the noise scale is pooled over every pair of the batch
    paired_rounds = [rounds[-1] if aa_check else rounds[0]] + rounds[1:len(runs) - int(aa_check)]
    intervals = pooled_speedup_intervals(rounds[0], paired_rounds if aa_check else paired_rounds[1:])
    if not aa_check:  # plain against itself is exactly 1: no interval of its own
        intervals = [(None, None)] + intervals
    out = []
    listed = runs[:-1] if aa_check else runs
    for (name, _, k), res, paired, (low, high) in zip(listed, best, paired_rounds, intervals):
        out.append(_row(res.stats, batch=B, drafter=name, k="adaptive" if callable(k) else k, repeats=repeats,
                        speedup=res.stats.decode_tokens_per_s / plain_tps, speedup_low=low, speedup_high=high,
                        round_speedups=(round_rates(paired) / plain_rates).tolist(), row_k=res.stats.row_k,
                        tokens=res.tokens))
    return out


def stepwise_min_seconds(step_times: list[list[float]]) -> float:
    """Runs of the same steps (each a list of per-step seconds) -> the sum over steps of the fastest run's
    time at that step. Raises if the runs took different numbers of steps (they did not decode alike)."""
    lengths = {len(times) for times in step_times}
    if len(lengths) != 1:
        raise ValueError(f"runs took different numbers of steps {sorted(lengths)}: they are not the same decode")
    return float(np.min(np.asarray(step_times, dtype=float), axis=0).sum())


@torch.inference_mode()
def k0_overhead(model, prompts: list[list[int]], make_drafter, make_policy, *, max_new_tokens: int,
                repeats: int = 3, eos_token_ids=None, prefilled=None) -> dict:
    """What a speculative run whose policy chooses k = 0 at every step costs over `engine.generate`.

    make_policy(batch) -> a policy that decides every step (its decision time is inside the step clock)
    and chooses k = 0 (e.g. a RowBudgetPolicy on a step-time model where speculation never pays); the
    drafter keeps its state. Both decode the same prompts from the same prefilled cache (truncated back to
    the prompts before each run: the same memory, so the two forwards read identical tensors), greedy,
    `repeats` interleaved rounds (order alternating). The prefill is not timed.

    The cost of each side is the sum over steps of that step's fastest time across the rounds: step i reads
    the same context on both sides (k = 0 advances every row one token a step), and background load only adds
    time, so the per-step minimum discards a burst that hit one step of one round instead of the whole run
    (a 1% question on a machine whose whole-run times wander by 5-10%). The whole-run fastest decode is
    reported beside it (`overhead_whole_run`). prefilled: a `decode.prefill` of these prompts to reuse (the
    sweep's), None = prefill here. -> {overhead: k0_s / plain_s - 1, plain_s, k0_s (per-step minima summed),
    overhead_whole_run, repeats, steps, nonzero_k_steps (must be 0), same_tokens, policy_s (the k0 run's own
    decision seconds)}.
    """
    from decodelab.core import engine

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    pre = prefilled if prefilled is not None else prefill(model, prompts, max_new_tokens=max_new_tokens)
    runs: dict[int, list] = {0: [], 1: []}
    for rnd in range(repeats):
        for which in ((0, 1) if rnd % 2 == 0 else (1, 0)):
            if which == 0:
                pre.cache.truncate(pre.prompt_lengths.clone())
                runs[0].append(engine.generate(model, prompts, max_new_tokens=max_new_tokens,
                                               eos_token_ids=eos_token_ids, prefilled=(pre.cache, pre.last_logits)))
            else:
                runs[1].append(generate(model, drafter=make_drafter(), k=make_policy(len(prompts)), prefilled=pre,
                                        max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids))
    plain_s, k0_s = (stepwise_min_seconds([r.stats.step_s for r in runs[side]]) for side in (0, 1))
    plain_best, spec_best = (min(runs[side], key=lambda r: r.stats.decode_s) for side in (0, 1))
    return {"batch": len(prompts), "overhead": k0_s / plain_s - 1.0, "plain_s": plain_s, "k0_s": k0_s,
            "overhead_whole_run": spec_best.stats.decode_s / plain_best.stats.decode_s - 1.0,
            "repeats": repeats, "steps": len(spec_best.stats.step_k),
            "nonzero_k_steps": sum(k > 0 for r in runs[1] for k in r.stats.step_k),
            "same_tokens": all(r.tokens == runs[0][0].tokens for r in runs[0] + runs[1]),
            "policy_s": sum(spec_best.stats.policy_s)}


def greedy_match(model, prompts: list[list[int]], drafters: dict, *, ks=(1, 4), max_new_tokens: int = 16) -> dict:
    """{drafter: bool}: greedy speculative output == plain greedy (engine.generate), token for token."""
    from decodelab.core.engine import generate as plain_generate

    ref = plain_generate(model, prompts, max_new_tokens=max_new_tokens).tokens
    return {name: all(generate(model, prompts, make(), k=k, max_new_tokens=max_new_tokens).tokens == ref for k in ks)
            for name, make in drafters.items()}


HF_NGRAM_SIZE = 2  # transformers' prompt lookup default (`max_matching_ngram_size`): ours matches it here


def hf_side_by_side(model, prompts: list[list[int]], *, k: int, max_new_tokens: int, draft=None,
                    repeats: int = 1, ngram_size: int = HF_NGRAM_SIZE) -> list[dict]:
    """Batch 1, greedy: transformers plain / prompt lookup / assisted generation next to ours.

    Both sides draft up to k tokens and match n-grams of at most `ngram_size` tokens (transformers'
    `max_matching_ngram_size`) and copy after the n-gram's earliest occurrence. Each side does its own
    prefill inside the timed region. The runs of one
    prompt are interleaved over `repeats` rounds (hf plain, hf ngram, ..., ours plain, ours ngram, ...)
    and each keeps its fastest round.
    -> rows {impl, method, prompt, tokens_per_s (prefill included), seconds, new_tokens, same_as_plain}.
    draft: a LoadedModel for `assistant_model=` and our ModelDrafter (None: skip that pair).
    """
    from decodelab.speculation.drafters import ModelDrafter, NGramDrafter

    hf, device = model.hf_model, model.device
    rows = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        hf_runs = {"plain": {}, "ngram": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": ngram_size}}
        if draft is not None:
            # constant k and no confidence cut-off: the same algorithm as ours (transformers' defaults adapt k)
            hf_runs["draft_model"] = {"assistant_model": draft.hf_model, "num_assistant_tokens": k,
                                      "num_assistant_tokens_schedule": "constant",
                                      "assistant_confidence_threshold": 0.0}
        ours = {"plain": (lambda: None, 0), "ngram": (lambda: NGramDrafter(max_ngram=ngram_size, match="earliest"), k)}
        if draft is not None:
            ours["draft_model"] = (lambda: ModelDrafter(draft, model), k)

        def run_hf(extra):
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=model.eos_token_ids,
                                  pad_token_id=model.tokenizer.pad_token_id, **extra)
            return out[0, len(prompt):].tolist()

        def run_ours(make, kk):
            return generate(model, [prompt], make(), k=kk, max_new_tokens=max_new_tokens).tokens[0]

        calls = [("hf", m, lambda e=e: run_hf(e)) for m, e in hf_runs.items()]
        calls += [("ours", m, lambda mk=mk, kk=kk: run_ours(mk, kk)) for m, (mk, kk) in ours.items()]
        best: dict = {}
        for _ in range(repeats):
            for impl, method, call in calls:
                new, seconds = timed(call, device)
                if (impl, method) not in best or seconds < best[impl, method][0]:
                    best[impl, method] = (seconds, new)
        ref = best["hf", "plain"][1]
        for (impl, method), (seconds, new) in best.items():
            rows.append({"impl": impl, "method": method, "prompt": i, "tokens_per_s": len(new) / seconds,
                         "seconds": seconds, "new_tokens": len(new), "same_as_plain": new == ref})
    return rows


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
                    else f"batch {k0['batch']}, fastest of {k0['repeats']} interleaved rounds each"))
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
                                   f"{worst['repeats']} interleaved rounds, noise pooled over the batch's runs")))
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
    return (f"Noise floor: plain decoding against itself (A/A, {bounded[0]['repeats']} interleaved rounds, noise "
            f"pooled over every run of the batch) gives 95% intervals {cells}; a method's interval is as wide.")
