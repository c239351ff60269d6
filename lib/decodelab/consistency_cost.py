"""Cost of n samples of one prompt: shared prompt KV vs n unshared copies vs HF `num_return_sequences`.

Notebook 05's experiment 3: wall time, measured peak memory and analytic KV bytes as prompt length and n grow.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from decodelab.consistency import row_generator

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

    from decodelab.tasks import chat_prompt_ids

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


class PeakMemory:
    """Peak memory a block adds above what was live when it started, in bytes (`.peak_bytes`).

    CUDA: torch.cuda.max_memory_allocated above the allocated bytes at entry. CPU: the process's peak RSS
    (VmHWM, reset at entry by writing 5 to /proc/self/clear_refs) above its RSS at entry, after a garbage
    collection and malloc_trim so freed memory from earlier work is returned first. `.how` says which.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)

    def __enter__(self):
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.how = "cuda_max_allocated"
            return self
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.how = "vmhwm"
        except OSError:  # no reset: the peak may predate the block (reported as such)
            self.how = "maxrss_unreset"
        self._base = _proc_status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _proc_status_kb("VmHWM") * 1024
        self.peak_bytes = max(int(peak - self._base), 0)
        return False


def _proc_status_kb(field_name: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_method(model, method: str, prompt: list[int], n: int, *, new_tokens: int, sampler=None, seed: int = 0):
    """Generate n samples of `prompt`, exactly `new_tokens` each (EOS ignored), with one method:
    shared (one prefill, shared prompt KV), unshared (`engine.generate` on n copies), or
    hf_num_return_sequences (transformers `generate(num_return_sequences=n)`). Returns the tokens (n, new)."""
    import torch

    from decodelab import engine
    from decodelab.shared_prefix import generate_shared

    gens = [row_generator(seed, 0, s, model.device) for s in range(n)]
    if method == "shared":
        return generate_shared(model, [prompt], n, max_new_tokens=new_tokens, sampler=sampler, generator=gens,
                               eos_token_ids=[]).tokens
    if method == "unshared":
        return engine.generate(model, [prompt] * n, max_new_tokens=new_tokens, sampler=sampler, generator=gens,
                               eos_token_ids=[]).tokens
    if method == "hf_num_return_sequences":
        ids = torch.tensor([prompt], device=model.device)
        # transformers refuses num_return_sequences > 1 without sampling: greedy is sampling with top_k=1.
        temperature = float(getattr(sampler, "configs", [None])[0].temperature) if sampler is not None else 1.0
        sampling = dict(do_sample=True, temperature=temperature, top_k=0 if sampler is not None else 1, top_p=1.0)
        # transformers samples from the global RNG: fork it so the caller's global state is untouched.
        cuda_ids = [model.device.index or 0] if model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_ids):
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.hf_model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), num_return_sequences=n,
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=model.eos_token_ids[0],
                    **sampling)
        return out[:, len(prompt):].tolist()
    raise ValueError(f"method={method!r} must be one of {COST_METHODS}")


def measure_cost(model, method: str, prompt: list[int], n: int, *, new_tokens: int, sampler=None,
                 seed: int = 0) -> dict:
    """Wall time, peak memory and analytic KV bytes of one `run_method` call.
    -> {method, prompt_len, n, new_tokens, seconds, kv_bytes, peak_bytes, peak_how}"""
    import time

    from decodelab import engine
    from decodelab.shared_prefix import analytic_kv_bytes, kv_bytes_per_token

    with PeakMemory(model.device) as memory:
        engine.synchronize(model.device)
        start = time.perf_counter()
        tokens = run_method(model, method, prompt, n, new_tokens=new_tokens, sampler=sampler, seed=seed)
        engine.synchronize(model.device)
        seconds = time.perf_counter() - start
    if len(tokens) != n or any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"method={method!r} returned {[len(t) for t in tokens]} tokens, expected {n} x {new_tokens}")
    kv = analytic_kv_bytes(kv_bytes_per_token(model), len(prompt), n, new_tokens, shared=method == "shared")
    return {"method": method, "prompt_len": len(prompt), "n": n, "new_tokens": new_tokens, "seconds": seconds,
            "kv_bytes": kv, "peak_bytes": memory.peak_bytes, "peak_how": memory.how}


def cost_sweep(model, prompt_lengths: Sequence[int], n_values: Sequence[int], *, new_tokens: int = 32,
               methods: Sequence[str] = COST_METHODS, baseline_max_tokens: int | None = None, sampler=None,
               seed: int = 0, progress: bool = True) -> list[dict]:
    """`measure_cost` over prompt lengths x n x methods. Baselines (every method but shared) are skipped
    where n * prompt_len > baseline_max_tokens (they prefill the prompt n times). Each method is warmed up
    once on a short prompt first, so one-time setup is not charged to the first point."""
    unknown = set(methods) - set(COST_METHODS)
    if unknown:
        raise ValueError(f"methods={list(methods)}: unknown {sorted(unknown)}; allowed {COST_METHODS}")
    for method in methods:
        run_method(model, method, long_prompt(model.tokenizer, 64), 2, new_tokens=2, sampler=sampler, seed=seed)
    grid = [(length, n, method) for length in prompt_lengths for n in n_values for method in methods
            if method == "shared" or baseline_max_tokens is None or n * length <= baseline_max_tokens]
    if progress:
        from tqdm.auto import tqdm

        grid = tqdm(grid, desc="cost")
    prompts = {length: long_prompt(model.tokenizer, length) for length in prompt_lengths}
    return [measure_cost(model, method, prompts[length], n, new_tokens=new_tokens, sampler=sampler, seed=seed)
            for length, n, method in grid]


def goal_summary(cost_rows: Sequence[dict], *, prompt_len: int = 1000, n: int = 16) -> dict:
    """Shared vs HF num_return_sequences at the measured point nearest (prompt_len, n) where both ran.
    -> {prompt_len, n, speedup_vs_hf, kv_ratio_vs_hf, peak_ratio_vs_hf} (empty when HF never ran)."""
    by_key = {(r["method"], r["prompt_len"], r["n"]): r for r in cost_rows}
    points = [(length, k) for (method, length, k) in by_key if method == "hf_num_return_sequences"
              and ("shared", length, k) in by_key]
    if not points:
        return {}
    length, k = min(points, key=lambda p: (abs(p[0] - prompt_len) / prompt_len + abs(np.log2(p[1] / n)), -p[1]))
    hf, shared = by_key[("hf_num_return_sequences", length, k)], by_key[("shared", length, k)]
    return {"prompt_len": length, "n": k, "speedup_vs_hf": hf["seconds"] / shared["seconds"],
            "kv_ratio_vs_hf": shared["kv_bytes"] / hf["kv_bytes"],
            "peak_ratio_vs_hf": shared["peak_bytes"] / hf["peak_bytes"] if hf["peak_bytes"] else float("nan")}
