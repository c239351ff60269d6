"""Drafters: prompt lookup, layer-skip self-drafting, draft models (and where the draft model comes from)."""
import pytest
import torch

from decodelab.core import engine
from decodelab.speculation.draft_models import check_same_tokenizer, truncated_model
from decodelab.speculation.drafters import DraftContext, Drafter, LayerSkipDrafter, ModelDrafter, NGramDrafter


def test_ngram_proposes_what_followed_the_latest_occurrence():
    d = NGramDrafter(max_ngram=2)
    seq = [1, 2, 3, 7, 1, 2, 4, 8, 9, 1, 2]
    d.begin([seq])
    prop = d.propose(DraftContext(tokens=[seq]), 3)
    assert prop.tokens.tolist() == [[4, 8, 9]] and prop.lengths.tolist() == [3]


def test_ngram_earliest_match_proposes_what_followed_the_first_occurrence():
    d = NGramDrafter(max_ngram=2, match="earliest")
    seq = [1, 2, 3, 7, 1, 2, 4, 8, 9, 1, 2]
    d.begin([seq])
    assert d.propose(DraftContext(tokens=[seq]), 3).tokens.tolist() == [[3, 7, 1]]
    with pytest.raises(ValueError, match="match"):
        NGramDrafter(match="first")


def test_ngram_continuation_wraps_around_a_repeating_tail():
    d = NGramDrafter()
    seq = [5, 6, 5, 6, 5]
    d.begin([seq])
    assert d.propose(DraftContext(tokens=[seq]), 5).tokens.tolist() == [[6, 5, 6, 5, 6]]


def test_ngram_without_a_match_proposes_nothing_per_row():
    d = NGramDrafter(min_ngram=2)
    rows = [[1, 2, 3, 4], [1, 2, 1, 2]]
    d.begin(rows)
    prop = d.propose(DraftContext(tokens=rows), 2)
    assert prop.lengths.tolist() == [0, 2]
    assert prop.tokens[1].tolist() == [1, 2]


def test_ngram_proposals_carry_the_order_of_the_ngram_they_continue():
    d = NGramDrafter(max_ngram=3)
    rows = [[1, 2, 3, 9, 1, 2, 3], [4, 5, 6, 5], [7, 8, 9, 10]]  # a 3-gram match, a 1-gram match, none
    d.begin(rows)
    prop = d.propose(DraftContext(tokens=rows), 2)
    assert prop.kinds.tolist() == [3, 1, 0] and prop.lengths.tolist() == [2, 2, 0]
    assert prop.tokens[:2].tolist() == [[9, 1], [6, 5]]


def test_every_drafter_implements_the_protocol(tiny):
    for d in (NGramDrafter(), LayerSkipDrafter(tiny, [0, 1]), ModelDrafter(truncated_model(tiny, 2), tiny)):
        assert isinstance(d, Drafter)


def test_full_layer_self_draft_proposes_the_targets_greedy_continuation(tiny):
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    ref = engine.generate(tiny, prompts, max_new_tokens=5, eos_token_ids=[])
    d = LayerSkipDrafter(tiny, range(tiny.transformer.n_layers))
    d.begin(prompts, max_len=32)
    ctx = DraftContext(tokens=[p + r[:1] for p, r in zip(prompts, ref.tokens)])
    assert d.propose(ctx, 4).tokens.tolist() == [r[1:5] for r in ref.tokens]


def test_truncated_model_equals_layer_subset_of_the_target(tiny):
    small = truncated_model(tiny, 2)
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        hf_logits = small.hf_model(tokens).logits
    cache = tiny.transformer.new_cache(1, 8, n_layers=2)
    ours = tiny.transformer.forward(tokens, cache, layers=[0, 1])
    torch.testing.assert_close(hf_logits, ours, atol=1e-4, rtol=1e-4)
    assert small.hf_model.model.layers[0] is tiny.hf_model.model.layers[0]  # shared, not copied


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_draft_with_a_different_tokenizer_is_refused(tiny):
    from decodelab.core.models import LoadedModel

    target = LoadedModel("t", tiny.hf_model, _Tok({"a": 0, "b": 1}), tiny.transformer)
    draft = LoadedModel("d", tiny.hf_model, _Tok({"a": 0, "c": 1}), tiny.transformer)
    with pytest.raises(ValueError, match="different tokenizer"):
        check_same_tokenizer(target, draft)
    check_same_tokenizer(target, LoadedModel("d2", tiny.hf_model, _Tok({"a": 0, "b": 1}), tiny.transformer))


