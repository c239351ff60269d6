"""DeepConf (Fu et al. 2025): token confidence from log-probs, confidence-weighted and -filtered votes, and
online stopping of low-confidence samples mid-stream.

Token confidence (the paper's definition): C_i = -(1/k) sum_{j=1..k} log P_i(j), the NEGATIVE MEAN LOG-PROB OF
THE k MOST LIKELY CANDIDATES at step i (not the chosen token's log-prob), under the model's own distribution
(temperature 1, no filters: the log-probs an API returns). A peaked distribution puts most candidates far below
the top one, so C is large when the model is sure. C >= 0 always.
Group confidence: the mean of C over a sliding window of `window` tokens (the group ending at token t holds
tokens t-window+1..t). A trace's confidence is its LOWEST group confidence (DeepConf's "lowest group"; "mean"
and "bottom10" are the other offline measures); a trace shorter than the window has one group, all of it.

Online (DeepConf-low/high): warm-up samples run to the end; the threshold s is the (1 - keep) quantile of
their lowest group confidences (keep = 0.1: DeepConf-low, 0.9: DeepConf-high); every later sample stops the
first time a full window's group confidence falls below s and is discarded from the vote. Rows are finished
early inside the batched decode (`ConfidenceStopPolicy`, a `LoopPolicy` for `core.engine.run_loop`).
Because a stopped row still rides in the batch, its tokens up to the stop equal the unstopped run's, so the
stop can also be replayed exactly from unstopped traces (`first_stop`): the paired comparison of the notebook.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from decodelab.consistency.votes import check_keep, majority_vote
from decodelab.core import engine

CONFIDENCE_TOP_K = 20  # candidates per step in C_i (DeepConf reads the top-20 log-probs vLLM returns)
TRACE_MEASURES = ("lowest", "mean", "bottom10")
NEVER_STOP = -math.inf  # a threshold no group confidence (>= 0) falls below


def check_window(window, max_new_tokens: int) -> int:
    """A confidence window must be an integer in [1, max_new_tokens] (a longer one never fills)."""
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= max_new_tokens:
        raise ValueError(f"confidence window={window!r} must be an integer in [1, max_new_tokens={max_new_tokens}]")
    return window


def check_threshold(threshold) -> float:
    """A stopping threshold is a group confidence: a finite number >= 0, or -inf (= never stop)."""
    value = float(threshold)
    if not (value == NEVER_STOP or (math.isfinite(value) and value >= 0)):
        raise ValueError(f"stopping threshold={threshold!r} must be a finite group confidence >= 0 "
                         "(token confidence is a negative mean log-prob) or -inf (never stop)")
    return value


def token_confidence(logits: torch.Tensor, top_k: int = CONFIDENCE_TOP_K) -> torch.Tensor:
    """(B, V) logits -> (B,) C = -mean of the top-k log-probs (float32), k capped at V."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1).values.mean(dim=-1)


def window_mean(confidences: Sequence[float], end: int, window: int) -> float:
    """Group confidence of the window ending at token `end` (1-based count of tokens so far). The online
    policy and the replay both call this, so their stops agree to the last bit."""
    return float(np.mean(confidences[max(0, end - window):end]))


def group_confidences(confidences: Sequence[float], window: int) -> np.ndarray:
    """(L,) token confidences -> (max(L - window + 1, 1),) group confidences, oldest first."""
    if len(confidences) == 0:
        raise ValueError("a trace with no tokens has no confidence")
    ends = range(min(window, len(confidences)), len(confidences) + 1)
    return np.asarray([window_mean(confidences, end, window) for end in ends])


def trace_confidence(confidences: Sequence[float], window: int, how: str = "lowest") -> float:
    """One number per trace: its lowest group confidence, the mean token confidence, or the mean of its
    lowest 10% groups ("bottom10")."""
    if how == "mean":
        return float(np.mean(confidences))
    groups = group_confidences(confidences, window)
    if how == "lowest":
        return float(groups.min())
    if how == "bottom10":
        return float(np.sort(groups)[:max(1, math.ceil(0.1 * len(groups)))].mean())
    raise ValueError(f"how={how!r} must be one of {TRACE_MEASURES}")


def first_stop(confidences: Sequence[float], window: int, threshold: float) -> int | None:
    """The token count at which online stopping ends this trace (the first full window whose group confidence
    is below threshold), or None when it runs to its end."""
    for end in range(window, len(confidences) + 1):
        if window_mean(confidences, end, window) < threshold:
            return end
    return None


def warmup_threshold(trace_confidences: Sequence[float], keep: float) -> float:
    """DeepConf's online threshold: the (1 - keep) quantile of the warm-up traces' lowest group confidences,
    so a share `keep` of traces like them would survive."""
    check_keep(keep)
    return float(np.quantile(np.asarray(trace_confidences, dtype=float), 1.0 - keep))


# ---------------------------------------------------------------- online: a LoopPolicy


