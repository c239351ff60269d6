"""A run's answer as a reader sees it: goal rows judged, the generated answer sentence, the few
numbers behind it, whether the machine was quiet, and the provenance line. One copy of the
formatting, used by the HTML report (decodelab.suite.report) and the README blocks (decodelab.suite.findings,
decodelab.suite.bench_block).

    verdict = answers.judge(metrics)      # rows for the goal table + answer sentence (never typed)
    answers.key_numbers(question, metrics)  # [(readable label, value), ...], no token-id lists
    answers.load_state(env)               # ("loaded" | "quiet" | "unknown", "loaded: timings not comparable (...)")

A goal row is trusted only as far as its fields allow: a row without value/target/op/met, an old
dict of bare numbers, or a row whose `met` disagrees with `value op target` is shown as "malformed",
a row without a value as "not measured", never as met.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import html
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decodelab.common import goals as goals_mod
from decodelab.suite.provenance import is_loaded

STATEMENT_KEYS = ("verdict", "goals")  # metrics shown as statements, not as numbers
MAX_LIST_ITEMS = 12
MAX_KEY_NUMBERS = 8
TIMING_UNITS = ("s", "ms", "us", "tok/s")
GOAL_COLUMNS = ("goal", "value", "target", "status", "note")
MALFORMED = "malformed"
NO_RUN = "none"  # what a README block's run line names when no run was there
RUN_LINE = re.compile(r"^<!-- (\w+) run: (\S+) -->$", re.M)  # "<!-- quickstart run: quickstart/<id> -->"
LOADED, QUIET, UNKNOWN = "loaded", "quiet", "unknown"


# ---------------------------------------------------------------- values
def fmt(value: Any) -> str:
    """A metric value as short text: 4 significant digits, lists truncated."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(fmt(v) for v in value[:MAX_LIST_ITEMS])
        more = f", … ({len(value)} items)" if len(value) > MAX_LIST_ITEMS else ""
        return f"[{shown}{more}]"
    if isinstance(value, dict):
        text = json.dumps(value, default=str)
        return text if len(text) <= 200 else text[:199] + "…"
    return str(value)


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def flat_scalars(metrics: dict) -> dict[str, Any]:
    """Dotted key -> value for every metric that is not a list of records (STATEMENT_KEYS left out).

    `{"speedup": {"1": 1.8}}` -> `{"speedup.1": 1.8}`; lists of numbers stay lists.
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif not (isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
            flat[prefix] = value

    for key, value in metrics.items():
        if key not in STATEMENT_KEYS:
            walk(str(key), value)
    return flat


# ---------------------------------------------------------------- goals
@dataclass(frozen=True)
class Judgement:
    """What a run's goal rows say: display rows (GOAL_COLUMNS), the answer sentence, the goals."""

    rows: list[dict]
    answer: str
    goals: list[goals_mod.Goal]
    malformed: int = 0


def _checked(row: Any) -> goals_mod.Goal | str:
    """A well-formed goal row -> Goal (its `met` as recorded); else the reason it is malformed."""
    try:
        goal = goals_mod.from_rows([row])[0]
    except (ValueError, TypeError) as error:
        return str(error)
    if goal.value is None:
        return dataclasses.replace(goal, met=None)  # nothing measured can be met
    try:
        met = bool(goals_mod.OPS[goal.op](goal.value, goal.target))
    except TypeError:
        return f"value {goal.value!r} cannot be compared with target {goal.target!r}"
    if goal.met is not met:
        return f"recorded met={goal.met!r} but {goal.value!r} {goal.op} {goal.target!r} is {met}"
    return goal


def _malformed_row(name: Any, value: Any, why: str) -> dict:
    return {"goal": str(name), "value": fmt(value), "target": "–", "status": MALFORMED, "note": why}


def judge(metrics: dict) -> Judgement:
    """metrics.json -> goal rows for display and the generated answer (goals.headline)."""
    raw = metrics.get("goals")
    if raw is None or raw == []:
        return Judgement([], "No goal rows recorded: this run cannot answer its question.", [])
    if isinstance(raw, dict):  # the old {goal: bare number or bool} form: no target, no comparison
        rows = [_malformed_row(k, v, "bare value without target (old format)") for k, v in raw.items()]
        return Judgement(rows, "Not judged: the goals are bare values without targets (old format).", [],
                         len(rows))
    if not isinstance(raw, list):
        return Judgement([_malformed_row("goals", raw, "not a list of goal rows")],
                         "Not judged: metrics[\"goals\"] is not a list of goal rows.", [], 1)
    good: list[goals_mod.Goal] = []
    rows: list[dict] = []
    for row in raw:
        checked = _checked(row)
        if isinstance(checked, str):
            name = row.get("label") or row.get("name") if isinstance(row, dict) else row
            rows.append(_malformed_row(name, row.get("value") if isinstance(row, dict) else None, checked))
        else:
            good.append(checked)
            rows.append(goals_mod.table([checked])[0])
    bad = len(rows) - len(good)
    answer = goals_mod.headline(good) if good else "No well-formed goal rows: this run cannot answer its question."
    if bad and good:
        answer += f" {bad} goal row{'s' if bad > 1 else ''} malformed (not judged)."
    return Judgement(rows, answer, good, bad)


