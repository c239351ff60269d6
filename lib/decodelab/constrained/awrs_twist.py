"""Twisted SMC on AWRS proposals ("awrs_twist"): AWRS-SMC that learns, run after run, where L's mass lies.

Why: SMC with masked (or AWRS) proposals puts its particles where the model's *next* token is likely, not
where its whole continuation stays in L. On notebook 04's month_day task ("MM-DD") masking sends 96% of the
particles down "1" at the first step while p(. | L) puts 81% on "0": most particles are spent on prefixes the
final weights then discount, so KL falls slowly (a twisted resampling with the exact future mass alone still
leaves it 3x above an exact sampler's at 200k forward passes). The fix is a proposal that looks ahead.

Twist. psi(u) approximates F(u) = P(a model continuation of prefix u ends in L); F(u) = sum_{t in A(u)}
p(t | u) F(u t), F(EOS) = 1. Each run uses a frozen psi learned from the runs before it, as ASAp learns its
EFG (Park et al. 2024) but without masks:
  K(u)      allowed tokens at u that AWRS has accepted or come upon so far (each checked once by the grammar),
  Zbar(u)   the mean of AWRS's unbiased estimates of Z(u) = p(A(u) | u) seen at u,
  psi(u)    = sum_{t in K(u)} p(t | u) psi(u t) + max(0, Zbar(u) - p(K(u) | u)) g(u)
(psi(EOS) = 1; g(u), the twist of children not yet observed, is the mean psi of the observed ones, see
`LearnedTwist.refit`; before any run psi(root) = 1).

Proposal at a particle's prefix u, a two-branch mixture (alpha = S_K / (S_K + S_U), S_K = sum_K p psi,
S_U = psi(u) - S_K; 1 - alpha kept >= UNKNOWN_FLOOR so no allowed token ever has probability 0):
  known branch, probability alpha: t ~ p psi over K(u), no grammar check (already known allowed);
      weight p(t) psi(u t) / (psi(u) alpha p(t) psi(u t) / S_K) = S_K / (alpha psi(u));
  AWRS branch, probability 1 - alpha: t ~ AWRS over A(u) minus K(u) (`awrs.awrs_draw(exclude=K(u))`, K's
      tokens removed before the first draw, never checked); weight Zhat_U psi(u t) / ((1 - alpha) psi(u)),
      Zhat_U AWRS's estimate of Z(u) - p(K(u)), unbiased given t (`awrs.awrs_law`), pooled over the
      AWRS-branch particles at u as in `awrs_trie`; nothing allowed left: the particle's weight is 0.
Either way E[weight | t] equals the twisted target's p(t) psi(u t) / (psi(u) r(t)), so each run is a
random-weight SMC for p(. | L) and its Z_hat is unbiased; psi only moves variance. With psi = F and every
allowed token known the known branch samples p(. | L) exactly at weight 1. Runs are combined by their Z_hat
(`correctors._combine_runs`), which stays consistent when psi changes between runs.

Cost: one forward pass per sampled token as for every corrector; grammar checks only on the AWRS branch.
"""
from __future__ import annotations

import math

import numpy as np

from decodelab.constrained.awrs import WEIGHT_DRAWS, awrs_draw
from decodelab.constrained.awrs_trie import EOS, AwrsNode, resample, settled, weighted_strings
from decodelab.constrained.distortion import TokenTrie

UNKNOWN_FLOOR = 0.02  # least probability of the AWRS branch, so tokens not yet known keep a chance


