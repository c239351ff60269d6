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


@pytest.mark.parametrize("handoff", CR.HANDOFFS)
@pytest.mark.parametrize("delimiter", [None, "e"])  # at EOS / the budget, or after a common letter
def test_free_then_constrained_answer_always_validates(tok, setup, delimiter, handoff):
    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems])
    sampler = Sampler(SamplerConfig(temperature=1.0))
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    replies = CR.answer_problems(model, tok, prompts, "crane", engine, constraint, reasoning_budget=12,
                                 delimiter=delimiter, handoff=handoff, sampler=sampler, generator=gens)
    forced = CR.handoff_ids(tok, handoff)
    for reply in replies:
        assert reply.finished and reply.valid, reply
        assert isinstance(json.loads(reply.answer_text)["answer"], int)
        assert reply.answer == json.loads(reply.answer_text)["answer"]
        assert reply.text.endswith(reply.answer_text)
        draft = tok.decode(reply.draft, skip_special_tokens=True)
        assert reply.text.startswith(draft) and len(reply.draft) <= 12
        if delimiter and delimiter in draft:  # the draft ends right after the cue's first appearance
            assert draft.index(delimiter) + len(delimiter) >= len(draft) - 8
        assert reply.tokens <= 12 + len(forced) + CR.ANSWER_TOKENS
        middle = reply.text[len(draft): len(reply.text) - len(reply.answer_text)]
        assert middle == tok.decode(forced, skip_special_tokens=True)  # the handoff, then the JSON
    if delimiter == "e":
        assert any("e" in tok.decode(r.draft) for r in replies)  # the cue path ran


def test_turn_handoff_closes_the_assistant_turn_and_asks_for_json(tok):
    forced = tok.decode(CR.handoff_ids(tok, "turn"))
    assert forced.startswith(tok.eos_token) and CR.FOLLOW_UP in forced
    assert forced.endswith("assistant\n")
    assert CR.handoff_ids(tok, "none") == [] and tok.decode(CR.handoff_ids(tok, "line")) == "\n"
    with pytest.raises(ValueError, match="handoff='paragraph'.*turn"):
        CR.handoff_ids(tok, "paragraph")


def test_crane_draft_is_the_free_reply_token_for_token(tok, setup):
    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems])
    free = CR.answer_problems(model, tok, prompts, "free", engine, constraint, reasoning_budget=10)
    crane = CR.answer_problems(model, tok, prompts, "crane", engine, constraint, reasoning_budget=10)
    for f, c in zip(free, crane):
        assert c.draft == f.draft and c.draft_finished == f.draft_finished
        derived = CR.free_reply(tok, c.draft, c.draft_finished)
        assert (derived.text, derived.answer, derived.valid, derived.tokens) == (f.text, f.answer, f.valid, f.tokens)


def test_study_reads_free_rows_from_the_crane_drafts(tok, setup):
    model, engine, problems, _ = setup
    rows = CS.crane_study(model, tok, problems[:3], engine, answer_schema=None, reasoning_budget=6)
    by = {(r["mode"], r["problem"]): r for r in rows}
    assert [r["mode"] for r in rows] == [m for m in CR.MODES for _ in range(3)]
    for p in problems[:3]:
        assert by[("crane", p.id)]["text"].startswith(by[("free", p.id)]["text"])
        assert by[("crane", p.id)]["valid"] and by[("constrained", p.id)]["valid"]
    differ = CS.disagreements(rows)
    assert {d["problem"] for d in differ} == {p.id for p in problems[:3]
                                             if by[("free", p.id)]["answer"] != by[("crane", p.id)]["answer"]}


def test_constrained_mode_is_json_from_the_first_token_and_free_mode_is_unmasked(tok, setup):
    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems])
    strict = CR.answer_problems(model, tok, prompts, "constrained", engine, constraint, reasoning_budget=4)
    assert all(r.valid and r.text == r.answer_text for r in strict)
    free = CR.answer_problems(model, tok, prompts, "free", engine, constraint, reasoning_budget=4)
    assert all(r.tokens <= 4 for r in free)
    assert not all(r.valid for r in free)  # a random model does not write "The answer is N" by chance


