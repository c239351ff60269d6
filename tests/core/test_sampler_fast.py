"""The sort-free sampler paths against the full-sort pipeline they replace, token for token.

The reference below is the sampler as it was before the fast paths (one full sort per row, the
thresholds and the inverse-CDF draw read from it), copied here unchanged: for the same generator state
the fast pipeline must draw the same token in every row, on random logits with ties, -inf entries,
peaked and flat rows, per-row settings and both stage orders.
"""
import numpy as np
import pytest
import torch

from decodelab.core import filters
from decodelab.core.filters import (
    NEG_INF,
    apply_temperature,
    epsilon_threshold,
    eta_threshold,
    sort_values,
    typical_filter,
)
from decodelab.core.sampling import Sampler, SamplerConfig, draw_uniforms, sample_inverse_cdf

# ----------------------------------------------------------------------------------------------
# the reference: today's functions before the fast paths, verbatim apart from names


def ref_top_k_threshold(logits, top_k, sorted_asc=None):
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    V = sa.shape[-1]
    k = filters._row_param(top_k, sa, torch.long).expand(sa.shape[0], 1)
    kth = sa.gather(-1, (V - k.clamp(1, V)))
    return torch.where(k > 0, kth, NEG_INF)


def ref_top_p_threshold(logits, top_p, sorted_asc=None):
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    V = sa.shape[-1]
    p = filters._row_param(top_p, sa, torch.float64).expand(sa.shape[0], 1)
    cum = sa.softmax(dim=-1).cumsum_(dim=-1)
    tail = (1 - p).to(sa.dtype)
    n_removed = torch.searchsorted(cum, tail.contiguous(), right=True).clamp(max=V - 1)
    return torch.where(p < 1, sa.gather(-1, n_removed), NEG_INF)


def ref_min_p_threshold(logits, min_p):
    m = filters._row_param(min_p, logits)
    return logits.amax(dim=-1, keepdim=True) + torch.log(m)


def ref_sample_inverse_cdf(logits, u, sorted_asc=None):
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    B, V = sa.shape
    cum = sa.softmax(dim=-1).cumsum_(dim=-1)
    target = (1 - u.to(cum.device, cum.dtype)).reshape(B, 1) * cum[:, -1:]
    pos = torch.searchsorted(cum, target, right=True).clamp(max=V - 1)
    value = sa.gather(-1, pos)
    tie_rank = pos - torch.searchsorted(sa, value, right=False)
    equal = logits == value
    if not bool((tie_rank > 0).any()):
        return equal.view(torch.uint8).argmax(dim=-1)
    nth = equal.cumsum(dim=-1)
    return (equal & (nth == tie_rank + 1)).view(torch.uint8).argmax(dim=-1)


def ref_run(sampler, logits):
    x = logits.float()
    p = sampler._params(x.device)
    sa = None
    for stage in sampler.stages:
        if stage == "temperature":
            if sampler._any_greedy:
                x, sa = apply_temperature(x, p["temperature"]), None
                continue
            t = p["temperature"].reshape(-1, 1).to(x.dtype)
            x = x / t
            if sa is not None:
                sa.div_(t)
            continue
        if stage == "typical_p":
            x, sa = typical_filter(x, p["typical_p"]), None
            continue
        if stage in ("top_k", "top_p") and sa is None:
            sa = sort_values(x)
        thr = {
            "top_k": lambda: ref_top_k_threshold(x, p["top_k"], sa),
            "top_p": lambda: ref_top_p_threshold(x, p["top_p"], sa),
            "min_p": lambda: ref_min_p_threshold(x, p["min_p"]),
            "epsilon": lambda: epsilon_threshold(x, p["epsilon"]),
            "eta": lambda: eta_threshold(x, p["eta"]),
        }[stage]()
        x = x.clone() if x.data_ptr() == logits.data_ptr() else x
        x.masked_fill_(x < thr, NEG_INF)
        if sa is not None:
            sa.masked_fill_(sa < thr, NEG_INF)
    if sampler._any_greedy:
        raw = logits.float()
        onehot = torch.zeros_like(raw, dtype=torch.bool).scatter_(-1, raw.argmax(-1, keepdim=True), True)
        x = torch.where(p["greedy"], raw.masked_fill(~onehot, NEG_INF), x)
        sa = None
    if sa is None:
        sa = sort_values(x)
    return x, sa


