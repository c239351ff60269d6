"""Correctors converge to p(x | L); masked sampling converges to its own q, not to p(x | L)."""
import math

import numpy as np
import pytest

from decodelab.constrained import correctors as K
from decodelab.constrained import distortion as D
from decodelab.core.models import resolve_model_path, tiny_model
from decodelab.workloads.prompts import user_prompt_ids

STRINGS = ["yes", "no", "unsure", "maybe"]


@pytest.fixture(scope="module")
def scored():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    model = tiny_model(seed=5, vocab_size=49152, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, init_std=0.05)
    trie = D.build_trie(STRINGS, D.token_bytes_table(tok), [tok.eos_token_id])
    D.score_trie(model, user_prompt_ids(tok, "Answer yes, no, unsure or maybe."), trie)
    exact = D.exact_distributions(trie, {s: tok(s, add_special_tokens=False).input_ids for s in STRINGS})
    return trie, exact


def hand_trie():
    """L = {"a", "ab"} over tokens 3 "a", 4 "b", 5 "ab" (EOS 2), with probabilities set by hand.

    p("a") = 0.3 * 0.5 = 0.15, p("ab") = 0.3 * 0.2 * 0.4 + 0.1 * 0.8 = 0.104, p(L) = 0.254.
    """
    import math

    trie = D.build_trie(["a", "ab"], [None, None, None, b"a", b"b", b"ab"], [2])
    a, ab_two, ab_one = trie.find([3]), trie.find([3, 4]), trie.find([5])
    trie.child_logp = [{}] * len(trie)
    trie.eos_logp = [-math.inf] * len(trie)
    trie.child_logp[0] = {3: math.log(0.3), 5: math.log(0.1)}
    trie.child_logp[a] = {4: math.log(0.2)}
    trie.child_logp[ab_two] = {}
    trie.child_logp[ab_one] = {}
    trie.eos_logp[a], trie.eos_logp[ab_two], trie.eos_logp[ab_one] = math.log(0.5), math.log(0.4), math.log(0.8)
    return trie


def test_hand_example_exact_distributions():
    trie = hand_trie()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    assert exact.target["a"] == pytest.approx(0.15 / 0.254)
    assert exact.masked["a"] == pytest.approx(0.75 * 5 / 7)
    assert exact.masked["ab"] == pytest.approx(0.75 * 2 / 7 + 0.25)
    assert exact.log_p_language == pytest.approx(__import__("math").log(0.254))


@pytest.mark.parametrize("method", ["rejection", "smc", "importance", "asap"])
def test_corrector_converges_to_target_on_hand_example(method):
    trie = hand_trie()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    rows = K.run_corrector(trie, method, exact.target, [20_000], seed=0)
    assert rows[-1]["tv"] < 0.02


@pytest.mark.parametrize("method", ["smc", "importance", "asap"])
def test_corrector_converges_to_target(scored, method):
    trie, exact = scored
    rows = K.run_corrector(trie, method, exact.target, [200, 20_000], seed=0)
    assert rows[-1]["tv"] < 0.05
    assert rows[-1]["forward_passes"] >= 20_000


def test_masked_sampling_converges_to_masked_distribution(scored):
    trie, exact = scored
    rows = K.run_corrector(trie, "masked", exact.masked, [20_000], seed=1)
    assert rows[-1]["tv"] < 0.03


def test_distortion_exists_on_the_test_trie(scored):
    _, exact = scored
    assert D.tv(exact.target, exact.masked) > 0.05  # otherwise the convergence tests above prove little


def test_unknown_corrector_error_lists_allowed(scored):
    trie, exact = scored
    with pytest.raises(ValueError, match="allowed"):
        K.run_corrector(trie, "beam", exact.target, [10])


def hand_trie_with_forbidden():
    """The correctors' hand trie with the forbidden mass laid out: two named tokens and a lump."""
    trie = hand_trie()
    trie.off_logp = []
    for node in range(len(trie)):
        kept = sum(math.exp(v) for v in trie.child_logp[node].values())
        if trie.complete[node] is not None:
            kept += math.exp(trie.eos_logp[node])
        off = 1.0 - kept
        trie.off_logp.append([math.log(off * 0.6), math.log(off * 0.3)] if off > 0 else [])
    return trie


