"""Shared-prefix (Hydragen-style) attention and cache: equal to standard attention and to unshared decoding."""
import pytest
import torch

from decodelab.core.kv_cache import grouped_attention
from decodelab.core.shared_prefix import (
    SharedPrefixKVCache,
    analytic_kv_bytes,
    expand_counts,
    generate_shared,
    merge_attention,
    partial_attention,
    shared_prefix_attention,
)


def _reference(q, prefix_k, prefix_v, prefix_mask, suffix_k, suffix_v, suffix_mask, row_counts):
    """Standard attention over each row's concatenated [prefix ; suffix] keys."""
    rows = torch.repeat_interleave(torch.arange(len(row_counts)), torch.tensor(row_counts))
    keys = torch.cat([prefix_k[rows], suffix_k], dim=2)
    values = torch.cat([prefix_v[rows], suffix_v], dim=2)
    n_new = q.shape[2]
    visible = torch.cat([prefix_mask[rows][:, None, :].expand(-1, n_new, -1), suffix_mask], dim=2)
    return grouped_attention(q, keys, values, visible)


@pytest.mark.parametrize("seed", range(8))
def test_shared_prefix_attention_allclose_to_standard(seed):
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    n_kv, group, head_dim = ri(1, 3), ri(1, 4), 8 * ri(1, 4)
    n_prompts, n_new, prefix_len, suffix_len = ri(1, 3), ri(1, 4), ri(1, 40), ri(4, 12)
    row_counts = [ri(1, 5) for _ in range(n_prompts)] if seed % 2 else [ri(1, 5)] * n_prompts
    batch = sum(row_counts)
    q = torch.randn(batch, n_kv * group, n_new, head_dim, generator=g, dtype=torch.float64) * 2
    prefix_k, prefix_v = (torch.randn(n_prompts, n_kv, prefix_len, head_dim, generator=g, dtype=torch.float64)
                          for _ in range(2))
    suffix_k, suffix_v = (torch.randn(batch, n_kv, suffix_len, head_dim, generator=g, dtype=torch.float64)
                          for _ in range(2))
    prefix_lengths = torch.randint(1, prefix_len + 1, (n_prompts,), generator=g)
    prefix_mask = torch.arange(prefix_len)[None, :] < prefix_lengths[:, None]
    # Causal suffix: query t of row b sits at slot start_b + t and sees slots <= it.
    starts = torch.randint(0, suffix_len - n_new + 1, (batch,), generator=g)
    slots = starts[:, None] + torch.arange(n_new)
    suffix_mask = torch.arange(suffix_len)[None, None, :] <= slots[:, :, None]

    got = shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_mask,
                                  row_counts=row_counts, prefix_mask=prefix_mask)
    want = _reference(q, prefix_k, prefix_v, prefix_mask, suffix_k, suffix_v, suffix_mask, row_counts)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_merge_gives_zero_weight_to_an_empty_block():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    out, lse = partial_attention(q, k, v, torch.ones(2, 3, 5, dtype=torch.bool), 0.5)
    empty_out, empty_lse = partial_attention(q, k, v, torch.zeros(2, 3, 5, dtype=torch.bool), 0.5)
    assert torch.isneginf(empty_lse).all() and not empty_out.isnan().any()
    torch.testing.assert_close(merge_attention(out, lse, empty_out, empty_lse), out)


def test_uniform_and_ragged_row_paths_agree():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 1, 8, generator=g)
    pk, pv = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    sk, sv = torch.randn(6, 2, 3, 8, generator=g), torch.randn(6, 2, 3, 8, generator=g)
    mask = torch.ones(6, 1, 3, dtype=torch.bool)
    uniform = shared_prefix_attention(q, pk, pv, sk, sv, mask, row_counts=[3, 3])
    # The ragged path with a third, one-row prompt that repeats prompt 1 (rows 3-5 split 2 + 1).
    ragged = shared_prefix_attention(q, torch.cat([pk, pk[1:]]), torch.cat([pv, pv[1:]]), sk, sv, mask,
                                     row_counts=[3, 2, 1])
    torch.testing.assert_close(uniform, ragged)


def test_row_counts_must_cover_the_batch():
    q = torch.randn(3, 2, 1, 4)
    kv = torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="row_counts"):
        shared_prefix_attention(q, kv, kv, torch.randn(3, 1, 2, 4), torch.randn(3, 1, 2, 4),
                                torch.ones(3, 1, 2, dtype=torch.bool), row_counts=[2])


