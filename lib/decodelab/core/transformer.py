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

from decodelab.core import native_norm, native_rope
from decodelab.core.kv_cache import AttentionCache, ForwardPlan, KVCache
from decodelab.core.packed_linear import PackedLinears, packing_available

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def head_dim_of(config) -> int:
    """Per-head width of a transformers config: its `head_dim` when set (Qwen3, Gemma), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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


# transformers' RMSNorm of the supported families: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)
_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for a transformers RMSNorm: torch's rms_norm without a weight computes in float32 and rounds to
    x's dtype as transformers does, then the weight multiplies in x's dtype (bit for bit equal in fp32 and
    bf16, tested). On CPU one C call computes the same values (`native_norm`: torch runs ~10 ops a call, ~4 ms
    of a bf16 batch-1 step). Other norms run as themselves."""
    if type(norm).__name__ not in _RMS_NORMS:
        return norm(x)
    fused = native_norm.rms_norm(norm.weight, x, norm.variance_epsilon)
    return fused if fused is not None else native_norm.reference(norm.weight, x, norm.variance_epsilon)


def gated_mlp(linear: PackedLinears, mlp, x: torch.Tensor) -> torch.Tensor:
    """A transformers LlamaMLP exactly as it computes, down(act(gate(x)) * up(x)), with gate and up as one
    call through `linear` (packed weights, or the modules themselves when packing is off)."""
    gate, up = linear.group((mlp.gate_proj, mlp.up_proj), x)
    return linear(mlp.down_proj, mlp.act_fn(gate) * up)


