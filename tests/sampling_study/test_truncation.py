"""Properties of the kept-set analysis: size and mass of what a truncation sampler keeps, entropy
matching, order of operations, and the teacher-forced logits it runs on."""
import math

import pytest
import torch

from decodelab.sampling_study import truncation


def test_kept_set_stats_measure_size_and_original_mass():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]])
    processed = torch.tensor([[1.0, 1.0, -math.inf], [1.0, -math.inf, -math.inf]])
    stats = truncation.kept_set_stats(probs, processed)
    assert stats["size"].tolist() == [2, 1]
    assert torch.allclose(stats["mass"], torch.tensor([0.8, 0.9]))
    assert torch.allclose(stats["max_prob"], torch.tensor([0.5, 0.9]))


def test_bucket_by_includes_right_edge_in_last_bucket():
    assert truncation.bucket_by([0.0, 0.49, 0.5, 1.0], [0.0, 0.5, 1.0]).tolist() == [0, 0, 1, 1]


def test_match_entropy_finds_min_p_with_equal_mean_entropy():
    from decodelab.core.sampling import SamplerConfig

    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(0)) * 2
    m = truncation.match_entropy(logits, SamplerConfig(top_p=0.9), lambda v: SamplerConfig(min_p=v), 1e-4, 0.999)
    assert truncation.mean_sampling_entropy(logits, SamplerConfig(min_p=m)) == pytest.approx(
        truncation.mean_sampling_entropy(logits, SamplerConfig(top_p=0.9)), abs=2e-2)


def test_min_p_kept_set_widens_with_temperature_only_when_temperature_comes_first():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(1)) * 3
    table = truncation.kept_size_vs_temperature(logits, {"min_p": 0.1}, [0.5, 1.0, 2.0, 3.0])
    hf = table[table.order == "hf"].size_mean.tolist()
    first = table[table.order == "truncate_first"].size_mean.tolist()
    assert hf == sorted(hf) and hf[-1] > hf[0]
    assert first == [first[0]] * 4


def test_kept_set_disagreement_is_zero_for_a_single_filter():
    from decodelab.core.sampling import SamplerConfig

    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(2))
    disagreement = truncation.kept_set_disagreement(logits, SamplerConfig(temperature=1.5, min_p=0.1))
    assert disagreement["fraction_rows_differ"] == 0


def test_collect_step_logits_equal_teacher_forced_logits(tiny):
    prompts, conts = [[5, 6, 7], [8, 9]], [[20, 21, 22], [23]]
    got = truncation.collect_step_logits(tiny, prompts, conts, max_steps=100)
    expected = []
    for p, c in zip(prompts, conts):
        with torch.no_grad():
            full = tiny.hf_model(input_ids=torch.tensor([p + c])).logits[0]
        expected.append(full[len(p) - 1 : len(p) - 1 + len(c)])
    assert torch.allclose(got, torch.cat(expected).float(), atol=1e-4)



def test_sampler_cost_times_real_logits_of_the_prompts():
    from decodelab.core.models import tiny_model
    from decodelab.core.sampling import Sampler, SamplerConfig

    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    rows = truncation.sampler_cost(model, {"top_p": Sampler(SamplerConfig(top_p=0.9))}, prompts, repeats=2)
    (row,) = rows
    assert row["batch_size"] == 2 and row["context"] == 4.0
    assert row["ratio"] == pytest.approx(row["sample_s"] / row["step_s"])
    with pytest.raises(ValueError, match="at least one prompt"):
        truncation.sampler_cost(model, {}, [], repeats=1)
