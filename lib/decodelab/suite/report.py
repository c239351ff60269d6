"""The report: one offline HTML page over the latest successful run of every notebook.

    decodelab report                       # latest "ok" run of each notebook -> results/report/index.html
    decodelab report RUN_DIR [RUN_DIR...]  # these runs for their notebooks, the latest ok run for the rest
    decodelab report --hide-code           # executed notebooks exported without their code cells

Each research question's section answers first: the question, the answer sentence generated from the
run's goal rows (decodelab.suite.answers), the goal table (met / not met / not measured), the key figure,
a short table of the numbers that support the answer (readable labels), then, collapsed, the raw
metrics, the other figures and provenance (profile, parameters, model, git commit, package versions,
hardware, machine load, wall time, run directory). A run whose load exceeded its core count is marked
"loaded: timings not comparable"; one without a load record "load not recorded".
Each executed notebook is exported to `notebooks/<name>.html` next to the page and linked from it.
A notebook without a successful run is shown with the command that would produce one.

Offline by construction: figures are embedded as data: URIs, CSS is inline, and the notebook exports
(decodelab.suite.notebook_export) fetch nothing from CDNs.
"""
from __future__ import annotations

import argparse
import base64
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from decodelab.suite import answers, runs
from decodelab.suite.answers import STATEMENT_KEYS, esc, flat_scalars, fmt, is_scalar  # noqa: F401 (re-exported)
from decodelab.suite.notebook_export import drop_widgets, export_notebook, strip_remote_assets, write_text  # noqa: F401
from decodelab.suite.registry import QUESTIONS, Question, run_command  # noqa: F401 (re-exported)

REPORT_DIR_NAME = "report"
MAX_TABLE_ROWS = 20


# ---------------------------------------------------------------- runs
@dataclass
class RunRecord:
    """What one run directory recorded (see decodelab.suite.runs for the layout)."""

    name: str
    dir: Path
    params: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    captions: dict = field(default_factory=dict)

    @property
    def status(self) -> str | None:
        """env.json's status as a reader should see it: a "running" run whose process is gone reads
        "interrupted (process gone)" (runs.effective_status)."""
        return runs.effective_status(self.env)

    @property
    def ok(self) -> bool:
        return self.status == runs.STATUS_OK

    @property
    def notebook(self) -> Path:
        return self.dir / "notebook.ipynb"

    def figures(self) -> dict[str, Path]:
        """Figure stem -> image file (PNG preferred over SVG), in the order the notebook saved them."""
        folder = self.dir / "figures"
        if not folder.is_dir():
            return {}
        found: dict[str, Path] = {}
        for path in sorted(folder.glob("*.svg")) + sorted(folder.glob("*.png")):
            found[path.stem] = path  # the PNG overwrites the SVG of the same stem
        order = [stem for stem in self.captions if stem in found]
        return {stem: found[stem] for stem in order + sorted(set(found) - set(order))}


