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
        if not np.isfinite(logw).any():
            return -math.inf, {}, cost, checks
        alive = [k for k in range(particles) if np.isfinite(logw[k])]
        if all(done[k] is not None for k in alive):
            break
        w = np.exp(logw - logw.max())
        ess = w.sum() ** 2 / (w ** 2).sum()
        if ess_threshold > 0 and ess < ess_threshold * particles:
            log_zhat += logw.max() + math.log(w.mean())
            picks = rng.choice(particles, size=particles, p=w / w.sum())
            nodes = [nodes[i] for i in picks]
            done = [done[i] for i in picks]
            logw = np.zeros(particles)
    w = np.exp(logw - logw.max())
    log_zhat += logw.max() + math.log(w.mean())
    estimate: dict[str, float] = {}
    for k in range(particles):
        if w[k] > 0:
            estimate[done[k]] = estimate.get(done[k], 0.0) + w[k] / w.sum()
    return log_zhat, estimate, cost, checks
