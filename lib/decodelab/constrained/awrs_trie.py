"""AWRS on a scored `TokenTrie`: the per-step sampler ("awrs") and SMC with AWRS proposals ("awrs_smc").

At a trie node the model's next-token distribution is laid out as one vector: the tokens the grammar allows
(children, plus EOS where the node spells a whole string), then the forbidden tokens score_trie kept
(`off_logp`, most likely first), then one lump for the remaining forbidden mass (1 minus the rest: many
tiny tokens, counted as one token, so checks are slightly under-counted when a draw lands there; the
accepted law and the weight's unbiasedness do not depend on how forbidden mass is split).

- "awrs": `awrs.awrs_draw` at every step, no weights: the masked-renormalized law, so it converges to
  masking's q (not to p(. | L)), at a few grammar checks per token instead of a vocabulary-wide mask.
- "awrs_smc": K particles propose with AWRS and multiply their weight by an unbiased estimate of Z (instead of
  the exact Z the mask gives SMC); resampling as in `correctors.smc_run`. Unbiased incremental weights keep
  SMC's estimate consistent for p(. | L) (random-weight / pseudo-marginal SMC).

Pooling: particles at the same prefix share one next-token distribution, hence one Z, so each of them gets the
mean of their estimates. Given every particle's token, each estimate has mean Z (`awrs.awrs_law`, given_token)
and the particles draw independently, so the mean is still unbiased; what it removes is weight noise that is
pure noise: at the root every particle sits at one node, and with unpooled estimates their weights differed
by the estimator's spread alone, which lowered the effective sample size and triggered resampling for
nothing (SMC's exact Z gives them equal weights). On notebook 04's month_day task the root keeps Z < 0.01 in
two allowed tokens, where one particle's estimate spreads about as much as its mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decodelab.constrained.awrs import WEIGHT_DRAWS, awrs_draw
from decodelab.constrained.distortion import STOP, TokenTrie, allowed_next

EOS = STOP


@dataclass
class AwrsNode:
    keys: list[int]      # allowed: child node ids, EOS = -1 (the first len(keys) entries of probs)
    probs: np.ndarray    # allowed probabilities, then kept forbidden ones, then the forbidden lump

    def allowed(self, index: int) -> bool:
        return index < len(self.keys)


def awrs_tables(trie: TokenTrie) -> list[AwrsNode]:
    """One `AwrsNode` per trie node (the trie must be scored, with off_logp)."""
    if not trie.scored or trie.off_logp is None:
        raise ValueError("trie is not scored with forbidden-token log-probs: call distortion.score_trie first")
    out = []
    for node in range(len(trie)):
        keys, logps = allowed_next(trie, node)
        allowed = np.exp(np.array(logps, dtype=np.float64))
        off = np.exp(np.array(trie.off_logp[node], dtype=np.float64))
        lump = max(0.0, 1.0 - allowed.sum() - off.sum())
        out.append(AwrsNode(keys, np.concatenate([allowed, off, [lump]])))
    return out


def awrs_walk(tables: list[AwrsNode], trie: TokenTrie, rng) -> tuple[str, int, int]:
    """One AWRS sample from the root -> (string, tokens sampled incl. EOS, grammar checks)."""
    node, cost, checks = 0, 0, 0
    while True:
        t = tables[node]
        draw = awrs_draw(t.probs, t.allowed, rng, weight_draws=0)
        cost += 1
        checks += draw.checks
        key = t.keys[draw.token]
        if key == EOS:
            return trie.complete[node], cost, checks
        node = key


def awrs_smc_run(tables: list[AwrsNode], trie: TokenTrie, rng, particles: int, ess_threshold: float,
                 weight_draws: int = WEIGHT_DRAWS, pool: bool = True):
    """One SMC run with AWRS proposals. -> (log Z_hat, {string: normalized weight}, forward passes, checks).

    pool: each particle's step weight is the mean estimate of the particles at its node (module doc); False
    gives each its own estimate (kept for the tests of both). `awrs.awrs_draw`'s weights are > 0, so no
    particle dies; a weight of 0 would still be handled (log weight -inf; a run whose particles all die
    returns log Z_hat = -inf and an empty estimate, which carries no weight when runs are combined)."""
    nodes = [0] * particles
    done: list[str | None] = [None] * particles
    logw = np.zeros(particles)
    log_zhat, cost, checks = 0.0, 0, 0
    while any(d is None for d in done):
        estimates: dict[int, list[float]] = {}  # node -> the weight estimates its particles drew this step
        moved = []
        for k in range(particles):
            if done[k] is not None or logw[k] == -math.inf:
                continue
            t = tables[nodes[k]]
            draw = awrs_draw(t.probs, t.allowed, rng, weight_draws=weight_draws)
            cost += 1
            checks += draw.checks
            estimates.setdefault(nodes[k], []).append(draw.weight)
            moved.append((k, nodes[k]))
            key = t.keys[draw.token]
            if key == EOS:
                done[k] = trie.complete[nodes[k]]
            else:
                nodes[k] = key
        for k, node in moved:  # pooled: every particle at a node gets the mean of their estimates of its Z
            pooled = float(np.mean(estimates[node])) if pool else estimates[node].pop(0)
            logw[k] += math.log(pooled) if pooled > 0 else -math.inf
        if settled(logw, done):
            break
        step_zhat, nodes, done, logw = resample(logw, nodes, done, rng, ess_threshold)
        log_zhat += step_zhat
    if not np.isfinite(logw).any():
        return -math.inf, {}, cost, checks
    final_zhat, estimate = weighted_strings(logw, done)
    return log_zhat + final_zhat, estimate, cost, checks


def settled(logw: np.ndarray, done: list) -> bool:
    """A run is over when every particle died (weight 0) or every live one has finished."""
    return all(done[k] is not None for k in range(len(logw)) if np.isfinite(logw[k]))


def resample(logw: np.ndarray, nodes: list, done: list, rng, ess_threshold: float):
    """Multinomial resampling when the effective sample size (sum w)^2 / sum w^2 < ess_threshold * K.
    logw (K,) -> (log of the mean weight folded into Z_hat, or 0 when no resampling, nodes, done, logw)."""
    particles = len(logw)
    w = np.exp(logw - logw.max())
    if not (ess_threshold > 0 and w.sum() ** 2 / (w ** 2).sum() < ess_threshold * particles):
        return 0.0, nodes, done, logw
    picks = rng.choice(particles, size=particles, p=w / w.sum())
    return (logw.max() + math.log(w.mean()), [nodes[i] for i in picks], [done[i] for i in picks],
            np.zeros(particles))


def weighted_strings(logw: np.ndarray, done: list) -> tuple[float, dict[str, float]]:
    """A finished run's particles -> (log of their mean weight, the last factor of Z_hat; {string: weight share})."""
    w = np.exp(logw - logw.max())
    estimate: dict[str, float] = {}
    for k, string in enumerate(done):
        if w[k] > 0:
            estimate[string] = estimate.get(string, 0.0) + w[k] / w.sum()
    return logw.max() + math.log(w.mean()), estimate
