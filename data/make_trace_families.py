"""Write data/trace_families.jsonl: the query stream of notebook 06 (trace reuse), seed 0.

A frozen copy of `decodelab.workloads.families.make_stream(n, seed=seed)`: families of templated problems
(one-step additions with operands <= 20, two- and three-step word problems, unit conversions, running totals)
interleaved in arrival order, each with
its computable answer and its aligned values, so a reader can look at the problems without running anything.

    python data/make_trace_families.py [--n 240] [--seed 0] [--out data/trace_families.jsonl]
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from decodelab.workloads.families import make_stream, save_stream


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=240, help="problems in the stream, all families together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("trace_families.jsonl"))
    args = parser.parse_args(argv)
    problems = make_stream(args.n, seed=args.seed)
    path = save_stream(problems, args.out)
    print(f"wrote {len(problems)} problems to {path}: {dict(Counter(p.family for p in problems))}")
    return path


if __name__ == "__main__":
    main()
