"""A drafter's LM head over part of the vocabulary (FR-Spec, Zhao et al. 2025): drafts that cost little to unembed.

Why: at batch 1 the retrofit module's own block reads ~7 MB of fp32 weights and the tied LM head 113 MB, so
one draft over the whole vocabulary costs about a quarter of a target step, and three chained drafts most of
one: measured on the embedded model (code editing, k = 3), proposing took 42 ms of a 46 ms verify step. The
drafts are only proposals. Verification keeps greedy output identical, and speculative sampling stays exact
for any proposal distribution q, one that is zero outside a subset included: the residual max(p - q, 0) gives
the target's mass on tokens q never proposes. A target token outside the subset is just never drafted.

The subset: the vocabulary's first `size` ids (a BPE vocabulary is numbered in merge order, so low ids are its
frequent pieces; no corpus needed) plus every token of the batch's prompts (code edits and extractions copy
them). The notebook logs how much of the target's own output the subset covers.

Shapes: B rows, E hidden size, V vocabulary, n subset size.
"""
from __future__ import annotations

import torch
from torch import nn

from decodelab.core.packed_linear import PackedLinears, packing_available


def subset_ids(vocab_size: int, size: int, prompts: list[list[int]]) -> torch.Tensor:
    """(n,) long, sorted: ids 0..size-1 and every id in `prompts` (ids outside [0, vocab_size) are refused)."""
    extra = sorted({t for row in prompts for t in row})
    if extra and not (0 <= extra[0] and extra[-1] < vocab_size):
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}); got {extra[0]}..{extra[-1]}")
    ids = torch.arange(min(size, vocab_size))
    return torch.unique(torch.cat([ids, torch.tensor(extra, dtype=torch.long)])) if extra else ids


def coverage(vocab_size: int, size: int | None, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Fraction of the tokens in `outputs` (row b continues prompts[b]) that row b's subset holds: the share of
    the target's own choices a part-vocabulary drafter could draft at all (1.0 for the whole vocabulary)."""
    if size is None or size >= vocab_size:
        return 1.0
    inside = total = 0
    for prompt, row in zip(prompts, outputs, strict=True):
        held = set(subset_ids(vocab_size, size, [prompt]).tolist())
        inside += sum(t in held for t in row)
        total += len(row)
    return inside / total if total else float("nan")


class DraftHead:
    """norm + LM head of the trunk for drafting, over the whole vocabulary (size None) or a subset.

    Runs through once-packed weights where the machine has them (`core.packed_linear`; the module itself
    elsewhere). `begin(prompts)` fixes the subset for a batch; `pick(state, sampler, generator)` drafts."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, size: int | None = None,
                 linear: PackedLinears | None = None):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"draft_vocab={size!r} must be None (the whole vocabulary) or an int >= 1")
        self.norm, self.lm_head, self.size = norm, lm_head, size
        weight = lm_head.weight
        self.vocab_size = weight.shape[0]
        self.linear = linear or PackedLinears(packing_available(weight.device, weight.dtype))
        self.ids: torch.Tensor | None = None  # None: the whole vocabulary
        self._sub: nn.Linear | None = None
        self._sub_linear: PackedLinears | None = None

    def begin(self, prompts: list[list[int]]) -> None:
        if self.size is None or self.size >= self.vocab_size:
            self.ids, self._sub = None, None
            return
        ids = subset_ids(self.vocab_size, self.size, prompts).to(self.lm_head.weight.device)
        if self.ids is not None and torch.equal(ids, self.ids):
            return  # same subset: keep the packed copy
        with torch.inference_mode(False), torch.no_grad():  # packing reads the weight's version counter
            sub = nn.Linear(self.lm_head.in_features, ids.numel(), bias=self.lm_head.bias is not None, device="meta")
            sub.weight = nn.Parameter(self.lm_head.weight.detach()[ids], requires_grad=False)
            if self.lm_head.bias is not None:
                sub.bias = nn.Parameter(self.lm_head.bias.detach()[ids], requires_grad=False)
        # its own packed copy, freed with it (the shared `linear` outlives every batch's subset)
        self.ids, self._sub, self._sub_linear = ids, sub, PackedLinears(self.linear.enabled)

    @property
    def n_tokens(self) -> int:
        return self.vocab_size if self.ids is None else self.ids.numel()

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Un-normed state (..., E) -> fp32 logits (..., n) over the subset (`ids`), or (..., V) over all."""
        if self._sub is None:
            return self.linear(self.lm_head, self.norm(state)).float()
        return self._sub_linear(self._sub, self.norm(state)).float()

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """Subset logits (..., n) -> (..., V), -inf outside the subset (a sampler then gives those ids q = 0)."""
        if self.ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, logits)

    def pick(self, state: torch.Tensor, sampler=None, generator=None):
        """state (B, E) -> (tokens (B,), probs (B, V) or None): greedy argmax over the subset, or `sampler`'s
        draw and probabilities over the full-width logits (zero outside the subset)."""
        logits = self.logits(state)
        if sampler is None:
            best = logits.argmax(-1)
            return (best if self.ids is None else self.ids[best]), None
        full = self.full(logits)
        return sampler.sample(full, generator), sampler.probs(full)
