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
from decodelab.core.engine import DecodeStats, as_transformer, synchronize
from decodelab.speculation.drafters import Drafter
from decodelab.speculation.policy import K_CHOICES
from decodelab.speculation.spec_step import SpeculativePolicy, verify  # noqa: F401  (verify: public here too)


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
    """Prefill ragged prompts once: -> Prefilled (cache room for max_new_tokens + max_k + 1 more).

    A batch that repeats prompts (a sweep cycling through fewer workload items than rows) prefills each
    distinct prompt once and copies its cache row to every row that asks for it: the same KV, a fraction
    of the prefill time (a causal prefill of one row does not depend on the other rows)."""
    tr = as_transformer(model)
    synchronize(tr.device)
    start = time.perf_counter()
    distinct = list(dict.fromkeys(map(tuple, prompts)))
    if len(distinct) < len(prompts):
        where = {p: i for i, p in enumerate(distinct)}
        rows = torch.tensor([where[tuple(p)] for p in prompts], device=tr.device)
        cache, last_logits, hidden = engine.prefill(tr, [list(p) for p in distinct], max_new_tokens=max_new_tokens,
                                                    extra=max_k + 1, return_hidden=True)
        cache, last_logits, hidden = cache.select(rows), last_logits[rows], hidden[rows]
    else:
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
    step_tokens: list[int] = field(default_factory=list)  # tokens each step added to the output (EOS-cut)
    row_k: list[list[int]] = field(default_factory=list)  # per-row policies: drafts row b verified per step, -1 done

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


def _check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be an int >= 0 (0 = plain decoding) or an AdaptivePolicy")


def generate(*args, **kwargs) -> SpecResult:
    """Speculative decoding run to the end: `generate_steps`' arguments -> its SpecResult."""
    return engine.drive(generate_steps(*args, **kwargs))


@torch.inference_mode()
def generate_steps(model, prompts: list[list[int]] | None = None, drafter: Drafter | None = None, *, k=4,
                   max_new_tokens: int = 64, sampler=None,
                   generator: torch.Generator | list[torch.Generator] | None = None,
                   eos_token_ids: list[int] | None = None, prefilled: Prefilled | None = None,
                   progress: bool = False, name: str | None = None):
    """A generator over the steps of one speculative decode (yields after each timed step; returns the
    SpecResult), so runs can be interleaved step by step (`bench.run_methods`); `generate` runs it out.

    Batched speculative decoding: draft k tokens per row, verify them in one target step, keep the
    accepted prefix (+ correction or bonus token) per row, truncate the rest of the KV cache.

    model: LoadedModel or Transformer (the target). drafter: any `Drafter` (None -> plain decoding).
    k: int >= 0 drafts per step (0 = plain decode steps), an `AdaptivePolicy` choosing k per step, or a
    `RowBudgetPolicy` choosing k per row under a batch verify budget.
    sampler: None (greedy) or a `decodelab.core.sampling.Sampler`; generator: a torch.Generator, or a list of one
    per row as `engine.generate` takes (row b then draws every number it uses from generator[b]: its plain
    steps draw exactly what engine.generate's would, and with a fixed k its stream does not depend on the
    other rows of the batch).
    prefilled: a `Prefilled` of the same prompts to reuse (its cache is truncated back to the prompts).
    name: the label in SpecStats.drafter (default: the drafter's name, "plain" without one).
    Greedy output equals plain greedy decoding token for token; sampled output has the target's law.
    The loop is the engine's (`engine.iter_loop`); this module contributes the `SpeculativePolicy`.
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
    if hasattr(policy, "check_batch"):  # e.g. a verify budget below the batch: fail before the prefill
        policy.check_batch(len(prompts) if prompts is not None else len(prefilled.prompts))
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
    loop = yield from engine.iter_loop(tr, prompts, spec, max_new_tokens=max_new_tokens, stats=stats,
                                       eos_token_ids=eos_token_ids, prefilled=(prefilled.cache, prefilled.last_logits),
                                       progress=progress, desc=stats.drafter)
    return SpecResult(tokens=loop.tokens, stats=stats, finished=loop.finished)
