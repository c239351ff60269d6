"""fp32 linear layers through packed weights (`core.packed_linear`: our row-invariant kernel, else oneDNN): the
modules' products to fp32 rounding, rebuilt on weight changes, the modules' own forward under autograd, and
greedy decoding unchanged against transformers and against the unpacked engine."""

import torch

from decodelab.core.engine import generate
from decodelab.core.models import tiny_model
from decodelab.core.packed_linear import PackedLinears, packing_available
from decodelab.core.transformer import Transformer
from decodelab.quickstart import bench


def test_packing_is_available_for_fp32_on_cpu_and_never_elsewhere():
    assert packing_available(torch.device("cpu"), torch.float32)
    assert not packing_available(torch.device("cpu"), torch.float16)
    assert not packing_available(torch.device("meta"), torch.float32)


def test_packed_products_equal_the_modules_and_follow_in_place_weight_updates():
    layer, linear = torch.nn.Linear(32, 16), PackedLinears(True)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = linear(layer, x)
        torch.testing.assert_close(before, layer(x), rtol=1e-5, atol=1e-5)
        assert before.shape == (2, 3, 16) and (layer,) in linear._packed
        layer.weight.mul_(2)
        after = linear(layer, x)
    torch.testing.assert_close(after, layer(x).detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_a_group_of_linears_in_one_call_equals_each_packed_call_bit_for_bit_and_follows_updates():
    """q/k/v and gate/up run as one product on their weights side by side: every output column is
    the same dot product, so the split results equal the separate packed calls exactly, at any batch, in
    fp32 and bf16, with biases on some modules only (a missing bias adds zeros)."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        if not packing_available(torch.device("cpu"), dtype):
            continue
        mods = (torch.nn.Linear(64, 64, bias=True), torch.nn.Linear(64, 16, bias=False), torch.nn.Linear(64, 16))
        mods = tuple(m.to(dtype) for m in mods)
        linear = PackedLinears(True)
        with torch.no_grad():
            for rows in (1, 3, 16, 65):
                x = torch.randn(rows, 2, 64, generator=g).to(dtype)
                grouped = linear.group(mods, x)
                assert [o.shape[-1] for o in grouped] == [64, 16, 16]
                assert all(torch.equal(a, linear(m, x)) for a, m in zip(grouped, mods))
            mods[1].weight.mul_(-1)  # an in-place update repacks the group
            x = torch.randn(2, 64, generator=g).to(dtype)
            assert torch.equal(linear.group(mods, x)[1], linear(mods[1], x))
            torch.testing.assert_close(linear.group(mods, x)[1].float(), mods[1](x).float(), rtol=2e-2, atol=2e-2)


def test_under_autograd_the_modules_own_forward_runs_and_gradients_flow():
    layer, linear = torch.nn.Linear(8, 4), PackedLinears(True)
    x = torch.randn(3, 8, requires_grad=True)
    out = linear(layer, x)
    assert torch.equal(out, layer(x)) and not linear._packed
    out.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_greedy_tokens_equal_the_unpacked_engine_and_transformers_at_several_batch_sizes():
    model = tiny_model(seed=0)
    plain = Transformer(model.hf_model, pack_linears=False)
    assert model.transformer.linear.enabled and not plain.linear.enabled
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4], [20, 21, 22, 23, 24, 25]]
    for batch in (1, 4, 5):
        rows = bench.prompt_batch(prompts, batch)
        ours = generate(model, rows, max_new_tokens=16, eos_token_ids=[]).tokens
        assert ours == generate(plain, rows, max_new_tokens=16, eos_token_ids=[]).tokens
        assert ours == bench.hf_generate_greedy(model, rows, 16)
