"""Constrained decoding: every output validates, jump-forward keeps greedy output, errors come first."""
import json

import pytest
import torch

from decodelab.constrained import decode as C
from decodelab.constrained import mask_cost as MC
from decodelab.constrained import masks as M
from decodelab.constrained import study as S
from decodelab.constrained.jump_forward_study import saved_fraction
from decodelab.core.models import resolve_model_path, tiny_model
from decodelab.core.sampling import Sampler, SamplerConfig
from decodelab.workloads.constrained import load_schemas, load_tasks
from decodelab.workloads.prompts import user_prompt_ids

SUITE = load_schemas()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def engines(tok):
    return {"xgrammar": M.XGrammarEngine(tok), "llguidance": M.LLGuidanceEngine(tok)}


@pytest.fixture(scope="module")
def tiny49k():
    """A random 2-layer Llama over the embedded tokenizer's 49,152-token vocabulary."""
    return tiny_model(seed=3, vocab_size=49152, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64)


def random_walk(engine, constraint, generator, max_tokens=400):
    """Sample from random logits under the mask until the grammar ends -> token ids."""
    masker = M.BatchMasker(engine, [engine.compile(constraint)])
    tokens = []
    while not masker.matchers[0].is_terminated() and len(tokens) < max_tokens:
        logits = masker.apply(torch.randn(1, engine.vocab_size, generator=generator) * 3)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert masker.accept([token]) == [True]
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("entry", SUITE, ids=[e["name"] for e in SUITE])
def test_random_logits_outputs_validate_against_schema(engines, tok, engine_name, entry):
    import jsonschema

    engine = engines[engine_name]
    constraint = M.Constraint.json(entry["schema"], name=entry["name"])
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = random_walk(engine, constraint, generator)
        assert tokens[-1] == tok.eos_token_id, "the grammar did not end within the token budget"
        jsonschema.validate(json.loads(tok.decode(tokens[:-1])), entry["schema"])


def test_random_logits_outputs_match_regex(engines, tok):
    constraint = M.Constraint.regex(r"(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
    generator = torch.Generator().manual_seed(1)
    for name in ("xgrammar", "llguidance"):
        for _ in range(5):
            tokens = random_walk(engines[name], constraint, generator)
            assert C.validate_output(constraint, tok.decode(tokens[:-1]))


def test_sampled_generate_outputs_all_validate(engines, tok, tiny49k):
    entry = SUITE[0]
    constraint = M.Constraint.json(entry["schema"], name=entry["name"])
    res = C.generate(tiny49k, [user_prompt_ids(tok, entry["prompt"])] * 4, constraint, engines["xgrammar"],
                     max_new_tokens=120, sampler=Sampler(SamplerConfig(temperature=1.0)),
                     generator=torch.Generator().manual_seed(0), tokenizer=tok)
    assert all(res.finished) and all(res.valid)


@pytest.mark.parametrize("mode", ["tokens", "draft"])
@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_greedy_with_exact_jump_forward_equals_greedy_without(engines, tok, tiny49k, engine_name, mode):
    items = S.schema_items([e for e in SUITE if e["fixed_keys"]][:3], tok)
    for item in items:
        off = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines[engine_name], max_new_tokens=120)
        jf = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines[engine_name], max_new_tokens=120,
                        jump_forward=mode, tokenizer=tok)
        assert jf.tokens == off.tokens
        assert jf.forward_passes + jf.jumped_tokens == off.forward_passes


@pytest.mark.parametrize("mode", ["tokens", "draft"])
def test_batched_jump_forward_rows_equal_single_row_runs(engines, tok, tiny49k, mode):
    items = S.schema_items(SUITE[:2], tok)
    batch = C.generate(tiny49k, [i["prompt"] for i in items], [i["constraint"] for i in items], engines["xgrammar"],
                       max_new_tokens=120, jump_forward=mode, tokenizer=tok)
    for row, item in enumerate(items):
        single = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines["xgrammar"], max_new_tokens=120)
        assert batch.tokens[row] == single.tokens[0]


