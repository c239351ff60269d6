"""The sampler-grid study: equal tuning budgets, paired generator streams, cross-fitted tuning and
quality read off Pareto frontiers at matched diversity."""
import numpy as np
import pytest

from decodelab.common.seeding import row_seed
from decodelab.sampling_study import grid, tables, verdicts, writing
from decodelab.workloads import tasks


def test_cross_fit_best_scores_each_fold_with_the_other_folds_choice():
    # setting 0 is best on every unit except unit 0: the choice never depends on the unit it scores
    matrix = np.array([[0.0, 1, 1, 1], [1.0, 0, 0, 0]])
    values, chosen = tables.cross_fit_best(matrix, seed=0)
    assert chosen == [0, 0]
    assert values.tolist() == [0.0, 1.0, 1.0, 1.0]


def test_matched_quality_diff_reads_both_frontiers_at_the_same_diversity():
    import pandas as pd

    rows = []
    for unit in range(6):
        # sampler a: quality = 1 - x; sampler b: quality = 0.8 - x (worse by 0.2 at every diversity)
        settings = [("a", 0.2, 1.0), ("a", 0.6, 1.0), ("b", 0.1, 0.8), ("b", 0.7, 0.8)]
        for setting, (name, x, offset) in enumerate(settings):
            rows.append(dict(setting=setting, sampler=name, unit=unit, x=x, q=offset - x))
    d = writing.matched_quality_diff(pd.DataFrame(rows), "a", "b", "x", "q", 0.4, n_boot=50)
    assert d["difference"] == pytest.approx(0.2)
    assert d["ci_low"] == pytest.approx(0.2) and d["ci_high"] == pytest.approx(0.2)


# --- the grid runner ---------------------------------------------------------------------------------


def test_sampler_grid_enforces_equal_tuning_budget():
    with pytest.raises(ValueError, match="same number of settings"):
        grid.sampler_grid({"top_p": [0.9, 0.95], "min_p": [0.1]}, [1.0])
    with pytest.raises(ValueError, match="unknown names"):
        grid.sampler_grid({"nucleus": [0.9]}, [1.0])
    cells = grid.sampler_grid({"top_p": [0.9, 0.95], "min_p": [0.05, 0.1]}, [1.0, 2.0])
    assert sum(s.sampler == "top_p" for s in cells) == sum(s.sampler == "min_p" for s in cells) == 4
    assert [s.sampler for s in cells].count("greedy") == 1 and [s.sampler for s in cells].count("temperature") == 2
    assert len(set(cells)) == len(cells)


def test_setting_configs_set_one_knob_and_temperature():
    s = grid.Setting("min_p", 0.1, 1.5)
    assert (s.config.min_p, s.config.temperature, s.config.top_p) == (0.1, 1.5, 1.0)
    assert grid.Setting("top_k", 20.0, 1.0).config.top_k == 20
    assert grid.Setting("greedy", None, 0.0).config.is_greedy


