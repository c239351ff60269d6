"""Self-consistency at the cost of one sample: SC@n wall time (prompt prefilled once, n samples decoded as
one shared-prefix batch) against ONE sample of the same prompt, where the extra time goes, and what a GPU
roofline predicts for the same ratio.

Like with like: the same prompt, exactly `new_tokens` per sample (EOS an ordinary token), the same sampler,
one outer wall clock around each whole call (`cost.time_method`), repeats interleaved (the call order rotates
each round) and the minimum kept, with the spread. One sample is the engine's plain path (`cost.run_method`
"unshared" with n = 1: a KVCache, no shared-prefix machinery), the baseline a user would run.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from decodelab.consistency.cost import time_method

SC16_TARGET = 1.25  # SC@16 / one sample wall time (issue 17)
SC64_TARGET = 2.0  # SC@64 / one sample (issue 17, moonshot)
# Roofline of one H100 SXM (NVIDIA datasheet): HBM3 bandwidth and dense bf16 tensor-core peak.
GPU_BANDWIDTH = 3.35e12  # bytes/s
GPU_FLOPS = 989e12  # FLOP/s


def sc_vs_one_sample(model, prompt: list[int], n_values: Sequence[int], *, new_tokens: int, sampler=None,
                     seed: int = 0, repeats: int = 3, warmup: bool = True) -> list[dict]:
    """Wall time of one sample and of SC@n (shared) for every n, `repeats` interleaved rounds after one
    untimed warm-up call each (warmup=False: the caller already ran both paths on this prompt length).
    -> [{n, prompt_len, new_tokens, seconds (min), seconds_spread, one_sample_seconds, one_sample_spread,
    ratio}] with ratio = SC@n min / one-sample min; n = 1 is the shared path at one row (its overhead)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    bad = [n for n in n_values if n < 1]
    if bad or not n_values:
        raise ValueError(f"n_values={list(n_values)}: need at least one n, each >= 1")
    calls = {"one": ("unshared", 1), **{f"sc{n}": ("shared", int(n)) for n in n_values}}
    run = lambda method, n: time_method(model, method, prompt, n, new_tokens=new_tokens, sampler=sampler,  # noqa: E731
                                        seed=seed)[0]
    for method, n in calls.values() if warmup else ():
        run(method, n)
    names, times = list(calls), {name: [] for name in calls}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run(*calls[name]))
    one = min(times["one"])
    rows = []
    for n in n_values:
        t = np.asarray(times[f"sc{n}"])
        rows.append({"n": int(n), "prompt_len": len(prompt), "new_tokens": new_tokens, "seconds": float(t.min()),
                     "seconds_spread": float((t.max() - t.min()) / t.min()), "one_sample_seconds": one,
                     "one_sample_spread": float((max(times["one"]) - one) / one), "ratio": float(t.min()) / one})
    return rows


def ratio_at(rows: Sequence[dict], n: int) -> float | None:
    """SC@n / one sample from `sc_vs_one_sample` rows, None when n was not measured."""
    return next((r["ratio"] for r in rows if r["n"] == n), None)


def stopped_batch(n: int, samples_used: float, pool: int) -> int:
    """The batch SC@n launches when a stopping rule draws on average `samples_used` of `pool` samples:
    ceil(n * samples_used / pool), at least 1 and at most n (a batch is sized before decoding, so it is
    rounded up, never down)."""
    if pool < 1 or not 0 <= samples_used <= pool:
        raise ValueError(f"samples_used={samples_used!r} must be in [0, pool={pool}]")
    return min(n, max(1, math.ceil(n * samples_used / pool - 1e-9)))


def stopped_batches(n_values: Sequence[int], samples_used: float, pool: int) -> list[int]:
    """Every n to time so that each SC@n with stopping is measured at its own batch: n_values plus each
    `stopped_batch`, sorted, without repeats."""
    return sorted({int(n) for n in n_values} | {stopped_batch(int(n), samples_used, pool) for n in n_values})


