"""Constrained decoding: every output validates, jump-forward keeps greedy output, errors come first."""
import json

import pytest
import torch

from decodelab import constrained as C
from decodelab import masks as M
from decodelab.distortion import chat_prompt
from decodelab.jump_forward import saved_fraction
from decodelab.models import resolve_model_path, tiny_model
from decodelab.sampling import Sampler, SamplerConfig

SUITE = C.load_schemas()


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
    res = C.generate(tiny49k, [chat_prompt(tok, entry["prompt"])] * 4, constraint, engines["xgrammar"],
                     max_new_tokens=120, sampler=Sampler(SamplerConfig(temperature=1.0)),
                     generator=torch.Generator().manual_seed(0), tokenizer=tok)
    assert all(res.finished) and all(res.valid)


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_greedy_with_token_jump_forward_equals_greedy_without(engines, tok, tiny49k, engine_name):
    items = C.schema_items([e for e in SUITE if e["fixed_keys"]][:3], tok)
    for item in items:
        off = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines[engine_name], max_new_tokens=120)
        jf = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines[engine_name], max_new_tokens=120,
                        jump_forward="tokens")
        assert jf.tokens == off.tokens
        assert jf.forward_passes + jf.jumped_tokens == off.forward_passes


def test_batched_jump_forward_rows_equal_single_row_runs(engines, tok, tiny49k):
    items = C.schema_items(SUITE[:2], tok)
    batch = C.generate(tiny49k, [i["prompt"] for i in items], [i["constraint"] for i in items], engines["xgrammar"],
                       max_new_tokens=120, jump_forward="tokens")
    for row, item in enumerate(items):
        single = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines["xgrammar"], max_new_tokens=120)
        assert batch.tokens[row] == single.tokens[0]


def test_retokenize_jump_forward_outputs_validate_and_save_passes(engines, tok, tiny49k):
    from decodelab.jump_forward import jump_forward_savings

    items = C.schema_items([e for e in SUITE if e["fixed_keys"]][:3], tok)
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
    item = C.schema_items(SUITE[:1], tok)[0]
    item["constraint"] = M.Constraint.json({"type": "integer", "minimum": 5, "maximum": 3})
    out = C.sample_schema(None, tok, item, engines["llguidance"], n_samples=2, sampler=None, seed=0)
    assert out["unsupported"] and out["n"] == 0


def test_field_two_sample_identical_samples_have_zero_tv():
    schema = SUITE[2]["schema"]
    objs = [{"city": "Oslo", "temperature_c": 3, "condition": "snowy", "windy": True}] * 5
    rows = C.field_two_sample(schema, objs, objs, permutations=20)
    assert all(r["tv"] == 0 for r in rows)


def test_extract_json_finds_object_in_prose():
    assert C.extract_json('Sure! ```json\n{"a": 1}\n```') == {"a": 1}
    assert C.extract_json("no json here") is None


def test_rows_with_their_own_generators_do_not_depend_on_the_batch(engines, tok, tiny49k):
    items = C.schema_items(SUITE[:3], tok)
    sampler = Sampler(SamplerConfig(temperature=1.0))
    seeds = [11, 12, 13]
    batch = C.generate(tiny49k, [i["prompt"] for i in items], [i["constraint"] for i in items], engines["llguidance"],
                       max_new_tokens=40, sampler=sampler, generator=[torch.Generator().manual_seed(s) for s in seeds])
    for row, (item, seed) in enumerate(zip(items, seeds)):
        single = C.generate(tiny49k, [item["prompt"]], item["constraint"], engines["llguidance"], max_new_tokens=40,
                            sampler=sampler, generator=[torch.Generator().manual_seed(seed)])
        assert batch.tokens[row] == single.tokens[0]


def test_outputs_cut_by_max_new_tokens_count_as_truncated_not_invalid(engines, tok, tiny49k):
    items = C.schema_items(SUITE[:2], tok)
    outs = C.sample_schemas(tiny49k, tok, items, engines["xgrammar"], n_samples=3,
                            sampler=Sampler(SamplerConfig(temperature=1.0)), seed=0, max_new_tokens=3)
    assert all(o["n"] == 3 and o["truncated"] == 3 and o["valid"] == 0 for o in outs)
    rows = [{"engine": "xgrammar", "n": 3, "valid": 0, "truncated": 3, "unsupported": False},
            {"engine": "llguidance", "n": 4, "valid": 2, "truncated": 2, "unsupported": False},
            {"engine": "unconstrained", "n": 4, "valid": 1, "truncated": 2, "unsupported": False}]
    rates = C.validity_rates(rows)
    assert rates["llguidance"] == 1.0 and rates["xgrammar"] != rates["xgrammar"]  # nan: nothing finished
    assert rates["unconstrained"] == 0.25  # free sampling that ran out of budget counts as not valid


def test_first_object_closed_only_when_the_first_brace_parses():
    assert C._first_object_closed('Sure: {"a": {"b": 1}} and more')
    assert not C._first_object_closed('{"a": {"b": 1}')
    assert not C._first_object_closed("no braces }")
