"""Votes and stopping rules on constructed answer lists; the vectorized subset vote equals the plain vote."""
import numpy as np
import pytest

from decodelab.consistency.votes import (
    adaptive_stop,
    beta_confidence,
    early_stop_table,
    encode_answers,
    esc_stop,
    majority_vote,
    sequence_weights,
    subset_votes,
    vote_accuracy_vs_n,
    weighted_vote,
)


def test_majority_vote_picks_the_most_common_answer():
    vote = majority_vote([3, 5, 5, 7, 5, 3])
    assert vote.answer == 5 and vote.scores == {3: 2.0, 5: 3.0, 7: 1.0} and vote.n_samples == 6


def test_majority_vote_tie_goes_to_the_first_answer_seen():
    assert majority_vote([4, 9, 9, 4]).answer == 4
    assert majority_vote([9, 4, 4, 9]).answer == 9


def test_no_answers_are_counted_never_voted():
    vote = majority_vote([None, None, None, 8])
    assert vote.answer == 8 and vote.n_no_answer == 3 and vote.scores == {8: 1.0}


def test_all_no_answer_gives_an_explicit_no_answer():
    vote = majority_vote([None, None])
    assert vote.answer is None and vote.n_no_answer == 2 and vote.support == 0.0


@pytest.mark.parametrize("vote", [lambda a: majority_vote(a), lambda a: weighted_vote(a, []),
                                  lambda a: esc_stop(a), lambda a: adaptive_stop(a)])
def test_empty_sample_list_is_a_clear_error(vote):
    with pytest.raises(ValueError, match="n >= 1"):
        vote([])


def test_weighted_vote_can_overturn_the_majority():
    # Two unlikely samples say 1, one confident sample says 2.
    answers, logprobs, lengths = [1, 1, 2], [-20.0, -20.0, -1.0], [10, 10, 10]
    assert majority_vote(answers).answer == 1
    vote = weighted_vote(answers, logprobs, lengths)
    assert vote.answer == 2
    assert vote.scores[2] == pytest.approx(np.exp(-0.1)) and vote.scores[1] == pytest.approx(2 * np.exp(-2.0))


def test_sequence_weights_normalize_by_length():
    assert sequence_weights([-4.0, -4.0], [2, 4]) == pytest.approx([np.exp(-2.0), np.exp(-1.0)])


