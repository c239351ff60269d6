"""Notebook 06's invariants on its smoke run: values that must hold at any size (not speed goals)."""
import math

import pytest

pytestmark = pytest.mark.slow

NAME = "reuse"


def _queries(smoke_runs):
    import pandas as pd

    return pd.read_csv(smoke_runs(NAME) / "tables" / "queries.csv")


def test_lossless_methods_keep_greedy_output_identical_on_smoke(metrics):
    identical = metrics["lossless_identical"]
    assert metrics["lossless_all_identical"] is True and identical and all(v == 1.0 for v in identical.values())
    kinds = {key.split("[")[0].split("@")[0] for key in identical}
    assert {"prompt_ngram", "trace_draft", "trace_draft_subst", "shared_prefix", "plain"} <= kinds
    assert any(key.startswith("step_reuse") for key in identical)  # the smoke profile's threshold 1 is lossless


def test_every_query_served_once_per_method_and_counts_add_up_on_smoke(smoke_runs, params):
    queries = _queries(smoke_runs)
    per = queries.groupby(["method", "batch_size"]).query.apply(sorted)
    assert all(list(q) == list(range(params["n_queries"])) for q in per)
    assert (queries.new_tokens <= params["max_new_tokens"]).all() and (queries.forwards >= 1).all()
    # one target-chosen token per forward (the last may be cut at the budget); the rest were copied
    assert ((queries.forwards <= queries.new_tokens + 1) & (queries.reused_tokens >= 0)).all()
    assert (queries.trace_tokens <= queries.reused_tokens + 1).all()
    plain = queries[queries.kind == "plain"].set_index(["batch_size", "query"]).forwards
    for kind in ("prompt_ngram", "trace_draft", "trace_draft_subst"):  # speculation never needs more forwards
        rows = queries[queries.kind == kind].set_index(["batch_size", "query"]).forwards
        assert (rows <= plain.loc[rows.index]).all()
    first = queries[queries["query"] == 0]
    assert not first.hit.any() and first.similarity.isna().all()  # the cache starts empty


def test_method_table_pairs_against_plain_on_smoke(metrics, params):
    rows = metrics["methods"]
    plain = [r for r in rows if r["kind"] == "plain"]
    assert {r["batch_size"] for r in plain} == set(params["batch_sizes"])
    for r in plain:
        assert r["target_token_cut"] == 1.0 and r["accuracy_change"] == 0.0 and r["identical_to_plain"] == 1.0
    for r in rows:
        assert r["queries"] == params["n_queries"] - params["warmup"]
        assert r["change_ci_low"] <= r["accuracy_change"] <= r["change_ci_high"]
        assert 0 <= r["hit_rate"] <= 1
    assert metrics["shared_prefix"]["B=1"]["prefix_tokens"] > 0


def test_hit_curve_falls_with_the_threshold_on_smoke(metrics):
    curve = metrics["hit_curve"]
    assert curve
    for key in {r["retrieval"] for r in curve}:
        rows = sorted((r for r in curve if r["retrieval"] == key), key=lambda r: r["threshold"])
        rates = [r["hit_rate"] for r in rows]
        assert all(a >= b for a, b in zip(rates, rates[1:]))
        assert math.isclose(rates[0], 1.0) or rows[0]["threshold"] > 0  # similarity >= 0 always hits


def test_goal_rows_present_and_judged_on_smoke(metrics):
    from decodelab.common import goals

    rows = {g.name: g for g in goals.from_rows(metrics["goals"])}
    assert {"trace_draft_speedup_vs_plain", "trace_draft_speedup_vs_prompt_ngram", "target_token_cut",
            "target_token_cut_moonshot", "amortization_ratio"} <= set(rows)
    for goal in rows.values():  # met is what value op target says, or None when not measured
        want = None if goal.value is None else goals.OPS[goal.op](goal.value, goal.target)
        assert goal.met == want
    assert rows["target_token_cut_moonshot"].moonshot is True
    assert rows["amortization_ratio"].value == pytest.approx(metrics["amortization_ratio"])
    assert "lossless_all_identical" not in rows  # an invariant, not a goal


def test_amortization_starts_at_the_cold_start_and_families_are_reported_on_smoke(smoke_runs, metrics, params):
    import pandas as pd

    curve = pd.read_csv(smoke_runs(NAME) / "tables" / "amortization.csv")
    assert metrics["amortization_cost"] == "target forwards" and not curve.empty
    assert (curve[curve.position == 1].window_cost == 1.0).all()  # the first query is served with an empty cache
    assert (curve.forwards >= 1).all() and (curve.cold_forwards >= 1).all()
    if metrics["amortization_ratio"] is not None:
        assert metrics["amortization_ratios"][metrics["amortization_method"]] == metrics["amortization_ratio"]
    by_family = metrics["plain_accuracy_by_family"]
    assert set(by_family) == set(params["families"]) and all(0 <= v <= 1 for v in by_family.values())
