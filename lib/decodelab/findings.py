"""README findings: the block between two markers, regenerated from the latest cpu-profile runs.

    decodelab findings            # rewrite README.md between the markers, copy figures to docs/findings/
    decodelab findings --check    # exit 1 when README.md is not what the runs give (nothing written)

README.md must contain, on their own lines::

    <!-- findings:start -->
    <!-- findings:end -->

Everything between them is generated: per notebook the headline figure (copied to
docs/findings/<name>.png and linked relatively), the verdict when the notebook writes one, the few
numbers the finding rests on, and the profile, machine, date and commit of the run.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
from pathlib import Path
from typing import Any

from decodelab import report, runs

START = "<!-- findings:start -->"
END = "<!-- findings:end -->"
MAX_METRICS = 6
MAX_NAMED = 12
MAX_ROWS = 8
MAX_COLUMNS = 6


def _md(text: Any) -> str:
    """A value for a Markdown table cell."""
    return report.fmt(text).replace("|", "\\|").replace("\n", " ")


def key_numbers(question: report.Question, metrics: dict) -> list[tuple[str, Any]]:
    """The notebook's key metrics (dotted names, shell-style patterns allowed: "speedup.*"), else its
    first few scalar metrics, top-level ones first."""
    flat = report.flat_scalars(metrics)
    named: dict[str, Any] = {}
    for pattern in question.key_metrics:
        named.update((k, flat[k]) for k in flat if fnmatch.fnmatchcase(k, pattern) and k not in named)
    if named:
        return list(named.items())[:MAX_NAMED]
    short = [(k, v) for k, v in flat.items()
             if not isinstance(v, (list, dict)) and not (isinstance(v, str) and len(v) > 80)]
    short.sort(key=lambda item: "." in item[0])  # stable: top-level metrics first
    return short[:MAX_METRICS]


def machine(env: dict) -> str:
    """'Intel(R) Xeon(R) ... (2 cores)' plus GPUs when there are any."""
    cpu = env.get("cpu") or {}
    cores = cpu.get("usable_cores") or cpu.get("cores")
    text = f"{cpu.get('model') or 'unknown CPU'}" + (f" ({cores} cores)" if cores else "")
    gpus = env.get("gpu") or []
    return text + (f", {', '.join(gpus)}" if gpus else "")


def provenance_line(record: report.RunRecord) -> str:
    env = record.env
    git = env.get("git") or {}
    commit = git.get("commit")
    parts = [
        f"profile `{env.get('profile')}`",
        machine(env),
        (env.get("started") or "unknown date")[:10],
        f"commit `{commit[:7]}`{' (dirty)' if git.get('dirty') else ''}" if commit else "commit unknown",
    ]
    if env.get("wall_s") is not None:
        parts.append(f"{float(env['wall_s']):.0f} s")
    parts.append(f"run `{record.dir.name}`")
    return "Measured with " + " · ".join(parts) + "."


def verdict_md(verdict: Any) -> str:
    if not verdict:
        return ""
    if isinstance(verdict, dict):
        items = [f"**{k}**: {v if isinstance(v, str) else report.fmt(v)}" for k, v in verdict.items()]
    elif isinstance(verdict, list):
        items = [v if isinstance(v, str) else report.fmt(v) for v in verdict]
    else:
        return f"> **Verdict.** {verdict}\n"
    return "> **Verdict.**\n" + "".join(f"> - {item}\n" for item in items)


def goals_md(goals: Any) -> str:
    if not isinstance(goals, dict) or not goals:
        return ""
    lines = "".join(f"- {report.goal_text(goal, met)}\n" for goal, met in goals.items())
    legend = " (✓ met, ✗ not met)" if any(isinstance(met, bool) for met in goals.values()) else ""
    return f"**Goals**{legend}:\n\n" + lines


def numbers_md(question: report.Question, metrics: dict) -> str:
    numbers = key_numbers(question, metrics)
    if numbers:
        rows = "".join(f"| `{k}` | {_md(v)} |\n" for k, v in numbers)
        return "| metric | value |\n|---|---|\n" + rows
    tables = report.split_metrics(metrics)[1]
    if not tables:
        return "_This run logged no metrics._\n"
    key, rows = tables[0]
    columns: list[str] = []
    for row in rows:
        columns += [str(c) for c in row if str(c) not in columns]
    columns = columns[:MAX_COLUMNS]
    text = f"`{key}`:\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    text += "".join("| " + " | ".join(_md(row.get(c)) for c in columns) + " |\n" for row in rows[:MAX_ROWS])
    if len(rows) > MAX_ROWS:
        text += f"\n_… {len(rows) - MAX_ROWS} more rows in metrics.json._\n"
    return text


def finding_md(question: report.Question, record: report.RunRecord | None, figure_link: str | None,
               profile: str) -> str:
    """One notebook's finding as Markdown."""
    head = f"### {question.title}\n\n*{question.question}*\n\n"
    if record is None:
        return head + f"_No `{profile}`-profile run yet: `{report.run_command(question.name, profile)}`._\n"
    text = head
    if figure_link:
        stem = report.headline_stems(question, record.figures())[0]
        caption = record.captions.get(stem, "")
        text += f"![{stem.replace('_', ' ')}]({figure_link})\n\n" + (f"*{caption}*\n\n" if caption else "")
    for statement in (verdict_md(record.metrics.get("verdict")), goals_md(record.metrics.get("goals"))):
        text += statement + "\n" if statement else ""
    text += numbers_md(question, record.metrics) + "\n"
    return text + provenance_line(record) + "\n"


