"""Confidence intervals of a speedup measured from interleaved timed rounds.

A run's decode rate is tokens / seconds summed over its steps. Within one round plain decoding and a method
ran back to back on the same prompts, so their ratio is paired by the round. The interval resamples rounds
(with replacement) and, inside each drawn round, each run's steps (with replacement, (tokens, seconds)
pairs kept together): the steps carry the machine's noise (a burst of load slows a few of them) and the
prompts' varying acceptance (how many tokens a verify step yields), the rounds the drift between rounds.
"""
from __future__ import annotations

import numpy as np


def _resampled_rates(tokens: np.ndarray, seconds: np.ndarray, rng, n_boot: int) -> np.ndarray:
    """(n_boot,) tokens / seconds of n_boot resamplings of one run's steps."""
    idx = rng.integers(0, len(tokens), size=(n_boot, len(tokens)))
    return tokens[idx].sum(1) / seconds[idx].sum(1)


def speedup_interval(plain_rounds: list[tuple[list, list]], method_rounds: list[tuple[list, list]], *,
                     n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """(low, high) percentile interval of the method's decode rate over plain's.

    plain_rounds / method_rounds: one (step_tokens, step_seconds) per interleaved round, paired by index.
    """
    if len(plain_rounds) != len(method_rounds) or not plain_rounds:
        raise ValueError(f"need one plain run per method run, at least one (got {len(plain_rounds)} "
                         f"and {len(method_rounds)})")
    rng = np.random.default_rng(seed)
    ratios = []
    for (pt, ps), (mt, ms) in zip(plain_rounds, method_rounds):
        p = _resampled_rates(np.asarray(pt, float), np.asarray(ps, float), rng, n_boot)
        m = _resampled_rates(np.asarray(mt, float), np.asarray(ms, float), rng, n_boot)
        ratios.append(m / p)
    ratios = np.stack(ratios)  # (rounds, n_boot)
    pick = rng.integers(0, len(ratios), size=(n_boot, len(ratios)))
    boots = ratios[pick, np.arange(n_boot)[:, None]].mean(1)
    alpha = (1 - level) / 2
    return float(np.quantile(boots, alpha)), float(np.quantile(boots, 1 - alpha))
