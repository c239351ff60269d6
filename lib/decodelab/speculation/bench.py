"""Experiments around `decodelab.speculation.decode`: workloads, step-time calibration, the method grid,
and transformers side by side (notebook 01's goal rows and generated sentences: `sweep_goals`). Notebook
01 calls these; the decoding itself lives in `decodelab.speculation.decode`.

Timing on a shared machine is noisy (other processes steal whole time slices), and noise only ever
adds time. So every measurement here repeats and keeps the *minimum*, and runs being compared are
interleaved (step by step within a round, in a fresh seeded order each round) so drift hits every method alike.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from decodelab.common.timing import timed
from decodelab.core.engine import as_transformer, drive, side_by_side, verify_step  # noqa: F401  (bench.side_by_side)
from decodelab.speculation.decode import Prefilled, SpecStats, generate, generate_steps, prefill
from decodelab.speculation.speedup_stats import cap_interruptions, pooled_speedup_intervals, round_rates


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


def rounds_by_batch(table: dict, batch_sizes: list[int], default: int, *,
                    name: str = "sweep_repeats_by_batch") -> dict[int, int]:
    """{batch: rounds} for every batch of the sweep: `table`'s rounds where it names the batch, else `default`.
    Keys may be strings of digits (a parameter's dict keys arrive so through papermill's JSON); a key that is
    not one of `batch_sizes` raises ValueError naming the parameter (`name`) and the allowed batches, before
    any work."""
    given = {int(b) if str(b).isdigit() else b: r for b, r in table.items()}
    unknown = sorted(set(given) - set(batch_sizes), key=str)
    if unknown:
        raise ValueError(f"{name}={table!r}: keys {unknown} are not in batch_sizes; "
                         f"allowed: {list(batch_sizes)}")
    return {b: given.get(b, default) for b in batch_sizes}


def run_methods(model, prompts: list[list[int]], methods: list[tuple], *, max_new_tokens: int, sampler=None,
                seed: int = 0, eos_token_ids=None, repeats: int = 1, prefilled=None, warmup: bool = True,
                aa_check: bool = True) -> list[dict]:
    """Run plain decoding and each method on copies of one prefill of `prompts`, `repeats` rounds, the runs of
    a round stepped side by side. prefilled: a `decode.prefill` of these prompts (None = prefill here).

    methods: (drafter_name, make_drafter() -> Drafter, k: int or make_policy(batch) -> AdaptivePolicy); the
    runs of a round are alive at once, so make_drafter must return a drafter no other method uses.
    Step interleaving: in a round every run advances one step in turn (plain, method 1, method 2, ... and,
    with aa_check, plain a second time; in a seeded random order drawn afresh each round, so no run always
    steps first or always after the same neighbour), each timed by its own clock
    (the sum of its step seconds). On a shared machine whole runs drift by 5-10% against each other from one
    run to the next (frequency, neighbours); side by side, that drift lands on every method's steps alike and
    cancels in their ratios, where back-to-back runs of several seconds each kept it. A run that ends first
    stops stepping; the others go on. warmup: an untimed plain decode of WARMUP_TOKENS first (cold caches).
    Each method keeps its fastest round (least decode time); `speedup` = its decode tokens/s over plain's
    fastest round's. The interval (`speedup_stats.pooled_speedup_intervals`) pairs a method's run with plain's
    run of the same round, its noise scale pooled over the batch's runs; it needs repeats >= 2 (else None).
    Intervals and round ratios read the rounds with interrupted steps capped (`speedup_stats.cap_interruptions`,
    every run alike; `capped_steps` counts them per row); the fastest round is as measured.
    aa_check: plain's second run per round gives plain's own row the interval of plain vs itself (an A/A
    check: it should cover 1 and be narrow; its width is the noise floor), and joins plain's first run as
    each round's reference for the methods' intervals (both are plain: their mean is a better reference
    than either; a method's interval is then sqrt(3/4) of the A/A's width at the same noise).
    -> one row per method (+ "plain" first) with SpecStats fields of that round, `speedup`, `speedup_low`,
    `speedup_high`, `round_speedups` (the paired per-round ratios: plain's row its twin over plain, a
    method's over the round's reference), `repeats`, `capped_steps`, and `tokens` (new tokens
    per row, to check greedy equality; identical across rounds when greedy).
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    pre = prefilled if prefilled is not None else prefill(model, prompts, max_new_tokens=max_new_tokens)
    B = len(prompts)
    runs = [("plain", lambda: None, 0)] + list(methods) + ([("plain", lambda: None, 0)] if aa_check else [])
    copies = [own_cache(pre) for _ in runs]  # runs alive at once cannot share one cache (`own_cache`)

    def steps(i, drafter, n_new=max_new_tokens, rnd=0):
        gen = torch.Generator(device=as_transformer(model).device).manual_seed(seed)
        k = runs[i][2]
        return generate_steps(model, drafter=drafter, k=k(B) if callable(k) else k, max_new_tokens=n_new,
                              sampler=sampler, generator=gen, eos_token_ids=eos_token_ids,
                              prefilled=copies[(i + rnd) % len(copies)])

    if warmup:  # a few steps suffice: what is cold is the first forwards after the prefill, not the length
        drive(steps(0, None, min(WARMUP_TOKENS, max_new_tokens)))
    best: list = [None] * len(runs)
    rounds: list[list[tuple]] = [[] for _ in runs]  # per run: (step_tokens, step_s) of every round
    for rnd in range(repeats):
        # a fixed cyclic order (even rotated) keeps each run's neighbour, whose cache footprint its steps meet
        order = torch.randperm(len(runs), generator=torch.Generator().manual_seed(seed * 7919 + rnd)).tolist()
        drafters = {i: runs[i][1]() for i in order}
        shared = [i for i in order if drafters[i] is not None
                  and any(drafters[j] is drafters[i] for j in order if j != i)]
        if shared:
            raise ValueError(f"methods {sorted({runs[i][0] for i in shared})} got one drafter object for several "
                             "runs: run_methods steps a round's runs side by side, so each method's make_drafter "
                             "must return its own drafter")
        for i, res in side_by_side({i: steps(i, drafters[i], rnd=rnd) for i in order}).items():
            rounds[i].append((res.stats.step_tokens, res.stats.step_s))
            if best[i] is None or res.stats.decode_s < best[i].stats.decode_s:
                best[i] = res
    plain_tps = best[0].stats.decode_tokens_per_s
    rounds, capped = map(list, zip(*(cap_interruptions(r) for r in rounds)))
    plain_rates = round_rates(rounds[0])
    # the methods' per-round reference, as in their intervals: plain's rate, or its geometric mean with the twin's
    reference = np.sqrt(plain_rates * round_rates(rounds[-1])) if aa_check else plain_rates
    methods_rounds = rounds[1:len(runs) - int(aa_check)]
    twins = [rounds[-1]] if aa_check else []
    intervals = pooled_speedup_intervals(rounds[0], methods_rounds, plain_twins=twins)
    # plain's own row: plain against its A/A twin, two single runs (without the twin plain vs itself is 1)
    aa = pooled_speedup_intervals(rounds[0], twins + methods_rounds)[0] if aa_check else (None, None)
    intervals = [aa] + intervals
    paired_rounds = [rounds[-1] if aa_check else rounds[0]] + methods_rounds
    out = []
    listed = runs[:-1] if aa_check else runs
    for i, ((name, _, k), res, paired, (low, high)) in enumerate(zip(listed, best, paired_rounds, intervals)):
        out.append(_row(res.stats, batch=B, drafter=name, k="adaptive" if callable(k) else k, repeats=repeats,
                        speedup=res.stats.decode_tokens_per_s / plain_tps, speedup_low=low, speedup_high=high,
                        round_speedups=(round_rates(paired) / (reference if i else plain_rates)).tolist(),
                        capped_steps=capped[i] + (capped[-1] if i == 0 and aa_check else 0),
                        row_k=res.stats.row_k, tokens=res.tokens))
    return out