def render_findings(selected: dict[str, report.RunRecord | None], links: dict[str, str], profile: str) -> str:
    """The whole generated block (without the markers)."""
    intro = (f"<!-- Generated by `decodelab findings` (make findings) from the latest `{profile}`-profile runs; "
             "edits between the markers are overwritten. -->\n\n")
    return intro + "\n".join(
        finding_md(report.QUESTIONS[name], selected.get(name), links.get(name), profile) for name in report.QUESTIONS
    )


def replace_block(text: str, block: str, *, source: str = "README.md") -> str:
    """Put `block` between the START and END markers of `text`; ValueError when they are missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start or text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(
            f"{source} needs exactly one {START!r} line followed by one {END!r} line "
            f"(found {text.count(START)} start and {text.count(END)} end markers); "
            "add them where the Findings section goes"
        )
    return text[: start + len(START)] + "\n" + block.rstrip("\n") + "\n" + text[end:]


def figure_targets(selected: dict[str, report.RunRecord | None], docs_dir: Path) -> dict[str, tuple[Path, Path]]:
    """name -> (headline figure of its run, docs_dir/<name>.<png|svg> it is copied to)."""
    targets = {}
    for name, record in selected.items():
        figures = record.figures() if record is not None else {}
        stems = report.headline_stems(report.QUESTIONS[name], figures)
        if stems:
            source = figures[stems[0]]
            targets[name] = (source, docs_dir / f"{name}{source.suffix.lower()}")
    return targets


def update_readme(readme: str | Path, *, root: str | Path | None = None, profile: str = "cpu",
                  docs_dir: str | Path | None = None, check: bool = False) -> bool:
    """Regenerate the findings block of `readme`; return True when its text changed (or would, with check)."""
    readme = Path(readme)
    if not readme.is_file():
        raise ValueError(f"readme={str(readme)!r} does not exist")
    text = readme.read_text(encoding="utf-8")
    replace_block(text, "", source=str(readme))  # fail on missing markers before copying anything
    root = Path(root) if root is not None else runs.results_root()
    selected = {name: report.latest_ok(name, root=root, profile=profile) for name in report.QUESTIONS}
    docs_dir = Path(docs_dir) if docs_dir is not None else readme.parent / "docs" / "findings"
    targets = figure_targets(selected, docs_dir)
    if not check:
        for source, target in targets.values():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    links = {name: Path(os.path.relpath(target, readme.parent)).as_posix() for name, (_, target) in targets.items()}
    new = replace_block(text, render_findings(selected, links, profile), source=str(readme))
    changed = new != text
    if changed and not check:
        tmp = readme.with_name(readme.name + ".tmp")
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, readme)
    return changed


def main(argv: list[str] | None = None) -> int:
    """`decodelab findings [--readme README.md] [--profile cpu] [--results DIR] [--docs DIR] [--check]`."""
    parser = argparse.ArgumentParser(prog="decodelab findings", description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", default=str(runs.repo_root() / "README.md"))
    parser.add_argument("--profile", default="cpu", help="use the latest ok run of this profile (default cpu)")
    parser.add_argument("--results", default=None, help="results root (default $DECODELAB_RESULTS or results/)")
    parser.add_argument("--docs", default=None, help="where figures go (default <readme dir>/docs/findings)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the README is stale")
    args = parser.parse_args(argv)
    try:
        changed = update_readme(args.readme, root=args.results, profile=args.profile, docs_dir=args.docs,
                                check=args.check)
    except ValueError as error:
        parser.exit(2, f"decodelab findings: error: {error}\n")
    if args.check:
        print(f"{args.readme}: findings {'are stale' if changed else 'up to date'}")
        return 1 if changed else 0
    print(f"{args.readme}: findings {'updated' if changed else 'unchanged'}")
    return 0