class Transformer(torch.nn.Module):
    """A decode forward over a transformers causal LM's modules (Llama, Qwen2/3, Mistral layouts)."""

    def __init__(self, hf_model, *, pack_linears: bool | None = None):
        """pack_linears: run linear layers through once-packed oneDNN weights (see `core.packed_linear`);
        None = whenever the model is fp32, or bf16 on a CPU that supports it."""
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
        self.head_dim = head_dim_of(config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        if pack_linears is None:
            pack_linears = packing_available(self.device, self.dtype)
        self.linear = PackedLinears(pack_linears)

    @classmethod
    def from_hf(cls, hf_model, **options) -> "Transformer":
        return cls(hf_model, **options)

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

    def _attention(self, layer, slot: int, x: torch.Tensor, cos, sin, cache: AttentionCache,
                   plan: ForwardPlan, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Normed x (B, T, E) -> the attention block's output (B, T, E), or (n, T, E) for `rows` only (see
        `hidden_states`: the other rows' queries, keys and values are zeros, their outputs are not computed)."""
        attn = layer.self_attn
        batch, n_new, _ = x.shape
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        if rows is None:
            qkv = self.linear.fused(projections, x)
        else:
            part = self.linear.fused(projections, x.index_select(0, rows))
            qkv = x.new_zeros(batch, n_new, part.shape[-1]).index_copy_(0, rows, part)
        # q and k side by side: (B, T, H + K, D); RoPE is elementwise with the same cos/sin for every head.
        qk = qkv[..., :(heads + kv_heads) * dim].view(batch, n_new, heads + kv_heads, dim)
        v = qkv[..., (heads + kv_heads) * dim:].view(batch, n_new, kv_heads, dim).transpose(1, 2)
        if "q_norm" in attn._modules:  # Qwen3 normalizes q and k per head (own weights) before RoPE
            q, k = qk.split([heads, kv_heads], dim=2)
            qk = torch.cat([attn.q_norm(q), attn.k_norm(k)], dim=2)
        qk = qk.transpose(1, 2)
        # RoPE: x * cos + rotate_half(x) * sin, with cos/sin (B, 1, T, D) for each row's own positions, on q
        # and k at once (half the small ops of two calls, the same numbers); on CPU in one C call (`native_rope`).
        rotated = native_rope.rope(qk, cos, sin)
        qk = rotated if rotated is not None else native_rope.reference(qk, cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        out = cache.attend(slot, q, k, v, plan).transpose(1, 2).reshape(batch, n_new, self.n_heads * self.head_dim)
        return self.linear(attn.o_proj, out if rows is None else out.index_select(0, rows))

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self.linear, mlp, x)

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden (..., E) -> logits (..., V) in float32.

        The LM head runs in the weights' dtype (a bf16 kernel accumulates in fp32 and rounds its output to
        bf16, as transformers' bf16 forward does, so greedy ties break the same way); the logits are
        returned in fp32 so softmax, log-probs and samplers work in fp32."""
        return self.linear(self.lm_head, hidden).float()

    def hidden_states(self, tokens: torch.Tensor, cache: AttentionCache, *, layers=None,
                      capture_layers=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder stack (or the `layers` subset) on tokens: (B, T) -> final-normed (B, T, E).

        capture_layers: layer indices whose output residual stream (un-normed) is returned too, side by side
        after the final-normed state: (B, T, E (1 + len(capture_layers))) (an EAGLE-3 drafter's features).
        Writes the tokens' keys/values into `cache` but leaves its lengths alone (`forward` advances them).

        rows: (n,) long, the batch rows whose states are wanted (finished rows riding along in a batch are
        not): the linear layers and the MLP run on those rows alone, and attention too on a plain KVCache
        (`ForwardPlan.rows`; other caches attend every row); the other rows write zero keys and values into
        scratch past their lengths and keep their embeddings as states. A row's result equals the whole
        batch's row where the linear path is row-invariant (`forward` checks)."""
        positions = cache.positions(tokens.shape[1])
        plan = cache.begin_forward(positions, group=self.n_heads // self.n_kv_heads)  # once per forward
        plan.rows = rows
        x = self.embed_tokens(tokens)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        layer_ids = range(self.n_layers) if layers is None else layers
        captured, stack = {}, list(self.layers)  # a list indexes faster than the ModuleList, once per layer
        for slot, index in enumerate(layer_ids):
            layer = stack[index]
            if rows is not None:
                live = x.index_select(0, rows)
                live = live + self._attention(layer, slot, rms_norm(layer.input_layernorm, x), cos, sin, cache, plan,
                                              rows)
                x = x.index_copy(0, rows, live + self._mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, live)))
                continue
            x = x + self._attention(layer, slot, rms_norm(layer.input_layernorm, x), cos, sin, cache, plan)
            x = x + self._mlp(layer.mlp, rms_norm(layer.post_attention_layernorm, x))
            if capture_layers is not None and index in capture_layers:
                captured[index] = x
        if capture_layers is None:
            return rms_norm(self.final_norm, x)
        missing = [i for i in capture_layers if i not in captured]
        if missing:
            raise ValueError(f"capture_layers={tuple(capture_layers)!r}: layers {missing} are not run by this forward "
                             f"(layers={layers!r}; allowed: indices of the layers it runs)")
        return torch.cat([rms_norm(self.final_norm, x)] + [captured[i] for i in capture_layers], dim=-1)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: AttentionCache, *, n_new: torch.Tensor | None = None, layers=None,
                logits_at: str = "all", return_hidden: bool = False, capture_layers=None,
                rows: torch.Tensor | None = None):
        """Append `tokens` to each row of `cache` and return logits.

        tokens: (B, T) long; n_new: (B,) valid tokens per row (default T; right padding past it is scratch).
        logits_at: "all" -> (B, T, V); "last" -> each row's last valid token (B, V); "none" -> None.
        With return_hidden, returns (logits, hidden) where hidden (B, T, E) feeds the LM head.
        capture_layers (with return_hidden): hidden is (B, T, E (1 + n)), the final-normed state first, then the
        residual stream after each of these layers (`hidden_states`); the logits are the same either way.
        rows: (n,) long, the rows whose outputs are wanted (see `hidden_states`; logits_at "all" only): the
        other rows' logits are zeros; every row's cache advances. Only on the row-invariant linear path (the
        packed CPU one, `core.packed_linear`), where those rows' logits equal the whole batch's bit for bit.
        """
        batch, n_tokens = tokens.shape
        if rows is not None and not (self.linear.enabled and logits_at == "all" and capture_layers is None):
            raise ValueError("rows= needs the packed CPU linear path (row-invariant), logits_at='all' and no "
                             f"capture_layers; got packed={self.linear.enabled}, logits_at={logits_at!r}")
        if n_new is None:
            n_new = torch.full((batch,), n_tokens, dtype=torch.long, device=tokens.device)
        hidden = self.hidden_states(tokens, cache, layers=layers, capture_layers=capture_layers, rows=rows)
        cache.advance(n_new)
        final = hidden if capture_layers is None else hidden[..., :self.hidden_size]
        if rows is not None:
            logits = self.unembed(final.index_select(0, rows))
            logits = logits.new_zeros((batch, *logits.shape[1:])).index_copy_(0, rows, logits)
            return (logits, hidden) if return_hidden else logits
        logits = self.forward_logits(final, n_new, logits_at)
        return (logits, hidden) if return_hidden else logits

    def forward_logits(self, hidden: torch.Tensor, n_new: torch.Tensor, logits_at: str):
        """`forward`'s logits of final-normed hidden (B, T, E): "all" (B, T, V), "last" (B, V), "none" None."""
        if logits_at == "all":
            return self.unembed(hidden)
        if logits_at == "last":
            return self.unembed(hidden[torch.arange(hidden.shape[0], device=hidden.device), n_new - 1])
        if logits_at == "none":
            return None
        raise ValueError(f"logits_at={logits_at!r} must be 'all', 'last' or 'none'")


class CapturingTransformer(Transformer):
    """The target for a fused (EAGLE-3-style) module: whenever the loop asks for hidden states it gets
    (B, T, D (1 + n)), the final-normed state first, then the residual stream after each of `capture_layers`
    (`Transformer.forward(capture_layers=...)`); logits, cache and tokens are the plain Transformer's, and
    the speculative loop carries the wider states to the drafter unchanged (it only slices rows and positions)."""

    def __init__(self, hf_model, capture_layers: tuple[int, ...], **options):
        super().__init__(hf_model, **options)
        self.capture_layers = tuple(capture_layers)

    def forward(self, tokens, cache, *, return_hidden: bool = False, capture_layers=None, **kwargs):
        if return_hidden and capture_layers is None:
            capture_layers = self.capture_layers
        return super().forward(tokens, cache, return_hidden=return_hidden, capture_layers=capture_layers, **kwargs)

    def unembed(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., E) or the wide (..., E (1 + n)) states -> logits (..., V) of the final-normed part."""
        return super().unembed(hidden[..., :self.hidden_size])