def test_draft_jump_forward_refuses_a_sampler(engines, tok, tiny49k):
    item = S.schema_items(SUITE[:1], tok)[0]
    with pytest.raises(ValueError, match="jump_forward='draft'.*greedy"):
        C.generate(tiny49k, [item["prompt"]], item["constraint"], engines["xgrammar"], max_new_tokens=8,
                   jump_forward="draft", sampler=Sampler(SamplerConfig(temperature=1.0)), tokenizer=tok)


def test_retokenize_jump_forward_outputs_validate_and_save_passes(engines, tok, tiny49k):
    from decodelab.constrained.jump_forward_study import jump_forward_savings

    items = S.schema_items([e for e in SUITE if e["fixed_keys"]][:3], tok)
    rows = jump_forward_savings(tiny49k, tok, engines["xgrammar"], items, max_new_tokens=120)
    assert all(r["valid"] for r in rows)
    assert all(r["same_tokens"] for r in rows if r["mode"] == "tokens")
    assert saved_fraction(rows, "retokenize") > 0


def test_unsatisfiable_schema_raises_before_generation(engines, tok):
    class Exploding:
        transformer = None

        def __getattr__(self, name):
            raise AssertionError("the model was used before the constraint was checked")

    with pytest.raises(M.ConstraintError):
        C.generate(Exploding(), [[1, 2]], M.Constraint.json({"enum": []}), engines["xgrammar"])


def test_engine_that_cannot_compile_reports_unsupported(engines, tok):
    item = S.schema_items(SUITE[:1], tok)[0]
    item["constraint"] = M.Constraint.json({"type": "integer", "minimum": 5, "maximum": 3})
    out = S.sample_schema(None, tok, item, engines["llguidance"], n_samples=2, sampler=None, seed=0)
    assert out["unsupported"] and out["n"] == 0


def test_field_two_sample_identical_samples_have_zero_tv():
    schema = SUITE[2]["schema"]
    objs = [{"city": "Oslo", "temperature_c": 3, "condition": "snowy", "windy": True}] * 5
    rows = S.field_two_sample(schema, objs, objs, permutations=20)
    assert all(r["tv"] == 0 for r in rows)


def test_extract_json_finds_object_in_prose():
    assert S.extract_json('Sure! ```json\n{"a": 1}\n```') == {"a": 1}
    assert S.extract_json("no json here") is None


def test_rows_with_their_own_generators_do_not_depend_on_the_batch(engines, tok, tiny49k):
    items = S.schema_items(SUITE[:3], tok)
    sampler = Sampler(SamplerConfig(temperature=1.0))
    seeds = [11, 12, 13]
    batch = C.generate(tiny49k, [i["prompt"] for i in items], [i["constraint"] for i in items], engines["llguidance"],
                       max_new_tokens=40, sampler=sampler, generator=[torch.Generator().manual_seed(s) for s in seeds])
    for row, (item, seed) in enumerate(zip(items, seeds)):
        single = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines["llguidance"], max_new_tokens=40,
                            sampler=sampler, generator=[torch.Generator().manual_seed(seed)])
        assert batch.tokens[row] == single.tokens[0]


def test_outputs_cut_by_max_new_tokens_count_as_truncated_not_invalid(engines, tok, tiny49k):
    items = S.schema_items(SUITE[:2], tok)
    outs = S.sample_schemas(tiny49k, tok, items, engines["xgrammar"], n_samples=3,
                            sampler=Sampler(SamplerConfig(temperature=1.0)), seed=0, max_new_tokens=3)
    assert all(o["n"] == 3 and o["truncated"] == 3 and o["valid"] == 0 for o in outs)


def test_truncated_outputs_leave_the_denominator_for_masked_and_unconstrained_alike():
    # The same counts under a mask and without one must give the same rate: one rule for both.
    counts = {"n": 10, "valid": 4, "truncated": 2, "unsupported": False}
    rows = [{"engine": e, **counts} for e in ("xgrammar", "unconstrained")]
    summary = {r["engine"]: r for r in S.validity_summary(rows)}
    assert summary["xgrammar"]["validity_rate"] == summary["unconstrained"]["validity_rate"] == 4 / 8
    assert summary["xgrammar"]["truncated_rate"] == summary["unconstrained"]["truncated_rate"] == 2 / 10
    assert summary["unconstrained"]["finished"] == 8
    assert S.validity_rates(rows) == {"xgrammar": 0.5, "unconstrained": 0.5}