def test_sampled_drafts_take_each_rows_uniforms_from_its_own_generator(tiny):
    from decodelab.core.sampling import Sampler, SamplerConfig
    from decodelab.speculation.drafters import DraftContext, LayerSkipDrafter

    prompt = [5, 9, 14, 5, 9, 20, 31]
    sampler = Sampler(SamplerConfig(temperature=1.5))

    def drafts(seeds):
        d = LayerSkipDrafter(tiny, [0, 1])
        d.begin([prompt, prompt], max_len=32)
        ctx = DraftContext(tokens=[prompt + [3], prompt + [3]], sampler=sampler,
                           generator=[torch.Generator().manual_seed(s) for s in seeds])
        return d.propose(ctx, 4).tokens

    base, other = drafts([1, 2]), drafts([1, 3])
    assert torch.equal(base[0], other[0])  # row 0 reads generator 0 only
    assert torch.equal(drafts([2, 2])[0], base[1])  # identical rows with identical generators draft alike


def test_draft_inverse_cdf_walks_token_ids_in_order_unlike_the_samplers_ranked_draw():
    from decodelab.core.sampling import sample_inverse_cdf
    from decodelab.speculation.verify import inverse_cdf

    probs = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.0, 0.5]])
    u = torch.tensor([0.25, 0.5])
    # smallest id whose cumulative mass (in id order) exceeds u * total: 0.1, 0.3 > 0.25 -> 1; 0.5, 0.5, 1.0 > 0.5 -> 2
    assert inverse_cdf(probs, u).tolist() == [1, 2]
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [0, 0]
    # core.sampling's draw ranks tokens by probability and reads 1 - u: the same uniforms pick other tokens, so
    # the drafters and the verifier keep verify.inverse_cdf (merging would change every sampled speculative run)
    ranked = sample_inverse_cdf(probs.log(), torch.tensor([0.0, 0.0]))
    assert ranked.tolist()[0] == 2 and not torch.equal(ranked, inverse_cdf(probs, torch.tensor([0.0, 0.0])))


def test_make_drafter_fills_in_the_notebooks_defaults(tiny):
    from decodelab.speculation.draft_models import default_draft_layers, draft_model_for
    from decodelab.speculation.drafters import default_skip_layers, make_drafter

    n = tiny.transformer.n_layers
    assert default_skip_layers(12) == [0, 1, 2, 3, 5, 6, 7, 9, 10, 11]  # all but the layers at 1/3 and 2/3 depth
    assert make_drafter("layer_skip", tiny).layers == default_skip_layers(n)
    assert make_drafter("layer_skip", tiny, layers=None).layers == default_skip_layers(n)
    assert make_drafter("layer_skip", tiny, layers=[0]).layers == [0]
    assert default_draft_layers(30) == 10 and default_draft_layers(2) == 1
    d = make_drafter("draft_model", tiny)
    assert d.tr.n_layers == default_draft_layers(n) and d.model.name == f"{tiny.name}-first{default_draft_layers(n)}"
    assert make_drafter("draft_model", tiny, draft_layers=2).tr.n_layers == 2
    assert draft_model_for(tiny, name=None, n_layers=None).transformer.n_layers == default_draft_layers(n)
    shared = truncated_model(tiny, 1)
    assert make_drafter("draft_model", tiny, draft=shared, draft_layers=2).model is shared
    assert make_drafter("ngram", tiny, max_ngram=2, other=1).max_ngram == 2


def test_draft_cache_rolls_back_rejected_drafts_and_keeps_accepted_ones(tiny):
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    d = LayerSkipDrafter(tiny, [0, 1])
    d.begin(prompts, max_len=32)
    d.propose(DraftContext(tokens=[p + [11] for p in prompts]), 4)  # feeds the pending token, drafts 3 more
    assert d.cache.lengths.tolist() == [5 + 3, 4 + 3]
    d.rollback(torch.tensor([1, 4]))  # row 0 keeps 1 draft, row 1 all 4 (the 4th was never fed)
    assert d.cache.lengths.tolist() == [5 + 1, 4 + 3]
