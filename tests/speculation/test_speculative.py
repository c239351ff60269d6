"""Speculative decoding: exact verification maths, and the batched loop against plain decoding."""
from __future__ import annotations

import itertools

import pytest
import torch

from decodelab.speculation.verify import greedy_verify, rejection_verify, residual_distribution


def _random_dist(generator, *shape, vocab, peaked=False):
    logits = torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * (3.0 if peaked else 1.0)
    probs = logits.softmax(-1)
    # a zero-probability token makes the residual and the acceptance ratio hit their edge cases
    probs[..., 0] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def _cells(breakpoints):
    """Midpoints and widths of the intervals [0, 1] is cut into by `breakpoints`."""
    edges = sorted({0.0, 1.0, *[float(b) for b in breakpoints if 0.0 < float(b) < 1.0]})
    return [((lo + hi) / 2, hi - lo) for lo, hi in zip(edges[:-1], edges[1:])]


def _exact_output_distribution(p_tree, q_tree, k, vocab, deterministic):
    """Distribution of the first k+1 tokens emitted by one verification step followed by plain target
    sampling, computed exactly: the verifier is a piecewise-constant function of its uniforms, so we
    evaluate it once per cell of the grid its breakpoints define and weight by the cell's volume."""
    out = torch.zeros((vocab,) * (k + 1), dtype=torch.float64)
    for drafts in itertools.product(range(vocab), repeat=k):
        weight, q_rows = 1.0, []
        for i in range(k):
            q = q_tree[drafts[:i]]
            if deterministic:  # a deterministic drafter proposes argmax q; q_i is one-hot at it
                if drafts[i] != int(q.argmax()):
                    weight = 0.0
                q = torch.nn.functional.one_hot(torch.tensor(drafts[i]), vocab).double()
            weight *= float(q[drafts[i]])
            q_rows.append(q)
        if weight == 0.0:
            continue
        p_rows = [p_tree[drafts[:i]] for i in range(k + 1)]
        accept_breaks = [[min(1.0, float(p_rows[i][drafts[i]] / q_rows[i][drafts[i]]))] for i in range(k)]
        finals = [residual_distribution(p_rows[i], q_rows[i]) for i in range(k)] + [p_rows[k]]
        sample_breaks = [float(c) for f in finals for c in f.cumsum(0)]
        grid = list(itertools.product(*[_cells(b) for b in accept_breaks], _cells(sample_breaks)))
        u = torch.tensor([[c[0] for c in cell] for cell in grid], dtype=torch.float64)
        area = torch.tensor([[c[1] for c in cell] for cell in grid], dtype=torch.float64).prod(-1)
        G = len(grid)
        n, nxt = rejection_verify(
            torch.tensor(drafts).repeat(G, 1),
            None if deterministic else torch.stack(q_rows).repeat(G, 1, 1),
            torch.stack(p_rows).repeat(G, 1, 1),
            uniforms=u,
        )
        for g in range(G):
            emitted = tuple(drafts[: int(n[g])]) + (int(nxt[g]),)
            # complete to k+1 tokens with the target's own conditionals
            completions = {emitted: 1.0}
            while len(next(iter(completions))) < k + 1:
                completions = {
                    prefix + (x,): w * float(p_tree[prefix][x])
                    for prefix, w in completions.items()
                    for x in range(vocab)
                }
            for seq, w in completions.items():
                out[seq] += weight * float(area[g]) * w
    return out


def _target_joint(p_tree, k, vocab):
    joint = torch.zeros((vocab,) * (k + 1), dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=k + 1):
        steps = [float(p_tree[seq[:i]][seq[i]]) for i in range(k + 1)]
        joint[seq] = float(torch.tensor(steps, dtype=torch.float64).prod())
    return joint


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("deterministic", [False, True])
def test_one_verification_step_reproduces_target_distribution_exactly(k, deterministic):
    vocab = 4
    g = torch.Generator().manual_seed(10 * k + deterministic)
    prefixes = [pre for m in range(k + 1) for pre in itertools.product(range(vocab), repeat=m)]
    p_tree = {pre: _random_dist(g, vocab=vocab) for pre in prefixes}
    q_tree = {pre: _random_dist(g, vocab=vocab, peaked=True) for pre in prefixes}
    got = _exact_output_distribution(p_tree, q_tree, k, vocab, deterministic)
    want = _target_joint(p_tree, k, vocab)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-9)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("k", [1, 2])
