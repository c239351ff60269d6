"""AWRS: the accepted token's law is the masked-renormalized one exactly, and its weight is unbiased for Z."""
import math

import numpy as np
import pytest
import torch

from decodelab.constrained.awrs import EXTRA_DRAWS_CAP, awrs_draw, awrs_law
from decodelab.core.models import tiny_model


def tiny_step_probs(vocab: int = 7, seed: int = 3) -> np.ndarray:
    """A real next-token distribution: the tiny model's, over a 7-token vocabulary."""
    model = tiny_model(seed=seed, vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=32)
    with torch.no_grad():
        logits = model.hf_model(torch.tensor([[1, 4, 3]])).logits[0, -1].double()
    return torch.softmax(logits, -1).numpy()


@pytest.mark.parametrize("allowed", [{0}, {1, 4}, {0, 2, 3, 5}, {6}, set(range(7))])
@pytest.mark.parametrize("weight_draws", [1, 2])
def test_awrs_law_equals_masked_renormalized_distribution_exactly(allowed, weight_draws):
    p = tiny_step_probs()
    z = sum(p[t] for t in allowed)
    law, expected_weight = awrs_law(p, allowed, weight_draws=weight_draws)
    assert set(law) == allowed
    for t in allowed:
        assert law[t] == pytest.approx(p[t] / z, rel=1e-12, abs=1e-15)
    assert expected_weight == pytest.approx(z, rel=1e-12)  # unbiased for the mass the mask keeps


def test_hand_computed_two_token_example():
    # allowed a with p = 0.25, forbidden b with 0.75: accept a always; weight (one draw, without replacement):
    # a first (p 0.25): K = 0.25 and the draw is b, w = 0.25; b first: both seen, w = K = 0.25. E = 0.25
    law, expected = awrs_law([0.25, 0.75], {0}, weight_draws=1)
    assert law == {0: pytest.approx(1.0)}
    assert expected == pytest.approx(0.25)


def test_awrs_draw_samples_the_law_it_claims():
    p = tiny_step_probs()
    allowed = {1, 4, 5}
    rng = np.random.default_rng(0)
    n = 20_000
    draws = [awrs_draw(p, allowed.__contains__, rng, weight_draws=2) for _ in range(n)]
    z = sum(p[t] for t in allowed)
    counts = np.bincount([d.token for d in draws], minlength=7)
    assert set(np.flatnonzero(counts)) <= allowed
    for t in allowed:  # 5 standard errors
        share = p[t] / z
        assert abs(counts[t] / n - share) < 5 * math.sqrt(share * (1 - share) / n)
    weights = np.array([d.weight for d in draws])
    assert abs(weights.mean() - z) < 5 * weights.std() / math.sqrt(n)
    # N = 2 + |R| (capped) weight draws, fewer when they run out of untouched tokens (7 - |R| - 1 of them)
    assert all(d.checks == d.rejected + 1 + min(2 + min(d.rejected, EXTRA_DRAWS_CAP), 6 - d.rejected) for d in draws)


def test_awrs_draw_errors_on_an_empty_constrained_step():
    with pytest.raises(ValueError, match="no allowed token"):
        awrs_draw(np.array([0.5, 0.5, 0.0]), {2}.__contains__, np.random.default_rng(0))
    with pytest.raises(ValueError, match="weight_draws"):
        awrs_draw(np.array([0.5, 0.5]), {0}.__contains__, np.random.default_rng(0), weight_draws=-1)


def test_wall_time_charges_masks_to_masking_and_checks_to_awrs():
    from decodelab.constrained import corrector_cost as CC

    ops = {"forward": 1.0, "softmax": 0.1, "draw": 0.01, "mask": 0.5, "check": 0.001}
    masked = {"method": "masked", "forward_passes": 10, "masks": 10, "checks": 0}
    awrs = {"method": "awrs_smc", "forward_passes": 10, "masks": 0, "checks": 40}
    assert CC.wall_seconds(masked, ops) == pytest.approx(10 * 1.1 + 10 * 0.01 + 10 * 0.5)
    assert CC.wall_seconds(awrs, ops) == pytest.approx(10 * 1.1 + 40 * 0.01 + 40 * 0.001)