def load(run_dir: str | Path) -> RunRecord:
    """Read a run directory; its notebook name comes from env.json, else from the parent folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir={str(run_dir)!r} is not a directory")
    read = runs.read_json
    env = read(run_dir / "env.json", {}) or {}
    name = env.get("name") or run_dir.parent.name
    if name not in QUESTIONS:
        raise ValueError(
            f"run_dir={str(run_dir)!r} belongs to notebook {name!r}, which is not one of {sorted(QUESTIONS)}"
        )
    return RunRecord(
        name=name, dir=run_dir, env=env,
        params=read(run_dir / "params.json", {}) or {},
        metrics=read(run_dir / "metrics.json", {}) or {},
        captions=read(run_dir / "figures" / "captions.json", {}) or {},
    )


def latest_ok(name: str, *, root: Path | None = None, profile: str | None = None) -> RunRecord | None:
    """The newest run of `name` whose status is "ok" (and whose profile matches, when given)."""
    for path in reversed(runs.list_runs(name, status=runs.STATUS_OK, root=root)):
        record = load(path)
        if profile is None or record.env.get("profile") == profile:
            return record
    return None


def select_runs(run_dirs=(), *, root: Path | None = None, profile: str | None = None) -> dict[str, RunRecord | None]:
    """Notebook name -> the run to show: a named run for its notebook, else the latest ok one (or None)."""
    named: dict[str, RunRecord] = {}
    for run_dir in run_dirs:
        record = load(run_dir)
        named[record.name] = record
    return {name: named.get(name) or latest_ok(name, root=root, profile=profile) for name in QUESTIONS}


def last_attempt(name: str, *, root: Path | None = None) -> RunRecord | None:
    """The newest run of `name` whatever its status (to say why a notebook is missing)."""
    paths = runs.list_runs(name, root=root)
    return load(paths[-1]) if paths else None


# ---------------------------------------------------------------- metrics -> tables
def is_flat(value: Any) -> bool:
    """A scalar or a list of scalars."""
    return is_scalar(value) or (isinstance(value, list) and all(is_scalar(v) for v in value))


def split_metrics(metrics: dict) -> tuple[list[tuple[str, Any]], list[tuple[str, list[dict]]]]:
    """metrics.json -> (scalars as (dotted key, value), tables as (dotted key, rows)), for display.

    A list of dicts is a table; a dict whose values are all dicts of scalars is a table with one row
    per key (column "key"); a dict of 3+ scalars (or lists of them) is a key/value table; other dicts
    are flattened into dotted keys. STATEMENT_KEYS ("verdict", "goals") are left out.
    """
    scalars: list[tuple[str, Any]] = []
    tables: list[tuple[str, list[dict]]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            inner = list(value.values())
            if all(isinstance(v, dict) and v and all(is_scalar(x) for x in v.values()) for v in inner):
                tables.append((prefix, [{"key": k, **v} for k, v in value.items()]))
            elif prefix and len(value) >= 3 and all(is_flat(v) for v in inner):
                tables.append((prefix, [{"key": k, "value": v} for k, v in value.items()]))
            else:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((prefix, value))
        else:
            scalars.append((prefix, value))

    for key, value in metrics.items():
        if key not in STATEMENT_KEYS:
            walk(str(key), value)
    return scalars, tables


# ---------------------------------------------------------------- HTML pieces
def html_table(rows: list[dict], max_rows: int = MAX_TABLE_ROWS) -> str:
    """Rows (dicts) -> <table> with the union of keys as columns; at most `max_rows` rows shown."""
    columns: list[str] = []
    for row in rows:
        columns += [str(k) for k in row if str(k) not in columns]
    head = "".join(f"<th>{esc(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(fmt(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows[:max_rows]
    )
    more = (f'<tr class="more"><td colspan="{len(columns)}">… {len(rows) - max_rows} more rows '
            f'(see metrics.json)</td></tr>') if len(rows) > max_rows else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}{more}</tbody></table>"


def kv_table(items, max_rows: int = 60) -> str:
    """(key, value) pairs -> a two-column <table>."""
    items = list(items)
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(fmt(v))}</td></tr>" for k, v in items[:max_rows])
    if len(items) > max_rows:
        rows += f'<tr class="more"><td colspan="2">… {len(items) - max_rows} more</td></tr>'
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def verdict_html(verdict: Any) -> str:
    if verdict is None or verdict == "" or verdict == [] or verdict == {}:
        return ""
    if isinstance(verdict, dict):
        inner = "".join(f"<li><b>{esc(k)}</b>: {esc(fmt(v) if not isinstance(v, str) else v)}</li>"
                        for k, v in verdict.items())
        body = f"<ul>{inner}</ul>"
    elif isinstance(verdict, list) and all(isinstance(v, dict) for v in verdict):  # verdict records: a table
        body = html_table([{k: x for k, x in v.items() if is_scalar(x)} for v in verdict])
    elif isinstance(verdict, list):
        body = "<ul>" + "".join(f"<li>{esc(v if isinstance(v, str) else fmt(v))}</li>" for v in verdict) + "</ul>"
    else:
        body = f"<p>{esc(verdict)}</p>"
    return f'<div class="verdict"><h3>Verdict</h3>{body}</div>'


def data_uri(path: Path) -> str:
    mime = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
    kind = mime.get(path.suffix.lower(), "application/octet-stream")
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def figure_html(stem: str, path: Path, caption: str) -> str:
    text = caption or stem
    return (f'<figure id="fig-{esc(stem)}"><img src="{data_uri(path)}" alt="{esc(text)}">'
            f"<figcaption><code>{esc(stem)}</code> — {esc(caption or 'no caption recorded')}</figcaption></figure>")


def headline_stems(question: Question, figures: dict[str, Path]) -> list[str]:
    """The notebook's named headline figures that exist, else its first figure."""
    stems = [s for s in question.headline if s in figures]
    return stems or list(figures)[:1]


