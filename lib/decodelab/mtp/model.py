"""Multi-token prediction: extra heads on a causal LM, their memory-lean backward, and their use as drafters.

Two head designs share one trunk (a transformers `LlamaForCausalLM`, so the decode engine runs it):

- "gloeckle" (Gloeckle et al. 2024): head j (j = 2..n) is one transformer layer reading the trunk's
  final-normed hidden state h_i and predicting t_{i+j} through the shared final norm + unembedding.
  Head 1 is the trunk's own LM head. All heads read the same h, so they are independent given h.
- "deepseek" (DeepSeek-V3): module k (k = 1..n-1) is sequential:
      s^k_i = Block_k( W_k [RMSNorm(s^{k-1}_i); RMSNorm(Emb(t_{i+k}))] ),   s^0 = h,
  predicting t_{i+k+1} through the shared head, with loss weight lambda / (n - 1).

Placement note: the extra heads read the trunk's *final* hidden state (the input of its LM head), not
the state one layer below as in Gloeckle's figure. Drafting then needs only what the target's own
verify step computes (`return_hidden=True`), and parameter matching still trades n - 1 trunk layers for
n - 1 head layers (see `trunk_layers`).

The loss (`mtp_loss`) can backpropagate "sequential"ly (Gloeckle's memory trick): detach h, run each
head's forward + backward alone so its (B, T, V) logits are freed before the next head starts, sum the
gradients at h, then backpropagate the trunk once. Peak memory stays ~ one head's, not n heads'.

Shapes: B batch, T tokens, D hidden size, V vocabulary, n heads (head 1 = next token).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.core.native_rope import rotate_half
from decodelab.core.packed_linear import PackedLinears
from decodelab.core.transformer import gated_mlp, head_dim_of

STYLES = ("gloeckle", "deepseek")


BACKWARD_MODES = ("sequential", "joint", "none")


@dataclass
class MTPConfig:
    """What defines an MTP model (saved with checkpoints as mtp_config.json)."""

    style: str = "gloeckle"
    n_heads: int = 1  # 1 = plain next-token model
    mtp_weight: float | None = None  # loss weight of the extra heads; None -> 1.0 (gloeckle) / 0.3 (deepseek)
    # deepseek only: trunk layers (0-based, residual stream after the layer) fused with the final state into the
    # module's input, EAGLE-3 style; () = the final state alone
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        self.feature_layers = tuple(self.feature_layers)  # JSON gives a list
        if self.feature_layers and self.style != "deepseek":
            raise ValueError(f"feature_layers={self.feature_layers!r} needs mtp_style='deepseek' (got {self.style!r})")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.feature_layers):
            raise ValueError(f"feature_layers={self.feature_layers!r} must be trunk layer indices >= 0")
        if self.style not in STYLES:
            raise ValueError(f"mtp_style={self.style!r} must be one of {STYLES}")
        if not isinstance(self.n_heads, int) or self.n_heads < 1:
            raise ValueError(f"n_heads={self.n_heads!r} must be an int >= 1")
        if self.mtp_weight is not None and self.mtp_weight < 0:
            raise ValueError(f"mtp_weight={self.mtp_weight!r} must be >= 0")

    def head_weights(self) -> list[float]:
        """Loss weight per head, head 1 first: Gloeckle sums the heads; DeepSeek adds lambda/D * sum."""
        extra = self.n_heads - 1
        if self.style == "gloeckle":
            return [1.0] + [1.0 if self.mtp_weight is None else self.mtp_weight] * extra
        lam = 0.3 if self.mtp_weight is None else self.mtp_weight
        return [1.0] + [lam / extra] * extra if extra else [1.0]

    def as_dict(self) -> dict:
        return {**asdict(self), "feature_layers": list(self.feature_layers)}


def config_name(style: str, n_heads: int) -> str:
    """"ntp" for the next-token baseline, else "<style>-<n>" (e.g. "gloeckle-4")."""
    return "ntp" if n_heads == 1 else f"{style}-{n_heads}"


def trunk_layers(n_layers: int, n_heads: int, match_params: bool = True) -> int:
    """Trunk depth: with match_params, the n - 1 extra head layers are taken from an n_layers budget."""
    trunk = n_layers - (n_heads - 1) if match_params else n_layers
    if trunk < 1:
        raise ValueError(f"n_layers={n_layers} leaves no trunk layer for n_heads={n_heads} (needs n_layers >= n_heads)")
    return trunk


def build_trunk(*, vocab_size: int, d_model: int, n_layers: int, n_attn_heads: int = 4, n_kv_heads: int = 2,
                intermediate_size: int | None = None, max_len: int = 1024, seed: int = 0):
    """A freshly initialized LlamaForCausalLM (tied embeddings) from `decodelab.core.models.tiny_config`.

    Initialization is seeded without touching the caller's global RNG (fork_rng restores it).
    """
    from transformers import LlamaForCausalLM

    from decodelab.core.models import tiny_config

    if d_model % n_attn_heads:
        raise ValueError(f"d_model={d_model} must be divisible by n_attn_heads={n_attn_heads}")
    config = tiny_config(vocab_size=vocab_size, hidden_size=d_model, num_layers=n_layers, num_heads=n_attn_heads,
                         num_kv_heads=n_kv_heads, intermediate_size=intermediate_size or 3 * d_model,
                         max_position_embeddings=max_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def build_model(*, vocab_size: int, d_model: int, n_layers: int, n_heads: int, style: str = "gloeckle",
                match_params: bool = True, n_attn_heads: int = 4, n_kv_heads: int = 2, max_len: int = 1024,
                mtp_weight: float | None = None, seed: int = 0) -> "MTPModel":
    """A from-scratch MTP model; with match_params the n - 1 head layers come out of the n_layers budget."""
    trunk = build_trunk(vocab_size=vocab_size, d_model=d_model, n_attn_heads=n_attn_heads, n_kv_heads=n_kv_heads,
                        n_layers=trunk_layers(n_layers, n_heads, match_params), max_len=max_len, seed=seed)
    return MTPModel(trunk, MTPConfig(style=style, n_heads=n_heads, mtp_weight=mtp_weight), seed=seed)


def decoder_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config, attend,
                  linear: PackedLinears | None = None) -> torch.Tensor:
    """A Llama decoder layer, (B, T, D) -> (B, T, D): x + Attn(norm(x)), then + MLP(norm(.)).

    The same maths as `decodelab.core.transformer.Transformer`; RoPE with cos/sin (B, 1, T, d_head).
    attend(q (B, H, T, d), k, v (B, K, T, d)) -> (B, H, T, d) is the attention itself: causal over the
    sequence in training, through a KV cache when drafting. linear: how the linear layers run (a drafter's
    packed weights); None = the modules themselves (training: packed weights record no gradients).
    """
    mlp = layer.mlp if linear is None else (lambda y: gated_mlp(linear, layer.mlp, y))
    linear = linear or PackedLinears(False)
    attn = layer.self_attn
    batch, n_tok, _ = x.shape
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = head_dim_of(config)
    q, k, v = linear.group((attn.q_proj, attn.k_proj, attn.v_proj), layer.input_layernorm(x))
    q = q.view(batch, n_tok, n_heads, head_dim).transpose(1, 2)
    k = k.view(batch, n_tok, n_kv, head_dim).transpose(1, 2)
    v = v.view(batch, n_tok, n_kv, head_dim).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    out = attend(q, k, v)
    x = x + linear(attn.o_proj, out.transpose(1, 2).reshape(batch, n_tok, n_heads * head_dim))
    return x + mlp(layer.post_attention_layernorm(x))


def layer_forward(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config) -> torch.Tensor:
    """A Llama decoder layer over a whole causal sequence: (B, T, D) -> (B, T, D)."""
    gqa = config.num_key_value_heads != config.num_attention_heads
    return decoder_layer(layer, x, cos, sin, config,
                         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))


class DeepSeekModule(nn.Module):
    """One sequential MTP module: Block(W [RMSNorm(s); RMSNorm(emb)]): (B, T, D), (B, T, D) -> (B, T, D).

    n_features > 0 (EAGLE-3's fused input): s = F [RMSNorm(f_1); ...; RMSNorm(f_n); h], the trunk's
    intermediate states f_1..f_n (B, T, n D) fused with its final state h (`fuse`)."""

    def __init__(self, config, layer_idx: int, n_features: int = 0):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        super().__init__()
        d = config.hidden_size
        self.norm_state = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.norm_embed = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = LlamaDecoderLayer(config, layer_idx)
        self.n_features = n_features
        if n_features:
            # the residual streams below the final norm have very different scales per layer: normalize each
            self.norm_features = nn.ModuleList(LlamaRMSNorm(d, eps=config.rms_norm_eps) for _ in range(n_features))
            self.fuse = nn.Linear((n_features + 1) * d, d, bias=False)

    def fused(self, state: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """state (B, T, D), features (B, T, n D) or None -> the module's state input (B, T, D). None (a drafted
        position, where the trunk has not run): the state alone, as EAGLE-3 feeds its own output back."""
        if not self.n_features or features is None:
            return state
        parts = features.split(state.shape[-1], dim=-1)
        return self.fuse(torch.cat([norm(f) for norm, f in zip(self.norm_features, parts)] + [state], dim=-1))

    def combine(self, state: torch.Tensor, embedded: torch.Tensor,
                features: torch.Tensor | None = None) -> torch.Tensor:
        state = self.fused(state, features)
        return self.proj(torch.cat([self.norm_state(state), self.norm_embed(embedded)], dim=-1))


class MTPModel(nn.Module):
    """A trunk LlamaForCausalLM plus n - 1 extra heads (Gloeckle layers or DeepSeek modules).

    frozen_trunk=True is the retrofit setting (Medusa-1): the trunk, its embedding, final norm and
    LM head get no gradients and are never modified; only the extra heads train.
    identity_init (default: frozen_trunk) starts every head as the identity on its input (zero output
    projections; DeepSeek's W = [I, 0]), as Medusa zero-initializes its heads: a retrofit head then
    starts from the model's own next-token guess instead of noise.
    """

    def __init__(self, trunk, config: MTPConfig, *, frozen_trunk: bool = False, seed: int = 0,
                 identity_init: bool | None = None):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        super().__init__()
        self.trunk = trunk
        self.config = config
        self.frozen_trunk = frozen_trunk
        tc = trunk.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            if config.style == "gloeckle":
                heads = [LlamaDecoderLayer(tc, tc.num_hidden_layers + j) for j in range(config.n_heads - 1)]
            else:
                heads = [DeepSeekModule(tc, tc.num_hidden_layers + j, len(config.feature_layers))
                         for j in range(config.n_heads - 1)]
        self.heads = nn.ModuleList(heads).to(device=trunk.device, dtype=trunk.dtype)
        if frozen_trunk if identity_init is None else identity_init:
            self._identity_init()
        if frozen_trunk:
            trunk.requires_grad_(False)

    @torch.no_grad()
    def _identity_init(self) -> None:
        for module in self.heads:
            layer = module if self.config.style == "gloeckle" else module.block
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            if self.config.style == "deepseek":
                d = module.proj.weight.shape[0]
                module.proj.weight.zero_()
                module.proj.weight[:, :d].copy_(torch.eye(d))
                if module.n_features:  # F = [0, ..., 0, I]: the fused state starts as the final state alone
                    module.fuse.weight.zero_()
                    module.fuse.weight[:, -d:].copy_(torch.eye(d))

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    @property
    def device(self) -> torch.device:
        return self.trunk.device

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    # -- forward pieces ------------------------------------------------------------------------
    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Trunk: (B, T) -> final-normed hidden (B, T, D), the input of the LM head."""
        ctx = torch.no_grad() if self.frozen_trunk else contextlib.nullcontext()
        with ctx:
            return self.trunk.model(input_ids=tokens).last_hidden_state

    def rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (1, 1, T, d_head) for positions 0..T-1 of x (B, T, D)."""
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.trunk.model.rotary_emb(x, positions)
        return cos[:, None], sin[:, None]

    def unembed(self, state: torch.Tensor, head: int) -> torch.Tensor:
        """(B, T, D) -> (B, T, V). Head 1 reads the already-normed h; extra heads go through the final norm."""
        if head == 1:
            return self.trunk.lm_head(state)
        return self.trunk.lm_head(self.trunk.model.norm(state))

    def head_state(self, j: int, source: torch.Tensor, tokens: torch.Tensor,
                   features: torch.Tensor | None = None) -> torch.Tensor:
        """Head j >= 2's state before unembedding.

        gloeckle: source = h (B, T, D) -> Layer_j(h) (B, T, D).
        deepseek: source = s^{j-2} (B, T-j+2, D) -> s^{j-1} (B, T-j+1, D), reading Emb(t_{i+j-1});
        features (B, T, n D): the trunk's `feature_layers` states (module 1 of a fused config only).
        """
        module = self.heads[j - 2]
        if self.config.style == "gloeckle":
            cos, sin = self.rope(source)
            return layer_forward(module, source, cos, sin, self.trunk.config)
        k = j - 1  # module depth
        length = tokens.shape[1] - k
        embedded = self.trunk.model.embed_tokens(tokens[:, k:k + length])
        x = module.combine(source[:, :length], embedded, None if features is None else features[:, :length])
        cos, sin = self.rope(x)
        return layer_forward(module.block, x, cos, sin, self.trunk.config)

    def head_logits(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> list[torch.Tensor]:
        """All heads' logits: head j -> (B, T_j, V), position i predicting t_{i+j}.

        hidden (B, T, D), optional: precomputed trunk states (frozen trunk only) instead of running it.
        """
        h = self.hidden(tokens) if hidden is None else hidden
        out, source = [self.unembed(h, 1)], h
        for j in range(2, self.n_heads + 1):
            state = self.head_state(j, h if self.config.style == "gloeckle" else source, tokens)
            source = state
            out.append(self.unembed(state, j))
        return out


def head_loss(logits: torch.Tensor, tokens: torch.Tensor, j: int) -> torch.Tensor:
    """Mean cross-entropy of head j: logits (B, T', V) at positions i predict tokens[:, i + j]."""
    n_valid = tokens.shape[1] - j
    if n_valid < 1:
        raise ValueError(f"seq_len={tokens.shape[1]} is too short for head {j}: needs seq_len > n_heads")
    logits = logits[:, :n_valid]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, j:j + n_valid].reshape(-1))


