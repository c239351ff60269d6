"""Roofline cost model: Leviathan's expected tokens, the least-squares fit, crossover batches."""
import numpy as np
import pytest

from decodelab.speculation import heldout, roofline
from decodelab.speculation.roofline import SHAPES, Hardware, ModelShape


def test_expected_tokens_matches_leviathan_limits():
    assert roofline.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert roofline.expected_tokens(1.0, 4) == pytest.approx(5.0)
    a, k = 0.7, 3
    assert roofline.expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))


def test_fit_alpha_inverts_expected_tokens():
    ks = [1, 2, 4, 8]
    taus = roofline.expected_tokens(0.62, np.array(ks))
    assert roofline.fit_alpha(ks, taus) == pytest.approx(0.62, abs=1e-3)


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_fit_recovers_the_hardware_that_made_the_step_times(combine):
    shape = SHAPES["Qwen2.5-0.5B"]
    true = Hardware("true", peak=2e12, bandwidth=5e10, overhead=3e-3, combine=combine)
    b, n = np.meshgrid([1, 4, 16, 64, 256], [1, 2, 3, 5, 9])
    b, n = b.ravel(), n.ravel()
    s = np.full_like(b, 512)
    t = roofline.step_time(shape, true, b, n, s)
    fit = roofline.fit_hardware(shape, b, n, s, t, combine=combine)
    assert fit.median_rel_error < 1e-4
    np.testing.assert_allclose(roofline.step_time(shape, fit.hardware, b, n, s), t, rtol=1e-3)


def test_shape_from_config_counts_every_matmul_weight():
    from decodelab.core.models import tiny_config

    config = tiny_config(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=128)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    shape = ModelShape.from_config(config, bytes_per_param=4)
    layer_params = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.ndim == 2)
    assert shape.matmul_params == layer_params + model.lm_head.weight.numel()
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4


def test_speculation_wins_at_batch_one_and_loses_at_large_batch_on_h100():
    hw = roofline.spec_sheet("H100-SXM")
    target, draft = SHAPES["Qwen2.5-7B"], SHAPES["Qwen2.5-0.5B"]

    def at(b):
        return roofline.speculative_speedup(target, hw, b, alpha=0.7, k=4, context=1024, draft=draft)

    assert at(1) > 1.3
    assert at(4096) < 1.0
    cross = roofline.crossover_batch(at)
    assert cross is not None and 1 < cross < 4096
    assert at(cross * 0.9) > 1.0 > at(cross * 1.1)


def test_crossover_is_none_when_speedup_never_drops():
    assert roofline.crossover_batch(lambda b: 2.0) is None


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(ValueError, match="hardware='TPU' is unknown"):
        roofline.spec_sheet("TPU")
    with pytest.raises(ValueError, match="combine='avg'"):
        roofline.fit_hardware(SHAPES["Qwen2.5-7B"], [1, 2, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], combine="avg")


def test_70b_needs_several_gpus_and_the_kv_cache_caps_the_batch():
    h100 = roofline.spec_sheet("H100-SXM")
    assert roofline.devices_needed(SHAPES["Qwen2.5-7B"], h100) == 1
    n = roofline.devices_needed(SHAPES["Llama-3-70B"], h100)
    assert n >= 4 and SHAPES["Llama-3-70B"].weight_bytes <= 0.5 * h100.tensor_parallel(n).memory
    b = roofline.max_batch(SHAPES["Qwen2.5-7B"], h100, 1024)
    kv = b * 1024 * SHAPES["Qwen2.5-7B"].kv_bytes_per_token
    shape = SHAPES["Qwen2.5-7B"]
    assert kv + shape.weight_bytes <= h100.memory < kv + shape.weight_bytes + 1024 * shape.kv_bytes_per_token


def test_two_calibration_points_narrow_the_fit_to_peak_and_overhead():
    shape = SHAPES["Qwen2.5-0.5B"]
    true = Hardware("true", peak=2e12, bandwidth=float("inf"), overhead=3e-3, combine="sum")
    b, n, s = np.array([2, 2]), np.array([1, 3]), np.array([300, 300])
    t = roofline.step_time(shape, true, b, n, s)
    fit = roofline.fit_hardware(shape, b, n, s, t, combine="sum")
    assert fit.parameters == ("peak", "overhead") and "bandwidth dropped" in fit.note
    np.testing.assert_allclose(roofline.step_time(shape, fit.hardware, b, n, s), t, rtol=1e-6)
    one = roofline.fit_hardware(shape, b[:1], n[:1], s[:1], t[:1])
    assert one.parameters == ("overhead",)
    # every step costs the one measured
    assert roofline.step_time(shape, one.hardware, 2, 9, 300) == pytest.approx(t[0])
    with pytest.raises(ValueError, match="need >= 1 measured step"):
        roofline.fit_hardware(shape, [], [], [], [])


