"""The never-loses interval: paired by interleaved round, one wall clock per run (speedup_stats)."""
import math

import numpy as np
import pytest

from decodelab.speculation.speedup_stats import (
    SPIKE,
    cap_interruptions,
    log_ratio_interval,
    pooled_speedup_intervals,
    round_rates,
    speedup_interval,
)


def _rounds(seconds, tokens=64, steps=8):
    """One run per entry: `steps` equal steps summing to `seconds`, `tokens` tokens in all."""
    return [([tokens // steps] * steps, [s / steps] * steps) for s in seconds]


def test_round_rates_use_one_wall_clock_per_run():
    rounds = [([4, 4, 8], [1.0, 1.0, 2.0]), ([16], [2.0])]
    assert round_rates(rounds).tolist() == [4.0, 8.0]


def test_plain_against_itself_with_noise_covers_one_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered, trials = 0, 2000
    for _ in range(trials):
        base = rng.uniform(1.0, 2.0)  # the machine's state drifts between rounds; both sides share it
        plain = base * np.exp(rng.normal(0, 0.05, 5))
        twin = base * np.exp(rng.normal(0, 0.05, 5))
        low, high = speedup_interval(_rounds(plain), _rounds(twin))
        covered += low <= 1.0 <= high
    assert 0.93 <= covered / trials <= 0.97


def test_a_constant_10_percent_gain_gives_an_interval_around_1_10():
    rng = np.random.default_rng(1)
    plain = 2.0 * np.exp(rng.normal(0, 0.01, 6))
    method = plain / 1.10 * np.exp(rng.normal(0, 0.01, 6))
    low, high = speedup_interval(_rounds(plain), _rounds(method))
    assert 1.05 < low < 1.10 < high < 1.15


def test_steps_that_differ_by_design_do_not_widen_the_interval():
    # a method whose steps yield 1 or 5 tokens (deterministic acceptance), identical in every round: the
    # old per-step bootstrap spread this over a wide interval; the paired-round interval is exact here
    method = [([1, 5] * 4, [0.1] * 8)] * 3
    plain = [([1] * 24, [0.1] * 24)] * 3
    low, high = speedup_interval(plain, method)
    assert low == pytest.approx(3.0) and high == pytest.approx(3.0)


def test_drift_shared_by_both_sides_of_a_round_cancels():
    drift = np.array([1.0, 1.6, 0.8, 1.3])  # round-level load: both runs of a round slowed alike
    low, high = speedup_interval(_rounds(2.0 * drift), _rounds(1.0 * drift))
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_one_round_has_no_interval_and_mismatched_rounds_are_refused():
    assert speedup_interval(_rounds([1.0]), _rounds([0.5])) == (None, None)
    assert log_ratio_interval([0.1]) is None
    with pytest.raises(ValueError, match="one plain run per method run"):
        speedup_interval(_rounds([1.0, 1.0]), _rounds([1.0]))
    with pytest.raises(ValueError, match="level"):
        speedup_interval(_rounds([1.0, 1.0]), _rounds([1.0, 1.0]), level=1.5)


def test_the_interval_is_a_t_interval_on_log_ratios():
    x = [0.1, 0.2, 0.3]
    est, low, high = log_ratio_interval(x)
    half = 4.302652729911275 * 0.1 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert est == pytest.approx(math.exp(0.2)) and low == pytest.approx(math.exp(0.2 - half))
    assert high == pytest.approx(math.exp(0.2 + half))


def test_pooled_intervals_cover_the_true_ratio_about_95_percent_of_the_time_with_two_rounds():
    rng = np.random.default_rng(2)
    gains = np.array([1.0, 1.0, 1.3, 0.8, 2.5, 1.1, 0.95, 1.6])  # the first "method" is plain's A/A twin
    covered, trials = np.zeros(len(gains)), 1000
    for _ in range(trials):
        drift = rng.uniform(1.0, 1.5, 2)  # per round, shared by every run of the round
        plain = 2.0 * drift * np.exp(rng.normal(0, 0.03, 2))
        methods = [_rounds(2.0 / g * drift * np.exp(rng.normal(0, 0.03, 2))) for g in gains]
        for i, (low, high) in enumerate(pooled_speedup_intervals(_rounds(plain), methods)):
            covered[i] += low <= gains[i] <= high
    assert np.all(covered / trials > 0.92) and np.mean(covered / trials) == pytest.approx(0.95, abs=0.02)


def test_pooled_intervals_are_tight_where_the_noise_is_small_and_need_two_rounds():
    rng = np.random.default_rng(3)
    plain = 2.0 * np.exp(rng.normal(0, 0.005, 3))
    methods = [_rounds(2.0 / g * np.exp(rng.normal(0, 0.005, 3))) for g in (1.0, 1.10, 0.9)]
    (a_low, a_high), (low, high), (s_low, s_high) = pooled_speedup_intervals(_rounds(plain), methods)
    assert 0.98 < a_low <= 1.0 <= a_high < 1.02
    assert 1.07 < low < 1.10 < high < 1.13 and s_high < 0.93
    assert pooled_speedup_intervals(_rounds([1.0]), [_rounds([0.5])]) == [(None, None)]
    with pytest.raises(ValueError, match="one plain run per method run"):
        pooled_speedup_intervals(_rounds([1.0, 1.0]), [_rounds([1.0])])


def test_short_runs_are_pooled_apart_so_their_noise_does_not_widen_full_length_runs():
    # full-length runs (8 steps like plain) with 0.5% noise beside short runs (2 steps) with 4% noise: each
    # stratum's intervals keep ~95% coverage, and the quiet ones stay about as narrow as they would alone
    rng = np.random.default_rng(11)
    quiet_gains, loud_gains, trials, n = (1.0, 0.99), (1.5, 2.0), 400, 4
    covered, widths = np.zeros(4), []
    for _ in range(trials):
        drift = rng.uniform(1.0, 1.3, n)
        plain = _rounds(2.0 * drift * np.exp(rng.normal(0, 0.005, n)))
        quiet = [_rounds(2.0 / g * drift * np.exp(rng.normal(0, 0.005, n))) for g in quiet_gains]
        loud = [_rounds(2.0 / g * drift * np.exp(rng.normal(0, 0.04, n)), steps=2) for g in loud_gains]
        intervals = pooled_speedup_intervals(plain, quiet + loud)
        for i, ((low, high), g) in enumerate(zip(intervals, quiet_gains + loud_gains)):
            covered[i] += low <= g <= high
        widths.append(math.log(intervals[0][1] / intervals[0][0]))
        alone = pooled_speedup_intervals(plain, quiet)
        assert np.allclose(intervals[:2], alone, rtol=1e-12)  # the loud runs change nothing for the quiet stratum
    assert np.all(covered / trials > 0.92)
    assert np.median(widths) < 0.03  # one scale pooled over both strata would give ~0.07 here


def test_plain_twin_joins_the_reference_keeping_coverage_with_a_narrower_interval():
    # plain decoded twice per round: their mean is the reference, so a method's paired noise is s^2 (1 + 1/2)
    # instead of 2 s^2: coverage stays ~95% and the interval narrows by about sqrt(3/4)
    rng = np.random.default_rng(12)
    gains, trials, n = (1.0, 0.98, 1.2), 1500, 4
    covered, ratios = np.zeros(len(gains)), []
    for _ in range(trials):
        drift = rng.uniform(1.0, 1.3, n)
        run = lambda g: _rounds(2.0 / g * drift * np.exp(rng.normal(0, 0.01, n)))  # noqa: E731
        plain, twin, methods = run(1.0), run(1.0), [run(g) for g in gains]
        with_twin = pooled_speedup_intervals(plain, methods, plain_twins=[twin])
        alone = pooled_speedup_intervals(plain, [twin] + methods)[1:]  # the twin as one more method
        for i, ((low, high), g) in enumerate(zip(with_twin, gains)):
            covered[i] += low <= g <= high
        ratios.append(math.log(with_twin[0][1] / with_twin[0][0]) / math.log(alone[0][1] / alone[0][0]))
    assert np.all(np.abs(covered / trials - 0.95) < 0.02)
    assert np.median(ratios) == pytest.approx(math.sqrt(3 / 4), abs=0.05)
    with pytest.raises(ValueError, match="per method and twin"):
        pooled_speedup_intervals(_rounds([1.0, 1.0]), [_rounds([1.0, 1.0])], plain_twins=[_rounds([1.0])])


def test_cap_interruptions_caps_one_step_of_one_round_and_keeps_drift():
    tokens = [1, 2, 1]
    rounds = [(tokens, [1.0, 1.0, 1.0]), (tokens, [1.1, 1.1, 1.1]), (tokens, [1.0, 3.0, 1.0]),
              (tokens, [1.0, 1.0, 0.9])]
    capped, n = cap_interruptions(rounds)
    assert n == 1
    # step 2's median over the rounds is 1.05: the 3 s step is capped at 1.25 x that, the rest (a whole round 10%
    # slower, a step 10% faster) stays as measured
    assert capped[2][1] == pytest.approx([1.0, (1 + SPIKE) * 1.05, 1.0])
    assert [c[1] for c in capped[:2]] + [capped[3][1]] == [[1.0, 1.0, 1.0], [1.1, 1.1, 1.1], [1.0, 1.0, 0.9]]
    assert [c[0] for c in capped] == [tokens] * 4


def test_cap_interruptions_leaves_runs_whose_rounds_differ_or_are_too_few():
    differ = [([1, 2], [1.0, 1.0]), ([2, 1], [1.0, 1.0]), ([1, 2], [1.0, 5.0])]  # another step sequence
    assert cap_interruptions(differ) == (differ, 0)
    two = [([1], [1.0]), ([1], [9.0])]  # a median of two would be raised by the interrupted step itself
    assert cap_interruptions(two) == (two, 0)
    with pytest.raises(ValueError, match="spike"):
        cap_interruptions(differ, spike=-0.1)