def test_kl_at_masking_cost_reads_the_largest_budget_within_the_wall_limit_and_goals_take_the_worst_task():
    from decodelab.constrained import corrector_cost as CC

    rows = []
    for task, kls in (("a", (0.5, 0.02, 0.005)), ("b", (0.3, 0.004, 0.001))):
        rows.append({"task": task, "method": "masked", "forward_passes": 100, "wall_s": 10.0, "kl": 0.2,
                     "checks_per_token": 0.0})
        for passes, wall, value in zip((10, 100, 1000), (1.0, 12.0, 120.0), kls):
            rows.append({"task": task, "method": "awrs_smc", "forward_passes": passes, "wall_s": wall, "kl": value,
                         "checks_per_token": 5.0})
    assert CC.kl_at_masking_cost(rows, "awrs_smc") == {"a": 0.02, "b": 0.004}  # 12 s <= 1.5 x 10 s < 120 s
    goals = {g.name: g for g in CC.awrs_goals(rows, vocab_size=1000, method="awrs_smc")}
    assert goals["awrs_kl_at_masking_cost"].value == 0.02 and goals["awrs_kl_at_masking_cost"].met is False
    assert goals["awrs_checks_per_token"].value == 5.0 and goals["awrs_checks_per_token"].met is True


def test_awrs_pick_on_a_grammar_engine_samples_the_masked_distribution_and_leaves_the_matcher_unchanged():
    from transformers import AutoTokenizer

    from decodelab.constrained import masks as M
    from decodelab.constrained.awrs import awrs_pick
    from decodelab.constrained.bitmask import allocate_bitmask
    from decodelab.constrained.constraint import Constraint
    from decodelab.core.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    engine = M.XGrammarEngine(tok, stop_token_ids=[tok.eos_token_id])
    matcher = engine.matcher(engine.compile(Constraint.choices(["yes", "no", "unsure", "maybe"])))
    logits = torch.randn(engine.vocab_size, generator=torch.Generator().manual_seed(0)) * 2
    bitmask = allocate_bitmask(1, engine.vocab_size)
    matcher.fill(bitmask, 0)
    allowed = torch.nonzero(M.apply_bitmask(logits[None].float(), bitmask)[0] > -math.inf).flatten().tolist()
    logits[allowed] += 9.0  # the allowed tokens hold about half the mass: a few rejections per pick, not thousands
    masked = torch.softmax(M.apply_bitmask(logits[None].float(), bitmask)[0].double(), -1)
    full = torch.softmax(logits.double(), -1)
    assert 0.1 < float(full[allowed].sum()) < 0.9
    rng = np.random.default_rng(0)
    n = 1000  # each pick builds the 49k-token CDF once; 5 sigma at 1000 picks still separates masked from unmasked
    picks = [awrs_pick(logits, matcher, rng) for _ in range(n)]
    counts = np.bincount([d.token for d in picks], minlength=engine.vocab_size)
    assert set(np.flatnonzero(counts)) <= set(allowed)
    for t in allowed:
        share = float(masked[t])
        assert abs(counts[t] / n - share) < 5 * math.sqrt(share * (1 - share) / n) + 1e-3
    after = allocate_bitmask(1, engine.vocab_size)
    matcher.fill(after, 0)
    assert torch.equal(after, bitmask)  # every check was rolled back