def mtp_loss(model: MTPModel, tokens: torch.Tensor, *, backward: str = "sequential",
             hidden: torch.Tensor | None = None) -> dict:
    """Per-head losses of one batch, optionally backpropagated: tokens (B, T) -> {"loss", "head_losses"}.

    backward:
      "sequential"  Gloeckle's memory-lean order. h_d = h.detach() (leaf); for each head j:
                    loss_j(head_j(h_d)).backward() frees head j's graph and adds dL_j/dh into h_d.grad;
                    finally h.backward(h_d.grad) runs the trunk once with sum_j dL_j/dh. DeepSeek modules
                    are chained, so each module's output is detached too (its logits freed right away) and
                    the module graphs are backpropagated last to first.
      "joint"       one graph: sum_j w_j loss_j, then a single backward (all heads' logits alive at once).
      "none"        forward only (evaluation).
    Gradients equal sum_j w_j dL_j/dtheta in both backward modes (up to float summation order).
    hidden (B, T, D), optional: precomputed trunk states, for a frozen trunk (retrofit) only.
    """
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward={backward!r} must be one of {BACKWARD_MODES}")
    if hidden is not None and not model.frozen_trunk:
        raise ValueError("hidden= is only valid for a frozen trunk (retrofit): a trained trunk must run")
    weights = model.config.head_weights()
    if backward != "sequential":
        ctx = torch.no_grad() if backward == "none" else contextlib.nullcontext()
        with ctx:
            all_logits = model.head_logits(tokens, hidden=hidden)
            losses = [head_loss(lg, tokens, j) for j, lg in enumerate(all_logits, start=1)]
            total = sum(w * loss for w, loss in zip(weights, losses))
        if backward == "joint":
            total.backward()
        return {"loss": float(total.detach()), "head_losses": [float(x.detach()) for x in losses]}

    h = model.hidden(tokens) if hidden is None else hidden
    trunk_needs_grad = h.requires_grad
    h_d = h.detach().requires_grad_(True)
    losses, chain = [], []  # chain: (module output, its detached leaf) for DeepSeek, backpropagated last
    source = h_d
    for j in range(1, model.n_heads + 1):
        if j == 1:
            state = h_d
        else:
            state = model.head_state(j, h_d if model.config.style == "gloeckle" else source, tokens)
            if model.config.style == "deepseek":
                leaf = state.detach().requires_grad_(True)
                chain.append((state, leaf))
                state = source = leaf
        if j == 1 and not trunk_needs_grad:  # frozen trunk (retrofit): head 1 trains nothing; skip its
            losses.append(float("nan"))      # (B, T, V) logits (evaluate() still reports its loss)
            continue
        loss = head_loss(model.unembed(state, j), tokens, j)
        (weights[j - 1] * loss).backward()  # frees this head's (B, T, V) logits now
        losses.append(float(loss.detach()))
    for state, leaf in reversed(chain):  # module k's leaf.grad is complete once module k+1 has run
        if leaf.grad is not None:
            state.backward(leaf.grad)
    if trunk_needs_grad and h_d.grad is not None:
        h.backward(h_d.grad)
    total = sum(w * loss for w, loss in zip(weights, losses) if loss == loss)  # NaN: skipped head 1
    return {"loss": total, "head_losses": losses}
