"""Per-row draft lengths under a batch verify budget, the free k = 0 step, and the speedup interval."""
import math
from dataclasses import replace as dataclasses_replace

import numpy as np
import pytest
import torch

from decodelab.core import engine
from decodelab.speculation import bench as speculative_bench
from decodelab.speculation import decode as speculative
from decodelab.speculation.drafters import (
    DraftContext,
    DrafterBase,
    DraftProposal,
    LayerSkipDrafter,
    ModelDrafter,
    NGramDrafter,
    truncated_model,
)
from decodelab.speculation.row_policy import RowBudgetPolicy
from decodelab.speculation.sparse_draft import SparseKVDrafter


def _never_pays(b, n, s):
    return n ** 3 * 1.0  # compute-bound beyond hope: no acceptance makes a draft pay


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 12)]
    return [p + p[: len(p) // 2] for p in prompts]


def _learn(policy, accepted_per_row, k=4, steps=30):
    B = len(accepted_per_row)
    for _ in range(steps):
        policy.update_rows(torch.full((B,), k), torch.tensor(accepted_per_row), torch.ones(B, dtype=torch.bool),
                           step_s=1.0, draft_s=0.0)


def test_the_verify_budget_goes_to_the_rows_that_accept_most():
    policy = RowBudgetPolicy(lambda b, n, s: 1.0, verify_budget=4 + 6)
    policy.begin(4)
    _learn(policy, [4, 0, 3, 1])  # rows 0 and 2 accept nearly everything, row 1 nothing
    row_k = policy.choose_rows(torch.ones(4, dtype=torch.bool), context=10.0)
    assert int(row_k.sum()) <= 6  # the budget: 4 pending tokens + 6 drafts
    assert row_k[1] == 0 and row_k[0] >= row_k[3] and row_k[2] >= row_k[3] and row_k[0] > 0
    # a finished row gets nothing; caps (real drafts per row) bound each row
    active = torch.tensor([False, True, True, True])
    row_k = policy.choose_rows(active, context=10.0, caps=torch.tensor([8, 8, 1, 8]))
    assert row_k[0] == 0 and row_k[2] <= 1


def test_no_row_drafts_where_verification_cannot_pay():
    policy = RowBudgetPolicy(_never_pays)
    policy.begin(3)
    _learn(policy, [4, 4, 4])  # perfect acceptance, still compute-bound
    assert policy.choose_rows(torch.ones(3, dtype=torch.bool), context=10.0).tolist() == [0, 0, 0]


def test_a_verify_budget_below_the_batch_is_a_clear_error_before_any_work(tiny):
    with pytest.raises(ValueError, match=r"verify_budget=2 is below the batch size 4.*>= 4"):
        speculative.generate(tiny, _prompts(), NGramDrafter(), k=RowBudgetPolicy(lambda b, n, s: 1.0, verify_budget=2),
                             max_new_tokens=4)
    with pytest.raises(ValueError, match="verify_budget=0"):
        RowBudgetPolicy(lambda b, n, s: 1.0, verify_budget=0)


def test_an_all_k0_step_is_the_engines_plain_decode_step(tiny, monkeypatch):
    feeds = {"plain": [], "spec": []}
    forward = engine.TokenLoop.forward
    which = "plain"

    def spy(self, feed):
        feeds[which].append((feed.mode, tuple(feed.tokens.shape)))
        return forward(self, feed)

    monkeypatch.setattr(engine.TokenLoop, "forward", spy)
    prompts = _prompts()
    ref = engine.generate(tiny, prompts, max_new_tokens=12, eos_token_ids=[])
    which = "spec"
    out = speculative.generate(tiny, prompts, NGramDrafter(), k=RowBudgetPolicy(_never_pays), max_new_tokens=12,
                               eos_token_ids=[])
    assert out.tokens == ref.tokens
    assert feeds["spec"] == feeds["plain"] and all(f == ("step", (4, 1)) for f in feeds["spec"])
    assert set(out.stats.step_k) == {0} and len(out.stats.policy_s) == len(out.stats.step_s)


def test_a_draft_model_catches_up_after_plain_steps_in_one_forward(tiny, monkeypatch):
    from decodelab.speculation import drafters

    calls = []
    real = drafters.extend
    monkeypatch.setattr(drafters, "extend", lambda *a, **kw: calls.append(a[2].shape) or real(*a, **kw))
    prompts = _prompts()
    d = ModelDrafter(truncated_model(tiny, 2), tiny)
    d.begin(prompts, max_len=64)
    calls.clear()
    grown = [p + list(range(3, 3 + n)) for p, n in zip(prompts, (1, 9, 4, 12))]  # ragged unseen suffixes
    d.propose(DraftContext(tokens=grown), 3)
    assert calls[0] == (4, 12) and len(calls) == 3  # one catch-up forward, then k - 1 single-token forwards
    assert d._base.tolist() == [len(g) for g in grown]


def test_the_k0_benchmark_runs_plain_steps_only_and_keeps_the_tokens(tiny):
    res = speculative_bench.k0_overhead(tiny, _prompts(), NGramDrafter, lambda b: RowBudgetPolicy(_never_pays),
                                        max_new_tokens=6, repeats=2, eos_token_ids=[])
    assert res["nonzero_k_steps"] == 0 and res["same_tokens"] is True and res["steps"] == 5
    assert res["overhead_stepwise_min"] == pytest.approx(res["k0_s"] / res["plain_s"] - 1)
    rounds = np.array(res["round_overheads"]) + 1
    assert len(rounds) == 2 and res["overhead_rounds"] == pytest.approx(float(np.exp(np.log(rounds).mean())) - 1)
    assert res["overhead_whole_run"] > -1 and res["overhead"] > -1 and res["overhead_median_step"] > -1


def test_paired_step_overhead_trims_each_tail_alike_and_rejects_unpaired_steps():
    plain = np.full((2, 5), 0.1)
    assert speculative_bench.paired_step_overhead(plain, plain * 1.02, trim=0.0) == pytest.approx(0.02)
    other = plain * 1.01
    other[0, 0], other[1, 3] = 0.2, 0.05  # one spike each way: trimmed (1 of 10 steps per tail)
    assert speculative_bench.paired_step_overhead(plain, other, trim=0.1) == pytest.approx(0.01)
    untrimmed = np.exp(np.log(other / plain).mean()) - 1
    assert speculative_bench.paired_step_overhead(plain, other, trim=0.0) == pytest.approx(untrimmed)
    with pytest.raises(ValueError, match="one shape"):
        speculative_bench.paired_step_overhead(plain, plain[:, :4])
    with pytest.raises(ValueError, match="trim"):
        speculative_bench.paired_step_overhead(plain, plain, trim=0.5)


def test_stepwise_minimum_sums_each_steps_fastest_round_and_rejects_unlike_runs():
    assert speculative_bench.stepwise_min_seconds([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == pytest.approx(4.0)
    assert speculative_bench.stepwise_min_seconds([[0.5, 0.25]]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="different numbers of steps"):
        speculative_bench.stepwise_min_seconds([[1.0, 2.0], [1.0]])


def test_interleaved_runs_report_a_speedup_interval_around_the_fastest_round(tiny):
    rows = speculative_bench.run_methods(tiny, _prompts()[:2], [("ngram", NGramDrafter, 2)], max_new_tokens=8,
                                         eos_token_ids=[], repeats=3)
    assert [r["drafter"] for r in rows] == ["plain", "ngram"]  # the A/A twin of plain is not a row of its own
    for r in rows:
        assert r["speedup_low"] <= r["speedup_high"] and len(r["round_speedups"]) == 3
        ratios = np.log(r["round_speedups"])
        assert r["speedup_low"] <= math.exp(ratios.mean()) <= r["speedup_high"]
    assert rows[1]["tokens"] == rows[0]["tokens"]


def test_intervals_read_the_rounds_with_interrupted_steps_capped(tiny, monkeypatch):
    seen = []

    def fake_cap(rounds):  # every run's rounds pass through the cap once; a slower clock is what it hands on
        seen.append(len(rounds))
        return [(tokens, [2 * s for s in seconds]) for tokens, seconds in rounds], 7

    monkeypatch.setattr(speculative_bench, "cap_interruptions", fake_cap)
    rows = speculative_bench.run_methods(tiny, _prompts()[:2], [("ngram", NGramDrafter, 2)], max_new_tokens=6,
                                         eos_token_ids=[], repeats=3)
    assert seen == [3, 3, 3]  # plain, ngram, plain's twin
    assert [r["capped_steps"] for r in rows] == [14, 7]  # plain's row counts its twin's too
    assert all(r["speedup_low"] <= r["speedup_high"] for r in rows)


def test_a_single_round_reports_no_interval(tiny):
    rows = speculative_bench.run_methods(tiny, _prompts()[:2], [("ngram", NGramDrafter, 2)], max_new_tokens=4,
                                         eos_token_ids=[], repeats=1, warmup=False, aa_check=False)
    assert all(r["speedup_low"] is None and r["speedup_high"] is None for r in rows)


class _Pessimist(RowBudgetPolicy):
    """Starts as if every earlier draft had been rejected: verified evidence alone would never make it draft."""

    def begin(self, batch_size):
        super().begin(batch_size)
        self.pool_reached, self.pool_accepted = 50.0, 0.0


def test_free_first_draft_evidence_lets_a_pessimistic_policy_learn():
    policy = _Pessimist(lambda b, n, s: 1.0)  # verification is free: drafting pays once drafts are accepted
    policy.begin(2)
    active, zeros = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    assert policy.choose_rows(active, context=10.0).tolist() == [0, 0]
    for _ in range(3):  # plain steps only: nothing verified, so without `free` nothing would change
        policy.update_rows(zeros, zeros, active, step_s=1.0, draft_s=0.0)
    assert policy.choose_rows(active, context=10.0).tolist() == [0, 0]
    for _ in range(10):  # row 0's unverified first drafts keep matching the emitted token, row 1's never
        policy.update_rows(zeros, zeros, active, step_s=1.0, draft_s=0.0,
                           free=(torch.tensor([True, True]), torch.tensor([True, False])))
    row_k = policy.choose_rows(active, context=10.0)
    # free verification: even a weak row may get drafts (filled to the step's width: they cost nothing)
    assert row_k[0] >= row_k[1] and row_k[0] >= 4
    assert policy.row_acceptance()[0] > 5 * policy.row_acceptance()[1]  # the rows' evidence still differs


def test_live_rows_are_filled_to_the_width_a_step_pays_for_anyway():
    # widths cost the same per step whatever each row verifies (the engine pads to the widest)
    policy = RowBudgetPolicy(lambda b, n, s: 1.0 + 0.01 * np.asarray(n, dtype=float))
    policy.begin(3)
    _learn(policy, [4, 1, 0])  # row 0 accepts everything, row 1 some, row 2 nothing
    policy.pool_reached, policy.pool_accepted = 1e6, 0.0  # a pessimistic pool: row 2 stays dead
    row_k = policy.choose_rows(torch.ones(3, dtype=torch.bool), context=10.0, caps=torch.tensor([8, 8, 8]))
    width = int(row_k.max())
    assert width >= 4 and row_k[1] == width and row_k[2] == 0  # the live row rides along, the dead one not
    capped = policy.choose_rows(torch.ones(3, dtype=torch.bool), context=10.0, caps=torch.tensor([8, 2, 8]))
    assert capped[1] == 2  # never beyond a row's real drafts
    budget = RowBudgetPolicy(lambda b, n, s: 1.0, verify_budget=3 + 5)
    budget.begin(3)
    _learn(budget, [4, 1, 0])
    assert int(budget.choose_rows(torch.ones(3, dtype=torch.bool), context=10.0).sum()) <= 5  # the budget binds


def test_a_drafter_is_asked_only_where_some_draft_could_pay():
    assert not RowBudgetPolicy(_never_pays).worth_asking(4, context=10.0)
    assert RowBudgetPolicy(lambda b, n, s: 1.0).worth_asking(4, context=10.0)
    assert not RowBudgetPolicy(lambda b, n, s: 1.0).worth_asking(0, context=10.0)


class _Copier(DrafterBase):
    """A cheap drafter that proposes the target's own greedy continuation (a prompt the answer copies exactly)."""

    name, cheap = "copier", True

    def __init__(self, prompts, answers):
        self.starts, self.answers = [len(p) for p in prompts], answers

    def _propose(self, ctx, k):
        rows = []
        for b, seq in enumerate(ctx.tokens):
            got = self.answers[b][len(seq) - self.starts[b]:][:k]
            rows.append(got + [seq[-1]] * (k - len(got)))
        lengths = [min(k, max(len(self.answers[b]) - (len(s) - self.starts[b]), 0)) for b, s in enumerate(ctx.tokens)]
        return DraftProposal(tokens=torch.tensor(rows), lengths=torch.tensor(lengths))


class _ModelTimedPessimist(_Pessimist):
    """A _Pessimist that trusts its step-time model and ignores the wall clock, so its decisions (and the test
    below) do not depend on the machine's load."""

    def learn_time(self, k, verify_s, context):
        pass


def test_a_pessimistic_policy_drafts_on_a_copying_prompt_from_free_evidence(tiny):
    prompts = _prompts()
    ref = engine.generate(tiny, prompts, max_new_tokens=24, eos_token_ids=[])
    out = speculative.generate(tiny, prompts, _Copier(prompts, ref.tokens),
                               k=_ModelTimedPessimist(lambda b, n, s: 1.0),
                               max_new_tokens=24, eos_token_ids=[])
    assert out.tokens == ref.tokens
    # its first steps are plain (the pessimistic prior), then the free evidence makes it draft
    assert out.stats.step_k[0] == 0 and any(k > 0 for k in out.stats.step_k)
    assert out.stats.tau > 1.5


def test_the_k0_benchmark_reuses_the_shared_prefill_for_both_sides(tiny, monkeypatch):
    calls = []
    real = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pre = speculative.prefill(tiny, _prompts(), max_new_tokens=6)
    calls.clear()
    res = speculative_bench.k0_overhead(tiny, _prompts(), NGramDrafter, lambda b: RowBudgetPolicy(_never_pays),
                                        max_new_tokens=6, repeats=2, eos_token_ids=[], prefilled=pre)
    assert calls == [] and res["nonzero_k_steps"] == 0 and res["same_tokens"] is True and res["policy_s"] >= 0


def test_every_compared_run_decodes_on_a_copy_of_the_shared_prefill(tiny):
    # plain must not get the prefill's own cache while the methods get copies: alike on both sides
    pre = speculative.prefill(tiny, _prompts()[:2], max_new_tokens=6)
    pre.cache.truncate(pre.prompt_lengths.clone())
    keys, lengths = pre.cache.keys.clone(), pre.cache.lengths.clone()
    speculative_bench.run_methods(tiny, _prompts()[:2], [("ngram", NGramDrafter, 2)], max_new_tokens=6,
                                  eos_token_ids=[], repeats=2, prefilled=pre)
    speculative_bench.k0_overhead(tiny, _prompts()[:2], NGramDrafter, lambda b: RowBudgetPolicy(_never_pays),
                                  max_new_tokens=6, repeats=2, eos_token_ids=[], prefilled=pre)
    assert torch.equal(pre.cache.lengths, lengths) and torch.equal(pre.cache.keys, keys)


def test_side_by_side_steps_every_live_run_in_turn_and_returns_each_result():
    trace = []

    def run(name, n):
        for i in range(n):
            trace.append((name, i))
            yield
        return f"{name} done"

    out = speculative_bench.side_by_side({"a": run("a", 3), "b": run("b", 1), "c": run("c", 2)})
    assert out == {"a": "a done", "b": "b done", "c": "c done"}
    assert trace == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]


def test_step_generators_yield_once_per_timed_step_and_equal_the_driven_decode(tiny):
    prompts = _prompts()[:2]
    plain = engine.generate(tiny, prompts, max_new_tokens=6, eos_token_ids=[])
    steps = speculative.generate_steps(tiny, prompts, NGramDrafter(), k=2, max_new_tokens=6, eos_token_ids=[])
    n_yields = 0
    while True:
        try:
            next(steps)
            n_yields += 1
        except StopIteration as stop:
            result = stop.value
            break
    assert result.tokens == plain.tokens and n_yields == len(result.stats.step_s) > 0


def test_side_by_side_runs_own_their_caches_and_keep_greedy_tokens(tiny):
    prompts = _prompts()[:2]
    pre = speculative.prefill(tiny, prompts, max_new_tokens=6)
    copy = speculative_bench.own_cache(pre)
    assert copy.cache.keys.data_ptr() != pre.cache.keys.data_ptr()
    assert torch.equal(copy.cache.keys, pre.cache.keys) and torch.equal(copy.cache.lengths, pre.cache.lengths)
    copy.cache.advance(torch.ones(2, dtype=torch.long))
    assert not torch.equal(copy.cache.lengths, pre.cache.lengths)  # the original is untouched
    plain = engine.generate(tiny, prompts, max_new_tokens=6, eos_token_ids=[]).tokens
    runs = {i: speculative.generate_steps(tiny, drafter=d, k=k, max_new_tokens=6, eos_token_ids=[],
                                          prefilled=pre if i == 0 else speculative_bench.own_cache(pre))
            for i, (d, k) in enumerate([(None, 0), (NGramDrafter(), 1), (NGramDrafter(), 4)])}
    assert all(res.tokens == plain for res in speculative_bench.side_by_side(runs).values())


def test_methods_sharing_one_drafter_object_are_refused_before_any_step(tiny):
    shared = NGramDrafter()
    with pytest.raises(ValueError, match="one drafter object for several runs"):
        speculative_bench.run_methods(tiny, _prompts()[:2], [("ngram", lambda: shared, 1),
                                                             ("ngram", lambda: shared, 2)],
                                      max_new_tokens=4, eos_token_ids=[], warmup=False)


def test_plain_step_updates_equal_the_general_update_with_every_k_zero():
    # update_plain defers the row counts' decay; it must leave the policy where update_rows(k = 0) would
    step_time = lambda b, n, s: 1.0 + 0.2 * np.asarray(n, dtype=float)  # noqa: E731
    lazy, eager = RowBudgetPolicy(step_time), RowBudgetPolicy(step_time)
    active, zeros = torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    for policy in (lazy, eager):
        policy.begin(3)
        _learn(policy, [4, 1, 0], steps=5)
    for step in range(7):
        lazy.update_plain(step_s=1.1 + 0.01 * step, context=10.0)
        eager.update_rows(zeros, zeros, active, step_s=1.1 + 0.01 * step, draft_s=0.0, context=10.0)
    assert np.allclose(lazy.row_acceptance(), eager.row_acceptance(), rtol=1e-12)
    assert lazy.time_ratio == pytest.approx(eager.time_ratio, rel=1e-12)
    assert lazy.choose_rows(active, context=10.0).tolist() == eager.choose_rows(active, context=10.0).tolist()
    # a later drafting step lands on the same counts too (the deferred decay is applied first)
    for policy in (lazy, eager):
        policy.update_rows(torch.full((3,), 2), torch.tensor([2, 1, 0]), active, step_s=1.5, draft_s=0.1,
                           context=10.0)
    assert np.allclose(lazy.row_reached, eager.row_reached) and np.allclose(lazy.row_accepted, eager.row_accepted)


def test_a_step_that_cannot_pay_chooses_k0_for_every_row_without_the_full_search():
    policy = RowBudgetPolicy(_never_pays)
    policy.begin(4)
    _learn(policy, [4, 4, 4, 4])
    active = torch.ones(4, dtype=torch.bool)
    assert not policy.worth_asking(4, context=10.0)
    assert policy.choose_rows(active, context=10.0).tolist() == [0, 0, 0, 0]
    # the shortcut holds for one decision only: the next choose_rows searches again and still finds k = 0
    assert policy.choose_rows(active, context=10.0).tolist() == [0, 0, 0, 0]
    assert policy.history[-2:] == [0, 0]


def test_learned_verify_ratios_reach_the_ks_that_borrow_them():
    policy = RowBudgetPolicy(lambda b, n, s: 1.0)
    policy.begin(2)
    policy.learn_time(0, 2.0, 10.0)
    assert policy._ratios().tolist() == [2.0] * len(policy._widths)  # every k borrows k = 0's ratio
    policy.learn_time(0, 4.0, 10.0)  # k = 0 seen again: updated in place
    assert policy._ratios().tolist() == [policy.time_ratio[0]] * len(policy._widths)
    policy.learn_time(2, 1.0, 10.0)  # a new k: k >= 2 now borrow from k = 2, k = 1 from k = 0 (a tie: the smaller)
    expect = [policy.ratio(k) for k in range(len(policy._widths))]
    assert policy._ratios().tolist() == expect
    assert expect[1] == policy.time_ratio[0] and expect[2:] == [1.0] * (len(expect) - 2)


def test_acceptance_is_learned_per_proposal_kind():
    # rows 0 and 1 miss every weak (kind 1) draft; kind 3 has never been judged: its prior is untouched
    policy = RowBudgetPolicy(lambda b, n, s: 1.0 + 0.01 * np.asarray(n, dtype=float))
    policy.begin(2)
    active, weak, strong = torch.ones(2, dtype=torch.bool), torch.tensor([1, 1]), torch.tensor([3, 3])
    for _ in range(4):
        policy.choose_rows(active, context=10.0, kinds=weak)
        policy.update_rows(torch.full((2,), 4), torch.zeros(2, dtype=torch.long), active, step_s=1.0, draft_s=0.0)
    assert policy.choose_rows(active, context=10.0, kinds=weak).tolist() == [0, 0]
    assert policy.row_acceptance().max() < 0.1
    assert policy.choose_rows(active, context=10.0, kinds=strong).min() > 0  # kind 3: the prior 0.5 drafts
    assert policy.row_acceptance().tolist() == [0.5, 0.5]
    policy.choose_rows(active, context=10.0)  # no kinds: every row kind 0, the caller's tensors untouched
    assert weak.tolist() == [1, 1] and strong.tolist() == [3, 3] and policy._kinds.tolist() == [0, 0]
    # without kinds every proposal is one kind: the weak drafts' misses make the same rows pessimistic
    plain = RowBudgetPolicy(lambda b, n, s: 1.0 + 0.01 * np.asarray(n, dtype=float))
    plain.begin(2)
    for _ in range(4):
        plain.choose_rows(active, context=10.0)
        plain.update_rows(torch.full((2,), 4), torch.zeros(2, dtype=torch.long), active, step_s=1.0, draft_s=0.0)
    assert plain.choose_rows(active, context=10.0).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"kinds \[1, 9\] must be 2 ints in \[0, 8\)"):
        policy.choose_rows(active, context=10.0, kinds=torch.tensor([1, 9]))


def test_narrowing_and_trimming_a_proposal_keep_its_kinds():
    from decodelab.speculation.spec_step import narrow, trim

    prop = DraftProposal(tokens=torch.tensor([[1, 2, 3], [4, 5, 6]]), lengths=torch.tensor([3, 1]),
                         kinds=torch.tensor([3, 1]))
    assert narrow(prop, torch.tensor([2, 1])).kinds.tolist() == [3, 1]
    shorter = dataclasses_replace(prop, lengths=torch.tensor([2, 1]))
    assert trim(shorter, torch.ones(2, dtype=torch.bool)).kinds.tolist() == [3, 1]


def test_a_model_drafters_cost_is_its_weights_over_the_targets(tiny):
    tr = tiny.transformer
    layer = sum(p.numel() * p.element_size() for p in tr.layers[0].parameters())
    head = sum(p.numel() * p.element_size() for p in tr.lm_head.parameters())
    skip = LayerSkipDrafter(tiny, [0, 2])
    assert skip.relative_cost(tr) == pytest.approx((2 * layer + head) / (tr.n_layers * layer + head))
    assert ModelDrafter(tiny, tiny).relative_cost(tr) == pytest.approx(1.0)
    assert SparseKVDrafter(tiny).relative_cost is None  # its point is the KV it skips, not the weights


def test_a_drafter_known_to_cost_a_whole_step_is_not_tried_where_verification_is_nearly_free():
    step_time = lambda b, n, s: 1.0 + 0.01 * np.asarray(n, dtype=float)  # noqa: E731
    active = torch.ones(1, dtype=torch.bool)
    free, costly = RowBudgetPolicy(step_time), RowBudgetPolicy(step_time)
    for policy in (free, costly):
        policy.begin(1)
    costly.set_draft_cost(0.95)  # a layer-skip drafter running 28 of 30 layers
    assert free.choose_rows(active, context=10.0).item() > 0  # the prior acceptance 0.5 pays for free drafts
    assert costly.choose_rows(active, context=10.0).item() == 0
    assert costly.draft_seconds(10.0) == pytest.approx(0.95 * 1.01)
    costly.update_rows(torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.long), active, step_s=1.02,
                       draft_s=0.1, context=10.0)
    assert costly.draft_seconds(10.0) == pytest.approx(0.1)  # the first timed draft replaces the prior
    with pytest.raises(ValueError, match="fraction"):
        costly.set_draft_cost(-1.0)


def test_a_spec_run_gives_the_policy_its_drafters_cost_before_the_first_step(tiny):
    prompts = _prompts()
    ref = engine.generate(tiny, prompts, max_new_tokens=12, eos_token_ids=[])
    policy = RowBudgetPolicy(lambda b, n, s: 1.0 + 0.01 * np.asarray(n, dtype=float))
    out = speculative.generate(tiny, prompts, LayerSkipDrafter(tiny, list(range(tiny.transformer.n_layers))),
                               k=policy, max_new_tokens=12, eos_token_ids=[])
    assert out.tokens == ref.tokens
    assert policy._draft_fraction == pytest.approx(1.0) and all(k == 0 for k in out.stats.step_k)


def test_sweep_rounds_per_batch_read_string_keys_and_name_a_key_that_is_not_a_batch():
    assert speculative_bench.rounds_by_batch({"1": 4, 4: 3}, [1, 4, 16], 2) == {1: 4, 4: 3, 16: 2}
    assert speculative_bench.rounds_by_batch({}, [1, 4], 2) == {1: 2, 4: 2}
    with pytest.raises(ValueError, match=r"keys \[7, 'x'\] are not in batch_sizes; allowed: \[1, 4\]"):
        speculative_bench.rounds_by_batch({7: 2, "x": 1, 1: 3}, [1, 4], 2)
    with pytest.raises(ValueError,
                       match=r"^k0_repeats_by_batch=\{4: 2\}: keys \[4\] are not in batch_sizes; allowed: \[1, 64\]"):
        speculative_bench.rounds_by_batch({4: 2}, [1, 64], 2, name="k0_repeats_by_batch")


class _CountingBound(RowBudgetPolicy):
    def begin(self, batch_size):
        super().begin(batch_size)
        self.bounds = 0

    def _could_pay(self, *args):
        self.bounds += 1
        return super()._could_pay(*args)


def _plain_streak(policy, steps, *, finish_at=None, seconds=lambda i: 0.02 + 0.001 * (i % 5)):
    """Drive a 2-row policy through plain steps (row 1 finishes at step finish_at) -> the k chosen per step."""
    policy.begin(2)
    chosen = []
    for i in range(steps):
        active = torch.tensor([True, finish_at is None or i < finish_at])
        chosen.append(policy.choose_rows(active, context=100.0 + i).tolist())
        policy.update_plain(step_s=seconds(i), context=100.0 + i)
    return chosen


def test_a_plain_decision_holds_for_hold_steps_and_learns_every_held_step_time():
    # drafting never pays here (step time grows with the cube of the width): every step is plain by the bound
    held, every = _CountingBound(_never_pays, hold_steps=4), _CountingBound(_never_pays, hold_steps=1)
    assert _plain_streak(held, 10) == _plain_streak(every, 10) == [[0, 0]] * 10
    assert every.bounds == 10 and held.bounds == 3  # steps 0, 4, 8 decided; the others kept the decision
    held._decide_afresh()  # the two steps held since the last decision are learned now
    assert held.time_ratio[0] == pytest.approx(every.time_ratio[0], rel=1e-12)


def test_a_finished_row_ends_the_hold_and_proposal_kinds_never_hold():
    policy = _CountingBound(_never_pays, hold_steps=4)
    _plain_streak(policy, 6, finish_at=2)
    assert policy.bounds == 2  # step 0 decided, step 1 held, step 2 (a row finished) decided, 3-5 held
    policy.begin(2)
    active, kinds = torch.ones(2, dtype=torch.bool), torch.tensor([1, 1])
    for _ in range(3):
        policy.choose_rows(active, context=10.0, kinds=kinds)
        policy.update_plain(step_s=0.02, context=10.0)
    assert policy.bounds == 3  # with proposal kinds every step decides
    with pytest.raises(ValueError, match="hold_steps"):
        RowBudgetPolicy(_never_pays, hold_steps=0)
