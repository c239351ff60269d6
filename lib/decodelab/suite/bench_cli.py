"""`decodelab bench decode|sample`: the quickstart's decode and sampler benchmarks from the command line.

    decodelab bench decode                              # notebook 00's settings under the cpu profile
    decodelab bench decode --profile smoke              # ... under another profile
    decodelab bench decode --batch-sizes 1,4 --max-new-tokens 32 --repeats 2 --model smollm2-135m

The settings are not defined here: each default (batch sizes, new tokens, repeats, model) is notebook
00's parameters cell with the profile's deltas (notebooks/params/quickstart/<profile>.yaml) applied, so
`decodelab bench decode` measures what `decodelab run quickstart --profile cpu` measures. The
measurement is the registered module of the bench command (registry: "decodelab.quickstart.bench"),
imported by name: the suite never imports a question package.

Writes results/bench/decode-<stamp>-<rand>/ (or --out): decode.csv (one row per side and batch size),
decode.md (the ratio table) and env.json (versions, hardware, the settings, the machine's load).

    decodelab bench sample                              # B = 1, 16, 64; every filter; the profile's repeats
    decodelab bench sample --batch-sizes 1 --repeats 1  # a quick look

`sample` times `Sampler.sample` per filter next to the decode step of the same model and batch
(decodelab.quickstart.sampler_bench, imported by name like the registry's modules) and writes
results/bench/sample-<stamp>-<rand>/: sample.csv, sample.md (sampler ms, step ms, ratio) and env.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from decodelab.suite import profiles, records, registry

COMMAND = "decode"
SAMPLE = "sample"
SAMPLE_MODULE = "decodelab.quickstart.sampler_bench"  # named here until the registry records it
SAMPLE_BATCH_SIZES = [1, 16, 64]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def batch_size_list(text: str) -> list[int]:
    try:
        values = [int(b) for b in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated integers, each >= 1, e.g. 1,4,16,64")
    return values


def notebook_settings(name: str, profile: str) -> dict:
    """Every parameter of notebook `name` as a run with `profile` sees it: the parameters cell's defaults
    (non-literal ones evaluated, e.g. DEFAULT_MODEL -> "smollm2-135m") with the profile's values on top."""
    from decodelab.suite import runner

    _, injected, _ = runner.prepare(name, profile)  # checks the profile file against the parameters cell
    return {**profiles.evaluated_defaults(records.notebook_path(name)), **injected}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decodelab bench", description="Benchmarks of the decode engine.",
        epilog="Defaults: notebook 00's parameters under --profile (notebooks/params/quickstart/<profile>.yaml).",
    )
    parser.add_argument("what", choices=[COMMAND, SAMPLE],
                        help="decode: tokens/s of our engine vs transformers generate(); "
                             "sample: sampler time per filter next to the decode step time")
    parser.add_argument("--profile", default="cpu", choices=profiles.PROFILES,
                        help="the quickstart profile whose settings are the defaults (default: cpu)")
    parser.add_argument("--model", default=None, help="embedded name, local path or hub id (default: the profile's)")
    parser.add_argument("--batch-sizes", type=batch_size_list, default=None,
                        help="comma-separated, each >= 1 (default: the profile's batch_sizes; "
                             f"for sample {','.join(map(str, SAMPLE_BATCH_SIZES))})")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help="tokens per row, >= 1 (default: the profile's max_new_tokens; decode only)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed calls per side and batch size, interleaved, >= 1; the fastest is kept "
                             "(default: the profile's repeats)")
    parser.add_argument("--out", default=None, help="output folder (default results/bench/decode-<stamp>-<rand>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    record = registry.bench_record(COMMAND)  # notebook 00: its settings are both commands' defaults
    try:
        settings = notebook_settings(record.name, args.profile)
    except ValueError as error:
        parser.error(f"argument --profile: {error}")
    if args.what == SAMPLE and args.batch_sizes is None:
        args.batch_sizes = list(SAMPLE_BATCH_SIZES)
    for key in ("model", "batch_sizes", "max_new_tokens", "repeats"):
        if getattr(args, key) is None:
            setattr(args, key, settings[key])

    from decodelab.core import models
    from decodelab.suite import provenance

    try:  # the folder first: a bad results location fails before the model loads
        out = Path(args.out) if args.out else records.new_run_dir("bench", prefix=f"{args.what}-")
        out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as error:
        where = f"argument --out: {args.out!r}" if args.out else "the results folder ($DECODELAB_RESULTS or results/)"
        parser.error(f"{where} cannot hold the benchmark's folder ({error}); give a writable folder")
    try:
        model = models.load_model(args.model)
    except ValueError as error:
        if not args.out:
            out.rmdir()  # the fresh run folder is still empty: leave no trace of a run that never started
        parser.error(f"argument --model: {error}")
    load = provenance.LoadSampler().start()  # the machine's load while the sides are timed
    if args.what == SAMPLE:
        import importlib

        bench = importlib.import_module(SAMPLE_MODULE)
        rows = bench.sampler_cost(model, args.batch_sizes, repeats=args.repeats)
        markdown = bench.markdown_table(rows)
    else:
        bench = registry.bench_module(args.what)
        rows = bench.decode_throughput(model, args.batch_sizes, args.max_new_tokens, repeats=args.repeats)
        markdown = bench.markdown_table(bench.ratio_table(rows))
    import pandas as pd

    pd.DataFrame(rows).to_csv(out / f"{args.what}.csv", index=False)
    (out / f"{args.what}.md").write_text(markdown + "\n")
    env = provenance.collect_env(params={**vars(args), "model_device": str(model.device),
                                         "model_dtype": str(model.transformer.dtype)},
                                 load=load.stop())
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str))
    print(markdown)
    if env["load"]["loaded"]:
        print(f"\nloaded: 1-min load peaked at {env['load']['peak_1min']:.1f} on {env['load']['cores']} cores; "
              "timings not comparable")
    print(f"\nwritten to {out}")
    return 0