def ref_sample(sampler, logits, generator):
    u = draw_uniforms(generator, logits.shape[0], logits.device)
    if sampler.is_greedy:
        return logits.argmax(dim=-1)
    x, sa = ref_run(sampler, logits)
    return ref_sample_inverse_cdf(x, u, sa)


# ----------------------------------------------------------------------------------------------
# logits that exercise the edges


def hard_logits(seed, batch=24, vocab=5000):
    """Peaked, flat and LM-like (heavy-tailed) rows; quantized rows full of ties; -inf entries (masked
    vocabularies) and one row with a single finite entry."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(batch, 1, generator=g) * 6 + 0.2
    x = torch.randn(batch, vocab, generator=g) * scale
    x[: batch // 4] = -torch.empty(batch // 4, vocab).exponential_(generator=g).log() * 2  # heavy tail
    x[batch // 4: batch // 2] = (x[batch // 4: batch // 2] * 2).round() / 2  # many exact ties
    masked = torch.rand(batch, vocab, generator=g) < 0.3
    masked[batch // 2:] = False
    masked[-3:, :] = torch.rand(3, vocab, generator=g) < 0.9
    x[masked] = NEG_INF
    x[-1] = NEG_INF
    x[-1, 7] = 1.5
    return x


CONFIGS = [
    SamplerConfig(),
    SamplerConfig(temperature=0.7),
    SamplerConfig(top_p=0.9),
    SamplerConfig(top_k=50),
    SamplerConfig(top_k=1),
    SamplerConfig(top_k=4999),
    SamplerConfig(min_p=0.1),
    SamplerConfig(min_p=0.02, temperature=1.3),
    SamplerConfig(temperature=0.7, top_p=0.9),
    SamplerConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
    SamplerConfig(top_k=200, top_p=0.95),
    SamplerConfig(min_p=0.05, top_p=0.8),
    SamplerConfig(epsilon=3e-4, top_k=100),
    SamplerConfig(eta=3e-3, min_p=0.05),
    SamplerConfig(typical_p=0.9, top_k=40),
]


@pytest.mark.parametrize("order", ["hf", "vllm"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_fast_pipeline_draws_the_reference_tokens(cfg, order):
    sampler = Sampler(cfg, order=order)
    for seed in range(6):
        logits = hard_logits(seed)
        for step in range(4):
            g_fast = torch.Generator().manual_seed(100 * seed + step)
            g_ref = torch.Generator().manual_seed(100 * seed + step)
            fast = sampler.sample(logits, g_fast)
            ref = ref_sample(sampler, logits, g_ref)
            assert torch.equal(fast, ref), (cfg.label(), order, seed, step)
            assert torch.equal(g_fast.get_state(), g_ref.get_state())  # one uniform per row, both sides


@pytest.mark.parametrize("order", ["hf", "vllm"])
def test_fast_pipeline_matches_per_row_mixed_settings_and_greedy_rows(order):
    rows = [CONFIGS[i % len(CONFIGS)] for i in range(23)] + [SamplerConfig(temperature=0.0)]
    sampler = Sampler(rows, order=order)
    for seed in range(5):
        logits = hard_logits(seed)
        fast = sampler.sample(logits, torch.Generator().manual_seed(seed))
        assert torch.equal(fast, ref_sample(sampler, logits, torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("cfg", CONFIGS[:10], ids=lambda c: c.label())
def test_fast_pipeline_at_the_embedded_vocabulary_size(cfg):
    g = torch.Generator().manual_seed(3)
    logits = -torch.empty(8, 49152).exponential_(generator=g).log() * 1.5  # LM-like heavy tail
    sampler = Sampler(cfg)
    for step in range(5):
        assert torch.equal(sampler.sample(logits, torch.Generator().manual_seed(step)),
                           ref_sample(sampler, logits, torch.Generator().manual_seed(step)))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_processed_logits_equal_the_reference(cfg):
    sampler = Sampler(cfg)
    logits = hard_logits(11)
    assert torch.equal(sampler.process(logits), ref_run(sampler, logits)[0])


def test_uniform_grid_maps_to_the_same_tokens_as_the_full_sort():
    """Every u on a fine grid, with boundaries of every size: the window's inverse CDF is the full one."""
    logits = hard_logits(5, batch=6, vocab=3000)
    sampler = Sampler(SamplerConfig(top_k=30))
    x, window = sampler._run(logits, need_sorted=True)
    assert window.shape[-1] < x.shape[-1]
    full = sort_values(x)
    for u in torch.linspace(0, 1 - 2 ** -24, 2001):
        uu = u.repeat(x.shape[0])
        assert torch.equal(sample_inverse_cdf(x, uu, window), ref_sample_inverse_cdf(x, uu, full))