def own_cache(pre: Prefilled) -> Prefilled:
    """`pre` with a copy of its KV cache: the same prompts and logits, a cache no other run writes to.

    Where a compared run's KV cache lies in memory changes its speed: measured quiet here at batch 4,
    alternating, a decode on the prefill's own cache ran ~0.8% faster than on a copy of it (same layout and
    alignment), and two copies differed by up to ~1.3% in either direction, persistently over rounds. An
    offset that stays with a method is a bias no number of rounds averages out, so every compared run
    decodes on a copy (plain too) and the copies rotate between the runs from round to round: placement then
    varies like any other round-to-round noise, which the intervals capture."""
    return dataclasses.replace(pre, cache=pre.cache.copy())


def stepwise_min_seconds(step_times: list[list[float]]) -> float:
    """Runs of the same steps (each a list of per-step seconds) -> the sum over steps of the fastest run's
    time at that step. Raises if the runs took different numbers of steps (they did not decode alike)."""
    lengths = {len(times) for times in step_times}
    if len(lengths) != 1:
        raise ValueError(f"runs took different numbers of steps {sorted(lengths)}: they are not the same decode")
    return float(np.min(np.asarray(step_times, dtype=float), axis=0).sum())


K0_TRIM = 0.1  # the share of paired steps dropped at each tail of the k = 0 benchmark's log ratios


