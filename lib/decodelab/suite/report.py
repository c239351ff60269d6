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
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from decodelab.suite import answers, records
from decodelab.suite.answers import esc
from decodelab.suite.notebook_export import export_notebook, write_text
from decodelab.suite.registry import NOTEBOOKS, Notebook, run_command
from decodelab.suite.report_html import CSS, figure_html, kv_table, metrics_html, verdict_html

REPORT_DIR_NAME = "report"

# ---------------------------------------------------------------- runs
@dataclass
class RunRecord:
    """What one run directory recorded (see decodelab.suite.records for the layout)."""

    name: str
    dir: Path
    params: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    captions: dict = field(default_factory=dict)

    @property
    def status(self) -> str | None:
        """env.json's status as a reader should see it: a "running" run whose process is gone reads
        "interrupted (process gone)" (records.effective_status)."""
        return records.effective_status(self.env)

    @property
    def ok(self) -> bool:
        return self.status == records.STATUS_OK

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
    read = records.read_json
    env = read(run_dir / "env.json", {}) or {}
    name = env.get("name") or run_dir.parent.name
    if name not in NOTEBOOKS:
        raise ValueError(
            f"run_dir={str(run_dir)!r} belongs to notebook {name!r}, which is not one of {sorted(NOTEBOOKS)}"
        )
    return RunRecord(
        name=name, dir=run_dir, env=env,
        params=read(run_dir / "params.json", {}) or {},
        metrics=read(run_dir / "metrics.json", {}) or {},
        captions=read(run_dir / "figures" / "captions.json", {}) or {},
    )


def latest_ok(name: str, *, root: Path | None = None, profile: str | None = None) -> RunRecord | None:
    """The newest run of `name` whose status is "ok" (and whose profile matches, when given)."""
    for path in reversed(records.list_runs(name, status=records.STATUS_OK, root=root)):
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
    return {name: named.get(name) or latest_ok(name, root=root, profile=profile) for name in NOTEBOOKS}


def last_attempt(name: str, *, root: Path | None = None) -> RunRecord | None:
    """The newest run of `name` whatever its status (to say why a notebook is missing)."""
    paths = records.list_runs(name, root=root)
    return load(paths[-1]) if paths else None


def headline_stems(question: Notebook, figures: dict[str, Path]) -> list[str]:
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
def missing_html(question: Notebook, attempt: RunRecord | None) -> str:
    why = ""
    if attempt is not None:
        state = ("is still running" if attempt.status == records.STATUS_RUNNING
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

def section_html(question: Notebook, record: RunRecord | None, notebook_link: str | None,
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
    toc = "".join(f'<li><a href="#{esc(n)}">{esc(NOTEBOOKS[n].title)}</a> {esc(toc_note(selected.get(n)))}</li>'
                  for n in NOTEBOOKS)
    states = [answers.load_state(r.env)[0] for r in selected.values() if r is not None]
    load_note = "".join(f" · {states.count(state)} {text}" for state, text in (
        (answers.LOADED, "run(s) loaded: timings not comparable"), (answers.UNKNOWN, "run(s) without a load record"))
        if states.count(state))
    sections = "".join(
        section_html(NOTEBOOKS[n], selected.get(n), links.get(n), attempts.get(n)) for n in NOTEBOOKS
    )
    stamp = datetime.now().astimezone().isoformat(timespec="seconds")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>decodelab report</title><style>{CSS}</style></head><body><main>"
        "<header><h1>decodelab: research report</h1>"
        f"<p>{present} of {len(NOTEBOOKS)} research questions have a run · built {esc(stamp)}"
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
    root = Path(root) if root is not None else records.results_root()
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
