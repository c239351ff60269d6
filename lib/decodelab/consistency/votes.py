"""Self-consistency: votes over sampled answers, early-stopping rules, and vote accuracy from one pool
of samples per problem.

An answer is any hashable value (the arithmetic tasks give ints); `None` means the extractor found no
answer in that sample. A `None` never votes: it is counted in `n_no_answer`, and when no sample has an
answer the vote itself is `None` (explicitly "no answer", scored wrong), never a silent guess.

Votes (Wang et al. 2022): majority (each valid sample counts 1) and log-probability weighted (each counts
exp(mean token log-prob), the length-normalized sequence probability). Ties go to the answer that appeared
first in the sample stream, which is random order for i.i.d. samples.

Stopping rules decide, sample by sample, whether to draw more:
- ESC (Li et al. 2024): draw samples in windows of w; stop after a window whose w answers all agree.
- Adaptive consistency (Aggarwal et al. 2023): stop once the leader is the true majority with posterior
  probability >= threshold (Beta over the top two counts, or Dirichlet over all answers), or, budget-aware,
  once the leader would keep its lead over the rest of the budget with predictive probability >= threshold.

Sampling the pools with a model, and notebook 05's goals and findings, are in `experiment`.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

NO_ANSWER = None
ADAPTIVE_CRITERIA = ("beta", "dirichlet", "predictive")


@dataclass(frozen=True)
class Vote:
    answer: Hashable | None  # None = no sample had an answer
    n_samples: int  # samples the vote looked at, no-answers included
    n_no_answer: int
    scores: dict = field(default_factory=dict)  # answer -> count (or summed weight)

    @property
    def support(self) -> float:
        """Share of the answered samples' score held by the winner (0 when nothing answered)."""
        total = sum(self.scores.values())
        return self.scores[self.answer] / total if self.answer is not None and total > 0 else 0.0


def _check_samples(answers: Sequence, name: str = "answers") -> None:
    if len(answers) < 1:
        raise ValueError(f"{name} has {len(answers)} samples: a vote needs n >= 1")


def majority_vote(answers: Sequence[Hashable | None], weights: Sequence[float] | None = None) -> Vote:
    """The answer with the largest count (or summed weight); None answers never vote.

    answers: n answers (None = no answer); weights: n non-negative floats (default 1 each).
    """
    _check_samples(answers)
    if weights is None:
        weights = [1.0] * len(answers)
    if len(weights) != len(answers):
        raise ValueError(f"weights has {len(weights)} entries for {len(answers)} answers; need one per answer")
    scores: dict = {}
    for answer, weight in zip(answers, weights):
        if answer is NO_ANSWER:
            continue
        if not weight >= 0:  # also catches NaN
            raise ValueError(f"weight={weight!r} must be a non-negative number")
        scores[answer] = scores.get(answer, 0.0) + float(weight)
    n_no_answer = sum(answer is NO_ANSWER for answer in answers)
    # max keeps the first maximal key in insertion order = the first answer seen (tie-break rule).
    winner = max(scores, key=scores.__getitem__) if scores else NO_ANSWER
    return Vote(winner, len(answers), n_no_answer, scores)


def sequence_weights(logprobs: Sequence[float], lengths: Sequence[int] | None = None) -> list[float]:
    """exp(log p(sequence) / length): the length-normalized probability Wang et al. weight votes with.
    Without lengths, exp(log p) (unnormalized; long samples then count for almost nothing)."""
    if lengths is None:
        return [math.exp(lp) for lp in logprobs]
    if len(lengths) != len(logprobs):
        raise ValueError(f"lengths has {len(lengths)} entries for {len(logprobs)} log-probs")
    return [math.exp(lp / max(int(length), 1)) for lp, length in zip(logprobs, lengths)]


def weighted_vote(answers: Sequence[Hashable | None], logprobs: Sequence[float],
                  lengths: Sequence[int] | None = None) -> Vote:
    """Vote where sample i counts exp(logprobs[i] / lengths[i]) (see `sequence_weights`)."""
    _check_samples(answers)
    return majority_vote(answers, sequence_weights(logprobs, lengths))


# ---------------------------------------------------------------- stopping rules


@dataclass(frozen=True)
class StopResult:
    n_used: int  # samples drawn before stopping
    stopped_early: bool  # False when the pool ran out first
    vote: Vote  # majority vote over the n_used samples


