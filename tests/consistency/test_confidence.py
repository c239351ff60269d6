"""DeepConf: token confidence, group confidence, filtered votes, online stopping (policy and replay)."""
import math

import numpy as np
import pytest
import torch

from decodelab.common.seeding import row_generator
from decodelab.consistency import confidence as conf
from decodelab.consistency.votes import encode_answers, filter_weights, majority_vote, subset_votes
from decodelab.core.sampling import Sampler, SamplerConfig
from decodelab.core.shared_prefix import generate_shared

PROMPTS = [[5, 9, 17, 3, 44, 8], [7, 1, 90, 12]]


def test_token_confidence_is_minus_the_mean_of_the_top_k_log_probs():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    lp = torch.log_softmax(logits, dim=-1)
    want = -torch.sort(lp, dim=-1, descending=True).values[:, :2].mean(dim=-1)
    assert torch.allclose(conf.token_confidence(logits, top_k=2), want)
    # Uniform over 4: every log-prob is -log 4, whatever k (capped at V).
    assert conf.token_confidence(logits, top_k=99)[1].item() == pytest.approx(math.log(4))


def test_group_and_trace_confidences_by_hand():
    c = [4.0, 2.0, 3.0, 1.0, 5.0]
    assert conf.group_confidences(c, 2).tolist() == [3.0, 2.5, 2.0, 3.0]
    assert conf.trace_confidence(c, 2) == 2.0
    assert conf.trace_confidence(c, 2, how="mean") == 3.0
    assert conf.trace_confidence(c, 2, how="bottom10") == 2.0
    assert conf.group_confidences([1.0, 3.0], 5).tolist() == [2.0]  # shorter than the window: one group
    assert conf.first_stop(c, 2, 2.6) == 3  # groups end at tokens 2, 3, 4: 3.0, 2.5 < 2.6
    assert conf.first_stop(c, 2, 2.0) is None
    assert conf.first_stop(c, 2, conf.NEVER_STOP) is None


@pytest.mark.parametrize("window", [0, -1, 9, 2.0, True])
def test_bad_window_is_refused_naming_the_range(window):
    with pytest.raises(ValueError, match=r"window=.*max_new_tokens=8"):
        conf.check_window(window, 8)


@pytest.mark.parametrize("threshold", [-0.5, math.inf, math.nan])
def test_bad_threshold_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold"):
        conf.check_threshold(threshold)


def test_bad_window_fails_before_generation(tiny):
    with pytest.raises(ValueError, match="window=9"):
        conf.decode_with_confidence(tiny, PROMPTS, 2, max_new_tokens=8, window=9)
    with pytest.raises(ValueError, match="threshold"):
        conf.decode_with_confidence(tiny, PROMPTS, 2, max_new_tokens=8, window=2, thresholds=[math.inf] * 4)


def test_filter_weights_keep_each_rows_top_share():
    c = np.array([[1.0, 3.0, 2.0, 0.5], [2.0, 2.0, 1.0, 1.0]])
    assert filter_weights(c, 0.5).tolist() == [[0.0, 3.0, 2.0, 0.0], [2.0, 2.0, 0.0, 0.0]]
    assert filter_weights(c, 1.0).tolist() == c.tolist()
    # Filtering changes the winner: weighted by confidence, 3 wins (6 > 5); keeping the top half (the 7 and
    # the first 3), 7 wins (5 > 2); a filtered-out sample does not vote.
    codes, _ = encode_answers([7, 3, 3, 3])
    c = np.array([[5.0, 2.0, 2.0, 2.0]])
    everyone = np.array([[0, 1, 2, 3]])
    assert subset_votes(codes, everyone, 2, c).tolist() == [1]
    assert subset_votes(codes, everyone, 2, filter_weights(c, 0.5)).tolist() == [0]


def _sampled(tiny, n, **kw):
    sampler = Sampler(SamplerConfig(temperature=1.0))
    gens = [row_generator(0, p, s) for p in range(len(PROMPTS)) for s in range(n)]
    return sampler, gens


def test_never_stopping_equals_plain_shared_sampling_exactly(tiny):
    sampler, gens = _sampled(tiny, 3)
    policy, loop, _ = conf.decode_with_confidence(tiny, PROMPTS, 3, max_new_tokens=10, window=3, sampler=sampler,
                                                  generator=gens, eos_token_ids=[])
    _, gens2 = _sampled(tiny, 3)
    plain = generate_shared(tiny, PROMPTS, 3, max_new_tokens=10, sampler=sampler, generator=gens2, eos_token_ids=[])
    assert loop.tokens == plain.tokens
    assert not any(policy.stopped_low)
    assert [len(c) for c in policy.confidences] == [len(t) for t in loop.tokens]
    assert np.allclose([sum(lp) for lp in policy.logprobs], plain.logprobs, atol=1e-4)


