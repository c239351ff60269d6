"""Notebook 02's plan, claims and goals as library functions: the row seeds of the paired design, which
settings run on how many problems, the claims looked up by structured keys, the goal rows."""
import hashlib

import numpy as np
import pytest
import torch

from decodelab.common.seeding import row_generator, row_seed
from decodelab.sampling_study import experiment, grid, tables, verdicts


def test_row_seed_reproduces_the_sampling_notebooks_old_seeds():
    """The default stream "row" is the formula notebook 02 (and 05) seeded rows with before the move."""
    for seed, unit, sample in [(0, 0, 0), (0, 3, 1), (7, 12, 5), (123456, 0, 99)]:
        digest = hashlib.sha256(f"decodelab-row-{seed}-{unit}-{sample}".encode()).digest()
        old = int.from_bytes(digest[:8], "big") >> 1
        assert row_seed(seed, unit, sample) == old
        assert torch.equal(torch.rand(4, generator=row_generator(seed, unit, sample)),
                           torch.rand(4, generator=torch.Generator().manual_seed(old)))
    assert row_seed(0, 1, 0, stream="other") != row_seed(0, 1, 0)


def test_accuracy_plan_appends_order_and_check_settings_after_the_sweep():
    sweep = grid.sampler_grid({"top_p": [0.9], "min_p": [0.1]}, [1.0, 2.0])
    plan = experiment.accuracy_plan(sweep, order_settings={"min_p": 0.1}, order_temperatures=[2.0],
                                    temperatures=[1.0, 2.0], main_temperatures=[2.0], n_problems=5,
                                    n_secondary_problems=3, check_problems=2)
    assert plan.study[:len(sweep)] == sweep
    assert plan.study[len(sweep):] == [grid.Setting("min_p", 0.1, 2.0, grid.TRUNCATE_FIRST)]  # hf copy is in sweep
    assert plan.settings[:len(plan.study)] == plan.study
    assert [c for c, _ in plan.checks] == plan.settings[len(plan.study):]  # neither check is in the study
    assert len(plan.n_units) == len(plan.settings)
    counts = dict(zip(plan.settings, plan.n_units))
    assert counts[grid.Setting("min_p", 0.1, 2.0)] == counts[grid.Setting("greedy", None, 0.0)] == 5
    assert counts[grid.Setting("min_p", 0.1, 1.0)] == counts[plan.study[-1]] == 3
    assert plan.n_units[len(plan.study):] == [2, 2]


def test_bench_samplers_mix_the_sweep_and_time_each_sampler_alone():
    sweep = grid.sampler_grid({"top_p": [0.9, 0.95], "min_p": [0.05, 0.1]}, [1.0])
    bench = experiment.bench_samplers(sweep, {"top_p": [0.9, 0.95], "min_p": [0.05, 0.1]}, batch_size=8)
    assert list(bench) == [experiment.MIXED_GRID, "top_p", "min_p"]
    assert bench[experiment.MIXED_GRID].configs == [sweep[i % len(sweep)].config for i in range(8)]
    assert bench["top_p"].configs[0].top_p == 0.95 and bench["min_p"].configs[0].min_p == 0.1


def _frame(seed=0, n_units=8):
    """A run_grid-like frame of 0/1 `correct` values: two values per sampler at T = 1 and 2, plain temperature
    sampling, greedy, and min_p = 0.1 at T = 2 truncating first."""
    import pandas as pd

    settings = grid.sampler_grid({"top_p": [0.9, 0.95], "min_p": [0.05, 0.1]}, [1.0, 2.0])
    settings += grid.order_grid({"min_p": 0.1}, [2.0])[1:]
    rng = np.random.default_rng(seed)
    rows = [dict(setting=s, sampler=st.sampler, param=st.param, temperature=st.temperature, order=st.order_name,
                 label=st.label, unit=u, sample=0, correct=float(rng.random() < 0.5))
            for s, st in enumerate(settings) for u in range(n_units)]
    return pd.DataFrame(rows)


