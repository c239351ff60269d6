"""Self-speculation with a sparse KV (MagicDec, Chen et al. 2025; StreamingLLM, Xiao et al. 2024): the target's
own layers draft while attending only to the attention-sink positions and a recent window of the context, so
a draft step reads sink + window cache positions per row instead of the whole context. At long context and
high batch the KV read dominates a step's bytes, so such a draft costs a fraction of a target step.

`SparseKVDrafter` keeps its own `SinkWindowKVCache`: the sink and the latest window of the target's exact
full-attention KV of the prompt (prefilled with dense attention, so those entries are the target's own), in a
ring that every later forward (catch-up and drafts) updates and attends to, so a draft forward neither reads
nor copies the rest of the context. `prefill_once` prefills rows that share a prompt prefix once
and replicates its KV, which both this drafter and the long-context sweep use.
"""
from __future__ import annotations

import torch

from decodelab.core.engine import as_transformer, extend, pad_prompts
from decodelab.core.kv_cache import KVCache, SinkWindowKVCache, check_sink_window
from decodelab.speculation.drafters import CachedModelDrafter

DEFAULT_SINK = 4  # StreamingLLM keeps 4 initial tokens as attention sinks
DEFAULT_WINDOW = 256  # recent positions each draft query sees


def common_prefix_length(prompts: list[list[int]]) -> int:
    """Length of the longest token prefix every prompt shares, kept one short of the shortest prompt so
    every row still feeds at least its last token (whose logits start decoding)."""
    shortest = min(map(len, prompts))
    n = 0
    while n < shortest - 1 and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


@torch.inference_mode()
def prefill_once(model, prompts: list[list[int]], *, max_len: int, layers=None, return_hidden: bool = False):
    """Prefill B prompts sharing a prefix: the prefix once (batch 1), its KV replicated into B rows, then every
    row's own suffix in one ragged forward. -> (cache, last logits (B, V)) [+ hidden (B, T, E) of every prompt
    position, right-padded, with return_hidden]. Same cache contents as a B-row prefill (up to float rounding
    of the batched products); `max_len` sizes the cache."""
    tr = as_transformer(model)
    n_layers = None if layers is None else len(layers)
    shared = common_prefix_length(prompts)
    cache = tr.new_cache(1, max_len, n_layers=n_layers)
    head_hidden = None
    if shared:
        head = torch.tensor([prompts[0][:shared]], device=tr.device)
        out = extend(tr, cache, head, layers=layers, logits_at="none", return_hidden=return_hidden)
        head_hidden = out[1] if return_hidden else None
    cache = cache.select([0] * len(prompts))
    tokens, lengths = pad_prompts([p[shared:] for p in prompts], tr.device)
    out = extend(tr, cache, tokens, n_new=lengths, layers=layers, logits_at="last", return_hidden=return_hidden)
    if not return_hidden:
        return cache, out
    logits, tail_hidden = out
    if head_hidden is not None:
        tail_hidden = torch.cat([head_hidden.expand(len(prompts), -1, -1), tail_hidden], dim=1)
    return cache, logits, tail_hidden


class SparseKVDrafter(CachedModelDrafter):
    """The target's own `layers` (None: all) + its final norm and head, drafting with attention over only
    `sink` initial + `window` recent positions of each row (its own cache of the target's prompt KV).

    Bad input: sink < 0, window < 1, or sink + window larger than the shortest prompt (then the "sparse"
    view is the whole context) raise ValueError at `begin`, before any forward."""

    SPARE = 32  # ring positions past a row's length: room for a catch-up forward plus the drafts rolled back
    relative_cost = None  # no cost prior for a policy: it reads the target's weights, but its point is the KV it skips

    def __init__(self, model, *, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW, layers=None):
        check_sink_window(sink, window)
        tr = as_transformer(model)
        layers = None if layers is None else list(layers)
        if layers is not None and (not layers or any(not 0 <= i < tr.n_layers for i in layers)
                                   or layers != sorted(set(layers))):
            raise ValueError(f"layers={layers!r} must be a non-empty increasing list of indices in [0, {tr.n_layers})")
        super().__init__(tr, layers=layers, name="sparse_kv")
        self.sink, self.window = sink, window
        self.prompt_cache: KVCache | None = None

    def share(self, prompt_cache: KVCache) -> "SparseKVDrafter":
        """Start every `begin` from a copy of the target's own prefill of the same prompts (its lengths must
        be the prompts' lengths) instead of prefilling again: the entries are the same full-attention KV."""
        self.prompt_cache = prompt_cache
        return self

    def begin(self, prompts: list[list[int]], *, max_len: int) -> None:
        check_sink_window(self.sink, self.window, context=min(map(len, prompts)))
        if self.prompt_cache is not None and self.prompt_cache.lengths.tolist() == [len(p) for p in prompts]:
            source, layers = self.prompt_cache, self.layers
        else:  # a prefill of only the drafting layers
            source, layers = prefill_once(self.tr, prompts, max_len=max(map(len, prompts)), layers=self.layers)[0], None
        self.cache: KVCache = SinkWindowKVCache.from_cache(source, sink=self.sink, window=self.window,
                                                           spare=self.SPARE, max_len=max_len + self.CATCHUP,
                                                           layers=layers, dtype=self.tr.dtype)