def test_expand_counts_rejects_n_below_one():
    assert expand_counts(3, 2) == [3, 3]
    with pytest.raises(ValueError, match="n >= 1"):
        expand_counts(0, 2)
    with pytest.raises(ValueError, match="one count per prompt"):
        expand_counts([1, 2], 3)


def test_shared_kv_bytes_hold_the_prompt_once():
    per_token = 2 * 30 * 3 * 64 * 4  # the embedded model in float32: 46 KB per position
    assert analytic_kv_bytes(per_token, 1000, 16, 32, shared=True) == (1000 + 16 * 32) * per_token
    assert analytic_kv_bytes(per_token, 1000, 16, 32, shared=False) == 16 * 1032 * per_token


# ---------------------------------------------------------------- decoding on a tiny model


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (length,), generator=g).tolist() for length in (11, 5, 17)]


def _generators(seed, count):
    return [torch.Generator().manual_seed(seed * 1000 + i) for i in range(count)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefix_tokens_equal_unshared_engine_generate(tiny, temperature):
    from decodelab.core import engine
    from decodelab.core.sampling import Sampler, SamplerConfig

    prompts, counts = _prompts(), [3, 1, 4]
    sampler = None if temperature == 0 else Sampler(SamplerConfig(temperature=temperature))
    shared = generate_shared(tiny, prompts, counts, max_new_tokens=12, sampler=sampler,
                             generator=_generators(7, 8), eos_token_ids=[2])
    repeated = [p for p, c in zip(prompts, counts) for _ in range(c)]
    plain = engine.generate(tiny, repeated, max_new_tokens=12, sampler=sampler, generator=_generators(7, 8),
                            eos_token_ids=[2])
    assert shared.tokens == plain.tokens
    assert shared.row_prompt == [0, 0, 0, 1, 2, 2, 2, 2]
    if temperature:  # sampled rows of one prompt differ from each other (the streams are per row)
        assert len({tuple(t) for t in shared.tokens[4:]}) > 1


def test_shared_and_unshared_logprobs_agree(tiny):
    from decodelab.core.sampling import Sampler, SamplerConfig

    kwargs = dict(max_new_tokens=8, sampler=Sampler(SamplerConfig()), eos_token_ids=[])
    shared = generate_shared(tiny, _prompts(), 2, generator=_generators(3, 6), **kwargs)
    plain = generate_shared(tiny, _prompts(), 2, generator=_generators(3, 6), shared=False, **kwargs)
    assert shared.tokens == plain.tokens
    torch.testing.assert_close(torch.tensor(shared.logprobs), torch.tensor(plain.logprobs), rtol=1e-4, atol=1e-4)


def test_shared_cache_holds_each_prompt_once(tiny):
    from decodelab.core import engine

    prompts = _prompts()
    prefix_cache, _ = engine.prefill(tiny, prompts, max_new_tokens=0)
    cache = SharedPrefixKVCache.fork(prefix_cache, [4, 4, 4], max_new_tokens=6)
    assert cache.prefix_keys.data_ptr() == prefix_cache.keys.data_ptr()  # a view, not a copy
    per_position = 2 * 4 * 2 * 16 * 4  # K and V, layers, KV heads, head dim, float32
    assert cache.used_nbytes() == sum(map(len, prompts)) * per_position
    engine.decode_step(tiny, cache, torch.zeros(12, dtype=torch.long))
    assert cache.used_nbytes() == (sum(map(len, prompts)) + 12) * per_position
    assert cache.lengths.tolist() == [len(p) + 1 for p in prompts for _ in range(4)]


def test_shared_cache_refuses_to_truncate_into_the_prompt(tiny):
    from decodelab.core import engine

    prefix_cache, _ = engine.prefill(tiny, _prompts(), max_new_tokens=0)
    cache = SharedPrefixKVCache.fork(prefix_cache, [1, 1, 1], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt"):
        cache.truncate(cache.lengths - 1)


def test_shared_cache_overflow_is_an_error(tiny):
    from decodelab.core import engine

    prefix_cache, _ = engine.prefill(tiny, _prompts(), max_new_tokens=0)
    cache = SharedPrefixKVCache.fork(prefix_cache, [1, 1, 1], max_new_tokens=1)
    engine.decode_step(tiny, cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens=1"):
        engine.decode_step(tiny, cache, torch.zeros(3, dtype=torch.long))


def test_half_precision_inputs_are_computed_in_float32():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 1, 16, generator=g)
    pk, pv = torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    sk, sv = torch.randn(4, 2, 3, 16, generator=g), torch.randn(4, 2, 3, 16, generator=g)
    mask = torch.ones(4, 1, 3, dtype=torch.bool)
    exact = shared_prefix_attention(q, pk, pv, sk, sv, mask, row_counts=[4])
    half = shared_prefix_attention(*(x.bfloat16() for x in (q, pk, pv, sk, sv)), mask, row_counts=[4])
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), exact, rtol=0.02, atol=0.02)


