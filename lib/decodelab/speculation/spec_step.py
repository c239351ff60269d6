"""One speculative step as a `LoopPolicy` of the engine's token loop: choose k (fixed, per step, or per row),
draft, verify, keep each row's accepted prefix. The maths of verification is in `speculation.verify`.

A step where every row's k is 0 is the engine's plain decode step: the same `Feed(pending (B, 1), "step")`,
so the same forward call with the same shapes, one `pick_tokens` on its logits, no cache truncation while
every row is alive and no per-row Python loop beyond the loop's own. Drafters with state catch up lazily
when drafting resumes (the n-gram index from the tokens it has not indexed yet; a draft model's cache in
one batched forward over every row's unseen suffix; an MTP drafter's hidden states are queued).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from decodelab.core import engine
from decodelab.core.engine import Feed, PolicyBase, TokenLoop, synchronize
from decodelab.speculation.drafters import DraftContext
from decodelab.speculation.verify import greedy_verify, rejection_verify, verify_uniforms


def trim(proposal, active: torch.Tensor):
    """Drop draft positions that no active row fills (DraftProposal.lengths): a step where no row has a
    real draft becomes a plain decode step instead of verifying padding. -> a DraftProposal, maybe k = 0."""
    if proposal.lengths is None:
        return proposal
    lengths = proposal.lengths.to(active.device)[active]
    width = int(lengths.max()) if lengths.numel() else 0
    if width >= proposal.k:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:, :width]
    return dataclasses.replace(proposal, tokens=proposal.tokens[:, :width], probs=probs,
                               lengths=proposal.lengths.clamp(max=width))


def narrow(proposal, row_k: torch.Tensor):
    """Keep row b's first row_k[b] (B,) drafts (the rest become padding, always rejected); the width
    becomes max row_k. Narrowing never changes a kept draft, so verification stays exact."""
    width = int(row_k.max())
    lengths = row_k.to(proposal.tokens.device)
    if proposal.lengths is not None:
        lengths = torch.minimum(lengths, proposal.lengths.to(lengths.device))
    probs = None if proposal.probs is None else proposal.probs[:, :width]
    return dataclasses.replace(proposal, tokens=proposal.tokens[:, :width], probs=probs, lengths=lengths)


def pack_hidden(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(hidden (B, T_i, D), lengths (B,))] -> left-aligned (B, sum of lengths max, D) and total lengths (B,)."""
    B, D = chunks[0][0].shape[0], chunks[0][0].shape[2]
    device = chunks[0][0].device
    total = sum(lengths for _, lengths in chunks)
    out = torch.zeros(B, max(int(total.max()), 1), D, dtype=chunks[0][0].dtype, device=device)
    offset = torch.zeros(B, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)[:, None]
    for hidden, lengths in chunks:
        idx = torch.arange(hidden.shape[1], device=device)[None].expand(B, -1)
        valid = idx < lengths[:, None]
        out[rows.expand_as(idx)[valid], (offset[:, None] + idx)[valid]] = hidden[valid]
        offset = offset + lengths
    return out, total


