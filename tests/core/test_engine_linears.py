"""The fp32 K-major linear path (`core.transformer.EngineLinears`): same products as the modules, rebuilt on
weight changes, bit-identical below its row threshold, and greedy decoding unchanged against transformers."""

import torch

from decodelab.core.engine import generate
from decodelab.core.models import tiny_model
from decodelab.core.transformer import KMAJOR_MAX_ROWS, KMAJOR_MIN_ROWS, EngineLinears, Transformer
from decodelab.quickstart import bench


def test_fp32_cpu_models_use_the_kmajor_path_and_bf16_packing_stays_off():
    linear = tiny_model(seed=0).transformer.linear
    assert linear.kmajor and not linear.enabled


def test_outside_the_row_window_the_modules_own_forward_runs_bit_identically():
    layer, linear = torch.nn.Linear(32, 16), EngineLinears(False, kmajor=True)
    for rows in (1, KMAJOR_MIN_ROWS - 1, KMAJOR_MAX_ROWS + 1, 200):
        x = torch.randn(1, rows, 32)
        with torch.no_grad():
            assert torch.equal(linear(layer, x), layer(x))
    assert not linear._copies  # no copy was made for a call it does not serve


def test_kmajor_products_equal_the_modules_and_follow_in_place_weight_updates():
    layer, linear = torch.nn.Linear(32, 16), EngineLinears(False, kmajor=True)
    x = torch.randn(2, 3, 32)  # 6 rows >= the threshold
    with torch.no_grad():
        before = linear(layer, x)
        torch.testing.assert_close(before, layer(x), rtol=1e-5, atol=1e-5)
        assert before.shape == (2, 3, 16) and id(layer) in linear._copies
        layer.weight.mul_(2)
        after = linear(layer, x)
    torch.testing.assert_close(after, layer(x).detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_greedy_tokens_equal_the_plain_path_and_transformers_at_several_batch_sizes():
    model = tiny_model(seed=0)
    plain = Transformer(model.hf_model, kmajor_fp32=False)
    assert not plain.linear.kmajor
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4], [20, 21, 22, 23, 24, 25]]
    for batch in (1, 4, 5):
        rows = bench.prompt_batch(prompts, batch)
        ours = generate(model, rows, max_new_tokens=16, eos_token_ids=[]).tokens
        assert ours == generate(plain, rows, max_new_tokens=16, eos_token_ids=[]).tokens
        assert ours == bench.hf_generate_greedy(model, rows, 16)
