"""The drafter's LM head over part of the vocabulary: which ids, the drafts it makes, and exact decoding with it."""
import pytest
import torch

from decodelab.core import engine
from decodelab.core.models import tiny_model
from decodelab.core.sampling import Sampler, SamplerConfig
from decodelab.core.transformer import Transformer
from decodelab.mtp import drafter as mtp_drafter
from decodelab.mtp import retrofit_train as rt
from decodelab.mtp.draft_head import DraftHead, subset_ids

VOCAB = 97


def trunk():
    return tiny_model(seed=0, vocab_size=VOCAB).hf_model


def test_subset_is_the_first_ids_and_every_prompt_token_sorted_once():
    ids = subset_ids(VOCAB, 8, [[50, 3, 50], [96, 20]])
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 20, 50, 96]
    assert subset_ids(VOCAB, 200, []).tolist() == list(range(VOCAB))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        subset_ids(VOCAB, 8, [[97]])


def test_bad_draft_vocab_is_a_clear_error():
    model = trunk()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="draft_vocab"):
            DraftHead(model.model.norm, model.lm_head, bad)


def states(n=5, seed=1):
    return torch.randn(n, trunk().config.hidden_size, generator=torch.Generator().manual_seed(seed))


def reference_logits(model, state):
    with torch.no_grad():
        return model.lm_head(model.model.norm(state)).float()


def test_greedy_draft_is_the_argmax_over_the_subset_and_the_whole_vocabulary_without_one():
    model = trunk()
    state = states()
    want = reference_logits(model, state)
    whole = DraftHead(model.model.norm, model.lm_head, None)
    whole.begin([[5, 6]])
    with torch.no_grad():
        assert torch.equal(whole.pick(state)[0], want.argmax(-1))
    part = DraftHead(model.model.norm, model.lm_head, 10)
    part.begin([[40, 90]])
    with torch.no_grad():
        tokens, probs = part.pick(state)
    masked = torch.full_like(want, float("-inf"))
    masked[:, part.ids] = want[:, part.ids]
    assert probs is None and torch.equal(tokens, masked.argmax(-1))
    assert set(tokens.tolist()) <= set(part.ids.tolist())


def test_sampled_draft_probs_are_the_samplers_over_the_subset_and_zero_elsewhere():
    model = trunk()
    state = states()
    part = DraftHead(model.model.norm, model.lm_head, 10)
    part.begin([[40, 90]])
    sampler = Sampler(SamplerConfig(temperature=0.8, top_p=0.95))
    with torch.no_grad():
        tokens, probs = part.pick(state, sampler, torch.Generator().manual_seed(0))
        masked = torch.full((state.shape[0], VOCAB), float("-inf"))
        masked[:, part.ids] = reference_logits(model, state)[:, part.ids]
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[part.ids] = False
    assert torch.all(probs[:, outside] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(state.shape[0]))
    torch.testing.assert_close(probs, sampler.probs(masked), atol=1e-6, rtol=0)
    assert bool(probs[torch.arange(state.shape[0]), tokens].gt(0).all())


def chained_module(seed=0):
    model = rt.new_module_model(trunk(), seed=seed)
    with torch.no_grad():  # a non-identity module, so the drafts differ from the trunk's own next token
        for p in model.heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model


@pytest.mark.parametrize("draft_vocab", [None, 12])
def test_speculative_decoding_with_a_part_vocabulary_drafter_stays_identical_to_plain_greedy(draft_vocab):
    from decodelab.speculation import decode as speculative

    model = chained_module()
    tr = Transformer.from_hf(model.trunk)
    prompts = [[5, 7, 9, 3, 11], [4, 4, 2], [8] * 9]
    plain = engine.generate(tr, prompts, max_new_tokens=16, eos_token_ids=[])
    drafter = mtp_drafter.MTPDrafter(model, reuse=True, draft_vocab=draft_vocab)
    out = speculative.generate(tr, prompts, drafter, k=3, max_new_tokens=16, eos_token_ids=[])
    assert out.tokens == plain.tokens
    if draft_vocab is not None:
        assert drafter.head.n_tokens < VOCAB


def test_part_vocabulary_drafts_keep_only_the_whole_vocabulary_drafts_that_lie_in_the_subset():
    """Same module, same states: a draft the whole-vocabulary head makes inside the subset is made by the
    subset head too (same logits there, so the same argmax)."""
    from decodelab.speculation.drafters import DraftContext

    model = chained_module()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    drafts = {}
    for vocab in (None, 20):
        d = mtp_drafter.MTPDrafter(model, reuse=True, draft_vocab=vocab)
        d.begin(prompts, max_len=32)
        tokens, lengths = engine.pad_prompts(prompts, torch.device("cpu"))
        with torch.no_grad():
            hidden = model.hidden(tokens)
        d.observe(hidden, lengths, torch.roll(tokens, -1, dims=1))
        drafts[vocab] = d.propose(DraftContext(tokens=prompts), 1).tokens[:, 0]
        subset = set(d.head.ids.tolist()) if d.head.ids is not None else None
    for whole, part in zip(drafts[None].tolist(), drafts[20].tolist()):
        assert part in subset
        if whole in subset:
            assert part == whole


def test_coverage_counts_output_tokens_inside_each_rows_subset():
    from decodelab.mtp.draft_head import coverage

    prompts, outputs = [[50, 60], [70]], [[1, 50, 80, 2], [70, 60]]
    # row 0 holds 0..9, 50, 60: 1, 50, 2 of 4; row 1 holds 0..9, 70: 70 of 2 (60 is row 0's)
    assert coverage(VOCAB, 10, prompts, outputs) == pytest.approx(4 / 6)
    assert coverage(VOCAB, None, prompts, outputs) == 1.0
    drafter = mtp_drafter.MTPDrafter(chained_module(), reuse=True, draft_vocab=10)
    assert drafter.vocab_coverage(prompts, outputs) == pytest.approx(4 / 6)
