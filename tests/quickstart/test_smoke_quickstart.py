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


def test_every_throughput_row_names_its_dtype_and_the_memory_fraction_is_recorded_on_smoke(metrics, params):
    dtypes = {r["dtype"] for r in metrics["throughput"]}
    assert dtypes == set(params["dtypes"] or ["float32"])  # the cpu default dtype without a sweep
    assert set(metrics["memory_fraction_b1"]) == dtypes and all(v > 0 for v in metrics["memory_fraction_b1"].values())
    assert all(v > 0 for v in metrics["bandwidth_GBps"].values())
    for row in metrics["throughput_by_dtype"]:
        assert row["ours_flop_per_byte"] > 0 and row["ours_step_ms"] > 0


def test_verify_table_pads_each_width_up_never_down_on_smoke(metrics, params):
    rows = metrics["verify_widths"]
    assert [r["tokens"] for r in rows] == list(range(1, params["verify_max_width"] + 1))
    assert all(r["tokens"] <= r["width"] <= params["verify_max_width"] for r in rows)
    by_name = {row["name"]: row for row in metrics["goals"]}
    assert by_name["verify_worst_dip"]["value"] == pytest.approx(metrics["verify_worst_dip"])
