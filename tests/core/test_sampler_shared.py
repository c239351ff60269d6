"""The sampler's shared work (issue 15): the top-p search's weights reused by the draw, the skipped mask of
x before a last min-p stage, and the vectorized zeroing of the draw's weights. Each must give the same
tokens as the pipeline without them: the processed (masked) logits drawn by the plain dense inverse CDF,
token for token, for the same uniforms."""
import numpy as np
import pytest
import torch

from decodelab.core import draw, filters, nucleus
from decodelab.core.filters import NEG_INF
from decodelab.core.sampling import Sampler, SamplerConfig, sample_inverse_cdf


def adversarial_logits(seed: int, batch: int = 24, vocab: int = 4096) -> torch.Tensor:
    """Flat rows (T = 3 on LM-like tails), peaked rows, one dominant token, exact ties (quantized rows),
    -inf entries (masked vocabularies) and a row with one finite entry."""
    g = torch.Generator().manual_seed(seed)
    x = -torch.empty(batch, vocab).exponential_(generator=g).log() * torch.linspace(0.5, 4.0, batch).reshape(-1, 1)
    x[0] = 0.0  # uniform: every value tied
    x[1, 3] = 60.0  # one token holds all the mass
    x[2] = (x[2] * 2).round() / 2  # many ties, at the threshold too
    x[3] = (x[3] * 4).round() / 4
    x[4:8] = x[4:8] / 3.0  # flat
    masked = torch.rand(batch, vocab, generator=g) < 0.4
    masked[:8] = False
    x[masked & (torch.arange(batch) % 3 == 0).reshape(-1, 1)] = NEG_INF
    x[-1] = NEG_INF
    x[-1, 11] = 2.0
    return x


def uniforms(seed: int, batch: int) -> tuple[list, torch.Tensor]:
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(batch)]
    u = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(seed * 1000 + i)) for i in range(batch)])
    return gens, u


def grid_rows(batch: int) -> list[SamplerConfig]:
    """The notebook-02 grid's row kinds, cycled: top-p, min-p, plain temperature, greedy, at T = 1..3."""
    kinds = [SamplerConfig(temperature=t, top_p=tp) for t in (1.0, 1.5, 3.0) for tp in (0.9, 0.95, 1e-9)]
    kinds += [SamplerConfig(temperature=t, min_p=mp) for t in (1.0, 3.0) for mp in (0.05, 0.1)]
    kinds += [SamplerConfig(temperature=2.0), SamplerConfig(temperature=0.0), SamplerConfig(top_p=0.9, min_p=0.1)]
    return [kinds[i % len(kinds)] for i in range(batch)]


