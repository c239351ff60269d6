"""Our decode-ready forward pass over a transformers Llama/Qwen2-family model's weights.

Why our own forward: the research needs a KV cache that transformers' caches don't offer in one place:
per-row lengths (ragged prompts and ragged speculative advance), O(1) rollback of a row, running a subset
of layers (layer-skip self-drafting), and pluggable attention (a shared-prefix cache). The weights are the
transformers model's own tensors (no copy), so the two can be compared token for token.

Shapes: B batch rows, T new tokens per row in this call, S cache positions, H query heads, K key/value
heads (K divides H), D head dim, E hidden size, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def sliding_window_layers(config) -> list[int]:
    """Layers that attend through a sliding window shorter than the model's context ([] = none).

    Mistral sets `sliding_window` for every layer; Qwen2/3 only with `use_sliding_window` (their config
    then lists "sliding_attention" in `layer_types` for layers >= max_window_layers). A window that
    covers max_position_embeddings never cuts anything off, so it counts as full attention.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return []
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    return list(range(config.num_hidden_layers))


def check_supported(config) -> None:
    """Raise ValueError unless our forward computes this config's attention exactly (before weights load)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={config.model_type!r} is not supported by decodelab's engine; "
            f"supported: {SUPPORTED_MODEL_TYPES}"
        )
    layers = sliding_window_layers(config)
    if layers:
        raise ValueError(
            f"model_type={config.model_type!r} uses sliding-window attention (sliding_window={config.sliding_window} "
            f"on {len(layers)} of {config.num_hidden_layers} layers, max_position_embeddings="
            f"{config.max_position_embeddings}); decodelab's engine attends over the whole cache and would decode "
            "it wrongly. Allowed: models without a sliding window, or with a window >= max_position_embeddings"
        )


class KVCache:
    """Preallocated per-row KV cache: keys/values (n_layers, B, K, S_max, D), lengths (B,).

    Row b's valid entries are positions [0, lengths[b]). Entries past a row's length are scratch:
    never attended, overwritten by the next write. So rollback is `crop` (set lengths) and costs nothing.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 *, dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._rows = torch.arange(batch_size, device=device)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return self.keys.numel() * self.keys.element_size() * 2

    def used_nbytes(self) -> int:
        """Bytes of keys and values that hold valid positions (analytic KV size of the batch)."""
        per_position = self.keys.shape[0] * self.keys.shape[2] * self.keys.shape[4] * self.keys.element_size() * 2
        return int(self.lengths.sum().item()) * per_position

    def crop(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back: (B,) long, each <= the current length."""
        self.lengths = new_lengths.to(self.lengths)

    def select(self, rows: torch.Tensor | list[int]) -> "KVCache":
        """A new cache holding only `rows` (in that order); copies their entries."""
        rows = torch.as_tensor(rows, device=self.lengths.device, dtype=torch.long)
        out = KVCache.__new__(KVCache)
        out.keys = self.keys[:, rows].clone()
        out.values = self.values[:, rows].clone()
        out.lengths = self.lengths[rows].clone()
        out._rows = torch.arange(len(rows), device=rows.device)
        return out

    def positions(self, n_tokens: int) -> torch.Tensor:
        """Cache positions of the next `n_tokens` tokens of each row: (B, T)."""
        return self.lengths[:, None] + torch.arange(n_tokens, device=self.lengths.device)

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Called once per forward with the new tokens' positions (B, T), before any layer attends.

        Works out what every layer shares (the visible span and mask), so the per-layer `attend` does no
        host sync. Query t of row b sees cache position j iff j <= positions[b, t].
        """
        span = int(positions[:, -1].max()) + 1  # the one host sync of a forward
        if span > self.max_len:
            raise ValueError(f"KV cache overflow: need {span} positions, max_len={self.max_len}")
        self._span = span
        self._visible = torch.arange(span, device=positions.device)[None, None, :] <= positions[:, :, None]

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Write this call's keys/values at `positions`, then attend causally over each row's valid prefix.

        q: (B, H, T, D); k_new, v_new: (B, K, T, D); positions: (B, T) -> (B, H, T, D).
        """
        keys, values = self.keys[slot], self.values[slot]
        rows = self._rows[:, None]
        keys[rows, :, positions] = k_new.transpose(1, 2)
        values[rows, :, positions] = v_new.transpose(1, 2)
        span = self._span
        return grouped_attention(q, keys[:, :, :span], values[:, :, :span], self._visible)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean visibility mask.

    q: (B, H, T, D); keys, values: (B, K, S, D); visible: (B, T, S) -> (B, H, T, D).
    The H/K query heads sharing one KV head are folded into the query axis, so each KV head is read once.
    """
    batch, n_heads, n_new, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    q = q.reshape(batch, n_kv, group * n_new, head_dim)
    mask = visible[:, None, :, :].expand(batch, 1, n_new, visible.shape[-1])
    mask = mask.repeat(1, 1, group, 1) if group > 1 else mask
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.reshape(batch, n_heads, n_new, head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Transformer(torch.nn.Module):
    """A decode forward over a transformers causal LM's modules (Llama, Qwen2/3, Mistral layouts)."""

    def __init__(self, hf_model):
        super().__init__()
        config = hf_model.config
        check_supported(config)
        self.hf_model = hf_model
        self.config = config
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.final_norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.rotary = inner.rotary_emb
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size

    @classmethod
    def from_hf(cls, hf_model) -> "Transformer":
        return cls(hf_model)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_len: int, n_layers: int | None = None) -> KVCache:
        return KVCache(n_layers or self.n_layers, batch_size, self.n_kv_heads, self.head_dim, max_len,
                       dtype=self.dtype, device=self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, E)"""
        return self.embed_tokens(tokens)

    def _attention(self, layer, slot: int, x: torch.Tensor, cos, sin, cache, positions) -> torch.Tensor:
        attn = layer.self_attn
        batch, n_new, _ = x.shape
        q = attn.q_proj(x).view(batch, n_new, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(batch, n_new, self.n_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(batch, n_new, self.n_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes q and k per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # RoPE: x * cos + rotate_half(x) * sin, with cos/sin (B, 1, T, D) for each row's own positions.
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = cache.attend(slot, q, k, v, positions)
        return attn.o_proj(out.transpose(1, 2).reshape(batch, n_new, self.n_heads * self.head_dim))

    def hidden_states(self, tokens: torch.Tensor, cache, *, layers=None) -> torch.Tensor:
        """Run the decoder stack (or the `layers` subset) on tokens: (B, T) -> final-normed (B, T, E)."""
        positions = cache.positions(tokens.shape[1])
        cache.begin_forward(positions)
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        layer_ids = range(self.n_layers) if layers is None else layers
        for slot, index in enumerate(layer_ids):
            layer = self.layers[index]
            x = x + self._attention(layer, slot, layer.input_layernorm(x), cos, sin, cache, positions)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.final_norm(x)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache, *, n_new: torch.Tensor | None = None, layers=None,
                logits_at: str = "all", return_hidden: bool = False):
        """Append `tokens` to each row of `cache` and return logits.

        tokens: (B, T) long; n_new: (B,) valid tokens per row (default T; right padding past it is scratch).
        logits_at: "all" -> (B, T, V); "last" -> each row's last valid token (B, V); "none" -> None.
        With return_hidden, returns (logits, hidden) where hidden (B, T, E) feeds the LM head.
        """
        batch, n_tokens = tokens.shape
        if n_new is None:
            n_new = torch.full((batch,), n_tokens, dtype=torch.long, device=tokens.device)
        hidden = self.hidden_states(tokens, cache, layers=layers)
        cache.crop(cache.lengths + n_new)
        if logits_at == "all":
            logits = self.lm_head(hidden)
        elif logits_at == "last":
            last = hidden[torch.arange(batch, device=hidden.device), n_new - 1]
            logits = self.lm_head(last)
        elif logits_at == "none":
            logits = None
        else:
            raise ValueError(f"logits_at={logits_at!r} must be 'all', 'last' or 'none'")
        return (logits, hidden) if return_hidden else logits