@pytest.mark.parametrize("spacing", CR.SPACINGS)
def test_every_spacing_answer_validates_against_the_schema(tok, setup, spacing):
    import jsonschema

    model, engine, problems, prompts = setup
    constraint = CR.answer_constraint(None, [p.answer for p in problems], spacing=spacing)
    assert constraint.kind == ("regex" if spacing == "space" else "json")
    replies = CR.answer_problems(model, tok, prompts, "crane", engine, constraint, reasoning_budget=6)
    for r in replies:
        if spacing != "flexible":  # flexible whitespace may not close within ANSWER_TOKENS
            assert r.finished and r.valid, r
        if r.valid:
            jsonschema.validate(json.loads(r.answer_text), CR.ANSWER_SCHEMA)
    with pytest.raises(ValueError, match="spacing='loose'"):
        CR.answer_constraint(None, [1], spacing="loose")


def test_integer_field_pattern_is_the_schemas_language_with_one_optional_space():
    import re

    import jsonschema

    pattern = re.compile(CR.integer_field_pattern(CR.ANSWER_SCHEMA))
    for n in (0, 7, -7, 42, 999_999, -999_999):
        for text in (json.dumps({"answer": n}, separators=(",", ":")), json.dumps({"answer": n})):
            assert pattern.fullmatch(text), text
    for text in ('{"answer":1000000}', '{"answer":-1000000}', '{"answer":05}', '{"answer":-0}', '{"answer":  5}',
                 '{"answer":5.0}', '{ "answer":5}', '{"answer":5} '):
        assert not pattern.fullmatch(text), text
    small = {**CR.ANSWER_SCHEMA, "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}}}
    assert re.compile(CR.integer_field_pattern(small)).fullmatch('{"answer": 99}')
    assert not re.compile(CR.integer_field_pattern(small)).fullmatch('{"answer":-1}')
    jsonschema.validate({"answer": 99}, small)
    odd = {**CR.ANSWER_SCHEMA, "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}}}
    assert CR.integer_field_pattern(odd) is None  # not a digit-count range: the schema's own JSON grammar
    assert CR.answer_constraint(odd, [1], spacing="space").kind == "json"


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
    assert CR.answer_constraint(None, answers, spacing="compact").spec == CR.ANSWER_SCHEMA
    assert CR.answer_constraint(None, answers).pattern == CR.integer_field_pattern(CR.ANSWER_SCHEMA)


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
    assert "disagree on 0 of 20 problems" in goals["crane_vs_free_accuracy"].note


def test_disagreement_upper_bound_is_the_exact_binomial_bound():
    # 0 of n: solve (1 - u)^n = 0.05, the "rule of three" u ~ 3/n
    assert CS.disagreement_upper_bound(0, 60) == pytest.approx(1 - 0.05 ** (1 / 60), rel=1e-9)
    assert CS.disagreement_upper_bound(0, 60) < CS.disagreement_upper_bound(1, 60) < CS.disagreement_upper_bound(1, 20)
    assert CS.disagreement_upper_bound(5, 5) == 1.0


def test_crane_line_counts_the_answers_the_json_field_changed():
    from decodelab.constrained.summary import crane_line

    rows = []
    for i in range(10):
        free = i + 1 if i < 6 else -1
        crane = free if i not in (2, 8) else 0  # problem 2: the draft was right; 8: both wrong, different answers
        rows += [{"problem": i, "mode": "free", "correct": free == i + 1, "valid": True, "tokens": 30,
                  "answer": free, "truth": i + 1, "text": "t"},
                 {"problem": i, "mode": "constrained", "correct": False, "valid": True, "tokens": 8,
                  "answer": 0, "truth": i + 1, "text": "t"},
                 {"problem": i, "mode": "crane", "correct": crane == i + 1, "valid": True, "tokens": 38,
                  "answer": crane, "truth": i + 1, "text": "t"}]
    summary = CS.crane_summary(rows)
    assert [d["problem"] for d in summary["disagreements"]] == [2, 8]
    assert "another answer than its own free draft in 2 of 10 problems (1 where the draft was right)" in \
        crane_line(summary)
    assert CS.crane_metrics(summary)["crane_disagreements"] == 2
