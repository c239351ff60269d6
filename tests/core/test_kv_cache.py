"""The KV cache's attention: the additive-bias path equals the bool-mask path exactly, an all-visible step
drops the mask, and the sink + window (sparse) plan equals dense attention under the same visibility."""
import pytest
import torch

from decodelab.core import engine
from decodelab.core import kv_cache as kv

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200]]


def _bool_mask_bias(self, group, dtype):  # the path before: SDPA folds the bool mask itself on every layer
    return self.grouped_mask(group)


@pytest.mark.parametrize("n_tokens", [1, 3])
@pytest.mark.parametrize("ragged", [True, False])
def test_additive_bias_gives_the_bool_mask_logits_exactly(tiny, monkeypatch, n_tokens, ragged):
    prompts = PROMPTS if ragged else [PROMPTS[2]] * 3
    tokens = torch.arange(len(prompts) * n_tokens).reshape(len(prompts), n_tokens) % 200 + 3
    cache, _ = engine.prefill(tiny, prompts, max_new_tokens=8)
    fast = engine.verify_step(tiny, cache, tokens)
    monkeypatch.setattr(kv.ForwardPlan, "attention_bias", _bool_mask_bias)
    cache, _ = engine.prefill(tiny, prompts, max_new_tokens=8)
    assert torch.equal(engine.verify_step(tiny, cache, tokens), fast)


def test_bias_is_none_only_when_every_key_is_visible(tiny):
    cache, _ = engine.prefill(tiny, [PROMPTS[0]] * 2, max_new_tokens=4)
    assert cache.begin_forward(cache.positions(1), group=2).attention_bias(2, torch.float32) is None
    plan = cache.begin_forward(cache.positions(2), group=2)
    bias = plan.attention_bias(2, torch.float32)
    assert bias.dtype == torch.float32 and torch.equal(bias == 0, plan.grouped_mask(2))
    assert plan.attention_bias(2, torch.float32) is bias  # built once per forward
    ragged, _ = engine.prefill(tiny, PROMPTS, max_new_tokens=4)
    assert ragged.begin_forward(ragged.positions(1), group=2).attention_bias(2, torch.float32) is not None


def test_sink_window_visibility_by_hand():
    slots = torch.tensor([[9, 10], [2, 3]])
    read = kv.sink_window_gather(slots, sink=2, window=3)
    assert read.tolist() == [[0, 1, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]]
    visible = kv.sink_window_visible(read, slots, sink=2, window=3)
    seen = [[read[b][visible[b, t]].tolist() for t in range(2)] for b in range(2)]
    assert seen == [[[0, 1, 7, 8, 9], [0, 1, 8, 9, 10]], [[0, 1, 2], [0, 1, 2, 3]]]


@pytest.mark.parametrize("sink,window", [(1, 2), (2, 4), (0, 3), (4, 64)])
def test_sparse_plan_equals_dense_attention_with_the_same_visibility(sink, window):
    gen = torch.Generator().manual_seed(sink * 10 + window)
    B, H, K, D, S, T = 3, 4, 2, 8, 40, 3
    cache = kv.SinkWindowKVCache(1, B, K, D, S, dtype=torch.float32, device=torch.device("cpu"), sink=sink,
                                 window=window)
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    cache.advance(torch.tensor([20, 7, 2]))
    q, k_new, v_new = (torch.randn(B, n, T, D, generator=gen) for n in (H, K, K))
    plan = cache.begin_forward(cache.positions(T), group=H // K)
    out = cache.attend(0, q, k_new, v_new, plan)
    span = int(cache.positions(T).max()) + 1
    dense = torch.zeros(B, T, span, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            pos = int(cache.positions(T)[b, t])
            dense[b, t] = torch.tensor([j <= pos and (j < sink or pos - j < window) for j in range(span)])
    ref = kv.grouped_attention(q, cache.keys[0][:, :, :span], cache.values[0][:, :, :span], dense)
    assert torch.allclose(out, ref, atol=1e-6)


def test_sink_window_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        kv.check_sink_window(4, 0)
    with pytest.raises(ValueError, match=r"sink=-1"):
        kv.check_sink_window(-1, 8)
    with pytest.raises(ValueError, match=r"sink=4 \+ window=100 = 104 positions is larger than the context \(50"):
        kv.check_sink_window(4, 100, context=50)
