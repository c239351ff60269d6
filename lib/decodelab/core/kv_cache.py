"""The cache seam: the `AttentionCache` protocol every KV cache implements, its per-forward `ForwardPlan`,
the per-row `KVCache`, and grouped-query attention over it.

A forward of T new tokens per row runs, for every cache kind (standard, shared-prefix, tree):

    plan = cache.begin_forward(positions, group=H // K)   # once: span, masks, write slots (one host sync)
    for each layer:  out = cache.attend(slot, q, k_new, v_new, plan)
    cache.advance(n_new)                                   # count the valid new positions

and speculative rollback is `cache.truncate(lengths)` (only ever shortening a row: it costs nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass
class ForwardPlan:
    """What every layer of one forward shares, computed once by `begin_forward`.

    positions (B, T): RoPE positions of the new tokens; slots (B, T): where their keys/values are written;
    span: key positions [0, span) the layers read; visible (B, T, S=span) bool: query t of row b sees key j.
    The grouped-query mask (B, 1, G*T, S) is built once per group size G and then reused by every layer.
    rows (n,) long or None: only these rows' attention outputs are wanted (finished rows riding along:
    `Transformer.hidden_states(rows=)`); a plain KVCache then reads only their keys and values.
    start: set when every row writes its one new token at the same slot (a decode step of rows with equal
    lengths, always at batch 1): that slot, so a layer writes a slice instead of scattering by index.
    """

    positions: torch.Tensor
    slots: torch.Tensor
    span: int
    visible: torch.Tensor
    rows: torch.Tensor | None = None
    start: int | None = None
    _grouped: dict = field(default_factory=dict, repr=False)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """(B, 1, G*T, S) bool: `visible` repeated over the G query heads that share one KV head."""
        if group not in self._grouped:
            self._grouped[group] = grouped_mask(self.visible, group)
        return self._grouped[group]

    def row_runs(self) -> list[tuple[int, int]]:
        """`rows` as maximal runs of consecutive rows [(start, stop), ...], built once per forward."""
        if "runs" not in self._grouped:
            runs = []
            for r in sorted(self.rows.tolist()):
                if runs and runs[-1][1] == r:
                    runs[-1][1] = r + 1
                else:
                    runs.append([r, r + 1])
            self._grouped["runs"] = [tuple(run) for run in runs]
        return self._grouped["runs"]

    def attention_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """(B, 1, G*T, S) additive mask (0 where visible, -inf where not) in the queries' dtype, or None when
        every query sees every key of the span, built once per forward and shared by every layer.

        Why not the bool mask: SDPA turns a bool mask into exactly this additive one with a `where` on every
        call, i.e. once per layer (30 per forward); and an all-visible mask (a decode step of rows with equal
        lengths) is better left out: SDPA without a mask gives the same output (adding 0.0 changes no score)
        and skips reading the mask."""
        key = ("bias", group, dtype)
        if key not in self._grouped:
            mask = self.grouped_mask(group)
            self._grouped[key] = None if bool(mask.all()) else additive_bias(mask, dtype)
        return self._grouped[key]


@runtime_checkable
class AttentionCache(Protocol):
    """The interface `Transformer.forward` drives (structural: KVCache, SharedPrefixKVCache, TreeCache).

    lengths (B,) long: valid positions per row. positions(T) -> (B, T) positions of the next T tokens.
    begin_forward(positions, group) -> ForwardPlan, once per forward before any layer attends.
    attend(slot, q (B, H, T, D), k_new, v_new (B, K, T, D), plan) -> (B, H, T, D), once per layer.
    advance(n_new (B,)) after the forward; truncate(lengths (B,)) rolls rows back, never forward.
    """

    lengths: torch.Tensor

    @property
    def max_len(self) -> int: ...

    def positions(self, n_tokens: int) -> torch.Tensor: ...

    def begin_forward(self, positions: torch.Tensor, group: int = 1) -> ForwardPlan: ...

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               plan: ForwardPlan) -> torch.Tensor: ...

    def advance(self, n_new: torch.Tensor) -> None: ...

    def truncate(self, new_lengths: torch.Tensor) -> None: ...


def check_truncate(new_lengths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """new_lengths (B,) as `lengths`' dtype/device; ValueError when a row would grow (truncate never writes)."""
    new_lengths = new_lengths.to(lengths)
    if bool((new_lengths > lengths).any()):
        raise ValueError(f"truncate only rolls rows back; got new lengths {new_lengths.tolist()} for current "
                         f"lengths {lengths.tolist()} (use advance to count written positions)")
    return new_lengths


