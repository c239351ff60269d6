"""The graph-ready decode step computes what the eager step computes: same logits (to rounding), same tokens."""

import pytest
import torch

from decodelab.core.engine import generate, prefill
from decodelab.core.models import tiny_model
from decodelab.core.static_step import StaticStep, static_visible

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_static_visible_shows_each_row_its_prefix_and_new_position():
    visible = static_visible(torch.tensor([0, 2]), 4)
    assert visible.tolist() == [[[True, False, False, False]], [[True, True, True, False]]]


def test_eager_static_step_matches_the_eager_forward_for_ragged_rows(model):
    cache_a, logits = prefill(model, PROMPTS, max_new_tokens=6)
    cache_b, _ = prefill(model, PROMPTS, max_new_tokens=6)
    step = StaticStep(model.transformer, compile=False)
    tokens = logits.argmax(-1)
    for _ in range(5):
        eager = model.transformer.forward(tokens[:, None], cache_a)[:, 0]
        static = step(cache_b, tokens)
        assert torch.allclose(eager, static, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache_a.lengths, cache_b.lengths)
        tokens = eager.argmax(-1)
    assert not step.compiled and step.status()["compile_requested"] is False


def test_static_step_refuses_a_full_cache(model):
    cache, logits = prefill(model, PROMPTS, max_new_tokens=1)
    cache.advance(torch.ones_like(cache.lengths) * 0 + (cache.max_len - cache.lengths))
    with pytest.raises(ValueError, match="overflow"):
        StaticStep(model.transformer, compile=False)(cache, logits.argmax(-1))


def test_failed_compile_warns_and_decodes_eagerly_with_the_reason_recorded(model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    eager = generate(model, PROMPTS, max_new_tokens=6, eos_token_ids=[])
    tiny = tiny_model(seed=0)  # a fresh Transformer: its static steps are not cached yet
    with pytest.warns(RuntimeWarning, match="compile=True but torch.compile unavailable"):
        out = generate(tiny, PROMPTS, max_new_tokens=6, eos_token_ids=[], compile=True)
    assert out.tokens == eager.tokens
    assert out.compile["compiled"] is False and "no C++ compiler" in out.compile["reason"]


@pytest.mark.slow
def test_compiled_step_is_token_identical_to_eager(model):
    eager = generate(model, PROMPTS, max_new_tokens=10, eos_token_ids=[])
    compiled = generate(model, PROMPTS, max_new_tokens=10, eos_token_ids=[], compile=True)
    assert compiled.compile["compiled"] is True, compiled.compile
    assert compiled.tokens == eager.tokens