def test_online_stops_are_prefixes_and_match_the_replay(tiny):
    sampler, gens = _sampled(tiny, 3)
    ref, ref_loop, _ = conf.decode_with_confidence(tiny, PROMPTS, 3, max_new_tokens=12, window=3, sampler=sampler,
                                                   generator=gens, eos_token_ids=[])
    # A threshold between the rows' lowest group confidences: some rows stop, some do not.
    lowest = [conf.trace_confidence(c, 3) for c in ref.confidences]
    threshold = float(np.median(lowest))
    _, gens = _sampled(tiny, 3)
    policy, loop, _ = conf.decode_with_confidence(tiny, PROMPTS, 3, max_new_tokens=12, window=3, sampler=sampler,
                                                  generator=gens, eos_token_ids=[], thresholds=[threshold] * 6)
    stops = [conf.first_stop(c, 3, threshold) for c in ref.confidences]
    assert any(s is not None for s in stops) and any(s is None for s in stops)
    for row, stop in enumerate(stops):
        want = len(ref_loop.tokens[row]) if stop is None else stop
        assert loop.tokens[row] == ref_loop.tokens[row][:want]
        assert policy.stopped_low[row] == (stop is not None)
    assert len(loop.rows) < 6  # stopped rows left the batch (per-row generators), yet the others are unchanged


def test_online_vote_with_infinite_threshold_is_plain_majority():
    answers = [3, 5, 5, 3, 3, None]
    confidences = [[1.0, 2.0], [0.1, 0.2, 0.3], [5.0], [2.0, 2.0], [0.5, 0.1], [1.0]]
    order = [4, 1, 0, 5, 2, 3]
    out = conf.online_vote(answers, confidences, order, window=2, n_warmup=2, threshold=conf.NEVER_STOP,
                           weighted=False)
    assert out["answer"] == majority_vote([answers[j] for j in order]).answer
    assert out["tokens"] == sum(len(confidences[j]) for j in order) and out["n_stopped"] == 0


def test_online_vote_discards_stopped_traces_and_counts_their_tokens():
    answers = [1, 2, 2]
    confidences = [[3.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 5.0]]
    # Threshold from warm-up trace 0 alone: 3.0; traces 1 and 2 stop at their first full window (token 2).
    out = conf.online_vote(answers, confidences, [0, 1, 2], window=2, n_warmup=1, keep=0.9)
    assert out == {"answer": 1, "tokens": 3 + 2 + 2, "n_stopped": 2, "threshold": 3.0, "samples": 3}


def test_online_consensus_stops_drawing_once_the_leader_holds_the_share():
    answers = [7, 7, 4, 7, 4]
    confidences = [[2.0, 2.0]] * 5
    # Two agreeing warm-up traces: the leader holds all votes, so tau = 0.95 draws nothing more.
    out = conf.online_vote(answers, confidences, [0, 1, 2, 3, 4], window=2, n_warmup=2, consensus=0.95)
    assert out["samples"] == 2 and out["tokens"] == 4 and out["answer"] == 7
    # A split warm-up (1 of 2 = 0.5 < 0.6) draws on until the leader reaches 0.6: 7, 4, 7 -> 2/3 after 3.
    out = conf.online_vote(answers, confidences, [0, 2, 1, 3, 4], window=2, n_warmup=2, consensus=0.6)
    assert out["samples"] == 3 and out["answer"] == 7
    # consensus=None (and any tau that is never reached) draws the whole stream: the rule without it.
    full = conf.online_vote(answers, confidences, [0, 2, 1, 3, 4], window=2, n_warmup=2)
    assert full["samples"] == 5 and full == conf.online_vote(answers, confidences, [0, 2, 1, 3, 4], window=2,
                                                              n_warmup=2, consensus=1.0) | {"samples": 5}


@pytest.mark.parametrize("bad", [0, -0.1, 1.5])
def test_consensus_outside_its_range_is_refused_naming_the_parameter(bad):
    from decodelab.consistency import deepconf

    with pytest.raises(ValueError, match="confidence_consensus"):
        deepconf.check_settings(window=2, max_new_tokens=8, keeps=[0.9], n_warmup=2, pool_size=8, top_k=5,
                                consensus=bad)


def test_stops_from_precomputed_groups_equal_first_stop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = rng.random(int(rng.integers(1, 12))).tolist()
        window, threshold = int(rng.integers(1, 6)), float(rng.random())
        groups, _, length = conf.trace_profiles([c], window)[0]
        assert conf.stop_from_groups(groups, length, window, threshold) == conf.first_stop(c, window, threshold)
