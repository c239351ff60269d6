"""Reason then constrain: the answer after free reasoning always validates; errors come before generation."""
import json

import pytest
import torch

from decodelab.constrained import crane as CR
from decodelab.constrained import crane_study as CS
from decodelab.constrained import masks as M
from decodelab.core.models import resolve_model_path, tiny_model
from decodelab.core.sampling import Sampler, SamplerConfig
from decodelab.workloads.tasks import arithmetic_prompt, make_arithmetic


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def setup(tok):
    model = tiny_model(seed=3, vocab_size=49152, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=64)
    engine = M.XGrammarEngine(tok, stop_token_ids=[tok.eos_token_id])
    problems = make_arithmetic(6, seed=0, difficulty=2)
    prompts = [arithmetic_prompt(p, tok) for p in problems]
    return model, engine, problems, prompts


@pytest.mark.parametrize("delimiter", [None, "e"])  # at EOS / the budget, or after a common letter
def test_free_then_constrained_answer_always_validates(tok, setup, delimiter):
    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems])
    sampler = Sampler(SamplerConfig(temperature=1.0))
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    replies = CR.answer_problems(model, tok, prompts, "crane", engine, constraint, reasoning_budget=12,
                                 delimiter=delimiter, sampler=sampler, generator=gens)
    for reply in replies:
        assert reply.finished and reply.valid, reply
        assert isinstance(json.loads(reply.answer_text)["answer"], int)
        assert reply.answer == json.loads(reply.answer_text)["answer"]
        reasoning = reply.text[: len(reply.text) - len(reply.answer_text)]
        assert reply.text.endswith(reply.answer_text)
        if delimiter and delimiter in reasoning:  # the grammar starts right after the cue's first appearance
            assert reasoning.index(delimiter) + len(delimiter) >= len(reasoning) - 8
        assert reply.tokens <= 12 + CR.ANSWER_TOKENS
    if delimiter == "e":
        assert any("e" in r.text[: len(r.text) - len(r.answer_text)] for r in replies)  # the cue path ran


def test_constrained_mode_is_json_from_the_first_token_and_free_mode_is_unmasked(tok, setup):
    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems])
    strict = CR.answer_problems(model, tok, prompts, "constrained", engine, constraint, reasoning_budget=4)
    assert all(r.valid and r.text == r.answer_text for r in strict)
    free = CR.answer_problems(model, tok, prompts, "free", engine, constraint, reasoning_budget=4)
    assert all(r.tokens <= 4 + CR.ANSWER_TOKENS for r in free)
    assert not all(r.valid for r in free)  # a random model does not write "The answer is N" by chance


def test_answer_schema_that_cannot_hold_the_answers_is_a_clear_error():
    answers = [p.answer for p in make_arithmetic(10, seed=0, difficulty=2)]
    small = {"type": "object", "properties": {"answer": {"type": "integer", "maximum": 3}}, "required": ["answer"]}
    with pytest.raises(ValueError, match=r"answer_schema=.*cannot hold the task answer.*allowed"):
        CR.answer_constraint(small, answers)
    with pytest.raises(ValueError, match="answer_schema"):
        CR.answer_constraint({"type": "object", "properties": {"result": {"type": "integer"}},
                              "required": ["result"]}, answers)
    with pytest.raises(ValueError, match="schema"):
        CR.answer_constraint({"type": "nonsense"}, answers)
    assert CR.answer_constraint(None, answers).spec == CR.ANSWER_SCHEMA


def test_bad_mode_and_budget_are_errors(tok, setup):
    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems])
    with pytest.raises(ValueError, match="mode='loose'.*free"):
        CR.answer_problems(model, tok, prompts, "loose", engine, constraint, reasoning_budget=4)
    with pytest.raises(ValueError, match="reasoning_budget=0"):
        CR.answer_problems(model, tok, prompts, "crane", engine, constraint, reasoning_budget=0)


def test_summary_pairs_modes_on_the_same_problems_and_goals_read_ci_bounds():
    rows = []
    for i in range(20):
        rows += [{"problem": i, "mode": "free", "correct": i % 2 == 0, "valid": True, "tokens": 40},
                 {"problem": i, "mode": "constrained", "correct": i % 5 == 0, "valid": True, "tokens": 6},
                 {"problem": i, "mode": "crane", "correct": i % 2 == 0, "valid": True, "tokens": 46}]
    summary = CS.crane_summary(rows)
    acc = {m["mode"]: m["accuracy"] for m in summary["modes"]}
    assert acc == {"free": 0.5, "constrained": 0.2, "crane": 0.5}
    d = summary["differences"]
    assert d["crane_minus_free"]["difference"] == 0 and d["crane_minus_free"]["ci_low"] == 0  # identical pairs
    assert d["crane_minus_constrained"]["difference"] == pytest.approx(0.3)
    goals = {g.name: g for g in CS.crane_goals(summary)}
    assert goals["crane_validity"].met is True
    assert goals["crane_vs_free_accuracy"].met is True
    assert goals["crane_vs_constrained_accuracy"].value == d["crane_minus_constrained"]["ci_low"]