def test_weight_draws_grow_with_rejections_and_stay_unbiased_on_a_hand_computed_step():
    # allowed a (p 0.1), forbidden b (0.9), one base weight draw, without replacement. First draw a (p 0.1):
    # K = 0.1, R = {}, N = 1: the draw can only be b -> w = 0.1. First draw b (p 0.9): R = {b}, N = 2, but a and
    # b are both seen, so no draw is left to make: w = K = 0.1. Either way w = Z exactly.
    law, expected = awrs_law([0.1, 0.9], {0}, weight_draws=1)
    assert law == {0: pytest.approx(1.0)} and expected == pytest.approx(0.1, rel=1e-12)
    rng = np.random.default_rng(0)
    draws = [awrs_draw([0.1, 0.9], {0}.__contains__, rng, weight_draws=1) for _ in range(200)]
    assert any(d.rejected for d in draws) and any(not d.rejected for d in draws)
    assert all(d.weight == pytest.approx(0.1) and d.checks == 2 for d in draws)  # every token checked once


@pytest.mark.parametrize("allowed", [{0}, {1, 4}, {0, 2, 3, 5}, {6}])
def test_awrs_weight_is_unbiased_given_the_accepted_token(allowed):
    # random-weight SMC needs E[w | accepted token] = Z, not only E[w] = Z: a weight that leaned towards some
    # tokens would tilt the particle system's target
    p = tiny_step_probs()
    z = sum(p[t] for t in allowed)
    for draws in (1, 2, 3):
        _, by_token = awrs_law(p, allowed, weight_draws=draws, given_token=True)
        assert set(by_token) == allowed
        for t in allowed:
            assert by_token[t] == pytest.approx(z, rel=1e-12)


def test_awrs_weight_is_never_zero():
    # the known mass starts at p(accepted token) > 0, so no particle dies of a weight estimate
    p = tiny_step_probs()
    rng = np.random.default_rng(1)
    weights = [awrs_draw(p, {6}.__contains__, rng).weight for _ in range(500)]
    assert min(weights) >= p[6] * (1 - 1e-12)


def test_remaining_draws_from_p_without_the_removed_tokens_exactly():
    from decodelab.constrained.awrs import Remaining

    p = tiny_step_probs()
    left = Remaining(p)
    for token in (5, 0, 3):
        left.remove(token)
    q = p.copy()
    q[[5, 0, 3]] = 0
    q /= q.sum()
    assert left.mass == pytest.approx(1 - p[[5, 0, 3]].sum() / p.sum())
    # the draw maps u in [0, mass) onto the kept intervals: a grid of u values lands on each kept token in
    # proportion to its probability, and never on a removed one
    hits = np.zeros(len(p))

    class Grid:
        def __init__(self, n):
            self.values = iter((np.arange(n) + 0.5) / n)

        def random(self):
            return next(self.values)

    n = 100_000
    grid = Grid(n)
    for _ in range(n):
        hits[left.draw(grid)] += 1
    assert hits[[5, 0, 3]].sum() == 0
    np.testing.assert_allclose(hits / n, q, atol=2 / n)


def test_awrs_draw_with_excluded_tokens_samples_the_rest_of_the_allowed_set_and_estimates_its_mass():
    # exclude = allowed tokens already known: the draw is p restricted to A minus them, the weight is unbiased
    # for their complement's mass Z - p(exclude), and with nothing allowed left it reports token -1, weight 0
    p = tiny_step_probs()
    allowed, excluded = {0, 2, 5}, [2]
    rng = np.random.default_rng(7)
    draws = [awrs_draw(p, allowed.__contains__, rng, exclude=excluded) for _ in range(40_000)]
    rest = p[[0, 5]].sum()
    for token in (0, 5):
        share = np.mean([d.token == token for d in draws])
        assert share == pytest.approx(p[token] / rest, abs=5 * math.sqrt(0.25 / len(draws)))
    assert all(d.token != 2 for d in draws)
    weights = np.array([d.weight for d in draws])
    assert abs(weights.mean() - rest) < 5 * weights.std() / math.sqrt(len(weights))
    empty = awrs_draw(p, allowed.__contains__, rng, exclude=sorted(allowed), allow_empty=True)
    assert empty.token == -1 and empty.weight == 0.0 and empty.checks == len(p) - len(allowed)
    with pytest.raises(ValueError, match="empty"):
        awrs_draw(p, allowed.__contains__, rng, exclude=sorted(allowed))