def esc_stop(answers: Sequence[Hashable | None], window: int = 5) -> StopResult:
    """Early-stopping self-consistency (Li et al. 2024) over a stream of answers.

    Samples come in windows of `window`; after each full window, stop if all its answers are the same
    (answered) value, i.e. the window's answer entropy is 0. A window of no-answers does not stop.
    The final answer is the majority over every sample drawn.
    """
    _check_samples(answers)
    if window < 1:
        raise ValueError(f"window={window!r} must be >= 1")
    for end in range(window, len(answers) + 1, window):
        chunk = answers[end - window:end]
        if chunk[0] is not NO_ANSWER and all(a == chunk[0] for a in chunk):
            return StopResult(end, end < len(answers), majority_vote(answers[:end]))
    return StopResult(len(answers), False, majority_vote(answers))


def beta_confidence(top: float, second: float) -> float:
    """P(p_top > p_second | counts) under a uniform prior: the Beta stopping criterion.

    Restricted to the two leading answers, p = p_top / (p_top + p_second) ~ Beta(top + 1, second + 1),
    so P(p_top > p_second) = P(p > 1/2) = 1 - I_{1/2}(top + 1, second + 1) (regularized incomplete beta).
    """
    from scipy.special import betainc

    return float(1.0 - betainc(top + 1.0, second + 1.0, 0.5))


def dirichlet_confidence(counts: Sequence[float], rng: np.random.Generator, n_draws: int = 2000) -> float:
    """P(the leading answer has the largest probability) under Dirichlet(counts + 1), by Monte Carlo.

    One extra category with count 0 stands for "an answer not seen yet", so a single observed answer
    is not trivially certain.
    """
    alpha = np.asarray(list(counts) + [0.0], dtype=float) + 1.0
    draws = rng.dirichlet(alpha, size=n_draws)
    return float((draws.argmax(axis=1) == int(np.argmax(alpha[:-1]))).mean())


def predictive_confidence(counts: Sequence[float], remaining: int, rng: np.random.Generator,
                          n_draws: int = 1000) -> float:
    """P(the current leader still leads after `remaining` more samples), by Monte Carlo: answer probabilities
    from the posterior Dirichlet(counts + 1) with one extra category for every answer not seen yet (lumped,
    so the estimate is conservative), then the remaining draws from them (Dirichlet-multinomial predictive).

    Budget-aware: the question a fixed budget of N samples asks is whether drawing them all would change the
    vote, not whether the leader is the true mode; with few samples left, a modest lead already settles it.
    counts: leader first (as ranked); ties with the leader count as a hold (the tie-break keeps the earlier).
    """
    counts = np.asarray(counts, dtype=float)
    runner_up = counts[1] if len(counts) > 1 else 0.0
    if counts[0] - runner_up >= remaining:  # no one can pass the leader any more (an unseen answer starts at 0)
        return 1.0
    probs = rng.dirichlet(np.append(counts, 0.0) + 1.0, size=n_draws)  # (D, C + 1)
    final = rng.multinomial(remaining, probs) + np.append(counts, 0.0)  # (D, C + 1)
    return float((final[:, 0] >= final[:, 1:].max(axis=1)).mean())


def adaptive_stop(answers: Sequence[Hashable | None], threshold: float = 0.95, *, criterion: str = "beta",
                  min_samples: int = 1, seed: int = 0) -> StopResult:
    """Adaptive consistency (Aggarwal et al. 2023): after each sample, stop when the current majority is
    settled with posterior probability >= threshold. criterion: "beta" (top two counts, exact),
    "dirichlet" (all answers, Monte Carlo with `seed`) or "predictive" (`predictive_confidence`: the leader
    keeps the lead over the whole stream of len(answers), Monte Carlo). No-answers carry no evidence."""
    _check_samples(answers)
    if not 0.5 < threshold < 1:
        raise ValueError(f"threshold={threshold!r} must be in (0.5, 1)")
    if criterion not in ADAPTIVE_CRITERIA:
        raise ValueError(f"criterion={criterion!r} must be one of {ADAPTIVE_CRITERIA}")
    rng = np.random.default_rng(seed)
    counts: dict = {}
    for i, answer in enumerate(answers, start=1):
        if answer is not NO_ANSWER:
            counts[answer] = counts.get(answer, 0) + 1
        if i < min_samples or not counts:
            continue
        ranked = sorted(counts.values(), reverse=True)
        if criterion == "beta":
            confidence = beta_confidence(ranked[0], ranked[1] if len(ranked) > 1 else 0)
        elif criterion == "predictive":
            confidence = predictive_confidence(ranked, len(answers) - i, rng)
        else:
            confidence = dirichlet_confidence(ranked, rng)
        if confidence >= threshold:
            return StopResult(i, i < len(answers), majority_vote(answers[:i]))
    return StopResult(len(answers), False, majority_vote(answers))


# ---------------------------------------------------------------- accuracy vs n from one pool per problem


def encode_answers(answers: Sequence[Hashable | None]) -> tuple[np.ndarray, list]:
    """answers (N,) -> codes (N,) int (-1 = no answer; others numbered by first appearance) and the values."""
    values: dict = {}
    codes = [-1 if a is NO_ANSWER else values.setdefault(a, len(values)) for a in answers]
    return np.asarray(codes, dtype=int), list(values)


