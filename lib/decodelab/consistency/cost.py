"""Cost of n samples of one prompt: shared prompt KV vs n unshared copies vs HF `num_return_sequences`.

Notebook 05's experiment 3: wall time, peak memory, and KV bytes both measured (the storage behind each
method's cache tensors at the end) and analytic (a formula), as prompt length and n grow.

Like with like: every method samples with the same settings (`hf_sampling_kwargs` gives transformers our
temperature and filters, in the same order, and nothing from the model's generation_config), generates
exactly `new_tokens` per sample with EOS an ordinary token on both sides, and is timed by one outer wall
clock around the whole call; repeats are interleaved across methods and the minimum is kept, with the spread.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from decodelab.common.seeding import row_generator
from decodelab.common.timing import PeakMemory, timed

COST_METHODS = ("shared", "unshared", "hf_num_return_sequences")


def long_prompt(tokenizer, n_tokens: int, *, source_module: str = "argparse", seed: int = 0) -> list[int]:
    """A chat prompt of exactly `n_tokens` tokens built from real text: a stdlib module's source, cut to fit.

    Without a tokenizer (tiny test models), `n_tokens` random ids from `seed`.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} must be >= 1")
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return rng.integers(3, 200, size=n_tokens).tolist()
    import importlib.util
    from pathlib import Path

    from decodelab.workloads.prompts import chat_prompt_ids

    text = Path(importlib.util.find_spec(source_module).origin).read_text()
    marker = "<<SOURCE>>"
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": f"Summarize this Python code.\n\n{marker}"}])
    marker_ids = list(tokenizer(marker, add_special_tokens=False).input_ids)
    at = next(i for i in range(len(ids)) if ids[i:i + len(marker_ids)] == marker_ids)
    head, tail = ids[:at], ids[at + len(marker_ids):]
    body = list(tokenizer(text, add_special_tokens=False).input_ids)
    room = n_tokens - len(head) - len(tail)
    if room < 0 or room > len(body):
        raise ValueError(f"n_tokens={n_tokens} must be in [{len(head) + len(tail)}, "
                         f"{len(head) + len(tail) + len(body)}] with source_module={source_module!r}")
    return head + body[:room] + tail


@dataclass
class MethodOutput:
    """What one method returned: n token lists and the measured bytes of the KV cache it ended with."""

    tokens: list[list[int]]
    cache_bytes: int


def hf_sampling_kwargs(sampler=None) -> dict:
    """transformers `generate` settings that sample exactly as `sampler` does (None = greedy).

    Our `Sampler` in "hf" order applies temperature, top-k, top-p, min-p, typical, epsilon, eta, the order of
    transformers' `_get_logits_processor`, with the same semantics (min_tokens_to_keep=1). Every setting is
    passed explicitly, so nothing leaks in from the model's generation_config (e.g. Qwen's repetition_penalty
    1.1, top_k 20, top_p 0.8). transformers refuses num_return_sequences > 1 without sampling, so greedy is
    sampling with top_k=1 (the argmax, whatever the draw).
    """
    from decodelab.core.sampling import HF_ORDER

    neutral = dict(do_sample=True, repetition_penalty=1.0, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                   typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
    if sampler is None or sampler.is_greedy:
        return {**neutral, "top_k": 1}
    configs = set(sampler.configs)
    if len(configs) != 1:
        raise ValueError(f"sampler={sampler!r} mixes per-row settings; transformers applies one setting to all rows")
    if tuple(sampler.order) != HF_ORDER:
        raise ValueError(f"sampler order {list(sampler.order)} differs from transformers' fixed order {list(HF_ORDER)}")
    (c,) = configs
    return {**neutral, "temperature": c.temperature, "top_k": int(c.top_k), "top_p": c.top_p,
            "min_p": c.min_p if c.min_p > 0 else None, "typical_p": c.typical_p, "epsilon_cutoff": c.epsilon,
            "eta_cutoff": c.eta}


def run_method(model, method: str, prompt: list[int], n: int, *, new_tokens: int, sampler=None,
               seed: int = 0) -> MethodOutput:
    """Generate n samples of `prompt`, exactly `new_tokens` each (EOS sampled as an ordinary token, never a
    stop, on every side), with one method: shared (one prefill, shared prompt KV), unshared (n prefilled
    copies in a plain KV cache, the same decode loop) or hf_num_return_sequences (transformers
    `generate(num_return_sequences=n)` with `hf_sampling_kwargs(sampler)`). -> MethodOutput(tokens (n, new),
    measured cache bytes)."""
    import torch

    from decodelab.core.shared_prefix import cache_bytes, generate_shared

    gens = [row_generator(seed, 0, s, device=model.device) for s in range(n)]
    if method in ("shared", "unshared"):
        result = generate_shared(model, [prompt], n, max_new_tokens=new_tokens, sampler=sampler, generator=gens,
                                 eos_token_ids=[], shared=method == "shared", return_logprobs=False)
        return MethodOutput(result.tokens, result.cache_bytes)
    if method == "hf_num_return_sequences":
        ids = torch.tensor([prompt], device=model.device)
        # transformers samples from the global RNG: fork it so the caller's global state is untouched.
        cuda_ids = [model.device.index or 0] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_ids):
            torch.manual_seed(seed)
            with torch.inference_mode():
                # eos_token_id=None: no stop at EOS (not min_new_tokens, which would mask EOS out of the
                # distribution and so sample differently from our side).
                out = model.hf_model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), num_return_sequences=n,
                    max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=model.eos_token_ids[0],
                    return_dict_in_generate=True, **hf_sampling_kwargs(sampler))
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        return MethodOutput(out["sequences"][:, len(prompt):].tolist(), cache_bytes(cache))
    raise ValueError(f"method={method!r} must be one of {COST_METHODS}")


