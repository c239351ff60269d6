"""Step reuse (SpecReason-style, lossy): propose a retrieved trace's next reasoning step, let the target judge it.

At each step boundary (a token closing a sentence or a line, `align.is_step_end`) row b proposes step i of its
retrieved trace (numbers and names substituted, `align.substitute`), i = the steps the row has completed (when
the target's own token already opened the step, the rest of it). One
target forward scores [pending, s_1..s_m]: logits[:, j] is the target's distribution for s_{j+1}, and the last
gives the token after the step. With g = exp(mean_j log p(s_j)), the geometric-mean probability of the step:

    g >= threshold  -> accept the whole step, + the target's own token after it        (lossy)
    else            -> accept the longest prefix the target's argmax agrees with, + its correction (lossless)

So threshold = 1 never accepts a step the target would not have written: output equals plain greedy decoding.
Between boundaries (and after the trace runs out) no step is proposed; there the row drafts *losslessly* from its
reference traces (token-level speculation under the step-level one, as Lookahead Reasoning stacks them): the
tokens that followed the output's n-gram suffix in a trace, cut before the first step end, kept only as far as
the target's argmax agrees. Those drafts never change a token (each kept one is the target's own greedy choice)
and never skip a step boundary (a step end is only ever emitted as the target's own token or a step's last), so
the output is exactly what the policy without drafts writes; only the forwards fall. Without references the rows
decode plainly between steps. This is a `LoopPolicy` of the engine's one token loop (`engine.run_loop`), not a
loop of its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from decodelab.core import engine
from decodelab.core.engine import DecodeStats, Feed, TokenLoop
from decodelab.core.sampling import argmax_rows
from decodelab.reuse.align import is_step_end
from decodelab.reuse.drafting import ReferenceIndex


@dataclass
class StepStats(DecodeStats):
    """DecodeStats + per row: target forwards (prefill included), tokens taken from the trace, steps proposed,
    steps accepted whole by the threshold."""

    forwards: list[int] = field(default_factory=list)
    reused_tokens: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    accepted_steps: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # g of every proposed step


class StepReusePolicy:
    """The step-reuse step as a `LoopPolicy`. steps[b]: row b's trace cut into token steps ([] = no trace);
    piece(token) -> its text (to find step ends); threshold: on g, the step's geometric-mean probability.
    references[b]: token sequences row b drafts from losslessly between steps (None or [] = plain steps there),
    at most draft_k tokens a step, matched on an output suffix of max_ngram down to min_ngram tokens."""

    extra, compact = 0, False

    def __init__(self, steps: list[list[list[int]]], piece, threshold: float, stats: StepStats,
                 references: list[list[list[int]]] | None = None, *, draft_k: int = 8, max_ngram: int = 4,
                 min_ngram: int = 2):
        self.steps, self.piece, self.threshold, self.stats = steps, piece, threshold, stats
        B = len(steps)
        if references is not None and len(references) != B:
            raise ValueError(f"references has {len(references)} rows; steps has {B}: need one list per row")
        stats.forwards, stats.reused_tokens = [1] * B, [0] * B
        stats.proposed, stats.accepted_steps = [0] * B, [0] * B
        self.indices = [ReferenceIndex(r, max_ngram, min_ngram) for r in references] if references else None
        self.draft_k = draft_k if self.indices else 0
        self.max_step = max((len(s) for row in steps for s in row), default=1)
        self.extra = max(self.max_step, self.draft_k) + 1  # a proposal's width beyond max_new_tokens

    def _proposal(self, loop: TokenLoop, b: int) -> list[int]:
        """Row b's draft after its pending token (the last of its output): after a step end, the next trace
        step whole; when the pending token opens a step (the target's own first token, or the one after an
        accepted step), that step's remainder if the trace's step opens with the same token."""
        out, steps = loop.tokens[b], self.steps[b]
        ends = [is_step_end(self.piece(t)) for t in out]
        if ends[-1]:
            i = sum(ends)  # steps completed, the pending token's included
            return steps[i] if i < len(steps) else []
        if len(out) == 1 or ends[-2]:  # the pending token opens step i
            i = sum(ends[:-1])
            if i < len(steps) and len(steps[i]) > 1 and steps[i][0] == out[-1]:
                return steps[i][1:]
        return []

    def _draft(self, loop: TokenLoop, b: int) -> list[int]:
        """Row b's lossless draft where no step is proposed: what followed its output's suffix in a reference,
        up to draft_k tokens, cut before the first step end (so every step boundary is still the target's own
        token and gets its step proposal as without drafts)."""
        if not self.draft_k:
            return []
        found = self.indices[b].lookup(loop.tokens[b], self.draft_k)
        return next((found[:j] for j, t in enumerate(found) if is_step_end(self.piece(t))), found)

    def first(self, loop: TokenLoop, logits: torch.Tensor) -> dict[int, list[int]]:
        self.pending = argmax_rows(logits)
        return {b: [t] for b, t in enumerate(self.pending.tolist())}

    def feed(self, loop: TokenLoop) -> Feed:
        self.old = loop.cache.lengths.clone()
        self.drafts = [self._proposal(loop, b) if not loop.done[b] else [] for b in range(loop.batch)]
        self.lossy = [bool(d) for d in self.drafts]  # a step proposal (threshold-gated); else a lossless draft
        self.drafts = [d if d or loop.done[b] else self._draft(loop, b) for b, d in enumerate(self.drafts)]
        width = max(map(len, self.drafts))
        tokens = torch.zeros(loop.batch, width + 1, dtype=torch.long)
        tokens[:, 0] = self.pending.cpu()
        for b, d in enumerate(self.drafts):
            if d:
                tokens[b, 1:len(d) + 1] = torch.tensor(d)
        return Feed(tokens.to(loop.device), mode="all" if width else "step")

    def accept(self, loop: TokenLoop, logits: torch.Tensor, hidden) -> dict[int, list[int]]:
        if logits.dim() == 2:
            logits = logits[:, None]
        choice = logits.argmax(-1).tolist()  # (B, W+1)
        logp = torch.log_softmax(logits.float(), dim=-1)
        kept, emitted = [], {}
        for b in range(loop.batch):
            d = self.drafts[b]
            n = 0
            if d and not loop.done[b] and not self.lossy[b]:
                while n < len(d) and choice[b][n] == d[n]:
                    n += 1
                self.stats.reused_tokens[b] += min(n, loop.max_new_tokens - len(loop.tokens[b]))
            elif d and not loop.done[b]:
                g = math.exp(float(logp[b, torch.arange(len(d)), torch.tensor(d)].mean()))
                self.stats.scores.append(g)
                self.stats.proposed[b] += 1
                while n < len(d) and choice[b][n] == d[n]:  # the lossless part: the target's own argmax
                    n += 1
                if g >= self.threshold and n < len(d):
                    n = len(d)
                    self.stats.accepted_steps[b] += 1
                budget = loop.max_new_tokens - len(loop.tokens[b])  # the loop cuts emitted tokens past it
                self.stats.reused_tokens[b] += min(n, budget)
            kept.append(n)
            if not loop.done[b]:
                self.stats.forwards[b] += 1
                emitted[b] = d[:n] + [choice[b][n]]
        n_kept = torch.tensor(kept, device=loop.device)
        alive = torch.tensor([not x for x in loop.done], device=loop.device)
        loop.cache.truncate(torch.where(alive, self.old + 1 + n_kept, self.old))
        return emitted

    def stopped(self, loop: TokenLoop, row: int) -> bool:
        return False

    def end_step(self, loop: TokenLoop) -> None:
        self.pending = torch.tensor([s[-1] for s in loop.sequences], device=loop.device)


@torch.inference_mode()
def generate(model, prompts: list[list[int]], steps: list[list[list[int]]], piece, *, threshold: float,
             max_new_tokens: int, eos_token_ids=None, prefilled=None, references=None,
             draft_k: int = 8) -> tuple[list[list[int]], StepStats]:
    """Greedy decoding with step reuse: -> (new tokens per row, StepStats). steps[b]: row b's trace steps;
    references[b]: the sequences row b drafts from losslessly between steps (None: plain steps there).
    prefilled: a `speculation.decode.Prefilled` of exactly these prompts to decode from (its cache is truncated
    back to the prompts; it needs room for max_new_tokens + the longest step or draft + 1), or None to prefill here."""
    if not 0 <= threshold:
        raise ValueError(f"threshold={threshold!r} must be >= 0 (a geometric-mean probability; > 1 = lossless)")
    stats = StepStats(batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)))
    policy = StepReusePolicy(steps, piece, threshold, stats, references, draft_k=draft_k)
    shared = None
    if prefilled is not None:
        room = prefilled.cache.max_len - int(prefilled.prompt_lengths.max())
        if room < max_new_tokens + policy.extra:
            raise ValueError(f"prefilled has room for {room} new positions; step reuse needs max_new_tokens + "
                             f"the longest step or draft + 1 = {max_new_tokens + policy.extra}")
        prefilled.cache.truncate(prefilled.prompt_lengths.clone())
        shared, stats.prefill_s = (prefilled.cache, prefilled.last_logits), prefilled.prefill_s
    loop = engine.run_loop(model, prompts, policy, max_new_tokens=max_new_tokens, stats=stats,
                           eos_token_ids=eos_token_ids, prefilled=shared)
    return loop.tokens, stats
