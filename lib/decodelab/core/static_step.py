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

`StaticStep(tr, compile=True)` compiles the step with inductor (`mode` as torch.compile's, e.g.
"reduce-overhead" for CUDA graphs on a GPU) region by region: the two halves of one decoder layer
(`layer_qkv`, `layer_out`) are compiled once and serve every layer, since all layers share their shapes.
Compiling the whole step as one graph took minutes on 2 CPU cores; one layer takes seconds. Where
compiling fails (no C++ compiler, an unsupported backend) it warns once and runs the same static step
eagerly; `status()` says which path ran and why, for the run's env.json.
"""
from __future__ import annotations

import warnings

import torch

from decodelab.core.kv_cache import KVCache, grouped_mask
from decodelab.core.native_rope import rotate_half
from decodelab.core.transformer import Transformer


def static_visible(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """lengths (B,) -> (B, 1, S=max_len) bool: the one new query of row b (at position lengths[b]) sees j <= it."""
    return torch.arange(max_len, device=lengths.device)[None, None, :] <= lengths[:, None, None]


def plain_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward: what the compiler sees (inductor packs weights its own way)."""
    return module(x)


def layer_qkv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int, int],
              linear=plain_linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First half of a decoder layer of the static step: x (B, 1, E) -> queries folded per KV head
    (B, K, G, D) and the new key and value (B, K, D), RoPE applied. cos, sin: (B, 1, 1, D); heads: (H, K, D)."""
    n_heads, n_kv_heads, head_dim = heads
    batch = x.shape[0]
    h = layer.input_layernorm(x)
    attn = layer.self_attn
    q = linear(attn.q_proj, h).view(batch, 1, n_heads, head_dim)
    k = linear(attn.k_proj, h).view(batch, 1, n_kv_heads, head_dim)
    v = linear(attn.v_proj, h).view(batch, 1, n_kv_heads, head_dim)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim), k[:, :, 0], v[:, :, 0]


def layer_out(layer, x: torch.Tensor, folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor, linear=plain_linear) -> torch.Tensor:
    """Second half: attention of the folded queries (B, K, G, D) over this layer's cache keys, values
    (B, K, S, D) under mask (B, 1, G, S), then o_proj, the MLP and both residuals -> x (B, 1, E)."""
    batch, attn = x.shape[0], layer.self_attn
    out = torch.nn.functional.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    x = x + linear(attn.o_proj, out.reshape(batch, 1, -1))
    mlp, h = layer.mlp, layer.post_attention_layernorm(x)
    return x + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))


def static_decode_logits(tr: Transformer, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                         tokens: torch.Tensor, *, packed: bool = True, halves=(layer_qkv, layer_out)) -> torch.Tensor:
    """One decode step over a full-length cache, shapes fixed by (B, S): -> next-token logits (B, V) fp32.

    keys, values: (L, B, K, S, D), written in place at position lengths[b] of each row; lengths (B,) long
    (not advanced here: the caller counts the new position); tokens (B,) long. packed: the eager path's
    once-packed bf16 weights (`tr.linear`, bit-identical to the modules); False for compiled code.
    halves: (`layer_qkv`, `layer_out`) or compiled versions of them. Every layer has the same shapes, so one
    graph of each half serves all L layers (regional compilation: the compiler sees one layer, not L).
    """
    linear = tr.linear if packed else plain_linear
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    mask = grouped_mask(static_visible(lengths, keys.shape[3]), tr.n_heads // tr.n_kv_heads)  # (B, 1, G, S)
    x = tr.embed_tokens(tokens[:, None])
    cos, sin = tr.rotary(x, lengths[:, None])
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    heads = (tr.n_heads, tr.n_kv_heads, tr.head_dim)
    qkv, out = halves
    for slot in range(tr.n_layers):
        layer = tr.layers[slot]
        folded, k, v = qkv(layer, x, cos, sin, heads, linear)
        # The cache write stays outside the halves: compiled code that writes into a view of the cache
        # copies the whole view back every call.
        keys[slot, rows, :, lengths] = k
        values[slot, rows, :, lengths] = v
        x = out(layer, x, folded, keys[slot], values[slot], mask, linear)
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
                halves = tuple(torch.compile(half, mode=mode, dynamic=False, fullgraph=True)
                               for half in (layer_qkv, layer_out))
                self._fn = lambda *args: static_decode_logits(*args, packed=False, halves=halves)
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