def with_early_stopping(rows: Sequence[dict], samples_used: float, pool: int,
                        n_values: Sequence[int] | None = None) -> list[dict]:
    """SC@n's cost when a stopping rule draws on average `samples_used` of `pool` samples: the measured
    time at the smallest measured n >= n * samples_used / pool (a batch must be sized before decoding, so
    the saving is the batch it lets you launch; rounding up never credits more than was measured). Measure
    `stopped_batches(...)` so that this is the `stopped_batch` itself, not the next larger n.
    n_values: the SC@n rows to report (default every measured n). -> [{n, effective_n, measured_at_n,
    seconds, ratio}]"""
    out = []
    share = samples_used / pool
    for row in rows if n_values is None else [r for r in rows if r["n"] in set(n_values)]:
        needed = row["n"] * share
        fits = [r for r in rows if r["n"] >= needed - 1e-9]
        at = min(fits, key=lambda r: r["n"]) if fits else row
        out.append({"n": row["n"], "effective_n": needed, "measured_at_n": at["n"], "seconds": at["seconds"],
                    "ratio": at["ratio"]})
    return out


# ---------------------------------------------------------------- where the extra time goes


def step_breakdown(model, prompt: list[int], n_values: Sequence[int], *, new_tokens: int, sampler=None,
                   seed: int = 0, repeats: int = 3) -> list[dict]:
    """Per n: prefill and mean decode-step seconds of the shared path (the engine's own per-step clock, min
    over repeats), and the sampler alone on (n, V) logits (min over repeats), so the step time growth with n
    splits into the sampler's part and the rest (the model forward: weights, shared-prefix attention, the
    per-row suffix caches). -> [{n, prefill_s, step_s, sampler_s}]"""
    from decodelab.common.seeding import row_generator
    from decodelab.common.timing import best_time
    from decodelab.core import engine
    from decodelab.core.shared_prefix import generate_shared

    rows = []
    tr = engine.as_transformer(model)
    for n in n_values:
        prefill, step = [], []
        for _ in range(repeats):
            gens = [row_generator(seed, 0, s, device=model.device) for s in range(n)]
            out = generate_shared(model, [prompt], n, max_new_tokens=new_tokens, sampler=sampler, generator=gens,
                                  eos_token_ids=[], return_logprobs=False)
            prefill.append(out.stats.prefill_s)
            step.append(float(np.mean(out.stats.step_s)) if out.stats.step_s else float("nan"))
        sampler_s = float("nan")
        if sampler is not None:
            g = torch.Generator(device=model.device).manual_seed(seed)
            logits = torch.randn(n, tr.vocab_size, generator=g, device=tr.device, dtype=tr.dtype)
            gens = [row_generator(seed, 0, s, device=model.device) for s in range(n)]
            sampler_s = best_time(lambda: sampler.sample(logits, gens), repeats, model.device)
        rows.append({"n": int(n), "prefill_s": min(prefill), "step_s": min(step), "sampler_s": sampler_s})
    return rows


# ---------------------------------------------------------------- GPU extrapolation from a roofline


def roofline_seconds(*, n: int, prompt_len: int, new_tokens: int, n_params: int, bytes_per_param: int,
                     kv_bytes_per_token: int, shared: bool = True, bandwidth: float = GPU_BANDWIDTH,
                     flops: float = GPU_FLOPS) -> float:
    """Lower-bound seconds of prefill + new_tokens decode steps for n samples of one prompt.

    Each phase costs max(bytes / bandwidth, FLOPs / peak):
    prefill: FLOPs 2 * params * prompt_len, bytes the weights once + the prompt KV written;
    decode step t: FLOPs 2 * params * n, bytes the weights + the KV read: the prompt KV once (shared) or n
    times (unshared) + every row's suffix of t positions. Attention FLOPs are left out (at these lengths
    they are a few % of the matmuls); kernel launch and sampler time are left out (a lower bound).
    """
    weights = n_params * bytes_per_param
    total = max((weights + prompt_len * kv_bytes_per_token) / bandwidth, 2.0 * n_params * prompt_len / flops)
    prompt_reads = prompt_len if shared else n * prompt_len
    for t in range(new_tokens):
        kv = (prompt_reads + n * t) * kv_bytes_per_token
        total += max((weights + kv) / bandwidth, 2.0 * n_params * n / flops)
    return total