def test_accuracy_claims_find_each_setting_by_its_structured_key():
    frame = _frame()
    tuned, untuned = tables.tuned_per_unit(frame, "correct"), tables.per_unit_values(frame, "correct")
    rows = verdicts.accuracy_claims(tuned, untuned, temperatures=[1.0, 2.0], main_temperatures=[2.0],
                                    order_settings={"min_p": 0.1}, order_temperatures=[2.0], n_boot=50)
    assert [r["key"]["kind"] for r in rows] == ["tuned", "tuned", "paper_settings", "greedy", "greedy", "order"]
    assert [r["main"] for r in rows] == [False, True, True, False, False, False]
    paper = rows[2]
    assert paper["claim"] == "untuned min_p=0.1 beats top_p=0.9 at T=2 (the min-p paper's settings)"
    assert paper["key"] == {"kind": "paper_settings", "a": "min_p=0.1", "b": "top_p=0.9", "temperature": 2.0}
    by = {(r.sampler, r.param, r.temperature, r.order): r for r in frame.drop_duplicates("setting").itertuples()}
    a = frame[frame.setting == by[("min_p", 0.1, 2.0, "hf")].setting].correct.to_numpy()
    b = frame[frame.setting == by[("top_p", 0.9, 2.0, "hf")].setting].correct.to_numpy()
    assert paper["estimate"] == pytest.approx((a - b).mean())
    order = rows[-1]
    first = frame[frame.setting == by[("min_p", 0.1, 2.0, "truncate_first")].setting].correct.to_numpy()
    assert order["estimate"] == pytest.approx((first - a).mean())
    assert order["key"] == {"kind": "order", "a": "truncate_first", "b": "hf", "sampler": "min_p", "param": 0.1,
                            "temperature": 2.0}


def test_paper_claims_are_left_out_when_the_grid_lacks_the_papers_settings():
    frame = _frame()
    frame = frame[~((frame.sampler == "top_p") & (frame.param == 0.9))]
    tuned, untuned = tables.tuned_per_unit(frame, "correct"), tables.per_unit_values(frame, "correct")
    rows = verdicts.accuracy_claims(tuned, untuned, temperatures=[1.0, 2.0], main_temperatures=[2.0],
                                    order_settings={}, order_temperatures=[2.0], n_boot=50)
    assert "paper_settings" not in [r["key"]["kind"] for r in rows]


def test_writing_claims_say_min_p_is_better_with_lower_nll_and_higher_coherence():
    import pandas as pd

    rows = []
    for unit in range(6):
        # min_p: coherence 1 - x and NLL 2 + x; top_p: coherence 0.8 - x and NLL 2.3 + x (worse by 0.2 / 0.3)
        settings = [("min_p", 0.2, 0.0), ("min_p", 0.6, 0.0), ("top_p", 0.1, 1.0), ("top_p", 0.7, 1.0)]
        for setting, (name, x, worse) in enumerate(settings):
            rows.append(dict(setting=setting, sampler=name, param=x, temperature=1.0, order="hf", label=name,
                             unit=unit, embedding_diversity=x, coherence=1 - x - 0.2 * worse,
                             judge_nll=2 + x + 0.3 * worse))
    per_prompt = pd.DataFrame(rows)
    from decodelab.sampling_study import writing

    points = writing.setting_points(per_prompt, "embedding_diversity", "judge_nll").merge(
        writing.setting_points(per_prompt, "embedding_diversity", "coherence"))
    pareto = {q: writing.frontiers(points, "embedding_diversity", q, maximize_y=(q != "judge_nll"))
              for q in ("judge_nll", "coherence")}
    claims = verdicts.writing_claims(per_prompt, pareto, ["judge_nll", "coherence"], n_units=6, n_boot=50)
    assert [c["key"]["quality"] for c in claims] == ["judge_nll", "coherence"]
    assert claims[0]["estimate"] == pytest.approx(0.3) and claims[1]["estimate"] == pytest.approx(0.2)
    assert claims[0]["claim"] == "min-p has lower judge NLL than top-p at matched embedding diversity 0.400"
    assert all(c["finding"] == "a > b" for c in claims)


def test_notebook_goals_judge_the_widest_main_half_width_and_the_greedy_band():
    claims = [{"main": True, "half_width": 0.04, "normal_half_width": 0.08, "required_units": 40},
              {"main": True, "half_width": 0.06, "normal_half_width": None, "required_units": 90},
              {"main": False, "half_width": 0.5, "normal_half_width": 0.5, "required_units": 900}]
    common = dict(half_width_target=0.1, n_problems=64, main_temperatures=[2.0], difficulty=2,
                  greedy_ci=(0.3, 0.5), greedy_band=[0.3, 0.7], sampler_cost_budget=0.05, bench_repeats=3)
    goals = {g.name: g for g in experiment.notebook_goals(claims, greedy_accuracy=0.4, sampler_cost_ratio=0.01,
                                                          **common)}
    assert goals["main_verdict_half_width"].value == 0.08 and goals["main_verdict_half_width"].met is True
    assert "up to 90 problems" in goals["main_verdict_half_width"].note
    assert goals["greedy_accuracy_floor"].met and goals["greedy_accuracy_ceiling"].met
    assert goals["greedy_accuracy_floor"].ci == (0.3, 0.5)
    assert goals["sampler_cost_ratio"].met is True
    low = {g.name: g for g in experiment.notebook_goals([], greedy_accuracy=0.1, sampler_cost_ratio=None, **common)}
    assert low["main_verdict_half_width"].status == low["sampler_cost_ratio"].status == "not measured"
    assert low["greedy_accuracy_floor"].met is False and low["greedy_accuracy_ceiling"].met is True
