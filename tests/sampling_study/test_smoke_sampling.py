"""Invariants of notebook 02's smoke run (sampling) that must hold at any size: every verdict row is an
interval around its estimate, an inconclusive one says what the sample could have detected, the goal
rows are complete, and the paired design's check rows equal their references row for row."""
import pytest

from decodelab.common import goals

pytestmark = pytest.mark.slow

NAME = "sampling"  # the notebook whose smoke run the `metrics` fixture reads (tests/conftest.py)
GOALS = {"main_verdict_half_width", "greedy_accuracy_floor", "greedy_accuracy_ceiling", "sampler_cost_ratio"}


def test_every_verdict_row_carries_an_interval_around_its_estimate(metrics):
    rows = metrics["verdict"]
    assert rows, "the smoke run wrote no verdict rows"
    for row in rows:
        if row["finding"] == "not measured":  # a frontier interval that could not be computed
            assert row["lo"] is None and row["hi"] is None
            continue
        assert row["lo"] <= row["estimate"] <= row["hi"], row
        assert row["half_width"] == pytest.approx((row["hi"] - row["lo"]) / 2)
        assert row["finding"] == ("a > b" if row["lo"] > 0 else "a < b" if row["hi"] < 0 else "inconclusive")
        assert row["holds"] is (row["lo"] > 0)


def test_every_inconclusive_verdict_carries_a_minimum_detectable_difference(metrics):
    for row in metrics["verdict"]:
        if row["finding"] == "inconclusive":
            assert isinstance(row["mdd"], float) and row["mdd"] >= 0, row


def test_main_verdicts_are_structured_and_summarized(metrics):
    main = [row for row in metrics["verdict"] if row["main"]]
    assert main, "no verdict is marked main"
    temperatures = set(metrics["units"]["main_temperatures"])
    assert {row["key"]["temperature"] for row in main} == temperatures
    assert {row["key"]["kind"] for row in main} <= {"tuned", "paper_settings"}
    assert metrics["verdict_summary"].startswith(f"Of {len(main)} main verdicts")


def test_goal_rows_have_value_target_and_met(metrics):
    rows = {row["name"]: row for row in metrics["goals"]}
    assert GOALS <= set(rows)
    for row in goals.from_rows(metrics["goals"]):
        assert row.target is not None and row.op in goals.OPS
        assert row.met is (None if row.value is None else bool(goals.OPS[row.op](row.value, row.target)))
    widest = max(max(w for w in (r["half_width"], r["normal_half_width"]) if w is not None)
                 for r in metrics["verdict"] if r["main"] and r["half_width"] is not None)
    assert rows["main_verdict_half_width"]["value"] == pytest.approx(widest)


def test_check_rows_equal_plain_sampling_and_greedy_row_for_row(metrics):
    """The common random numbers hold in the run itself: top_p=1 rows are plain temperature sampling on
    the same uniforms, min_p=1 rows are greedy."""
    checks = metrics["crn_check"]
    assert len(checks) == 2
    for check in checks:
        assert check["n_rows"] > 0 and check["fraction_identical"] == 1.0, check
