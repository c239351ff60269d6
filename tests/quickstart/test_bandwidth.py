"""Bandwidth calibration, roofline points, and the verify-width calibration (no timings asserted)."""

import pytest

from decodelab.core.models import tiny_model
from decodelab.quickstart import bandwidth, verify_widths

ISSUE_MS = {1: 58, 2: 88, 3: 106, 4: 81, 5: 71, 6: 79, 7: 99, 8: 78, 9: 86}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_weight_bytes_counts_tied_embeddings_once(model):
    config = model.hf_model.config
    assert config.tie_word_embeddings
    total = sum(p.numel() for p in model.hf_model.parameters())  # parameters() already dedupes ties
    assert bandwidth.n_params(model) == total and bandwidth.weight_bytes(model) == 4 * total


def test_a_step_at_the_memory_limit_has_fraction_one_and_larger_batches_more_intensity():
    weights, params, bw = 4_000, 1_000, 8_000.0  # 0.5 s per weight read
    at_limit = bandwidth.roofline_point(2.0, 1, weights=weights, params=params, bandwidth=bw)
    assert at_limit["memory_fraction"] == pytest.approx(1.0)
    batch16 = bandwidth.roofline_point(16.0, 16, weights=weights, params=params, bandwidth=bw)
    assert batch16["memory_fraction"] == pytest.approx(0.5)
    assert batch16["flop_per_byte"] == pytest.approx(16 * at_limit["flop_per_byte"])
    assert batch16["attained_gflops"] == pytest.approx(2 * params * 16 / 1e9)


def test_matvec_bandwidth_reports_the_lm_head_bytes(model):
    out = bandwidth.matvec_bandwidth(model, repeats=2)
    head = model.transformer.lm_head.weight
    assert out["matrix_bytes"] == head.numel() * 4 and out["bandwidth_Bps"] > 0 and out["dtype"] == "float32"
    with pytest.raises(ValueError, match="repeats=0"):
        bandwidth.matvec_bandwidth(model, repeats=0)


def test_add_roofline_adds_columns_per_batch(model):
    table = [{"batch": 1, "ours_tokens_per_s": 10.0}, {"batch": 4, "ours_tokens_per_s": 30.0}]
    bandwidth.add_roofline(table, model, {"bandwidth_Bps": 1e9})
    assert {"ours_memory_fraction", "ours_flop_per_byte", "ours_attained_gflops"} <= set(table[1])


def test_verify_costs_times_every_width_and_leaves_no_trace(model):
    costs = verify_widths.verify_costs(model, 3, context=8, repeats=1)
    assert sorted(costs) == [1, 2, 3] and all(c > 0 for c in costs.values())
    with pytest.raises(ValueError, match="max_width=0"):
        verify_widths.verify_costs(model, 0)


def test_calibrated_widths_are_measured_once_and_then_read_back(model, tmp_path, monkeypatch):
    calls = []

    def fake_costs(model, max_width, **kwargs):
        calls.append(max_width)
        return {t: ISSUE_MS[t] / 1e3 for t in range(1, max_width + 1)}

    monkeypatch.setattr(verify_widths, "verify_costs", fake_costs)
    widths, path = verify_widths.calibrated_widths(model, name="tiny", max_width=9, directory=tmp_path)
    again, _ = verify_widths.calibrated_widths(model, name="tiny", max_width=9, directory=tmp_path)
    assert widths == again == {1: 1, 2: 5, 3: 5, 4: 5, 5: 5, 6: 6, 7: 8, 8: 8, 9: 9}
    assert calls == [9] and path.is_file() and "float32" in path.name


def test_before_after_table_reports_the_padded_width(model, monkeypatch):
    def fake_times(model, max_width, widths=None, **kwargs):  # three rounds, the second 10% slower throughout
        return {t: [ISSUE_MS[widths[t] if widths else t] / 1e3 * f for f in (1.0, 1.1, 1.0)]
                for t in range(1, max_width + 1)}

    monkeypatch.setattr(verify_widths, "verify_times", fake_times)
    rows = verify_widths.before_after_table(model, 9)
    assert [r["width"] for r in rows] == [1, 5, 5, 5, 5, 6, 8, 8, 9]
    padded = [r["padded_ms"] for r in rows]
    assert padded[:5] == sorted(padded[:5])
    assert "| 2 | 88.0 | 5 | 71.0 | 0.0% |" in verify_widths.markdown_widths(rows)
    # widths 5 -> 6: 71 -> 79 ms; 6 -> 7 pads to 8: 79 -> 78 ms, a 1.3% dip; the largest T has no dip
    dips = [r["padded_dip"] for r in rows]
    assert dips[4] == pytest.approx(71 / 79 - 1) and dips[5] == pytest.approx(79 / 78 - 1) and dips[-1] is None
    assert verify_widths.worst_dip(rows) == pytest.approx(max(d for d in dips if d is not None))
    assert verify_widths.worst_dip_of_minima(rows) == pytest.approx(79 / 78 - 1)  # padded 79 -> 78 ms at T = 6 -> 7


def test_paired_dips_pair_each_round_so_one_lucky_call_does_not_fake_a_dip():
    # T = 2 caught a brief fast spell once: the minima say T = 2 ran 18% cheaper than T = 1 (a dip), yet in
    # two of three rounds T = 2 cost 5% more than T = 1 beside it
    times = {1: [1.0, 1.0, 1.0], 2: [1.05, 0.85, 1.05], 3: [1.0, 1.0, 1.0]}
    dips = verify_widths.paired_dips(times)
    assert min(times[1]) / min(times[2]) - 1 > 0.17
    assert dips[1] == pytest.approx(1 / 1.05 - 1) and dips[2] == pytest.approx(0.05) and set(dips) == {1, 2}
    assert verify_widths.paired_dips({4: [1.0, 3.0, 1.0], 5: [2.0, 1.0, 2.0]})[4] == pytest.approx(-0.5)  # median
