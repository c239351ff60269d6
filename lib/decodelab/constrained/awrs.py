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
the accepted token given R. N such draws are averaged (each draw's rejection also grows R for the next, and
each term is unbiased given the R it was drawn under), which lowers the variance.

N = weight_draws + min(|R|, EXTRA_DRAWS_CAP), fixed before any weight draw: the rejections that preceded the
acceptance say the allowed share Z / (1 - m) is small, and then a fixed N = 2 returns w = 0 most of the time (on
notebook 04's month_day task, Z ~ 0.005 at two of six steps: 160 of 334 SMC runs lost all 16 particles). N
depends only on R, so each term is still unbiased given what it was drawn under, and so is their mean.
This is our derivation of an unbiased weight in AWRS's spirit; it may differ from the paper's estimator.

Draws: the step's CDF is built once (one pass over the vocabulary, like the softmax); a draw from
p(. | not in R) is then a uniform u on [0, 1 - m) walked past R's intervals and one binary search,
O(|R| + log V), instead of a new pass over the vocabulary per draw.

Cost: one grammar check per draw (accepted, rejected and weight draws), against a mask's check of every
vocabulary token.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

WEIGHT_DRAWS = 2  # draws per step for the unbiased weight (AWRS-SMC); 0 for the plain per-step sampler
EXTRA_DRAWS_CAP = 64  # ... plus one per rejection before the acceptance, up to this many


@dataclass(frozen=True)
class AwrsDraw:
    token: int       # the accepted token (index into probs)
    weight: float    # unbiased estimate of Z = p(A) (nan when weight_draws = 0)
    checks: int      # grammar checks made (one per draw)
    rejected: int    # tokens removed before the acceptance


def awrs_draw(probs: np.ndarray, is_allowed: Callable[[int], bool], rng: np.random.Generator, *,
              weight_draws: int = WEIGHT_DRAWS) -> AwrsDraw:
    """One constrained step. probs: (V,) next-token probabilities (normalized here); is_allowed(token) asks
    the grammar about one token; rng: numpy Generator. weight_draws = 0: no weight; else weight_draws + (the
    rejections, at most EXTRA_DRAWS_CAP) draws for it. Raises ValueError when no token of positive probability
    is allowed (the mask would be empty)."""
    if weight_draws < 0:
        raise ValueError(f"weight_draws={weight_draws!r} must be >= 0")
    left = Remaining(probs)
    checks = rejected = 0
    while True:
        token = left.draw(rng)
        checks += 1
        if is_allowed(token):
            break
        left.remove(token)
        rejected += 1
        if not left.mass > 0:
            raise ValueError("no allowed token has positive probability: the constrained step is empty")
    if weight_draws == 0:
        return AwrsDraw(token, float("nan"), checks, rejected)
    draws = weight_draws + min(rejected, EXTRA_DRAWS_CAP)  # fixed by R before any weight draw: still unbiased
    estimate = 0.0
    for _ in range(draws):
        mass = left.mass  # 1 - p(R)
        u = left.draw(rng)
        checks += 1
        if is_allowed(u):
            estimate += mass
        else:
            left.remove(u)
    return AwrsDraw(token, estimate / draws, checks, rejected)


class Remaining:
    """p restricted to the tokens not yet removed: draws from p(. | not in R) on one CDF built up front.

    Removed tokens cut their intervals [cdf[r] - p[r], cdf[r]) out of [0, 1). A uniform u on the kept length
    1 - p(R) is mapped back onto [0, 1) by walking the removed intervals in token order and adding the width
    of each one that starts at or below u; a binary search of the CDF then gives the token."""

    def __init__(self, probs):
        p = np.asarray(probs, dtype=np.float64)
        total = p.sum()
        if not total > 0:
            raise ValueError("probs sum to 0: nothing to sample")
        p = p / total
        self.p, self.cdf = p.tolist(), np.cumsum(p).tolist()  # plain floats: the walk below is scalar work
        self.removed: list[int] = []   # sorted token ids
        self.starts: list[float] = []  # their intervals' starts and widths, in the same order
        self.widths: list[float] = []
        self.mass = 1.0                # 1 - p(R)

    def remove(self, token: int) -> None:
        at = bisect.bisect_left(self.removed, token)
        self.removed.insert(at, token)
        self.starts.insert(at, self.cdf[token] - self.p[token])
        self.widths.insert(at, self.p[token])
        self.mass = max(0.0, 1.0 - math.fsum(self.widths))

    def draw(self, rng: np.random.Generator) -> int:
        u = rng.random() * self.mass
        for start, width in zip(self.starts, self.widths):
            if start > u:
                break
            u += width
        index = min(bisect.bisect_right(self.cdf, u), len(self.p) - 1)
        for _ in range(len(self.p)):  # rounding at an interval's edge: step to the next kept token
            at = bisect.bisect_left(self.removed, index)
            if self.p[index] > 0 and not (at < len(self.removed) and self.removed[at] == index):
                return index
            index = (index + 1) % len(self.p)
        raise ValueError("every token of positive probability was removed: nothing left to draw")


def awrs_law(probs, allowed: set[int], *, weight_draws: int = WEIGHT_DRAWS) -> tuple[dict[int, float], float]:
    """The exact law of `awrs_draw` by enumerating every rejection sequence (tiny vocabularies only).

    -> ({token: P(accepted = token)}, E[weight]), with N = weight_draws + min(|R|, EXTRA_DRAWS_CAP) weight draws
    as in `awrs_draw`.
    Exponential in the number of disallowed tokens: a test oracle for the claims above (accepted law =
    masked-renormalized, E[weight] = Z)."""
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
                    draws = weight_draws + min(len(removed), EXTRA_DRAWS_CAP)
                    expected += share * weight_mean(removed, draws) / draws
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
