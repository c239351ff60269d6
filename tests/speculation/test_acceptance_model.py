"""Acceptance from per-position rates, pooled over cells, and the steps a batch needs: hand-computed values."""
import numpy as np
import pytest

from decodelab.speculation import acceptance_model as am


def test_geometric_acceptance_is_leviathans_expected_tokens():
    for a, k in ((0.0, 3), (0.6, 1), (0.7, 4), (0.95, 8)):
        assert am.Acceptance.geometric(a).expected_tokens(k) == pytest.approx(float(am.expected_tokens(a, k)))


def test_measured_rates_give_survival_tokens_and_emissions():
    acc = am.Acceptance((0.5, 0.8), tail=0.5)
    np.testing.assert_allclose(acc.conditional(3), [0.5, 0.8, 0.5])
    np.testing.assert_allclose(acc.survival(3), [0.5, 0.4, 0.2])  # P(run >= j)
    assert acc.expected_tokens(3) == pytest.approx(2.1)  # 1 + 0.5 + 0.4 + 0.2
    np.testing.assert_allclose(acc.emission_pmf(3), [0.5, 0.1, 0.2, 0.2])  # P(X = 1..4), sums to 1
    np.testing.assert_allclose(acc.emission_pmf(1), [0.5, 0.5])


def test_pooling_weights_each_position_by_the_drafts_that_reached_it():
    # cell A: 10 row-steps, c = (0.5, 1.0); cell B: 30 row-steps, k = 1, c_1 = 1.0
    acc = am.pooled_acceptance([[0.5, 1.0], [1.0, float("nan")]], [10, 30], fallback=0.3)
    assert acc.rates == pytest.approx((35 / 40, 1.0))  # position 2: only A's 10 x 0.5 drafts reached it
    assert acc.tail == pytest.approx(1.0)  # beyond: the rate over positions >= 2
    # position 2 pooled: A reaches 10 x 0.5 = 5 at rate 0.6, C reaches 20 x 0.5 = 10 at rate 0.9
    two = am.pooled_acceptance([[0.5, 0.6], [0.5, 0.9]], [10, 20], fallback=0.3)
    assert two.rates == pytest.approx((0.5, (5 * 0.6 + 10 * 0.9) / 15))
    assert two.tail == pytest.approx(0.8)


def test_pooling_falls_back_to_the_geometric_rate_where_nothing_was_judged():
    first_only = am.pooled_acceptance([[0.7]], [5], fallback=0.3)
    assert first_only.rates == (0.7,) and first_only.tail == 0.3
    assert am.pooled_acceptance([(), ()], [5, 5], fallback=0.4) == am.Acceptance.geometric(0.4)
    assert am.pooled_acceptance([], [], fallback=0.4) == am.Acceptance.geometric(0.4)


def test_steps_to_finish_a_row_and_a_batch():
    np.testing.assert_allclose(am.steps_cdf([1.0], 5), [0, 0, 0, 0, 0, 1])  # one token a step: 5 steps
    np.testing.assert_allclose(am.steps_cdf([0.0, 1.0], 5), [0, 0, 0, 1, 1, 1])  # two a step: 3, the last cut
    np.testing.assert_allclose(am.steps_cdf([0.5, 0.5], 2), [0, 0.5, 1])
    assert am.expected_batch_steps([0.5, 0.5], 2, 1) == pytest.approx(1.5)
    assert am.expected_batch_steps([0.5, 0.5], 2, 2) == pytest.approx(1.75)  # max of two: 2 unless both finish at once
    # X in {1, 2, 3} w.p. (1/2, 1/4, 1/4), 4 tokens: f(n) = 1 + sum_m p_m f(n - m) -> f(4) = 2.625
    assert am.expected_batch_steps([0.5, 0.25, 0.25], 4, 1) == pytest.approx(2.625)


def test_the_batch_waits_for_its_slowest_row():
    pmf = am.Acceptance((0.7,), 0.9).emission_pmf(4)
    steps = [am.expected_batch_steps(pmf, 31, b) for b in (1, 4, 16, 64)]
    assert steps == sorted(steps) and steps[-1] <= 31
    assert steps[0] >= 31 / am.Acceptance((0.7,), 0.9).expected_tokens(4)  # the last step's surplus is cut


def test_bad_lengths_are_clear_errors():
    with pytest.raises(ValueError, match="n_tokens=0 must be >= 1"):
        am.steps_cdf([1.0], 0)
    with pytest.raises(ValueError, match="rows=0 must be >= 1"):
        am.expected_batch_steps([1.0], 3, 0)
