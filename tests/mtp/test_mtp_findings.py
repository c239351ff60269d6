"""Notebook 03's generated text and retrofit report: every figure comes from the numbers given."""
import pytest

from decodelab.common.goals import Goal
from decodelab.mtp import findings as mtp_findings


def result(name, head_loss, head_accuracy, block_loss=(1.0, 2.0, 3.0)):
    return {"name": name, "eval": {"head_loss": list(head_loss), "head_accuracy": list(head_accuracy),
                                   "val_block_loss": list(block_loss)}}


def draft(model, batch, tau=1.5, acceptance=(0.5,), speedup=1.1, same=None):
    same = batch if same is None else same
    return {"model": model, "batch": batch, "heads": 2, "tau": tau, "acceptance": list(acceptance),
            "speedup": speedup, "greedy_match": same == batch, "rows_identical": same}


def test_retrofit_report_carries_the_new_heads_accuracy_and_drafting_rows_only():
    results = [result("retrofit-gloeckle-2", [3.0, 9.0], [0.4, 0.12])]
    rows = [draft("retrofit-gloeckle-2", 1, tau=1.3), draft("retrofit-gloeckle-2", 8, tau=1.4), draft("gloeckle-2", 1)]
    report = mtp_findings.retrofit_report(results, rows)
    entry = report["retrofit-gloeckle-2"]
    assert entry["head_2_accuracy"] == 0.12
    assert [d["batch"] for d in entry["draft"]] == [1, 8]
    table = mtp_findings.retrofit_table(report)
    assert table[0]["head_2_accuracy"] == 0.12 and table[0]["draft_batch"] == 8 and table[0]["tau"] == 1.4
    assert "val_loss" not in table[0] and "head_1_loss" not in table[0]


def test_frozen_next_token_loss_is_the_shared_head_1_loss_and_refuses_disagreement():
    same = [result("a", [3.0, 9.0], [0.4, 0.1]), result("b", [3.0, 7.0], [0.4, 0.2])]
    frozen = mtp_findings.frozen_next_token_loss(same, model="smol")
    assert frozen["mean"] == 3.0 and frozen["model"] == "smol" and frozen["configs"] == ["a", "b"]
    assert mtp_findings.frozen_next_token_loss([]) is None
    with pytest.raises(ValueError, match="trunk changed"):
        mtp_findings.frozen_next_token_loss([result("a", [3.0, 9.0], [0.4, 0.1]), result("b", [3.1, 9.0], [0.4, 0.1])])


def test_draft_value_reads_the_largest_batch_or_the_one_asked_and_none_when_absent():
    rows = [draft("m", 1, speedup=0.9, acceptance=(0.3,)), draft("m", 8, speedup=1.2, acceptance=(0.6,))]
    assert mtp_findings.draft_value(rows, "m", "acceptance", position=0) == 0.6
    assert mtp_findings.draft_value(rows, "m", "speedup", batch=1) == 0.9
    assert mtp_findings.draft_value(rows, "m", "speedup", batch=4) is None
    assert mtp_findings.draft_value(rows, "other", "tau") is None
    assert mtp_findings.draft_value([draft("m", 2, acceptance=(float("nan"),))], "m", "acceptance", position=0) is None


def test_identical_rows_counts_decoded_rows_not_benchmark_rows():
    assert mtp_findings.identical_rows([draft("a", 2), draft("b", 8, same=7)]) == (9, 10)


def metrics(**overrides):
    base = {
        "step_time_ratio": 1.25, "step_time_ratio_joint": 1.5, "peak_mem_ratio": 1.1, "peak_mem_ratio_joint": 1.9,
        "cost_measured_at": {"n_heads": 4, "d_model": 64, "n_layers": 4, "batch_size": 16, "seq_len": 128,
                             "vocab_size": 1024, "device": "cpu", "repeats": 3},
        "grad_check_max_abs_diff": 2e-8, "one_head_loss_abs_diff": 0.0,
        "val_loss": {"ntp": {"mean": 3.0, "ci95": [2.9, 3.1]}, "gloeckle-2": {"mean": 3.5, "ci95": [3.4, 3.6]}},
        "self_spec": [draft("gloeckle-2", 1, tau=1.6, speedup=0.8),
                      draft("gloeckle-2", 8, tau=1.7, speedup=1.3, same=7)],
        "self_spec_rows_identical": [8, 9],
        "retrofit": {"retrofit-gloeckle-2": {"head_2_accuracy": 0.12, "draft": [
            {"batch": 8, "tau": 1.2, "acceptance": [0.21], "speedup": 0.7, "greedy_match": True}]}},
        "frozen_next_token_val_loss": {"model": "smol", "mean": 2.7, "ci95": [2.5, 2.9]},
        "retrofit_frozen_bit_identical": True,
    }
    return {**base, **overrides}


def test_summary_states_the_numbers_it_is_given():
    rows = [Goal.check("step_time_ratio", 1.25, "<=", 1.3, unit="x"),
            Goal.check("retrofit_head2_acceptance", 0.21, ">=", 0.6, unit="%", label="head-2 acceptance")]
    text = "\n".join(mtp_findings.summary(metrics(), rows, scratch_params={"min": 250_000, "max": 260_000}))
    assert "1 of 2 goals met" in text and "head-2 acceptance: 21%" in text
    assert "costs 1.25x" in text and "(1.50x joint)" in text and "1.10x its peak memory" in text
    assert "8/9 decoded rows identical" in text
    assert "gloeckle-2: main-head validation loss 3.500" in text and "do not overlap" in text
    assert "head 2 top-1 accuracy 12%" in text and "acceptance 21%" in text
    assert "frozen smol's own next-token validation loss is 2.700" in text
    assert "250,000-260,000 parameters" in text


def test_summary_changes_with_the_numbers():
    rows = [Goal.check("step_time_ratio", 2.0, "<=", 1.3, unit="x")]
    text = "\n".join(mtp_findings.summary(metrics(step_time_ratio=2.0, self_spec_rows_identical=[9, 9],
                                                  grad_check_max_abs_diff=0.5), rows))
    assert "0 of 1 goals met" in text and "costs 2.00x" in text and "9/9 decoded rows identical" in text
    assert "OUTSIDE the tolerance" in text


def test_summary_of_overlapping_intervals_claims_no_difference():
    close = {"ntp": {"mean": 3.0, "ci95": [2.8, 3.2]}, "gloeckle-2": {"mean": 3.1, "ci95": [2.9, 3.3]}}
    text = "\n".join(mtp_findings.summary(metrics(val_loss=close), []))
    assert "intervals overlap: no difference shown" in text