def verify(logits: torch.Tensor, proposal, sampler, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits (B, k+1, V) + DraftProposal -> (n_accepted (B,), next (B,)): greedy without a
    sampler (or when every row is temperature 0), else exact rejection sampling on sampler.probs."""
    if sampler is None or sampler.is_greedy:
        return greedy_verify(proposal.tokens.to(logits.device), logits, proposal.lengths)
    from decodelab.core.sampling import sample_inverse_cdf

    p = torch.stack([sampler.probs(logits[:, i]) for i in range(logits.shape[1])], dim=1)
    B, k = proposal.tokens.shape
    u = verify_uniforms(generator, proposal.lengths, k, B, device=logits.device, dtype=p.dtype)
    n, nxt = rejection_verify(proposal.tokens, proposal.probs, p, lengths=proposal.lengths, uniforms=u)
    if proposal.lengths is not None:
        # a row without a real draft samples p_0 either way; take a plain step's draw (its one uniform
        # through the sampler's own rank-ordered inverse CDF), so its stream does not depend on whether
        # the other rows made this a verify step
        empty = proposal.lengths.to(logits.device) == 0
        if bool(empty.any()):
            nxt = torch.where(empty, sample_inverse_cdf(sampler.process(logits[:, 0]), u[:, k]), nxt)
    return n, nxt


class SpeculativePolicy(PolicyBase):
    """The speculative step as a `LoopPolicy` of the engine's token loop.

    feed: choose k (fixed, the per-step `AdaptivePolicy`, or per row: a policy with `choose_rows`, such as
    `RowBudgetPolicy`), draft, and feed [pending, d_1..d_k] per row (or the pending token alone: a plain
    step). accept: verify, keep pending + n_b drafts of row b in the cache (`truncate`), emit d_1..d_{n_b} +
    next. end_step: park finished rows at their prompt (their scratch writes then always fit) and let the
    policy learn from the step's measured seconds.
    """

    def __init__(self, drafter, k, policy, prefilled, stats, sampler, generator):
        self.drafter, self.k, self.policy = drafter, k, policy
        self.prefilled, self.stats = prefilled, stats
        self.sampler, self.generator = sampler, generator
        self.needs_hidden = bool(getattr(drafter, "needs_hidden", False))
        self.per_row = hasattr(policy, "choose_rows")
        # a drafter whose proposal costs ~nothing (n-gram lookup) is asked first, so the policy sees which rows
        # have real drafts; model drafters are asked only once the policy chose to draft
        self.cheap = bool(getattr(drafter, "cheap", False))
        self.draft_sampler = None if sampler is None or sampler.is_greedy else sampler

    def first(self, loop: TokenLoop, logits: torch.Tensor) -> dict[int, list[int]]:
        self.pending = engine.pick_tokens(logits, self.sampler, self.generator)  # (B,)
        self.last_hidden = self.prefilled.last_hidden
        self.unseen_hidden = [(self.prefilled.prompt_hidden, self.prefilled.prompt_lengths)]
        if self.drafter is not None:
            self.drafter.begin(loop.prompts, max_len=loop.cache.max_len)
        if self.policy is not None:
            self.policy.begin(loop.batch)
            relative_cost = getattr(self.drafter, "relative_cost", None)
            if relative_cost is not None:  # a model drafter: its cost is known before it drafts
                self.policy.set_draft_cost(relative_cost(loop.tr))
        self.rows = torch.arange(loop.batch, device=loop.device)
        self.all_active = torch.ones(loop.batch, dtype=torch.bool, device=loop.device)
        self.step_k, self.proposal, self.row_k = None, None, None
        self.no_drafts_kept = torch.zeros(loop.batch, dtype=torch.long, device=loop.device)  # n (B,) of a plain step
        self.tokens_so_far = loop.batch
        return {b: [t] for b, t in enumerate(self.pending.tolist())}

    def _context(self, loop: TokenLoop) -> DraftContext:
        ctx = DraftContext(tokens=loop.sequences, last_hidden=self.last_hidden if self.needs_hidden else None,
                           active=self.active, sampler=self.draft_sampler, generator=self.generator)
        if self.needs_hidden:
            ctx.new_hidden, ctx.new_hidden_lengths = pack_hidden(self.unseen_hidden)
            self.unseen_hidden = []
        return ctx

    def _propose(self, loop: TokenLoop, k: int):
        t0 = time.perf_counter()
        proposal = self.drafter.propose(self._context(loop), k)
        self.draft_time += time.perf_counter() - t0
        return proposal

    def _worth_asking(self, n_active: int) -> bool:
        t0 = time.perf_counter()
        worth = self.policy.worth_asking(n_active, context=self.context)
        self.policy_time += time.perf_counter() - t0
        return worth

    def _choose(self, loop: TokenLoop, n_active: int, caps=None, kinds=None):
        t0 = time.perf_counter()
        if self.per_row:
            self.row_k = self.policy.choose_rows(self.active, context=self.context, caps=caps, kinds=kinds)
            step_k = int(self.row_k.max())
        else:
            step_k = self.policy.choose_k(n_active, context=self.context)
        self.policy_time += time.perf_counter() - t0
        return step_k

    def feed(self, loop: TokenLoop) -> Feed:
        # one clock per step, top to bottom: the policy's decision and update are charged like drafting
        stats, cache, device = self.stats, loop.cache, loop.device
        self.start = time.perf_counter()
        self.draft_time, self.policy_time = 0.0, 0.0
        n_active = loop.batch - sum(loop.done)
        self.all_alive = n_active == loop.batch
        self.active = self.all_active if self.all_alive else torch.tensor([not d for d in loop.done], device=device)
        proposal, self.free_drafts = None, None
        # greedy, no hidden-state drafter: finished rows riding along skip the forward's work (engine.live_rows)
        self.live = None if self.all_alive or self.needs_hidden or self.draft_sampler is not None else \
            engine.live_rows(loop.model, [not loop.done[r] for r in loop.rows])
        if self.policy is None:
            step_k = self.k
        else:
            self.context = cache.lengths.sum().item() / cache.batch_size
            # the step's cost is then the live rows' (its model predicts the batch it is told)
            self.policy.batch_size = loop.batch if self.live is None else len(self.live)
            if self.per_row and self.cheap and self._worth_asking(n_active):
                # the drafts cost ~nothing: the policy decides on each row's real drafts (caps), and a row
                # whose first draft goes unverified is scored against the emitted token (free evidence)
                proposal = self._propose(loop, max(self.policy.ks))
                real = (proposal.lengths > 0 if proposal.lengths is not None
                        else torch.ones(proposal.tokens.shape[0], dtype=torch.bool))
                self.free_drafts = (proposal.tokens[:, 0].cpu(), real.cpu())
                step_k = self._choose(loop, n_active, caps=proposal.lengths, kinds=proposal.kinds)
            else:
                step_k = self._choose(loop, n_active)
        if step_k > len(stats.reached):  # deeper drafts than K_CHOICES: grow the per-position counters
            grow = step_k - len(stats.reached)
            stats.reached += [0] * grow
            stats.accepted += [0] * grow
        if step_k > 0 and self.drafter is not None:
            if proposal is None:
                proposal = self._propose(loop, step_k)
            if self.row_k is not None:
                proposal = narrow(proposal, self.row_k)
            proposal = trim(proposal, self.active)
            step_k = proposal.k  # rows without real drafts everywhere: verify fewer (or zero) positions
        self.proposal = proposal  # also a proposal narrowed to k = 0: the drafter rolls it back to nothing
        self.step_k = step_k if proposal is not None else 0
        # the lengths before the forward, for accept's truncation: a plain step with every row alive needs none
        self.old = cache.lengths.clone() if self.step_k or not self.all_alive else None
        synchronize(device)
        self.t_draft = time.perf_counter()
        if self.step_k == 0:
            return Feed(self.pending[:, None], mode="step", return_hidden=self.needs_hidden, rows=self.live)
        inputs = torch.cat([self.pending[:, None], proposal.tokens.to(device)], dim=1)  # (B, k+1)
        return Feed(inputs, mode="all", return_hidden=self.needs_hidden, rows=self.live)

    def accept(self, loop: TokenLoop, logits: torch.Tensor, hidden) -> dict[int, list[int]]:
        stats, proposal, active, B = self.stats, self.proposal, self.active, loop.batch
        alive = loop.alive
        if self.step_k == 0:  # a plain step: the forward advanced every row by its pending token
            n = self.no_drafts_kept
            nxt = engine.pick_tokens(logits, self.sampler, self.generator)
            if not self.all_alive:
                loop.cache.truncate(torch.where(active, self.old + 1, self.old))
        else:
            n, nxt = verify(logits, proposal, self.sampler, self.generator)
            # ragged advance: row b keeps pending + n_b drafts; finished rows stay where they were
            loop.cache.truncate(torch.where(active, self.old + 1 + n, self.old))
        if proposal is not None:
            self.drafter.rollback(torch.where(active, n, torch.zeros_like(n)))
        if self.needs_hidden:
            self.last_hidden = torch.where(active[:, None], hidden[self.rows, n], self.last_hidden)
            self.unseen_hidden.append((hidden, torch.where(active, n + 1, torch.zeros_like(n))))
        self.n, self.next = n, nxt
        next_list = nxt.tolist()  # host sync
        self.t_verify = time.perf_counter()
        step_k = self.step_k
        stats.row_steps += len(alive)
        if step_k == 0:
            stats.emitted += len(alive)
            self.lengths = [0] * B
            return {b: [next_list[b]] for b in alive}
        n_list, drafts_list = n.tolist(), proposal.tokens.tolist()
        self.lengths = proposal.lengths.tolist() if proposal.lengths is not None else [step_k] * B
        emitted = {}
        for b in alive:
            nb = n_list[b]
            stats.emitted += nb + 1
            for i in range(min(nb + 1, self.lengths[b], step_k)):
                stats.reached[i] += 1
                stats.accepted[i] += int(i < nb)
            emitted[b] = drafts_list[b][:nb] + [next_list[b]]
        return emitted

    def _free_evidence(self, row_k: torch.Tensor):
        """(scored (B,), hit (B,)) bool: active rows with a real first draft that this step did not verify,
        and whether it equals the token the step emitted there (its next token: n_b = 0 for such a row)."""
        if self.free_drafts is None:
            return None
        first, real = self.free_drafts
        scored = real & self.active.cpu() & (row_k == 0)
        return scored, scored & (first == self.next.cpu())

    def end_step(self, loop: TokenLoop) -> None:
        if self.step_k is None:  # after the prefill: nothing was drafted yet
            return
        cache = loop.cache
        if any(loop.done):  # park finished rows at their prompt: their scratch writes then always fit
            parked = torch.tensor(loop.done, device=loop.device)
            cache.truncate(torch.where(parked, self.prefilled.prompt_lengths, cache.lengths))
        policy_s = self.policy_time
        if self.policy is not None:
            t_update = time.perf_counter()
            # the policy learns from the draft and verify seconds (its model predicts those), not its own
            verify_s = self.t_verify - self.t_draft
            if self.per_row and self.step_k == 0 and self.free_drafts is None and hasattr(self.policy, "update_plain"):
                self.policy.update_plain(step_s=verify_s, context=self.context)  # nothing drafted, nothing scored
            elif self.per_row:
                row_k = torch.tensor(self.lengths, dtype=torch.long)  # all zeros on a plain step
                self.policy.update_rows(row_k, self.n, self.active, step_s=verify_s + self.draft_time,
                                        draft_s=self.draft_time, context=self.context, free=self._free_evidence(row_k))
            else:
                self.policy.update(self.step_k, self.n, self.active, verify_s + self.draft_time, self.draft_time,
                                   lengths=self.lengths, context=self.context)
            policy_s += time.perf_counter() - t_update
        # every alive row's last token is this step's next token; a finished row's pending is scratch
        self.pending = self.next
        stats = self.stats
        if self.row_k is not None:
            # per row: the drafts it verified this step, -1 for a row that had finished before it
            stats.row_k.append(list(self.lengths) if self.all_alive
                               else [n if a else -1 for n, a in zip(self.lengths, self.active.tolist())])
        total = sum(map(len, loop.tokens))
        stats.step_tokens.append(total - self.tokens_so_far)
        self.tokens_so_far = total
        stats.step_k.append(self.step_k)
        stats.draft_s.append(self.draft_time)
        stats.verify_s.append(self.t_verify - self.t_draft)
        stats.policy_s.append(policy_s)
