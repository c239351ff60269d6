"""Goal rows: met computed from value/op/target, missing values are 'not measured', rows round-trip."""
import math

import pytest

from decodelab.common import goals
from decodelab.common.goals import Goal
from decodelab.suite import runs


def test_met_follows_the_comparison():
    assert Goal.check("a", 1.8, ">=", 1.7).met is True
    assert Goal.check("a", 1.6, ">=", 1.7).met is False
    assert Goal.check("b", 0.26, "<=", 0.15).met is False
    assert Goal.check("c", 0.97, ">", 0.97).met is False


def test_missing_or_nan_value_is_not_measured_not_met():
    for value in (None, float("nan"), math.inf):
        goal = Goal.check("a", value, ">=", 1.0)
        assert goal.met is None and goal.status == "not measured" and goal.value is None


def test_unknown_op_or_unit_is_rejected():
    with pytest.raises(ValueError, match="op="):
        Goal.check("a", 1, "=>", 1)
    with pytest.raises(ValueError, match="unit="):
        Goal.check("a", 1, ">=", 1, unit="furlongs")


def test_rows_round_trip_and_merge_by_name(tmp_path):
    run = runs.Run("quickstart", tmp_path)
    run.log_goals([Goal.check("a", 1.0, ">=", 2.0), Goal.check("b", 3.0, "<=", 4.0, ci=(2.0, 3.5), estimate=2.8)])
    back = run.log_goals([Goal.check("a", 2.5, ">=", 2.0)])
    assert [g.name for g in back] == ["a", "b"]
    assert back[0].met is True and back[1].ci == (2.0, 3.5)
    rows = run.metrics["goals"]
    assert all({"name", "value", "target", "op", "met", "status"} <= set(r) for r in rows)


def test_log_goals_rejects_bare_numbers(tmp_path):
    with pytest.raises(TypeError, match="Goal rows"):
        runs.Run("quickstart", tmp_path).log_goals([{"a": 1.0}])


def test_headline_names_unmet_and_unmeasured_goals():
    rows = [Goal.check("a", 1.8, ">=", 1.7, label="speedup", unit="x"),
            Goal.check("b", 0.26, "<=", 0.15, label="roofline error", unit="%"),
            Goal.check("c", None, ">=", 1.0, label="batch 64")]
    text = goals.headline(rows)
    assert text.startswith("1 of 3 goals met")
    assert "roofline error: 26% (target <= 15%)" in text and "not measured: batch 64" in text


def test_from_rows_rejects_rows_without_the_goal_fields():
    with pytest.raises(ValueError, match="lacks"):
        goals.from_rows([{"name": "a", "value": 1}])


def test_a_value_just_past_its_target_never_prints_as_the_target():
    goal = Goal.check("err", 0.1504, "<=", 0.15, label="roofline error", unit="%")
    assert goal.met is False and "15.04% (target <= 15%)" in goal.describe()
    assert goals.table([goal])[0]["value"] == "15.04%"
    assert "1.70001x" in Goal.check("s", 1.700009, ">", 1.7, unit="x").describe()
    assert goals.table([Goal.check("s", 1.7, ">=", 1.7, unit="x")])[0]["value"] == "1.7x"
