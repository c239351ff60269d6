"""Notebook 04's helpers moved out of the notebook and out of masks.py: seeds, metrics, goals, findings."""
import hashlib

import pytest

from decodelab.common.seeding import row_seed
from decodelab.constrained import mask_cost as MC
from decodelab.constrained import study as S
from decodelab.constrained.constraint import Constraint, ConstraintError
from decodelab.constrained.jump_forward_study import jump_forward_goal, jump_forward_metrics
from decodelab.constrained.summary import findings_markdown
from decodelab.workloads.constrained import schema_problem


def old_row_seed(seed, unit, sample):
    """The formula constrained.study.row_seed used before it became common.seeding.row_seed."""
    digest = hashlib.sha256(f"decodelab-constrained-{seed}-{unit}-{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@pytest.mark.parametrize("seed,unit,sample", [(0, "answer_confidence", 0), (3, "contact_card", 15), (12345, "x", 7)])
def test_row_seed_of_the_constrained_stream_is_bit_identical_to_the_old_formula(seed, unit, sample):
    assert row_seed(seed, unit, sample, stream=S.SEED_STREAM) == old_row_seed(seed, unit, sample)


def test_masks_module_re_exports_the_new_homes():
    from decodelab.constrained import bitmask, constraint, engines, masks

    assert masks.Constraint is constraint.Constraint and masks.apply_bitmask is bitmask.apply_bitmask
    assert masks.make_engine is engines.make_engine and masks.BatchMasker is engines.BatchMasker


def test_schema_problem_is_the_one_check_of_constraints_and_schema_files():
    assert schema_problem({"type": "string"}) is None
    assert "malformed" in schema_problem({"type": "no-such-type"}, "m")
    assert "must be a JSON object" in schema_problem(3)
    assert "not valid JSON" in schema_problem("{")
    with pytest.raises(ConstraintError, match="schema m is malformed"):
        Constraint.json({"type": "no-such-type"}, name="m")


def test_validity_metrics_and_goals_read_the_summary_rows():
    rows = [{"engine": "unconstrained", "validity_rate": 0.5, "truncated_rate": 0.25, "finished": 2},
            {"engine": "xgrammar", "validity_rate": 1.0, "truncated_rate": 0.0, "finished": 4}]
    study = {"truncated": {"unconstrained": 1, "xgrammar": 0}, "unsupported": {"xgrammar": 0}}
    metrics = S.validity_metrics(study, rows)
    assert list(metrics) == ["validity_rate", "truncated", "unsupported", "truncated_rate", "finished"]
    assert metrics["validity_rate"] == {"unconstrained": 0.5, "xgrammar": 1.0}
    assert metrics["finished"] == {"unconstrained": 2, "xgrammar": 4}
    [xg, ll] = S.validity_goals(rows, ["xgrammar", "llguidance"])
    assert xg.name == "masked_validity_xgrammar" and xg.met is True and ll.met is None


def cost(engine, us, trajectory="compact", schema="s"):
    return [{"engine": engine, "schema": schema, "trajectory": trajectory, "step": step, "us": t}
            for step, t in enumerate(us)]


def test_mask_cost_metrics_and_goals():
    rows = cost("naive", [5000.0]) + cost("xgrammar", [10.0] + [1.0] * 9)
    steps = {1: [2e-4, 1e-4, 3e-4], 16: [4e-4, 6e-4]}
    overhead = MC.mask_overhead_summary(rows, steps, {1: 1e-6, 16: 2e-6})
    slowdowns = MC.naive_slowdowns(rows, ["xgrammar"])
    metrics = MC.mask_cost_metrics(overhead, steps, slowdowns, ["xgrammar"])
    assert list(metrics) == ["mask_fill_us", "mask_overhead_mean", "mask_overhead_p50", "mask_overhead_p99",
                             "naive_slowdown", "naive_slowdown_vs", "decode_step_ms"]
    assert metrics["naive_slowdown"] == pytest.approx(500.0) and metrics["naive_slowdown_vs"] == slowdowns
    assert metrics["mask_overhead_mean"]["b16"]["xgrammar"] == MC.overhead_of(overhead, "xgrammar", 16)
    assert metrics["decode_step_ms"]["b1"] == pytest.approx({"min": 0.1, "median": 0.2, "max": 0.3})
    assert metrics["decode_step_ms"]["b16"]["median"] == pytest.approx(0.5)
    goals = MC.mask_cost_goals(overhead, slowdowns, ["xgrammar"], [1, 16])
    assert [g.name for g in goals] == ["mask_overhead_xgrammar_b1", "mask_overhead_xgrammar_b16",
                                       "naive_slowdown_vs_xgrammar"]
    assert goals[-1].met is True


def test_replay_outputs_takes_the_first_engine_with_a_valid_output():
    constraint = Constraint.json({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    items = [{"name": "s", "constraint": constraint}, {"name": "t", "constraint": constraint}]
    samples = {("s", "xgrammar"): {"objects": [], "texts": ['{"a"']},
               ("s", "llguidance"): {"objects": [{"a": 1}], "texts": ['{"a', '{"a":1}']},
               ("t", "xgrammar"): {"objects": [], "texts": []}, ("t", "llguidance"): {"objects": [], "texts": []}}
    assert MC.replay_outputs(items, samples, ["xgrammar", "llguidance"]) == {"s": '{"a":1}'}


class CountingMatcher:
    def __init__(self, accept_until):
        self.accept_until, self.fills, self.accepted = accept_until, 0, 0

    def fill(self, bitmask, row=0):
        self.fills += 1

    def accept(self, token):
        self.accepted += 1
        return self.accepted < self.accept_until


class FakeEngine:
    vocab_size = 40

    def __init__(self, matcher):
        self.made = matcher

    def matcher(self, compiled):
        return self.made


def test_replay_mask_times_times_one_fill_per_token_and_stops_at_a_rejection():
    matcher = CountingMatcher(accept_until=3)
    times = MC.replay_mask_times(FakeEngine(matcher), None, [1, 2, 3, 4, 5])
    assert len(times) == 3 == matcher.fills and all(t >= 0 for t in times)
    assert len(MC.replay_mask_times(FakeEngine(CountingMatcher(99)), None, [1, 2, 3, 4], max_steps=2)) == 2


def test_jump_forward_metrics_and_goal():
    summary = {"schemas": 2, "saved_frac": {"tokens": 0.3, "retokenize": 0.55},
               "changed": {"tokens": 0, "retokenize": 1}, "changed_tokens": {"tokens": 0, "retokenize": 2},
               "valid": {}, "greedy_identical": True}
    metrics = jump_forward_metrics(summary, "xgrammar")
    assert list(metrics) == ["jump_forward_saved_frac_tokens", "jump_forward_saved_frac_retokenize",
                             "jump_forward_outputs_changed", "jump_forward_tokens_changed", "jump_forward_schemas",
                             "jump_forward_engine", "jump_forward_greedy_identical"]
    assert metrics["jump_forward_engine"] == "xgrammar" and metrics["jump_forward_tokens_changed"]["retokenize"] == 2
    goal = jump_forward_goal(summary)
    assert goal.met is True and goal.target == 0.30 and "the tokens of 2 of 2 outputs" in goal.note
    assert jump_forward_goal({**summary, "saved_frac": {}}).met is None


def test_findings_name_every_experiment():
    distortion = [{"task": "a", "kl_masked": 0.1, "tv_masked": 0.2, "kl_masked_canonical": 0.01},
                  {"task": "b", "kl_masked": 0.3, "tv_masked": 0.4, "kl_masked_canonical": 0.02}]
    corrected = [{"task": t, "method": m, "forward_passes": f, "kl": k}
                 for t in "ab" for m, k in (("masked", 0.1), ("smc", 0.01)) for f in (10, 100)]
    validity = [{"engine": "xgrammar", "validity_rate": 1.0, "valid": 4, "finished": 4, "truncated": 0, "n": 4}]
    overhead = [{"engine": "xgrammar", "trajectory": "compact", "mean_us": 10.0, "p50_us": 5.0, "p99_us": 50.0},
                {"engine": "xgrammar", "trajectory": "indented", "mean_us": 99.0, "p50_us": 9.0, "p99_us": 99.0}]
    jf = {"schemas": 1, "saved_frac": {"tokens": 0.4}, "changed": {}, "changed_tokens": {}, "greedy_identical": True}
    lines = findings_markdown([jump_forward_goal(jf)], distortion, corrected, validity, overhead, jf)
    assert len(lines) == 6 and lines[0].startswith("**")
    assert "largest: `b`" in lines[1] and "smc 0.01, masked 0.1 nats" in lines[2]
    assert "(4/4; 0 of 4 truncated)" in lines[3]
    assert lines[4].endswith("xgrammar 10 / 5 / 50 µs.")  # the compact trajectory only
