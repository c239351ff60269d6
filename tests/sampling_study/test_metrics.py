"""Properties of the diversity / quality metrics, the bootstrap and the Pareto frontier."""
import math

import numpy as np
import pytest
import torch

from decodelab.common import stats
from decodelab.sampling_study import metrics


def test_distinct_n_counts_unique_over_total_ngrams():
    texts = [["a", "b", "a", "b"], ["a", "b"]]
    # bigrams: ab, ba, ab | ab -> 2 unique of 4
    assert metrics.distinct_n(texts, 2) == pytest.approx(2 / 4)
    assert metrics.distinct_n(texts, 1) == pytest.approx(2 / 6)
    assert metrics.distinct_n(["the cat sat", "a dog ran"], 1) == 1.0


def test_distinct_n_is_zero_without_ngrams():
    assert metrics.distinct_n([["a"]], 2) == 0.0


def test_bleu_of_identical_sentence_is_one():
    s = "the quick brown fox jumps over the lazy dog".split()
    assert metrics.bleu(s, [s]) == pytest.approx(1.0)


def test_bleu_matches_hand_computed_value():
    hyp = "a b c d e".split()
    ref = "a b c x e".split()
    # clipped precisions: 1-grams 4/5, 2-grams 2/4, 3-grams 1/3, 4-grams 0/2 -> epsilon 0.1/2; BP = 1
    expected = math.exp((math.log(4 / 5) + math.log(2 / 4) + math.log(1 / 3) + math.log(0.1 / 2)) / 4)
    assert metrics.bleu(hyp, [ref]) == pytest.approx(expected)


def test_bleu_brevity_penalty_uses_closest_reference_length():
    hyp = "a b c d".split()
    refs = ["a b c d e f g h".split(), "a b c d e".split()]
    # precisions all 1; closest reference length is 5 -> BP = exp(1 - 5/4)
    assert metrics.bleu(hyp, refs) == pytest.approx(math.exp(1 - 5 / 4))


def test_self_bleu_is_one_for_copies_and_lower_for_varied_texts():
    same = ["the cat sat on the mat today"] * 3
    varied = ["the cat sat on the mat today", "rain fell over the quiet harbour", "seven engineers wrote code"]
    assert metrics.self_bleu(same) == pytest.approx(1.0)
    assert metrics.self_bleu(varied) < 0.2


def test_self_bleu_rejects_single_text():
    with pytest.raises(ValueError, match="len\\(texts\\)=1"):
        metrics.self_bleu(["only one"])


def test_embedding_diversity_is_mean_pairwise_cosine_distance():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    # pairs: (0,1) 1, (0,2) 2, (1,2) 1 -> 4/3
    assert metrics.embedding_diversity(e) == pytest.approx(4 / 3)
    assert metrics.embedding_diversity(torch.ones(4, 3)) == pytest.approx(0.0, abs=1e-6)


def test_coherence_is_rowwise_cosine():
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    c = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    assert torch.allclose(metrics.coherence(p, c), torch.tensor([1.0, 1 / math.sqrt(2)]))


def test_bootstrap_ci_contains_mean_and_narrows_with_more_units():
    rng = np.random.default_rng(0)
    small, large = rng.normal(size=20), rng.normal(size=2000)
    est, lo, hi = stats.bootstrap_ci(small)
    assert lo <= est <= hi and est == pytest.approx(small.mean())
    _, lo2, hi2 = stats.bootstrap_ci(large)
    assert hi2 - lo2 < hi - lo


def test_paired_bootstrap_cancels_shared_unit_effects():
    rng = np.random.default_rng(1)
    unit = rng.normal(scale=10, size=200)  # large per-unit difficulty shared by both arms
    a, b = unit + 0.5, unit + rng.normal(scale=0.1, size=200)
    result = stats.paired_bootstrap_diff(a, b)
    assert result["ci_low"] > 0.3 and result["ci_high"] < 0.7 and result["excludes_zero"]
    same = stats.paired_bootstrap_diff(unit, unit)
    assert same["difference"] == 0 and not same["excludes_zero"]


def test_paired_bootstrap_rejects_unpaired_shapes():
    with pytest.raises(ValueError, match="a.shape"):
        stats.paired_bootstrap_diff([1, 2, 3], [1, 2])


def test_pareto_frontier_keeps_exactly_the_non_dominated_points():
    x = [0.1, 0.2, 0.3, 0.15, 0.3]
    y = [0.9, 0.8, 0.5, 0.7, 0.4]
    # (0.15, 0.7) is dominated by (0.2, 0.8); (0.3, 0.4) by (0.3, 0.5)
    assert stats.pareto_frontier(x, y) == [0, 1, 2]


def test_interpolate_at_does_not_extrapolate():
    assert stats.interpolate_at([0, 1, 2], [0, 10, 20], 1.5) == pytest.approx(15)
    assert math.isnan(stats.interpolate_at([0, 1], [0, 1], 2.0))