def paired_step_overhead(plain_steps, other_steps, trim: float = K0_TRIM) -> float:
    """(rounds, steps) seconds of two decodes stepped side by side (step i of one beside step i of the other)
    -> exp(mean of log(other / plain) over all paired steps, `trim` of them cut at each tail) - 1.

    A per-step ratio of two steps taken tens of ms apart cancels the machine's drift; trimming both tails
    alike drops the steps an interruption slowed on one side (either side) without favouring either."""
    plain_steps, other_steps = np.asarray(plain_steps, dtype=float), np.asarray(other_steps, dtype=float)
    if plain_steps.shape != other_steps.shape or plain_steps.size == 0:
        raise ValueError(f"paired steps need one shape, got {plain_steps.shape} and {other_steps.shape}")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim={trim!r} must be in [0, 0.5)")
    from scipy.stats import trim_mean

    return float(np.exp(trim_mean(np.log(other_steps / plain_steps).ravel(), trim))) - 1.0


@torch.inference_mode()
def k0_overhead(model, prompts: list[list[int]], make_drafter, make_policy, *, max_new_tokens: int,
                repeats: int = 3, eos_token_ids=None, prefilled=None) -> dict:
    """What a speculative run whose policy chooses k = 0 at every step costs over `engine.generate`.

    make_policy(batch) -> a policy that decides every step (its decision time is inside the step clock)
    and chooses k = 0 (e.g. a RowBudgetPolicy on a step-time model where speculation never pays); the
    drafter keeps its state. Both decode the same prompts from copies of one prefilled cache, greedy,
    `repeats` rounds, stepped side by side within a round (`side_by_side`, which of the two steps first
    alternating by round), so the machine's drift lands on both alike. The prefill is not timed.

    `overhead` is `paired_step_overhead` over every step of every round: the k0 step against the plain step
    taken right beside it (tens of ms apart), log ratios trimmed by `K0_TRIM` at each tail, so a step that a
    thread wake-up or page fault slowed by 10-30% on one side only does not decide a 1% question. It was
    chosen before the run of record from its spread: six repeats of 8 batch-1 rounds in one process read
    +0.36% +- 0.06% (sd) this way, against +- 0.14% for the geometric mean of the 8 paired round ratios
    (reported as `overhead_rounds`), and in the notebook those round ratios spread -3.6% to +7.8% within one
    run. A cost the k0 side pays on fewer than `K0_TRIM` of its steps is trimmed away with the spikes:
    `overhead_whole_run` (fastest run over fastest run) and `overhead_stepwise_min` (per-step minima over
    the rounds, summed) keep it. prefilled: a `decode.prefill` of these prompts to reuse (the sweep's), None =
    prefill here. -> {overhead, overhead_rounds, round_overheads, overhead_median_step, plain_s, k0_s
    (per-step minima summed), overhead_stepwise_min: k0_s / plain_s - 1, overhead_whole_run, repeats, steps,
    nonzero_k_steps (must be 0), same_tokens, policy_s (the k0 run's own decision seconds)}.
    """
    from decodelab.core import engine

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    pre = prefilled if prefilled is not None else prefill(model, prompts, max_new_tokens=max_new_tokens)
    copies = own_cache(pre), own_cache(pre)  # the two runs are alive at once: one cache each (`own_cache`)
    runs: dict[int, list] = {0: [], 1: []}
    for rnd in range(repeats):
        plain_pre, spec_pre = copies if rnd % 2 == 0 else copies[::-1]
        plain_pre.cache.truncate(plain_pre.prompt_lengths.clone())
        steppers = {0: engine.generate_steps(model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                                             prefilled=(plain_pre.cache, plain_pre.last_logits)),
                    1: generate_steps(model, drafter=make_drafter(), k=make_policy(len(prompts)), prefilled=spec_pre,
                                      max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)}
        order = (0, 1) if rnd % 2 == 0 else (1, 0)
        for side, result in side_by_side({side: steppers[side] for side in order}).items():
            runs[side].append(result)
    plain_s, k0_s = (stepwise_min_seconds([r.stats.step_s for r in runs[side]]) for side in (0, 1))
    plain_best, spec_best = (min(runs[side], key=lambda r: r.stats.decode_s) for side in (0, 1))
    paired = np.array([k0.stats.decode_s / plain.stats.decode_s for plain, k0 in zip(runs[0], runs[1])])
    plain_steps, k0_steps = (np.asarray([r.stats.step_s for r in runs[side]], dtype=float) for side in (0, 1))
    step_ratios = k0_steps / plain_steps
    return {"batch": len(prompts), "overhead": paired_step_overhead(plain_steps, k0_steps),
            "overhead_rounds": float(np.exp(np.log(paired).mean())) - 1.0,
            "overhead_median_step": float(np.median(step_ratios)) - 1.0,
            "round_overheads": (paired - 1.0).tolist(), "plain_s": plain_s, "k0_s": k0_s,
            "overhead_stepwise_min": k0_s / plain_s - 1.0,
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
