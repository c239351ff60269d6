"""Finished rows riding along in a batch skip the linear layers (`Transformer.forward(rows=)`, `engine.live_rows`):
the live rows' logits equal the whole batch's bit for bit, and greedy decoding is unchanged."""
import pytest
import torch

from decodelab.core import engine
from decodelab.core.models import tiny_model
from decodelab.core.transformer import Transformer
from decodelab.speculation import decode as speculative
from decodelab.speculation.drafters import LayerSkipDrafter, NGramDrafter


def _batch(seed=0, rows=6, length=9):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length + i,), generator=g).tolist() for i in range(rows)]


@pytest.mark.parametrize("n_tokens", [1, 3])
@pytest.mark.parametrize("live", [[1, 4], [0, 1, 2, 4, 5]])  # single rows; runs of consecutive rows
def test_live_rows_logits_and_cache_equal_the_whole_batch_forward(tiny, n_tokens, live):
    tr = tiny.transformer
    prompts = _batch()
    rows = torch.tensor(live)
    caches, outs = [], []
    for use_rows in (None, rows):
        cache, _ = engine.prefill(tr, prompts, max_new_tokens=8)
        tokens = torch.randint(3, 256, (len(prompts), n_tokens), generator=torch.Generator().manual_seed(1))
        outs.append(tr.forward(tokens, cache, rows=use_rows))
        caches.append(cache)
    full, live = outs
    assert torch.equal(live[rows], full[rows])  # bit for bit on the packed (row-invariant) path
    others = torch.ones(len(prompts), dtype=torch.bool).index_fill_(0, rows, False)
    assert bool((live[others] == 0).all())
    assert torch.equal(caches[0].lengths, caches[1].lengths)  # every row advanced
    span = int(caches[0].lengths.max())
    for r in rows.tolist():  # the live rows' keys and values are the whole batch's
        assert torch.equal(caches[0].keys[:, r, :, :span], caches[1].keys[:, r, :, :span])
        assert torch.equal(caches[0].values[:, r, :, :span], caches[1].values[:, r, :, :span])


def test_rows_need_the_row_invariant_linear_path(tiny):
    unpacked = Transformer(tiny.hf_model, pack_linears=False)
    cache, _ = engine.prefill(unpacked, _batch(rows=2), max_new_tokens=4)
    with pytest.raises(ValueError, match="rows= needs the packed CPU linear path"):
        unpacked.forward(torch.ones(2, 1, dtype=torch.long), cache, rows=torch.tensor([0]))


def test_live_rows_only_when_few_rows_are_live_and_the_path_is_exact(tiny):
    assert engine.live_rows(tiny, [True] * 4) is None and engine.live_rows(tiny, [True, True, True, False]) is None
    assert engine.live_rows(tiny, [True, False, True, False]).tolist() == [0, 2]
    assert engine.live_rows(tiny, [False] * 4) is None
    other = tiny_model(seed=0)
    other.transformer.linear.enabled = False
    assert engine.live_rows(other, [True, False, False, False]) is None


def _spy_rows(monkeypatch):
    seen = []
    forward = engine.TokenLoop.forward
    monkeypatch.setattr(engine.TokenLoop, "forward", lambda self, feed: seen.append(feed.rows) or forward(self, feed))
    return seen


def test_greedy_decodes_with_rows_that_finish_early_equal_each_row_alone(tiny, monkeypatch):
    prompts = _batch(rows=4)
    free = engine.generate(tiny, prompts, max_new_tokens=10, eos_token_ids=[])
    eos = [free.tokens[0][1], free.tokens[1][2], free.tokens[2][3]]  # three of four rows end early
    solo = [engine.generate(tiny, [p], max_new_tokens=10, eos_token_ids=eos).tokens[0] for p in prompts]
    seen = _spy_rows(monkeypatch)
    plain = engine.generate(tiny, prompts, max_new_tokens=10, eos_token_ids=eos)
    spec = speculative.generate(tiny, prompts, NGramDrafter(), k=3, max_new_tokens=10, eos_token_ids=eos)
    assert plain.tokens == solo and spec.tokens == solo and sum(map(len, solo)) < 40
    assert any(r is not None for r in seen)  # some steps ran the linear layers on the live rows only


def test_a_model_drafter_skips_finished_rows_and_stays_exact(tiny, monkeypatch):
    prompts = _batch(rows=4)
    free = engine.generate(tiny, prompts, max_new_tokens=10, eos_token_ids=[])
    eos = [free.tokens[0][1], free.tokens[1][2], free.tokens[2][3]]
    solo = [engine.generate(tiny, [p], max_new_tokens=10, eos_token_ids=eos).tokens[0] for p in prompts]
    drafter = LayerSkipDrafter(tiny, [0, 1, 3])
    calls = []
    logits = drafter._logits
    monkeypatch.setattr(drafter, "_logits", lambda *a, **kw: calls.append(kw.get("rows", a[2] if len(a) > 2 else None))
                        or logits(*a, **kw))
    spec = speculative.generate(tiny, prompts, drafter, k=3, max_new_tokens=10, eos_token_ids=eos)
    assert spec.tokens == solo
    assert any(r is not None for r in calls) and any(r is None for r in calls)  # drafted for live rows only at the end
