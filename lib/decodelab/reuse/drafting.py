"""Trace-as-draft: an n-gram drafter that copies from retrieved earlier traces as well as from the prompt.

`TraceDrafter` implements `decodelab.speculation.drafters.Drafter`, so `speculation.decode.generate` verifies
its drafts and greedy output stays identical to plain greedy decoding (lossless). Per step and row it looks the
row's last n tokens (n = max_ngram .. min_ngram, longest first) up in the row's reference traces and proposes
what followed there; without a reference match it falls back to prompt lookup (`NGramDrafter`, the row's own
prompt + output). With no references it *is* prompt-only n-gram drafting, proposal for proposal.

It also counts, per row, the target forward passes it saw (one `propose` per decode step of an active row) and
how many accepted tokens came from a trace and how many from the prompt.
"""
from __future__ import annotations

import torch

from decodelab.speculation.drafters import DraftContext, DrafterBase, DraftProposal, NGramDrafter


class ReferenceIndex:
    """n-gram -> (reference, end) of its latest occurrence with a continuation, over a list of token sequences.

    References are indexed in order, so on equal n-grams the *last* reference wins: pass the most similar last.
    """

    def __init__(self, references: list[list[int]], max_ngram: int, min_ngram: int):
        self.references = [list(r) for r in references]
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: dict[tuple, tuple[int, int]] = {}
        for r, seq in enumerate(self.references):
            for end in range(1, len(seq)):  # seq[end] continues the n-gram ending before it
                for n in range(min_ngram, min(max_ngram, end) + 1):
                    self.index[tuple(seq[end - n:end])] = (r, end)

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `seq` found in a reference, or []."""
        return self.match(seq, k)[0]

    def match(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the longest suffix of `seq` found in a reference, that suffix's
        length); ([], 0) without a match."""
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            found = self.index.get(tuple(seq[len(seq) - n:]))
            if found is not None:
                r, end = found
                return self.references[r][end:end + k], n
        return [], 0


class TraceDrafter(DrafterBase):
    """Drafts from each row's reference traces first, then from its own prompt + output (prompt lookup).

    references: one list of token sequences per row (the retrieved traces, least similar first); [] for a row
    with no hit. trace_min_ngram: the shortest suffix that may match a trace (a 1-token match on a common
    word copies noise); the prompt-lookup fallback uses min_ngram.
    short_k: the most tokens drafted from a weak match: prompt lookup, or a trace matched on fewer than
    max_ngram tokens; only a trace matched on a full max_ngram-token suffix drafts up to the step's k (None:
    every draft up to k). A long draft is worth its verify width only where the trace is in step with the
    output; elsewhere a wide verify mostly checks tokens that will be rejected.
    """

    name = "trace"

    def __init__(self, references: list[list[list[int]]], *, max_ngram: int = 4, min_ngram: int = 1,
                 trace_min_ngram: int = 2, short_k: int | None = None, name: str = "trace"):
        if not 1 <= min_ngram <= max_ngram or not 1 <= trace_min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram!r}, trace_min_ngram={trace_min_ngram!r}, max_ngram={max_ngram!r}: "
                             "need 1 <= min_ngram, trace_min_ngram <= max_ngram")
        if short_k is not None and (isinstance(short_k, bool) or not isinstance(short_k, int) or short_k < 1):
            raise ValueError(f"short_k={short_k!r} must be None or an int >= 1 (draft tokens from a weak match)")
        self.name, self.short_k, self.max_ngram = name, short_k, max_ngram
        self.indices = [ReferenceIndex(refs, max_ngram, trace_min_ngram) for refs in references]
        self.prompt_lookup = NGramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.forwards = [0] * len(references)  # decode steps each row was active in
        self.accepted = {"trace": [0] * len(references), "prompt": [0] * len(references)}
        self._source: list[str | None] = [None] * len(references)

    def begin(self, prompts: list[list[int]], *, max_len: int = 0) -> None:
        if len(prompts) != len(self.indices):
            raise ValueError(f"TraceDrafter has references for {len(self.indices)} rows, got {len(prompts)} prompts")
        self.prompt_lookup.begin(prompts, max_len=max_len)

    def _propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        B = ctx.batch_size
        tokens = torch.zeros(B, k, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        for b, seq in enumerate(ctx.tokens):
            self._source[b] = None
            if ctx.active is not None and not bool(ctx.active[b]):
                continue
            self.forwards[b] += 1
            short = k if self.short_k is None else min(k, self.short_k)
            found, n = self.indices[b].match(seq, k)
            found, source = (found if n >= self.max_ngram else found[:short]), "trace"
            if not found:
                found, source = self.prompt_lookup.lookup(b, seq, short), "prompt"
            if found:
                tokens[b, :len(found)] = torch.tensor(found)
                lengths[b] = len(found)
                self._source[b] = source
            tokens[b, len(found):] = seq[-1]  # padding, always rejected
        return DraftProposal(tokens=tokens, probs=None, lengths=lengths)

    def rollback(self, n_accepted: torch.Tensor) -> None:
        for b, n in enumerate(n_accepted.tolist()):
            if self._source[b] is not None:
                self.accepted[self._source[b]][b] += int(n)