class ConfidenceStopPolicy(engine.PolicyBase):
    """Plain sampling that also records each row's token confidences and log-probs, and finishes a row the
    first time its group confidence over `window` tokens falls below the row's threshold.

    thresholds: one per row (NEVER_STOP = run to the end). With one generator per row (or greedy), finished
    rows leave the batch (`compact`, set by `decode_with_confidence`), so a stopped trace stops costing; each
    row draws from its own stream, so its tokens up to its stop still equal the unstopped run's. With one
    shared generator they ride along instead: dropping a row would shift the shared stream for the others.
    """

    def __init__(self, thresholds: Sequence[float], *, window: int, top_k: int = CONFIDENCE_TOP_K):
        self.thresholds = [check_threshold(t) for t in thresholds]
        self.window, self.top_k = window, top_k
        self.confidences: list[list[float]] = [[] for _ in self.thresholds]
        self.logprobs: list[list[float]] = [[] for _ in self.thresholds]
        self.stopped_low = [False] * len(self.thresholds)
        self.next_tokens, self.next_by_row = None, {}

    def first(self, loop: engine.TokenLoop, logits: torch.Tensor) -> dict[int, list[int]]:
        if len(self.thresholds) != loop.batch:
            raise ValueError(f"{len(self.thresholds)} thresholds for {loop.batch} rows; need one per row")
        self.next_tokens = loop.pick(logits)
        confidence = token_confidence(logits, self.top_k).tolist()
        chosen = engine.chosen_logprob(logits, self.next_tokens).tolist()
        for i, row in enumerate(loop.rows):
            if not loop.done[row]:
                self.confidences[row].append(confidence[i])
                self.logprobs[row].append(chosen[i])
        self.next_by_row = dict(zip(loop.rows, self.next_tokens.tolist()))
        return {row: [token] for row, token in self.next_by_row.items()}

    def feed(self, loop: engine.TokenLoop) -> engine.Feed:
        if len(loop.rows) == len(self.next_by_row):
            return engine.Feed(self.next_tokens[:, None], mode="step")
        kept = [self.next_by_row[row] for row in loop.rows]  # the batch was compacted since the last pick
        return engine.Feed(torch.tensor(kept, dtype=torch.long, device=self.next_tokens.device)[:, None], mode="step")

    def stopped(self, loop: engine.TokenLoop, row: int) -> bool:
        seen = len(self.confidences[row])
        if seen >= self.window and window_mean(self.confidences[row], seen, self.window) < self.thresholds[row]:
            self.stopped_low[row] = True
        return self.stopped_low[row]


@torch.no_grad()
def decode_with_confidence(model, prompts: list[list[int]], n, *, max_new_tokens: int, thresholds=None,
                           window: int, top_k: int = CONFIDENCE_TOP_K, sampler=None, generator=None,
                           eos_token_ids: list[int] | None = None):
    """n samples of each prompt with the prompt prefilled once (a shared-prefix cache, as
    `shared_prefix.generate_shared`), decoded by `run_loop` with a `ConfidenceStopPolicy`.

    thresholds: None (never stop) or one per row (rows grouped by prompt, B = sum n).
    -> (policy, loop, stats): loop.tokens per row, policy.confidences / logprobs / stopped_low per row.
    With thresholds None the tokens equal `generate_shared`'s with the same generators.
    """
    from decodelab.core.decode_stats import DecodeStats
    from decodelab.core.shared_prefix import SharedPrefixKVCache, expand_counts

    engine.validate_generation_args(prompts, max_new_tokens)
    check_window(window, max_new_tokens)
    counts = expand_counts(n, len(prompts))
    rows = [prompts[p] for p, count in enumerate(counts) for _ in range(count)]
    thresholds = [NEVER_STOP] * len(rows) if thresholds is None else list(thresholds)
    if len(thresholds) != len(rows):
        raise ValueError(f"thresholds has {len(thresholds)} entries for {len(rows)} rows; need one per row")
    policy = ConfidenceStopPolicy(thresholds, window=window, top_k=top_k)
    policy.compact = sampler is None or isinstance(generator, (list, tuple))
    tr = engine.as_transformer(model)
    stats = DecodeStats(batch_size=len(rows), prompt_tokens=sum(len(p) for p in rows))
    prefix_cache, logits = engine.prefill(tr, prompts, max_new_tokens=0)
    cache = SharedPrefixKVCache.fork(prefix_cache, counts, max_new_tokens)
    loop = engine.run_loop(model, rows, policy, max_new_tokens=max_new_tokens, stats=stats,
                           eos_token_ids=eos_token_ids, sampler=sampler, generator=generator,
                           prefilled=(cache, logits[cache.row_prompt]))
    return policy, loop, stats


# ---------------------------------------------------------------- online stopping replayed on full traces


def trace_profiles(confidences: Sequence[Sequence[float]], window: int) -> list[tuple[np.ndarray, float, int]]:
    """Per trace, computed once for every replay: (group confidences, lowest of them, length)."""
    out = []
    for c in confidences:
        groups = group_confidences(c, window)
        out.append((groups, float(groups.min()), len(c)))
    return out


