"""A graph-ready decode step: static shapes, no host sync, so `torch.compile` (and CUDA graphs) can capture it.

The eager step (`Transformer.forward`) reads `span = max(positions) + 1` on the host once per forward to
attend over only the filled part of the cache; that sync and the span-dependent shapes make every step
a new graph. The static step instead attends over the whole preallocated cache (S = max_len, fixed per
cache) and hides what a row may not see with a mask:

    query of row b sits at position p_b = lengths[b];   key j is visible  iff  j <= p_b

so the shapes depend only on (B, S), and every input that changes between steps (tokens, lengths) is a
tensor. Keys/values are written in place at slot p_b of every layer before attending, exactly as
`KVCache.attend` does. Entries past p_b are scratch (zeros or stale rollback data): masked out, they
get softmax weight exactly 0, so the step computes the same attention as the eager one, up to the
summation order of the longer (masked) reduction. The tests check greedy tokens are identical.

`StaticStep(tr, compile=True)` compiles the step once per Transformer (inductor; `mode` as
torch.compile's, e.g. "reduce-overhead" for CUDA graphs on a GPU). Where compiling fails (no C++
compiler, an unsupported backend) it warns once and runs the same static step eagerly; `status()`
says which path ran and why, for the run's env.json.
"""
from __future__ import annotations

import warnings

import torch

from decodelab.core.kv_cache import KVCache, grouped_mask
from decodelab.core.transformer import Transformer, rotate_half


def static_visible(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """lengths (B,) -> (B, 1, S=max_len) bool: the one new query of row b (at position lengths[b]) sees j <= it."""
    return torch.arange(max_len, device=lengths.device)[None, None, :] <= lengths[:, None, None]


def plain_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward: what the compiler sees (inductor packs weights its own way)."""
    return module(x)


def static_decode_logits(tr: Transformer, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                         tokens: torch.Tensor, *, packed: bool = True) -> torch.Tensor:
    """One decode step over a full-length cache, shapes fixed by (B, S): -> next-token logits (B, V) fp32.

    keys, values: (L, B, K, S, D), written in place at position lengths[b] of each row; lengths (B,) long
    (not advanced here: the caller counts the new position); tokens (B,) long. packed: the eager path's
    once-packed bf16 weights (`tr.linear`, bit-identical to the modules); False for the compiled graph.
    """
    linear = tr.linear if packed else plain_linear
    batch = tokens.shape[0]
    positions = lengths[:, None]  # (B, 1)
    rows = torch.arange(batch, device=tokens.device)
    mask = grouped_mask(static_visible(lengths, keys.shape[3]), tr.n_heads // tr.n_kv_heads)  # (B, 1, G, S)
    x = tr.embed_tokens(tokens[:, None])
    cos, sin = tr.rotary(x, positions)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    for slot in range(tr.n_layers):
        layer = tr.layers[slot]
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        q = linear(attn.q_proj, h).view(batch, 1, tr.n_heads, tr.head_dim)
        k = linear(attn.k_proj, h).view(batch, 1, tr.n_kv_heads, tr.head_dim)
        v = linear(attn.v_proj, h).view(batch, 1, tr.n_kv_heads, tr.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys[slot, rows, :, lengths] = k[:, :, 0]
        values[slot, rows, :, lengths] = v[:, :, 0]
        folded = q.reshape(batch, tr.n_kv_heads, tr.n_heads // tr.n_kv_heads, tr.head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(folded, keys[slot], values[slot], attn_mask=mask)
        out = out.reshape(batch, 1, tr.n_heads * tr.head_dim)
        x = x + linear(attn.o_proj, out)
        mlp, h = layer.mlp, layer.post_attention_layernorm(x)
        x = x + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))
    return linear(tr.lm_head, tr.final_norm(x))[:, 0].float()


class StaticStep:
    """The static decode step of one Transformer, compiled on request: `step(cache, tokens (B,)) -> (B, V)`.

    Works on a plain `KVCache` (per-row lengths); advances it by one position per row, like
    `engine.decode_step`. compile=False runs the same static maths eagerly (the reference for tests).
    """

    def __init__(self, tr: Transformer, *, compile: bool = True, mode: str | None = None):
        self.tr = tr
        self.requested = compile
        self.mode = mode
        self.reason = "compile not requested" if not compile else ""
        self._fn = None
        if compile:
            try:
                compiled = torch.compile(static_decode_logits, mode=mode, dynamic=False, fullgraph=True)
                self._fn = lambda *args: compiled(*args, packed=False)
            except Exception as error:  # noqa: BLE001 - any failure means: no compiler here
                self._fall_back(error)

    @property
    def compiled(self) -> bool:
        """Whether steps run through the compiled graph (False: eager, see `status()["reason"]`)."""
        return self._fn is not None

    def status(self) -> dict:
        """For env.json: {compile_requested, compiled, mode, reason}."""
        return {"compile_requested": self.requested, "compiled": self.compiled, "mode": self.mode,
                "reason": self.reason or "compiled with torch.compile (inductor)"}

    def _fall_back(self, error: Exception) -> None:
        self._fn = None
        self.reason = f"torch.compile unavailable: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        warnings.warn(f"compile=True but {self.reason}; decoding with the eager static step instead",
                      RuntimeWarning, stacklevel=3)

    def __call__(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(cache, KVCache):
            raise TypeError(f"the static step needs a plain KVCache, got {type(cache).__name__}")
        if bool((cache.lengths >= cache.max_len).any()):  # checked before the graph: it cannot raise inside
            raise ValueError(f"KV cache overflow: a row is at max_len={cache.max_len}")
        with torch.no_grad():
            logits = None
            if self._fn is not None:
                try:
                    logits = self._fn(self.tr, cache.keys, cache.values, cache.lengths, tokens)
                except Exception as error:  # noqa: BLE001 - a compiler failing at first call (no g++, ...)
                    self._fall_back(error)
            if logits is None:
                logits = static_decode_logits(self.tr, cache.keys, cache.values, cache.lengths, tokens)
        cache.advance(torch.ones_like(cache.lengths))
        return logits


def static_step_for(tr: Transformer, *, compile: bool = True, mode: str | None = None) -> StaticStep:
    """The Transformer's StaticStep for these options, built once and reused (compiling costs seconds)."""
    steps = tr.__dict__.setdefault("_static_steps", {})
    key = (compile, mode)
    if key not in steps:
        steps[key] = StaticStep(tr, compile=compile, mode=mode)
    return steps[key]
