"""Notebook 00's invariants on its smoke run: values that must hold at any size, never speed goals."""
import pytest

pytestmark = pytest.mark.slow

NAME = "quickstart"


def test_greedy_rows_of_our_engine_equal_hf_generate_on_smoke(metrics):
    assert metrics["greedy_match"] is True


def test_every_throughput_row_is_identical_on_both_sides_on_smoke(metrics, params):
    rows = metrics["throughput"]
    expected = {(batch, impl) for batch in params["batch_sizes"] for impl in ("ours", "hf")}
    assert {(r["batch"], r["impl"]) for r in rows} == expected
    for r in rows:
        assert r["rows"] == r["batch"] and r["identical_rows"] == r["rows"], r


def test_both_sides_decode_every_token_with_eos_off_on_smoke(metrics, params):
    for r in metrics["throughput"]:
        assert r["new_tokens"] == r["batch"] * params["max_new_tokens"], r


def test_throughput_table_keeps_the_columns_the_readme_reads_on_smoke(smoke_runs):
    import pandas as pd

    table = pd.read_csv(smoke_runs(NAME) / "tables" / "throughput.csv")
    assert {"batch", "impl", "tokens_per_s", "seconds", "new_tokens", "identical_rows", "rows"} <= set(table.columns)


def test_goal_rows_state_one_speed_goal_per_batch_and_the_identity_goal_on_smoke(metrics, params):
    by_name = {row["name"]: row for row in metrics["goals"]}
    for batch in params["batch_sizes"]:
        row = by_name[f"ours_over_hf_b{batch}"]
        assert (row["op"], row["target"], row["unit"]) == (">=", 1.0, "x")
        assert row["value"] == pytest.approx(metrics["ours_over_hf"][str(batch)])
        assert row["met"] == (row["value"] >= 1.0)
    identity = by_name["identical_greedy_rows"]
    assert (identity["value"], identity["op"], identity["target"], identity["met"]) == (True, "==", True, True)