def test_weights_must_match_answers():
    with pytest.raises(ValueError, match="one per answer"):
        majority_vote([1, 2], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        majority_vote([1, 2], [1.0, float("nan")])


def test_esc_stops_after_the_first_unanimous_window():
    answers = [1, 2, 3, 3, 3, 3, 3, 3, 9, 9]
    result = esc_stop(answers, window=4)
    assert result.n_used == 8 and result.stopped_early and result.vote.answer == 3


def test_esc_never_stops_on_a_window_of_no_answers():
    result = esc_stop([None] * 4 + [5] * 4, window=4)
    assert result.n_used == 8 and not result.stopped_early and result.vote.answer == 5


def test_esc_runs_the_pool_when_no_window_agrees():
    result = esc_stop([1, 2, 1, 2, 1, 2], window=2)
    assert result.n_used == 6 and not result.stopped_early and result.vote.answer == 1


def test_beta_confidence_closed_forms():
    # Beta(k + 1, 1): P(p > 1/2) = 1 - 2^-(k+1); equal counts: exactly 1/2.
    assert beta_confidence(4, 0) == pytest.approx(1 - 0.5 ** 5)
    assert beta_confidence(3, 3) == pytest.approx(0.5)


def test_adaptive_stops_when_unanimity_is_settled():
    # 1 - 2^-(k+1) >= 0.95 first at k = 4 agreeing samples.
    result = adaptive_stop([7] * 10, threshold=0.95)
    assert result.n_used == 4 and result.vote.answer == 7


def test_adaptive_needs_more_samples_under_disagreement():
    result = adaptive_stop([1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1], threshold=0.95)
    assert result.n_used > 4 and result.vote.answer == 1
    counts_at_stop = [1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1][: result.n_used]
    assert beta_confidence(counts_at_stop.count(1), counts_at_stop.count(2)) >= 0.95


def test_adaptive_ignores_no_answers():
    assert adaptive_stop([None, None, 3, 3, 3, 3, 3], threshold=0.95).n_used == 6


def test_adaptive_dirichlet_stops_and_checks_its_arguments():
    assert adaptive_stop([5] * 30, criterion="dirichlet", seed=0).vote.answer == 5
    with pytest.raises(ValueError, match="criterion"):
        adaptive_stop([1], criterion="gamma")
    with pytest.raises(ValueError, match="threshold"):
        adaptive_stop([1], threshold=1.0)


@pytest.mark.parametrize("seed", range(5))
def test_subset_votes_equal_majority_vote(seed):
    rng = np.random.default_rng(seed)
    pool = [None if x == 0 else int(x) for x in rng.integers(0, 5, size=20)]
    weights = rng.random(20)
    codes, values = encode_answers(pool)
    subsets = np.argsort(rng.random((50, 20)), axis=1)[:, :7]
    for w in (None, weights):
        winners = subset_votes(codes, subsets, len(values), w)
        for subset, winner in zip(subsets, winners):
            want = majority_vote([pool[j] for j in subset], None if w is None else [w[j] for j in subset]).answer
            assert (values[winner] if winner >= 0 else None) == want


def test_accuracy_vs_n_on_a_pool_with_a_clear_majority():
    # 10 problems, pool of 9: 6 right, 3 wrong (spread). n = 9 majority is always right; n = 1 is right 2/3.
    pools = [[42] * 6 + [1, 2, 3] for _ in range(10)]
    rows = vote_accuracy_vs_n(pools, [42] * 10, [1, 9], n_subsets=300, seed=0, lengths=[[10] * 9] * 10)
    assert rows[1]["accuracy"] == 1.0 and abs(rows[0]["accuracy"] - 2 / 3) < 0.05
    assert rows[0]["tokens"] == 10 and rows[1]["tokens"] == 90
    with pytest.raises(ValueError, match="n_values"):
        vote_accuracy_vs_n(pools, [42] * 10, [10])


def test_early_stop_saves_samples_on_unanimous_pools():
    pools = [[5] * 16 for _ in range(4)]
    rows = {r["method"] + ":" + r["setting"]: r for r in early_stop_table(pools, [5] * 4, esc_windows=(4,))}
    assert rows["majority:n=16"]["mean_samples"] == 16
    assert rows["esc:window=4"]["mean_samples"] == 4 and rows["esc:window=4"]["accuracy"] == 1.0
    assert rows["adaptive_consistency:beta>=0.95"]["mean_samples"] == 4
    assert rows["adaptive_consistency:beta>=0.95"]["saved"] == 0.75
    assert rows["esc:window=4"]["accuracy_change"] == 0.0


# ---------------------------------------------------------------- drivers on a tiny model


def test_cost_methods_give_n_samples_of_exact_length(tiny):
    from decodelab.consistency.cost import cost_sweep, goal_summary

    rows = cost_sweep(tiny, [24], [1, 3], new_tokens=5, progress=False, repeats=2)
    assert {(r["method"], r["n"]) for r in rows} == {(m, n) for m in
                                                    ("shared", "unshared", "hf_num_return_sequences") for n in (1, 3)}
    by = {(r["method"], r["n"]): r for r in rows}
    assert by[("shared", 3)]["kv_bytes_analytic"] * 3 < by[("unshared", 3)]["kv_bytes_analytic"] * 2  # 39 vs 87
    assert by[("unshared", 3)]["kv_bytes_analytic"] == by[("hf_num_return_sequences", 3)]["kv_bytes_analytic"]
    assert all(r["repeats"] == 2 and r["seconds"] <= r["seconds_median"] <= r["seconds_max"] for r in rows)
    goal = goal_summary(rows, prompt_len=1000, n=16)
    assert goal["n"] == 3 and goal["kv_ratio_vs_hf_analytic"] == pytest.approx(39 / 87)
    # Measured: HF's DynamicCache holds 3 x (24 + 5 - 1) positions (the last token is never forwarded).
    assert goal["kv_ratio_vs_hf_measured"] == pytest.approx(39 / 84)
    assert goal["speedup_vs_hf"] == pytest.approx(by[("hf_num_return_sequences", 3)]["seconds"]
                                                  / by[("shared", 3)]["seconds"])


def test_measured_cache_bytes_are_the_caches_tensors(tiny):
    import torch

    from decodelab.consistency.cost import hf_sampling_kwargs, long_prompt, run_method
    from decodelab.core.shared_prefix import kv_bytes_per_token

    prompt, n, new, per_token = long_prompt(None, 20), 3, 6, kv_bytes_per_token(tiny)
    assert run_method(tiny, "shared", prompt, n, new_tokens=new).cache_bytes == (20 + n * new) * per_token
    assert run_method(tiny, "unshared", prompt, n, new_tokens=new).cache_bytes == n * (20 + new) * per_token
    hf = run_method(tiny, "hf_num_return_sequences", prompt, n, new_tokens=new)
    # Independently: transformers' own cache after the same generate, summed tensor by tensor.
    ids = torch.tensor([prompt])
    out = tiny.hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_return_sequences=n,
                                 max_new_tokens=new, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                                 **hf_sampling_kwargs(None))
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    layers = cache.layers
    assert hf.cache_bytes == sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    assert hf.cache_bytes == n * (20 + new - 1) * per_token