def causal_visible(span: int, slots: torch.Tensor) -> torch.Tensor:
    """(B, T) slots -> (B, T, span) bool: query t of row b sees slot j iff j <= slots[b, t]."""
    return torch.arange(span, device=slots.device)[None, None, :] <= slots[:, :, None]


class KVCache:
    """Preallocated per-row KV cache: keys/values (n_layers, B, K, S_max, D), lengths (B,).

    Row b's valid entries are positions [0, lengths[b]). Entries past a row's length are scratch:
    never attended, overwritten by the next write. So rollback is `truncate` (set lengths) and costs nothing.
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

    def advance(self, n_new: torch.Tensor) -> None:
        """Count n_new (B,) freshly written positions of each row as valid."""
        self.lengths = self.lengths + n_new.to(self.lengths)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to new_lengths (B,) long, each <= the current length (rejected drafts cost nothing)."""
        self.lengths = check_truncate(new_lengths, self.lengths)

    def select(self, rows: torch.Tensor | list[int]) -> "KVCache":
        """A new cache holding only `rows` (in that order); copies their entries."""
        rows = torch.as_tensor(rows, device=self.lengths.device, dtype=torch.long)
        out = KVCache.__new__(KVCache)
        if len(rows) > 1 and bool((rows == rows[0]).all()):
            # one row replicated (a shared document's prefill): a broadcast copy, ~4x index_select's speed here
            # (3 GB of a 4096-token row into 16 rows: ~0.9 vs ~3.5 s)
            one = rows[:1]
            shape = (self.keys.shape[0], len(rows), *self.keys.shape[2:])
            out.keys = self.keys.index_select(1, one).expand(shape).contiguous()
            out.values = self.values.index_select(1, one).expand(shape).contiguous()
        else:
            out.keys = self.keys.index_select(1, rows)  # one copy (indexing then cloning wrote every byte twice)
            out.values = self.values.index_select(1, rows)
        out.lengths = self.lengths[rows].clone()
        out._rows = torch.arange(len(rows), device=rows.device)
        return out

    def copy(self) -> "KVCache":
        """A copy of every row in order: `select` of all rows, at about twice its speed (a plain copy of the
        storage, where index_select gathers; ~0.3 vs ~0.65 s for 1.5 GB of keys here)."""
        out = KVCache.__new__(KVCache)
        out.keys, out.values = self.keys.clone(), self.values.clone()
        out.lengths = self.lengths.clone()
        out._rows = torch.arange(len(out.lengths), device=out.lengths.device)
        return out

    def first_rows(self, batch: int) -> "KVCache":
        """Rows [0, batch) as a cache that shares this one's storage (views: its writes land here) and has its own
        lengths: for runs that write only positions past the rows' lengths and truncate back (a benchmark
        decoding several batches of one prefill), where a copy would cost as much as reading the whole KV."""
        if not 1 <= batch <= self.batch_size:
            raise ValueError(f"batch={batch} must be in [1, {self.batch_size}]")
        out = KVCache.__new__(KVCache)
        out.keys, out.values = self.keys[:, :batch], self.values[:, :batch]
        out.lengths = self.lengths[:batch].clone()
        out._rows = self._rows[:batch]
        return out

    def room(self) -> int:
        """How many tokens per row the next forward may write: the free positions of the longest row."""
        return self.max_len - int(self.lengths.max())

    def positions(self, n_tokens: int) -> torch.Tensor:
        """Cache positions of the next `n_tokens` tokens of each row: (B, T)."""
        return self.lengths[:, None] + torch.arange(n_tokens, device=self.lengths.device)

    def begin_forward(self, positions: torch.Tensor, group: int = 1) -> ForwardPlan:
        """The plan of one forward of tokens at `positions` (B, T): span, visibility and the grouped mask,
        so the per-layer `attend` does no host sync and builds no mask. Query t of row b sees cache
        position j iff j <= positions[b, t]."""
        last, first = torch.stack((positions[:, -1].max(), positions[:, 0].min())).tolist()  # the one host sync
        span = last + 1
        if span > self.max_len:
            raise ValueError(f"KV cache overflow: need {span} positions, max_len={self.max_len}")
        plan = ForwardPlan(positions=positions, slots=positions, span=span, visible=causal_visible(span, positions),
                           start=first if positions.shape[1] == 1 and first == last else None)
        plan.grouped_mask(group)
        return plan

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               plan: ForwardPlan) -> torch.Tensor:
        """Write this call's keys/values at the plan's slots, then attend causally over each row's valid prefix.

        q: (B, H, T, D); k_new, v_new: (B, K, T, D); plan: from `begin_forward` -> (B, H, T, D).
        """
        keys, values = self.keys[slot], self.values[slot]
        if plan.start is not None:  # the same values as the scatter below, as two slice copies (~10 us less each)
            keys[:, :, plan.start:plan.start + 1] = k_new
            values[:, :, plan.start:plan.start + 1] = v_new
        else:
            rows = self._rows[:, None]
            keys[rows, :, plan.slots] = k_new.transpose(1, 2)
            values[rows, :, plan.slots] = v_new.transpose(1, 2)
        span = plan.span
        if plan.rows is not None:
            # only the live rows' outputs are wanted: read only their keys and values, run by run of consecutive
            # rows through views (copying them out would write as many bytes as it reads: at long context the
            # first step after a row finishes would cost twice the KV read)
            bias = plan.attention_bias(q.shape[1] // keys.shape[1], q.dtype)
            out = q.new_zeros(q.shape)
            for a, b in plan.row_runs():
                out[a:b] = grouped_attention_masked(q[a:b], keys[a:b, :, :span], values[a:b, :, :span],
                                                    None if bias is None else bias[a:b])
            return out
        if q.shape[0] == 1 and q.shape[2] == 1 and q.dtype in (torch.bfloat16, torch.float16):
            # Batch-1 decode sees every key of its span. In half precision SDPA rounds the unfolded (1, H, 1, D)
            # call differently from the folded (1, K, G, D) one; the unfolded call is transformers', so greedy
            # tokens match it token for token (fp32 matches either way and keeps the faster folded call).
            return F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], enable_gqa=True)
        bias = plan.attention_bias(q.shape[1] // keys.shape[1], q.dtype)
        return grouped_attention_masked(q, keys[:, :, :span], values[:, :, :span], bias)


def grouped_mask(visible: torch.Tensor, group: int) -> torch.Tensor:
    """(B, T, S) bool -> (B, 1, G*T, S): the mask of the G*T folded queries of one KV head."""
    batch, n_new, span = visible.shape
    mask = visible[:, None, :, :].expand(batch, 1, n_new, span)
    return mask.repeat(1, 1, group, 1) if group > 1 else mask


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> the same shape in `dtype`: 0 where True, -inf where False (what SDPA adds to the scores)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def grouped_attention_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention with a mask already folded by `grouped_mask`.

    q: (B, H, T, D); keys, values: (B, K, S, D); mask: (B, 1, G*T, S) bool, or the same additive in q's
    dtype (`additive_bias`), or None (every key visible) -> (B, H, T, D).
    The H/K query heads sharing one KV head are folded into the query axis, so each KV head is read once.
    """
    batch, n_heads, n_new, head_dim = q.shape
    n_kv = keys.shape[1]
    q = q.reshape(batch, n_kv, (n_heads // n_kv) * n_new, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.reshape(batch, n_heads, n_new, head_dim)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean visibility mask, folding the mask on every call (a standalone
    reference; the forward folds it once per forward through its `ForwardPlan`).

    q: (B, H, T, D); keys, values: (B, K, S, D); visible: (B, T, S) -> (B, H, T, D).
    """
    return grouped_attention_masked(q, keys, values, grouped_mask(visible, q.shape[1] // keys.shape[1]))


def check_sink_window(sink: int, window: int, context: int | None = None) -> None:
    """ValueError unless sink >= 0 and window >= 1 are ints and (given a context) sink + window <= context:
    a sparse view as wide as the context is just the full cache."""
    for name, value, low in (("sink", sink, 0), ("window", window, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    if context is not None and sink + window > context:
        raise ValueError(f"sink={sink} + window={window} = {sink + window} positions is larger than the context "
                         f"({context} tokens, the shortest prompt): allowed sink + window <= {context}")


class SinkWindowKVCache(KVCache):
    """A per-row KV cache that stores only what a sink + window forward reads (StreamingLLM's attention sinks +
    sliding window, Xiao et al. 2024): positions [0, sink) and a ring of the latest window + spare positions.
    A forward's attention reads those C = sink + window + spare stored entries per row, contiguous (no gather),
    however long the context. Query at position q sees a stored position j iff j <= q and (j < sink or
    q - j < window).

    `lengths` stay logical (a row's token count, its next RoPE position) and `max_len` is the logical limit.
    Rollback is `truncate`, as in KVCache, while no row's furthest written position runs more than `spare` past
    its length: then the ring has overwritten nothing a later query can see (each forward checks: ValueError).
    stored (B, C) long: the position each slot holds (-1: none)."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int, *, sink: int,
                 window: int, spare: int = 32, dtype: torch.dtype, device: torch.device):
        check_sink_window(sink, window)
        if not isinstance(spare, int) or isinstance(spare, bool) or spare < 1:
            raise ValueError(f"spare={spare!r} must be an int >= 1")
        super().__init__(n_layers, batch_size, n_kv_heads, head_dim, sink + window + spare, dtype=dtype,
                         device=device)
        self.sink, self.window, self.spare, self._max_len = sink, window, spare, max_len
        self.stored = torch.full((batch_size, sink + window + spare), -1, dtype=torch.long, device=device)
        self.written = torch.zeros(batch_size, dtype=torch.long, device=device)  # one past each row's furthest write

    @classmethod
    def from_cache(cls, cache: KVCache, *, sink: int, window: int, spare: int = 32, max_len: int | None = None,
                   layers=None, dtype: torch.dtype | None = None) -> "SinkWindowKVCache":
        """The sink and the latest window + spare positions of each row of a full `cache` (of its `layers`;
        None: all), copied (cast to `dtype`; None: the cache's); max_len: the logical limit (None: cache's)."""
        layers = slice(None) if layers is None else torch.as_tensor(list(layers), dtype=torch.long)
        keys, values = cache.keys[layers], cache.values[layers]
        n_layers, batch, n_kv, _, head_dim = keys.shape
        out = cls(n_layers, batch, n_kv, head_dim, max_len or cache.max_len, sink=sink, window=window, spare=spare,
                  dtype=dtype or keys.dtype, device=keys.device)
        lengths = cache.lengths.clone()
        held = out.held_positions(lengths)  # (B, C)
        source, rows = held.clamp(min=0), out._rows[:, None]
        out.keys.copy_(keys[:, rows, :, source].permute(2, 0, 3, 1, 4))  # (B, C, L, K, D) -> (L, B, K, C, D)
        out.values.copy_(values[:, rows, :, source].permute(2, 0, 3, 1, 4))
        out.stored, out.lengths, out.written = held, lengths, lengths.clone()
        return out

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def ring(self) -> int:
        return self.window + self.spare

    def used_nbytes(self) -> int:
        per_slot = self.keys.shape[0] * self.keys.shape[2] * self.keys.shape[4] * self.keys.element_size() * 2
        return int((self.stored >= 0).sum().item()) * per_slot

    def slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Where each position lives: itself in the sink, else sink + (position - sink) mod ring."""
        return torch.where(positions < self.sink, positions, self.sink + (positions - self.sink) % self.ring)

    def held_positions(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) lengths -> (B, C): the position each slot holds once positions [0, length) were written in
        order (-1: none), i.e. the latest position below the length that maps to it."""
        slot = torch.arange(self.keys.shape[3], device=lengths.device)
        offset = (slot - self.sink).clamp(min=0)
        latest = self.sink + offset + self.ring * torch.div(lengths[:, None] - 1 - self.sink - offset, self.ring,
                                                            rounding_mode="floor")
        held = torch.where(slot < self.sink, slot.expand_as(latest), latest)
        keep = (held < lengths[:, None]) & ((slot < self.sink) | (held >= self.sink))
        return torch.where(keep, held, -1)

    def room(self) -> int:
        return min(super().room(), self.spare)  # a forward reaches max(written, length + T) - length

    def begin_forward(self, positions: torch.Tensor, group: int = 1) -> ForwardPlan:
        written = torch.maximum(self.written, positions[:, -1] + 1)
        span, ahead = torch.stack([positions[:, -1].max() + 1, (written - self.lengths).max()]).tolist()
        if span > self.max_len:
            raise ValueError(f"KV cache overflow: need {span} positions, max_len={self.max_len}")
        if ahead > self.spare:
            raise ValueError(f"a sink + window cache keeps {self.spare} positions past each row's length; this "
                             f"forward (with any rollback before it) reaches {ahead}: forward fewer tokens at once "
                             f"or build the cache with a larger spare")
        slots = self.slot_of(positions)
        self.stored[self._rows[:, None], slots] = positions
        self.written = written
        j, q = self.stored[:, None, :], positions[:, :, None]
        visible = (j >= 0) & (j <= q) & ((j < self.sink) | (q - j < self.window))
        plan = ForwardPlan(positions=positions, slots=slots, span=self.keys.shape[3], visible=visible)
        plan.grouped_mask(group)
        return plan

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               plan: ForwardPlan) -> torch.Tensor:
        keys, values = self.keys[slot], self.values[slot]
        rows = self._rows[:, None]
        keys[rows, :, plan.slots] = k_new.transpose(1, 2)
        values[rows, :, plan.slots] = v_new.transpose(1, 2)
        return grouped_attention_masked(q, keys, values, plan.attention_bias(q.shape[1] // keys.shape[1], q.dtype))
