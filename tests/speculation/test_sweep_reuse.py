"""What the sweep shares between runs: one prefill per distinct prompt, a model drafter's prompt cache."""
import torch

from decodelab.core import engine
from decodelab.speculation import decode as speculative
from decodelab.speculation.drafters import DraftContext, LayerSkipDrafter


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 8)]


def test_a_batch_repeating_prompts_prefills_each_once_and_decodes_like_a_full_prefill(tiny, monkeypatch):
    distinct = _prompts()
    prompts = [distinct[i] for i in (0, 1, 0, 2, 1, 0)]
    seen = []
    original = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda tr, ps, **kw: seen.append(len(ps)) or original(tr, ps, **kw))
    pre = speculative.prefill(tiny, prompts, max_new_tokens=6)
    assert seen == [3]  # the distinct prompts only
    monkeypatch.setattr(engine, "prefill", original)
    full = speculative.prefill(tiny, [list(p) for p in prompts] + [[5]], max_new_tokens=6)  # no repeats: full
    assert pre.prompt_lengths.tolist() == [len(p) for p in prompts]
    assert torch.allclose(pre.last_logits, full.last_logits[:6], atol=1e-5)
    for b, p in enumerate(prompts):
        n = len(p)
        assert torch.allclose(pre.cache.keys[:, b, :, :n], full.cache.keys[:, b, :, :n], atol=1e-5)
    ref = engine.generate(tiny, prompts, max_new_tokens=6, eos_token_ids=[]).tokens
    out = speculative.generate(tiny, drafter=None, k=0, prefilled=pre, max_new_tokens=6, eos_token_ids=[])
    assert out.tokens == ref


def test_a_model_drafter_begun_again_on_the_same_prompts_reuses_its_prompt_cache(tiny, monkeypatch):
    prompts = _prompts()
    reused, fresh = LayerSkipDrafter(tiny, layers=[0, 2]), LayerSkipDrafter(tiny, layers=[0, 2])
    reused.begin(prompts, max_len=40)
    grown = [p + [7, 8, 9] for p in prompts]
    reused.propose(DraftContext(tokens=grown), 3)  # advances (and dirties) the draft cache past the prompts
    calls = []
    forward = type(reused.tr).forward
    monkeypatch.setattr(reused.tr, "forward", lambda *a, **kw: calls.append(1) or forward(reused.tr, *a, **kw))
    reused.begin(prompts, max_len=40)
    assert calls == [] and reused.cache.lengths.tolist() == [len(p) for p in prompts]
    fresh.begin(prompts, max_len=40)
    ctx = DraftContext(tokens=[p + [11] for p in prompts])
    assert torch.equal(reused.propose(ctx, 3).tokens, fresh.propose(ctx, 3).tokens)
    reused.begin(grown, max_len=40)  # other prompts: prefilled anew
    assert calls and reused.cache.lengths.tolist() == [len(p) for p in grown]


def test_drafters_sharing_prefills_copy_one_prefill_of_the_same_model_layers_and_prompts(tiny, monkeypatch):
    prompts = _prompts()
    prefills = {}
    first, second = (LayerSkipDrafter(tiny, layers=[0, 2]).share_prefills(prefills) for _ in range(2))
    other_layers = LayerSkipDrafter(tiny, layers=[0, 1]).share_prefills(prefills)
    fresh = LayerSkipDrafter(tiny, layers=[0, 2])
    first.begin(prompts, max_len=40)
    first.propose(DraftContext(tokens=[p + [7, 8, 9] for p in prompts]), 3)  # dirties its cache past the prompts
    calls = []
    forward = type(first.tr).forward
    monkeypatch.setattr(first.tr, "forward", lambda *a, **kw: calls.append(1) or forward(first.tr, *a, **kw))
    second.begin(prompts, max_len=40)
    assert calls == [] and second.cache is not first.cache  # a copy: the two decode side by side
    assert second.cache.lengths.tolist() == [len(p) for p in prompts]
    other_layers.begin(prompts, max_len=40)  # another layer subset: its own prefill
    assert calls
    fresh.begin(prompts, max_len=40)
    for b, p in enumerate(prompts):
        n = len(p)
        assert torch.equal(second.cache.keys[:, b, :, :n], fresh.cache.keys[:, b, :, :n])
        assert torch.equal(second.cache.values[:, b, :, :n], fresh.cache.values[:, b, :, :n])
    ctx = DraftContext(tokens=[p + [11] for p in prompts])
    assert torch.equal(second.propose(ctx, 3).tokens, fresh.propose(ctx, 3).tokens)
