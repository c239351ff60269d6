"""Shared-prefix attention against attention over n copies of the prompt, timed alone (no model around it)."""
from __future__ import annotations

import torch

from decodelab.common.timing import alternating_times
from decodelab.core.shared_prefix import shared_prefix_attention


def attention_benchmark(prompt_lengths, n_values, *, n_heads: int = 9, n_kv_heads: int = 3, head_dim: int = 64,
                        suffix_len: int = 32, repeats: int = 5, device="cpu", dtype=torch.float32,
                        seed: int = 0) -> list[dict]:
    """Time one decode step of one attention layer: shared-prefix attention vs standard attention over n
    materialized copies of the prompt KV (what an unshared cache holds). Defaults: the embedded model's
    head shapes. The two are timed in alternation, `repeats` rounds after one warm-up call each.
    -> [{prompt_len, n, impl: "shared" | "unshared", seconds (min per call), seconds_max, seconds_spread}]"""
    from decodelab.core.kv_cache import grouped_attention

    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be >= 1")
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    rows = []
    for prompt_len in prompt_lengths:
        prefix_k, prefix_v = rand(1, n_kv_heads, prompt_len, head_dim), rand(1, n_kv_heads, prompt_len, head_dim)
        for n in n_values:
            q = rand(n, n_heads, 1, head_dim)
            suffix_k, suffix_v = rand(n, n_kv_heads, suffix_len, head_dim), rand(n, n_kv_heads, suffix_len, head_dim)
            suffix_mask = torch.ones(n, 1, suffix_len, dtype=torch.bool, device=device)
            full_k = torch.cat([prefix_k.expand(n, -1, -1, -1), suffix_k], dim=2)  # n copies, as unshared holds
            full_v = torch.cat([prefix_v.expand(n, -1, -1, -1), suffix_v], dim=2)
            full_mask = torch.ones(n, 1, prompt_len + suffix_len, dtype=torch.bool, device=device)
            calls = {
                "shared": lambda: shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_mask,
                                                          row_counts=[n]),
                "unshared": lambda: grouped_attention(q, full_k, full_v, full_mask),
            }
            times = alternating_times(calls, repeats, torch.device(device))
            for impl, t in times.items():
                rows.append({"prompt_len": prompt_len, "n": n, "impl": impl, "seconds": min(t),
                             "seconds_max": max(t), "seconds_spread": (max(t) - min(t)) / min(t)})
    return rows