def test_a_draft_distribution_with_zeros_where_the_target_has_mass_still_gives_the_target_exactly(k):
    """A drafter over part of the vocabulary (`decodelab.mtp.draft_head`) proposes q = 0 off its subset:
    the residual max(p - q, 0) must then emit those tokens with exactly the target's probability."""
    vocab = 4
    g = torch.Generator().manual_seed(7 + k)
    prefixes = [pre for m in range(k + 1) for pre in itertools.product(range(vocab), repeat=m)]
    p_tree = {pre: _random_dist(g, vocab=vocab) for pre in prefixes}
    q_tree = {}
    for pre in prefixes:
        q = _random_dist(g, vocab=vocab, peaked=True)
        q[3] = 0.0  # token 3: never drafted, though the target gives it mass
        q_tree[pre] = q / q.sum()
    assert all(float(p[3]) > 0 for p in p_tree.values())
    got = _exact_output_distribution(p_tree, q_tree, k, vocab, deterministic=False)
    torch.testing.assert_close(got, _target_joint(p_tree, k, vocab), atol=1e-6, rtol=0)


def test_padding_drafts_are_never_accepted_and_next_token_comes_from_target():
    g = torch.Generator().manual_seed(0)
    p = _random_dist(g, 3, 3, vocab=5)  # B=3, k=2
    drafts = p[:, :2].argmax(-1)
    n, nxt = rejection_verify(drafts, None, p, lengths=torch.tensor([0, 1, 2]), generator=g)
    assert (n <= torch.tensor([0, 1, 2])).all()
    n_greedy, next_greedy = greedy_verify(drafts, p.log(), lengths=torch.tensor([0, 1, 2]))
    assert n_greedy.tolist() == [0, 1, 2]
    assert next_greedy.tolist() == [int(p[b, n_greedy[b]].argmax()) for b in range(3)]


def test_greedy_verify_accepts_longest_matching_prefix():
    logits = torch.full((2, 4, 6), -1.0)
    choice = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2]])
    logits.scatter_(2, choice.unsqueeze(-1), 1.0)
    drafts = torch.tensor([[1, 2, 3], [5, 1, 1]])
    n, nxt = greedy_verify(drafts, logits)
    assert n.tolist() == [3, 1]
    assert nxt.tolist() == [4, 0]  # bonus token for row 0, correction for row 1


# ----------------------------------------------------------------------------------------------
# the batched loop on a tiny model

from decodelab.core import engine  # noqa: E402
from decodelab.core.models import tiny_model  # noqa: E402
from decodelab.core.sampling import Sampler, SamplerConfig  # noqa: E402
from decodelab.speculation import decode as speculative  # noqa: E402
from decodelab.speculation import policy as spec_policy  # noqa: E402
from decodelab.speculation.drafters import LayerSkipDrafter, ModelDrafter, NGramDrafter, make_drafter, truncated_model  # noqa: E402
from decodelab.speculation.roofline import Hardware, ModelShape, step_time  # noqa: E402
from decodelab.speculation.row_policy import RowBudgetPolicy  # noqa: E402


