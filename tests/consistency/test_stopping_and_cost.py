"""Budget-aware adaptive consistency, the early-stop table's token accounting, DeepConf's settings checks, and
the SC@n-vs-one-sample arithmetic (roofline, early-stopping charge, goal rows)."""
import numpy as np
import pytest

from decodelab.consistency import deepconf, one_sample
from decodelab.consistency.votes import adaptive_stop, early_stop_table, majority_vote, predictive_confidence


def test_predictive_confidence_is_certain_once_the_lead_cannot_be_caught():
    rng = np.random.default_rng(0)
    assert predictive_confidence([5, 2], 3, rng) == 1.0
    assert predictive_confidence([3], 3, rng) == 1.0  # an unseen answer can at most tie
    assert predictive_confidence([1, 1], 30, rng) < 0.9


def test_predictive_stops_where_the_rest_of_the_pool_cannot_change_the_vote():
    stream = [3, 3, 3, 3, 3, 5]
    # After 3 agreeing samples, 3 remain: the leader can at worst be tied. Beta (unaware of the budget)
    # needs 4: 1 - 0.5**4 = 0.9375 < 0.95 after three.
    predictive = adaptive_stop(stream, 0.99, criterion="predictive")
    assert predictive.n_used == 3 and predictive.vote.answer == majority_vote(stream).answer
    assert adaptive_stop(stream, 0.95, criterion="beta").n_used == 4  # 1 - 0.5**5 >= 0.95


def test_early_stop_table_counts_tokens_and_runs_extra_rules_on_the_same_orders():
    pools = [[1, 1, 2, 1], [4, 5, 5, 5]]
    lengths = [[3, 4, 5, 6], [2, 2, 2, 2]]
    seen = []

    def make(i):
        def rule(order):
            seen.append((i, tuple(order)))
            return 1, lengths[i][order[0]], pools[i][order[0]]  # "first sample" rule
        return rule

    rows = early_stop_table(pools, [1, 5], esc_windows=[], thresholds=[], criteria=[], n_orders=3, seed=1,
                            lengths=lengths, extra_rules={("first", "n=1"): make})
    majority, first = rows
    assert majority["mean_tokens"] == pytest.approx(np.mean([18, 8])) and majority["tokens_saved"] == 0
    assert first["mean_samples"] == 1 and first["saved"] == pytest.approx(0.75)
    # Same orders as the built-in rules: seed 1's permutations.
    rng = np.random.default_rng(1)
    orders = [[tuple(rng.permutation(4)) for _ in range(3)] for _ in pools]
    assert seen == [(i, o) for i in range(2) for o in orders[i]]
    want = np.mean([[lengths[i][o[0]] for o in orders[i]] for i in range(2)])
    assert first["mean_tokens"] == pytest.approx(want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=0), "window=0"), (dict(window=49), "window=49"), (dict(keeps=[0.0]), "keep=0.0"),
    (dict(keeps=[]), "confidence_keep"), (dict(n_warmup=16), "confidence_warmup=16"), (dict(top_k=0), "top_k=0")])
def test_deepconf_settings_are_checked_before_generation(kwargs, match):
    settings = dict(window=8, max_new_tokens=48, keeps=[0.9], n_warmup=4, pool_size=16, top_k=20) | kwargs
    with pytest.raises(ValueError, match=match):
        deepconf.check_settings(**settings)


def _rows():
    return [{"n": n, "prompt_len": 1024, "new_tokens": 32, "seconds": s, "seconds_spread": 0.01,
             "one_sample_seconds": 2.0, "one_sample_spread": 0.02, "ratio": s / 2.0}
            for n, s in ((1, 2.1), (4, 2.4), (16, 3.0), (64, 5.0))]


def test_early_stopping_charges_the_smallest_measured_batch_that_holds_the_samples():
    out = {r["n"]: r for r in one_sample.with_early_stopping(_rows(), samples_used=6.0, pool=16)}
    assert out[16]["measured_at_n"] == 16 and out[16]["effective_n"] == 6.0  # 6 > 4: the batch of 16
    assert out[64]["measured_at_n"] == 64 and out[4]["measured_at_n"] == 4
    assert one_sample.with_early_stopping(_rows(), samples_used=3.0, pool=16)[2]["measured_at_n"] == 4


def test_stopped_batch_rounds_the_rule_share_up_within_one_and_n():
    assert one_sample.stopped_batch(16, 11.3167, 16) == 12
    assert one_sample.stopped_batch(16, 8.0, 16) == 8  # exact: no rounding up past it
    assert one_sample.stopped_batch(4, 0.1, 16) == 1 and one_sample.stopped_batch(64, 16.0, 16) == 64
    assert one_sample.stopped_batches([1, 4, 16, 64], 11.3167, 16) == [1, 3, 4, 12, 16, 46, 64]
    with pytest.raises(ValueError, match="samples_used"):
        one_sample.stopped_batch(16, 17.0, 16)


def test_early_stopping_is_charged_its_own_measured_batch():
    rows = _rows() + [{**_rows()[2], "n": 12, "seconds": 2.7, "ratio": 1.35}]
    out = one_sample.with_early_stopping(rows, samples_used=11.3, pool=16, n_values=[1, 4, 16, 64])
    assert [r["n"] for r in out] == [1, 4, 16, 64]  # only the requested rows are reported
    at16 = next(r for r in out if r["n"] == 16)
    assert at16["measured_at_n"] == 12 and at16["ratio"] == 1.35  # the batch of 12, not the next n = 16


def test_sc_goal_rows_judge_the_measured_ratios():
    rows = _rows()
    goals = {g.name: g for g in one_sample.goals(rows, one_sample.with_early_stopping(rows, 4.0, 16), "rule")}
    assert goals["sc16_vs_one_sample"].value == 1.5 and goals["sc16_vs_one_sample"].met is False
    early = goals["sc16_vs_one_sample_early_stop"]
    assert early.value == pytest.approx(1.2) and early.met
    assert goals["sc64_vs_one_sample"].moonshot and goals["sc64_vs_one_sample"].value == 2.5
    assert one_sample.goals(rows[:2], [], "rule")[0].met is None  # n = 16 not measured


def test_roofline_by_hand_and_its_ratio_grows_with_n():
    # 1 GB of weights at 1 GB/s, no KV, infinite FLOPs: prefill 1 s + 2 steps of 1 s.
    t = one_sample.roofline_seconds(n=8, prompt_len=10, new_tokens=2, n_params=10**9, bytes_per_param=1,
                                    kv_bytes_per_token=0, bandwidth=1e9, flops=float("inf"))
    assert t == pytest.approx(3.0)
    # Compute bound: 2 * params * n FLOPs per step.
    t = one_sample.roofline_seconds(n=8, prompt_len=10, new_tokens=1, n_params=10, bytes_per_param=0,
                                    kv_bytes_per_token=0, bandwidth=1.0, flops=1.0)
    assert t == pytest.approx(2 * 10 * 10 + 2 * 10 * 8)
    times = [one_sample.roofline_seconds(n=n, prompt_len=1024, new_tokens=32, n_params=10**8, bytes_per_param=2,
                                         kv_bytes_per_token=20_000) for n in (1, 16, 64)]
    assert times[0] < times[1] < times[2]


def test_roofline_rows_of_the_tiny_model(tiny):
    rows = one_sample.roofline_rows(tiny, prompt_len=64, n_values=[1, 4], new_tokens=4)
    assert rows[0]["gpu_ratio"] == pytest.approx(1.0) and rows[1]["gpu_ratio"] >= 1.0
