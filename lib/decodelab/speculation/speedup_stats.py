"""Confidence intervals of a speedup measured from interleaved timed rounds.

What the interval is about. Greedy decoding of fixed prompts is deterministic: every run of a method emits
the same tokens through the same sequence of steps (the same drafts accepted at the same positions). The
only thing that varies between two runs of one method is the machine (background load, caches, frequency).
So the question "is this method >= x times plain decoding on this workload on this machine?" has one unit of
replication: a *round*, in which plain and the method each decode the whole workload once, back to back,
each timed by one wall clock over its whole decode. The population the interval covers is repeated rounds
on this machine in the state it was measured in (not other prompts, not other machines).

Resampling the steps inside a run (as if they were independent draws) is wrong for this question: a run's
steps differ by design (a step that accepted 4 drafts vs one that accepted none), and that deterministic
variation widens the interval without being measurement noise; it also ignores that a run's steps share
the machine state, which is the noise that matters.

The interval: per round r the paired log ratio l_r = log(rate_method_r / rate_plain_r) (the same prompts,
the order alternated between rounds so neither side always runs first); mean(l) +- t_{n-1} s / sqrt(n),
exponentiated (a Student t interval on log ratios: exact when the paired noise is log-normal, and the
log makes "1.1x faster" and "1.1x slower" symmetric). With one round there is no interval (None).

Pooled noise (`pooled_speedup_intervals`). A few rounds give a poor estimate of s (2 rounds: 1 degree of
freedom, t = 12.7). Every method of one batch is measured in the same rounds on the same machine, so the
noise is estimated once from all of them, with the additive two-way model of log rates
log rate[m, r] = mu_m + rho_r + e[m, r] (m: plain and the methods, r: rounds, rho_r: the round's shared
drift, which cancels in every paired ratio; e: independent noise of one scale s): s^2 = the sum of squared
interaction residuals over M (n - 1) degrees of freedom (M methods besides plain, n rounds), and method m's
interval is exp(mu_m - mu_plain +- t_df s sqrt(2 / n)). The assumption (stated with every interval) is one
noise scale across the runs pooled; a plain-vs-plain (A/A) pair among them shows that scale directly.

Runs of like length. Runs stepped side by side share the round's drift only while both are stepping: a run
that finishes in 8 of the round's 31 steps (n-gram drafts at k = 8) meets a different slice of it than plain,
and its paired ratio is noisier. Measured in one quiet sweep at batch 4 (4 rounds), the per-round sd of the
log ratio was 0.2-1.4% for runs as long as plain's (its A/A twin, the adaptive policies at k = 0, a draft
model at k = 1) and 1-4% for runs of 8-19 steps. One scale pooled over both widened the first group's
intervals (and narrowed the second's). So the noise is pooled within two strata: runs of at least
FULL_LENGTH of plain's steps, and the shorter ones, each with the additive model over plain and its members.

Plain measured twice per round. A sweep with an A/A check decodes plain twice in every round (its twin).
Both are runs of the same method, so the reference of round r is their mean log rate: the method's paired
difference then carries the noise of one run plus half of one, s^2 (1 + 1/P) per round with P plain runs,
instead of 2 s^2 (half-width x sqrt(3/4) at P = 2). The twin still gives plain's own A/A interval (plain
vs twin, both single runs), and it enters each stratum's table as one more full-length row.

Interrupted steps (`cap_interruptions`). Measured at batch 1 (8 rounds of 31 steps of ~43 ms), a run's step
now and then took 60-75 ms, 1.4-1.8x the same step in its other rounds: another process or an interrupt took
the core for one step of one run, and one such step moves that run's round by 1-2%, the whole margin a "never
loses" bound at 0.98 has. Where every round of a run took the same steps (the same tokens per step: greedy
decoding of fixed prompts does), each step's seconds are capped at (1 + SPIKE) times that step's median over
the rounds before the rounds are summed, for every run alike (plain, its twin and the methods). The cap leaves
a round's drift (a whole round 9% slower moves every step by about that much) and anything a run pays at the
same step in every round; it takes only what lands on one step of one run in one round.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats as scipy_stats

SPIKE = 0.25  # a step slower than (1 + SPIKE) x its median over the rounds was interrupted (module docstring)


def cap_interruptions(rounds: list[tuple[list, list]], spike: float = SPIKE) -> tuple[list[tuple[list, list]], int]:
    """One run's rounds (step_tokens, step_seconds) -> (the same with each step's seconds capped at (1 + spike)
    times that step's median over the rounds, the number of steps capped). Unchanged (0 capped) unless every
    round took the same steps (same count, same tokens per step) and there are at least 3 rounds (a median of
    two is their mean: one interrupted step would raise its own cap)."""
    if spike < 0:
        raise ValueError(f"spike={spike!r} must be >= 0")
    if len(rounds) < 3 or len({tuple(tokens) for tokens, _ in rounds}) != 1:
        return rounds, 0
    seconds = np.asarray([s for _, s in rounds], dtype=float)  # (rounds, steps)
    cap = (1 + spike) * np.median(seconds, axis=0)
    capped = np.minimum(seconds, cap)
    return [(list(tokens), row.tolist()) for (tokens, _), row in zip(rounds, capped)], int((seconds > cap).sum())


def round_rates(rounds: list[tuple[list, list]]) -> np.ndarray:
    """(n_rounds,) decode rate of each run: its tokens over its seconds (one wall clock per run: the sum
    of its step seconds, the steps being consecutive). rounds: one (step_tokens, step_seconds) per run."""
    return np.array([float(np.sum(t)) / float(np.sum(s)) for t, s in rounds])


def log_ratio_interval(log_ratios, *, level: float = 0.95) -> tuple[float, float, float] | None:
    """(estimate, low, high) of exp(mean log ratio) with a Student t interval over the rounds; None with
    fewer than 2 rounds (one round has no spread to judge noise by)."""
    x = np.asarray(log_ratios, dtype=float)
    if x.ndim != 1 or not np.all(np.isfinite(x)):
        raise ValueError(f"log_ratios={log_ratios!r} must be a 1-d sequence of finite numbers")
    if len(x) < 2:
        return None
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    half = float(scipy_stats.t.ppf((1 + level) / 2, df=len(x) - 1)) * sd / math.sqrt(len(x))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def speedup_interval(plain_rounds: list[tuple[list, list]], method_rounds: list[tuple[list, list]], *,
                     level: float = 0.95) -> tuple[float | None, float | None]:
    """(low, high) interval of the method's decode rate over plain's, paired by interleaved round; (None,
    None) with a single round.

    plain_rounds / method_rounds: one (step_tokens, step_seconds) per round, paired by index (round r's
    plain run and method run decoded the same prompts back to back).
    """
    if len(plain_rounds) != len(method_rounds) or not plain_rounds:
        raise ValueError(f"need one plain run per method run, at least one (got {len(plain_rounds)} "
                         f"and {len(method_rounds)})")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    ci = log_ratio_interval(np.log(round_rates(method_rounds) / round_rates(plain_rounds)), level=level)
    return (None, None) if ci is None else (ci[1], ci[2])


FULL_LENGTH = 0.8  # a run of at least this fraction of plain's steps shares the round's drift as plain's does


def _mean_steps(rounds: list[tuple[list, list]]) -> float:
    return float(np.mean([len(seconds) for _, seconds in rounds]))


def pooled_speedup_intervals(plain_rounds: list[tuple[list, list]], methods_rounds: list[list[tuple[list, list]]],
                             *, plain_twins: list[list[tuple[list, list]]] = (),
                             level: float = 0.95) -> list[tuple[float | None, float | None]]:
    """(low, high) per method of its decode rate over plain's, paired by round, with the round-to-round
    noise pooled over the methods of its length stratum (see the module docstring); (None, None) each with
    one round.

    plain_rounds: plain's (step_tokens, step_seconds) per round; methods_rounds: one such list per method,
    every list as long as plain's; plain_twins: further plain runs of the same rounds (the A/A twin), which
    join plain in each round's reference (module docstring: P = 1 + len(plain_twins))."""
    n = len(plain_rounds)
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    if n == 0 or any(len(m) != n for m in [*methods_rounds, *plain_twins]):
        raise ValueError(f"need one plain run per method run, at least one (got {n} plain rounds and "
                         f"{[len(m) for m in [*methods_rounds, *plain_twins]]} per method and twin)")
    if n < 2 or not methods_rounds:
        return [(None, None)] * len(methods_rounds)
    n_plain = 1 + len(plain_twins)
    logs = np.log(np.stack([round_rates(r) for r in [plain_rounds, *plain_twins, *methods_rounds]]))  # (P + M, n)
    reference = logs[:n_plain].mean(0)  # (n,) each round's plain log rate, averaged over its plain runs
    full = np.array([_mean_steps(m) for m in methods_rounds]) >= FULL_LENGTH * _mean_steps(plain_rounds)
    out: list[tuple[float, float]] = [None] * len(methods_rounds)
    for stratum in (np.flatnonzero(full), np.flatnonzero(~full)):
        if not len(stratum):
            continue
        sub = logs[np.r_[np.arange(n_plain), stratum + n_plain]]  # plain's runs and this stratum's methods
        residual = sub - sub.mean(1, keepdims=True) - sub.mean(0, keepdims=True) + sub.mean()
        df = (len(sub) - 1) * (n - 1)
        sd = math.sqrt(float((residual ** 2).sum()) / df)
        half = float(scipy_stats.t.ppf((1 + level) / 2, df=df)) * sd * math.sqrt((1 + 1 / n_plain) / n)
        for m in stratum.tolist():
            gain = float((logs[m + n_plain] - reference).mean())
            out[m] = (math.exp(gain - half), math.exp(gain + half))
    return out
