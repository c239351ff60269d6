"""Mask engines: agreement with the naive reference, bitmask format, rollback, clear errors."""
import pytest
import torch

from decodelab.constrained.bitmask import allocate_bitmask, apply_bitmask, bitmask_to_bool, bool_to_bitmask
from decodelab.constrained.constraint import Constraint, ConstraintError, UnsupportedConstraint
from decodelab.constrained.engines import LLGuidanceEngine, NaiveEngine, XGrammarEngine, make_engine
from decodelab.core.models import resolve_model_path


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def engines(tok):
    xg = XGrammarEngine(tok)
    return {"xgrammar": xg, "llguidance": LLGuidanceEngine(tok), "naive": NaiveEngine(tok, xgrammar_engine=xg)}


def masks_along(engine, constraint, tokens):
    """Allowed-token sets (V,) bool at each prefix of `tokens` (EOS appended by the caller)."""
    matcher = engine.matcher(engine.compile(constraint))
    out = []
    for token in tokens:
        bitmask = allocate_bitmask(1, engine.vocab_size)
        matcher.fill(bitmask, 0)
        out.append(bitmask_to_bool(bitmask, engine.vocab_size)[0])
        assert matcher.accept(token)
    assert matcher.is_terminated()
    return out


def test_bitmask_roundtrip_preserves_every_bit():
    allowed = torch.rand(3, 100, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(bitmask_to_bool(bool_to_bitmask(allowed), 100), allowed)


def test_apply_bitmask_sets_exactly_disallowed_to_minus_inf():
    allowed = torch.rand(2, 70, generator=torch.Generator().manual_seed(1)) < 0.3
    logits = torch.randn(2, 75)
    out = apply_bitmask(logits, bool_to_bitmask(allowed))
    assert torch.equal(torch.isinf(out[:, :70]), ~allowed)
    assert torch.isinf(out[:, 70:]).all()  # past the tokenizer's vocabulary: never allowed


@pytest.mark.parametrize("constraint,text", [
    (Constraint.choices(["yes", "no", "unsure"]), "unsure"),
    (Constraint.regex(r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])"), "2019-05"),
])
def test_compiled_engines_match_naive_reference_mask_on_regex(engines, tok, constraint, text):
    """XGrammar allows exactly the tokens the naive check allows. llguidance allows a subset that always
    holds the canonical next token: where the rest of the output is forced it keeps only the canonical
    tokenization of the forced bytes (so its masked distribution differs; notebook 04 measures it)."""
    tokens = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    reference = masks_along(engines["naive"], constraint, tokens)
    for step, (got, want) in enumerate(zip(masks_along(engines["xgrammar"], constraint, tokens), reference)):
        assert torch.equal(got, want), f"xgrammar differs from naive at step {step}"
    for step, (got, want) in enumerate(zip(masks_along(engines["llguidance"], constraint, tokens), reference)):
        assert not (got & ~want).any(), f"llguidance allows a token naive forbids at step {step}"
        assert got[tokens[step]], f"llguidance forbids the canonical token at step {step}"


def test_xgrammar_matches_naive_reference_mask_on_json(engines, tok):
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"],
              "additionalProperties": False}
    constraint = Constraint.json(schema)
    tokens = tok('{"c":"red"}', add_special_tokens=False).input_ids[:3]
    naive = engines["naive"].matcher(engines["naive"].compile(constraint))
    fast = engines["xgrammar"].matcher(engines["xgrammar"].compile(constraint))
    for token in tokens:
        a, b = allocate_bitmask(1, 49152), allocate_bitmask(1, 49152)
        naive.fill(a, 0)
        fast.fill(b, 0)
        assert torch.equal(a, b)
        assert naive.accept(token) and fast.accept(token)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "naive"])
def test_rollback_restores_the_mask(engines, tok, name):
    engine = engines[name]
    matcher = engine.matcher(engine.compile(Constraint.choices(["orange", "olive"])))
    first = allocate_bitmask(1, 49152)
    matcher.fill(first, 0)
    for token in tok("ol", add_special_tokens=False).input_ids:
        assert matcher.accept(token)
    matcher.rollback(len(tok("ol", add_special_tokens=False).input_ids))
    again = allocate_bitmask(1, 49152)
    matcher.fill(again, 0)
    assert torch.equal(first, again)


def test_malformed_regex_is_rejected_with_the_pattern_named():
    with pytest.raises(ConstraintError, match=r"pattern='\[a-'"):
        Constraint.regex("[a-")


def test_malformed_schema_is_rejected_before_any_engine():
    with pytest.raises(ConstraintError, match="malformed"):
        Constraint.json({"type": "foo"})
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json("{not json")


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("schema", [{"enum": []}, {"type": "integer", "minimum": 5, "maximum": 3}])
def test_unsatisfiable_schema_raises_at_compile(engines, name, schema):
    with pytest.raises(ConstraintError):
        engines[name].compile(Constraint.json(schema))


def test_unknown_engine_error_lists_allowed(tok):
    with pytest.raises(ValueError, match="allowed"):
        make_engine("outlines-nope", tok)


def test_empty_choices_rejected():
    with pytest.raises(ConstraintError, match="choices"):
        Constraint.choices([])


def test_xgrammar_reports_allof_as_unsupported_instead_of_ignoring_it(engines):
    schema = {"allOf": [{"type": "string"}, {"type": "integer"}]}
    with pytest.raises(UnsupportedConstraint, match="allOf"):
        engines["xgrammar"].compile(Constraint.json(schema))
    with pytest.raises(ConstraintError):
        engines["llguidance"].compile(Constraint.json(schema))


def test_xgrammar_json_masks_never_allow_raw_control_bytes(engines, tok):
    engine = engines["xgrammar"]
    matcher = engine.matcher(engine.compile(Constraint.json({"type": "string", "maxLength": 5})))
    assert matcher.accept(tok('"', add_special_tokens=False).input_ids[0])
    bitmask = allocate_bitmask(1, engine.vocab_size)
    matcher.fill(bitmask, 0)
    allowed = bitmask_to_bool(bitmask, engine.vocab_size)[0].nonzero().flatten().tolist()
    vocab = engine.info.decoded_vocab
    assert allowed and not any(any(b < 32 for b in vocab[t]) for t in allowed if t != tok.eos_token_id)
