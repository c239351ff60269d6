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


def _random_cache(lengths, *, K=2, D=8, S=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = kv.KVCache(1, len(lengths), K, D, S, dtype=torch.float32, device=torch.device("cpu"))
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    cache.advance(torch.tensor(lengths))
    return cache


def test_sink_window_ring_by_hand():
    ring = kv.SinkWindowKVCache.from_cache(_random_cache([9, 3]), sink=2, window=3, spare=2)
    # ring of window + spare = 5 slots after the 2 sink slots: position p >= 2 lives at slot 2 + (p - 2) % 5
    assert ring.stored.tolist() == [[0, 1, 7, 8, 4, 5, 6], [0, 1, 2, -1, -1, -1, -1]]
    plan = ring.begin_forward(ring.positions(2))
    assert plan.slots.tolist() == [[4, 5], [3, 4]]
    assert ring.stored.tolist() == [[0, 1, 7, 8, 9, 10, 6], [0, 1, 2, 3, 4, -1, -1]]
    seen = [[sorted(ring.stored[b][plan.visible[b, t]].tolist()) for t in range(2)] for b in range(2)]
    assert seen == [[[0, 1, 7, 8, 9], [0, 1, 8, 9, 10]], [[0, 1, 2, 3], [0, 1, 2, 3, 4]]]


@pytest.mark.parametrize("sink,window,spare", [(1, 2, 3), (2, 4, 4), (0, 3, 5), (4, 64, 8)])
def test_sink_window_ring_attends_like_dense_attention_through_forwards_and_rollbacks(sink, window, spare):
    """The ring's output equals dense attention over a full cache with the sink + window visibility, step after
    step, with ragged rows, multi-token forwards and rollbacks up to what `spare` allows."""
    gen = torch.Generator().manual_seed(sink * 100 + window * 10 + spare)
    H, K, D = 4, 2, 8
    full = _random_cache([20, 7, 2], K=K, D=D, S=120, seed=spare)
    ring = kv.SinkWindowKVCache.from_cache(full, sink=sink, window=window, spare=spare)
    rows = torch.arange(3)[:, None]
    for _ in range(12):
        T = int(torch.randint(1, min(3, spare) + 1, (1,), generator=gen))
        T = min(T, ring.room())
        positions = ring.positions(T)
        assert torch.equal(positions, full.positions(T))
        q, k_new, v_new = (torch.randn(3, n, T, D, generator=gen) for n in (H, K, K))
        out = ring.attend(0, q, k_new, v_new, ring.begin_forward(positions, group=H // K))
        full.keys[0][rows, :, positions] = k_new.transpose(1, 2)
        full.values[0][rows, :, positions] = v_new.transpose(1, 2)
        span = int(positions.max()) + 1
        j, p = torch.arange(span)[None, None, :], positions[:, :, None]
        visible = (j <= p) & ((j < sink) | (p - j < window))
        ref = kv.grouped_attention(q, full.keys[0][:, :, :span], full.values[0][:, :, :span], visible)
        assert torch.allclose(out, ref, atol=1e-6)
        for cache in (ring, full):
            cache.advance(torch.full((3,), T))
        back = torch.randint(0, T + 1, (3,), generator=gen)  # reject up to this forward's tokens
        ring.truncate(ring.lengths - back)
        full.truncate(full.lengths - back)


def test_sink_window_ring_refuses_to_run_past_its_spare():
    ring = kv.SinkWindowKVCache.from_cache(_random_cache([9, 3]), sink=2, window=3, spare=2)
    assert ring.room() == 2
    with pytest.raises(ValueError, match="keeps 2 positions past each row's length; this forward .* reaches 3"):
        ring.begin_forward(ring.positions(3))
    for _ in range(2):
        ring.begin_forward(ring.positions(2))
        ring.advance(torch.tensor([2, 2]))
    ring.truncate(ring.lengths - 3)  # further back than the spare allows: the ring may have lost a visible position
    with pytest.raises(ValueError, match="reaches 3"):
        ring.begin_forward(ring.positions(1))
    with pytest.raises(ValueError, match="spare=0 must be an int >= 1"):
        kv.SinkWindowKVCache(1, 1, 1, 4, 16, sink=1, window=2, spare=0, dtype=torch.float32, device="cpu")


def test_sink_window_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        kv.check_sink_window(4, 0)
    with pytest.raises(ValueError, match=r"sink=-1"):
        kv.check_sink_window(-1, 8)
    with pytest.raises(ValueError, match=r"sink=4 \+ window=100 = 104 positions is larger than the context \(50"):
        kv.check_sink_window(4, 100, context=50)


@pytest.mark.parametrize("lengths,sliced", [([7], True), ([5, 5, 5], True), ([5, 3, 6], False)])
def test_a_decode_step_of_equal_rows_writes_a_slice_with_the_scatters_values(lengths, sliced):
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim = len(lengths), 4, 2, 8
    caches = [kv.KVCache(2, batch, kv_heads, dim, 16, dtype=torch.float32, device=torch.device("cpu")) for _ in "ab"]
    for cache in caches:
        cache.keys.normal_(generator=torch.Generator().manual_seed(1))
        cache.values.normal_(generator=torch.Generator().manual_seed(2))
        cache.lengths = torch.tensor(lengths)
    q = torch.randn(batch, heads, 1, dim, generator=gen)
    k_new, v_new = (torch.randn(batch, kv_heads, 1, dim, generator=gen) for _ in "kv")
    plans = [cache.begin_forward(cache.positions(1), group=heads // kv_heads) for cache in caches]
    assert (plans[0].start is not None) == sliced
    plans[1].start = None  # the scatter by index
    outs = [cache.attend(1, q, k_new, v_new, plan) for cache, plan in zip(caches, plans)]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
    two_tokens = caches[0].begin_forward(caches[0].positions(2), group=2)
    assert two_tokens.start is None  # verify feeds keep the scatter


@pytest.mark.parametrize("view", [False, True])
def test_copy_equals_selecting_every_row_and_owns_its_storage(tiny, view):
    cache, _ = engine.prefill(tiny, PROMPTS, max_new_tokens=4)
    source = cache.first_rows(3) if view else cache  # a view into a larger cache copies as well
    copied, selected = source.copy(), source.select(list(range(source.batch_size)))
    assert torch.equal(copied.keys, selected.keys) and torch.equal(copied.values, selected.values)
    assert torch.equal(copied.lengths, selected.lengths) and torch.equal(copied._rows, selected._rows)
    copied.keys.add_(1.0)
    copied.truncate(copied.lengths - 1)
    assert torch.equal(source.keys, selected.keys) and torch.equal(source.lengths, selected.lengths)


@pytest.mark.parametrize("rows", [[1, 1, 1], [2], [0, 2, 1, 2]])
def test_select_copies_the_rows_asked_for_in_order_one_row_replicated_or_not(tiny, rows):
    cache, _ = engine.prefill(tiny, PROMPTS, max_new_tokens=4)
    out = cache.select(rows)
    index = torch.tensor(rows)
    assert torch.equal(out.keys, cache.keys[:, index]) and torch.equal(out.values, cache.values[:, index])
    assert out.keys.is_contiguous() and torch.equal(out.lengths, cache.lengths[index])
    out.keys.add_(1.0)  # its own storage
    assert not torch.equal(out.keys, cache.keys[:, index])
