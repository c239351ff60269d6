"""Samplers: each filter equals its transformers warper, per-row settings, truncation properties,
exact inverse-CDF sampling, generator discipline, pipeline order, config validation."""


import pytest
import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from decodelab.core.sampling import (
    HF_ORDER,
    VLLM_ORDER,
    Sampler,
    SamplerConfig,
    apply_temperature,
    epsilon_filter,
    eta_filter,
    min_p_filter,
    sample_inverse_cdf,
    top_k_filter,
    top_p_filter,
    typical_filter,
)

NEG_INF = float("-inf")


def random_logits(seed=0, batch=16, vocab=300, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    # a mix of peaked and flat rows: scale varies per row
    return torch.randn(batch, vocab, generator=g) * (scale * torch.rand(batch, 1, generator=g) + 0.3)


def assert_same_filtering(ours, ref):
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "kept sets differ"
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(ours[kept], ref[kept], rtol=1e-6, atol=1e-6)


# filter name -> (our function, transformers warper factory, parameter values to try)
FILTERS = {
    "temperature": (apply_temperature, lambda v: TemperatureLogitsWarper(v), [0.3, 1.0, 2.5]),
    "top_k": (top_k_filter, lambda v: TopKLogitsWarper(v), [1, 5, 50, 299, 300, 1000]),
    "top_p": (top_p_filter, lambda v: TopPLogitsWarper(v), [1e-9, 0.05, 0.3, 0.9, 0.99]),
    "min_p": (min_p_filter, lambda v: MinPLogitsWarper(v), [0.0, 0.01, 0.1, 0.5, 1.0]),
    "typical_p": (typical_filter, lambda v: TypicalLogitsWarper(v), [1e-9, 0.2, 0.5, 0.9, 0.99]),
    "epsilon": (epsilon_filter, lambda v: EpsilonLogitsWarper(v), [1e-4, 3e-3, 0.02, 0.5, 0.99]),
    "eta": (eta_filter, lambda v: EtaLogitsWarper(v), [1e-4, 3e-3, 0.02, 0.5, 0.99]),
}
CASES = [(name, v) for name, (_, _, values) in FILTERS.items() for v in values]


@pytest.mark.parametrize("name,value", CASES)
def test_filter_matches_transformers_warper(name, value):
    ours, warper, _ = FILTERS[name]
    for seed in range(3):
        logits = random_logits(seed)
        assert_same_filtering(ours(logits, value), warper(value)(None, logits.clone()))


@pytest.mark.parametrize("name,value", CASES)
def test_filter_matches_warper_on_already_truncated_logits(name, value):
    """Inputs with -inf entries (as after an earlier filter) follow the warper too."""
    ours, warper, _ = FILTERS[name]
    logits = MinPLogitsWarper(0.05)(None, random_logits(7))
    assert_same_filtering(ours(logits, value), warper(value)(None, logits.clone()))


# (eta cannot empty a row: its cut sqrt(eta) exp(-H) stays below the mean probability)
@pytest.mark.parametrize("name,value", [("top_p", 1e-9), ("typical_p", 1e-9), ("epsilon", 0.99), ("min_p", 1.0)])
def test_min_tokens_to_keep_is_one_like_the_warpers(name, value):
    """Where a filter would remove every token, exactly one survives, the same one as the warper's."""
    ours, warper, _ = FILTERS[name]
    logits = random_logits(3, scale=0.01)  # nearly flat: no token reaches the thresholds
    out = ours(logits, value)
    assert (~torch.isinf(out)).sum(-1).eq(1).all()
    assert_same_filtering(out, warper(value)(None, logits.clone()))


def hf_chain(cfg: SamplerConfig) -> LogitsProcessorList:
    """The warpers transformers' `_get_logits_processor` builds for do_sample=True, in its order."""
    procs = LogitsProcessorList()
    if cfg.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        procs.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p:
        procs.append(MinPLogitsWarper(cfg.min_p))
    if cfg.typical_p < 1.0:
        procs.append(TypicalLogitsWarper(cfg.typical_p))
    if cfg.epsilon:
        procs.append(EpsilonLogitsWarper(cfg.epsilon))
    if cfg.eta:
        procs.append(EtaLogitsWarper(cfg.eta))
    return procs


CHAINS = [
    SamplerConfig(),
    SamplerConfig(temperature=0.7, top_p=0.9),
    SamplerConfig(temperature=1.5, min_p=0.1),
    SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplerConfig(top_k=20, typical_p=0.9, epsilon=3e-3),
    SamplerConfig(temperature=2.0, top_p=0.8, eta=1e-3),
    SamplerConfig(temperature=1.2, typical_p=0.5, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("cfg", CHAINS, ids=lambda c: c.label())
def test_hf_order_pipeline_matches_transformers_chain(cfg):
    logits = random_logits(11)
    assert_same_filtering(Sampler(cfg).process(logits), hf_chain(cfg)(None, logits.clone()))


MIXED = [
    SamplerConfig(),
    SamplerConfig(temperature=0.0),
    SamplerConfig(temperature=0.7, top_p=0.9),
    SamplerConfig(temperature=1.5, min_p=0.1),
    SamplerConfig(top_k=5),
    SamplerConfig(top_k=20, top_p=0.5, temperature=2.0),
    SamplerConfig(typical_p=0.8),
    SamplerConfig(epsilon=3e-3, temperature=0.5),
    SamplerConfig(eta=1e-3),
    SamplerConfig(min_p=0.3, top_p=0.6),
]


@pytest.mark.parametrize("order", ["hf", "vllm"])
def test_mixed_batch_equals_each_row_alone(order):
    logits = random_logits(5, batch=len(MIXED))
    together = Sampler(MIXED, order=order).process(logits)
    for i, cfg in enumerate(MIXED):
        alone = Sampler(cfg, order=order).process(logits[i : i + 1])
        assert_same_filtering(together[i : i + 1], alone)


@pytest.mark.parametrize("name", [n for n in FILTERS if n != "temperature"])
def test_per_row_parameter_tensor_equals_scalar_per_row(name):
    fn, _, values = FILTERS[name]
    logits = random_logits(2, batch=len(values))
    dtype = torch.long if name == "top_k" else torch.float32
    together = fn(logits, torch.tensor(values, dtype=dtype))
    for i, v in enumerate(values):
        assert_same_filtering(together[i : i + 1], fn(logits[i : i + 1], v))


@pytest.mark.parametrize("fn,off", [(top_k_filter, 0), (top_p_filter, 1.0), (min_p_filter, 0.0), (typical_filter, 1.0),
                                    (epsilon_filter, 0.0), (eta_filter, 0.0), (apply_temperature, 1.0)])
def test_disabled_rows_pass_through_unchanged(fn, off):
    logits = random_logits(4)
    logits[:, :3] = -1e4  # probability underflows to exactly 0: still kept by a disabled filter
    logits[:, 3] = NEG_INF
    assert torch.equal(fn(logits, off), logits)
    values = torch.tensor([off, 0.5 if not isinstance(off, int) else 3] * 8)
    mixed = fn(logits, values.to(torch.long) if isinstance(off, int) else values)
    assert torch.equal(mixed[0::2], logits[0::2])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("min_p", [0.0, 0.1, 0.9, 1.0])
def test_min_p_keeps_argmax(temperature, min_p):
    logits = random_logits(6, batch=64)
    probs = Sampler(SamplerConfig(temperature=temperature, min_p=min_p)).probs(logits)
    assert (probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all()


@pytest.mark.parametrize(
    "fn,loosening",
    [
        (top_p_filter, [0.01, 0.1, 0.3, 0.5, 0.8, 0.9, 0.99, 1.0]),
        (min_p_filter, [1.0, 0.5, 0.2, 0.1, 0.05, 0.01, 0.0]),
        (top_k_filter, [1, 2, 5, 10, 50, 100, 300, 0]),
        (epsilon_filter, [0.5, 0.05, 1e-2, 3e-3, 1e-3, 1e-4, 0.0]),
        (eta_filter, [0.5, 0.05, 1e-2, 3e-3, 1e-3, 1e-4, 0.0]),
        (typical_filter, [0.01, 0.2, 0.5, 0.9, 0.99, 1.0]),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_kept_set_grows_monotonically_as_threshold_loosens(fn, loosening):
    logits = random_logits(8, batch=32)
    previous = None
    for v in loosening:
        kept = ~torch.isinf(fn(logits, v))
        if previous is not None:
            assert (kept | ~previous).all(), f"{fn.__name__}({v}) dropped a token kept at a tighter setting"
        previous = kept
    assert previous.all()  # the loosest setting keeps everything


@pytest.mark.parametrize("order", ["hf", "vllm"])
def test_processed_probs_renormalize_to_one(order):
    logits = random_logits(9, batch=len(MIXED))
    s = Sampler(MIXED, order=order)
    probs = s.probs(logits)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(MIXED)), rtol=0, atol=1e-5)
    assert (probs[torch.isinf(s.process(logits))] == 0).all()


def test_low_temperature_reduces_to_greedy():
    logits = random_logits(10, batch=32, scale=1.0)
    probs = Sampler(SamplerConfig(temperature=1e-4)).probs(logits)
    top = probs.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
    assert (top > 1 - 1e-6).all()


@pytest.mark.parametrize("order", ["hf", "vllm", ["typical_p", "top_p", "temperature"]])
def test_temperature_zero_is_exactly_greedy_in_a_mixed_batch(order):
    logits = random_logits(12, batch=6)
    logits[1, [7, 40]] = logits[1].max() + 1.0  # a tie for the max: greedy takes the first id
    configs = [SamplerConfig(temperature=0.0, top_p=0.5, typical_p=0.3), SamplerConfig(temperature=0.0)] + [
        SamplerConfig(temperature=1.0, top_p=0.9)
    ] * 4
    s = Sampler(configs, order=order)
    argmax = logits.argmax(-1)
    assert argmax[1] == 7
    probs = s.probs(logits)
    assert torch.equal(probs[:2], torch.nn.functional.one_hot(argmax[:2], logits.shape[1]).float())
    for seed in range(5):
        tokens = s.sample(logits, torch.Generator().manual_seed(seed))
        assert torch.equal(tokens[:2], argmax[:2])
    all_greedy = Sampler(SamplerConfig(temperature=0.0))
    assert all_greedy.is_greedy and not s.is_greedy
    assert torch.equal(all_greedy.sample(logits, torch.Generator().manual_seed(0)), argmax)


def grid_frequencies(logits_row, n=20000):
    """Draw with u on the grid (k + 1/2)/n: token frequencies equal the probabilities up to 1/n."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = sample_inverse_cdf(logits_row.expand(n, -1).contiguous(), u.float())
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).double() / n


@pytest.mark.parametrize("cfg", [SamplerConfig(), SamplerConfig(temperature=0.7, top_p=0.8),
                                 SamplerConfig(min_p=0.2, temperature=2.0)], ids=lambda c: c.label())
def test_inverse_cdf_on_a_grid_reproduces_probs_exactly(cfg):
    logits = random_logits(13, batch=1, vocab=12, scale=1.5)
    s = Sampler(cfg)
    freq = grid_frequencies(s.process(logits))
    torch.testing.assert_close(freq, s.probs(logits)[0].double(), rtol=0, atol=2 / 20000)


def test_inverse_cdf_splits_tied_logits_evenly_and_never_picks_removed_tokens():
    logits = torch.tensor([[0.5, 2.0, NEG_INF, 2.0, -1.0, 2.0, NEG_INF, 1e-3]])
    freq = grid_frequencies(logits)
    torch.testing.assert_close(freq, logits.softmax(-1)[0].double(), rtol=0, atol=2 / 20000)
    assert freq[2] == 0 and freq[6] == 0


def test_sample_matches_probs_chi_square():
    logits = random_logits(14, batch=1, vocab=10, scale=1.0)
    s = Sampler(SamplerConfig(temperature=0.9, top_k=8))
    n = 20000
    tokens = s.sample(logits.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=10).double()
    expected = s.probs(logits)[0].double() * n
    kept = expected > 0
    assert counts[~kept].sum() == 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < 31.3  # chi-square 0.9999 quantile at 7 degrees of freedom (8 kept tokens)


def test_sample_uses_one_uniform_per_row_from_the_generator():
    logits = random_logits(15, batch=8)
    s = Sampler(SamplerConfig(temperature=0.8, min_p=0.05))
    u = torch.rand(8, generator=torch.Generator().manual_seed(3))
    expected = sample_inverse_cdf(s.process(logits), u)
    assert torch.equal(s.sample(logits, torch.Generator().manual_seed(3)), expected)
    # a list of generators: row b takes the first uniform of generator b
    gens = [torch.Generator().manual_seed(100 + b) for b in range(8)]
    u_list = torch.stack([torch.rand(1, generator=torch.Generator().manual_seed(100 + b))[0] for b in range(8)])
    assert torch.equal(s.sample(logits, gens), sample_inverse_cdf(s.process(logits), u_list))


def test_same_seed_gives_same_draws_and_global_rng_is_untouched():
    logits = random_logits(16, batch=32)
    s = Sampler(MIXED * 3 + [SamplerConfig()] * 2)
    state = torch.get_rng_state()
    g1, g2 = torch.Generator().manual_seed(42), torch.Generator().manual_seed(42)
    a = [s.sample(logits, g1) for _ in range(3)]
    b = [s.sample(logits, g2) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(a[0], x) for x in a[1:])  # the stream advances between steps
    assert torch.equal(torch.get_rng_state(), state)


def test_hf_and_vllm_orders_keep_different_sets_where_min_p_meets_top_p():
    # p = [0.5, 0.3, 0.05 x 4]; min_p=0.2 -> keep p >= 0.1; top_p=0.6.
    # hf: top-p on the full distribution needs 0.5 + 0.3 -> {0, 1}; min-p keeps both.
    # vllm: min-p first leaves {0, 1} renormalized to [0.625, 0.375]; top-p 0.6 keeps only {0}.
    logits = torch.tensor([[0.5, 0.3, 0.05, 0.05, 0.05, 0.05]]).log()
    cfg = SamplerConfig(min_p=0.2, top_p=0.6)
    hf, vllm = Sampler(cfg, order="hf"), Sampler(cfg, order="vllm")
    assert hf.order == HF_ORDER and vllm.order == VLLM_ORDER
    assert torch.equal(~torch.isinf(hf.process(logits)), torch.tensor([[True, True, False, False, False, False]]))
    assert torch.equal(~torch.isinf(vllm.process(logits)), torch.tensor([[True, False, False, False, False, False]]))
    # and each is the documented composition of the pure filters
    assert_same_filtering(hf.process(logits), min_p_filter(top_p_filter(logits, 0.6), 0.2))
    assert_same_filtering(vllm.process(logits), top_p_filter(min_p_filter(logits, 0.2), 0.6))


def test_explicit_order_puts_temperature_after_truncation():
    logits = random_logits(17, batch=8)
    cfg = SamplerConfig(temperature=2.0, top_p=0.7)
    before = Sampler(cfg).process(logits)
    after = Sampler(cfg, order=["top_p", "temperature"]).process(logits)
    assert_same_filtering(after, apply_temperature(top_p_filter(logits, 0.7), 2.0))
    assert_same_filtering(before, top_p_filter(apply_temperature(logits, 2.0), 0.7))
    assert (~torch.isinf(after)).sum() < (~torch.isinf(before)).sum()  # hot first flattens: nucleus grows


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("typical_p", 0.0),
        ("typical_p", 2.0),
        ("top_k", -1),
        ("top_k", 2.5),
        ("epsilon", 1.0),
        ("epsilon", -1e-3),
        ("eta", 1.0),
        ("eta", -0.5),
    ],
)
def test_bad_config_raises_naming_parameter_and_value(name, value):
    with pytest.raises(ValueError, match=f"^{name}={value!r} must be"):
        SamplerConfig(**{name: value})


def test_bad_order_and_shapes_raise():
    with pytest.raises(ValueError, match="order='tgi'"):
        Sampler(SamplerConfig(), order="tgi")
    with pytest.raises(ValueError, match="unknown stage 'nucleus'"):
        Sampler(SamplerConfig(), order=["nucleus"])
    with pytest.raises(ValueError, match=r"leaves out \['min_p'\]"):
        Sampler(SamplerConfig(min_p=0.1), order=["temperature"])
    with pytest.raises(ValueError, match="3 rows but the sampler has 2 configs"):
        Sampler([SamplerConfig(), SamplerConfig()]).process(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="list of 2 generators"):
        Sampler(SamplerConfig()).sample(torch.zeros(3, 5), [torch.Generator()] * 2)


def test_labels_are_short_and_readable():
    assert SamplerConfig(min_p=0.1).label() == "min_p=0.1,T=1.0"
    assert SamplerConfig(temperature=0.7, top_p=0.9).name == "top_p=0.9,T=0.7"
    assert SamplerConfig(temperature=0).label() == "greedy"
    assert SamplerConfig().label() == "T=1.0"


def test_argmax_rows_equals_torch_argmax_including_ties():
    from decodelab.core.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    logits[3, [5, 700]] = 100.0  # a tie: the first index wins in both
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[3] == 5 and argmax_rows(logits).dtype == torch.long


def test_filters_live_in_core_filters_and_stay_importable_from_sampling():
    from decodelab.core import filters, sampling

    for name in ("apply_temperature", "top_k_filter", "top_p_filter", "min_p_filter", "typical_filter",
                 "epsilon_filter", "eta_filter", "top_k_threshold", "top_p_threshold", "min_p_threshold",
                 "epsilon_threshold", "eta_threshold", "sort_values", "NEG_INF"):
        assert getattr(sampling, name) is getattr(filters, name)
    assert set(sampling.__all__) >= {"Sampler", "SamplerConfig", "argmax_rows", "sample_inverse_cdf", "draw_uniforms"}
