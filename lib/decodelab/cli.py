"""`decodelab` command line: run notebooks, list them, prepare the model, benchmark, report.

    decodelab run quickstart --profile smoke -p batch_sizes=[1,4]
    decodelab list
    decodelab prepare
    decodelab bench decode [...]
    decodelab report [...]
    decodelab findings [...]
"""
from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  decodelab run quickstart --profile smoke
  decodelab run speculation --profile cpu -p batch_sizes=[1,4] -p max_new_tokens=64
  decodelab list
results go to results/<notebook>/<run-id>/ (or $DECODELAB_RESULTS)."""


def build_parser() -> argparse.ArgumentParser:
    from decodelab import profiles, runs

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
    run.add_argument("notebook", metavar="NOTEBOOK", help=f"runner name: {', '.join(runs.NOTEBOOKS)}")
    run.add_argument("--profile", default="cpu", metavar="PROFILE",
                     help=f"parameter profile: {', '.join(profiles.PROFILES)} (default: cpu)")
    run.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                     help="override one parameter, value in YAML (repeatable): -p batch_sizes=[1,3]")
    run.add_argument("--no-progress", action="store_true", help="hide papermill's cell progress bar")

    sub.add_parser("list", help="notebooks, their profiles and parameters with defaults")
    sub.add_parser("prepare", help="convert the embedded model's weights once and print where they are")
    for name, text in (
        ("bench", "benchmarks: `decodelab bench decode --help`"),
        ("report", "build results/report/index.html from the latest runs"),
        ("findings", "regenerate the README's Findings section from the latest cpu runs"),
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


def cmd_run(args) -> int:
    from decodelab import profiles, runs

    overrides = profiles.parse_overrides(args.param)
    try:
        runs.execute(args.notebook, args.profile, overrides, progress=not args.no_progress)
    except runs.RunFailed as failure:
        print(f"decodelab run: FAILED {failure}", file=sys.stderr)
        return 1
    return 0


def cmd_list(args) -> int:
    from decodelab import profiles, runs

    for name, file in runs.NOTEBOOKS.items():
        path = runs.notebooks_dir() / file
        if not path.exists():
            print(f"{name}  ({file}: not written yet)\n")
            continue
        available = profiles.available_profiles(runs.params_dir(name))
        print(f"{name}  ({file})  profiles: {', '.join(available) or 'none'}")
        try:
            declared = runs.parameters(name)
        except ValueError as error:
            print(f"    cannot read parameters: {error}\n")
            continue
        width = max((len(p) for p in declared), default=0)
        for param in declared.values():
            note = f"  # {param.help}" if param.help else ""
            print(f"    {param.name:<{width}} = {param.display}{note}")
        print()
    return 0


def cmd_prepare(args) -> int:
    from decodelab import models

    path = models.embedded_model_dir()
    print(f"embedded model {models.DEFAULT_MODEL!r}: {path}")
    return 0


def cmd_bench(args) -> int:
    from decodelab import bench

    return bench.main(args.args) or 0


def cmd_report(args) -> int:
    from decodelab import report

    return report.main(args.args) or 0


def cmd_findings(args) -> int:
    from decodelab import report

    return report.findings_main(args.args) or 0


DELEGATED = ("bench", "report", "findings")
COMMANDS = {
    "run": cmd_run, "list": cmd_list, "prepare": cmd_prepare,
    "bench": cmd_bench, "report": cmd_report, "findings": cmd_findings,
}