def test_awrs_smc_converges_to_target_and_awrs_to_masked_on_hand_example():
    trie = hand_trie_with_forbidden()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    smc = K.run_corrector(trie, "awrs_smc", exact.target, [20_000], seed=0)[-1]
    assert smc["tv"] < 0.02
    assert smc["checks"] > smc["forward_passes"] and smc["masks"] == 0
    per_step = K.run_corrector(trie, "awrs", exact.masked, [20_000], seed=0)[-1]
    assert per_step["tv"] < 0.02  # masking's q, not p(. | L)
    assert D.tv(exact.target, exact.masked) > 2 * 0.02  # so the two checks above are different claims


def test_awrs_per_step_converges_to_masked_distribution_on_a_scored_trie(scored):
    trie, exact = scored
    assert trie.off_logp is not None and all(len(v) == D.OFF_TOKENS for v in trie.off_logp)
    row = K.run_corrector(trie, "awrs", exact.masked, [20_000], seed=1)[-1]
    assert row["tv"] < 0.03
    assert 0 < row["checks"] / row["forward_passes"] < 49152 / 100  # far fewer checks than a vocabulary scan


def test_exact_sampler_floor_is_zero_for_a_one_string_language():
    assert K.exact_sampler_floor({"only": 1.0}, 1000) == pytest.approx(0.0, abs=1e-12)


def test_exact_sampler_floor_falls_with_samples_like_the_chi_square_term():
    target = {f"s{i}": w for i, w in enumerate([0.3, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])}
    total = sum(target.values())
    target = {s: w / total for s, w in target.items()}
    floors = [K.exact_sampler_floor(target, n, seeds=20) for n in (500, 5000, 50_000)]
    assert floors[0] > floors[1] > floors[2] > 0
    assert floors[2] == pytest.approx((len(target) - 1) / (2 * 50_000), rel=0.3)  # KL ~ chi-square / (2n)


def test_corrector_rows_carry_the_floor_at_their_sample_count():
    trie = hand_trie()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    row = K.run_corrector(trie, "rejection", exact.target, [2000], seed=0)[-1]
    assert row["kl_floor"] == K.exact_sampler_floor(exact.target, row["samples"], seed=0)


def _run_products(run, runs: int, seed: int) -> dict[str, np.ndarray]:
    """Z_hat * normalized weight of each string, per independent run: (runs,) arrays, one per string."""
    rng = np.random.default_rng(seed)
    out = {"a": np.zeros(runs), "ab": np.zeros(runs)}
    for r in range(runs):
        log_zhat, estimate = run(rng)[:2]
        for s, share in estimate.items():
            out[s][r] = math.exp(log_zhat) * share
    return out


@pytest.mark.parametrize("method", ["smc", "awrs_smc", "awrs_smc_unpooled"])
def test_smc_runs_estimate_each_strings_mass_without_bias(method):
    # SMC's unbiasedness, the property that makes combining runs by Z_hat exact: E[Z_hat * weight share of s] =
    # p(s) for each s in L (p("a") = 0.15, p("ab") = 0.104), with random AWRS weights as with the mask's exact Z.
    # Four particles and the default resampling rule, so resampling happens; tolerance: 5 standard errors.
    from decodelab.constrained.awrs_trie import awrs_smc_run, awrs_tables

    trie = hand_trie_with_forbidden()
    if method == "smc":
        tables = K._tables(trie)
        run = lambda rng: K.smc_run(tables, trie, rng, 4, 0.5)  # noqa: E731
    else:
        tables = awrs_tables(trie)
        run = lambda rng: awrs_smc_run(tables, trie, rng, 4, 0.5, pool=method == "awrs_smc")  # noqa: E731
    products = _run_products(run, 6000, seed=11)
    for s, p_s in {"a": 0.15, "ab": 0.104}.items():
        values = products[s]
        assert abs(values.mean() - p_s) < 5 * values.std() / math.sqrt(len(values)), (s, values.mean(), p_s)