def test_greedy_methods_agree_token_for_token(tiny):
    from decodelab.consistency.cost import long_prompt, run_method

    prompt = long_prompt(None, 30)
    outs = {m: run_method(tiny, m, prompt, 2, new_tokens=6).tokens
            for m in ("shared", "unshared", "hf_num_return_sequences")}
    assert outs["shared"] == outs["unshared"] == outs["hf_num_return_sequences"]


def test_hf_baseline_does_not_stop_at_an_early_eos_in_generation_config():
    # The model's generation_config names as EOS the token greedy decoding emits 3rd: HF must neither stop
    # there nor mask it out (min_new_tokens would), so its tokens equal ours, EOS included, all new_tokens long.
    from decodelab.consistency.cost import long_prompt, run_method
    from decodelab.core.models import tiny_model

    model = tiny_model(seed=0)
    prompt = long_prompt(None, 30)
    ours = run_method(model, "shared", prompt, 2, new_tokens=8).tokens
    model.hf_model.generation_config.eos_token_id = ours[0][2]
    hf = run_method(model, "hf_num_return_sequences", prompt, 2, new_tokens=8).tokens
    assert hf == ours and all(len(t) == 8 for t in hf)


def test_hf_processed_scores_equal_our_sampler_probs(tiny):
    # Same sampler on both sides: transformers' processed scores (its warpers from hf_sampling_kwargs)
    # give, step by step, the distribution our Sampler makes from the same raw logits.
    import torch

    from decodelab.consistency.cost import hf_sampling_kwargs, long_prompt
    from decodelab.consistency.experiment import make_sampler

    for settings in ({"top_k": 5}, {"top_k": 40, "top_p": 0.9}, {"min_p": 0.1}):
        sampler = make_sampler(0.7, settings)
        ids = torch.tensor([long_prompt(None, 16)])
        torch.manual_seed(0)
        out = tiny.hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_return_sequences=2,
                                     max_new_tokens=4, eos_token_id=None, pad_token_id=0,
                                     return_dict_in_generate=True, output_scores=True, output_logits=True,
                                     **hf_sampling_kwargs(sampler))
        for raw, processed in zip(out["logits"], out["scores"]):
            torch.testing.assert_close(sampler.probs(raw.float()), torch.softmax(processed.float(), dim=-1),
                                       rtol=1e-5, atol=1e-6)


