"""Tokens per verify step from measured per-position acceptance, and the steps a batch needs to finish.

A verify step with k drafts emits X = 1 + (accepted run) tokens per row. With the conditional rates
c_j = P(draft j accepted | drafts 1..j-1 accepted), the survival S_j = P(run >= j) = c_1 ... c_j and

    E[X] = 1 + sum_{j<=k} S_j,        P(X = m) = S_{m-1} - S_m   (m = 1..k+1; S_0 = 1, S_{k+1} = 0).

Leviathan et al.'s model is the special case c_j = a for all j. Real n-gram acceptance is not geometric:
the first draft is a lookup that hits or misses (c_1 ~ 0.7 on code editing), the later ones continue a copy
that already hit (c_j ~ 0.9-1), so one a fitted on small k mispredicts large k. `Acceptance` keeps the
measured rates up to the deepest position some cell reached and one `tail` rate beyond it.

A row asked for N tokens stops after the first step whose emissions reach N (the surplus is cut), and a batch
steps until its slowest row is done, so the tokens per step a batch realizes are N / E[max_b steps_b] < E[X]
(rows taken as independent draws from one acceptance).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def expected_tokens(alpha, k) -> np.ndarray:
    """Leviathan et al.: E[tokens per verify step] = (1 - a^(k+1)) / (1 - a) (bonus included; = k+1 at a=1)."""
    a, k = np.asarray(alpha, dtype=float), np.asarray(k, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (1 - a ** (k + 1)) / (1 - a)
    return np.where(np.isclose(a, 1.0), k + 1, out)


def fit_alpha(ks, taus) -> float:
    """The per-token acceptance a whose expected_tokens(a, k) best matches measured tau over ks."""
    from scipy.optimize import minimize_scalar

    ks, taus = np.asarray(ks, dtype=float), np.asarray(taus, dtype=float)
    ok = np.isfinite(taus) & (ks > 0)
    if not ok.any():
        return float("nan")
    res = minimize_scalar(lambda a: float(np.sum((expected_tokens(a, ks[ok]) - taus[ok]) ** 2)),
                          bounds=(0.0, 0.9999), method="bounded")
    return float(res.x)


@dataclass(frozen=True)
class Acceptance:
    """rates[j-1] = c_j for the measured positions j = 1..len(rates); c_j = tail beyond them."""

    rates: tuple[float, ...]
    tail: float

    @classmethod
    def geometric(cls, alpha: float) -> "Acceptance":
        """Leviathan et al.'s one-rate model: c_j = alpha at every position."""
        return cls((), float(alpha))

    def conditional(self, k: int) -> np.ndarray:
        """(k,) c_1..c_k."""
        measured = list(self.rates[:k])
        return np.array(measured + [self.tail] * (k - len(measured)), dtype=float)

    def survival(self, k: int) -> np.ndarray:
        """(k,) S_j = P(accepted run >= j) = c_1 ... c_j, j = 1..k."""
        return np.cumprod(self.conditional(k))

    def expected_tokens(self, k: int) -> float:
        """E[tokens per verify step] = 1 + sum_{j<=k} S_j (bonus token included)."""
        return float(1.0 + self.survival(k).sum())

    def emission_pmf(self, k: int) -> np.ndarray:
        """(k+1,) P(X = m) for m = 1..k+1 tokens emitted by one verify step."""
        s = np.concatenate([[1.0], self.survival(k), [0.0]])
        return s[:-1] - s[1:]


def pooled_acceptance(acceptances, weights, *, fallback: float) -> Acceptance:
    """Pool cells' per-position conditional rates into one Acceptance.

    acceptances: per cell, its c_1, c_2, ... (nan where no draft reached the position); weights: per cell,
    the row-steps it judged (steps x batch). A cell's drafts reaching position j are estimated as
    weight x c_1 ... c_{j-1}, so each position's pooled rate is the reach-weighted mean of the cells' rates
    there. tail = the reach-weighted rate over every position >= 2 (a copy continuing), else `fallback`
    (e.g. the geometric alpha) when no cell judged a second position. No cell -> geometric(fallback)."""
    num: dict[int, float] = {}
    den: dict[int, float] = {}
    for rates, w in zip(acceptances, weights):
        reach = float(w)
        for j, c in enumerate(map(float, rates)):
            if not math.isfinite(c) or reach <= 0:  # no draft judged here: nor deeper
                break
            num[j] = num.get(j, 0.0) + reach * c
            den[j] = den.get(j, 0.0) + reach
            reach *= c
    depth = 0
    while depth in den and den[depth] > 0:
        depth += 1
    rates = tuple(num[j] / den[j] for j in range(depth))
    deep_den = sum(den[j] for j in range(1, depth))
    tail = sum(num[j] for j in range(1, depth)) / deep_den if deep_den > 0 else float(fallback)
    return Acceptance(rates, tail) if depth else Acceptance.geometric(fallback)


def steps_cdf(pmf, n_tokens: int) -> np.ndarray:
    """(n_tokens + 1,) P(a row is done after s steps), s = 0..n_tokens, for a row that needs n_tokens tokens
    and emits X ~ pmf (pmf[m-1] = P(X = m)) per step. Every step emits >= 1, so s = n_tokens always ends it.

    Dynamic programme over the tokens still missing: mass that reaches 0 missing is absorbed (done)."""
    pmf = np.asarray(pmf, dtype=float)
    if n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} must be >= 1")
    missing = np.zeros(n_tokens + 1)  # missing[t] = P(t tokens still missing and not done)
    missing[n_tokens] = 1.0
    done = np.zeros(n_tokens + 1)
    for s in range(1, n_tokens + 1):
        nxt = np.zeros_like(missing)
        for m, p in enumerate(pmf, start=1):
            nxt[1 : n_tokens + 1 - m] += p * missing[1 + m :]  # t > m: t - m still missing
            done[s] += p * missing[1 : m + 1].sum()  # t <= m: the step finishes the row
        missing = nxt
        done[s] += done[s - 1]
    return done


def expected_batch_steps(pmf, n_tokens: int, rows: int) -> float:
    """E[max over `rows` independent rows of their steps to emit n_tokens] = sum_s (1 - F(s)^rows)."""
    if rows < 1:
        raise ValueError(f"rows={rows!r} must be >= 1")
    cdf = steps_cdf(pmf, n_tokens)
    return float(np.sum(1.0 - cdf[:-1] ** rows))
