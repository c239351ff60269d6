"""Votes and stopping rules on constructed answer lists; the vectorized subset vote equals the plain vote."""
import numpy as np
import pytest

from decodelab.consistency import (
    adaptive_stop, beta_confidence, early_stop_table, encode_answers, esc_stop, majority_vote, sequence_weights,
    subset_votes, vote_accuracy_vs_n, weighted_vote,
)


def test_majority_vote_picks_the_most_common_answer():
    vote = majority_vote([3, 5, 5, 7, 5, 3])
    assert vote.answer == 5 and vote.scores == {3: 2.0, 5: 3.0, 7: 1.0} and vote.n_samples == 6


def test_majority_vote_tie_goes_to_the_first_answer_seen():
    assert majority_vote([4, 9, 9, 4]).answer == 4
    assert majority_vote([9, 4, 4, 9]).answer == 9


def test_no_answers_are_counted_never_voted():
    vote = majority_vote([None, None, None, 8])
    assert vote.answer == 8 and vote.n_no_answer == 3 and vote.scores == {8: 1.0}


def test_all_no_answer_gives_an_explicit_no_answer():
    vote = majority_vote([None, None])
    assert vote.answer is None and vote.n_no_answer == 2 and vote.support == 0.0


@pytest.mark.parametrize("vote", [lambda a: majority_vote(a), lambda a: weighted_vote(a, []),
                                  lambda a: esc_stop(a), lambda a: adaptive_stop(a)])
def test_empty_sample_list_is_a_clear_error(vote):
    with pytest.raises(ValueError, match="n >= 1"):
        vote([])


def test_weighted_vote_can_overturn_the_majority():
    # Two unlikely samples say 1, one confident sample says 2.
    answers, logprobs, lengths = [1, 1, 2], [-20.0, -20.0, -1.0], [10, 10, 10]
    assert majority_vote(answers).answer == 1
    vote = weighted_vote(answers, logprobs, lengths)
    assert vote.answer == 2
    assert vote.scores[2] == pytest.approx(np.exp(-0.1)) and vote.scores[1] == pytest.approx(2 * np.exp(-2.0))


def test_sequence_weights_normalize_by_length():
    assert sequence_weights([-4.0, -4.0], [2, 4]) == pytest.approx([np.exp(-2.0), np.exp(-1.0)])


