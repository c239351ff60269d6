"""The suite's time budget, judged from the runs the README shows: each notebook's wall time and `make all`'s.

`make all` runs every registered notebook once with the cpu profile, so its wall time is the sum of the
notebooks' recorded `wall_s` (papermill start to finish, kernel start included) plus the report (seconds).
The budget rows are goals like any other (value, target, met), so the README cannot claim a budget the runs
did not show; a run that was loaded is marked, since its wall time says little about a quiet machine.
"""
from __future__ import annotations

from decodelab.common.goals import Goal
from decodelab.suite import answers, registry

NOTEBOOK_BUDGET_S = 600.0   # every notebook's cpu profile within ~10 minutes on 2 quiet cores
SUITE_BUDGET_S = 45 * 60.0  # make all: every notebook and the quickstart within 45 minutes


def wall_times(selected: dict) -> dict[str, float | None]:
    """name -> recorded wall seconds of the run shown for it (None: no run or no wall time recorded)."""
    out = {}
    for name in registry.NOTEBOOKS:
        record = selected.get(name)
        wall = (record.env or {}).get("wall_s") if record is not None else None
        out[name] = float(wall) if wall is not None else None
    return out


def budget_goals(walls: dict[str, float | None]) -> list[Goal]:
    """One goal row per notebook (<= NOTEBOOK_BUDGET_S) and one for their sum (<= SUITE_BUDGET_S).

    The sum is not measured (None) unless every notebook has a wall time: a partial sum would flatter."""
    rows = [Goal.check(f"wall_{name}", wall, "<=", NOTEBOOK_BUDGET_S, label=f"{name} cpu profile wall time",
                       unit="s") for name, wall in walls.items()]
    known = [w for w in walls.values() if w is not None]
    total = sum(known) if len(known) == len(walls) and known else None
    rows.append(Goal.check("wall_make_all", total, "<=", SUITE_BUDGET_S,
                           label="make all (sum of the notebooks' wall times)", unit="s"))
    return rows


def budget_md(selected: dict) -> str:
    """The budget table for the README: per notebook wall time, load state, and the make-all sum."""
    walls = wall_times(selected)
    goals = {g.name: g for g in budget_goals(walls)}
    lines = ["| notebook | wall time | budget | status | load | commit |", "|---|---|---|---|---|---|"]
    for name, wall in walls.items():
        record = selected.get(name)
        load = answers.load_state(record.env)[1] if record is not None else "no run"
        commit = ((record.env or {}).get("git") or {}).get("commit") if record is not None else None
        lines.append(f"| {name} | {_seconds(wall)} | <= {NOTEBOOK_BUDGET_S:.0f} s | "
                     f"{_status(goals[f'wall_{name}'].met)} | {load} | {f'`{commit[:7]}`' if commit else 'unknown'} |")
    total = goals["wall_make_all"]
    lines.append(f"| **make all** (sum) | {_seconds(total.value)} | <= {SUITE_BUDGET_S:.0f} s | "
                 f"{_status(total.met)} | | |")
    met = [g for g in goals.values() if g.met]
    intro = (f"Wall time of each notebook's cpu-profile run shown below (recorded by the runner, at the commit "
             f"named: a run at an older commit says nothing of today's code), {len(met)} of {len(goals)} budget "
             "rows met.")
    return intro + "\n\n" + "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.0f} s ({value / 60:.1f} min)"


def _status(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "not met")
