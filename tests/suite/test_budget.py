"""The time-budget rows: per notebook and for make all, judged only from recorded wall times."""
from types import SimpleNamespace

from decodelab.suite import budget, registry


def _records(walls: dict):
    return {name: SimpleNamespace(env={"wall_s": wall, "load": {"cores": 2, "before": [1.0], "loaded": False}})
            for name, wall in walls.items()}


def test_make_all_is_the_sum_of_every_notebooks_wall_time_and_judged_against_45_minutes():
    walls = {name: 300.0 for name in registry.NOTEBOOKS}
    goals = {g.name: g for g in budget.budget_goals(walls)}
    assert goals["wall_make_all"].value == 300.0 * len(walls)
    assert goals["wall_make_all"].met == (300.0 * len(walls) <= 45 * 60)
    assert all(goals[f"wall_{n}"].met for n in walls)
    walls[next(iter(walls))] = 601.0
    assert budget.budget_goals(walls)[0].met is False


def test_a_missing_wall_time_leaves_the_sum_unmeasured_instead_of_flattering_it():
    walls = {name: 10.0 for name in registry.NOTEBOOKS}
    walls[next(iter(walls))] = None
    total = budget.budget_goals(walls)[-1]
    assert total.value is None and total.met is None


def test_budget_table_shows_each_notebook_and_the_sum_from_the_records():
    selected = _records({name: 120.0 for name in registry.NOTEBOOKS})
    selected[next(iter(selected))] = None
    text = budget.budget_md(selected)
    assert text.count("| 120 s (2.0 min) |") == len(registry.NOTEBOOKS) - 1
    assert "| not recorded |" in text and "no run" in text
    assert "make all" in text and "not measured" in text