def time_method(model, method: str, prompt: list[int], n: int, *, new_tokens: int, sampler=None,
                seed: int = 0) -> tuple[float, MethodOutput]:
    """One outer wall clock around one whole `run_method` call (prefill, decode, host copies) -> (s, output).
    Raises when the method did not return n x new_tokens tokens (the work both sides are credited with)."""
    output, seconds = timed(lambda: run_method(model, method, prompt, n, new_tokens=new_tokens, sampler=sampler,
                                               seed=seed), model.device)
    lengths = [len(t) for t in output.tokens]
    if len(lengths) != n or any(length != new_tokens for length in lengths):
        raise RuntimeError(f"method={method!r} returned {lengths} tokens, expected {n} x {new_tokens}")
    return seconds, output


def measure_point(model, methods: Sequence[str], prompt: list[int], n: int, *, new_tokens: int, sampler=None,
                  seed: int = 0, repeats: int = 3) -> list[dict]:
    """Every method at one (prompt, n): `repeats` timed calls each, interleaved (repeat r runs the methods
    in an order rotated by r, so none always goes first); peak memory is read on the last round's calls
    (`PeakMemory` around the timed call: its garbage collection and allocator trim run before the clock
    starts), so no extra call is paid for it (at a 1024-token prompt and n = 16 a baseline call is ~30 s).

    -> one row per method: {method, prompt_len, n, new_tokens, repeats, seconds (min), seconds_median,
    seconds_max, seconds_spread ((max - min) / min), cache_bytes (measured), kv_bytes_analytic, peak_bytes,
    peak_how}.
    """
    from decodelab.core.shared_prefix import analytic_kv_bytes, kv_bytes_per_token

    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    methods = list(methods)
    times: dict = {m: [] for m in methods}
    outputs: dict = {}
    peaks: dict = {}
    for r in range(repeats):
        for method in methods[r % len(methods):] + methods[:r % len(methods)]:
            with PeakMemory(model.device) if r == repeats - 1 else nullcontext() as memory:
                seconds, outputs[method] = time_method(model, method, prompt, n, new_tokens=new_tokens,
                                                       sampler=sampler, seed=seed)
            times[method].append(seconds)
            if memory is not None:
                peaks[method] = (memory.peak_bytes, memory.how)
    per_token = kv_bytes_per_token(model)
    rows = []
    for method in methods:
        peak, how = peaks[method]
        t = np.asarray(times[method])
        rows.append({"method": method, "prompt_len": len(prompt), "n": n, "new_tokens": new_tokens,
                     "repeats": repeats, "seconds": float(t.min()), "seconds_median": float(np.median(t)),
                     "seconds_max": float(t.max()), "seconds_spread": float((t.max() - t.min()) / t.min()),
                     "cache_bytes": outputs[method].cache_bytes,
                     "kv_bytes_analytic": analytic_kv_bytes(per_token, len(prompt), n, new_tokens,
                                                            shared=method == "shared"),
                     "peak_bytes": peak, "peak_how": how})
    return rows


def sweep_points(prompt_lengths: Sequence[int], n_values: Sequence[int], *, full_grid: bool = False) -> list[tuple]:
    """The (prompt_len, n) points of the cost sweep: every n at the longest prompt and every prompt length at
    the largest n (the two curves the notebook plots; the goal point is their corner), or with full_grid
    every pair. -> sorted [(prompt_len, n)]"""
    if full_grid:
        return sorted({(length, n) for length in prompt_lengths for n in n_values})
    longest, largest = max(prompt_lengths), max(n_values)
    return sorted({(longest, n) for n in n_values} | {(length, largest) for length in prompt_lengths})