def check_keep(keep) -> float:
    """The share of traces a filter keeps: 0 < keep <= 1 (DeepConf: 0.1 or 0.9)."""
    if not 0 < float(keep) <= 1:
        raise ValueError(f"keep={keep!r} must be in (0, 1]: the share of traces kept by confidence")
    return float(keep)


def filter_weights(confidences: np.ndarray, keep: float) -> np.ndarray:
    """(S, n) trace confidences -> (S, n) vote weights: each row's top ceil(keep * n) traces keep their
    confidence as weight (DeepConf's filtered, confidence-weighted vote), the rest weigh 0. Ties keep the
    earlier trace."""
    check_keep(keep)
    n = confidences.shape[1]
    kept = max(1, math.ceil(keep * n))
    rank = np.argsort(np.argsort(-confidences, axis=1, kind="stable"), axis=1, kind="stable")
    return np.where(rank < kept, confidences, 0.0)


def subset_votes(codes: np.ndarray, subsets: np.ndarray, n_values: int,
                 weights: np.ndarray | None = None) -> np.ndarray:
    """Vectorized `majority_vote` over many subsets of one pool.

    codes: (N,) from `encode_answers`; subsets: (S, n) pool indices, each row in stream order;
    weights: (N,) per sample, (S, n) per subset member (e.g. `filter_weights`), or None
    -> winner code per subset (S,), -1 when no sample of the subset answered (or all its weights are 0).
    Ties go to the answer seen first in the subset, as in `majority_vote`.
    """
    picked = codes[subsets]  # (S, n)
    onehot = picked[:, :, None] == np.arange(max(n_values, 1))[None, None, :]  # (S, n, C)
    if weights is None:
        w = np.ones(picked.shape)
    else:
        w = weights if weights.ndim == 2 else weights[subsets]
        onehot = onehot & (w > 0)[:, :, None]  # a zero weight is a filtered-out vote, not a vote for nothing
    scores = (onehot * w[:, :, None]).sum(axis=1)  # (S, C)
    present = onehot.any(axis=1)
    first = np.where(onehot, np.arange(picked.shape[1])[None, :, None], picked.shape[1]).min(axis=1)  # (S, C)
    # Lexicographic (score desc, first-seen asc): rank by score, break exact ties by earliest position.
    best = scores.max(axis=1, keepdims=True)
    candidates = present & (scores == best)
    winner = np.where(candidates, first, np.iinfo(int).max).argmin(axis=1)
    return np.where(present.any(axis=1), winner, -1)


def vote_accuracy_vs_n(pools: Sequence[Sequence], truths: Sequence, n_values: Sequence[int], *,
                       weights: Sequence[Sequence[float]] | None = None, lengths: Sequence[Sequence[int]] | None = None,
                       n_subsets: int = 200, seed: int = 0, vote: str = "majority",
                       keep: float | None = None) -> list[dict]:
    """Accuracy of a vote over n samples, for every n, from one pool of N samples per problem.

    For each problem and n, `n_subsets` random n-subsets of its pool (without replacement, random order)
    each give a vote; the problem's score is the share of correct votes (an estimate of P(vote of n
    i.i.d. samples is right)). Accuracy = mean over problems, CI = percentile bootstrap over problems.
    lengths (tokens per sample) give the mean tokens an n-sample vote costs. keep (with weights): only each
    subset's top ceil(keep * n) samples by weight vote (DeepConf's confidence filter, `filter_weights`).
    -> [{n, vote, accuracy, ci_low, ci_high, tokens}]
    """
    from decodelab.common.stats import bootstrap_ci

    if len(pools) != len(truths) or not pools:
        raise ValueError(f"pools ({len(pools)}) and truths ({len(truths)}) must be non-empty and match")
    pool_size = min(len(p) for p in pools)
    bad = [n for n in n_values if not 1 <= n <= pool_size]
    if bad:
        raise ValueError(f"n_values={list(n_values)}: each n must be in [1, {pool_size}] (the smallest pool)")
    rng = np.random.default_rng(seed)
    scores = np.zeros((len(pools), len(n_values)))
    for i, (pool, truth) in enumerate(zip(pools, truths)):
        codes, values = encode_answers(pool)
        truth_code = values.index(truth) if truth in values else -2
        w = None if weights is None else np.asarray(weights[i], dtype=float)
        for j, n in enumerate(n_values):
            subsets = np.argsort(rng.random((n_subsets, len(pool))), axis=1)[:, :n]
            ws = w if keep is None or w is None else filter_weights(w[subsets], keep)
            scores[i, j] = (subset_votes(codes, subsets, len(values), ws) == truth_code).mean()
    mean_len = float(np.mean([np.mean(x) for x in lengths])) if lengths is not None else float("nan")
    rows = []
    for j, n in enumerate(n_values):
        accuracy, low, high = bootstrap_ci(scores[:, j], seed=seed)
        rows.append({"n": int(n), "vote": vote, "accuracy": accuracy, "ci_low": low, "ci_high": high,
                     "tokens": n * mean_len})
    return rows


