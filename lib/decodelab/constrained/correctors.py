"""Correctors that target p(x | x in L) instead of masked sampling's locally renormalized q(x).

Each runs on a scored `TokenTrie` (see `decodelab.constrained.distortion`): the trie holds the model's next-token
probabilities at every prefix that can still end in L, which is every prefix these samplers can visit,
so sampling from it is sampling from the model, exactly, with the decode work counted instead of redone.
Cost unit: one forward pass = one token position the model must score (a sampled token, EOS included;
the shared prompt prefill is not counted). A rejected sample stops at its first token that leaves L's
prefixes (the grammar checks prefixes), so rejection is charged for the tokens it sampled up to there.

- "masked": the baseline; converges to q, not to p(. | L).
- "rejection": sample from p, keep samples in L. Exact; expected cost ~ (mean length) / p(L).
- "smc": K particles propose with the mask, weight w *= Z(prefix) per step (p(x) 1[x in L] / q(x) =
  prod Z), resample when the effective sample size falls below ess_threshold * K (Lew et al. 2023;
  Loula et al. 2025). ess_threshold = 0 gives plain importance sampling.
- "awrs" / "awrs_smc": adaptive weighted rejection sampling (Lipkin et al. 2025), per step and as SMC
  proposals with unbiased weights (pooled over the particles at one prefix); see `constrained.awrs` and
  `constrained.awrs_trie`.
- "awrs_twist": AWRS-SMC with a twist learned between runs (where L's mass lies below each prefix), proposing
  among the allowed tokens already found in proportion to p times that twist; see `constrained.awrs_twist`.
- "asap": Adaptive Sampling with Approximate expected futures (Park et al. 2024): sample with
  q_k(t | w) ~ p(t | w) EFG_k(w t), where EFG_k(w) approximates p(L | w) from the prefixes seen so far
  (unseen prefixes: 1), and tighten EFG along each sampled path. q_k -> p(. | L) as the trie fills in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decodelab.constrained.distortion import STOP, TokenTrie, allowed_next, kl, tv

CORRECTORS = ("masked", "rejection", "smc", "importance", "asap", "awrs", "awrs_smc", "awrs_twist")
# what each method asks of the grammar per sampled token: a full mask (every vocabulary token checked) or
# checks of single tokens (rejection: the sampled one; AWRS: each draw, counted as the walk goes)
FULL_MASK = ("masked", "smc", "importance", "asap")
EOS = STOP


@dataclass
class _Node:
    keys: list[int]        # allowed next: child node ids, EOS = -1
    probs: np.ndarray      # model probabilities of those (unnormalized: sum = Z)
    z: float               # mass the mask keeps


def _tables(trie: TokenTrie) -> list[_Node]:
    if not trie.scored:
        raise ValueError("trie is not scored: call distortion.score_trie first")
    out = []
    for node in range(len(trie)):
        keys, logps = allowed_next(trie, node)
        probs = np.exp(np.array(logps, dtype=np.float64))
        out.append(_Node(keys, probs, float(probs.sum())))
    return out


def _walk(tables, trie, rng, weights_of, path: list[int]) -> tuple[str | None, int]:
    """Sample one path: at each node pick among allowed keys with weights_of(node) (plus an 'off' mass).

    Appends the visited nodes to `path`. -> (string, or None if the sample left L; tokens sampled).
    """
    node, cost = 0, 0
    while True:
        path.append(node)
        weights, off = weights_of(node)
        total = weights.sum() + off
        cost += 1
        u = rng.random() * total
        if u >= weights.sum():
            return None, cost
        pick = min(int(np.searchsorted(np.cumsum(weights), u, side="right")), len(weights) - 1)
        key = tables[node].keys[pick]
        if key == EOS:
            return trie.complete[node], cost
        node = key


def estimate_from_counts(counts: dict[str, float], n: float, strings: list[str]) -> dict[str, float]:
    """Counts (possibly weighted, summing to n) -> distribution over L with Jeffreys smoothing (+1/2 each).

    Smoothing keeps KL finite for strings not yet seen; every method gets the same estimator.
    """
    alpha = 0.5
    denom = n + alpha * len(strings)
    return {s: (counts.get(s, 0.0) + alpha) / denom for s in strings}


FLOOR_SEEDS = 5  # exact-sampler draws averaged per floor value (its spread across seeds is a few percent)


def exact_sampler_floor(target: dict[str, float], n: float, *, seeds: int = FLOOR_SEEDS, seed: int = 0) -> float:
    """Mean KL(target || estimate) that n i.i.d. draws from the target itself get under `estimate_from_counts`.

    The KL of a perfect sampler is not 0: the smoothed histogram of n draws is noisy, about (|L| - 1) / (2n)
    nats for a spread-out target (the chi-square term of KL's expansion), less for a peaked one. A
    corrector's measured KL is this floor plus its own bias, so the floor says what the estimator can resolve.
    n: samples, rounded (weighted methods: effective samples as `_combine_runs` counts them); n = 0 gives the
    KL of the uniform smoothed estimate. -> nats, averaged over `seeds` multinomial draws seeded from `seed`.
    """
    if n < 0 or seeds < 1:
        raise ValueError(f"n={n!r} must be >= 0 and seeds={seeds!r} >= 1")
    strings = list(target)
    p = np.array([target[s] for s in strings], dtype=np.float64)
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(seeds):
        draws = rng.multinomial(int(round(n)), p / p.sum())
        values.append(kl(target, estimate_from_counts(dict(zip(strings, draws.astype(float))), float(n), strings)))
    return float(np.mean(values))


def run_corrector(trie: TokenTrie, method: str, target: dict[str, float], budgets: list[int], *, seed: int = 0,
                  particles: int = 16, ess_threshold: float = 0.5) -> list[dict]:
    """Run `method` until each forward-pass budget; -> [{method, forward_passes, samples, kl, kl_floor, tv,
    masks, checks}] per budget.

    kl = KL(target || estimate), tv = TV(target, estimate), estimate smoothed as in `estimate_from_counts`;
    kl_floor = `exact_sampler_floor` at the row's sample count (what a perfect sampler would measure).
    masks: full vocabulary masks computed (one per sampled token for FULL_MASK methods); checks: single-token
    grammar checks (rejection: one per sampled token; AWRS: one per draw).
    """
    if method not in CORRECTORS:
        raise ValueError(f"method={method!r} is not a corrector; allowed: {list(CORRECTORS)}")
    if not budgets or any(b < 1 for b in budgets):
        raise ValueError(f"budgets={budgets!r} must be a non-empty list of positive forward-pass counts")
    tables = _tables(trie)
    rng = np.random.default_rng(seed)
    strings = trie.strings
    budgets = sorted(budgets)
    rows, cost, checks = [], 0, 0
    counts: dict[str, float] = {}
    n = 0.0
    efg = np.ones(len(trie))

    def record():
        est = estimate_from_counts(counts, n, strings)
        rows.append({"method": method, "forward_passes": cost, "samples": n,
                     "kl": kl(target, est), "kl_floor": exact_sampler_floor(target, n, seed=seed),
                     "tv": tv(target, est),
                     "masks": cost if method in FULL_MASK else 0,
                     "checks": cost if method == "rejection" else checks})

    if method in ("awrs", "awrs_smc", "awrs_twist"):
        from decodelab.constrained.awrs_trie import awrs_smc_run, awrs_tables, awrs_walk
        from decodelab.constrained.awrs_twist import LearnedTwist, awrs_twisted_run

        awrs = awrs_tables(trie)
        twist = LearnedTwist(awrs, trie) if method == "awrs_twist" else None
        runs = []
        for budget in budgets:
            while cost < budget:
                if method == "awrs":
                    string, spent, checked = awrs_walk(awrs, trie, rng)
                    counts[string] = counts.get(string, 0.0) + 1.0
                    n += 1
                elif method == "awrs_smc":
                    log_zhat, estimate, spent, checked = awrs_smc_run(awrs, trie, rng, particles, ess_threshold)
                    runs.append((log_zhat, estimate))
                else:
                    log_zhat, estimate, spent, checked = awrs_twisted_run(twist, rng, particles, ess_threshold)
                    runs.append((log_zhat, estimate))
                cost += spent
                checks += checked
            if method != "awrs":
                counts, n = _combine_runs(runs, particles)
            record()
        return rows

    if method in ("smc", "importance"):
        threshold = 0.0 if method == "importance" else ess_threshold
        runs = []  # (log Z_hat, {string: normalized weight})
        for budget in budgets:
            while cost < budget:
                log_zhat, estimate, spent = smc_run(tables, trie, rng, particles, threshold)
                cost += spent
                runs.append((log_zhat, estimate))
            counts, n = _combine_runs(runs, particles)
            record()
        return rows

    mask_weights = lambda node: (tables[node].probs, 0.0)  # noqa: E731
    reject_weights = lambda node: (tables[node].probs, max(0.0, 1.0 - tables[node].z))  # noqa: E731

    def asap_weights(node):
        t = tables[node]
        return t.probs * np.array([1.0 if k == EOS else efg[k] for k in t.keys]), 0.0

    weights_of = {"masked": mask_weights, "rejection": reject_weights, "asap": asap_weights}[method]
    for budget in budgets:
        while cost < budget:
            path: list[int] = []
            string, spent = _walk(tables, trie, rng, weights_of, path)
            cost += spent
            if string is not None:
                counts[string] = counts.get(string, 0.0) + 1.0
                n += 1
            if method == "asap":
                _asap_update(tables, efg, path)
        record()
    return rows


def _asap_update(tables, efg: np.ndarray, path: list[int]) -> None:
    """EFG(w) <- sum_{allowed t} p(t | w) EFG(w t) at each node of the sampled path, deepest first.

    EOS at a complete node counts 1 (the string is in L); children never visited keep EFG = 1.
    """
    for node in reversed(path):
        t = tables[node]
        efg[node] = float(sum(p * (1.0 if k == EOS else efg[k]) for p, k in zip(t.probs, t.keys)))


def _combine_runs(runs, particles: int) -> tuple[dict[str, float], float]:
    """Independent SMC runs -> one estimate: weight each run by its marginal-likelihood estimate Z_hat.
    Runs with Z_hat = 0 (every particle died) carry no weight and count no samples."""
    runs = [(lz, e) for lz, e in runs if lz > -math.inf]
    if not runs:
        return {}, 0.0
    top = max(lz for lz, _ in runs)
    weights = [math.exp(lz - top) for lz, _ in runs]
    total = sum(weights)
    n = float(particles * len(runs))
    counts: dict[str, float] = {}
    for w, (_, estimate) in zip(weights, runs):
        for s, share in estimate.items():
            counts[s] = counts.get(s, 0.0) + n * share * w / total
    return counts, n


def smc_run(tables, trie: TokenTrie, rng, particles: int, ess_threshold: float):
    """One SMC run with K particles. -> (log Z_hat, {string: normalized weight}, forward passes spent).

    Proposal: the mask's locally renormalized q; incremental weight Z(prefix); multinomial resampling
    when ESS = (sum w)^2 / sum w^2 < ess_threshold * K. Finished particles keep their weight and ride along.
    """
    nodes = [0] * particles
    done: list[str | None] = [None] * particles
    logw = np.zeros(particles)
    log_zhat, cost = 0.0, 0
    while any(d is None for d in done):
        for k in range(particles):
            if done[k] is not None:
                continue
            t = tables[nodes[k]]
            pick = int(rng.choice(len(t.keys), p=t.probs / t.z))
            logw[k] += math.log(t.z)
            cost += 1
            key = t.keys[pick]
            if key == EOS:
                done[k] = trie.complete[nodes[k]]
            else:
                nodes[k] = key
        w = np.exp(logw - logw.max())
        ess = w.sum() ** 2 / (w ** 2).sum()
        if ess_threshold > 0 and ess < ess_threshold * particles and any(d is None for d in done):
            log_zhat += logw.max() + math.log(w.mean())
            picks = rng.choice(particles, size=particles, p=w / w.sum())
            nodes = [nodes[i] for i in picks]
            done = [done[i] for i in picks]
            logw = np.zeros(particles)
    w = np.exp(logw - logw.max())
    log_zhat += logw.max() + math.log(w.mean())
    estimate: dict[str, float] = {}
    for k in range(particles):
        estimate[done[k]] = estimate.get(done[k], 0.0) + w[k] / w.sum()
    return log_zhat, estimate, cost


def budgets_up_to(max_forward_passes: int, points: int = 8, start: int = 10) -> list[int]:
    """Geometric forward-pass budgets from `start` to `max_forward_passes` (for KL-vs-compute curves)."""
    if max_forward_passes < start:
        raise ValueError(f"max_forward_passes={max_forward_passes!r} must be >= {start}")
    values = np.unique(np.geomspace(start, max_forward_passes, points).astype(int))
    return [int(v) for v in values]
