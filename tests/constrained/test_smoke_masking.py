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
