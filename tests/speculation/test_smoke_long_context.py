"""Notebook 01's long-context section on its smoke run: invariants at any size (never speed goals)."""
import math

import pytest

pytestmark = pytest.mark.slow
NAME = "speculation"


def test_every_long_context_cell_is_measured_and_exact(metrics, params):
    rows = metrics["long_context"]
    cells = {(r["context"], r["batch"], r["drafter"]) for r in rows}
    want = {(c, b, d) for c in params["long_contexts"] for b in params["long_batches"] for d in params["long_drafters"]}
    assert cells == want and len(rows) == len(want)
    for r in rows:
        assert r["matches_plain"] is True, r
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0, r
        if params["long_repeats"] < 2:  # one round has no spread to build an interval from
            assert r["speedup_low"] is None and r["speedup_high"] is None, r
        else:
            centre = math.exp(sum(map(math.log, r["ratios"])) / len(r["ratios"]))
            assert r["speedup_low"] <= centre <= r["speedup_high"], r
        assert len(r["ratios"]) == params["long_repeats"], r
        assert r["tau"] >= 1.0 and r["k"] == params["long_k"], r
        assert r["verify_ratio"] >= 1.0 and 0.0 <= r["attention_share"] < 1.0, r


def test_long_context_goal_rows_are_logged(metrics, params):
    goals = {g["name"]: g for g in metrics["goals"]}
    for name in ("long_context_speedup_b16", "long_context_speedup_grows", "long_context_exact"):
        g = goals[name]
        assert {"value", "target", "op", "met", "status"} <= set(g), g
        assert g["met"] is None if g["value"] is None else isinstance(g["met"], bool), g
    assert goals["long_context_exact"]["met"] is True
    if max(params["long_contexts"]) < 2048:  # the speed goals are judged at >= 2k tokens only
        assert goals["long_context_speedup_b16"]["value"] is None


def test_gpu_prediction_covers_every_hardware_model_and_context(metrics, params):
    cross = metrics["long_context_gpu_crossovers"]
    models = {c["model"] for c in cross}
    assert models == {"8B", "70B"}
    assert {c["context"] for c in cross} == set(params["long_gpu_contexts"])
    assert len(cross) == len(params["gpu_hardware"]) * 2 * len(params["long_gpu_contexts"])
    for c in cross:
        assert c["crossover"] is None or 1 <= c["crossover"] <= c["max_batch"], c
    assert 0 <= metrics["long_context_sparse_alpha"] < 1


def test_long_context_roofline_error_is_recorded_held_out_and_in_sample(metrics):
    for key in ("long_context_roofline_heldout_error", "long_context_roofline_insample_error"):
        value = metrics[key]
        assert value is None or (math.isfinite(value) and value >= 0), key
    assert metrics["long_context_roofline_insample_error"] is not None  # every cell has a fit in sample
