"""Write data/arithmetic.jsonl: 50 word problems per difficulty level, seed 0.

The file is a frozen copy of `decodelab.workloads.tasks.make_arithmetic(50, seed=0, difficulty=level)` for
every level, so a reader can look at the problems without running anything; notebooks may also
generate problems on the fly (same function, same result).

    python data/make_arithmetic.py [--n 50] [--seed 0] [--out data/arithmetic.jsonl]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from decodelab.workloads.tasks import DIFFICULTIES, make_arithmetic, save_arithmetic


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="problems per difficulty level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("arithmetic.jsonl"))
    args = parser.parse_args(argv)
    problems = [p for level in DIFFICULTIES for p in make_arithmetic(args.n, seed=args.seed, difficulty=level)]
    path = save_arithmetic(problems, args.out)
    print(f"wrote {len(problems)} problems to {path}")
    return path


if __name__ == "__main__":
    main()