def roofline_rows(model, *, prompt_len: int, n_values: Sequence[int], new_tokens: int,
                  bytes_per_param: int = 2, **hardware) -> list[dict]:
    """SC@n / one sample predicted by `roofline_seconds` for `model`'s shapes in bf16 (bytes_per_param 2,
    KV in the same width) on the default GPU. -> [{n, gpu_seconds, gpu_one_sample_seconds, gpu_ratio}]"""
    from decodelab.core import engine

    tr = engine.as_transformer(model)
    n_params = sum(p.numel() for p in tr.parameters())  # tied embeddings counted once, read once per step
    kv = 2 * tr.n_layers * tr.n_kv_heads * tr.head_dim * bytes_per_param
    shape = dict(prompt_len=prompt_len, new_tokens=new_tokens, n_params=n_params, bytes_per_param=bytes_per_param,
                 kv_bytes_per_token=kv, **hardware)
    one = roofline_seconds(n=1, shared=False, **shape)
    return [{"n": int(n), "gpu_seconds": roofline_seconds(n=n, **shape), "gpu_one_sample_seconds": one,
             "gpu_ratio": roofline_seconds(n=n, **shape) / one} for n in n_values]


# ---------------------------------------------------------------- goals and generated findings


def goals(rows: Sequence[dict], stopped_rows: Sequence[dict], rule: str) -> list:
    """SC@16 and SC@64 against one sample (min of interleaved repeats), SC@16 also with the stopping rule
    `rule`'s samples counted (`with_early_stopping`). None where n was not measured."""
    from decodelab.common.goals import Goal

    def note(n):
        row = next((r for r in rows if r["n"] == n), None)
        return (f"{row['prompt_len']}-token prompt, {row['new_tokens']} new tokens; spread SC "
                f"{row['seconds_spread']:.0%}, one sample {row['one_sample_spread']:.0%}") if row else ""

    stopped = next((r for r in stopped_rows if r["n"] == 16), None)
    return [
        Goal.check("sc16_vs_one_sample", ratio_at(rows, 16), "<=", SC16_TARGET, unit="x",
                   label="SC@16 wall time / one sample (shared prompt KV, one batch)", note=note(16)),
        Goal.check("sc16_vs_one_sample_early_stop", stopped["ratio"] if stopped else None, "<=", SC16_TARGET, unit="x",
                   label=f"SC@16 / one sample with {rule}'s samples counted",
                   note=(f"{stopped['effective_n']:.1f} samples on average: the measured batch of "
                         f"{stopped['measured_at_n']}" if stopped else "")),
        Goal.check("sc64_vs_one_sample", ratio_at(rows, 64), "<=", SC64_TARGET, unit="x", moonshot=True,
                   label="SC@64 wall time / one sample (moonshot)", note=note(64)),
    ]


def findings(rows: Sequence[dict], stopped_rows: Sequence[dict], breakdown: Sequence[dict],
             gpu: Sequence[dict], rule: str) -> list[str]:
    """Sentences from the SC@n tables: the ratio by n, with stopping, where the step time goes, the GPU roofline."""
    if not rows:
        return []
    first = rows[0]
    out = [f"One sample of the {first['prompt_len']}-token prompt ({first['new_tokens']} new tokens) took "
           f"{first['one_sample_seconds']:.3g} s; SC@n / one sample: "
           + ", ".join(f"n = {r['n']}: {r['ratio']:.2f}x" for r in rows) + " (min of interleaved repeats)."]
    if stopped_rows:
        out.append(f"With {rule}'s average samples counted (the batch it lets you launch, rounded up to a measured n): "
                   + ", ".join(f"n = {r['n']}: {r['ratio']:.2f}x" for r in stopped_rows) + ".")
    if len(breakdown) > 1:
        lo, hi = breakdown[0], breakdown[-1]
        extra = hi["step_s"] - lo["step_s"]
        sampler = hi["sampler_s"] - lo["sampler_s"]
        growth = (f"the sampler's share of the growth {sampler / extra:.0%}, the rest the model forward at batch "
                  f"{hi['n']} (weights' matmuls, shared-prefix attention, per-row suffix caches)" if extra > 0 else
                  "the step did not grow (noise above the work at these sizes)")
        out.append(f"Per decode step, n = {lo['n']} -> {hi['n']}: {lo['step_s'] * 1e3:.3g} -> "
                   f"{hi['step_s'] * 1e3:.3g} ms; the sampler alone {lo['sampler_s'] * 1e3:.3g} -> "
                   f"{hi['sampler_s'] * 1e3:.3g} ms; {growth}; the prefill ({hi['prefill_s']:.3g} s) is paid once.")
    if gpu:
        out.append("GPU roofline (H100 SXM, bf16, weights + KV bytes against FLOPs per phase, a lower bound): "
                   "SC@n / one sample " + ", ".join(f"n = {r['n']}: {r['gpu_ratio']:.2f}x" for r in gpu)
                   + " (decode is weight-bandwidth bound, so extra rows are nearly free).")
    return out