def is_timing_goal(goal: goals_mod.Goal, patterns: tuple[str, ...]) -> bool:
    return goal.unit in TIMING_UNITS or matches(goal.name, patterns)


# ---------------------------------------------------------------- key numbers
def matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _pattern_and_label(entry: str | tuple[str, str]) -> tuple[str, str]:
    return (entry, "") if isinstance(entry, str) else (entry[0], entry[1])


def _captures(pattern: str, key: str) -> list[str]:
    """What the `*`s of `pattern` matched in `key`: ("a.*.b", "a.4.b") -> ["4"]; no `*` -> [key]."""
    regex = "".join("(.+?)" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    found = re.fullmatch(regex, key)
    return list(found.groups()) if found and found.groups() else [key]


def readable(key: str) -> str:
    """'crossover_batch.ngram.measured' -> 'crossover batch (ngram, measured)'."""
    head, *rest = key.split(".")
    text = head.replace("_", " ")
    return text + (f" ({', '.join(r.replace('_', ' ') for r in rest)})" if rest else "")


def key_numbers(question, metrics: dict) -> list[tuple[str, Any]]:
    """(label, value) for the question's key metrics (`question.key_metrics`: dotted names, shell-style
    patterns, optionally paired with a label template whose {0}, {1}... are the parts `*` matched).

    Only scalars: lists (token ids, curves) are never key numbers. Without named metrics: the first
    few top-level scalars. At most MAX_KEY_NUMBERS.
    """
    flat = {k: v for k, v in flat_scalars(metrics).items()
            if is_scalar(v) and not (isinstance(v, str) and len(v) > 80)}
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for entry in getattr(question, "key_metrics", ()):
        pattern, template = _pattern_and_label(entry)
        for key in flat:
            if key not in seen and fnmatch.fnmatchcase(key, pattern):
                seen.add(key)
                label = template.format(*_captures(pattern, key)) if template else readable(key)
                out.append((label, flat[key]))
    if not out:
        out = [(readable(k), v) for k, v in flat.items() if "." not in k]
    return out[:MAX_KEY_NUMBERS]


def timing_numbers(question, metrics: dict) -> list[str]:
    """Dotted keys of the question's key metrics that are timings (question.timing_metrics)."""
    patterns = tuple(getattr(question, "timing_metrics", ()))
    flat = flat_scalars(metrics)
    keys = [k for entry in getattr(question, "key_metrics", ()) for k in flat
            if fnmatch.fnmatchcase(k, _pattern_and_label(entry)[0])]
    return sorted({k for k in keys if matches(k, patterns)})


# ---------------------------------------------------------------- load
def _first(value: Any) -> float | None:
    """A load figure: a number, or the 1-minute entry of a (1, 5, 15)-minute list."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def load_state(env: dict) -> tuple[str, str]:
    """(LOADED | QUIET | UNKNOWN, text) from env["load"] = {cores, before, after, peak_1min, loaded} (and, where
    recorded, memory_read_GBps: a host whose memory reads slowed shows it though its load stays quiet).

    Loaded when any recorded load exceeds the core count by more than provenance.LOAD_MARGIN (the run's
    own threads fill the cores); where no numbers were recorded, when the runner's flag says so.
    """
    load = env.get("load")
    if not isinstance(load, dict):
        return UNKNOWN, "load not recorded"
    cores = _first(load.get("cores"))
    seen = [x for x in (_first(load.get(k)) for k in ("before", "peak_1min", "after")) if x is not None]
    peak = max(seen) if seen else None
    loaded = is_loaded(env)
    detail = f"peak load {peak:.2f} on {cores:.0f} cores" if peak is not None and cores is not None else ""
    memory = [_first(v) for v in load.get("memory_read_GBps") or []]
    if detail and memory and all(v is not None for v in memory):
        detail += f"; one core read memory at {' then '.join(f'{v:.1f}' for v in memory)} GB/s"
    if loaded:
        return LOADED, "loaded: timings not comparable" + (f" ({detail})" if detail else "")
    if load.get("loaded") is False or detail:
        return QUIET, "quiet" + (f" ({detail})" if detail else "")
    return UNKNOWN, "load not recorded"


def verdict_line(row: dict) -> str:
    """A verdict record {claim, finding, estimate?, lo?, hi?, mdd?, unit?, main?} -> one line: the claim,
    its finding, the estimate with its 95% interval, and the minimum detectable difference of an
    inconclusive one (what the sample could have seen)."""
    unit = row.get("unit") if row.get("unit") in goals_mod.UNITS else ""
    show = lambda v: goals_mod.format_value(v, unit)  # noqa: E731
    finding = row.get("finding", row.get("holds"))
    text = f"{'**main** · ' if row.get('main') else ''}{row['claim']}: {fmt(finding)}"
    if row.get("estimate") is not None and row.get("lo") is not None and row.get("hi") is not None:
        text += f" (difference {show(row['estimate'])}, 95% CI [{show(row['lo'])}, {show(row['hi'])}]"
        text += f", {row['n_units']} paired units" if row.get("n_units") else ""
        if finding == "inconclusive" and row.get("mdd") is not None:
            text += f"; minimum detectable difference {show(row['mdd']).lstrip('+')}"
        text += ")"
    return text


# ---------------------------------------------------------------- rendering
def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def md_cell(value: Any) -> str:
    text = value if isinstance(value, str) else fmt(value)
    return text.replace("|", "\\|").replace("\n", " ")


def goal_table_html(rows: list[dict]) -> str:
    """Goal rows -> <table class="goals">, each row classed by its status (met / not-met / ...)."""
    if not rows:
        return '<p class="goals-none"><i>No goal rows recorded.</i></p>'
    head = "".join(f"<th>{esc(c)}</th>" for c in GOAL_COLUMNS)
    body = "".join(
        f'<tr class="{esc(row["status"].split(" (")[0].replace(" ", "-"))}">'
        + "".join(f"<td>{esc(row.get(c, ''))}</td>" for c in GOAL_COLUMNS) + "</tr>"
        for row in rows
    )
    return f'<table class="goals"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def goal_table_md(rows: list[dict]) -> str:
    if not rows:
        return "_No goal rows recorded._\n"
    lines = ["| " + " | ".join(GOAL_COLUMNS) + " |", "|" + "---|" * len(GOAL_COLUMNS)]
    lines += ["| " + " | ".join(md_cell(row.get(c, "")) for c in GOAL_COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _number_text(value: Any) -> str:
    return "not measured" if value is None else fmt(value)


def numbers_table_html(numbers: list[tuple[str, Any]]) -> str:
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(_number_text(v))}</td></tr>" for k, v in numbers)
    return f'<table class="kv numbers"><tbody>{rows}</tbody></table>' if numbers else ""


def numbers_table_md(numbers: list[tuple[str, Any]]) -> str:
    if not numbers:
        return ""
    return "| number | value |\n|---|---|\n" + "".join(f"| {md_cell(k)} | {md_cell(_number_text(v))} |\n"
                                                  for k, v in numbers)


# ---------------------------------------------------------------- provenance (README)
def machine(env: dict) -> str:
    """'Intel(R) Xeon(R) ... (2 cores)' plus GPUs when there are any."""
    cpu = env.get("cpu") or {}
    cores = cpu.get("usable_cores") or cpu.get("cores")
    text = f"{cpu.get('model') or 'unknown CPU'}" + (f" ({cores} cores)" if cores else "")
    gpus = env.get("gpu") or []
    return text + (f", {', '.join(gpus)}" if gpus else "")


def provenance_line(env: dict, source: str, date: str | None = None) -> str:
    """'Measured with profile `cpu` · <machine> · <load> · <date> · commit `abc1234` · 12 s · run `<source>`.'"""
    git = env.get("git") or {}
    commit = git.get("commit")
    state, load_text = load_state(env)
    parts = [
        f"profile `{env.get('profile')}`" if env.get("profile") else None,
        machine(env),
        f"**{load_text}**" if state != QUIET else load_text,
        (date or env.get("started") or "unknown date")[:10],
        f"commit `{commit[:7]}`{' (dirty)' if git.get('dirty') else ''}" if commit else "commit unknown",
        f"{float(env['wall_s']):.0f} s" if env.get("wall_s") is not None else None,
        f"run `{source}`",
    ]
    return "Measured with " + " · ".join(p for p in parts if p) + "."


def run_line(name: str, source: str) -> str:
    return f"<!-- {name} run: {source} -->"


def relative(path: Path, root: Path) -> str:
    """`path` relative to the results root ('quickstart/<run-id>'), else as given."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()