def test_split_cells_holds_out_a_seeded_share_of_each_group():
    groups = ["a"] * 5 + ["b"] * 4 + ["c"]
    held = heldout.split_cells(groups, seed=3)
    assert held.tolist() == heldout.split_cells(groups, seed=3).tolist()  # reproducible
    by = {g: [h for x, h in zip(groups, held) if x == g] for g in "abc"}
    assert (sum(by["a"]), sum(by["b"]), sum(by["c"])) == (2, 2, 0)  # floor(n / 2); a lone cell only fits
    assert any(heldout.split_cells(groups, seed=s).tolist() != held.tolist() for s in range(4, 10))


def _cells(alpha=0.6, draft_s=1e-3):
    shape, hw = SHAPES["Qwen2.5-0.5B"], Hardware("hw", peak=5e11, bandwidth=2e10, overhead=2e-3, combine="sum")
    rows = []
    for b in (1, 4, 16):
        for k in (1, 2, 4):
            t1, tv = roofline.step_time(shape, hw, b, 1, 200), roofline.step_time(shape, hw, b, k + 1, 200)
            rows.append({"batch": b, "drafter": "ngram", "k": k, "context": 200, "draft_s_per_token": draft_s,
                         "tau": float(roofline.expected_tokens(alpha, k)),
                         "speedup": float(roofline.predicted_speedup(alpha, k, t1, draft_s, tv))})
    return rows, shape, hw


def test_a_held_out_cells_own_measurements_never_enter_its_prediction():
    rows, shape, hw = _cells()
    val = heldout.validate(rows, shape, hw, seed=0)
    assert val.n_heldout == 4 and val.n_fit == 5
    tampered = [dict(r, tau=9.0, draft_s_per_token=5.0, speedup=0.01) if h else r for r, h in zip(rows, val.held_out)]
    again = heldout.validate(tampered, shape, hw, seed=0)
    assert again.held_out == val.held_out
    np.testing.assert_allclose(again.predicted, val.predicted)  # the fit saw none of the held-out numbers
    assert again.heldout_error > 0.5 and again.insample_error != val.insample_error


def test_cells_the_model_made_are_predicted_exactly_held_out_and_in_sample():
    rows, shape, hw = _cells()
    val = heldout.validate(rows, shape, hw, seed=1)
    assert val.heldout_error == pytest.approx(0.0, abs=1e-3) and val.insample_error == pytest.approx(0.0, abs=1e-3)
    alone = heldout.validate(rows[:1], shape, hw, seed=1)  # one cell: nothing to hold out
    assert alone.n_heldout == 0 and alone.heldout_error is None


CALIBRATION = [{"batch": b, "n_tokens": n, "context": 100, "seconds": s * b}
               for b in (1, 4) for n, s in ((1, 0.01), (2, 0.02), (3, 0.03))]


def test_calibrated_seconds_interpolate_the_measured_steps():
    shape, hw = SHAPES["Qwen2.5-0.5B"], Hardware("hw", peak=5e11, bandwidth=2e10, overhead=2e-3, combine="sum")
    assert heldout.calibrated_seconds(CALIBRATION, shape, hw, 1, 2, 100) == pytest.approx(0.02)
    half = [c for c in CALIBRATION if c["n_tokens"] != 2]
    assert heldout.calibrated_seconds(half, shape, hw, 4, 2, 100) == pytest.approx(0.08)  # linear in n
    shift = roofline.step_time(shape, hw, 1, 3, 400) / roofline.step_time(shape, hw, 1, 3, 100)
    assert heldout.calibrated_seconds(CALIBRATION, shape, hw, 1, 3, 400) == pytest.approx(0.03 * shift)
    assert heldout.calibrated_seconds(CALIBRATION, shape, hw, 1, 5, 100) is None  # beyond the calibrated n
    assert heldout.calibrated_seconds(CALIBRATION, shape, hw, 16, 2, 100) is None  # batch not calibrated
    assert heldout.calibrated_seconds(None, shape, hw, 1, 2, 100) is None


def _fit_cell(**kw):
    # batch 1, k = 1, 5 new tokens (N = 4 after the first); verify 0.02 s/step = T(1, 2): loop factor f = 1;
    # decode_s x speedup / N = 0.012 = 1.2 T(1, 1): g = 1.2; draft 0.001 s/token = 0.1 T(1, 1); tau 1.5 -> a = 0.5
    cell = {"batch": 1, "drafter": "ngram", "k": 1, "context": 100, "tau": 1.5, "acceptance": [0.5], "steps": 10,
            "verify_s": 0.2, "decode_s": 0.25, "speedup": 0.192, "new_tokens": 5, "draft_s_per_token": 0.001}
    return {**cell, **kw}