def early_stop_table(pools: Sequence[Sequence], truths: Sequence, *, esc_windows: Sequence[int] = (4, 8),
                     thresholds: Sequence[float] = (0.95,), criteria: Sequence[str] = ("beta",),
                     n_orders: int = 20, seed: int = 0, lengths: Sequence[Sequence[int]] | None = None,
                     extra_rules: dict | None = None) -> list[dict]:
    """Samples and tokens used, and accuracy, of ESC, adaptive consistency and `extra_rules` vs majority over
    the whole pool, all on the same samples replayed in the same orders (paired).

    Each problem's pool is replayed in `n_orders` random orders (sample streams); a rule stops somewhere
    in each stream and votes. extra_rules: {(method, setting): make(i) -> rule(order) -> (samples, tokens,
    answer)} for rules that need more than answers (DeepConf's confidences: `confidence.online_rule`).
    -> [{method, setting, mean_samples, mean_tokens, accuracy, ci_low, ci_high, saved, tokens_saved,
    accuracy_change, change_ci_low, change_ci_high}] with saved = 1 - mean_samples / pool size, tokens_saved
    = 1 - mean_tokens / the first row's (NaN without lengths) and accuracy_change = accuracy minus the first
    row's (majority over the whole pool), its interval a paired bootstrap over problems.
    """
    from decodelab.common.stats import bootstrap_ci, paired_bootstrap_diff

    rules = {("majority", f"n={min(len(p) for p in pools)}"): lambda a: StopResult(len(a), False, majority_vote(a))}
    for w in esc_windows:
        rules[("esc", f"window={w}")] = lambda a, w=w: esc_stop(a, window=w)
    for criterion in criteria:
        for t in thresholds:
            rules[("adaptive_consistency", f"{criterion}>={t}")] = (
                lambda a, c=criterion, t=t: adaptive_stop(a, t, criterion=c, seed=seed))

    def answer_rule(i, rule):
        def run(order):
            result = rule([pools[i][j] for j in order])
            tokens = np.nan if lengths is None else sum(lengths[i][j] for j in order[:result.n_used])
            return result.n_used, tokens, result.vote.answer
        return run

    makers = {key: (lambda i, rule=rule: answer_rule(i, rule)) for key, rule in rules.items()}
    makers.update(extra_rules or {})
    rng = np.random.default_rng(seed)
    orders = [[rng.permutation(len(pool)) for _ in range(n_orders)] for pool in pools]
    pool_size = float(np.mean([len(p) for p in pools]))
    rows, reference, reference_tokens = [], None, None
    for (method, setting), make in makers.items():
        used, tokens, correct = (np.zeros((len(pools), n_orders)) for _ in range(3))
        for i, truth in enumerate(truths):
            rule = make(i)
            for k, order in enumerate(orders[i]):
                used[i, k], tokens[i, k], answer = rule(list(order))
                correct[i, k] = answer is not NO_ANSWER and answer == truth
        per_problem = correct.mean(axis=1)
        if reference is None:
            reference, reference_tokens = per_problem, float(tokens.mean())
        accuracy, low, high = bootstrap_ci(per_problem, seed=seed)
        change = paired_bootstrap_diff(per_problem, reference, seed=seed)
        rows.append({"method": method, "setting": setting, "mean_samples": float(used.mean()),
                     "mean_tokens": float(tokens.mean()), "accuracy": accuracy, "ci_low": low, "ci_high": high,
                     "saved": 1.0 - float(used.mean()) / pool_size,
                     "tokens_saved": 1.0 - float(tokens.mean()) / reference_tokens,
                     "accuracy_change": change["difference"],
                     "change_ci_low": change["ci_low"], "change_ci_high": change["ci_high"]})
    return rows


def pool_votes(pools: Sequence[Sequence]) -> list[dict]:
    """The majority vote over each problem's whole pool, with its counts, so a reader (or a test) can check
    that they add up: answered + no_answer == n_samples. -> [{problem, answer, n_samples, answered, no_answer}]"""
    rows = []
    for i, pool in enumerate(pools):
        vote = majority_vote(list(pool))
        rows.append({"problem": i, "answer": vote.answer, "n_samples": vote.n_samples,
                     "answered": int(sum(vote.scores.values())), "no_answer": vote.n_no_answer})
    return rows
