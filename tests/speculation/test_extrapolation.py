"""Crossover batches and the GPU extrapolation of notebook 01 (decodelab.speculation.extrapolation)."""
import numpy as np
import pytest

from decodelab.speculation import extrapolation, roofline
from decodelab.speculation.roofline import SHAPES, Hardware

SHAPE = SHAPES["Qwen2.5-0.5B"]
MACHINE = Hardware("cpu-like", peak=5e11, bandwidth=2e10, overhead=2e-3, combine="sum")
DRAFT_SHAPES = {"layer_skip": SHAPE.with_layers(20), "draft_model": SHAPES["Qwen2.5-0.5B"].with_layers(8)}


def _best(d, b, alpha, ks, measured=None):
    return extrapolation.predicted_best_speedup(d, b, shape=SHAPE, hw=MACHINE, context=300, alpha=alpha, ks=ks,
                                                draft_shapes=DRAFT_SHAPES, measured=measured or {"ngram": 1e-4})


@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model"])
@pytest.mark.parametrize("batch", [1, 8, 64, 512])
def test_predicted_speedup_stays_under_the_free_draft_bound_and_k0_is_plain(drafter, batch):
    alpha, ks = 0.6, (1, 2, 4, 8)
    best = _best(drafter, batch, alpha, ks)
    t1 = roofline.step_time(SHAPE, MACHINE, batch, 1, 300)
    free = max(float(roofline.expected_tokens(alpha, k) * t1 / roofline.step_time(SHAPE, MACHINE, batch, k + 1, 300))
               for k in ks)
    assert 0 < best <= free <= 1 / (1 - alpha)  # drafting costs time; tokens(a, k) < 1 / (1 - a); T(B, k+1) >= T(B, 1)
    assert _best(drafter, batch, alpha, (0,)) == pytest.approx(1.0)  # k = 0 is plain decoding
    assert _best(drafter, batch, alpha, (0,) + ks) == max(1.0, best)


@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model"])
def test_predicted_speedup_rises_with_acceptance(drafter):
    for batch in (1, 16, 256):
        values = [_best(drafter, batch, a, (1, 2, 4, 8)) for a in np.linspace(0.0, 0.95, 20)]
        assert all(b >= a for a, b in zip(values, values[1:])), (batch, values)


def test_draft_cost_is_the_drafts_roofline_or_the_measured_median():
    measured = extrapolation.measured_draft_cost([
        {"drafter": "ngram", "draft_s_per_token": 1.0}, {"drafter": "ngram", "draft_s_per_token": 3.0},
        {"drafter": "ngram", "draft_s_per_token": float("nan")}, {"drafter": "layer_skip", "draft_s_per_token": 9.0}])
    assert measured == {"ngram": 2.0, "layer_skip": 9.0}
    cost = extrapolation.draft_seconds_per_token
    assert cost("ngram", 4, MACHINE, 300, draft_shapes=DRAFT_SHAPES, measured=measured) == 2.0
    assert cost("layer_skip", 4, MACHINE, 300, draft_shapes=DRAFT_SHAPES, measured=measured) == pytest.approx(
        float(roofline.step_time(DRAFT_SHAPES["layer_skip"], MACHINE, 4, 1, 300)))  # not the measured 9.0
    assert np.isnan(cost("ngram", 4, MACHINE, 300, draft_shapes={}, measured={}))


def test_local_crossovers_equal_the_notebooks_former_inline_computation():
    alphas, ks, drafter_ks = {"ngram": 0.4, "layer_skip": 0.7}, [1, 2, 4, 8], {"layer_skip": [1, 2]}
    fixed = [{"drafter": d, "batch": b, "k": k, "draft_s_per_token": 1e-4 * (1 + b % 3 + k),
              "speedup": 2.5 / b ** 0.4 / k ** 0.1}
             for d in alphas for b in (1, 4, 16, 64) for k in drafter_ks.get(d, ks)]
    best = [max((r for r in fixed if r["drafter"] == d and r["batch"] == b), key=lambda r: r["speedup"])
            for d in alphas for b in (64, 16, 4, 1)]  # out of order: the measured crossover sorts by batch
    got = extrapolation.local_crossovers(best, fixed, drafters=list(alphas), shape=SHAPE, hw=MACHINE, context=300.0,
                                         alphas=alphas, ks=ks, drafter_ks=drafter_ks, draft_shapes=DRAFT_SHAPES)

    def draft_cost(d, b):  # notebook 01's cell before the move (pandas median -> median of the cells)
        if d in DRAFT_SHAPES:
            return float(roofline.step_time(DRAFT_SHAPES[d], MACHINE, b, 1, 300.0))
        return float(np.median([r["draft_s_per_token"] for r in fixed if r["drafter"] == d]))

    def predicted_best(d, b):
        t1 = roofline.step_time(SHAPE, MACHINE, b, 1, 300.0)
        return max(float(roofline.predicted_speedup(alphas[d], k, t1, draft_cost(d, b),
                                                    roofline.step_time(SHAPE, MACHINE, b, k + 1, 300.0)))
                   for k in drafter_ks.get(d, ks))

    for d in alphas:
        part = sorted((r for r in best if r["drafter"] == d), key=lambda r: r["batch"])
        measured = roofline.crossover_from_points([r["batch"] for r in part], [r["speedup"] for r in part])
        predicted = roofline.crossover_batch(lambda b, d=d: predicted_best(d, b))
        assert got[d] == {"measured": measured, "predicted": predicted}
    assert got["ngram"]["measured"] is not None and 1 < got["ngram"]["measured"] < 64


