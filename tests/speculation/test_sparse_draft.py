"""The sparse-KV self-draft: greedy speculative output equals plain greedy with it (ragged rows, fixed and
per-row k), its prefill equals a dense prefill, a window as wide as the context drafts what the full model
drafts, and bad sink/window values fail before any forward."""
import pytest
import torch

from decodelab.core import engine
from decodelab.speculation import decode as speculative
from decodelab.speculation import sparse_draft
from decodelab.speculation.drafters import Drafter, LayerSkipDrafter
from decodelab.speculation.row_policy import RowBudgetPolicy
from decodelab.speculation.sparse_draft import SparseKVDrafter, common_prefix_length, prefill_once


def _prompts(batch, shared=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 256, (shared,), generator=g).tolist()
    lengths = [14, 23, 17, 19][:batch]
    rows = [head + torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    return [p + p[-8:] for p in rows]


@pytest.mark.parametrize("batch,shared", [(1, 0), (3, 0), (3, 12)])
@pytest.mark.parametrize("k", [1, 3, "rows"])
def test_greedy_speculative_with_the_sparse_draft_equals_plain(tiny, batch, shared, k):
    prompts = _prompts(batch, shared)
    ref = engine.generate(tiny, prompts, max_new_tokens=20, eos_token_ids=[])
    policy = k if k != "rows" else RowBudgetPolicy(lambda b, n, s: 1.0, verify_budget=batch + 2)
    drafter = SparseKVDrafter(tiny, sink=2, window=5)
    assert isinstance(drafter, Drafter)
    out = speculative.generate(tiny, prompts, drafter, k=policy, max_new_tokens=20, eos_token_ids=[])
    assert out.tokens == ref.tokens


def test_prefill_once_equals_a_batched_prefill(tiny):
    prompts = _prompts(3, shared=12)
    assert common_prefix_length(prompts) == 12
    dense, logits, hidden = engine.prefill(tiny, prompts, max_new_tokens=4, return_hidden=True)
    once, logits_once, hidden_once = prefill_once(tiny, prompts, max_len=dense.max_len, return_hidden=True)
    assert once.lengths.tolist() == dense.lengths.tolist()
    assert torch.allclose(logits_once, logits, atol=1e-4)
    for b, p in enumerate(prompts):
        n = len(p)
        assert torch.allclose(once.keys[:, b, :, :n], dense.keys[:, b, :, :n], atol=1e-5)
        assert torch.allclose(hidden_once[b, :n], hidden[b, :n], atol=1e-4)


def test_a_window_covering_the_context_drafts_like_the_full_model(tiny, monkeypatch):
    monkeypatch.setattr(sparse_draft, "check_sink_window", lambda *args, **kwargs: None)  # allow window > context
    prompts = _prompts(3)
    wide = SparseKVDrafter(tiny, sink=0, window=64)
    full = LayerSkipDrafter(tiny, range(tiny.transformer.n_layers))
    a = speculative.generate(tiny, prompts, wide, k=3, max_new_tokens=12, eos_token_ids=[])
    b = speculative.generate(tiny, prompts, full, k=3, max_new_tokens=12, eos_token_ids=[])
    assert a.stats.tau == b.stats.tau == 4.0  # the target drafting for itself accepts every draft


def test_a_narrow_window_drafts_differently_than_the_full_model(tiny):
    prompts = _prompts(3)
    narrow = speculative.generate(tiny, prompts, SparseKVDrafter(tiny, sink=1, window=2), k=3, max_new_tokens=12,
                                  eos_token_ids=[])
    assert narrow.stats.tau < 4.0  # a test that could not fail would draft with the full context


def test_bad_sink_or_window_fails_before_any_forward(tiny):
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        SparseKVDrafter(tiny, window=0)
    drafter = SparseKVDrafter(tiny, sink=4, window=40)
    with pytest.raises(ValueError, match=r"sink=4 \+ window=40 = 44 positions is larger than the context \(22"):
        speculative.generate(tiny, _prompts(3), drafter, k=2, max_new_tokens=4, eos_token_ids=[])