def min_limit(*limits: int | None) -> int | None:
    """The smallest of the limits that are set (None = no limit)."""
    set_limits = [x for x in limits if x is not None]
    return min(set_limits) if set_limits else None


def cost_sweep(model, prompt_lengths: Sequence[int], n_values: Sequence[int], *, new_tokens: int = 32,
               methods: Sequence[str] = COST_METHODS, baseline_max_tokens: int | None = None,
               unshared_max_tokens: int | None = None, sampler=None, seed: int = 0, repeats: int = 3,
               progress: bool = True, full_grid: bool = False) -> list[dict]:
    """`measure_point` at `sweep_points(prompt_lengths, n_values, full_grid=...)`. Baselines (every method
    but shared) are skipped where n * prompt_len > baseline_max_tokens (they prefill the prompt n times);
    the unshared baseline also where n * prompt_len > unshared_max_tokens (it does HF's work in our engine,
    so at large n it repeats HF's measurement at HF's cost; None = no extra limit).
    Each method is warmed up once on a short prompt first, so one-time setup is not charged to the first
    point."""
    unknown = set(methods) - set(COST_METHODS)
    if unknown:
        raise ValueError(f"methods={list(methods)}: unknown {sorted(unknown)}; allowed {COST_METHODS}")
    for method in methods:
        run_method(model, method, long_prompt(model.tokenizer, 64), 2, new_tokens=2, sampler=sampler, seed=seed)
    points = sweep_points(prompt_lengths, n_values, full_grid=full_grid)
    if progress:
        from tqdm.auto import tqdm

        points = tqdm(points, desc="cost")
    prompts = {length: long_prompt(model.tokenizer, length) for length in prompt_lengths}
    limits = {"shared": None, "unshared": min_limit(baseline_max_tokens, unshared_max_tokens)}
    rows = []
    for length, n in points:
        todo = [m for m in methods
                if (limit := limits.get(m, baseline_max_tokens)) is None or n * length <= limit]
        rows += measure_point(model, todo, prompts[length], n, new_tokens=new_tokens, sampler=sampler, seed=seed,
                              repeats=repeats)
    return rows


def goal_summary(cost_rows: Sequence[dict], *, prompt_len: int = 1000, n: int = 16) -> dict:
    """Shared vs HF num_return_sequences at the measured point nearest (prompt_len, n) where both ran.

    speedup_vs_hf = HF's minimum seconds / shared's minimum seconds (min of interleaved repeats; the
    spreads beside it); kv_ratio_vs_hf_measured = shared cache bytes / HF cache bytes (storage behind the
    caches' tensors at the end); kv_ratio_vs_hf_analytic = the same ratio from the position-count formula.
    -> {prompt_len, n, repeats, speedup_vs_hf, shared_seconds, hf_seconds, shared_spread, hf_spread,
        kv_ratio_vs_hf_measured, kv_ratio_vs_hf_analytic, shared_cache_bytes, hf_cache_bytes,
        peak_ratio_vs_hf} (empty when HF never ran)."""
    by_key = {(r["method"], r["prompt_len"], r["n"]): r for r in cost_rows}
    points = [(length, k) for (method, length, k) in by_key if method == "hf_num_return_sequences"
              and ("shared", length, k) in by_key]
    if not points:
        return {}
    length, k = min(points, key=lambda p: (abs(p[0] - prompt_len) / prompt_len + abs(np.log2(p[1] / n)), -p[1]))
    hf, shared = by_key[("hf_num_return_sequences", length, k)], by_key[("shared", length, k)]
    return {"prompt_len": length, "n": k, "repeats": min(hf["repeats"], shared["repeats"]),
            "speedup_vs_hf": hf["seconds"] / shared["seconds"],
            "shared_seconds": shared["seconds"], "hf_seconds": hf["seconds"],
            "shared_spread": shared["seconds_spread"], "hf_spread": hf["seconds_spread"],
            "kv_ratio_vs_hf_measured": shared["cache_bytes"] / hf["cache_bytes"],
            "kv_ratio_vs_hf_analytic": shared["kv_bytes_analytic"] / hf["kv_bytes_analytic"],
            "shared_cache_bytes": shared["cache_bytes"], "hf_cache_bytes": hf["cache_bytes"],
            "peak_ratio_vs_hf": shared["peak_bytes"] / hf["peak_bytes"] if hf["peak_bytes"] else float("nan")}