def test_continuation_nll_is_independent_of_batch_padding(tiny):
    model = tiny.hf_model
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    conts = [[20, 21], [22, 23, 24, 25], [26]]
    batched = metrics.continuation_nll(model, prompts, conts, batch_size=3)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        tokens = torch.tensor([p + c])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=tokens).logits[0].float(), -1)
        expected = -torch.stack([logp[len(p) - 1 + t, c[t]] for t in range(len(c))]).mean()
        assert batched[i] == pytest.approx(float(expected), abs=1e-4)


def test_embedder_is_re_exported_from_common():
    from decodelab.common import embeddings

    assert metrics.load_embedder is embeddings.load_embedder and metrics.Embedder is embeddings.Embedder
    assert metrics.EMBEDDER_PACKAGE == embeddings.EMBEDDER_PACKAGE


@pytest.mark.slow
def test_embedder_gives_unit_vectors_and_ranks_paraphrase_closer():
    from decodelab.common.embeddings import load_embedder

    embed = load_embedder()
    e = embed(["A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock markets fell sharply today."])
    assert e.shape == (3, 384)
    assert torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    sims = e @ e.T
    assert sims[0, 1] > sims[0, 2] + 0.2


def test_kept_sets_of_the_widget_follow_the_thresholds():
    from decodelab.sampling_study import widgets

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sets = widgets.kept_sets(logits, temperature=1.0, top_p=0.7, min_p=0.2)
    assert sets["top_p"].tolist() == [True, True, False, False]  # 0.5 + 0.3 >= 0.7
    assert sets["min_p"].tolist() == [True, True, True, False]  # p >= 0.2 * 0.5
    assert torch.allclose(sets["probs"], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_static_explorer_draws_one_panel_per_setting():
    import matplotlib

    matplotlib.use("Agg")
    from decodelab.sampling_study import widgets

    dist = widgets.NextToken(context="", logits=torch.randn(50, generator=torch.Generator().manual_seed(0)))
    fig = widgets.kept_set_explorer(dist, None, interactive=False, static_settings=[(1.0, 0.9, 0.1), (2.0, 0.9, 0.1)])
    assert len(fig.axes) == 2


# --- power and sample size of a paired comparison ---------------------------------------------------


@pytest.mark.parametrize("sd,half_width", [(0.5, 0.1), (0.35, 0.1), (1.0, 0.05), (0.2, 0.3)])
def test_required_pairs_is_the_smallest_n_meeting_the_half_width(sd, half_width):
    n = stats.required_pairs(sd, half_width)
    z = stats.z_value(0.95)
    assert z * sd / math.sqrt(n) <= half_width + 1e-12
    assert n == 2 or z * sd / math.sqrt(n - 1) > half_width


def test_required_pairs_rejects_a_non_positive_half_width():
    with pytest.raises(ValueError, match="half_width"):
        stats.required_pairs(0.5, 0.0)
    with pytest.raises(ValueError, match="sd_of_differences"):
        stats.required_pairs(float("nan"), 0.1)


def test_minimum_detectable_difference_is_z_sum_times_the_standard_error():
    # (1.959964 + 0.841621) * 0.5 / sqrt(100)
    assert stats.minimum_detectable_difference(0.5, 100) == pytest.approx(0.1400792, rel=1e-6)
    assert stats.minimum_detectable_difference(0.5, 400) == pytest.approx(0.1400792 / 2, rel=1e-6)
    assert math.isnan(stats.minimum_detectable_difference(0.5, 1))


def test_mdd_from_a_normal_interval_equals_the_analytic_mdd():
    sd, n = 0.4, 80
    half = stats.z_value(0.95) * sd / math.sqrt(n)
    assert stats.mdd_from_interval(0.03 - half, 0.03 + half) == pytest.approx(
        stats.minimum_detectable_difference(sd, n))


def test_sd_of_differences_pairs_units_and_needs_two():
    a, b = np.array([1.0, 0, 1, 1]), np.array([0.0, 0, 1, 0])
    assert stats.sd_of_differences(a, b) == pytest.approx(np.std(a - b, ddof=1))
    assert math.isnan(stats.sd_of_differences([1.0], [0.0]))


def test_planning_sd_is_at_least_one_discordant_unit_for_bounded_values():
    assert stats.planning_sd(0.0, 25) == pytest.approx(0.2)
    assert stats.planning_sd(0.5, 25) == 0.5
    assert stats.planning_sd(0.0, 25, bounded=False) == 0.0
    one_discordant = np.r_[1.0, np.zeros(24)]
    assert stats.sd_of_differences(one_discordant, np.zeros(25)) == pytest.approx(0.2)


def test_interpolate_at_a_missing_target_is_nan():
    assert math.isnan(stats.interpolate_at([0.0, 1.0], [0.0, 1.0], float("nan")))