def stop_from_groups(groups: np.ndarray, length: int, window: int, threshold: float) -> int | None:
    """`first_stop` from a trace's precomputed `group_confidences` (the same floats, so the same stop)."""
    if length < window:
        return None
    below = groups < threshold
    return int(window + below.argmax()) if bool(below.any()) else None


def check_consensus(consensus) -> float | None:
    """DeepConf's adaptive-sampling threshold tau: None (draw the whole budget) or a vote share in (0, 1]."""
    if consensus is not None and not 0 < float(consensus) <= 1:
        raise ValueError(f"consensus={consensus!r} must be None (never stop drawing) or a vote share in (0, 1]")
    return None if consensus is None else float(consensus)


def consensus_share(answers: Sequence, voters: Sequence[int], weights: Sequence[float] | None) -> float:
    """beta = V(leader) / sum_a V(a): the leader's share of the (confidence-weighted) votes; 0 with no votes."""
    scores = majority_vote([answers[j] for j in voters] or [None],
                           [weights[j] for j in voters] if weights is not None and voters else None).scores
    total = sum(scores.values())
    return max(scores.values()) / total if total > 0 else 0.0


def online_vote(answers: Sequence, confidences: Sequence[Sequence[float]], order: Sequence[int], *, window: int,
                n_warmup: int, keep: float = 0.9, threshold: float | None = None, weighted: bool = True,
                consensus: float | None = None, profiles=None) -> dict:
    """DeepConf online on one problem's sample stream `order` (indices into answers / confidences, the full
    unstopped traces): the first n_warmup run to the end and set the threshold (`warmup_threshold`, or
    `threshold` when given); a warm-up trace below it does not vote; every later trace stops at its
    `first_stop` and is discarded, or runs to the end and votes. The vote weighs each voter by its trace
    confidence (weighted=False: one each; with threshold NEVER_STOP that is plain majority over the stream).
    consensus (the paper's adaptive sampling, tau = 0.95 there): before each trace after the warm-up, stop
    drawing once the leader holds >= consensus of the votes (`consensus_share`); None draws the whole stream.
    profiles: `trace_profiles(confidences, window)`, when replaying many orders.
    -> {answer, tokens (generated, stopped traces counted to their stop), n_stopped, threshold, samples
    (traces started)}."""
    if not 1 <= n_warmup <= len(order):
        raise ValueError(f"n_warmup={n_warmup!r} must be in [1, {len(order)}] (the samples in the stream)")
    consensus = check_consensus(consensus)
    profiles = trace_profiles(confidences, window) if profiles is None else profiles
    s = (warmup_threshold([profiles[j][1] for j in order[:n_warmup]], keep) if threshold is None
         else check_threshold(threshold))
    voters = [j for j in order[:n_warmup] if profiles[j][1] >= s]
    tokens, n_stopped, started = sum(profiles[j][2] for j in order[:n_warmup]), 0, n_warmup
    trace_weights = [p[1] for p in profiles] if weighted else None
    for j in order[n_warmup:]:
        if consensus is not None and consensus_share(answers, voters, trace_weights) >= consensus:
            break
        started += 1
        groups, _, length = profiles[j]
        stop = stop_from_groups(groups, length, window, s)
        if stop is None:
            voters.append(j)
            tokens += length
        else:
            tokens += stop
            n_stopped += 1
    picked = [answers[j] for j in voters] or [None]
    weights = [profiles[j][1] for j in voters] if weighted and voters else None
    return {"answer": majority_vote(picked, weights).answer, "tokens": tokens, "n_stopped": n_stopped, "threshold": s,
            "samples": started}


def online_rule(answers: Sequence, confidences: Sequence[Sequence[float]], *, window: int, **settings):
    """`online_vote` as a `votes.early_stop_table` extra rule: order -> (samples started, tokens, answer)."""
    profiles = trace_profiles(confidences, window)

    def rule(order):
        out = online_vote(answers, confidences, order, window=window, profiles=profiles, **settings)
        return out["samples"], out["tokens"], out["answer"]
    return rule


def warmup_thresholds(confidences: Sequence[Sequence[Sequence[float]]], *, window: int, n_warmup: int,
                      keep: float) -> list[float]:
    """Per problem: the online threshold its first n_warmup samples (in sampling order) set."""
    return [warmup_threshold([trace_confidence(c, window) for c in pool[:n_warmup]], keep) for pool in confidences]


def stream_stops(confidences: Sequence[Sequence[Sequence[float]]], thresholds: Sequence[float], *, window: int,
                 n_warmup: int) -> list[list[int | None]]:
    """The replayed stop of every sample in sampling order (None: the warm-up, or ran to its end): what an
    online run with these per-problem thresholds must reproduce token for token."""
    return [[None if s < n_warmup else first_stop(c, window, t) for s, c in enumerate(pool)]
            for pool, t in zip(confidences, thresholds)]