def test_hf_sampling_kwargs_refuse_what_transformers_cannot_match():
    from decodelab.consistency.cost import hf_sampling_kwargs
    from decodelab.core.sampling import Sampler, SamplerConfig

    assert hf_sampling_kwargs(None)["top_k"] == 1 and hf_sampling_kwargs(None)["repetition_penalty"] == 1.0
    with pytest.raises(ValueError, match="per-row"):
        hf_sampling_kwargs(Sampler([SamplerConfig(top_k=3), SamplerConfig(top_k=5)]))
    with pytest.raises(ValueError, match="order"):
        hf_sampling_kwargs(Sampler(SamplerConfig(top_k=3, min_p=0.1), order="vllm"))


class _NoModel:
    device = "cpu"


class _FakePeak:
    """Stands in for PeakMemory: the n-th block entered reads n bytes."""
    entered = 0

    def __init__(self, device):
        pass

    def __enter__(self):
        _FakePeak.entered += 1
        self.peak_bytes, self.how = 6 + _FakePeak.entered, "fake"
        return self

    def __exit__(self, *exc):
        return False


def test_sweep_points_are_the_two_plotted_curves():
    from decodelab.consistency.cost import sweep_points

    assert sweep_points([256, 1024], [1, 4, 16]) == [(256, 16), (1024, 1), (1024, 4), (1024, 16)]
    assert len(sweep_points([256, 1024], [1, 4, 16], full_grid=True)) == 6
    assert sweep_points([48], [2]) == [(48, 2)]