def test_window_softmax_equals_the_full_sorted_rows():
    """What the window relies on: the softmax (and cumulative sum) of a row's last L sorted values, the
    rest -inf, equals that of the full row bit for bit at those positions."""
    g = torch.Generator().manual_seed(0)
    V = 49152
    for _ in range(50):
        K = int(torch.randint(1, 4000, (1,), generator=g))
        x = torch.full((2, V), NEG_INF)
        x[:, torch.randperm(V, generator=g)[:K]] = torch.randn(2, K, generator=g) * 4
        full = sort_values(x)
        window = filters.sorted_kept(x)
        L = window.shape[-1]
        assert L < V and torch.equal(window, full[:, V - L:])
        assert torch.equal(window.softmax(-1).cumsum(-1), full.softmax(-1).cumsum(-1)[:, V - L:])


def test_top_values_ascending_are_the_tail_of_the_sort():
    x = hard_logits(2)
    for n in (1, 7, 64, 4999, 5000):
        assert torch.equal(filters.top_values_ascending(x, n), sort_values(x)[:, x.shape[-1] - n:])
    with pytest.raises(ValueError, match="n=0"):
        filters.top_values_ascending(x, 0)


def test_sorted_kept_falls_back_to_the_full_sort_for_broad_nan_or_empty_rows():
    x = torch.randn(3, 1000)
    assert filters.sorted_kept(x).shape == (3, 1000)  # nothing removed: a full sort
    y = torch.full((3, 1000), NEG_INF)
    y[:, :10] = 1.0
    assert filters.sorted_kept(y).shape[-1] < 1000
    y[1, 20] = float("nan")
    assert filters.sorted_kept(y).shape == (3, 1000)
    z = torch.full((2, 1000), NEG_INF)
    z[0, 3] = 0.0
    assert filters.sorted_kept(z).shape == (2, 1000)  # an empty row


def test_row_max_equals_amax():
    x = hard_logits(4)
    assert torch.equal(filters.row_max(x), x.amax(dim=-1, keepdim=True))
    assert np.array_equal(filters.row_max(x.double()).numpy(), x.double().amax(-1, keepdim=True).numpy())


def test_nan_and_inf_rows_take_the_reference_path():
    x = hard_logits(6, batch=4, vocab=2000)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    for cfg in (SamplerConfig(top_k=20), SamplerConfig(min_p=0.1), SamplerConfig(top_k=20, top_p=0.9)):
        sampler = Sampler(cfg)
        fast = sampler.sample(x, torch.Generator().manual_seed(0))
        assert torch.equal(fast, ref_sample(sampler, x, torch.Generator().manual_seed(0)))