def test_validity_rate_is_not_measured_when_nothing_finished_and_skips_unsupported_schemas():
    rows = [{"engine": "xgrammar", "n": 3, "valid": 0, "truncated": 3, "unsupported": False},
            {"engine": "llguidance", "n": 4, "valid": 2, "truncated": 2, "unsupported": False},
            {"engine": "llguidance", "n": 0, "valid": 0, "truncated": 0, "unsupported": True}]
    rates = S.validity_rates(rows)
    assert rates["llguidance"] == 1.0 and rates["xgrammar"] is None  # nothing finished: not measured


def test_first_object_closed_only_when_the_first_brace_parses():
    assert C._first_object_closed('Sure: {"a": {"b": 1}} and more')
    assert not C._first_object_closed('{"a": {"b": 1}')
    assert not C._first_object_closed("no braces }")


# ---------------------------------------------------------------- schema files (issue 12)

def write_json(path, value):
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def test_user_schemas_file_is_used_whole_when_no_names_are_given(tmp_path):
    path = write_json(tmp_path / "mine.json", [{"type": "object", "title": "a"}, {"type": "string"}])
    assert [e["name"] for e in load_schemas(path)] == ["a", "schema_1"]
    assert [e["name"] for e in load_schemas(path, ["schema_1"])] == ["schema_1"]


def test_unknown_schema_name_error_names_the_value_and_the_files_schemas(tmp_path):
    path = write_json(tmp_path / "mine.json", [{"name": "x", "schema": {"type": "string"}}])
    with pytest.raises(ValueError) as error:
        load_schemas(path, ["answer_confidence"])
    message = str(error.value)
    assert "answer_confidence" in message and "['x']" in message and "mine.json" in message


@pytest.mark.parametrize("names", [[], "x", [1]])
def test_schema_selection_that_is_not_a_list_of_names_is_rejected(tmp_path, names):
    path = write_json(tmp_path / "mine.json", [{"name": "x", "schema": {"type": "string"}}])
    with pytest.raises(ValueError, match="schemas="):
        load_schemas(path, names)


def test_missing_or_malformed_schemas_file_fails_with_the_value_named(tmp_path):
    with pytest.raises(ValueError, match="schemas_file='nowhere.json' is not a file"):
        load_schemas("nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{", encoding="utf-8")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_schemas(bad)
    malformed = write_json(tmp_path / "malformed.json", [{"name": "m", "schema": {"type": "no-such-type"}}])
    with pytest.raises(ValueError, match="'m'"):
        load_schemas(malformed)
    twice = write_json(tmp_path / "twice.json", [{"name": "d", "schema": {}}, {"name": "d", "schema": {}}])
    with pytest.raises(ValueError, match="unique"):
        load_schemas(twice)