@pytest.mark.parametrize("order", ["hf", "vllm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_equals_the_dense_draw_of_the_processed_logits_on_adversarial_rows(order, seed, draw_path):
    x = adversarial_logits(seed)
    sampler = Sampler(grid_rows(x.shape[0]), order=order)
    processed = sampler.process(x)
    for rep in range(8):
        gens, u = uniforms(seed * 10 + rep, x.shape[0])
        assert torch.equal(sampler.sample(x, gens), sample_inverse_cdf(processed, u))


@pytest.mark.parametrize("config", [SamplerConfig(top_p=0.9), SamplerConfig(top_p=0.95, min_p=0.05, temperature=2.0),
                                    SamplerConfig(top_p=1e-9, min_p=0.1), SamplerConfig(top_k=30, top_p=0.8)])
def test_one_config_for_every_row_equals_the_dense_draw(config):
    x = adversarial_logits(5)
    sampler = Sampler(config)
    processed = sampler.process(x)
    for rep in range(6):
        gens, u = uniforms(50 + rep, x.shape[0])
        assert torch.equal(sampler.sample(x, gens), sample_inverse_cdf(processed, u))


def test_shared_weights_and_floor_on_unmasked_logits_equal_the_draw_on_masked_ones(draw_path):
    x = adversarial_logits(3)[:-1]  # every row's max finite
    B = x.shape[0]
    floor = nucleus.top_p_threshold_rows(x, torch.full((B,), 0.9, dtype=torch.float64))
    floor[::4] = NEG_INF  # rows no earlier stage masked
    thr = filters.min_p_threshold(x, torch.tensor([0.0, 0.05, 0.3, 1e-4] * (B // 4) + [0.0] * (B % 4)))
    masked = x.masked_fill(x < floor, NEG_INF)
    for rep in range(10):
        u = torch.rand(B, generator=torch.Generator().manual_seed(rep))
        expected = sample_inverse_cdf(masked, u, thr)
        weights = nucleus.row_weights(x)
        kept = weights.w.clone()
        assert torch.equal(sample_inverse_cdf(x, u, thr, weights=weights, floor=floor), expected)
        assert torch.equal(weights.w, kept)  # the draw only reads the shared weights
        some = nucleus.row_weights(x, rows=np.arange(1, B, 3))  # weights for some rows: the others computed
        assert torch.equal(sample_inverse_cdf(x, u, thr, weights=some, floor=floor), expected)
        assert torch.equal(sample_inverse_cdf(x, u, thr, floor=floor), expected)
        assert torch.equal(sample_inverse_cdf(x, u, None, weights=nucleus.row_weights(x), floor=floor),
                           sample_inverse_cdf(masked, u))


def test_row_weights_are_the_draws_weights():
    x = adversarial_logits(4)[:-1]
    weights = nucleus.row_weights(x)
    full = torch.sub(x, x.gather(-1, x.argmax(-1, keepdim=True))).exp_()
    assert torch.equal(weights.max, x.amax(-1, keepdim=True))
    assert torch.equal(weights.w, full)
    rows = np.array([2, 5, 11])
    some = nucleus.row_weights(x, rows)
    assert torch.equal(some.max, weights.max) and some.w.shape == (3, x.shape[-1])
    assert torch.equal(some.w, full[torch.from_numpy(rows)])
    assert some.has(np.array([2, 3, 11])).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="no weights"):  # a top-p row the caller gave no weights for
        nucleus.top_p_threshold_rows(x, torch.full((x.shape[0],), 0.9, dtype=torch.float64), weights=some)


@pytest.mark.parametrize("few_rows", [True, False])
def test_zeroing_below_a_threshold_equals_the_masked_assignment(few_rows):
    x = adversarial_logits(6)
    w = torch.exp(x - x.amax(-1, keepdim=True))
    thr = torch.from_numpy(np.quantile(np.where(np.isfinite(x.numpy()), x.numpy(), 0), 0.4, -1, keepdims=True))
    thr = thr.float()
    if few_rows:
        thr[: 2 * x.shape[0] // 3] = NEG_INF  # most rows keep everything
    expected = w.masked_fill(x < thr, 0.0)
    out = w.clone()
    draw._fill_below_(out, x, thr, 0.0)
    assert torch.equal(out, expected)
    masked = x.clone()
    draw._mask_below_(masked, thr)
    assert torch.equal(masked, x.masked_fill(x < thr, NEG_INF))


def test_min_p_threshold_with_a_known_row_max_is_the_same():
    x = adversarial_logits(7)
    p = torch.linspace(0, 1, x.shape[0])
    assert torch.equal(filters.min_p_threshold(x, p, filters.row_max(x)), filters.min_p_threshold(x, p))


@pytest.mark.parametrize("top_p", [1e-9, 0.3, 0.9, 0.95, 0.999, 1.0])
def test_top_p_threshold_rows_with_shared_weights_equals_the_full_sort(top_p):
    x = adversarial_logits(8)
    p = torch.full((x.shape[0],), top_p, dtype=torch.float64)
    ref = filters.top_p_threshold(x, p)
    assert torch.equal(nucleus.top_p_threshold_rows(x, p), ref)
    finite = x[:-1]
    assert torch.equal(nucleus.top_p_threshold_rows(finite, p[:-1], weights=nucleus.row_weights(finite)), ref[:-1])


def test_flat_rows_skip_the_wider_windows(monkeypatch):
    """A flat row's first window is already too wide: no second or third window pass is tried."""
    calls = []
    real = nucleus._resolve
    monkeypatch.setattr(nucleus, "_resolve", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.zeros(1, 4096)
    assert torch.equal(nucleus.top_p_threshold_rows(x, 0.9), filters.top_p_threshold(x, 0.9))
    assert calls == []  # the full sort, without sorting any window first