def provenance(record: RunRecord) -> list[tuple[str, Any]]:
    """The facts a reader needs to trust or reproduce a run."""
    env, params = record.env, record.params
    cpu = env.get("cpu") or {}
    git = env.get("git") or {}
    commit = git.get("commit")
    return [
        ("status", record.status),
        ("profile", env.get("profile") or "(interactive)"),
        ("overrides", env.get("overrides") or {}),
        ("model", params.get("model")),
        ("git commit", f"{commit[:12]}{' (dirty)' if git.get('dirty') else ''}" if commit else None),
        ("started", env.get("started")),
        ("finished", env.get("finished")),
        ("wall time (s)", env.get("wall_s")),
        ("machine load", answers.load_state(env)[1]),
        *[(f"load {key}", (env.get("load") or {}).get(key)) for key in ("cores", "before", "after", "peak_1min")
          if isinstance(env.get("load"), dict)],
        ("cpu", f"{cpu.get('model')} ({cpu.get('usable_cores') or cpu.get('cores')} cores)" if cpu else None),
        ("memory (GiB)", env.get("memory_gib")),
        ("gpu", ", ".join(env.get("gpu") or []) or "none"),
        ("python", env.get("python")),
        ("platform", env.get("platform")),
        ("run dir", str(record.dir)),
    ]


# ---------------------------------------------------------------- the page
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; margin: 0; color: #1d1d1f;
       background: #fafafa; line-height: 1.45; }
