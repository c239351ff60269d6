"""The sort-free sampler paths against the full-sort pipeline they replace.

The filters, token for token: the reference below is the pipeline as it was before the fast paths (one
full sort per row, the thresholds read from it), copied here unchanged; the processed logits must be
equal on random logits with ties, -inf entries, peaked and flat rows, per-row settings and both orders.
The draw (the sort-free head-first inverse CDF) is checked by its law in tests/core/test_sampler_law.py.
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
from decodelab.core.sampling import Sampler, SamplerConfig

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


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_processed_logits_equal_the_reference(cfg):
    sampler = Sampler(cfg)
    logits = hard_logits(11)
    assert torch.equal(sampler.process(logits), ref_run(sampler, logits)[0])


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


def test_top_window_is_the_tail_of_the_sort_and_stands_for_it_after_a_top_k_cut():
    x = hard_logits(2)
    V = x.shape[-1]
    for n in (1, 7, 51, 4999, 5000):
        window = filters.top_window(x, n)
        L = window.shape[-1]
        assert L >= n and torch.equal(window, sort_values(x)[:, V - L:])
    g = torch.Generator().manual_seed(3)
    y = torch.randn(3, 4096, generator=g)
    window = filters.top_window(y, 11)
    cut = filters.top_k_threshold(y, 10, window)
    assert torch.equal(cut, filters.top_k_threshold(y, 10))  # the k-th largest read from the window
    window.masked_fill_(window < cut, -torch.inf)
    assert filters.is_full_window(window)
    tied = y.clone()
    tied[:, :70] = 9.0  # 70 values tie with the 10th largest: they fill the (aligned, 64-long) window
    window = filters.top_window(tied, 11)
    window.masked_fill_(window < filters.top_k_threshold(tied, 10, window), -torch.inf)
    assert not filters.is_full_window(window)
    for bad in (float("nan"), float("inf")):
        z = y.clone()
        z[1, 5] = bad
        assert filters.top_window(z, 11) is None


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


@pytest.mark.parametrize("order", ["hf", "vllm"])
def test_processed_logits_equal_the_reference_per_row_mixed_settings_and_greedy_rows(order):
    rows = [CONFIGS[i % len(CONFIGS)] for i in range(23)] + [SamplerConfig(temperature=0.0)]
    sampler = Sampler(rows, order=order)
    for seed in range(5):
        logits = hard_logits(seed)
        assert torch.equal(sampler.process(logits), ref_run(sampler, logits)[0])


TOP_P = [SamplerConfig(top_p=0.9), SamplerConfig(temperature=0.7, top_p=0.9), SamplerConfig(top_p=0.5),
         SamplerConfig(top_p=0.99, temperature=1.5), SamplerConfig(min_p=0.05, top_p=0.8)]


@pytest.mark.parametrize("order", ["hf", "vllm"])
@pytest.mark.parametrize("cfg", CONFIGS[:10] + TOP_P, ids=lambda c: c.label())
def test_processed_logits_equal_the_reference_at_the_embedded_vocabulary_size(cfg, order):
    """LM-like heavy tails at V = 49152, where top-p first takes its nucleus window (no full sort)."""
    g = torch.Generator().manual_seed(3)
    logits = -torch.empty(8, 49152).exponential_(generator=g).log() * torch.linspace(0.8, 2.5, 8).reshape(8, 1)
    sampler = Sampler(cfg, order=order)
    assert torch.equal(sampler.process(logits), ref_run(sampler, logits)[0])


# ----------------------------------------------------------------------------------------------
# core.nucleus: the per-row top-p threshold (windows, the reference sort only where a row needs it)


def lm_like(seed, batch, vocab=49152, temperatures=(1.0, 1.5, 2.0, 3.0)):
    """Heavy-tailed rows at several temperatures: peaked rows (small nucleus) and flat ones (most of the row)."""
    g = torch.Generator().manual_seed(seed)
    x = -torch.empty(batch, vocab).exponential_(generator=g).log() * torch.linspace(1.0, 4.0, batch).reshape(-1, 1)
    return x / torch.tensor(temperatures).repeat(batch // len(temperatures) + 1)[:batch].reshape(-1, 1)


@pytest.fixture(params=["kernel", "python"])
def search_path(request, monkeypatch):
    """Run a test through the C radix select (nucleus_kernel.c) and through the pure-Python windows."""
    from decodelab.core import nucleus

    if request.param == "python":
        monkeypatch.setattr(nucleus.native, "load", lambda name: None)
    elif nucleus.native.compiler() is None:
        pytest.skip("no C compiler here: only the Python path runs")
    return request.param


@pytest.mark.parametrize("top_p", [1e-9, 0.05, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_top_p_threshold_rows_equals_the_full_sort_bit_for_bit(top_p, search_path):
    from decodelab.core.nucleus import row_weights, top_p_threshold_rows

    for x in (hard_logits(0), hard_logits(1, batch=16, vocab=300), lm_like(0, 12)):
        p = torch.full((x.shape[0],), top_p, dtype=torch.float64)
        assert torch.equal(top_p_threshold_rows(x, p), ref_top_p_threshold(x, p))
        assert torch.equal(top_p_threshold_rows(x, top_p), ref_top_p_threshold(x, top_p))
        finite = torch.isfinite(x.amax(-1))
        xf = x[finite]  # the sampler hands over its weights for rows with a finite max
        assert torch.equal(top_p_threshold_rows(xf, top_p, weights=row_weights(xf)), ref_top_p_threshold(xf, top_p))


def test_top_p_threshold_rows_per_row_parameters_and_bad_rows(search_path):
    from decodelab.core.nucleus import top_p_threshold_rows

    x = lm_like(1, 16, vocab=8192)
    x[3, 5] = float("nan")
    x[4, 9] = float("inf")
    x[5] = NEG_INF
    x[6, 100:] = NEG_INF  # a masked vocabulary
    x[8] = (x[8] * 4).round() / 4  # long runs of ties, across the boundary
    x[9, :4000] = x[9].max()  # thousands tied at the max: one bucket holds them
    p = torch.rand(16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p[[0, 7]] = 1.0
    thr, ref = top_p_threshold_rows(x, p), ref_top_p_threshold(x, p)
    assert torch.equal(thr.isnan(), ref.isnan()) and torch.equal(thr[~ref.isnan()], ref[~ref.isnan()])
    assert thr[0, 0] == NEG_INF and thr[7, 0] == NEG_INF  # top_p = 1: the row is left alone


def test_top_p_threshold_rows_sorts_only_the_rows_no_search_decides(monkeypatch, search_path):
    """The Python windows give up on a flat row (its window is most of the row) and sort it; the kernel's
    radix select decides it. Neither sorts a peaked row; both sort a row whose boundary lies within
    rounding of the float32 reference (its cumulative mass there is within the decision band)."""
    from decodelab.core import nucleus

    sorted_rows = []
    real = nucleus._reference_rows
    def spy(x, p, rows):
        sorted_rows.extend(rows.tolist())
        return real(x, p, rows)

    monkeypatch.setattr(nucleus, "_reference_rows", spy)
    x = lm_like(3, 8)
    x[0] = torch.zeros(x.shape[-1])  # a uniform row: its nucleus is 90% of the vocabulary
    x[1, 17] = 40.0  # one token holds nearly all the mass
    x[2] = torch.full((x.shape[-1],), NEG_INF)
    x[2, :10] = 0.0  # ten equal tokens, P Z = 9: the boundary sits exactly on a cumulative sum
    p = torch.full((8,), 0.9, dtype=torch.float64)
    assert torch.equal(nucleus.top_p_threshold_rows(x, p), ref_top_p_threshold(x, p))
    assert 1 not in sorted_rows and 2 in sorted_rows and len(sorted_rows) < 8
    assert (0 in sorted_rows) is (search_path == "python")


def test_the_c_kernel_builds_wherever_a_compiler_is_installed(tmp_path, monkeypatch):
    from decodelab.core import native

    if native.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("DECODELAB_NATIVE_CACHE", str(tmp_path))
    path = native.build("nucleus_kernel")
    assert path.parent == tmp_path and path.stat().st_size > 0
    assert native.build("nucleus_kernel") == path  # cached by the source's hash: not rebuilt
    assert hasattr(native.ctypes.CDLL(str(path)), "top_p_rows")


def test_a_failed_build_warns_and_the_python_path_decides(tmp_path, monkeypatch):
    from decodelab.core import native, nucleus

    monkeypatch.setenv("DECODELAB_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="nucleus_kernel.c is unavailable"):
            assert native.load("nucleus_kernel") is None
        x = lm_like(5, 8)
        assert torch.equal(nucleus.top_p_threshold_rows(x, 0.9), ref_top_p_threshold(x, 0.9))
    finally:
        native.load.cache_clear()


def test_processed_logits_equal_the_reference_on_flat_and_peaked_rows_mixed_per_row():
    """The notebook-02 grid shape: top-p, min-p, plain and greedy rows at T = 1..3 in one batch."""
    rows = [SamplerConfig(top_p=tp, temperature=t) for tp in (0.9, 0.95) for t in (1.0, 1.5, 2.0, 3.0)]
    rows += [SamplerConfig(min_p=0.05, temperature=3.0), SamplerConfig(temperature=2.0), SamplerConfig(temperature=0.0)]
    sampler = Sampler(rows)
    x = lm_like(4, len(rows), temperatures=(1.0,))
    assert torch.equal(sampler.process(x), ref_run(sampler, x)[0])


def test_argmax_rows_is_numpys_first_maximum_with_nans_ties_and_signed_zeros():
    from decodelab.core.draw import argmax_rows

    g = torch.Generator().manual_seed(11)
    for shape in ((64, 49152), (1, 49152), (3, 7), (2, 1), (4, 33), (3, 16), (3, 32)):
        x = torch.randn(*shape, generator=g)
        assert torch.equal(argmax_rows(x), torch.from_numpy(np.argmax(x.numpy(), axis=-1)))
    x = torch.randn(8, 100, generator=g)
    x[1, 50] = x[1, 70] = float("nan")  # the first NaN
    x[2, :] = NEG_INF  # all -inf: id 0
    x[3, 10] = x[3, 20] = 1e9  # a tie: the first
    x[4, :] = 0.0
    x[4, 5] = -0.0  # -0.0 == 0.0: the first of them
    x[5, 99] = float("inf")  # in the scalar tail
    x[6, 0] = float("nan")
    x[7, 97] = float("nan")  # a NaN in the tail only
    assert argmax_rows(x).tolist() == np.argmax(x.numpy(), axis=-1).tolist() == torch.argmax(x, -1).tolist()
    assert argmax_rows(x).tolist() == [int(torch.argmax(x[0])), 50, 0, 10, 0, 99, 0, 97]


def test_a_sampled_batch_is_the_same_tokens_whatever_the_thread_count():
    """The C kernels share rows among threads; each row's draw is its own, so one thread or two give the same
    tokens (a mixed grid: top-p, min-p, plain rows and a greedy one)."""
    configs = [SamplerConfig(temperature=t, top_p=p, min_p=mp) for t in (0.7, 1.5) for p, mp in
               ((0.9, 0.0), (1.0, 0.1), (1.0, 0.0))] + [SamplerConfig(temperature=0.0)]
    logits = torch.randn(len(configs) * 4, 5000, generator=torch.Generator().manual_seed(12)) * 4
    sampler = Sampler(configs * 4)

    def draw():
        return sampler.sample(logits, [torch.Generator().manual_seed(r) for r in range(logits.shape[0])])

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draw()
    finally:
        torch.set_num_threads(threads)
    assert threads > 1 and torch.equal(one, draw())
