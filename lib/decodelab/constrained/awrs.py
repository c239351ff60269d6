"""AWRS: adaptive weighted rejection sampling of one constrained step (after Lipkin et al., COLM 2025).

Masking computes the whole allowed set A (a scan of the vocabulary, or a grammar engine's bitmask) and then
samples from p restricted to A. AWRS never builds A: it samples a token from p, asks the grammar about that
one token, and on a rejection removes it and samples again from what is left:

    R = {}  (rejected tokens, all outside A);  draw t ~ p(. | not in R);  t in A -> accept;  else R += {t}

The accepted token is distributed exactly as the masked-renormalized q(t) = p(t) 1[t in A] / Z, Z = p(A):
at every round the draw, conditioned on landing in A, is p restricted to A (removing tokens outside A never
changes the ratios inside it), and the loop ends the first time a draw lands in A.

Weight for SMC (Z is not computed): after acceptance, with R the rejected set and m = p(R), draw u from
p(. | not in R). Given R (any set of tokens outside A), P(u in A) = Z / (1 - m), so
w = (1 - m) 1[u in A] has E[w | R] = Z: an unbiased estimate of the mass the mask would keep, independent of
the accepted token given R. `weight_draws` such draws are averaged (each draw's rejection also grows R for
the next, and each term is unbiased given the R it was drawn under), which lowers the variance.
This is our derivation of an unbiased weight in AWRS's spirit; it may differ from the paper's estimator.

Cost: one grammar check per draw (accepted, rejected and weight draws), against a mask's check of every
vocabulary token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

WEIGHT_DRAWS = 2  # extra draws per step for the unbiased weight (AWRS-SMC); 0 for the plain per-step sampler


@dataclass(frozen=True)
class AwrsDraw:
    token: int       # the accepted token (index into probs)
    weight: float    # unbiased estimate of Z = p(A) (nan when weight_draws = 0)
    checks: int      # grammar checks made (one per draw)
    rejected: int    # tokens removed before the acceptance


def awrs_draw(probs: np.ndarray, is_allowed: Callable[[int], bool], rng: np.random.Generator, *,
              weight_draws: int = WEIGHT_DRAWS) -> AwrsDraw:
    """One constrained step. probs: (V,) next-token probabilities (normalized here); is_allowed(token) asks
    the grammar about one token; rng: numpy Generator. Raises ValueError when no token of positive
    probability is allowed (the mask would be empty)."""
    if weight_draws < 0:
        raise ValueError(f"weight_draws={weight_draws!r} must be >= 0")
    remaining = np.asarray(probs, dtype=np.float64).copy()
    total = remaining.sum()
    if not total > 0:
        raise ValueError("probs sum to 0: nothing to sample")
    remaining /= total
    checks = rejected = 0
    while True:
        token = _draw(remaining, rng)
        checks += 1
        if is_allowed(token):
            break
        remaining[token] = 0.0
        rejected += 1
        if not remaining.sum() > 0:
            raise ValueError("no allowed token has positive probability: the constrained step is empty")
    if weight_draws == 0:
        return AwrsDraw(token, float("nan"), checks, rejected)
    estimate = 0.0
    for _ in range(weight_draws):
        mass = remaining.sum()  # 1 - p(R)
        u = _draw(remaining, rng)
        checks += 1
        if is_allowed(u):
            estimate += mass
        else:
            remaining[u] = 0.0
    return AwrsDraw(token, estimate / weight_draws, checks, rejected)


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of an index with probability weights / weights.sum()."""
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(weights) - 1))


def awrs_law(probs, allowed: set[int], *, weight_draws: int = WEIGHT_DRAWS) -> tuple[dict[int, float], float]:
    """The exact law of `awrs_draw` by enumerating every rejection sequence (tiny vocabularies only).

    -> ({token: P(accepted = token)}, E[weight]). Exponential in the number of disallowed tokens: a test
    oracle for the claims above (accepted law = masked-renormalized, E[weight] = Z)."""
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    law: dict[int, float] = {}

    def weight_mean(removed: frozenset, draws: int) -> float:
        if draws == 0:
            return 0.0
        mass = 1.0 - sum(p[i] for i in removed)
        out = 0.0
        for u in range(len(p)):
            if u in removed or p[u] == 0:
                continue
            share = p[u] / mass
            out += share * (mass if u in allowed else 0.0) + share * weight_mean(
                removed if u in allowed else removed | {u}, draws - 1)
        return out

    expected = 0.0

    def walk(removed: frozenset, reach: float) -> None:
        nonlocal expected
        mass = 1.0 - sum(p[i] for i in removed)
        for t in range(len(p)):
            if t in removed or p[t] == 0:
                continue
            share = reach * p[t] / mass
            if t in allowed:
                law[t] = law.get(t, 0.0) + share
                if weight_draws:
                    expected += share * weight_mean(removed, weight_draws) / weight_draws
            else:
                walk(removed | {t}, share)

    walk(frozenset(), 1.0)
    return law, expected


def awrs_pick(logits, matcher, rng: np.random.Generator, *, weight_draws: int = 0) -> AwrsDraw:
    """AWRS on a grammar engine's matcher: one constrained step from (V,) logits (temperature 1) without a mask.

    A check is `matcher.accept(token)` (an allowed token is rolled back at once), so the matcher's state is
    unchanged on return; the caller accepts the returned token."""
    import torch

    probs = torch.softmax(logits.detach().double().flatten(), -1).cpu().numpy()

    def is_allowed(token: int) -> bool:
        if matcher.accept(token):
            matcher.rollback(1)
            return True
        return False

    return awrs_draw(probs, is_allowed, rng, weight_draws=weight_draws)
