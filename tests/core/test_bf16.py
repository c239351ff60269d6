"""bf16 on CPU: the packed oneDNN path is bit-identical to transformers' bf16 modules, logits come back fp32."""

import pytest
import torch

from decodelab.core.engine import generate, prefill
from decodelab.core.models import tiny_model
from decodelab.core.packed_linear import PackedLinears, bf16_packing_available
from decodelab.core.transformer import Transformer
from decodelab.quickstart.bench import hf_generate_greedy

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200]]
needs_bf16 = pytest.mark.skipif(not bf16_packing_available(torch.device("cpu")),
                                reason="this CPU has no oneDNN bf16 (AVX512-BF16 / AMX)")


@pytest.fixture(scope="module")
def tiny_bf16():
    return tiny_model(seed=0, dtype=torch.bfloat16)


@needs_bf16
def test_bf16_model_packs_its_linears_and_returns_fp32_logits(tiny_bf16):
    assert tiny_bf16.transformer.linear.enabled
    _, logits = prefill(tiny_bf16, PROMPTS, max_new_tokens=1)
    assert logits.dtype == torch.float32
    # rounded to bf16 first, as transformers' bf16 LM head does (so greedy ties break the same way)
    assert torch.equal(logits, logits.bfloat16().float())


@needs_bf16
def test_packed_forward_is_bit_identical_to_the_unpacked_modules(tiny_bf16):
    plain = Transformer(tiny_bf16.hf_model, pack_linears=False)
    assert not plain.linear.enabled
    _, packed_logits = prefill(tiny_bf16, PROMPTS, max_new_tokens=1)
    _, plain_logits = prefill(plain, PROMPTS, max_new_tokens=1)
    assert torch.equal(packed_logits, plain_logits)


@needs_bf16
def test_bf16_greedy_equals_transformers_bf16_token_for_token(tiny_bf16):
    """Row by row: transformers' own batched bf16 run is not batch-invariant (a row with 9 left pads
    diverges from its solo run after ~15 tokens on this model), while ours is (checked here too)."""
    ours = generate(tiny_bf16, PROMPTS, max_new_tokens=24, eos_token_ids=[]).tokens
    for prompt, row in zip(PROMPTS, ours):
        assert row == hf_generate_greedy(tiny_bf16, [prompt], 24)[0]
        assert row == generate(tiny_bf16, [prompt], max_new_tokens=24, eos_token_ids=[]).tokens[0]


@needs_bf16
def test_packed_weights_follow_in_place_weight_updates():
    layer = torch.nn.Linear(16, 8).bfloat16()
    linear, x = PackedLinears(True), torch.randn(3, 16).bfloat16()
    with torch.no_grad():
        before = linear(layer, x)
        layer.weight.mul_(2)
        after = linear(layer, x)
    assert torch.equal(after, layer(x).detach()) and not torch.equal(before, after)


def test_fp32_cpu_models_pack_their_linears_too():
    assert tiny_model(seed=0).transformer.linear.enabled


@needs_bf16
@pytest.mark.slow
def test_embedded_model_in_bf16_decodes_transformers_bf16_greedy_tokens_row_by_row():
    """The embedded model at batch 1 (transformers' batched bf16 run is not batch-invariant, see above): every
    benchmark prompt decodes the same 32 greedy tokens as transformers' bf16 generate(), EOS off."""
    from decodelab.core.models import load_model
    from decodelab.quickstart.bench import chat_prompts

    lm = load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)
    for prompt in chat_prompts(lm.tokenizer)[:4]:
        ours = generate(lm, [prompt], max_new_tokens=32, eos_token_ids=[]).tokens[0]
        assert ours == hf_generate_greedy(lm, [prompt], 32)[0]
