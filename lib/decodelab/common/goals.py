"""Goals as data: each goal a notebook states is one row (value, target, comparison, met).

    from decodelab.common.goals import Goal
    rows = [
        Goal.check("ngram_speedup_b1", speedup, ">=", 1.7, label="n-gram speedup at batch 1, code editing", unit="x"),
        Goal.check("roofline_heldout_error", err, "<=", 0.15, label="roofline median error on held-out cells",
                   unit="%"),
    ]
    run.log_goals(rows)                 # metrics.json["goals"]: a list of rows, merged by name
    print(goals.headline(rows))         # "1 of 2 goals met; not met: roofline median error ... 26% (target <= 15%)"

A goal whose value could not be measured (None, NaN) has `met=None` ("not measured"), never False or True.
When a goal is judged on an interval (a lower confidence bound), pass that bound as `value` and the
point estimate and interval as `estimate` / `ci`, so the row says what was compared.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import asdict, dataclass, field
from typing import Any

OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
UNITS = ("", "x", "%", "s", "ms", "us", "tok/s", "nats", "points")
GOAL_FIELDS = ("name", "value", "target", "op", "met")


@dataclass(frozen=True)
class Goal:
    """One stated goal and how the run measured against it.

    `met` is None when `value` is missing (not measured). `unit` only changes how numbers print
    ("%" prints 0.26 as 26%, "x" prints 1.21x).
    """

    name: str
    value: float | bool | None
    target: float | bool
    op: str
    met: bool | None
    label: str = ""
    unit: str = ""
    note: str = ""
    estimate: float | None = None
    ci: tuple[float, float] | None = None
    moonshot: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Goal {self.name!r}: op={self.op!r} is not one of {list(OPS)}")
        if self.unit not in UNITS:
            raise ValueError(f"Goal {self.name!r}: unit={self.unit!r} is not one of {list(UNITS)}")

    @classmethod
    def check(cls, name: str, value: Any, op: str, target: float | bool, **kwargs) -> "Goal":
        """A goal row with `met` computed from value `op` target (None when value is missing)."""
        if op not in OPS:
            raise ValueError(f"Goal {name!r}: op={op!r} is not one of {list(OPS)}")
        value = _number(value)
        met = None if value is None else bool(OPS[op](value, target))
        return cls(name=name, value=value, target=target, op=op, met=met, **kwargs)

    @property
    def status(self) -> str:
        """"met", "not met" or "not measured"."""
        return "not measured" if self.met is None else "met" if self.met else "not met"

    def describe(self) -> str:
        """'label: 26% (target <= 15%), not met'."""
        label = self.label or self.name
        value, target = format_against(self.value, self.target, self.unit)
        value = "not measured" if self.value is None else value
        text = f"{label}: {value} (target {self.op} {target})"
        if self.ci is not None and self.estimate is not None:
            text += (f"; estimate {format_value(self.estimate, self.unit)}, "
                     f"CI [{format_value(self.ci[0], self.unit)}, {format_value(self.ci[1], self.unit)}]")
        return text

    def to_row(self) -> dict:
        row = asdict(self)
        row["status"] = self.status
        row["ci"] = list(self.ci) if self.ci is not None else None
        return row


def _number(value: Any) -> float | bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if hasattr(value, "item"):
        value = value.item()
    value = float(value)
    return value if math.isfinite(value) else None


def format_value(value: Any, unit: str = "", *, digits: int = 3) -> str:
    """A number as a reader sees it: 0.26 with unit "%" -> "26%", 1.214 with "x" -> "1.21x"."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    value = float(value)
    if unit == "%":
        decimals = max(0, digits - 2) if abs(value) < 0.1 else max(0, digits - 3)
        return f"{value * 100:.{decimals}f}%"
    if unit == "points":
        return f"{value * 100:+.{max(1, digits - 2)}f} points"
    text = f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.{max(0, digits - 3)}f}"
    return f"{text}{'x' if unit == 'x' else (' ' + unit if unit else '')}"


def format_against(value: Any, target: Any, unit: str = "") -> tuple[str, str]:
    """(value, target) as printed, with as many digits as it takes for a value that differs from its
    target not to print as the target (0.1504 against 0.15 -> "15.04%", not "15%")."""
    goal = format_value(target, unit)
    if value is None or isinstance(value, bool) or isinstance(target, bool) or float(value) == float(target):
        return format_value(value, unit), goal
    for digits in range(3, 9):
        shown = format_value(value, unit, digits=digits)
        if _printed_number(shown) != _printed_number(goal):
            break
    return shown, goal


def _printed_number(text: str) -> float:
    return float(re.sub(r"[^0-9.eE+-]", "", text.split(" ")[0].replace(",", "")) or "nan")


def from_rows(rows: Any) -> list[Goal]:
    """metrics.json's "goals" (a list of row dicts) -> Goal objects; raises ValueError on a malformed row."""
    if not isinstance(rows, list):
        raise ValueError(f"goals must be a list of goal rows, got {type(rows).__name__}")
    out = []
    for row in rows:
        if not isinstance(row, dict) or not set(GOAL_FIELDS) <= set(row):
            raise ValueError(f"goal row {row!r:.120} lacks one of {GOAL_FIELDS}")
        known = {k: v for k, v in row.items() if k in Goal.__dataclass_fields__}
        if known.get("ci") is not None:
            known["ci"] = tuple(known["ci"])
        out.append(Goal(**known))
    return out


def merge(old_rows: list[dict] | None, new: list[Goal]) -> list[dict]:
    """Goal rows with `new` replacing rows of the same name, order of first appearance kept."""
    rows = {row["name"]: row for row in old_rows or []}
    for goal in new:
        rows[goal.name] = goal.to_row()
    return list(rows.values())


def headline(goals: list[Goal]) -> str:
    """One generated sentence: how many goals the run met, and which it did not (never typed)."""
    goals = [g for g in goals if not g.moonshot] or list(goals)
    if not goals:
        return "This run states no goals."
    met = [g for g in goals if g.met is True]
    unmet = [g for g in goals if g.met is False]
    missing = [g for g in goals if g.met is None]
    text = f"{len(met)} of {len(goals)} goals met"
    if unmet:
        text += "; not met: " + "; ".join(g.describe() for g in unmet)
    if missing:
        text += "; not measured: " + ", ".join(g.label or g.name for g in missing)
    return text + "."


def table(goals: list[Goal]) -> list[dict]:
    """Rows for a notebook table or a report: goal, value, target, status, note."""
    return [
        {
            "goal": g.label or g.name,
            "value": "not measured" if g.value is None else format_against(g.value, g.target, g.unit)[0],
            "target": f"{g.op} {format_against(g.value, g.target, g.unit)[1]}",
            "status": g.status + (" (moonshot)" if g.moonshot else ""),
            "note": g.note,
        }
        for g in goals
    ]