def test_relative_schemas_file_resolves_from_the_repository_root(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # as under the runner: the working directory is not the root
    assert [e["name"] for e in load_schemas("notebooks/params/masking/smoke_schemas.json")] == ["answer_confidence"]


def test_smoke_schema_and_task_files_are_copies_of_shipped_entries():
    shipped = {e["name"]: e for e in load_schemas()}
    for entry in load_schemas("notebooks/params/masking/smoke_schemas.json"):
        assert entry == shipped[entry["name"]]
    tasks = {t["name"]: t for t in load_tasks()}
    for task in load_tasks("notebooks/params/masking/smoke_tasks.json"):
        assert task == tasks[task["name"]]


# ---------------------------------------------------------------- mask cost summary

def cost(engine, us, trajectory="compact", schema="s"):
    return [{"engine": engine, "schema": schema, "trajectory": trajectory, "step": step, "us": t}
            for step, t in enumerate(us)]


def test_mask_overhead_is_judged_on_the_mean_fill_with_p50_and_p99_beside_it():
    # 99 fast fills and one slow one: the p50 says 1 us, the mean (what a generation pays) 10.9 us.
    rows = cost("xgrammar", [1.0] * 99 + [991.0])
    step = {1: [2e-4, 1e-4, 3e-4], 16: [4e-4]}  # the fastest timed step is the reference
    apply = {1: 1e-6, 16: 2e-6}
    [summary] = MC.mask_overhead_summary(rows, step, apply)
    assert summary["fills"] == 100 and summary["p50_us"] == 1.0
    assert summary["mean_us"] == pytest.approx(10.9)
    assert summary["p99_us"] == pytest.approx(1.0 + 0.01 * 990)  # linear interpolation between ranks 98 and 99
    assert summary["overhead_b1_mean"] == pytest.approx((10.9e-6 + 1e-6) / 1e-4)
    assert summary["overhead_b1_p50"] == pytest.approx((1e-6 + 1e-6) / 1e-4)
    assert summary["overhead_b16_mean"] == pytest.approx((16 * 10.9e-6 + 2e-6) / 4e-4)
    assert summary["step_b1_ms"] == pytest.approx(0.1)
    assert MC.overhead_of([summary], "xgrammar", 1) == summary["overhead_b1_mean"]
    assert MC.overhead_of([summary], "llguidance", 1) is None


def test_overhead_goal_fails_on_a_slow_mean_even_when_the_p50_passes():
    rows = cost("xgrammar", [1.0] * 99 + [991.0])
    summary = MC.mask_overhead_summary(rows, {1: [1e-4]}, {1: 0.0})
    goal = MC.overhead_goal(summary, "xgrammar", 1, target=0.05)
    assert summary[0]["overhead_b1_p50"] <= 0.05 < goal.value
    assert goal.met is False and goal.op == "<=" and "p50" in goal.note and "p99" in goal.note
    assert MC.overhead_goal(summary, "llguidance", 1, target=0.05).met is None  # not measured


def test_naive_slowdown_compares_the_same_grammar_states_only():
    # naive times only step 0; xgrammar's step 0 costs 10 us and its later steps 1 us.
    rows = cost("naive", [5000.0]) + cost("xgrammar", [10.0] + [1.0] * 9)
    assert MC.naive_slowdown(rows) == pytest.approx(500.0)
    assert MC.naive_slowdown(cost("xgrammar", [1.0])) is None


# ---------------------------------------------------------------- jump-forward summary

def test_jump_forward_summary_credits_each_mode_and_counts_changed_outputs():
    from decodelab.constrained.jump_forward_study import jump_forward_summary

    def row(schema, mode, passes, same):
        return {"schema": schema, "mode": mode, "forward_passes": passes, "new_tokens": 10, "jumped_tokens": 0,
                "same_tokens": same, "same_text": same, "valid": True}

    rows = [row("a", "off", 10, True), row("a", "tokens", 8, True), row("a", "retokenize", 4, False),
            row("b", "off", 10, True), row("b", "tokens", 6, True), row("b", "retokenize", 5, True)]
    summary = jump_forward_summary(rows)
    assert summary["saved_frac"] == {"tokens": pytest.approx(0.3), "retokenize": pytest.approx(0.55)}
    assert summary["changed"] == {"tokens": 0, "retokenize": 1} and summary["schemas"] == 2
    assert summary["greedy_identical"] is True
    rows[1]["same_tokens"] = False
    assert jump_forward_summary(rows)["greedy_identical"] is False
    assert jump_forward_summary([])["greedy_identical"] is None


@pytest.mark.parametrize("profile", ["smoke", "cpu", "gpu"])
def test_user_schemas_file_on_top_of_a_profile_runs_every_schema_of_that_file(tmp_path, profile):
    from decodelab.suite import runner

    path = write_json(tmp_path / "mine.json", [{"name": "p", "schema": {"type": "string"}},
                                               {"name": "q", "schema": {"type": "integer"}}])
    _, _, merged = runner.prepare("masking", profile, {"schemas_file": str(path)})
    assert [e["name"] for e in load_schemas(merged["schemas_file"], merged["schemas"])] == ["p", "q"]
    _, _, merged = runner.prepare("masking", profile, {"schemas_file": str(path), "schemas": ["q"]})
    assert [e["name"] for e in load_schemas(merged["schemas_file"], merged["schemas"])] == ["q"]