def test_gpu_extrapolation_has_rows_for_every_hardware_model_and_drafter():
    hardware = ["A100-80GB", "H100-SXM", "H200"]
    ex = extrapolation.gpu_extrapolation(hardware, ks=[1, 2, 4], context=1024, alphas={"ngram": 0.3}, draft_alpha=0.7)
    drafters = ("ngram", "draft_model")
    assert list(ex.crossovers) == [f"{d}/{size}/{hw}" for hw in hardware for size in extrapolation.GPU_TARGETS
                                   for d in drafters]
    seen = {(r["hardware"].split("x ")[-1], r["model"], r["drafter"]) for r in ex.rows}
    assert seen == {(hw, size, d) for hw in hardware for size in extrapolation.GPU_TARGETS for d in drafters}
    for name, c in ex.crossovers.items():
        d, size, hw = name.split("/")
        rows = [r for r in ex.rows if r["drafter"] == d and r["model"] == size and r["hardware"].endswith(hw)]
        assert c["max_batch_in_memory"] == max(r["batch"] for r in rows)
        assert all(r["batch"] in extrapolation.GPU_BATCHES for r in rows)
        n_dev = roofline.devices_needed(SHAPES[extrapolation.GPU_TARGETS[size][0]], roofline.spec_sheet(hw))
        assert c["devices"] == n_dev and rows[0]["hardware"] == (f"{n_dev}x {hw}" if n_dev > 1 else hw)
        curve = ([r["batch"] for r in rows], [r["speedup"] for r in rows])
        assert c["predicted"] == roofline.crossover_from_points(*curve)
    # speedups are the roofline's best fixed k for that target, hardware and drafter
    one = next(r for r in ex.rows if r["hardware"] == "H200" and r["model"] == "7B" and r["drafter"] == "draft_model")
    h200 = roofline.spec_sheet("H200")
    assert one["speedup"] == roofline.best_k_speedup(SHAPES["Qwen2.5-7B"], h200, one["batch"], alpha=0.7, ks=[1, 2, 4],
                                                     context=1024, draft=SHAPES["Qwen2.5-0.5B"])


def test_gpu_extrapolation_assumes_an_ngram_acceptance_when_none_was_measured():
    kw = dict(ks=[2], context=1024, draft_alpha=0.7, targets={"7B": extrapolation.GPU_TARGETS["7B"]})
    unmeasured = extrapolation.gpu_extrapolation(["H100-SXM"], alphas={}, **kw)
    default = extrapolation.UNMEASURED_NGRAM_ALPHA
    assert unmeasured == extrapolation.gpu_extrapolation(["H100-SXM"], alphas={"ngram": default}, **kw)
    # a better acceptance keeps speculation paying up to a larger batch
    higher = extrapolation.gpu_extrapolation(["H100-SXM"], alphas={"ngram": default + 0.1}, **kw)
    assert higher.crossovers["ngram/7B/H100-SXM"]["predicted"] > unmeasured.crossovers["ngram/7B/H100-SXM"]["predicted"]


def test_drafter_shapes_cost_the_skipped_target_and_the_draft_model(tiny):
    from decodelab.speculation.draft_models import truncated_model

    target = roofline.ModelShape.from_config(tiny.hf_model.config, name="tiny", bytes_per_param=4)
    shapes = extrapolation.drafter_shapes(target, n_skip_layers=1, draft=truncated_model(tiny, 2))
    assert shapes["layer_skip"].n_layers == 1 and shapes["layer_skip"].hidden == target.hidden
    assert shapes["draft_model"].n_layers == 2 and shapes["draft_model"].bytes_per_param == 4