class LearnedTwist:
    """psi per trie node, learned from AWRS observations between runs (module doc)."""

    def __init__(self, tables: list[AwrsNode], trie: TokenTrie):
        self.tables, self.trie = tables, trie
        self.known: list[dict[int, float]] = [{} for _ in tables]  # node -> {allowed index: p}
        self.z_sum = np.zeros(len(tables))
        self.z_count = np.zeros(len(tables), dtype=np.int64)
        self.psi = np.ones(len(tables))  # replaced by a guess from the parent once it is observed

    def child_psi(self, node: int, index: int) -> float:
        key = self.tables[node].keys[index]
        return 1.0 if key == EOS else float(self.psi[key])

    def known_share(self, node: int) -> tuple[list[int], np.ndarray]:
        """-> (known allowed indices, p(t) psi(u t) of each)."""
        indices = list(self.known[node])
        return indices, np.array([p * self.child_psi(node, i) for i, p in self.known[node].items()])

    def observe(self, node: int, token: int, found: tuple[int, ...], z_hat: float) -> None:
        """An AWRS draw at `node`: its token (-1: none left) and the allowed tokens it found; z_hat estimates Z."""
        t = self.tables[node]
        for i in (token, *found):
            if i >= 0:
                self.known[node][i] = float(t.probs[i])
        self.z_sum[node] += z_hat
        self.z_count[node] += 1

    def refit(self, visited: set[int]) -> None:
        """psi(u) from K, Zbar and the children's psi, deepest visited node first (children before parents).

        g(u), the twist of u's children not yet observed: the p-weighted mean psi of its observed known
        children (EOS: 1), or, with none observed, psi(u) / Zbar(u) (F(u) / Z(u) is the mean F of an allowed
        child drawn by the mask); psi(u) = sum_K p psi + max(0, Zbar - p(K)) g."""
        for node in sorted(visited, key=lambda u: -self.trie.depths[u]):
            t = self.tables[node]
            observed = [(p, self.child_psi(node, i)) for i, p in self.known[node].items()
                        if t.keys[i] == EOS or self.z_count[t.keys[i]] > 0]
            z_bar = self.z_sum[node] / self.z_count[node]
            p_observed = sum(p for p, _ in observed)
            guess = (sum(p * s for p, s in observed) / p_observed if p_observed > 0
                     else float(self.psi[node]) / z_bar)
            for child in self.trie.children[node].values():
                if self.z_count[child] == 0:
                    self.psi[child] = guess
            p_known = sum(self.known[node].values())
            self.psi[node] = (sum(p * self.child_psi(node, i) for i, p in self.known[node].items())
                              + max(0.0, z_bar - p_known) * guess)


def awrs_twisted_run(twist: LearnedTwist, rng, particles: int, ess_threshold: float,
                     weight_draws: int = WEIGHT_DRAWS, learn: bool = True) -> tuple[float, dict[str, float], int, int]:
    """One twisted SMC run with `twist` frozen, then (learn) `twist` refit on what the run's AWRS draws saw.
    -> (log Z_hat, {string: normalized weight}, forward passes, grammar checks)."""
    tables, trie = twist.tables, twist.trie
    psi = twist.psi.copy()
    nodes = [0] * particles
    done: list[str | None] = [None] * particles
    logw = np.full(particles, math.log(psi[0]))
    log_zhat, cost, checks = 0.0, 0, 0
    seen: list[tuple[int, int, tuple[int, ...], float]] = []
    while any(d is None for d in done):
        awrs_estimates: dict[int, list[float]] = {}
        awrs_moves = []  # (particle, node, index, 1 - alpha) of AWRS-branch particles whose token was new
        for k in range(particles):
            if done[k] is not None or logw[k] == -math.inf:
                continue
            node = nodes[k]
            t = tables[node]
            indices, shares = twist.known_share(node)
            s_known = float(shares.sum())
            alpha = min(s_known / psi[node], 1.0 - UNKNOWN_FLOOR) if s_known > 0 else 0.0
            cost += 1
            if rng.random() < alpha:
                index = indices[int(rng.choice(len(indices), p=shares / s_known))]
                logw[k] += math.log(s_known / (alpha * psi[node]))
            else:
                draw = awrs_draw(t.probs, t.allowed, rng, weight_draws=weight_draws, exclude=indices,
                                 allow_empty=True)
                checks += draw.checks
                p_known = float(sum(twist.known[node].values()))
                seen.append((node, draw.token, draw.found, draw.weight + p_known))
                awrs_estimates.setdefault(node, []).append(draw.weight)
                if draw.token < 0:  # every allowed token is known: this branch has nothing to offer
                    logw[k] = -math.inf
                    continue
                index = draw.token
                awrs_moves.append((k, node, index, 1.0 - alpha))
            key = t.keys[index]
            if key == EOS:
                done[k] = trie.complete[node]
            else:
                nodes[k] = key
        for k, node, index, unknown in awrs_moves:
            z_hat = float(np.mean(awrs_estimates[node]))
            step_psi = 1.0 if tables[node].keys[index] == EOS else psi[tables[node].keys[index]]
            logw[k] += math.log(z_hat * step_psi / (unknown * psi[node]))
        if settled(logw, done):
            break
        step_zhat, nodes, done, logw = resample(logw, nodes, done, rng, ess_threshold)
        log_zhat += step_zhat
    if learn:
        _refit(twist, seen)
    if not np.isfinite(logw).any():
        return -math.inf, {}, cost, checks
    final_zhat, estimate = weighted_strings(logw, done)
    return log_zhat + final_zhat, estimate, cost, checks


def _refit(twist: LearnedTwist, seen) -> None:
    visited = set()
    for node, token, found, z_hat in seen:
        twist.observe(node, token, found, z_hat)
        visited.add(node)
    for node in list(visited):  # ancestors' psi depend on their children's: refit the whole path up
        parent = twist.trie.parents[node]
        while parent >= 0 and parent not in visited:
            visited.add(parent)
            parent = twist.trie.parents[parent]
    twist.refit({u for u in visited if twist.z_count[u] > 0})