def _prompts(batch, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 12][:batch] if batch > 1 else [11]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return [p + p[: n // 2] for p, n in zip(prompts, lengths)]  # some repetition for the n-gram drafter


def _adaptive(model):
    shape = ModelShape.from_config(model.hf_model.config, bytes_per_param=4)
    hw = Hardware("test", peak=1e10, bandwidth=1e10, overhead=1e-4)
    return spec_policy.AdaptivePolicy(lambda b, n, s: step_time(shape, hw, b, n, s))


def _drafters(model):
    return {
        "ngram": lambda: NGramDrafter(),
        "layer_skip": lambda: LayerSkipDrafter(model, [0, 2]),
        "draft_model": lambda: ModelDrafter(truncated_model(model, 2), model),
    }


class _FreeDrafts(RowBudgetPolicy):
    """Drafts cost nothing, whatever the drafter's `relative_cost` says: every row may draft."""

    def draft_seconds(self, context):
        return 0.0


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model"])
@pytest.mark.parametrize("k", [1, 4, "adaptive", "rows"])
def test_greedy_speculative_equals_plain_greedy_token_for_token(tiny, batch, drafter, k):
    prompts = _prompts(batch)
    ref = engine.generate(tiny, prompts, max_new_tokens=30, eos_token_ids=[])
    # "rows": per-row k under a verify budget of batch + 2 tokens, on a free verify (mixed k per step)
    policy = (_adaptive(tiny) if k == "adaptive" else k if k != "rows"
              else _FreeDrafts(lambda b, n, s: 1.0, verify_budget=batch + 2))
    out = speculative.generate(tiny, prompts, _drafters(tiny)[drafter](), k=policy, max_new_tokens=30, eos_token_ids=[])
    assert out.tokens == ref.tokens
    assert out.stats.tau >= 1.0
    if k == "rows":
        # the budget: every active row's pending token + its drafts (finished rows, -1, verify nothing)
        assert out.stats.row_k and all(sum(x + 1 for x in ks if x >= 0) <= batch + 2 for ks in out.stats.row_k)
        assert any(max(ks) > 0 for ks in out.stats.row_k)
        if batch > 1 and drafter != "ngram":  # the budget covers 2 drafts: 3 rows cannot all get the same k > 0
            assert any(len(set(ks)) > 1 for ks in out.stats.row_k)


def test_eos_inside_an_accepted_run_ends_the_row(tiny):
    prompts = _prompts(3)
    ref = engine.generate(tiny, prompts, max_new_tokens=24, eos_token_ids=[])
    eos = [ref.tokens[1][6]]  # a token row 1 emits mid-way
    want = engine.generate(tiny, prompts, max_new_tokens=24, eos_token_ids=eos)
    # the full model as its own drafter accepts every draft, so EOS lands inside an accepted run
    perfect = LayerSkipDrafter(tiny, range(tiny.transformer.n_layers))
    out = speculative.generate(tiny, prompts, perfect, k=8, max_new_tokens=24, eos_token_ids=eos)
    assert out.tokens == want.tokens
    assert out.finished == want.finished
    assert out.tokens[1][-1] == eos[0] and len(out.tokens[1]) <= 7


def test_perfect_drafter_accepts_every_draft(tiny):
    perfect = LayerSkipDrafter(tiny, range(tiny.transformer.n_layers))
    out = speculative.generate(tiny, _prompts(3), perfect, k=4, max_new_tokens=21, eos_token_ids=[])
    assert out.stats.tau == pytest.approx(5.0)
    assert out.stats.acceptance_per_position[:4] == [1.0, 1.0, 1.0, 1.0]


def test_shared_prefill_gives_the_same_tokens_as_a_fresh_one(tiny):
    prompts = _prompts(3)
    pre = speculative.prefill(tiny, prompts, max_new_tokens=20)
    first = speculative.generate(tiny, drafter=NGramDrafter(), k=2, max_new_tokens=20, prefilled=pre, eos_token_ids=[])
    again = speculative.generate(tiny, drafter=None, k=0, max_new_tokens=20, prefilled=pre, eos_token_ids=[])
    assert first.tokens == again.tokens


def _exact_marginals(model, prompt, sampler, n_positions):
    """Exact law of generated tokens 1..n_positions under plain sampling, by enumerating prefixes."""
    tr = model.transformer
    V = tr.vocab_size
    seqs, weights = [list(prompt)], torch.ones(1, dtype=torch.float64)
    marginals = []
    for _ in range(n_positions):
        cache, logits = engine.prefill(tr, seqs, max_new_tokens=1)
        p = sampler.probs(logits).double() * weights[:, None]  # (N, V) joint of prefix and next token
        marginals.append(p.sum(0))
        keep = p.flatten() > 1e-9
        idx = keep.nonzero().squeeze(1)
        seqs = [seqs[i // V] + [i % V] for i in idx.tolist()]
        weights = p.flatten()[idx]
    return marginals


@pytest.mark.parametrize("drafter,per_row", [("layer_skip", False), ("ngram", False), ("layer_skip", True),
                                              ("ngram", True)])
def test_sampled_speculative_decoding_is_indistinguishable_from_plain_sampling(drafter, per_row):
    from scipy.stats import chisquare

    model = tiny_model(seed=1, vocab_size=24)
    sampler = Sampler(SamplerConfig(temperature=1.0, top_k=8))
    prompt = [5, 9, 5, 9, 5]
    exact = _exact_marginals(model, prompt, sampler, 3)
    n_rows = 3000
    d = LayerSkipDrafter(model, [0, 1]) if drafter == "layer_skip" else NGramDrafter(max_ngram=2)
    # per_row: each row's k from its own acceptance, a budget of 2 drafts per row on average (mixed k, 0 too)
    # free_evidence off: step 1's few n-gram matches would teach it to draft little, and this test needs drafts
    k = _FreeDrafts(lambda b, n, s: 1.0, ks=(0, 1, 3), verify_budget=3 * n_rows, min_gain=0.0,
                        free_evidence=False) if per_row else 3
    out = speculative.generate(model, [prompt] * n_rows, d, k=k, max_new_tokens=3, sampler=sampler,
                               generator=torch.Generator().manual_seed(0), eos_token_ids=[])
    if per_row:
        assert any(len(set(ks)) > 1 for ks in out.stats.row_k)  # rows really verified different k
    assert sum(out.stats.accepted) > 50  # drafts were accepted: positions 2 and 3 often came through verification
    for pos, want in enumerate(exact):
        counts = torch.bincount(torch.tensor([row[pos] for row in out.tokens]), minlength=want.numel()).double()
        expected = want * n_rows
        big = expected >= 5  # pool the rare tokens into one bin
        f_obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
        f_exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
        nonzero = f_exp > 0
        assert f_obs[~nonzero].sum() == 0, "a token the target gives probability 0 was sampled"
        f_obs, f_exp = f_obs[nonzero], f_exp[nonzero] * f_obs.sum() / f_exp[nonzero].sum()
        assert chisquare(f_obs.numpy(), f_exp.numpy()).pvalue > 1e-3, f"position {pos + 1}"


def test_bad_inputs_get_clear_errors(tiny):
    prompts = _prompts(1)
    with pytest.raises(ValueError, match="k=-1"):
        speculative.generate(tiny, prompts, NGramDrafter(), k=-1, max_new_tokens=4)
    with pytest.raises(ValueError, match="k=3 needs a drafter"):
        speculative.generate(tiny, prompts, None, k=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter='medusa' is unknown"):
        make_drafter("medusa", tiny)
    with pytest.raises(ValueError, match="k=0"):
        NGramDrafter().propose(None, 0)
    other = tiny_model(seed=0, vocab_size=128)
    with pytest.raises(ValueError, match="vocab_size=128 differs"):
        ModelDrafter(other, tiny)
    with pytest.raises(ValueError, match="layers="):
        LayerSkipDrafter(tiny, [3, 1])


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_on_the_embedded_model(smol, chat_ids):
    ref = engine.generate(smol, chat_ids, max_new_tokens=8)
    drafters = {
        "ngram": (lambda: NGramDrafter(), 4),
        "layer_skip": (lambda: LayerSkipDrafter(smol, range(0, 30, 2)), 2),
        "draft_model": (lambda: ModelDrafter(truncated_model(smol, 10), smol), 2),
    }
    for name, (make, k) in drafters.items():  # ragged batch of 3
        assert speculative.generate(smol, chat_ids, make(), k=k, max_new_tokens=8).tokens == ref.tokens, name
    one = speculative.generate(smol, chat_ids[1:2], NGramDrafter(), k=4, max_new_tokens=8)
    assert one.tokens == ref.tokens[1:2]


def test_adaptive_policy_speculates_when_verify_is_free_and_not_when_it_costs_k_plus_one_steps():
    free = spec_policy.AdaptivePolicy(lambda b, n, s: 1.0)  # memory-bound: n tokens cost one step
    bound = spec_policy.AdaptivePolicy(lambda b, n, s: float(n), probe_budget=0.0)  # compute-bound
    for policy in (free, bound):
        policy.begin(4)
        for _ in range(20):  # every draft accepted at k = 4
            policy.update(4, torch.tensor([4, 4, 4, 4]), torch.ones(4, dtype=torch.bool), 1.0, 0.0)
    assert free.choose_k(4, context=10.0) == max(speculative.K_CHOICES)
    # compute-bound: even perfect acceptance cannot beat one token per step (k+1 tokens cost k+1 steps)
    assert all(bound.goodput(k, 10.0) <= bound.goodput(0, 10.0) + 1e-9 for k in speculative.K_CHOICES)
    # compute-bound and nothing accepted: plain decoding
    bound.begin(4)
    for _ in range(20):
        bound.update(1, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), 1.0, 0.0)
    assert bound.choose_k(4, context=10.0) == 0


def test_adaptive_policy_probes_after_a_run_of_plain_steps():
    policy = spec_policy.AdaptivePolicy(lambda b, n, s: float(n), probe_budget=0.1)
    policy.begin(1)
    for _ in range(10):
        policy.update(1, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), 1.0, 0.0)
    chosen = [policy.choose_k(1, context=1.0) for _ in range(30)]
    assert chosen.count(1) >= 2 and chosen.count(0) >= 20


def test_steps_where_no_row_has_a_draft_verify_nothing(tiny):
    prompts = [[10, 11, 12, 13, 14]]
    ref = engine.generate(tiny, prompts, max_new_tokens=6, eos_token_ids=[])
    out = speculative.generate(tiny, prompts, NGramDrafter(min_ngram=3, max_ngram=3), k=4, max_new_tokens=6,
                               eos_token_ids=[])
    assert out.tokens == ref.tokens
    # the first step has no 3-gram match: a plain decode step (k = 0), not a verify of 4 padding drafts
    assert out.stats.step_k[0] == 0


class _HiddenRecorder(NGramDrafter):
    """An n-gram drafter that records the hidden states the loop hands to `needs_hidden` drafters."""

    needs_hidden = True

    def begin(self, prompts, *, max_len=0):
        super().begin(prompts, max_len=max_len)
        self.seen = [[] for _ in prompts]

    def _propose(self, ctx, k):
        for b in range(ctx.batch_size):
            self.seen[b].append(ctx.new_hidden[b, : int(ctx.new_hidden_lengths[b])])
            assert len(ctx.tokens[b]) - 1 == sum(h.shape[0] for h in self.seen[b])  # every cached position, once
        return super()._propose(ctx, k)


@pytest.mark.parametrize("k", [3, "plain steps in between"])
def test_needs_hidden_drafters_get_the_targets_state_of_every_cached_position(tiny, k):
    prompts = _prompts(3)
    rec = _HiddenRecorder()
    if k != 3:  # a policy alternating plain steps and k = 2: hidden states of plain steps must pile up
        k = spec_policy.AdaptivePolicy(lambda b, n, s: 1.0)
        schedule = iter([0, 0, 2] * 20)
        k.choose_k = lambda n_active, context: next(schedule)
    out = speculative.generate(tiny, prompts, rec, k=k, max_new_tokens=12, eos_token_ids=[])
    tr = tiny.transformer
    for b, prompt in enumerate(prompts):
        seen = torch.cat(rec.seen[b])
        full = torch.tensor([prompt + out.tokens[b]])[:, : seen.shape[0]]
        _, hidden = tr.forward(full, tr.new_cache(1, full.shape[1]), return_hidden=True)
        torch.testing.assert_close(seen, hidden[0], atol=1e-4, rtol=1e-4)


def test_adaptive_policy_learns_the_observed_verify_cost_and_stops_speculating():
    # the model says verifying is free; the steps show k = 4 costs five plain steps
    policy = spec_policy.AdaptivePolicy(lambda b, n, s: 1.0, ks=(0, 4), probe_budget=0.0)
    policy.begin(1)
    assert policy.choose_k(1, context=10.0) == 4
    for _ in range(20):
        policy.update(0, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), 1.0, 0.0, context=10.0)
        policy.update(4, torch.tensor([4]), torch.ones(1, dtype=torch.bool), 5.0, 0.0, context=10.0)
    assert policy.ratio(4) == pytest.approx(5.0, rel=1e-3) and policy.ratio(0) == pytest.approx(1.0)
    # five tokens for five plain steps' time: no better than plain decoding, so plain it is
    assert policy.choose_k(1, context=10.0) == 0


def test_adaptive_policy_picks_plain_unless_speculation_clearly_pays():
    # prior acceptance 0.5: k = 1 yields 1.5 tokens per 1.45-step verify, 3% over plain: within the margin
    step = lambda b, n, s: 1.0 + 0.45 * (n - 1)  # noqa: E731
    assert spec_policy.AdaptivePolicy(step, ks=(0, 1), probe_budget=0.0).choose_k(1, context=1.0) == 0
    assert spec_policy.AdaptivePolicy(step, ks=(0, 1), probe_budget=0.0, margin=0.0).choose_k(1, context=1.0) == 1


def test_interleaved_method_runs_keep_plain_greedy_tokens_and_the_fastest_round(tiny):
    from decodelab.speculation import bench as speculative_bench

    prompts = _prompts(2)
    rows = speculative_bench.run_methods(tiny, prompts, [("ngram", NGramDrafter, 2)], max_new_tokens=8,
                                         eos_token_ids=[], repeats=2)
    assert [r["drafter"] for r in rows] == ["plain", "ngram"] and rows[0]["speedup"] == 1.0
    plain = engine.generate(tiny, prompts, max_new_tokens=8, eos_token_ids=[]).tokens
    assert rows[1]["tokens"] == rows[0]["tokens"] == plain
    calib = speculative_bench.measure_step_times(tiny, [1, 2], (1, 3), context=8, repeats=3)
    assert all(r["seconds"] <= r["seconds_median"] for r in calib) and len(calib) == 4



class _SleepyPolicy:
    """A k policy that spends `pause` seconds deciding and `pause` updating, every step."""

    ks = (0, 2)

    def __init__(self, pause):
        self.pause, self.calls = pause, 0

    def begin(self, batch_size):
        pass

    def choose_k(self, n_active, *, context):
        import time

        time.sleep(self.pause)
        self.calls += 1
        return 2

    def update(self, *args, **kwargs):
        import time

        time.sleep(self.pause)


def test_the_policys_own_decision_time_is_charged_to_its_steps(tiny):
    pause = 0.02
    policy = _SleepyPolicy(pause)
    out = speculative.generate(tiny, _prompts(2), NGramDrafter(), k=policy, max_new_tokens=6, eos_token_ids=[])
    steps = len(out.stats.step_s)
    assert steps == policy.calls >= 1
    assert all(s >= 2 * pause for s in out.stats.step_s)  # decide + update inside every step's clock
    assert out.stats.decode_s >= 2 * pause * steps
    assert out.stats.as_dict()["policy_s"] >= 2 * pause * steps
    assert out.stats.as_dict()["policy_s"] <= out.stats.decode_s


def _row_generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_plain_steps_with_per_row_generators_sample_what_engine_generate_samples(tiny):
    prompts = _prompts(3)
    sampler = Sampler(SamplerConfig(temperature=1.0))
    ref = engine.generate(tiny, prompts, max_new_tokens=12, sampler=sampler, generator=_row_generators([4, 5, 6]),
                          eos_token_ids=[])
    out = speculative.generate(tiny, prompts, None, k=0, max_new_tokens=12, sampler=sampler,
                               generator=_row_generators([4, 5, 6]), eos_token_ids=[])
    assert out.tokens == ref.tokens


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_per_row_generators_make_a_rows_sample_independent_of_its_batch(tiny, drafter):
    prompts = _prompts(3)
    sampler = Sampler(SamplerConfig(temperature=1.0))
    make = _drafters(tiny)[drafter]
    batch = speculative.generate(tiny, prompts, make(), k=3, max_new_tokens=14, sampler=sampler,
                                 generator=_row_generators([7, 8, 9]), eos_token_ids=[])
    again = speculative.generate(tiny, prompts, make(), k=3, max_new_tokens=14, sampler=sampler,
                                 generator=_row_generators([7, 8, 9]), eos_token_ids=[])
    assert batch.tokens == again.tokens  # reproducible per-row streams
    for b, (prompt, seed) in enumerate(zip(prompts, [7, 8, 9])):
        alone = speculative.generate(tiny, [prompt], make(), k=3, max_new_tokens=14, sampler=sampler,
                                     generator=_row_generators([seed]), eos_token_ids=[])
        assert alone.tokens[0] == batch.tokens[b], f"row {b}"
    other = speculative.generate(tiny, prompts, make(), k=3, max_new_tokens=14, sampler=sampler,
                                 generator=_row_generators([7, 8, 99]), eos_token_ids=[])
    assert other.tokens[:2] == batch.tokens[:2]  # reseeding row 2 leaves rows 0 and 1 alone


def test_a_generator_list_of_the_wrong_length_is_a_clear_error(tiny):
    sampler = Sampler(SamplerConfig(temperature=1.0))
    with pytest.raises(ValueError, match="list of 2 generators, need one per row \\(3"):
        speculative.generate(tiny, _prompts(3), NGramDrafter(), k=2, max_new_tokens=4, sampler=sampler,
                             generator=_row_generators([1, 2]))


# ----------------------------------------------------------------------------------------------
# notebook 01's goals and generated sentences

def _sweep_rows(batches=(1, 4), category_speedup=1.8):
    rows = []
    for b in batches:
        rows += [{"batch": b, "drafter": "plain", "k": 0, "speedup": 1.0},
                 {"batch": b, "drafter": "ngram", "k": 2, "speedup": category_speedup / b},
                 {"batch": b, "drafter": "ngram", "k": 4, "speedup": category_speedup / b - 0.1},
                 {"batch": b, "drafter": "ngram", "k": "adaptive", "speedup": 0.9 * category_speedup / b}]
    return rows


def test_goals_the_run_could_not_measure_are_not_measured():
    from decodelab.speculation import sweep_goals

    rows = [r for r in _sweep_rows() if r["k"] != "adaptive"]
    goals = {g.name: g for g in sweep_goals.speculation_goals(rows, drafters=["ngram"], grid_category="chat")}
    assert set(goals) == {"ngram_speedup_b1_code", "ngram_ours_over_hf_prompt_lookup",
                          "adaptive_vs_plain_at_largest_batch_ngram", "adaptive_fraction_of_best_fixed_k_b1_ngram",
                          "roofline_heldout_error", "adaptive_vs_plain_every_batch_ngram",
                          "adaptive_fraction_of_best_fixed_k_every_batch_ngram", "k0_overhead"}
    assert all(g.value is None and g.met is None and g.status == "not measured" for g in goals.values())
    assert "code_edit" in goals["ngram_speedup_b1_code"].note


def test_goals_are_judged_against_their_targets_from_the_sweep():
    from decodelab.speculation import sweep_goals

    hf = [{"impl": "ours", "method": "ngram", "tokens_per_s": 30.0},
          {"impl": "hf", "method": "ngram", "tokens_per_s": 20.0}]
    goals = {g.name: g for g in sweep_goals.speculation_goals(
        _sweep_rows(), drafters=["ngram"], grid_category="code_edit", hf_rows=hf, heldout_error=0.2, insample_error=0.1,
        n_heldout=3)}
    assert goals["ngram_speedup_b1_code"].value == pytest.approx(1.8) and goals["ngram_speedup_b1_code"].met is True
    assert goals["ngram_ours_over_hf_prompt_lookup"].value == pytest.approx(1.5)
    largest = goals["adaptive_vs_plain_at_largest_batch_ngram"]
    assert largest.value == pytest.approx(0.9 * 1.8 / 4) and largest.met is False and "batch 4" in largest.label
    assert goals["adaptive_fraction_of_best_fixed_k_b1_ngram"].value == pytest.approx(0.9)
    heldout = goals["roofline_heldout_error"]
    assert heldout.met is False and "in-sample error 10%" in heldout.note


def test_trend_sentences_say_falls_only_when_the_speedup_falls_with_batch():
    from decodelab.speculation import sweep_goals

    rows = [{"drafter": "a", "batch": 1, "speedup": 1.5}, {"drafter": "a", "batch": 4, "speedup": 0.8},
            {"drafter": "b", "batch": 1, "speedup": 0.9}, {"drafter": "b", "batch": 4, "speedup": 1.1},
            {"drafter": "c", "batch": 1, "speedup": 1.2}]
    a, b, c = sweep_goals.trend_sentences(rows)
    assert "falls at every larger batch" in a and "1.50x at batch 1" in a and "above plain (> 1x) at batch 1." in a
    assert "rises at every larger batch" in b and "falls" not in b
    assert "batch 1 only" in c
