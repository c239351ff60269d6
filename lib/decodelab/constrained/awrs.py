"""AWRS: adaptive weighted rejection sampling of one constrained step (after Lipkin et al., COLM 2025).

Masking computes the whole allowed set A (a scan of the vocabulary, or a grammar engine's bitmask) and then
samples from p restricted to A. AWRS never builds A: it samples a token from p, asks the grammar about that
one token, and on a rejection removes it and samples again from what is left:

    R = {}  (rejected tokens, all outside A);  draw t ~ p(. | not in R);  t in A -> accept;  else R += {t}

The accepted token is distributed exactly as the masked-renormalized q(t) = p(t) 1[t in A] / Z, Z = p(A):
at every round the draw, conditioned on landing in A, is p restricted to A (removing tokens outside A never
changes the ratios inside it), and the loop ends the first time a draw lands in A.

Weight for SMC (Z is not computed): after acceptance of t with R the rejected set, keep drawing *without
replacement*, from what no draw has touched yet. Before weight draw j let K_j be the known allowed mass (p(t)
plus every allowed token a weight draw has found so far) and m_j the mass of every token seen (R, t and the
weight draws); the untouched allowed mass is Z - K_j, so a draw u_j from p(. | untouched) lands in A with
probability (Z - K_j) / (1 - m_j), and

    w_j = K_j + (1 - m_j) 1[u_j in A]    has E[w_j | the draws before it] = Z,

given the accepted token too (the allowed tokens other than t are never touched by the acceptance loop, and
the accepted token's law given R is the masked one). w = the mean of N such terms is unbiased for Z. Once every
token of positive probability has been seen, K_j = Z exactly and the remaining terms need no draw. Against
draws with replacement (an allowed token found once could be found again, and p(t) was ignored) the known mass
only grows, so each term's spread shrinks, and since K_1 = p(t) > 0 the weight is never 0 (with replacement,
where the allowed share was small most weights were 0 and those particles died).

N = weight_draws + min(|R|, EXTRA_DRAWS_CAP), fixed before any weight draw: rejections before the acceptance say
the allowed share is small, so more draws are spent finding the rest of A. N depends only on R, so the mean
stays unbiased. This is our derivation of an unbiased weight in AWRS's spirit (a sampling-without-replacement
estimate of a sum); it may differ from the paper's estimator.

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
from typing import Callable, Iterable

import numpy as np

WEIGHT_DRAWS = 2  # draws per step for the unbiased weight (AWRS-SMC); 0 for the plain per-step sampler
EXTRA_DRAWS_CAP = 64  # ... plus one per rejection before the acceptance, up to this many


@dataclass(frozen=True)
class AwrsDraw:
    token: int       # the accepted token (index into probs)
    weight: float    # unbiased estimate of Z = p(A) (nan when weight_draws = 0)
    checks: int      # grammar checks made (one per draw)
    rejected: int    # tokens removed before the acceptance
    found: tuple[int, ...] = ()  # allowed tokens other than `token` that the weight draws came upon


def awrs_draw(probs: np.ndarray, is_allowed: Callable[[int], bool], rng: np.random.Generator, *,
              weight_draws: int = WEIGHT_DRAWS, exclude: Iterable[int] = (), allow_empty: bool = False) -> AwrsDraw:
    """One constrained step. probs: (V,) next-token probabilities (normalized here); is_allowed(token) asks
    the grammar about one token; rng: numpy Generator. weight_draws = 0: no weight; else weight_draws + (the
    rejections, at most EXTRA_DRAWS_CAP) draws for it. Raises ValueError when no token of positive probability
    is allowed (the mask would be empty).

    exclude: tokens removed before the first draw, never checked (e.g. allowed tokens the caller already
    knows): the draw is then from p restricted to A minus them, and the weight estimates that set's mass
    Z - p(exclude), in probs' own (normalized) units; the module doc's argument holds with the excluded
    tokens counted as seen. allow_empty: when nothing allowed is left, return token -1 with weight 0 (the
    checks made so far counted) instead of raising."""
    if weight_draws < 0:
        raise ValueError(f"weight_draws={weight_draws!r} must be >= 0")
    left = Remaining(probs)
    for token in exclude:
        left.remove(token)
    checks = rejected = 0
    while True:
        if not left.mass > 0 or left.exhausted:
            if allow_empty:
                return AwrsDraw(-1, 0.0, checks, rejected)
            raise ValueError("no allowed token has positive probability: the constrained step is empty")
        token = left.draw(rng)
        checks += 1
        if is_allowed(token):
            break
        left.remove(token)
        rejected += 1
    if weight_draws == 0:
        return AwrsDraw(token, float("nan"), checks, rejected)
    draws = weight_draws + min(rejected, EXTRA_DRAWS_CAP)  # fixed by R before any weight draw: still unbiased
    known = left.p[token]  # allowed mass found so far: K_1 = p(t)
    left.remove(token)
    total, found = 0.0, []
    for j in range(draws):
        if left.exhausted:  # every token seen: K_j = Z exactly, for this term and the ones after it
            total += known * (draws - j)
            break
        mass = left.mass  # 1 - m_j
        u = left.draw(rng)
        checks += 1
        if is_allowed(u):
            total += known + mass
            known += left.p[u]
            found.append(u)
        else:
            total += known
        left.remove(u)
    return AwrsDraw(token, total / draws, checks, rejected, tuple(found))


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
        self.positive = sum(1 for v in self.p if v > 0)  # tokens that can be drawn at all
        self.removed_positive = 0

    @property
    def exhausted(self) -> bool:
        """Every token of positive probability removed (mass may then be a rounding residue above 0)."""
        return self.removed_positive >= self.positive

    def remove(self, token: int) -> None:
        at = bisect.bisect_left(self.removed, token)
        if at < len(self.removed) and self.removed[at] == token:
            return  # already removed
        self.removed_positive += self.p[token] > 0
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


def awrs_law(probs, allowed: set[int], *, weight_draws: int = WEIGHT_DRAWS,
             given_token: bool = False) -> tuple[dict[int, float], float | dict[int, float]]:
    """The exact law of `awrs_draw` by enumerating every rejection sequence and weight draw (tiny vocabularies).

    -> ({token: P(accepted = token)}, E[weight]); given_token=True gives {token: E[weight | accepted = token]}
    instead of E[weight] (what SMC needs: the weight unbiased whichever token it comes with). N = weight_draws +
    min(|R|, EXTRA_DRAWS_CAP) weight draws without replacement, as in `awrs_draw`.
    Exponential in the vocabulary: a test oracle for the claims above (accepted law = masked-renormalized,
    E[weight | token] = Z)."""
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    law: dict[int, float] = {}
    weight_sum: dict[int, float] = {}  # sum over paths of P(path) * E[weight | path]

    def terms(seen: frozenset, known: float, draws: int) -> float:
        """E[sum of the remaining `draws` weight terms] from a state (seen tokens, known allowed mass)."""
        if draws == 0:
            return 0.0
        left = [u for u in range(len(p)) if u not in seen and p[u] > 0]
        if not left:
            return known * draws
        mass = 1.0 - sum(p[i] for i in seen)
        out = 0.0
        for u in left:
            share = p[u] / mass
            hit = u in allowed
            out += share * ((known + mass if hit else known)
                            + terms(seen | {u}, known + (p[u] if hit else 0.0), draws - 1))
        return out

    def walk(removed: frozenset, reach: float) -> None:
        mass = 1.0 - sum(p[i] for i in removed)
        for t in range(len(p)):
            if t in removed or p[t] == 0:
                continue
            share = reach * p[t] / mass
            if t in allowed:
                law[t] = law.get(t, 0.0) + share
                if weight_draws:
                    draws = weight_draws + min(len(removed), EXTRA_DRAWS_CAP)
                    weight_sum[t] = weight_sum.get(t, 0.0) + share * terms(removed | {t}, p[t], draws) / draws
            else:
                walk(removed | {t}, share)

    walk(frozenset(), 1.0)
    if given_token:
        return law, {t: weight_sum.get(t, 0.0) / law[t] for t in law}
    return law, sum(weight_sum.values())


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
