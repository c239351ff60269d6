"""A KV cache over a token trie: every node attends to its ancestors only, so one forward scores a whole tree."""
from __future__ import annotations

import torch

from decodelab.core.kv_cache import ForwardPlan, check_truncate, grouped_attention_masked


class TreeCache:
    """A KV cache for scoring a token tree in chunks: an `AttentionCache` like `KVCache`.

    Slots [0, P) hold the prompt; trie node i (i >= 1) lives in slot P + i - 1. A chunk of nodes sees the
    prompt plus each node's ancestors (and itself); RoPE positions are P + depth - 1. Batch size 1.
    """

    def __init__(self, base, prompt_len: int, parents: list[int], depths: list[int]):
        self.base = base
        self.prompt_len = prompt_len
        self.lengths = base.lengths
        n = len(parents)
        # ancestors[i, j]: node j is node i or an ancestor of it (j >= 1); parents-first order lets one pass fill it
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i in range(1, n):
            if parents[i] > 0:
                ancestors[i] = ancestors[parents[i]]
            ancestors[i, i] = True
        self._ancestors = ancestors[:, 1:]  # columns: slots P + 0 .. P + n - 2
        self._depths = torch.tensor(depths, dtype=torch.long)
        self._chunk: tuple[int, int] | None = None

    def set_chunk(self, start: int, stop: int) -> None:
        """The next forward scores nodes [start, stop) (all ancestors already in the cache or in the chunk)."""
        self._chunk = (start, stop)

    def positions(self, n_tokens: int) -> torch.Tensor:
        start, stop = self._chunk
        assert stop - start == n_tokens
        return (self.prompt_len + self._depths[start:stop] - 1)[None].to(self.lengths.device)

    @property
    def max_len(self) -> int:
        return self.base.max_len

    def begin_forward(self, positions: torch.Tensor, group: int = 1) -> ForwardPlan:
        """The chunk's plan: write slots P + i - 1, and a mask showing each node the prompt + its ancestors."""
        start, stop = self._chunk
        span = self.prompt_len + stop - 1
        if span > self.base.max_len:
            raise ValueError(f"KV cache overflow: need {span} positions, max_len={self.base.max_len}")
        visible = torch.zeros(1, stop - start, span, dtype=torch.bool)
        visible[0, :, : self.prompt_len] = True
        visible[0, :, self.prompt_len:] = self._ancestors[start:stop, : stop - 1]
        device = self.lengths.device
        slots = torch.arange(self.prompt_len + start - 1, self.prompt_len + stop - 1, device=device)[None]
        plan = ForwardPlan(positions=positions, slots=slots, span=span, visible=visible.to(device))
        plan.grouped_mask(group)
        return plan

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               plan: ForwardPlan) -> torch.Tensor:
        """Write the chunk's keys/values at their slots, attend over prompt + ancestors. Shapes as KVCache.attend."""
        keys, values = self.base.keys[slot], self.base.values[slot]
        where = plan.slots[0]
        keys[0, :, where] = k_new[0]
        values[0, :, where] = v_new[0]
        mask = plan.attention_bias(q.shape[1] // keys.shape[1], q.dtype)  # additive, built once per forward
        return grouped_attention_masked(q, keys[:, :, : plan.span], values[:, :, : plan.span], mask)

    def advance(self, n_new: torch.Tensor) -> None:
        """Count the chunk's nodes (the tree's slots are fixed by node index; lengths only keep the count)."""
        self.lengths = self.lengths + n_new.to(self.lengths)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        self.lengths = check_truncate(new_lengths, self.lengths)
