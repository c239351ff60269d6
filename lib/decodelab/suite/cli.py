"""`decodelab` command line: run notebooks, list them, prepare the model, benchmark, report.

    decodelab run quickstart --profile smoke -p batch_sizes=[1,4]
    decodelab list
    decodelab list --names | --gpu-check
    decodelab list --runs [NAME]
    decodelab prepare
    decodelab bench decode [...]
    decodelab bench sample [...]
    decodelab report [...]
    decodelab findings [...]
    decodelab train-mtp [...]
"""
from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  decodelab run quickstart --profile smoke
  decodelab run speculation --profile cpu -p batch_sizes=[1,4] -p max_new_tokens=64
  decodelab list
  decodelab list --runs speculation
results go to results/<notebook>/<run-id>/ (or $DECODELAB_RESULTS)."""


def build_parser() -> argparse.ArgumentParser:
    from decodelab.suite import profiles, registry

    parser = argparse.ArgumentParser(
        prog="decodelab", description="Research notebooks on LLM decoding, run headlessly with papermill.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run", help="execute a notebook into results/<notebook>/<run-id>/",
        description="Execute a notebook with papermill. Values of -p are parsed as YAML; only names "
        "in the notebook's parameters cell are accepted (see `decodelab list`).",
    )
    run.add_argument("notebook", metavar="NOTEBOOK", help=f"runner name: {', '.join(registry.NOTEBOOKS)}")
    run.add_argument("--profile", default="cpu", metavar="PROFILE",
                     help=f"parameter profile: {', '.join(profiles.PROFILES)} (default: cpu)")
    run.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                     help="override one parameter, value in YAML (repeatable): -p batch_sizes=[1,3]")
    run.add_argument("--no-progress", action="store_true", help="hide papermill's cell progress bar")

    listing = sub.add_parser(
        "list", help="notebooks, their profiles and parameters with defaults; --runs: the runs and how each ended",
    )
    listing.add_argument("--runs", nargs="?", const="", default=None, metavar="NAME",
                         help="list the runs in results/ (of notebook NAME only, when given) with their status")
    listing.add_argument("--names", action="store_true",
                         help="only the runner names, one per line (for scripts: the Makefile's `make all`)")
    listing.add_argument("--gpu-check", action="store_true",
                         help="one line per notebook: NAME and its -p overrides for scripts/gpu_check.sh")
    sub.add_parser("prepare", help="convert the embedded model's weights once and print where they are")
    for name, text in (
        ("bench", "benchmarks: `decodelab bench decode --help`, `decodelab bench sample --help`"),
        ("report", "build results/report/index.html from the latest runs"),
        ("findings", "regenerate the README's Findings section from the latest cpu runs"),
        ("train-mtp", "train the retrofit MTP module on the frozen embedded model (resumable, cached): "
                      "`decodelab train-mtp --help`"),
    ):
        delegated = sub.add_parser(name, help=text, add_help=False)
        delegated.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv and argv[0] in DELEGATED:
        # Their own parsers own every argument after the command (options included, --help too).
        args = argparse.Namespace(command=argv[0], args=argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except ValueError as error:
        print(f"decodelab {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `decodelab list | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def cmd_run(args) -> int:
    from decodelab.suite import profiles, records, runner

    overrides = profiles.parse_overrides(args.param)
    try:
        runner.execute(args.notebook, args.profile, overrides, progress=not args.no_progress)
    except runner.RunFailed as failure:
        print(f"decodelab run: FAILED {failure}", file=sys.stderr)
        return 1
    except runner.RunInterrupted as stop:
        where = f"in {records.describe_cell(stop.last_cell)}" if stop.last_cell else "before the first cell"
        kept = (f"the run directory keeps what it wrote: {stop.run_dir}" if stop.run_dir
                else "no run directory had been made yet")
        print(f"decodelab run: interrupted by {stop.signal_name} {where}; {kept}", file=sys.stderr)
        return stop.exit_code
    return 0


def cmd_list(args) -> int:
    import shlex

    from decodelab.suite import profiles, records, registry

    if getattr(args, "runs", None) is not None:
        return list_runs(args.runs or None)
    if getattr(args, "names", False):
        print("\n".join(registry.NOTEBOOKS))
        return 0
    if getattr(args, "gpu_check", False):
        for name, notebook in registry.NOTEBOOKS.items():
            print(shlex.join([name, *(word for item in notebook.gpu_check for word in ("-p", item))]))
        return 0
    for name, notebook in registry.NOTEBOOKS.items():
        file = notebook.file
        path = records.notebooks_dir() / file
        if not path.exists():
            print(f"{name}  ({file}: not written yet)\n")
            continue
        available = profiles.available_profiles(records.params_dir(name))
        print(f"{name}  ({file})  profiles: {', '.join(available) or 'none'}")
        try:
            declared = records.parameters(name)
        except ValueError as error:
            print(f"    cannot read parameters: {error}\n")
            continue
        width = max((len(p) for p in declared), default=0)
        for param in declared.values():
            help_text = "  ".join(filter(None, (param.help, f"({param.allowed_text})" if param.checks else "")))
            note = f"  # {help_text}" if help_text else ""
            print(f"    {param.name:<{width}} = {param.display}{note}")
        print()
    return 0


def list_runs(name: str | None = None) -> int:
    """`decodelab list --runs [NAME]`: every run folder, oldest first, with how it ended."""
    from decodelab.suite import provenance, records, registry

    root = records.results_root()
    known = registry.NOTEBOOKS
    if name is not None and name not in known and not (root / name).is_dir():
        raise ValueError(
            f"notebook={name!r} has no runs in {root} and is not registered; allowed: {sorted(known)}"
        )
    names = [name] if name is not None else sorted(
        {*known, *(p.name for p in root.iterdir() if p.is_dir())} if root.is_dir() else set(known)
    )
    print(f"runs in {root}")
    found = 0
    for each in names:
        paths = records.list_runs(each, root=root)
        if not paths:
            if name is not None:
                print(f"{each}: no runs")
            continue
        print(f"{each}:")
        for path in paths:
            env = records.read_json(path / "env.json", {})
            found += 1
            wall = env.get("wall_s")
            print("  " + "  ".join(filter(None, (
                f"{path.name:<30}", f"{records.effective_status(env):<26}", f"{env.get('profile') or '-':<6}",
                env.get("started") or "", f"{wall:.1f} s" if isinstance(wall, (int, float)) else "",
                _load_note(env, provenance), _end_note(env, records),
            ))))
    if not found and name is None:
        print("  (none)")
    return 0


def _load_note(env: dict, provenance) -> str:
    load = env.get("load") or {}
    if load.get("peak_1min") is None:
        return ""
    note = f"load peak {load['peak_1min']:g} on {load.get('cores')} cores"
    return note + " (loaded: timings not comparable)" if provenance.is_loaded(env) else note


def _end_note(env: dict, records) -> str:
    status = env.get("status")
    if status == records.STATUS_INTERRUPTED:
        signal_name = (env.get("interrupted") or {}).get("signal") or "a signal"
        return f"by {signal_name} in {records.describe_cell(env.get('last_cell'))}"
    if status == records.STATUS_FAILED:
        error = env.get("error") or {}
        what = error.get("kind") or "failed"
        detail = f": {error.get('ename')}: {error.get('evalue')}" if error.get("ename") else ""
        where = f" in {records.describe_cell(env['last_cell'])}" if env.get("last_cell") else ""
        return f"{what}{where}{detail}"[:200]
    return ""


def cmd_prepare(args) -> int:
    from decodelab.core import models

    path = models.embedded_model_dir()
    print(f"embedded model {models.DEFAULT_MODEL!r}: {path}")
    return 0


def cmd_bench(args) -> int:
    from decodelab.suite import bench_cli

    return bench_cli.main(args.args) or 0


def cmd_report(args) -> int:
    from decodelab.suite import report

    return report.main(args.args) or 0


def cmd_findings(args) -> int:
    from decodelab.suite import findings

    return findings.main(args.args) or 0


TRAIN_MTP_ENTRY = "decodelab.mtp.shipped"  # named, not imported: suite imports no question package


def cmd_train_mtp(args) -> int:
    import importlib

    return importlib.import_module(TRAIN_MTP_ENTRY).main(args.args) or 0


DELEGATED = ("bench", "report", "findings", "train-mtp")
COMMANDS = {
    "run": cmd_run, "list": cmd_list, "prepare": cmd_prepare,
    "bench": cmd_bench, "report": cmd_report, "findings": cmd_findings, "train-mtp": cmd_train_mtp,
}