def test_weights_must_match_answers():
    with pytest.raises(ValueError, match="one per answer"):
        majority_vote([1, 2], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        majority_vote([1, 2], [1.0, float("nan")])


def test_esc_stops_after_the_first_unanimous_window():
    answers = [1, 2, 3, 3, 3, 3, 3, 3, 9, 9]
    result = esc_stop(answers, window=4)
    assert result.n_used == 8 and result.stopped_early and result.vote.answer == 3


def test_esc_never_stops_on_a_window_of_no_answers():
    result = esc_stop([None] * 4 + [5] * 4, window=4)
    assert result.n_used == 8 and not result.stopped_early and result.vote.answer == 5


def test_esc_runs_the_pool_when_no_window_agrees():
    result = esc_stop([1, 2, 1, 2, 1, 2], window=2)
    assert result.n_used == 6 and not result.stopped_early and result.vote.answer == 1


def test_beta_confidence_closed_forms():
    # Beta(k + 1, 1): P(p > 1/2) = 1 - 2^-(k+1); equal counts: exactly 1/2.
    assert beta_confidence(4, 0) == pytest.approx(1 - 0.5 ** 5)
    assert beta_confidence(3, 3) == pytest.approx(0.5)


def test_adaptive_stops_when_unanimity_is_settled():
    # 1 - 2^-(k+1) >= 0.95 first at k = 4 agreeing samples.
    result = adaptive_stop([7] * 10, threshold=0.95)
    assert result.n_used == 4 and result.vote.answer == 7


def test_adaptive_needs_more_samples_under_disagreement():
    result = adaptive_stop([1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1], threshold=0.95)
    assert result.n_used > 4 and result.vote.answer == 1
    counts_at_stop = [1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1][: result.n_used]
    assert beta_confidence(counts_at_stop.count(1), counts_at_stop.count(2)) >= 0.95


def test_adaptive_ignores_no_answers():
    assert adaptive_stop([None, None, 3, 3, 3, 3, 3], threshold=0.95).n_used == 6


def test_adaptive_dirichlet_stops_and_checks_its_arguments():
    assert adaptive_stop([5] * 30, criterion="dirichlet", seed=0).vote.answer == 5
    with pytest.raises(ValueError, match="criterion"):
        adaptive_stop([1], criterion="gamma")
    with pytest.raises(ValueError, match="threshold"):
        adaptive_stop([1], threshold=1.0)


@pytest.mark.parametrize("seed", range(5))
def test_subset_votes_equal_majority_vote(seed):
    rng = np.random.default_rng(seed)
    pool = [None if x == 0 else int(x) for x in rng.integers(0, 5, size=20)]
    weights = rng.random(20)
    codes, values = encode_answers(pool)
    subsets = np.argsort(rng.random((50, 20)), axis=1)[:, :7]
    for w in (None, weights):
        winners = subset_votes(codes, subsets, len(values), w)
        for subset, winner in zip(subsets, winners):
            want = majority_vote([pool[j] for j in subset], None if w is None else [w[j] for j in subset]).answer
            assert (values[winner] if winner >= 0 else None) == want


def test_accuracy_vs_n_on_a_pool_with_a_clear_majority():
    # 10 problems, pool of 9: 6 right, 3 wrong (spread). n = 9 majority is always right; n = 1 is right 2/3.
    pools = [[42] * 6 + [1, 2, 3] for _ in range(10)]
    rows = vote_accuracy_vs_n(pools, [42] * 10, [1, 9], n_subsets=300, seed=0, lengths=[[10] * 9] * 10)
    assert rows[1]["accuracy"] == 1.0 and abs(rows[0]["accuracy"] - 2 / 3) < 0.05
    assert rows[0]["tokens"] == 10 and rows[1]["tokens"] == 90
    with pytest.raises(ValueError, match="n_values"):
        vote_accuracy_vs_n(pools, [42] * 10, [10])


def test_early_stop_saves_samples_on_unanimous_pools():
    pools = [[5] * 16 for _ in range(4)]
    rows = {r["method"] + ":" + r["setting"]: r for r in early_stop_table(pools, [5] * 4, esc_windows=(4,))}
    assert rows["majority:n=16"]["mean_samples"] == 16
    assert rows["esc:window=4"]["mean_samples"] == 4 and rows["esc:window=4"]["accuracy"] == 1.0
    assert rows["adaptive_consistency:beta>=0.95"]["mean_samples"] == 4
    assert rows["adaptive_consistency:beta>=0.95"]["saved"] == 0.75
    assert rows["esc:window=4"]["accuracy_change"] == 0.0


# ---------------------------------------------------------------- drivers on a tiny model


def test_cost_methods_give_n_samples_of_exact_length(tiny):
    from decodelab.consistency_cost import cost_sweep, goal_summary

    rows = cost_sweep(tiny, [24], [1, 3], new_tokens=5, progress=False)
    assert {(r["method"], r["n"]) for r in rows} == {(m, n) for m in
                                                    ("shared", "unshared", "hf_num_return_sequences") for n in (1, 3)}
    by = {(r["method"], r["n"]): r for r in rows}
    assert by[("shared", 3)]["kv_bytes"] * 3 < by[("unshared", 3)]["kv_bytes"] * 2  # (24 + 15) vs 3 * 29 positions
    assert by[("unshared", 3)]["kv_bytes"] == by[("hf_num_return_sequences", 3)]["kv_bytes"]
    goal = goal_summary(rows, prompt_len=1000, n=16)
    assert goal["n"] == 3 and goal["kv_ratio_vs_hf"] == pytest.approx(39 / 87)


def test_greedy_methods_agree_token_for_token(tiny):
    from decodelab.consistency_cost import long_prompt, run_method

    prompt = long_prompt(None, 30)
    outs = {m: run_method(tiny, m, prompt, 2, new_tokens=6) for m in ("shared", "unshared", "hf_num_return_sequences")}
    assert outs["shared"] == outs["unshared"] == outs["hf_num_return_sequences"]


def test_baselines_skipped_beyond_the_token_budget(tiny):
    from decodelab.consistency_cost import cost_sweep

    rows = cost_sweep(tiny, [20], [1, 4], new_tokens=2, baseline_max_tokens=40, progress=False)
    assert sorted((r["method"], r["n"]) for r in rows) == [
        ("hf_num_return_sequences", 1), ("shared", 1), ("shared", 4), ("unshared", 1)]


def test_check_shared_equals_unshared_on_tiny(tiny):
    from decodelab.consistency import check_shared_equals_unshared
    from decodelab.consistency_cost import long_prompt

    check = check_shared_equals_unshared(tiny, [long_prompt(None, 9, seed=1), long_prompt(None, 14, seed=2)], 3,
                                         max_new_tokens=6)
    assert check["equal"] and check["rows"] == 6