main { max-width: 1100px; margin: 0 auto; padding: 1.5rem 2rem 4rem; }
header p { color: #555; margin: .2rem 0; }
nav ul { columns: 2; padding-left: 1.2rem; }
section { background: #fff; border: 1px solid #e3e3e3; border-radius: 8px; padding: 1rem 1.5rem; margin: 1.5rem 0; }
section.missing { background: #fbfbf8; border-style: dashed; }
h2 { margin-top: .3rem; } h3 { margin-bottom: .3rem; font-size: 1.02rem; }
.question { font-size: 1.15rem; font-weight: 600; }
.answer { border-left: 4px solid #4e79a7; background: #f3f6fa; padding: .4rem 1rem; margin: .8rem 0; }
.verdict { border-left: 4px solid #bbb; padding: .1rem 1rem; margin: .6rem 0; }
.verdict td:first-child { min-width: 18rem; }
table.goals tr.met td:nth-child(4) { color: #1e6b34; font-weight: 600; }
table.goals tr.not-met td:nth-child(4) { color: #a12a2a; font-weight: 600; }
table.goals tr.not-measured td:nth-child(4), table.goals tr.malformed td:nth-child(4) { color: #8a6d00; }
.badge { display: inline-block; padding: 0 .5rem; border-radius: 4px; font-size: .85rem; background: #eee; }
.badge.failed, .badge.loaded { background: #f8d7da; } .badge.ok, .badge.quiet { background: #d4edda; }
.badge.unknown { background: #fff3cd; }
figure { margin: 1rem 0; } figure img { max-width: min(100%, 760px); height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: .92rem; }
table { border-collapse: collapse; margin: .4rem 0 1rem; font-size: .88rem; display: block; overflow-x: auto; }
th, td { border: 1px solid #ddd; padding: .2rem .5rem; text-align: left; vertical-align: top; }
thead th { background: #f2f2f2; } table.kv th { background: #f7f7f7; font-weight: 600; white-space: nowrap; }
tr.more td { color: #777; font-style: italic; }
code { background: #f2f2f2; padding: 0 .25rem; border-radius: 3px; }
details { margin: .6rem 0; } summary { cursor: pointer; font-weight: 600; }
"""


def missing_html(question: Question, attempt: RunRecord | None) -> str:
    why = ""
    if attempt is not None:
        state = ("is still running" if attempt.status == runs.STATUS_RUNNING
                 else f"ended with status <b>{esc(attempt.status)}</b>")
        why = f"<p>The latest attempt (<code>{esc(attempt.dir)}</code>) {state}.</p>"
    return ("<p><b>No successful run yet.</b> Produce one with "
            f"<code>{esc(run_command(question.name))}</code>, then rebuild this page with "
            f"<code>decodelab report</code>.</p>{why}")


def status_html(record: RunRecord, notebook_link: str | None) -> str:
    """Status, profile, run id, load badge and the link to the executed notebook."""
    state, load_text = answers.load_state(record.env)
    return (f'<p class="status"><span class="badge {"ok" if record.ok else "failed"}">{esc(record.status)}</span> '
            f'<span class="badge {state}">{esc(load_text)}</span> '
            f'profile <b>{esc(record.env.get("profile") or "interactive")}</b> · <code>{esc(record.dir.name)}</code>'
            + (f' · <a href="{esc(notebook_link)}">executed notebook</a>' if notebook_link else "") + "</p>")


def metrics_html(metrics: dict) -> str:
    """Every metric of metrics.json (goal rows and verdict aside) as tables, for the collapsed block."""
    scalars, tables = split_metrics(metrics)
    parts = [kv_table(scalars)] if scalars else []
    parts += [f"<h3><code>{esc(key)}</code></h3>{html_table(rows)}" for key, rows in tables]
    return "".join(parts) or "<p><i>No metrics recorded.</i></p>"


def section_html(question: Question, record: RunRecord | None, notebook_link: str | None,
                 attempt: RunRecord | None = None) -> str:
    """Answer first: question, answer, goal table, key figure, supporting numbers; the rest collapsed."""
    q = question
    cls = ' class="missing"' if record is None else ""
    head = f'<section id="{esc(q.name)}"{cls}><h2>{esc(q.title)}</h2><p class="question">{esc(q.question)}</p>'
    if record is None:
        return head + missing_html(q, attempt) + "</section>"
    judged = answers.judge(record.metrics)
    state, load_text = answers.load_state(record.env)
    caution = f" <i>({esc(load_text)}.)</i>" if state == answers.LOADED else ""
    parts = [head, status_html(record, notebook_link),
             f'<p class="answer"><b>Answer.</b> {esc(judged.answer)}{caution}</p>',
             answers.goal_table_html(judged.rows), verdict_html(record.metrics.get("verdict"))]
    figures = record.figures()
    headline = headline_stems(q, figures)
    if not figures:
        parts.append("<p><i>This run saved no figures.</i></p>")
    parts += [figure_html(stem, figures[stem], record.captions.get(stem, "")) for stem in headline]
    numbers = answers.key_numbers(q, record.metrics)
    if numbers:
        parts.append(f"<h3>Numbers behind the answer</h3>{answers.numbers_table_html(numbers)}")
    parts.append(f"<details><summary>All metrics (metrics.json)</summary>{metrics_html(record.metrics)}</details>")
    others = [s for s in figures if s not in headline]
    if others:
        inner = "".join(figure_html(s, figures[s], record.captions.get(s, "")) for s in others)
        parts.append(f"<details><summary>Other figures ({len(others)})</summary>{inner}</details>")
    parts.append(f"<details><summary>Provenance</summary>{kv_table(provenance(record))}"
                 f"<h3>Parameters</h3>{kv_table(sorted(record.params.items()))}"
                 f"<h3>Package versions</h3>{kv_table(sorted((record.env.get('packages') or {}).items()))}"
                 "</details></section>")
    return "".join(parts)


def toc_note(record: RunRecord | None) -> str:
    """'(2 of 3 goals met)' for the table of contents; '(not run yet)' without a run."""
    if record is None:
        return "(not run yet)"
    judged = [g for g in answers.judge(record.metrics).goals if not g.moonshot]
    return f"({sum(g.met is True for g in judged)} of {len(judged)} goals met)" if judged else "(no goal rows)"


def render_page(selected: dict[str, RunRecord | None], links: dict[str, str], *,
                attempts: dict[str, RunRecord | None] | None = None, root: Path | None = None) -> str:
    """The whole index.html as a string (no I/O besides reading the figures)."""
    attempts = attempts or {}
    present = sum(r is not None for r in selected.values())
    toc = "".join(f'<li><a href="#{esc(n)}">{esc(QUESTIONS[n].title)}</a> {esc(toc_note(selected.get(n)))}</li>'
                  for n in QUESTIONS)
    states = [answers.load_state(r.env)[0] for r in selected.values() if r is not None]
    load_note = "".join(f" · {states.count(state)} {text}" for state, text in (
        (answers.LOADED, "run(s) loaded: timings not comparable"), (answers.UNKNOWN, "run(s) without a load record"))
        if states.count(state))
    sections = "".join(
        section_html(QUESTIONS[n], selected.get(n), links.get(n), attempts.get(n)) for n in QUESTIONS
    )
    stamp = datetime.now().astimezone().isoformat(timespec="seconds")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>decodelab report</title><style>{CSS}</style></head><body><main>"
        "<header><h1>decodelab: research report</h1>"
        f"<p>{present} of {len(QUESTIONS)} research questions have a run · built {esc(stamp)}"
        + (f" from <code>{esc(root)}</code>" if root else "") + esc(load_note) + "</p>"
        "<p>Each section shows the latest successful run of its notebook, unless runs were named "
        "on the command line.</p></header>"
        f"<nav><ul>{toc}</ul></nav>{sections}</main></body></html>\n"
    )


def build_report(run_dirs=(), *, root: str | Path | None = None, out_dir: str | Path | None = None,
                 hide_code: bool = False, export: bool = True, profile: str | None = None, log=print) -> Path:
    """Write <out_dir>/index.html (default results/report/) and notebooks/<name>.html; return index.html.

    `profile` restricts the automatic choice (not the named `run_dirs`) to runs of that profile.
    """
    root = Path(root) if root is not None else runs.results_root()
    out_dir = Path(out_dir) if out_dir is not None else root / REPORT_DIR_NAME
    selected = select_runs(run_dirs, root=root, profile=profile)
    attempts = {n: last_attempt(n, root=root) for n, r in selected.items() if r is None}
    nb_dir = out_dir / "notebooks"
    nb_dir.mkdir(parents=True, exist_ok=True)
    for stale in nb_dir.glob("*.html"):  # exports of runs no longer shown
        stale.unlink()
    links: dict[str, str] = {}
    for name, record in selected.items():
        if export and record is not None and record.notebook.is_file():
            try:
                export_notebook(record.notebook, nb_dir / f"{name}.html", hide_code=hide_code)
                links[name] = f"notebooks/{name}.html"
            except Exception as error:  # a broken notebook file must not take the page down
                log(f"warning: could not export {record.notebook}: {type(error).__name__}: {error}")
    index = out_dir / "index.html"
    write_text(index, render_page(selected, links, attempts=attempts, root=root))
    return index


# ---------------------------------------------------------------- CLI entry points
def main(argv: list[str] | None = None) -> int:
    """`decodelab report [RUN_DIR ...] [--hide-code] [--profile P] [--results DIR] [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="decodelab report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="*", metavar="RUN_DIR",
                        help="runs to show (each replaces its notebook's latest ok run)")
    parser.add_argument("--hide-code", action="store_true", help="export the notebooks without code cells")
    parser.add_argument("--results", default=None, help="results root (default $DECODELAB_RESULTS or results/)")
    parser.add_argument("--out", default=None, help="output folder (default <results>/report)")
    parser.add_argument("--profile", default=None, help="only consider runs of this profile (smoke, cpu, gpu)")
    parser.add_argument("--no-notebooks", action="store_true", help="skip the nbconvert export of each notebook")
    args = parser.parse_args(argv)
    try:
        index = build_report(args.run_dirs, root=args.results, out_dir=args.out, hide_code=args.hide_code,
                             export=not args.no_notebooks, profile=args.profile)
    except ValueError as error:
        parser.exit(2, f"decodelab report: error: {error}\n")
    print(f"report: {index}")
    return 0


def findings_main(argv: list[str] | None = None) -> int:
    """`decodelab findings`: see decodelab.suite.findings."""
    from decodelab.suite import findings

    return findings.main(argv)
