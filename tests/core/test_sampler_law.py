"""The sort-free draw (`sample_inverse_cdf`: head-first inverse CDF, two-level search) by its law.

- exact frequencies: every uniform on a fine grid, so each token's count is n * p_i within 1 (its set of
  uniforms is one interval of length p_i), on small rows with ties and -inf entries, for every pipeline;
- the map from u to a token equals a float64 reference (one full cumulative sum, no chunks) wherever
  u is not within rounding of an interval boundary, at the embedded vocabulary size;
- removed tokens are never drawn; a deferred threshold draws what masking first draws;
- each of these through the C draw (draw_kernel.c) and through the torch/numpy searches it stands for;
- a chi-square bound on draws from a generator; the common random numbers (one uniform per row, the
  argmax's interval [0, p_max) shared by every sampler).
"""
import numpy as np
import pytest
import torch
from test_sampler_fast import CONFIGS, hard_logits

from decodelab.core.filters import NEG_INF, min_p_threshold
from decodelab.core.sampling import Sampler, SamplerConfig, sample_inverse_cdf


def ref_draw(x: torch.Tensor, u: torch.Tensor):
    """(B, V), (B,) -> (tokens (B,), margin (B,)): the head-first inverse CDF with one float64 cumulative
    sum; margin is the distance of u * C from the nearest interval boundary, relative to C."""
    xd = x.double()
    head = xd.argmax(-1, keepdim=True)
    w = (xd - xd.gather(-1, head)).exp().scatter(-1, head, 0.0)
    edges = 1 + w.cumsum(-1)  # the upper end of each non-head token's interval
    total = edges[:, -1:]
    t = u.double().reshape(-1, 1) * total
    first = torch.searchsorted(edges, t, right=True).clamp(max=x.shape[-1] - 1)
    tokens = torch.where(t < 1, head, first).reshape(-1)
    bounds = torch.cat([torch.ones_like(total), edges], dim=-1)
    margin = ((bounds - t).abs().amin(-1) / total[:, 0])
    return tokens, margin


def grid(n: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()


@pytest.mark.parametrize("order", ["hf", "vllm"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_grid_frequencies_are_the_probabilities(cfg, order, draw_path):
    n = 8000
    sampler = Sampler(cfg, order=order)
    logits = hard_logits(1, batch=8, vocab=40)
    logits = logits[torch.isfinite(logits).any(-1)]  # an empty row has no law
    x = sampler.process(logits)
    # the sampler's draw is the inverse CDF of its processed logits (its last threshold deferred)
    u = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampler.sample(logits, [_Fixed(v) for v in u]), sample_inverse_cdf(x, u))
    probs = x.double().softmax(-1)
    for row in range(x.shape[0]):
        tokens = sample_inverse_cdf(x[row: row + 1].expand(n, -1).contiguous(), grid(n))
        freq = torch.bincount(tokens, minlength=x.shape[-1]).double() / n
        torch.testing.assert_close(freq, probs[row], rtol=0, atol=1.5 / n)
        assert freq[torch.isinf(x[row])].sum() == 0  # removed tokens: never


class _Fixed:
    """Stands for a row's generator whose one draw is the uniform u (see the fixture below)."""

    def __init__(self, u):
        self.u = float(u)


@pytest.fixture(autouse=True)
def _fixed_uniforms(monkeypatch):
    from decodelab.core import sampling

    real = sampling.draw_uniforms

    def draw(generator, batch_size, device=None):
        if isinstance(generator, list) and generator and isinstance(generator[0], _Fixed):
            return torch.tensor([g.u for g in generator], dtype=torch.float32, device=device)
        return real(generator, batch_size, device)

    monkeypatch.setattr(sampling, "draw_uniforms", draw)


@pytest.mark.parametrize("vocab", [9, 300, 1023, 49152])
def test_the_two_level_search_maps_u_as_one_full_cumulative_sum(vocab, draw_path):
    """The chunked search against the float64 reference, token for token, away from rounding boundaries;
    heavy tails, ties and -inf entries; vocabularies shorter than, equal to and not a multiple of a chunk."""
    g = torch.Generator().manual_seed(vocab)
    for seed in range(3):
        x = hard_logits(seed, batch=24, vocab=vocab)
        u = torch.rand(24, generator=g)
        u[:4] = torch.tensor([0.0, 1 - 2 ** -24, 0.5, 1e-7])
        ours = sample_inverse_cdf(x, u)
        ref, margin = ref_draw(x, u)
        clear = margin > 1e-6  # the chunk sums are float32: boundaries move by ~1e-7 of the total
        assert clear.float().mean() > 0.6
        assert torch.equal(ours[clear], ref[clear]), (vocab, seed)
        rows = torch.isfinite(x).any(-1)  # (an empty row has no law)
        assert torch.isfinite(x.gather(-1, ours.reshape(-1, 1)))[rows].all()  # never a removed token


def test_never_draws_a_removed_token_even_at_the_edges_of_u(draw_path):
    x = hard_logits(4, batch=24, vocab=1000)
    for u in (0.0, 2 ** -24, 0.5, 1 - 2 ** -24):
        for cfg in CONFIGS:
            sampler = Sampler(cfg)
            kept = torch.isfinite(sampler.process(x))
            tokens = sampler.sample(x, [_Fixed(u)] * x.shape[0])
            assert kept.gather(-1, tokens.reshape(-1, 1)).all(), (cfg.label(), u)


def test_a_deferred_threshold_draws_what_masking_first_draws(draw_path):
    x = hard_logits(7, batch=24, vocab=5000)
    thr = min_p_threshold(x, 0.05)
    masked = x.masked_fill(x < thr, NEG_INF)
    for seed in range(5):
        u = torch.rand(24, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sample_inverse_cdf(x, u, thr), sample_inverse_cdf(masked, u))


def test_small_u_picks_the_argmax_in_every_sampler():
    """The coupling: u < p_max (renormalized) picks the argmax, whatever truncation kept the argmax."""
    x = hard_logits(2, batch=24, vocab=2000)[:-3]  # rows with one finite entry aside
    argmax = x.argmax(-1)
    for cfg in CONFIGS:
        if cfg.typical_p < 1:
            continue  # typical sampling may drop the argmax
        sampler = Sampler(cfg)
        p_max = sampler.probs(x).gather(-1, argmax.reshape(-1, 1)).squeeze(-1)
        u = p_max * 0.999
        tokens = sampler.sample(x, [_Fixed(v) for v in u])
        assert torch.equal(tokens, argmax), cfg.label()


def test_draws_from_a_generator_pass_a_chi_square_and_use_one_uniform_per_row():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.5, NEG_INF, 0.0, -1.0, 3.0, 3.0, -2.0]])
    sampler = Sampler(SamplerConfig(temperature=0.9, top_k=7), order="vllm")
    n = 40000
    g = torch.Generator().manual_seed(0)
    tokens = sampler.sample(logits.expand(n, -1), g)
    rest = torch.Generator().manual_seed(0)
    torch.rand(n, generator=rest)
    assert torch.equal(g.get_state(), rest.get_state())  # exactly n uniforms taken
    counts = torch.bincount(tokens, minlength=10).double()
    expected = sampler.probs(logits)[0].double() * n
    kept = expected > 0
    assert counts[~kept].sum() == 0
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < 27.9  # chi-square 0.9999 quantile at 6 degrees of freedom (7 kept tokens)