def test_attention_benchmark_times_both_impls():
    from decodelab.consistency.attention_bench import attention_benchmark

    rows = attention_benchmark([16], [1, 2], repeats=1)
    assert [(r["n"], r["impl"]) for r in rows] == [(1, "shared"), (1, "unshared"), (2, "shared"), (2, "unshared")]
    assert all(r["seconds"] > 0 for r in rows)


@pytest.mark.slow
def test_shared_prefix_equals_unshared_on_the_embedded_model(smol, chat_ids):
    """Greedy: token for token. Sampled: the shared cache attends its prefix and each row's own suffix as two
    parts, so its logits equal the unshared cache's to fp32 rounding (max |diff| ~1e-4 on logits of ~10), not bit
    for bit; a draw whose uniform lands within that rounding of a CDF boundary can differ (it did on an AVX2 host,
    at one row's 7th token: ids 6198 / 6195, neighbours in the vocabulary-order CDF). So on the same sampled
    tokens, every step's logits are compared."""
    from decodelab.core import engine
    from decodelab.core.sampling import Sampler, SamplerConfig
    from decodelab.core.shared_prefix import SharedPrefixKVCache

    prompts, tr = chat_ids[:2], smol.transformer
    repeated = [p for p in prompts for _ in range(2)]
    greedy = generate_shared(smol, prompts, 2, max_new_tokens=8, eos_token_ids=[])
    assert greedy.tokens == engine.generate(smol, repeated, max_new_tokens=8, eos_token_ids=[]).tokens
    sampled = engine.generate(smol, repeated, max_new_tokens=8, sampler=Sampler(SamplerConfig(temperature=1.0)),
                              generator=_generators(5, 4), eos_token_ids=[])
    tokens = torch.tensor(sampled.tokens)
    prefix, prefix_logits = engine.prefill(tr, prompts, max_new_tokens=0)
    plain, plain_logits = engine.prefill(tr, repeated, max_new_tokens=8)
    shared = SharedPrefixKVCache.fork(prefix, [2, 2], 8)
    assert torch.equal(prefix_logits[shared.row_prompt], plain_logits)  # the same prefill rows
    torch.testing.assert_close(tr.forward(tokens, shared), tr.forward(tokens, plain), rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------- measured KV bytes


def test_storage_bytes_count_a_view_once():
    from decodelab.core.shared_prefix import storage_bytes

    base = torch.zeros(4, 10, dtype=torch.float32)
    assert storage_bytes([base]) == 160
    assert storage_bytes([base, base[:, :5], base[1]]) == 160  # views of one buffer: the buffer once
    assert storage_bytes([base, torch.zeros(3, dtype=torch.float64)]) == 160 + 24


def test_generate_shared_measures_the_cache_it_decoded_with(tiny):
    from decodelab.core.shared_prefix import kv_bytes_per_token

    prompts, per_token = _prompts(), kv_bytes_per_token(tiny)
    kwargs = dict(max_new_tokens=6, eos_token_ids=[], generator=_generators(2, 6))
    shared = generate_shared(tiny, prompts, 2, **kwargs)
    # One prompt buffer (P prompts padded to the longest, prefilled once) + 2 rows x 6 suffix slots per prompt.
    assert shared.cache_bytes == (len(prompts) * max(map(len, prompts)) + 6 * 6) * per_token
    plain = generate_shared(tiny, prompts, 2, shared=False, **kwargs)
    assert plain.cache_bytes == 6 * (max(map(len, prompts)) + 6) * per_token  # six rows, each prompt + suffix
    assert plain.tokens == shared.tokens


def test_return_logprobs_false_leaves_the_tokens_unchanged(tiny):
    kwargs = dict(max_new_tokens=5, eos_token_ids=[])
    with_lp = generate_shared(tiny, _prompts(), 2, generator=_generators(4, 6), **kwargs)
    without = generate_shared(tiny, _prompts(), 2, generator=_generators(4, 6), return_logprobs=False, **kwargs)
    assert without.tokens == with_lp.tokens and without.logprobs is None and with_lp.logprobs is not None


@pytest.mark.parametrize("keep", [[0, 1, 5, 7, 8], [4, 5, 6, 7], [2], list(range(12))])
def test_selected_rows_decode_as_they_would_in_the_full_cache(tiny, keep):
    """Compaction: after select(keep) the kept rows' next logits equal the full cache's for those rows, including
    when whole prompts lose every row (their shared KV is dropped) and prompts differ in length."""
    from decodelab.core import engine

    prompts = _prompts()
    prefix_cache, _ = engine.prefill(tiny, prompts, max_new_tokens=0)
    full = SharedPrefixKVCache.fork(prefix_cache, [4, 4, 4], max_new_tokens=6)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        engine.decode_step(tiny, full, torch.randint(0, 64, (12,), generator=g))
    small = full.select(keep)
    assert small.batch_size == len(keep) and sum(small.row_counts) == len(keep)
    assert small.lengths.tolist() == [full.lengths[r].item() for r in keep]
    for _ in range(2):
        tokens = torch.randint(0, 64, (12,), generator=g)
        expected = engine.decode_step(tiny, full, tokens)[keep]
        got = engine.decode_step(tiny, small, tokens[keep])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_select_refuses_rows_out_of_order_or_range(tiny):
    from decodelab.core import engine

    prefix_cache, _ = engine.prefill(tiny, _prompts(), max_new_tokens=0)
    cache = SharedPrefixKVCache.fork(prefix_cache, [2, 2, 2], max_new_tokens=4)
    for rows in ([3, 1], [0, 0], [6]):
        with pytest.raises(ValueError, match="increasing distinct rows"):
            cache.select(rows)


@pytest.mark.parametrize("with_mask", [False, True])
def test_fused_block_attention_equals_the_explicit_path(with_mask):
    # The fused CPU kernel's (out, lse) equal partial_attention's in float32, an empty query row included
    # (lse -inf, so the merge gives it zero weight; the kernel itself returns 0 there).
    from decodelab.core.shared_prefix import block_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, m, 16, generator=g) for m in (5, 40, 40))
    visible = None
    if with_mask:
        visible = torch.rand(2, 1, 5, 40, generator=g) < 0.6
        visible[0, 0, 2] = False  # a query that sees no key of this block
    out, lse = block_attention(q, k, v, visible, 0.25)
    want_out, want_lse = partial_attention(q, k, v, visible, 0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_mask", [False, True])
def test_fused_block_attention_in_bf16_matches_the_float32_path(with_mask):
    # bf16 goes through the fused kernel: its lse stays float32, its output equals the float32 explicit path
    # on the same (bf16-rounded) inputs up to one bf16 rounding of the output.
    from decodelab.core.shared_prefix import block_attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, m, 16, generator=g).bfloat16() for m in (5, 40, 40))
    visible = None
    if with_mask:
        visible = torch.rand(2, 1, 5, 40, generator=g) < 0.6
        visible[1, 0, 3] = False
    out, lse = block_attention(q, k, v, visible, 0.25)
    want_out, want_lse = partial_attention(q.float(), k.float(), v.float(), visible, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out, rtol=8e-3, atol=8e-3)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-4, atol=1e-4)


