"""MTP heads as a drafter: the trained heads propose k tokens that the speculative loop verifies."""
from __future__ import annotations

import weakref

import torch

from decodelab.core.packed_linear import PackedLinears, packing_available
from decodelab.core.transformer import CapturingTransformer, Transformer, head_dim_of
from decodelab.mtp.draft_head import DraftHead, coverage
from decodelab.mtp.model import MTPModel, decoder_layer

# -- drafting ----------------------------------------------------------------------------------------
_PACKED = weakref.WeakKeyDictionary()  # MTPModel -> its PackedLinears, shared by the drafters made from it


def packed_linears(model: MTPModel) -> PackedLinears:
    """One `PackedLinears` per model, so each new drafter (one per generate call) does not pack it again."""
    if model not in _PACKED:
        weight = model.trunk.lm_head.weight
        _PACKED[model] = PackedLinears(packing_available(weight.device, weight.dtype))
    return _PACKED[model]


def layer_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, slot: int,
               plan, config, linear=None) -> torch.Tensor:
    """`layer_forward` with a KV cache (decodelab.core.kv_cache.KVCache slot): (B, T, D) -> (B, T, D).

    cos, sin: (B, 1, T, d_head) for the plan's positions; plan: `cache.begin_forward(positions, group)`;
    linear: a `PackedLinears` (None: the modules themselves).
    """
    return decoder_layer(layer, x, cos, sin, config, lambda q, k, v: cache.attend(slot, q, k, v, plan), linear)