def test_timed_repeats_interleave_the_methods(monkeypatch):
    from decodelab.consistency import cost as cc

    calls = []
    monkeypatch.setattr(cc, "time_method", lambda model, m, *a, **k: (calls.append(m) or 1.0 + len(calls),
                                                                      cc.MethodOutput([[0]], 8)))
    monkeypatch.setattr(cc, "PeakMemory", _FakePeak)
    _FakePeak.entered = 0
    monkeypatch.setattr("decodelab.core.shared_prefix.kv_bytes_per_token", lambda model: 1)
    rows = cc.measure_point(_NoModel(), ["a", "b", "c"], [1, 2], 1, new_tokens=1, repeats=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each method goes first once
    # Peak memory is read on the last round's timed calls: no extra call, one reading per method.
    assert {r["method"]: r["peak_bytes"] for r in rows} == {"c": 7, "a": 8, "b": 9}
    by = {r["method"]: r for r in rows}
    assert (by["a"]["seconds"], by["a"]["seconds_median"], by["a"]["seconds_max"]) == (2.0, 7.0, 9.0)  # calls 1, 6, 8
    assert by["a"]["seconds_spread"] == 3.5


def test_baselines_skipped_beyond_the_token_budget(tiny):
    from decodelab.consistency.cost import cost_sweep

    rows = cost_sweep(tiny, [20], [1, 4], new_tokens=2, baseline_max_tokens=40, progress=False)
    assert sorted((r["method"], r["n"]) for r in rows) == [
        ("hf_num_return_sequences", 1), ("shared", 1), ("shared", 4), ("unshared", 1)]


def test_unshared_baseline_has_its_own_tighter_budget(tiny):
    from decodelab.consistency.cost import cost_sweep

    rows = cost_sweep(tiny, [20], [1, 4], new_tokens=2, baseline_max_tokens=80, unshared_max_tokens=40,
                      progress=False, repeats=1)
    assert sorted((r["method"], r["n"]) for r in rows) == [
        ("hf_num_return_sequences", 1), ("hf_num_return_sequences", 4), ("shared", 1), ("shared", 4),
        ("unshared", 1)]


def test_check_shared_equals_unshared_on_tiny(tiny):
    from decodelab.consistency.cost import long_prompt
    from decodelab.consistency.experiment import check_shared_equals_unshared

    check = check_shared_equals_unshared(tiny, [long_prompt(None, 9, seed=1), long_prompt(None, 14, seed=2)], 3,
                                         max_new_tokens=6)
    assert check["equal"] and check["rows"] == 6


# ---------------------------------------------------------------- vote counts, goals, generated findings


def test_pool_vote_counts_add_up():
    from decodelab.consistency.votes import pool_votes

    rows = pool_votes([[1, None, 1, 2], [None, None, None, None], [3, 3, 3, 3]])
    assert [r["answer"] for r in rows] == [1, None, 3]
    assert all(r["answered"] + r["no_answer"] == r["n_samples"] == 4 for r in rows)
    assert [r["no_answer"] for r in rows] == [1, 4, 0]


def test_accuracy_change_interval_is_paired_against_the_full_pool():
    pools = [[5] * 8, [1, 2] * 4, [7] * 6 + [1, 2]]
    rows = early_stop_table(pools, [5, 1, 7], esc_windows=(2,))
    assert rows[0]["accuracy_change"] == rows[0]["change_ci_low"] == rows[0]["change_ci_high"] == 0.0
    for row in rows[1:]:
        assert row["change_ci_low"] <= row["accuracy_change"] <= row["change_ci_high"]


def _goal_point(**overrides):
    point = {"prompt_len": 1000, "n": 16, "repeats": 3, "speedup_vs_hf": 5.0, "shared_seconds": 1.0,
             "hf_seconds": 5.0, "shared_spread": 0.1, "hf_spread": 0.2, "kv_ratio_vs_hf_measured": 0.1,
             "kv_ratio_vs_hf_analytic": 0.09, "shared_cache_bytes": 2**20, "hf_cache_bytes": 10 * 2**20,
             "peak_ratio_vs_hf": 0.2}
    return {**point, **overrides}


def test_notebook_goals_judge_each_value_against_its_target():
    from decodelab.consistency.experiment import notebook_goals

    early = [{"method": "majority", "setting": "n=16"},
             {"method": "adaptive_consistency", "setting": "beta>=0.95", "saved": 0.6, "accuracy_change": 0.0,
              "change_ci_low": -0.05, "change_ci_high": 0.04}]
    goals = {g.name: g for g in notebook_goals(_goal_point(), early)}
    assert goals["speedup_vs_hf"].met is True and goals["kv_ratio_vs_hf_measured"].met is True
    assert goals["adaptive_samples_saved"].met is True
    assert goals["adaptive_accuracy_change"].met is False and goals["adaptive_accuracy_change"].ci == (-0.05, 0.04)
    slow = {g.name: g for g in notebook_goals(_goal_point(speedup_vs_hf=3.9, kv_ratio_vs_hf_measured=0.2), early)}
    assert slow["speedup_vs_hf"].met is False and slow["kv_ratio_vs_hf_measured"].met is False
    missing = notebook_goals({}, [])
    assert [g.status for g in missing] == ["not measured"] * 4


def test_findings_follow_the_numbers():
    from decodelab.consistency.experiment import findings

    kwargs = dict(greedy_accuracy=0.3, early_rows=[], cost_rows=[
        {"method": "shared", "prompt_len": 1000, "n": 16, "seconds": 1.0},
        {"method": "hf_num_return_sequences", "prompt_len": 1000, "n": 16, "seconds": 5.0}],
        accuracy_rows=[{"n": 1, "vote": "majority", "accuracy": 0.2, "ci_low": 0.1, "ci_high": 0.3},
                       {"n": 16, "vote": "majority", "accuracy": 0.5, "ci_low": 0.4, "ci_high": 0.6}])
    good = findings(check={"rows": 4, "greedy_equal": True, "sampled_equal": True}, goal_point=_goal_point(),
                    **kwargs)
    bad = findings(check={"rows": 4, "greedy_equal": True, "sampled_equal": False}, goal_point={}, **kwargs)
    assert "sampled equal" in good[0] and "sampled NOT equal" in bad[0]
    assert "5x" in good[-2] and "n = 16: 5x" in good[-2]
    assert "no speedup was measured" in bad[-1]
    assert "50%" in good[1] and "+20.0 points vs greedy" in good[1]