def test_shared_prefix_attention_equals_per_row_attention_at_decode_shapes():
    # One decode step of 16 rows over a 300-token shared prompt (the embedded model's heads: 9 query, 3 KV),
    # float32 through the fused path: equal to standard attention over each row's own copy to 1e-5.
    g = torch.Generator().manual_seed(7)
    n, prefix_len, suffix_len = 16, 300, 9
    q = torch.randn(n, 9, 1, 64, generator=g)
    pk, pv = (torch.randn(1, 3, prefix_len, 64, generator=g) for _ in range(2))
    sk, sv = (torch.randn(n, 3, suffix_len, 64, generator=g) for _ in range(2))
    for suffix_mask in (None, torch.ones(n, 1, suffix_len, dtype=torch.bool)):
        got = shared_prefix_attention(q, pk, pv, sk, sv, suffix_mask, row_counts=[n])
        want = _reference(q, pk, pv, torch.ones(1, prefix_len, dtype=torch.bool), sk, sv,
                          torch.ones(n, 1, suffix_len, dtype=torch.bool), [n])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_is_exact_softmax_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 3, 4, dtype=torch.float64, generator=g), torch.randn(2, 9, 4, dtype=torch.float64,
                                                                                generator=g), \
        torch.randn(2, 9, 4, dtype=torch.float64, generator=g)
    ones = lambda s: torch.ones(2, 3, s, dtype=torch.bool)  # noqa: E731
    a, b, whole = partial_attention(q, k[:, :4], v[:, :4], ones(4), 1.0), \
        partial_attention(q, k[:, 4:], v[:, 4:], ones(5), 1.0), partial_attention(q, k, v, ones(9), 1.0)
    torch.testing.assert_close(merge_attention(*a, *b), whole[0], rtol=1e-12, atol=1e-12)
