"""Notebook 02's experiment plan and goals: which settings the accuracy study runs on how many problems,
the samplers the cost benchmark times, and the goal rows judged from the run's numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from decodelab.sampling_study.grid import (
    SAMPLER_FIELDS,
    Setting,
    check_settings,
    order_grid,
    units_per_setting,
)

MIXED_GRID = "mixed grid"  # the cost benchmark's name for one Sampler with every grid setting in its rows


@dataclass(frozen=True)
class AccuracyPlan:
    """The settings one `grid.run_grid` call runs for the accuracy study, and on how many problems each.

    study: the settings the verdicts use (the sweep, then the order-of-operations settings not in it);
    checks: (check, reference) pairs that must generate identical rows (`grid.check_settings`);
    settings: study + the check settings not already in it, in that order (what run_grid runs);
    n_units: leading problems per entry of `settings` (run_grid's n_units).
    """

    study: list[Setting]
    checks: list[tuple[Setting, Setting]]
    settings: list[Setting]
    n_units: list[int]


def accuracy_plan(sweep: list[Setting], *, order_settings: dict[str, float], order_temperatures: Sequence[float],
                  temperatures: Sequence[float], main_temperatures: Sequence[float], n_problems: int,
                  n_secondary_problems: int, check_problems: int) -> AccuracyPlan:
    """The sweep (`grid.sampler_grid`) plus the order-of-operations settings (`grid.order_grid`) and the
    row checks: main settings on all n_problems, secondary ones on the first n_secondary_problems
    (`grid.units_per_setting`), the check settings on the first min(check_problems, n_secondary_problems).
    The check rows are last, so `frame.setting < len(plan.study)` drops them from the study."""
    study = sweep + [s for s in order_grid(order_settings, order_temperatures) if s not in sweep]
    checks = check_settings(temperatures)
    extra = [c for c, _ in checks if c not in study]
    n_units = (units_per_setting(study, main_temperatures, n_problems, n_secondary_problems)
               + [min(check_problems, n_secondary_problems)] * len(extra))
    return AccuracyPlan(study=study, checks=checks, settings=study + extra, n_units=n_units)


def bench_samplers(sweep: list[Setting], samplers: dict[str, list], *, batch_size: int = 64) -> dict:
    """{name: Sampler} the cost benchmark times: MIXED_GRID, one Sampler whose batch_size rows cycle
    through the sweep's configs (as the runs mix them), then each sampler alone at the last value of
    its grid (T = 1)."""
    from decodelab.core.sampling import Sampler, SamplerConfig

    return {MIXED_GRID: Sampler([sweep[i % len(sweep)].config for i in range(batch_size)]),
            **{name: Sampler(SamplerConfig(**{SAMPLER_FIELDS[name]: values[-1]})) for name, values in samplers.items()}}


def notebook_goals(claims: list[dict], *, half_width_target: float, n_problems: int, main_temperatures,
                   difficulty, greedy_accuracy: float, greedy_ci: tuple[float, float], greedy_band,
                   sampler_cost_ratio: float | None, sampler_cost_budget: float, bench_repeats: int) -> list:
    """Notebook 02's goal rows (`decodelab.common.goals.Goal`): the widest 95% CI half-width of the main
    verdict rows (bootstrap or normal, the larger: `verdicts.effective_half_width`) against
    half_width_target; greedy accuracy inside greedy_band (off the floor, off the ceiling); the mixed
    grid's Sampler.sample cost as a fraction of a decode step against sampler_cost_budget."""
    from decodelab.common.goals import Goal
    from decodelab.sampling_study.verdicts import effective_half_width

    main_rows = [r for r in claims if r["main"]]
    widths = [w for w in map(effective_half_width, main_rows) if w is not None]
    needed = [r["required_units"] for r in main_rows if r["required_units"] is not None]
    ci = (float(greedy_ci[0]), float(greedy_ci[1]))
    return [
        Goal.check("main_verdict_half_width", max(widths) if widths else None, "<=", half_width_target,
                   label="widest 95% CI half-width of the main verdicts (accuracy difference)",
                   note=f"{len(main_rows)} main verdicts on {n_problems} problems at T={main_temperatures}; "
                        f"the observed spread needs up to {max(needed) if needed else 'n/a'} problems"),
        Goal.check("greedy_accuracy_floor", greedy_accuracy, ">=", greedy_band[0], unit="%",
                   label=f"greedy accuracy at difficulty {difficulty}, off the floor", estimate=greedy_accuracy, ci=ci),
        Goal.check("greedy_accuracy_ceiling", greedy_accuracy, "<=", greedy_band[1], unit="%",
                   label=f"greedy accuracy at difficulty {difficulty}, off the ceiling", estimate=greedy_accuracy,
                   ci=ci),
        Goal.check("sampler_cost_ratio", sampler_cost_ratio, "<=", sampler_cost_budget, unit="%",
                   label="mixed-grid Sampler.sample / one decode step at batch 64",
                   note=f"best of {bench_repeats} repeats; a timing, noisy on a loaded machine"),
    ]