class MTPDrafter:
    """The trained heads as a drafter (`decodelab.speculation.drafters.Drafter` protocol): head j drafts t_{p+j}.

    The heads are transformer layers, so they keep their own KV cache over the target's positions.
    `observe(hidden, n_new, next_tokens)` appends the target's final-normed states of the positions it just
    added to its cache; `propose` then unembeds each head's state at the last position (cheap: no
    forward beyond the heads). Head j >= 2 gives draft j - 1, so k <= n_heads - 1 real drafts
    (more are padding, marked by `lengths`).

    The heads attend over every earlier position, so they need the target's state at *every* position
    it caches, not only the last: the DraftContext fields `new_hidden` (B, T, D) + `new_hidden_lengths` (B,),
    which the speculative policy on the engine's loop fills for `needs_hidden` drafters, give them that.
    A loop that sets only `ctx.last_hidden` makes the drafter observe that one position per step:
    proposals stay valid, but the heads' context has gaps and acceptance drops.
    DeepSeek modules draft with depth 1 only (module 2 would need an unverified draft as input), unless
    `reuse=True` (one module, as DeepSeek-V3 ships it and vLLM reuses it): draft d then feeds the next step,
    EAGLE-style, as position p + d: input [RMSNorm(s^(d)); RMSNorm(Emb(draft_d))] with the module's own state
    standing in for the target's unknown one, attending over the verified positions' cache plus the chain
    (written past the cache's length, so the next `observe` overwrites it: nothing to roll back).

    draft_vocab: drafts come from the first `draft_vocab` ids plus the batch's prompt tokens only
    (`decodelab.mtp.draft_head`, FR-Spec), which cuts the LM head's cost per draft; None = every id.
    The module's linear layers and the head run through packed weights where the machine has them.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, model: MTPModel, *, reuse: bool = False, draft_vocab: int | None = None):
        if model.n_heads < 2:
            raise ValueError(f"n_heads={model.n_heads} has no extra head to draft with (needs >= 2)")
        if model.config.style == "deepseek" and model.n_heads > 2:
            raise ValueError(f"mtp_style='deepseek' drafts with depth 1 only; got n_heads={model.n_heads} (allowed: 2)")
        if reuse and model.config.style != "deepseek":
            raise ValueError(f"reuse=True chains one DeepSeek module; mtp_style={model.config.style!r} has "
                             "independent heads (allowed: reuse=False)")
        self.model = model
        self.reuse = reuse
        self.head = DraftHead(model.trunk.model.norm, model.trunk.lm_head, draft_vocab, packed_linears(model))
        self.linear = self.head.linear
        self.cache = None
        self._last = None
        self._fed = False

    def begin(self, prompts: list[list[int]], *, max_len: int) -> None:
        from decodelab.core.kv_cache import KVCache

        tc = self.model.trunk.config
        room = 16 if self.reuse else 0  # the chained drafts are written past the verified positions
        self.cache = KVCache(len(self.model.heads), len(prompts), tc.num_key_value_heads, head_dim_of(tc),
                             max_len + room,
                             dtype=self.model.trunk.dtype, device=self.model.device)
        self._last, self._fed = None, False
        self.head.begin(prompts)

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, n_new: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """hidden (B, T, D): target states of positions appended since the last call (row b: n_new[b] valid,
        n_new[b] may be 0); next_tokens (B, T): the token that follows each of those positions."""
        model, cache = self.model, self.cache
        n_new = n_new.to(cache.lengths)
        positions = cache.positions(hidden.shape[1])
        tc = model.trunk.config
        plan = cache.begin_forward(positions, group=tc.num_attention_heads // tc.num_key_value_heads)
        cos, sin = model.trunk.model.rotary_emb(hidden, positions)
        cos, sin = cos[:, None].to(hidden.dtype), sin[:, None].to(hidden.dtype)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = (n_new - 1).clamp_min(0)
        hidden, features = self._split(hidden)
        states = []
        for slot, module in enumerate(model.heads):
            if model.config.style == "gloeckle":
                x, layer = hidden, module
            else:  # depth-1 module: [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))] (h_i fused with features, if any)
                x, layer = module.combine(hidden, model.trunk.model.embed_tokens(next_tokens), features), module.block
            out = layer_step(layer, x, cos, sin, cache, slot, plan, model.trunk.config, self.linear)
            states.append(out[rows, last])
        cache.advance(n_new)
        new_last = torch.stack(states)  # (n_heads - 1, B, D)
        keep = (n_new > 0)[None, :, None]
        self._last = new_last if self._last is None else torch.where(keep, new_last, self._last)
        self._fed = True

    @torch.inference_mode()
    def propose(self, ctx, k: int):
        from decodelab.speculation.drafters import DraftProposal

        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r} must be an int >= 1")
        if not self._fed and ctx.new_hidden is not None:  # DraftContext.new_hidden: every newly cached state
            self.observe(ctx.new_hidden, ctx.new_hidden_lengths,
                         self._following(ctx.tokens, ctx.new_hidden_lengths, ctx.new_hidden.shape[1]))
        elif not self._fed:  # a loop that gives only the last position's state
            if ctx.last_hidden is None:
                raise ValueError("MTPDrafter needs ctx.new_hidden or ctx.last_hidden (needs_hidden=True), "
                                 "or an observe() before propose; the context carried neither")
            pending = torch.tensor([row[-1] for row in ctx.tokens], device=self.model.device)
            ones = torch.ones(ctx.batch_size, dtype=torch.long, device=self.model.device)
            self.observe(ctx.last_hidden[:, None].to(self.model.trunk.dtype), ones, pending[:, None])
        self._fed = False
        if self.reuse:
            tokens, probs = self._chain(ctx, k)
            n_real = k
        else:
            n_real = min(k, self._last.shape[0])  # self._last (n_heads - 1, B, D): one state per head
            picks = [self._pick(self._last[i], ctx) for i in range(n_real)]
            tokens = torch.stack([token for token, _ in picks], dim=1)  # (B, n_real)
            probs = None if ctx.sampler is None else torch.stack([p for _, p in picks], dim=1)
        lengths = None
        if n_real < k:  # pad: verification rejects positions past `lengths`
            pad = tokens[:, -1:].expand(-1, k - n_real)
            tokens = torch.cat([tokens, pad], dim=1)
            if probs is not None:
                probs = torch.cat([probs, probs[:, -1:].expand(-1, k - n_real, -1)], dim=1)
            lengths = torch.full((tokens.shape[0],), n_real, dtype=torch.long, device=tokens.device)
        return DraftProposal(tokens=tokens, probs=probs, lengths=lengths)

    def _split(self, hidden: torch.Tensor):
        """The loop's states (B, T, D) or, for a fused module, (B, T, D (1 + n)) -> (final (B, T, D), features
        (B, T, n D) or None)."""
        layers = self.model.config.feature_layers
        d = self.model.trunk.config.hidden_size
        if not layers:
            return hidden, None
        if hidden.shape[-1] != d * (1 + len(layers)):
            raise ValueError(f"this module fuses trunk layers {layers} (EAGLE-3), so it needs states of width "
                             f"{d * (1 + len(layers))} (final + captured layers); the loop gave width "
                             f"{hidden.shape[-1]}: "
                             "verify with drafter.target() (a CapturingTransformer), not the plain Transformer")
        return hidden[..., :d], hidden[..., d:]

    def _pick(self, state: torch.Tensor, ctx):
        """A head's state (B, D) -> (token (B,), probs (B, V) or None): greedy, or the loop's sampler."""
        return self.head.pick(state, ctx.sampler, ctx.generator)

    def _chain(self, ctx, k: int):
        """k drafts from the one module reused (see the class docstring): -> tokens (B, k), probs (B, k, V) | None."""
        model, cache = self.model, self.cache
        module, tc = model.heads[0], model.trunk.config
        state = self._last[0]  # (B, D): the module's state at the last verified position
        token, p = self._pick(state, ctx)
        tokens, probs = [token], [p]
        for depth in range(1, k):
            positions = cache.lengths[:, None] + (depth - 1)  # (B, 1): p + depth
            plan = cache.begin_forward(positions, group=tc.num_attention_heads // tc.num_key_value_heads)
            x = module.combine(state[:, None], model.trunk.model.embed_tokens(token[:, None]))
            cos, sin = model.trunk.model.rotary_emb(x, positions)
            state = layer_step(module.block, x, cos[:, None].to(x.dtype), sin[:, None].to(x.dtype), cache, 0, plan,
                               tc, self.linear)[:, 0]
            token, p = self._pick(state, ctx)
            tokens.append(token)
            probs.append(p)
        return torch.stack(tokens, 1), None if ctx.sampler is None else torch.stack(probs, 1)

    def _following(self, tokens: list[list[int]], lengths: torch.Tensor, width: int) -> torch.Tensor:
        """(B, width) the token after each newly cached position: row b's last lengths[b] cached positions
        are len(tokens[b]) - 1 - lengths[b] .. len(tokens[b]) - 2 (the pending token is not cached yet)."""
        out = torch.zeros((len(tokens), width), dtype=torch.long)
        for b, (row, n) in enumerate(zip(tokens, lengths.tolist())):
            if n:
                out[b, :n] = torch.tensor(row[len(row) - n:])
        return out.to(self.model.device)

    def target(self):
        """The trunk as the engine's `Transformer`: the model these heads draft for (a `CapturingTransformer`
        for a fused module, so the loop hands it the layers it reads)."""
        if self.model.config.feature_layers:
            return CapturingTransformer(self.model.trunk, self.model.config.feature_layers)
        return Transformer.from_hf(self.model.trunk)

    def vocab_coverage(self, prompts: list[list[int]], outputs: list[list[int]]) -> float:
        """Share of `outputs`' tokens (continuing `prompts`) that this drafter's vocabulary could draft."""
        return coverage(self.head.vocab_size, self.head.size, prompts, outputs)

    def rollback(self, n_accepted: torch.Tensor) -> None:
        """Nothing to undo: the heads' cache only ever holds positions the target accepted."""

    def __repr__(self) -> str:
        return (f"MTPDrafter(style={self.model.config.style!r}, n_heads={self.model.n_heads}, reuse={self.reuse}, "
                f"draft_vocab={self.head.size})")


def load_mtp_drafter(checkpoint_dir, *, device=None, trunk=None, reuse: bool = False) -> MTPDrafter:
    """A checkpoint written by `decodelab.mtp.checkpoint.save_checkpoint` -> its heads as an `MTPDrafter`.

    From-scratch checkpoints carry their trunk (`drafter.target()` is the model to verify with);
    retrofit checkpoints load the frozen model they name, or use `trunk` (a LlamaForCausalLM) if given.
    """
    from decodelab.mtp.checkpoint import load_checkpoint

    return MTPDrafter(load_checkpoint(checkpoint_dir, device=device, trunk=trunk), reuse=reuse)