def test_awrs_smc_single_run_law_approaches_the_target_as_particles_grow():
    # one run's self-normalized estimate is biased at K particles (K = 1: it is masking's q, as a lone particle's
    # weight normalizes to 1) and the bias falls as K grows: at 32 particles the mean over runs is the target
    # within 5 standard errors
    from decodelab.constrained.awrs_trie import awrs_smc_run, awrs_tables

    trie = hand_trie_with_forbidden()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    tables = awrs_tables(trie)
    rng = np.random.default_rng(3)
    for particles, law in ((1, exact.masked), (32, exact.target)):
        shares = np.array([awrs_smc_run(tables, trie, rng, particles, 0.5)[1].get("a", 0.0)
                           for _ in range(8000 // particles)])
        assert abs(shares.mean() - law["a"]) < 5 * shares.std() / math.sqrt(len(shares)) + 1e-12
    assert abs(exact.masked["a"] - exact.target["a"]) > 0.05  # so the two claims differ


def _exact_future_mass(trie) -> list[float]:
    """F(u) = P(a model continuation of prefix u ends in L), by recursion over the trie (children first)."""
    future = [0.0] * len(trie)
    for node in reversed(range(len(trie))):
        keys, logps = D.allowed_next(trie, node)
        future[node] = sum(math.exp(lp) * (1.0 if k == D.STOP else future[k]) for k, lp in zip(keys, logps))
    return future


@pytest.mark.parametrize("state", ["fresh", "partial", "exact"])
def test_twisted_awrs_runs_estimate_each_strings_mass_without_bias_whatever_the_twist(state):
    # the property that makes awrs_twist exact: for any frozen twist (psi far from F, some allowed tokens known,
    # others not) E[Z_hat * weight share of s] = p(s), p("a") = 0.15, p("ab") = 0.104; 5 standard errors
    from decodelab.constrained.awrs_trie import awrs_tables
    from decodelab.constrained.awrs_twist import LearnedTwist, awrs_twisted_run

    trie = hand_trie_with_forbidden()
    tables = awrs_tables(trie)
    twist = LearnedTwist(tables, trie)
    if state == "partial":  # the root knows token "a" only; psi is far from F (exact: 0.254, 0.58, 0.4, 0.8)
        twist.known[0] = {0: float(tables[0].probs[0])}
        twist.psi[:] = [0.9, 0.1, 0.7, 0.3][: len(trie)] + [1.0] * (len(trie) - 4)
    elif state == "exact":
        for node, t in enumerate(tables):
            twist.known[node] = {i: float(t.probs[i]) for i in range(len(t.keys))}
        twist.psi[:] = _exact_future_mass(trie)
    products = _run_products(lambda rng: awrs_twisted_run(twist, rng, 4, 0.5, learn=False), 6000, seed=11)
    for s, p_s in {"a": 0.15, "ab": 0.104}.items():
        values = products[s]
        assert abs(values.mean() - p_s) < 5 * values.std() / math.sqrt(len(values)) + 1e-12, (s, values.mean(), p_s)


def test_twisted_awrs_with_the_exact_twist_samples_the_target_at_a_constant_weight_without_grammar_checks():
    from decodelab.constrained.awrs_trie import awrs_tables
    from decodelab.constrained.awrs_twist import UNKNOWN_FLOOR, LearnedTwist, awrs_twisted_run

    trie = hand_trie_with_forbidden()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    tables = awrs_tables(trie)
    twist = LearnedTwist(tables, trie)
    for node, t in enumerate(tables):
        twist.known[node] = {i: float(t.probs[i]) for i in range(len(t.keys))}
    twist.psi[:] = _exact_future_mass(trie)
    rng = np.random.default_rng(0)
    runs = [awrs_twisted_run(twist, rng, 1, 0.5, learn=False) for _ in range(4000)]
    # the known branch throughout: no grammar check; each step's weight is 1 / alpha = 1 / (1 - UNKNOWN_FLOOR)
    # (the AWRS branch, taken with UNKNOWN_FLOOR, finds nothing new and drops its particle), so Z_hat = p(L)
    known = [r for r in runs if r[3] == 0]
    assert len(known) > (1 - UNKNOWN_FLOOR) ** 3 * len(runs) * 0.97
    assert all(math.exp(r[0]) * (1 - UNKNOWN_FLOOR) ** r[2] == pytest.approx(0.254) for r in known)
    share_a = np.mean([r[1].get("a", 0.0) for r in known])
    assert share_a == pytest.approx(exact.target["a"], abs=5 * math.sqrt(0.25 / len(known)))


def test_twisted_awrs_learns_and_converges_on_the_hand_example_and_a_scored_trie(scored):
    trie = hand_trie_with_forbidden()
    exact = D.exact_distributions(trie, {"a": [3], "ab": [5]})
    row = K.run_corrector(trie, "awrs_twist", exact.target, [20_000], seed=0)[-1]
    assert row["tv"] < 0.02 and row["masks"] == 0
    trie, exact = scored
    row = K.run_corrector(trie, "awrs_twist", exact.target, [200, 20_000], seed=0)[-1]
    assert row["tv"] < 0.05
    assert 0 < row["checks"] / row["forward_passes"] < 49152 / 100