def test_run_grid_pairs_generator_streams_across_settings(tiny):
    """top_k = V keeps every token, so it samples exactly what plain temperature sampling does: with the
    same per-(unit, sample) generator streams the tokens must be identical row for row."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    settings = [grid.Setting("temperature", None, 1.0), grid.Setting("top_k", 256.0, 1.0),
                grid.Setting("min_p", 0.3, 1.0)]
    frame, _ = grid.run_grid(tiny, prompts, settings, n_samples=3, max_new_tokens=6, batch_size=5,
                             progress=False)
    plain = frame[frame.sampler == "temperature"].tokens.tolist()
    assert plain == frame[frame.sampler == "top_k"].tokens.tolist()
    assert len({tuple(t) for t in plain}) > 1  # and the samples do differ from each other


def test_run_grid_matches_engine_generate_row_for_row(tiny):
    import torch

    from decodelab.core.engine import generate
    from decodelab.core.sampling import Sampler

    prompts = [[5, 6, 7], [8, 9]]
    settings = [grid.Setting("top_p", 0.8, 1.3), grid.Setting("greedy", None, 0.0)]
    frame, _ = grid.run_grid(tiny, prompts, settings, n_samples=2, max_new_tokens=5, seed=3, progress=False)
    for row in frame.itertuples():
        gen = torch.Generator().manual_seed(row_seed(3, row.unit, row.sample))
        ref = generate(tiny, [prompts[row.unit]], max_new_tokens=5, sampler=Sampler([settings[row.setting].config]),
                       generator=[gen])
        assert row.tokens == ref.tokens[0]
    assert (frame.sampler == "greedy").sum() == 2  # one sample per unit: more would be copies


def test_order_grid_pairs_each_setting_in_both_orders():
    cells = grid.order_grid({"top_p": 0.9, "min_p": 0.1}, [1.5, 3.0])
    assert len(cells) == 8
    assert {s.order_name for s in cells} == {"hf", "truncate_first"}
    truncate_first = grid.Setting("min_p", 0.1, 2.0, grid.TRUNCATE_FIRST)
    assert truncate_first.label == "min_p=0.1,T=2,truncate_first"


@pytest.mark.slow
def test_embedded_model_ends_with_the_answer_format(smol):
    """The one-shot prompt keeps SmolLM2-135M-Instruct on "The answer is N." (greedy, easy problems)."""
    problems = tasks.make_arithmetic(4, seed=0, difficulty=1)
    prompts = [tasks.arithmetic_prompt(p, smol.tokenizer) for p in problems]
    frame, _ = grid.run_grid(smol, prompts, [grid.Setting("greedy", None, 0.0)], max_new_tokens=40,
                             progress=False)
    frame = grid.score_arithmetic(frame, problems, smol.tokenizer)
    assert sum("The answer is" in t for t in frame.text) >= 3, list(frame.text)
    assert frame.pred.notna().all()



# --- verdicts: intervals, minimum detectable differences, generated text ---------------------------------


def _binary_pair(n=60, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.random(n) < 0.3).astype(float), (rng.random(n) < 0.25).astype(float)


def test_claim_row_carries_an_interval_around_its_estimate_and_its_mdd():
    from decodelab.common import stats

    a, b = _binary_pair()
    row = verdicts.claim("a beats b", a, b, n_boot=200, target_half_width=0.1)
    assert row["lo"] <= row["estimate"] <= row["hi"]
    assert row["estimate"] == pytest.approx((a - b).mean())
    assert row["half_width"] == pytest.approx((row["hi"] - row["lo"]) / 2)
    sd = np.std(a - b, ddof=1)
    assert row["mdd"] == pytest.approx(stats.minimum_detectable_difference(sd, len(a)))
    assert row["required_units"] == stats.required_pairs(sd, 0.1)
    assert row["finding"] == ("a > b" if row["lo"] > 0 else "a < b" if row["hi"] < 0 else "inconclusive")


def test_claim_pairs_series_on_the_units_both_ran():
    import pandas as pd

    a = pd.Series(np.arange(10.0), index=range(10))
    b = pd.Series(np.zeros(5), index=range(5))  # ran on the first 5 units only
    row = verdicts.claim("a beats b", a, b, n_boot=50)
    assert row["n_units"] == 5 and row["estimate"] == pytest.approx(2.0)  # mean of 0..4


def test_inconclusive_verdict_text_names_half_width_and_mdd():
    a, b = _binary_pair(n=20)
    row = verdicts.claim("min-p beats top-p", a, b, n_boot=200)
    assert row["finding"] == "inconclusive"
    text = verdicts.verdict_text(row)
    assert "inconclusive" in text and f"minimum detectable difference {row['mdd'] * 100:.1f} points" in text
    held = verdicts.claim("ones beat zeros", np.ones(20), np.zeros(20), n_boot=50)
    assert verdicts.verdict_text(held).endswith(": holds.") and "detectable" not in verdicts.verdict_text(held)


def test_verdict_summary_counts_the_main_rows_only():
    rows = [verdicts.claim("holds", np.ones(10), np.zeros(10), main=True, n_boot=50),
            verdicts.claim("reversed", np.zeros(10), np.ones(10), main=True, n_boot=50),
            verdicts.claim("secondary", np.ones(10), np.zeros(10), n_boot=50)]
    text = verdicts.verdict_summary(rows, target_half_width=0.1)
    assert text.startswith("Of 2 main verdicts, 1 hold, 1 are reversed and 0 are inconclusive")
    # the bootstrap intervals are points, but 10 units with no spread resolve only z * sqrt(1/10) / sqrt(10)
    assert "widest 95% CI half-width 19.6 points (target <= 10.0 points: not met)" in text


def test_a_sample_without_disagreement_does_not_claim_a_zero_mdd():
    from decodelab.common import stats

    row = verdicts.claim("all zero", np.zeros(3), np.zeros(3), n_boot=50, target_half_width=0.1)
    assert row["half_width"] == 0.0 and row["finding"] == "inconclusive"
    assert row["mdd"] == pytest.approx(stats.minimum_detectable_difference(np.sqrt(1 / 3), 3))
    assert verdicts.effective_half_width(row) == pytest.approx(stats.z_value() / 3)
    assert row["required_units"] == stats.required_pairs(np.sqrt(1 / 3), 0.1)


def test_claim_from_diff_takes_its_mdd_from_the_interval():
    from decodelab.common import stats

    row = verdicts.claim_from_diff("x", {"difference": 0.01, "ci_low": -0.05, "ci_high": 0.07}, n_units=6,
                                         target_half_width=0.03)
    assert row["finding"] == "inconclusive" and row["lo"] <= row["estimate"] <= row["hi"]
    assert row["mdd"] == pytest.approx(stats.mdd_from_interval(-0.05, 0.07))
    assert row["required_units"] == 24  # 6 units * (0.06 / 0.03)^2


def test_units_per_setting_runs_main_settings_on_every_unit():
    cells = grid.sampler_grid({"top_p": [0.9], "min_p": [0.1]}, [1.0, 2.0])
    cells += grid.order_grid({"min_p": 0.1}, [2.0])[1:]  # the truncate-first copy
    counts = dict(zip(cells, grid.units_per_setting(cells, [2.0], 10, 4)))
    assert {s.label: n for s, n in counts.items() if n == 10} == {
        "top_p=0.9,T=2": 10, "min_p=0.1,T=2": 10, "greedy": 10}
    with pytest.raises(ValueError, match="main_temperatures"):
        grid.units_per_setting(cells, [1.5], 10, 4)


def test_run_grid_runs_each_setting_on_its_leading_units(tiny):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    settings = [grid.Setting("min_p", 0.2, 1.0), grid.Setting("greedy", None, 0.0)]
    frame, _ = grid.run_grid(tiny, prompts, settings, n_samples=2, max_new_tokens=4, n_units=[1, 3],
                             progress=False)
    assert sorted(frame[frame.sampler == "min_p"].unit) == [0, 0]
    assert sorted(frame[frame.sampler == "greedy"].unit) == [0, 1, 2]
    with pytest.raises(ValueError, match="n_units"):
        grid.run_grid(tiny, prompts, settings, n_units=[4, 1], progress=False)


def test_check_settings_reproduce_their_references_row_for_row(tiny):
    """top_p=1 is plain temperature sampling on the same uniforms; min_p=1 keeps only the argmax."""
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    pairs = grid.check_settings([1.0, 2.5])
    settings = [s for pair in pairs for s in pair]
    frame, _ = grid.run_grid(tiny, prompts, settings, n_samples=3, max_new_tokens=6, batch_size=5,
                             progress=False)
    for check, reference in pairs:
        result = grid.identical_rows(frame, check, reference)
        assert result["fraction_identical"] == 1.0 and result["n_rows"] == 6
    # and the comparison can fail: min_p=1 is not plain temperature sampling
    other = grid.identical_rows(frame, pairs[1][0], pairs[0][1])
    assert other["fraction_identical"] < 1.0


def test_tuned_per_unit_pairs_on_units_and_rejects_uneven_grids():
    import pandas as pd

    rows = [dict(setting=s, sampler="min_p", param=p, temperature=1.0, order="hf", unit=u, sample=0,
                 correct=float(u % 2))
            for s, p in enumerate((0.05, 0.1)) for u in range(4)]
    tuned = tables.tuned_per_unit(pd.DataFrame(rows), "correct")
    values, chosen = tuned[("min_p", 1.0, "hf")]
    assert list(values.index) == [0, 1, 2, 3] and len(chosen) == 2
    uneven = pd.DataFrame(rows[:-1])  # setting 1 lacks unit 3
    with pytest.raises(ValueError, match="different units"):
        tables.tuned_per_unit(uneven, "correct")


def test_setting_key_is_how_verdicts_find_settings():
    s = grid.Setting("min_p", 0.1, 2.0, grid.TRUNCATE_FIRST)
    assert s.key == grid.setting_key("min_p", 0.1, 2, "truncate_first")
    assert grid.Setting("greedy", None, 0.0).key == ("greedy", None, 0.0, "hf")
