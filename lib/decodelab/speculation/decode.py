"""Speculative decoding: verification maths and the batched draft -> verify -> roll back loop.

One step for B rows, each with a pending token x (chosen by the target, not yet in its KV cache):

    drafts d_1..d_k       <- drafter.propose(ctx, k)                 (B, k)
    logits                <- verify_step(target, cache, [x, d_1..d_k]) (B, k+1, V): logits[:, i]
                             is the target's distribution p_{i+1} for the token after d_i (d_0 = x)
    n_b accepted, next_b  <- greedy_verify / rejection_verify
    row b emits d_1..d_{n_b}, next_b; its cache is truncated to old + 1 + n_b (ragged advance)

Greedy: accept while d_i == argmax p_i; next = argmax p_{n+1} (the correction, or the bonus token
when all k drafts were accepted). Output equals plain greedy decoding token for token.

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection sample next from norm(max(p_i - q_i, 0)); when all k are accepted sample the
bonus from p_{k+1}. Every emitted token is then distributed exactly as the target's (processed) p.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decodelab.core import engine
from decodelab.core.engine import DecodeStats, Feed, PolicyBase, TokenLoop, as_transformer, synchronize
from decodelab.speculation.drafters import DraftContext, Drafter
from decodelab.speculation.policy import K_CHOICES
from decodelab.speculation.verify import greedy_verify, rejection_verify, verify_uniforms


@dataclass
class Prefilled:
    """A target prefill that several runs can share: `generate` truncates the cache back to the prompts.

    cache: KVCache sized for the longest prompt + max_new_tokens + max k + 1; last_logits (B, V);
    last_hidden (B, D) (final-normed state at each prompt's last token); prompt_lengths (B,)."""

    prompts: list[list[int]]
    cache: object
    last_logits: torch.Tensor
    last_hidden: torch.Tensor
    prompt_hidden: torch.Tensor  # (B, T, D) final-normed states of every prompt position (right-padded)
    prompt_lengths: torch.Tensor
    prefill_s: float
    max_new_tokens: int
    max_k: int


@torch.inference_mode()
def prefill(model, prompts: list[list[int]], *, max_new_tokens: int, max_k: int = max(K_CHOICES)) -> Prefilled:
    """Prefill ragged prompts once: -> Prefilled (cache room for max_new_tokens + max_k + 1 more)."""
    tr = as_transformer(model)
    synchronize(tr.device)
    start = time.perf_counter()
    cache, last_logits, hidden = engine.prefill(tr, prompts, max_new_tokens=max_new_tokens, extra=max_k + 1,
                                                return_hidden=True)
    lengths = cache.lengths.clone()
    last_hidden = hidden[torch.arange(len(prompts), device=tr.device), lengths - 1]
    synchronize(tr.device)
    return Prefilled(prompts=[list(p) for p in prompts], cache=cache, last_logits=last_logits,
                     last_hidden=last_hidden, prompt_hidden=hidden, prompt_lengths=lengths,
                     prefill_s=time.perf_counter() - start, max_new_tokens=max_new_tokens, max_k=max_k)


@dataclass
class SpecStats(DecodeStats):
    """What one speculative generation measured: the engine's DecodeStats plus, per step, k, draft seconds,
    verify seconds and the k policy's own seconds, and the acceptance counts.

    A step's clock (`step_s`) runs from the top of the loop to the bottom: the policy's decision,
    drafting, verifying, the bookkeeping and the policy's update, so whatever a method spends deciding
    is charged to its speedup."""

    drafter: str = "plain"
    step_k: list[int] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    policy_s: list[float] = field(default_factory=list)  # the k policy's own decision + update time (inside step_s)
    row_steps: int = 0  # (active row, step) pairs
    emitted: int = 0  # tokens those row-steps produced before truncation: sum of n_accepted + 1
    reached: list[int] = field(default_factory=lambda: [0] * max(K_CHOICES))  # drafts at position i judged
    accepted: list[int] = field(default_factory=lambda: [0] * max(K_CHOICES))  # ... and accepted

    @property
    def tau(self) -> float:
        """Mean tokens per active row per target forward, bonus included (plain decoding = 1.0)."""
        return self.emitted / self.row_steps if self.row_steps else float("nan")

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted), i = 1.. (nan where never reached)."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first (which every method gets from the prefill) per decode second."""
        return (self.new_tokens - self.batch_size) / self.decode_s if self.decode_s > 0 else float("nan")

    def as_dict(self) -> dict:
        steps = len(self.step_s)
        return {
            "drafter": self.drafter, "batch_size": self.batch_size, "prompt_tokens": self.prompt_tokens,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "draft_s": sum(self.draft_s),
            "verify_s": sum(self.verify_s), "policy_s": sum(self.policy_s), "steps": steps,
            "new_tokens": self.new_tokens, "tau": self.tau,
            "mean_k": sum(self.step_k) / steps if steps else float("nan"),
            "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass
class SpecResult:
    tokens: list[list[int]]  # new tokens per row, EOS included when hit, nothing after it
    stats: SpecStats
    finished: list[bool]


def _trim(proposal, active: torch.Tensor):
    """Drop draft positions that no active row fills (DraftProposal.lengths): a step where no row has a
    real draft becomes a plain decode step instead of verifying padding. -> a DraftProposal, maybe k = 0."""
    if proposal.lengths is None:
        return proposal
    lengths = proposal.lengths.to(active.device)[active]
    width = int(lengths.max()) if lengths.numel() else 0
    if width >= proposal.k:
        return proposal
    probs = None if proposal.probs is None else proposal.probs[:, :width]
    return type(proposal)(tokens=proposal.tokens[:, :width], probs=probs,
                          lengths=proposal.lengths.clamp(max=width))


def _pack_hidden(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
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


def _check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0 (0 = plain decoding) or an AdaptivePolicy")


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

    feed: choose k (fixed or the adaptive policy), draft, and feed [pending, d_1..d_k] per row (or the
    pending token alone: a plain step). accept: verify, keep pending + n_b drafts of row b in the cache
    (`truncate`), emit d_1..d_{n_b} + next. end_step: park finished rows at their prompt (their scratch
    writes then always fit) and let the adaptive policy learn from the step's measured seconds.
    """

    def __init__(self, drafter, k, policy, prefilled: Prefilled, stats: SpecStats, sampler, generator):
        self.drafter, self.k, self.policy = drafter, k, policy
        self.prefilled, self.stats = prefilled, stats
        self.sampler, self.generator = sampler, generator
        self.needs_hidden = bool(getattr(drafter, "needs_hidden", False))
        self.draft_sampler = None if sampler is None or sampler.is_greedy else sampler

    def first(self, loop: TokenLoop, logits: torch.Tensor) -> dict[int, list[int]]:
        self.pending = engine.pick_tokens(logits, self.sampler, self.generator)  # (B,)
        self.last_hidden = self.prefilled.last_hidden
        self.unseen_hidden = [(self.prefilled.prompt_hidden, self.prefilled.prompt_lengths)]
        if self.drafter is not None:
            self.drafter.begin(loop.prompts, max_len=loop.cache.max_len)
        if self.policy is not None:
            self.policy.begin(loop.batch)
        self.rows = torch.arange(loop.batch, device=loop.device)
        self.step_k, self.proposal = None, None
        return {b: [t] for b, t in enumerate(self.pending.tolist())}

    def feed(self, loop: TokenLoop) -> Feed:
        # one clock per step, top to bottom: the policy's decision and update are charged like drafting
        stats, cache, device = self.stats, loop.cache, loop.device
        self.start = time.perf_counter()
        self.active = torch.tensor([not d for d in loop.done], device=device)
        n_active = loop.batch - sum(loop.done)
        self.context = cache.lengths.float().mean().item() if self.policy is not None else 0.0
        step_k = self.policy.choose_k(n_active, context=self.context) if self.policy is not None else self.k
        self.t_policy = time.perf_counter()
        if step_k > len(stats.reached):  # deeper drafts than K_CHOICES: grow the per-position counters
            grow = step_k - len(stats.reached)
            stats.reached += [0] * grow
            stats.accepted += [0] * grow
        self.old = cache.lengths.clone()
        proposal = None
        if step_k > 0 and self.drafter is not None:
            ctx = DraftContext(tokens=loop.sequences, last_hidden=self.last_hidden if self.needs_hidden else None,
                               active=self.active, sampler=self.draft_sampler, generator=self.generator)
            if self.needs_hidden:
                ctx.new_hidden, ctx.new_hidden_lengths = _pack_hidden(self.unseen_hidden)
                self.unseen_hidden = []
            proposal = _trim(self.drafter.propose(ctx, step_k), self.active)
            step_k = proposal.k  # rows without real drafts everywhere: verify fewer (or zero) positions
        synchronize(device)
        self.t_draft = time.perf_counter()
        self.proposal = proposal
        if step_k == 0 or proposal is None:
            self.step_k = 0
            return Feed(self.pending[:, None], mode="step", return_hidden=self.needs_hidden)
        self.step_k = step_k
        inputs = torch.cat([self.pending[:, None], proposal.tokens.to(device)], dim=1)  # (B, k+1)
        return Feed(inputs, mode="all", return_hidden=self.needs_hidden)

    def accept(self, loop: TokenLoop, logits: torch.Tensor, hidden) -> dict[int, list[int]]:
        stats, proposal, active, B = self.stats, self.proposal, self.active, loop.batch
        if self.step_k == 0:
            n = torch.zeros(B, dtype=torch.long, device=loop.device)
            nxt = engine.pick_tokens(logits, self.sampler, self.generator)
            drafts_list = None
        else:
            n, nxt = verify(logits, proposal, self.sampler, self.generator)
            drafts_list = proposal.tokens.tolist()
        # ragged advance: row b keeps pending + n_b drafts; finished rows stay where they were
        loop.cache.truncate(torch.where(active, self.old + 1 + n, self.old))
        if proposal is not None:  # (a proposal trimmed to k = 0 still drafted: roll it back to nothing)
            self.drafter.rollback(torch.where(active, n, torch.zeros_like(n)))
        if self.needs_hidden:
            self.last_hidden = torch.where(active[:, None], hidden[self.rows, n], self.last_hidden)
            self.unseen_hidden.append((hidden, torch.where(active, n + 1, torch.zeros_like(n))))
        n_list, next_list = n.tolist(), nxt.tolist()  # host sync
        self.t_verify = time.perf_counter()
        step_k = self.step_k
        has_lengths = step_k > 0 and proposal.lengths is not None
        self.lengths = proposal.lengths.tolist() if has_lengths else [step_k] * B
        self.n = n
        emitted = {}
        for b in loop.alive:
            nb = n_list[b]
            stats.row_steps += 1
            stats.emitted += nb + 1
            for i in range(min(nb + 1, self.lengths[b], step_k)):
                stats.reached[i] += 1
                stats.accepted[i] += int(i < nb)
            emitted[b] = (drafts_list[b][:nb] if drafts_list is not None else []) + [next_list[b]]
        return emitted

    def end_step(self, loop: TokenLoop) -> None:
        if self.step_k is None:  # after the prefill: nothing was drafted yet
            return
        cache = loop.cache
        if any(loop.done):  # park finished rows at their prompt: their scratch writes then always fit
            parked = torch.tensor(loop.done, device=loop.device)
            cache.truncate(torch.where(parked, self.prefilled.prompt_lengths, cache.lengths))
        policy_s = self.t_policy - self.start
        if self.policy is not None:
            t_update = time.perf_counter()
            # the policy learns from the draft and verify seconds (its model predicts those), not its own
            self.policy.update(self.step_k, self.n, self.active, self.t_verify - self.t_policy,
                               self.t_draft - self.t_policy, lengths=self.lengths, context=self.context)
            policy_s += time.perf_counter() - t_update
        self.pending = torch.tensor([s[-1] for s in loop.sequences], device=loop.device)
        self.stats.step_k.append(self.step_k)
        self.stats.draft_s.append(self.t_draft - self.t_policy)
        self.stats.verify_s.append(self.t_verify - self.t_draft)
        self.stats.policy_s.append(policy_s)


@torch.inference_mode()
def generate(model, prompts: list[list[int]] | None = None, drafter: Drafter | None = None, *, k=4,
             max_new_tokens: int = 64, sampler=None, generator: torch.Generator | list[torch.Generator] | None = None,
             eos_token_ids: list[int] | None = None, prefilled: Prefilled | None = None,
             progress: bool = False, name: str | None = None) -> SpecResult:
    """Batched speculative decoding: draft k tokens per row, verify them in one target step, keep the
    accepted prefix (+ correction or bonus token) per row, truncate the rest of the KV cache.

    model: LoadedModel or Transformer (the target). drafter: any `Drafter` (None -> plain decoding).
    k: int >= 0 drafts per step (0 = plain decode steps), or an `AdaptivePolicy` choosing k per step.
    sampler: None (greedy) or a `decodelab.core.sampling.Sampler`; generator: a torch.Generator, or a list of one
    per row as `engine.generate` takes (row b then draws every number it uses from generator[b]: its plain
    steps draw exactly what engine.generate's would, and with a fixed k its stream does not depend on the
    other rows of the batch).
    prefilled: a `Prefilled` of the same prompts to reuse (its cache is truncated back to the prompts).
    name: the label in SpecStats.drafter (default: the drafter's name, "plain" without one).
    Greedy output equals plain greedy decoding token for token; sampled output has the target's law.
    The loop is the engine's (`engine.run_loop`); this module contributes the `SpeculativePolicy`.
    """
    policy = k if hasattr(k, "choose_k") else None
    if policy is None:
        _check_k(k)
    if k != 0 and drafter is None and policy is None:
        raise ValueError(f"k={k!r} needs a drafter (got drafter=None); use k=0 for plain decoding")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise ValueError(f"drafter={drafter!r} does not implement decodelab.speculation.drafters.Drafter "
                         "(name, needs_hidden, begin, propose, rollback)")
    engine.validate_generation_args(prompts, max_new_tokens)
    tr = as_transformer(model)
    k_max = max(policy.ks) if policy is not None else k
    if prefilled is None:
        if prompts is None:
            raise ValueError("give prompts or prefilled")
        prefilled = prefill(tr, prompts, max_new_tokens=max_new_tokens, max_k=k_max)
    elif prefilled.max_new_tokens < max_new_tokens or prefilled.max_k < k_max:
        raise ValueError(f"prefilled has room for max_new_tokens={prefilled.max_new_tokens}, max_k={prefilled.max_k}; "
                         f"this run needs {max_new_tokens} and {k_max}")
    prompts = prefilled.prompts
    if eos_token_ids is None:
        eos_token_ids = getattr(model, "eos_token_ids", None) or []
    prefilled.cache.truncate(prefilled.prompt_lengths.clone())
    stats = SpecStats(batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)),
                      drafter=name or getattr(drafter, "name", "plain"), prefill_s=prefilled.prefill_s)
    spec = SpeculativePolicy(drafter, k, policy, prefilled, stats, sampler, generator)
    loop = engine.run_loop(tr, prompts, spec, max_new_tokens=max_new_tokens, stats=stats,
                           eos_token_ids=eos_token_ids, prefilled=(prefilled.cache, prefilled.last_logits),
                           progress=progress, desc=stats.drafter)
    return SpecResult(tokens=loop.tokens, stats=stats, finished=loop.finished)