def test_prediction_from_fit_cells_matches_the_hand_computed_value():
    shape, hw = SHAPES["Qwen2.5-0.5B"], Hardware("hw", peak=5e11, bandwidth=2e10, overhead=2e-3, combine="sum")
    target = {"batch": 1, "drafter": "ngram", "k": 2, "context": 100}
    (pred,) = heldout.predict_from([_fit_cell()], [target], shape, hw, calibration=CALIBRATION)
    # c = (0.5, tail 0.5) -> X in {1, 2, 3} w.p. (1/2, 1/4, 1/4): 2.625 steps for N = 4 tokens;
    # S = g T(1, 1) / (steps / N (f T(1, 3) + 2 r T(1, 1))) = 1.2 x 0.01 / (0.65625 x (0.03 + 0.002)) = 4 / 7
    assert pred == pytest.approx(4 / 7, rel=1e-4)
    # the same cell without calibration steps reads T off the roofline
    (bare,) = heldout.predict_from([_fit_cell()], [target], shape, hw)
    t1, t3 = (float(roofline.step_time(shape, hw, 1, n, 100)) for n in (1, 3))
    f, g = 0.02 / float(roofline.step_time(shape, hw, 1, 2, 100)), 0.012 / t1
    assert bare == pytest.approx(g * t1 / (0.65625 * (f * t3 + 2 * 0.001)), rel=1e-4)  # r T(1, 1) = 0.001 again


def test_a_batch_is_predicted_to_wait_for_its_slowest_row():
    shape, hw = SHAPES["Qwen2.5-0.5B"], Hardware("hw", peak=5e11, bandwidth=2e10, overhead=2e-3, combine="sum")
    fit = [_fit_cell(), _fit_cell(batch=4, new_tokens=20, verify_s=0.8, decode_s=1.0)]
    one, four = heldout.predict_from(fit, [{"batch": b, "drafter": "ngram", "k": 2, "context": 100} for b in (1, 4)],
                                      shape, hw, calibration=CALIBRATION)
    assert four < one  # same step-time ratios per batch; only the max over rows of the steps differs


def test_no_measurement_of_a_held_out_cell_enters_any_prediction():
    rows, shape, hw = _cells()
    rich = [dict(r, acceptance=[0.6] * r["k"], steps=12, verify_s=0.3, decode_s=0.4, new_tokens=9 * r["batch"])
            for r in rows]
    cal = [{"batch": b, "n_tokens": n, "context": 200, "seconds": float(roofline.step_time(shape, hw, b, n, 200))}
           for b in (1, 4, 16) for n in (1, 2, 3, 5)]
    val = heldout.validate(rich, shape, hw, seed=0, calibration=cal)
    tampered = [dict(r, tau=9.0, acceptance=[0.01] * r["k"], steps=3, verify_s=5.0, decode_s=7.0, speedup=0.01,
                     draft_s_per_token=5.0, new_tokens=50 * r["batch"]) if h else r for r, h in zip(rich, val.held_out)]
    again = heldout.validate(tampered, shape, hw, seed=0, calibration=cal)
    assert again.held_out == val.held_out and val.n_heldout == 4
    np.testing.assert_allclose(again.predicted, val.predicted)  # held-out and fit cells alike
    assert again.heldout_error != val.heldout_error
    assert not np.allclose(again.predicted_insample, val.predicted_insample)  # the all-cells fit does read them


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_step_time_short_path_equals_the_broadcast_formula(combine):
    # a scalar batch and context take the policy's short path; it must be the same model as the array path
    shape, hw = roofline.SHAPES["Llama-3-8B"], roofline.Hardware("x", peak=3e11, bandwidth=2e10, overhead=2e-3,
                                                               combine=combine)
    widths = np.arange(1, 10)
    for batch, context in [(1, 0.0), (4, 203.25), (64, 4096.0)]:
        short = roofline.step_time(shape, hw, batch, widths, context)
        broadcast = roofline.step_time(shape, hw, np.full(9, batch), widths, np.full(9, context))
        by_hand = np.array([max(shape.flops(batch, n, context) / hw.peak, shape.bytes(batch, n, context) / hw.bandwidth)
                            if combine == "max" else shape.flops(batch, n, context) / hw.peak
                            + shape.bytes(batch, n, context) / hw.bandwidth for n in widths]) + hw.overhead
        np.testing.assert_allclose(short, broadcast, rtol=1e-12)
        np.testing.assert_allclose(short, by_hand, rtol=1e-12)