def test_greedy_rows_in_a_sampled_batch_stay_greedy_with_a_deferred_threshold():
    x = hard_logits(3, batch=8, vocab=500)
    configs = [SamplerConfig(temperature=0.0), SamplerConfig(min_p=0.1)] * 4
    sampler = Sampler(configs)
    for seed in range(10):
        tokens = sampler.sample(x, torch.Generator().manual_seed(seed))
        assert torch.equal(tokens[0::2], x[0::2].argmax(-1))
    assert np.all(np.isfinite(sampler.process(x).gather(-1, tokens.reshape(-1, 1)).numpy()))


def test_the_sparse_draw_over_few_kept_ids_has_the_law_and_maps_u_as_the_dense_one(draw_path):
    """A threshold keeping few ids takes the sparse path (their ids only): grid frequencies are the
    probabilities, and tokens equal the float64 reference away from interval boundaries."""
    x = hard_logits(9, batch=12, vocab=2000)
    x = x[torch.isfinite(x).any(-1)]
    thr = min_p_threshold(x, 0.2)
    masked = x.masked_fill(x < thr, NEG_INF)
    assert torch.isfinite(masked).sum() * 16 <= masked.numel()  # the sparse path's condition
    n = 4000
    for row in range(x.shape[0]):
        tokens = sample_inverse_cdf(x[row: row + 1].expand(n, -1).contiguous(), grid(n), thr[row: row + 1].expand(n, 1))
        freq = torch.bincount(tokens, minlength=x.shape[-1]).double() / n
        torch.testing.assert_close(freq, masked[row].double().softmax(-1), rtol=0, atol=1.5 / n)
    u = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(1))
    ref, margin = ref_draw(masked, u)
    clear = margin > 1e-6
    assert torch.equal(sample_inverse_cdf(x, u, thr)[clear], ref[clear])


def test_a_batch_of_sparse_and_dense_rows_maps_u_as_the_float64_reference(draw_path):
    """Each row takes its own path (kept ids alone when few, else the dense search): tokens equal the
    float64 reference away from interval boundaries, and no removed token is drawn."""
    x = hard_logits(5, batch=24, vocab=2000)
    x = x[torch.isfinite(x).any(-1)]
    thr = min_p_threshold(x, torch.tensor([0.3, 0.0] * (x.shape[0] // 2) + [0.3] * (x.shape[0] % 2)))
    masked = x.masked_fill(x < thr, NEG_INF)
    counts = torch.isfinite(masked).sum(-1)
    assert (counts * 16 <= x.shape[-1]).any() and (counts * 16 > x.shape[-1]).any()  # both paths in one batch
    for seed in range(5):
        u = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(seed))
        ours = sample_inverse_cdf(x, u, thr)
        ref, margin = ref_draw(masked, u)
        clear = margin > 1e-6
        assert torch.equal(ours[clear], ref[clear])
        assert torch.isfinite(masked.gather(-1, ours.reshape(-1, 1))).all()


def test_greedy_rows_are_drawn_apart_and_sampled_rows_keep_their_law():
    """A mixed batch: greedy rows give the raw argmax; the sampled rows' tokens are the inverse CDF of
    the processed logits with the same uniforms (away from rounding boundaries)."""
    x = hard_logits(6, batch=12, vocab=3000)[:-3]
    configs = [SamplerConfig(temperature=0.0), SamplerConfig(top_p=0.9, temperature=1.5), SamplerConfig(min_p=0.1)] * 3
    sampler = Sampler(configs)
    processed = sampler.process(x)
    greedy = torch.tensor([c.is_greedy for c in configs])
    for seed in range(4):
        u = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(seed))
        tokens = sampler.sample(x, [_Fixed(v) for v in u])
        assert torch.equal(tokens[greedy], x[greedy].argmax(-1))
        ref, margin = ref_draw(processed[~greedy], u[~greedy])
        clear = margin > 1e-6
        assert torch.equal(tokens[~greedy][clear], ref[clear])
