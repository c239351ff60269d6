"""Notebook 05's invariants on its smoke run: values that must hold at any size (not speed goals)."""
import json

import pytest

pytestmark = pytest.mark.slow

NAME = "consistency"


def _params(smoke_runs) -> dict:
    return json.loads((smoke_runs(NAME) / "params.json").read_text(encoding="utf-8"))


def test_shared_equals_unshared_greedy_and_sampled_on_smoke(smoke_runs):
    metrics = smoke_runs.metrics(NAME)
    detail = metrics["shared_equals_unshared_detail"]
    assert detail["greedy_equal"] is True and detail["sampled_equal"] is True
    assert metrics["shared_equals_unshared"] is True
    assert detail["rows"] == 2 * _params(smoke_runs)["check_n"]  # two prompts x check_n samples


def test_vote_counts_add_up_on_smoke(smoke_runs):
    import pandas as pd

    params, metrics = _params(smoke_runs), smoke_runs.metrics(NAME)
    n = max(params["n_values"])
    votes = metrics["votes_full_pool"]
    assert len(votes) == params["n_problems"] and metrics["pool_size"] == n
    assert all(v["answered"] + v["no_answer"] == v["n_samples"] == n for v in votes)
    # The saved samples table agrees: n samples per problem, the same no-answer count per problem.
    samples = pd.read_csv(smoke_runs(NAME) / "tables" / "samples.csv")
    assert samples.groupby("problem").size().tolist() == [n] * params["n_problems"]
    assert samples.answer.isna().groupby(samples.problem).sum().tolist() == [v["no_answer"] for v in votes]


def test_goal_rows_present_and_judged_on_smoke(smoke_runs):
    from decodelab.common import goals

    metrics = smoke_runs.metrics(NAME)
    rows = {g.name: g for g in goals.from_rows(metrics["goals"])}
    assert {"speedup_vs_hf", "kv_ratio_vs_hf_measured", "adaptive_samples_saved",
            "adaptive_accuracy_change"} <= set(rows)
    for goal in rows.values():  # met is what value op target says, or None when not measured
        want = None if goal.value is None else goals.OPS[goal.op](goal.value, goal.target)
        assert goal.met == want
    assert rows["speedup_vs_hf"].value == pytest.approx(metrics["speedup_vs_hf"])
    assert rows["kv_ratio_vs_hf_measured"].value == pytest.approx(metrics["kv_ratio_vs_hf_measured"])
    assert "shared_equals_unshared" not in rows  # an invariant, not a goal


def test_measured_kv_bytes_match_each_cache_layout_on_smoke(smoke_runs):
    # At any size: the shared cache holds P + n*new positions (= the analytic count), ours unshared n*(P + new),
    # transformers' DynamicCache n*(P + new - 1) (the last sampled token is never forwarded).
    import pandas as pd

    cost = pd.read_csv(smoke_runs(NAME) / "tables" / "cost.csv")
    assert len(cost) and (cost.cache_bytes > 0).all()
    for row in cost.itertuples():
        if row.method in ("shared", "unshared"):
            assert row.cache_bytes == row.kv_bytes_analytic
        else:
            length = row.prompt_len + row.new_tokens
            assert row.cache_bytes * length == row.kv_bytes_analytic * (length - 1)
    assert (cost.seconds <= cost.seconds_max).all() and (cost.repeats == _params(smoke_runs)["cost_repeats"]).all()


def test_deepconf_online_run_equals_its_replay_on_smoke(smoke_runs):
    params, metrics = _params(smoke_runs), smoke_runs.metrics(NAME)
    check = metrics["deepconf_online_check"]
    assert check["equal_to_replay"] is True
    assert check["rows"] == check["problems"] * max(params["n_values"])
    assert check["tokens"] <= check["tokens_unstopped"]


def test_deepconf_rows_sit_beside_the_other_rules_on_smoke(smoke_runs):
    params, metrics = _params(smoke_runs), smoke_runs.metrics(NAME)
    early = metrics["early_stop"]
    assert early[0]["method"] == "majority" and early[0]["tokens_saved"] == 0
    online = [r for r in early if r["method"] == "deepconf_online"]
    assert len(online) == len(params["confidence_keep"])
    assert all(r["mean_tokens"] <= early[0]["mean_tokens"] for r in online)  # stopping never adds tokens
    votes = {r["vote"] for r in metrics["accuracy_vs_n"]}
    assert {"majority", "weighted", "confidence"} | {f"conf_top{k:g}" for k in params["confidence_keep"]} == votes
    names = {g["name"] for g in metrics["goals"]}
    assert {"deepconf_tokens_saved", "deepconf_accuracy_change", "sc16_vs_one_sample",
            "sc16_vs_one_sample_early_stop", "sc64_vs_one_sample"} <= names


def test_sc_vs_one_sample_rows_on_smoke(smoke_runs):
    params, metrics = _params(smoke_runs), smoke_runs.metrics(NAME)
    rows = metrics["sc_vs_one_sample"]
    assert [r["n"] for r in rows] == params["sc_n_values"]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["seconds"] / row["one_sample_seconds"])
        assert row["prompt_len"] == max(params["prompt_lengths"]) and row["new_tokens"] == params["cost_new_tokens"]
    gpu = metrics["sc_gpu_roofline"]
    assert [r["n"] for r in gpu] == params["sc_n_values"] and gpu[0]["gpu_ratio"] == pytest.approx(1.0)
