"""The decode engine against transformers, and the cache properties speculative decoding relies on."""
import pytest
import torch

from decodelab.core.engine import decode_step, generate, prefill, verify_step

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200]]


def hf_greedy(hf_model, prompt, max_new_tokens, eos_token_id=None):
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate_token_for_token(tiny):
    result = generate(tiny, PROMPTS, max_new_tokens=24, eos_token_ids=[])
    for prompt, tokens in zip(PROMPTS, result.tokens):
        assert tokens == hf_greedy(tiny.hf_model, prompt, 24)


def test_ragged_batch_equals_each_row_alone(tiny):
    batched = generate(tiny, PROMPTS, max_new_tokens=16, eos_token_ids=[]).tokens
    alone = [generate(tiny, [p], max_new_tokens=16, eos_token_ids=[]).tokens[0] for p in PROMPTS]
    assert batched == alone


def test_logits_match_transformers_forward(tiny):
    tokens = torch.tensor([PROMPTS[2]])
    cache, last = prefill(tiny, [PROMPTS[2]], max_new_tokens=1)
    reference = tiny.hf_model(tokens).logits[:, -1]
    torch.testing.assert_close(last, reference, atol=1e-4, rtol=1e-4)


def test_verify_step_equals_sequential_decode_steps(tiny):
    drafts = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6], [4, 4, 4, 4], [100, 101, 102, 103]])
    cache_a, _ = prefill(tiny, PROMPTS, max_new_tokens=8)
    cache_b, _ = prefill(tiny, PROMPTS, max_new_tokens=8)
    together = verify_step(tiny, cache_a, drafts)
    one_by_one = torch.stack([decode_step(tiny, cache_b, drafts[:, t]) for t in range(drafts.shape[1])], dim=1)
    torch.testing.assert_close(together, one_by_one, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_a.lengths, cache_b.lengths)


def test_truncate_rolls_a_row_back_exactly(tiny):
    cache, _ = prefill(tiny, PROMPTS, max_new_tokens=8)
    start = cache.lengths.clone()
    expected = decode_step(tiny, cache, torch.tensor([7, 7, 7, 7]))
    verify_step(tiny, cache, torch.tensor([[1, 2, 3]] * 4))  # drafts that get rejected
    cache.truncate(start)
    again = decode_step(tiny, cache, torch.tensor([7, 7, 7, 7]))
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.lengths, start + 1)


def test_rows_roll_back_independently(tiny):
    cache, _ = prefill(tiny, PROMPTS, max_new_tokens=8)
    start = cache.lengths.clone()
    verify_step(tiny, cache, torch.tensor([[1, 2, 3]] * 4))
    keep = torch.tensor([0, 1, 2, 3])  # row r keeps r of the 3 drafts
    cache.truncate(start + keep)
    logits = decode_step(tiny, cache, torch.tensor([50, 50, 50, 50]))
    for row, prompt in enumerate(PROMPTS):
        _, alone = prefill(tiny, [prompt + [1, 2, 3][: int(keep[row])] + [50]], max_new_tokens=1)
        torch.testing.assert_close(logits[row], alone[0], atol=1e-4, rtol=1e-4)


def test_layer_subset_with_all_layers_equals_full_forward(tiny):
    every = list(range(tiny.transformer.n_layers))
    _, full = prefill(tiny, PROMPTS, max_new_tokens=1)
    _, subset = prefill(tiny, PROMPTS, max_new_tokens=1, layers=every)
    torch.testing.assert_close(subset, full)
    _, skipped = prefill(tiny, PROMPTS, max_new_tokens=1, layers=[0, 1])
    assert not torch.allclose(skipped, full)


def test_hidden_state_is_what_the_lm_head_reads(tiny):
    tr = tiny.transformer
    cache = tr.new_cache(1, 16)
    logits, hidden = tr.forward(torch.tensor([PROMPTS[0]]), cache, return_hidden=True)
    reference = tiny.hf_model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(hidden, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, tr.lm_head(hidden))


def test_rows_stop_at_eos_and_nothing_follows(tiny):
    free = generate(tiny, PROMPTS, max_new_tokens=12, eos_token_ids=[]).tokens
    eos = free[0][3]  # make row 0's fourth token the EOS
    stopped = generate(tiny, PROMPTS, max_new_tokens=12, eos_token_ids=[eos])
    assert stopped.tokens[0] == free[0][:4] and stopped.finished[0]
    for full, cut in zip(free, stopped.tokens):
        assert cut == (full[: full.index(eos) + 1] if eos in full else full)
    assert stopped.stats.new_tokens == sum(len(t) for t in stopped.tokens)


def test_stats_count_steps_and_time(tiny):
    result = generate(tiny, PROMPTS, max_new_tokens=10, eos_token_ids=[])
    stats = result.stats
    assert len(stats.step_s) == 9 and stats.new_tokens == 40
    assert stats.prefill_s > 0 and stats.tokens_per_s > 0


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_max_new_tokens_must_be_positive_integer(tiny, bad):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny, PROMPTS, max_new_tokens=bad)


def test_empty_batch_is_rejected(tiny):
    with pytest.raises(ValueError, match="batch size"):
        generate(tiny, [], max_new_tokens=4)


def test_cache_overflow_is_a_clear_error(tiny):
    cache = tiny.transformer.new_cache(1, 4)
    with pytest.raises(ValueError, match="max_len"):
        tiny.transformer.forward(torch.tensor([[1, 2, 3, 4, 5]]), cache)


@pytest.mark.slow
def test_embedded_model_greedy_matches_transformers(smol, chat_ids):
    result = generate(smol, chat_ids, max_new_tokens=24)
    for prompt, tokens in zip(chat_ids, result.tokens):
        reference = hf_greedy(smol.hf_model, prompt, 24, eos_token_id=smol.eos_token_ids)
        assert tokens == reference[: len(tokens)]
        assert len(tokens) == 24 or tokens[-1] in smol.eos_token_ids
    assert "Paris" in smol.tokenizer.decode(result.tokens[0])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_transformers_module_bit_for_bit(tiny, dtype):
    import copy

    from decodelab.core.engine import as_transformer
    from decodelab.core.transformer import rms_norm

    tr = as_transformer(tiny)
    assert type(tr.final_norm).__name__ == "LlamaRMSNorm"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for source in (tr.final_norm, tr.layers[0].input_layernorm):
            norm = copy.deepcopy(source).to(dtype)  # the fixture's own modules stay untouched
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.5 + 1)  # not all ones
            for scale in (1e-3, 1.0, 50.0):
                x = (torch.randn(4, 3, tr.hidden_size, generator=g) * scale).to(dtype)
                assert torch.equal(rms_norm(norm, x), norm(x))
