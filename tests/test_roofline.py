"""Roofline cost model: Leviathan's expected tokens, the least-squares fit, crossover batches."""
import numpy as np
import pytest

from decodelab import roofline
from decodelab.roofline import Hardware, ModelShape, SHAPES


def test_expected_tokens_matches_leviathan_limits():
    assert roofline.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert roofline.expected_tokens(1.0, 4) == pytest.approx(5.0)
    a, k = 0.7, 3
    assert roofline.expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))


def test_fit_alpha_inverts_expected_tokens():
    ks = [1, 2, 4, 8]
    taus = roofline.expected_tokens(0.62, np.array(ks))
    assert roofline.fit_alpha(ks, taus) == pytest.approx(0.62, abs=1e-3)


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_fit_recovers_the_hardware_that_made_the_step_times(combine):
    shape = SHAPES["Qwen2.5-0.5B"]
    true = Hardware("true", peak=2e12, bandwidth=5e10, overhead=3e-3, combine=combine)
    b, n = np.meshgrid([1, 4, 16, 64, 256], [1, 2, 3, 5, 9])
    b, n = b.ravel(), n.ravel()
    s = np.full_like(b, 512)
    t = roofline.step_time(shape, true, b, n, s)
    fit = roofline.fit_hardware(shape, b, n, s, t, combine=combine)
    assert fit.median_rel_error < 1e-4
    np.testing.assert_allclose(roofline.step_time(shape, fit.hardware, b, n, s), t, rtol=1e-3)


def test_shape_from_config_counts_every_matmul_weight():
    from decodelab.models import tiny_config

    config = tiny_config(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    shape = ModelShape.from_config(config, bytes_per_param=4)
    layer_params = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.ndim == 2)
    assert shape.matmul_params == layer_params + model.lm_head.weight.numel()
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4


def test_speculation_wins_at_batch_one_and_loses_at_large_batch_on_h100():
    hw = roofline.spec_sheet("H100-SXM")
    target, draft = SHAPES["Qwen2.5-7B"], SHAPES["Qwen2.5-0.5B"]
    at = lambda b: roofline.speculative_speedup(target, hw, b, alpha=0.7, k=4, context=1024, draft=draft)
    assert at(1) > 1.3
    assert at(4096) < 1.0
    cross = roofline.crossover_batch(at)
    assert cross is not None and 1 < cross < 4096
    assert at(cross * 0.9) > 1.0 > at(cross * 1.1)


def test_crossover_is_none_when_speedup_never_drops():
    assert roofline.crossover_batch(lambda b: 2.0) is None


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(ValueError, match="hardware='TPU' is unknown"):
        roofline.spec_sheet("TPU")
    with pytest.raises(ValueError, match="combine='avg'"):
        roofline.fit_hardware(SHAPES["Qwen2.5-7B"], [1, 2, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], combine="avg")


def test_70b_needs_several_gpus_and_the_kv_cache_caps_the_batch():
    h100 = roofline.spec_sheet("H100-SXM")
    assert roofline.devices_needed(SHAPES["Qwen2.5-7B"], h100) == 1
    n = roofline.devices_needed(SHAPES["Llama-3-70B"], h100)
    assert n >= 4 and SHAPES["Llama-3-70B"].weight_bytes <= 0.5 * h100.tensor_parallel(n).memory
    b = roofline.max_batch(SHAPES["Qwen2.5-7B"], h100, 1024)
    kv = b * 1024 * SHAPES["Qwen2.5-7B"].kv_bytes_per_token
    assert kv + SHAPES["Qwen2.5-7B"].weight_bytes <= h100.memory < kv + SHAPES["Qwen2.5-7B"].weight_bytes + 1024 * SHAPES["Qwen2.5-7B"].kv_bytes_per_token
