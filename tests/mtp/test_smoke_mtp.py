"""Notebook 03's invariants on its smoke run: what must hold at any size (equalities, exactness), not speed."""
import pytest

from decodelab.common.goals import OPS

pytestmark = pytest.mark.slow

NAME = "mtp"  # the notebook whose smoke run the `metrics` fixture reads (tests/conftest.py)

GRAD_TOLERANCE = 1e-5  # max |g_sequential - g_joint|: float32 summation-order noise, nothing more
STATED_GOALS = {"step_time_ratio", "peak_mem_ratio", "retrofit_head2_acceptance_gloeckle",
                "retrofit_head2_acceptance_deepseek", "retrofit_speedup_b1_gloeckle", "retrofit_speedup_b1_deepseek",
                "retrofit_tau_3_positions", "self_spec_greedy_identical", "module_pos1_acceptance_code_edit",
                "module_speedup_b1_code_edit", "module_tau_3_positions", "module_train_seconds"}


def test_one_head_loss_equals_next_token_loss_on_smoke(metrics):
    assert metrics["one_head_loss_abs_diff"] == 0.0


def test_sequential_backward_gradients_equal_joint_on_smoke(metrics):
    diff = metrics["grad_check_max_abs_diff"]
    assert isinstance(diff, float) and 0.0 <= diff <= GRAD_TOLERANCE
    assert metrics["grad_check_tolerance"] <= GRAD_TOLERANCE  # the notebook states no looser tolerance


def test_retrofit_frozen_weights_bit_identical_on_smoke(metrics):
    assert metrics["retrofit_frozen_bit_identical"] is True


def test_self_speculative_greedy_equals_plain_on_smoke(metrics):
    rows = metrics["self_spec"]
    assert rows and all(row["greedy_match"] is True and row["rows_identical"] == row["batch"] for row in rows)
    decoded = sum(row["batch"] for row in rows)
    assert metrics["self_spec_rows_identical"] == [decoded, decoded]
    assert metrics["self_spec_greedy_match"] is True


def test_generic_loop_with_mtp_drafter_equals_plain_greedy_on_smoke(metrics):
    assert metrics["generic_loop"] and metrics["generic_loop_greedy_match"] is True


def test_goal_rows_cover_the_stated_goals_and_judge_them_on_smoke(metrics):
    rows = {row["name"]: row for row in metrics["goals"]}
    assert STATED_GOALS <= set(rows)
    for row in rows.values():
        assert {"value", "target", "op", "met", "status"} <= set(row)
        expected = None if row["value"] is None else OPS[row["op"]](row["value"], row["target"])
        assert row["met"] == expected, row["name"]
    assert rows["step_time_ratio"]["value"] == metrics["step_time_ratio"]
    assert rows["self_spec_greedy_identical"]["value"] is True


def test_retrofit_is_reported_by_its_new_heads_on_smoke(metrics):
    assert "retrofit_val_loss" not in metrics
    frozen = metrics["frozen_next_token_val_loss"]
    assert set(metrics["retrofit"]) == set(frozen["configs"])
    for entry in metrics["retrofit"].values():
        assert 0.0 <= entry["head_2_accuracy"] <= 1.0
        assert entry["head_loss"][0] == frozen["mean"]  # head 1 is the frozen model's own, shared
        assert all(d["tau"] >= 1.0 and d["greedy_match"] is True for d in entry["draft"])
    assert metrics["retrofit"]["retrofit-gloeckle-2"]["draft"]


def test_self_spec_caption_counts_the_identical_rows_on_smoke(smoke_runs, metrics):
    import json

    captions = json.loads((smoke_runs("mtp") / "figures" / "captions.json").read_text())
    same, total = metrics["self_spec_rows_identical"]
    assert f"{same}/{total} decoded rows identical" in captions["self_spec_tau"]


def test_shipped_module_keeps_next_token_logits_and_greedy_output_on_smoke(metrics, params):
    assert metrics["retrofit_module_frozen_logits_identical"] is True
    rows = metrics["retrofit_module_drafting"]
    assert {row["drafter"] for row in rows} == {"mtp", "ngram", "layer_skip"}
    assert all(row["greedy_match"] is True and row["tau"] >= 1.0 for row in rows)
    assert all(row["rows_identical"] == row["rows"] for row in rows)
    # batch 1 decodes draft_batch1_prompts prompts one at a time; larger batches decode their rows together
    assert all(row["rows"] == (params["draft_batch1_prompts"] if row["batch"] == 1 else row["batch"]) for row in rows)
    assert metrics["retrofit_module_greedy_match"] is True
    for row in rows:  # the part-vocabulary drafter says how much of plain greedy's output it could draft
        if row["drafter"] == "mtp" and params["draft_vocab"] is not None:
            assert 0 < row["vocab_coverage"] <= 1
        else:
            assert row["vocab_coverage"] in (None, 1.0)
    module = metrics["retrofit_module"]
    assert module["source"] == "shipped" and module["problems"] == []  # the shipped record matches the default spec


def test_the_acceptance_goal_reads_the_untimed_sample_with_its_interval_on_smoke(metrics, params):
    sample = metrics["retrofit_module_acceptance"]
    assert sample["prompts"] == params["acceptance_prompts"] and sample["k"] == params["draft_k"]
    reached, accepted = [r[0] for r in sample["reached"]], [a[0] for a in sample["accepted"]]
    assert sum(reached) > 0 and sample["acceptance"][0] == sum(accepted) / sum(reached)  # counts pooled, not rates
    low, high = sample["ci"][0]
    assert 0 <= low <= sample["acceptance"][0] <= high <= 1
    goal = next(g for g in metrics["goals"] if g["name"] == "module_pos1_acceptance_code_edit")
    assert goal["value"] == sample["acceptance"][0] and f"{sum(reached)} judged drafts" in goal["note"]


def test_training_cost_is_measured_at_the_cost_size_with_the_whole_training_state_on_smoke(smoke_runs, metrics,
                                                                                          params):
    import pandas as pd

    at = metrics["cost_measured_at"]
    assert (at["d_model"], at["n_layers"], at["seq_len"], at["batch_size"], at["n_heads"]) == (
        params["cost_d_model"], params["cost_n_layers"], params["cost_seq_len"], params["cost_batch_size"],
        params["cost_n_heads"])
    rows = pd.read_csv(smoke_runs(NAME) / "tables" / "training_cost.csv")
    assert (rows.total_peak_bytes == rows.state_bytes + rows.peak_bytes).all()
    assert (rows.peak_bytes >= 4 * rows.params).all()  # the float32 gradient buffers each step allocates
    assert metrics["flop_ratio"] > 1.0
    assert metrics["peak_mem_ratio"] == rows.total_peak_bytes[1] / rows.total_peak_bytes[0]
