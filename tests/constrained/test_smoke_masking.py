"""Notebook 04's invariants on its smoke run: values that must hold at any size, never speed goals."""
import math

import pytest

from decodelab.common import goals

pytestmark = pytest.mark.slow

NAME = "masking"


def test_every_finished_masked_output_validates_under_every_engine_on_smoke(metrics, params):
    engines = [e for e in params["engines"] if e != "naive"]
    rates = metrics["validity_rate"]
    assert engines and set(engines) <= set(rates), (engines, rates)
    assert all(rates[e] == 1.0 for e in engines), rates
    assert all(metrics["finished"][e] >= 1 for e in engines), metrics["finished"]  # a rate over nothing proves nothing


def test_exact_jump_forward_greedy_output_equals_plain_masked_greedy_on_smoke(metrics):
    assert metrics["jump_forward_schemas"] >= 1
    assert metrics["jump_forward_greedy_identical"] is True
    assert metrics["jump_forward_outputs_changed"]["tokens"] == 0
    assert metrics["jump_forward_outputs_changed"]["draft"] == 0  # the verified draft keeps greedy output too
    assert metrics["jump_forward_tokens_changed"]["draft"] == 0


def test_kl_and_tv_values_lie_in_their_ranges_on_smoke(metrics):
    for key in ("kl_masked", "kl_masked_canonical", "kl_canonical_target"):
        assert metrics[key], key
        assert all(v is not None and 0 <= v < math.inf for v in metrics[key].values()), (key, metrics[key])
    assert all(0 <= v <= 1 for v in metrics["tv_masked"].values()), metrics["tv_masked"]
    assert metrics["corrected"] and all(row["kl"] >= 0 for row in metrics["corrected"])


def test_goal_rows_cover_every_stated_goal_on_smoke(metrics, params):
    rows = goals.from_rows(metrics["goals"])
    names = {g.name for g in rows}
    engines = [e for e in params["engines"] if e != "naive"]
    expected = {f"mask_overhead_{e}_b{b}" for e in engines for b in params["overhead_batch_sizes"]}
    expected |= {"naive_slowdown_vs_xgrammar", "jump_forward_saved_exact"} | {f"masked_validity_{e}" for e in engines}
    assert expected <= names, expected - names
    for g in rows:
        assert g.met is None if g.value is None else g.met in (True, False), g
    validity = [g for g in rows if g.name.startswith("masked_validity_")]
    assert all(g.met is True for g in validity), validity


def test_free_then_constrained_answers_all_validate_on_smoke(metrics, params):
    assert metrics["crane_validity"]["crane"] == 1.0, metrics["crane_validity"]
    assert metrics["crane_validity"]["constrained"] == 1.0, metrics["crane_validity"]
    assert set(metrics["crane_accuracy"]) == {"free", "constrained", "crane"}
    assert metrics["crane_tokens"]["constrained"] < metrics["crane_tokens"]["crane"]  # reasoning costs tokens
    names = {g["name"] for g in metrics["goals"]}
    assert {"crane_validity", "crane_vs_constrained_accuracy", "crane_vs_free_accuracy"} <= names, names


def test_awrs_rows_are_timed_and_check_far_fewer_tokens_than_a_mask_on_smoke(metrics, params):
    ops = metrics["corrector_ops_s"]
    assert set(ops) == {"forward", "softmax", "draw", "cdf", "awrs_draw", "mask", "check"}, ops
    assert all(v > 0 for v in ops.values()), ops
    per_token = metrics["checks_per_token"]
    assert 1 <= per_token["awrs"] < 1000 and per_token["awrs_smc"] > per_token["awrs"], per_token  # + weight draws
    assert per_token["masked"] == 0 and per_token["rejection"] == 1, per_token
    assert per_token["awrs_twist"] < per_token["awrs_smc"], per_token  # the known branch asks no grammar check
    names = {g["name"] for g in metrics["goals"]}
    assert {"awrs_kl_at_masking_cost", "awrs_checks_per_token"} <= names, names


def test_the_goal_pair_runs_to_the_goal_budget_and_the_other_correctors_to_theirs(metrics, params):
    top = {}
    for row in metrics["corrected"]:
        top[row["method"]] = max(top.get(row["method"], 0), row["forward_passes"])
    for method, passes in top.items():
        budget = params["goal_forward_passes"] if method in ("masked", "awrs_twist") else params["max_forward_passes"]
        assert budget <= passes < budget * 1.2, (method, passes, budget)  # a run that crosses the budget finishes
