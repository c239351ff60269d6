"""The README's decode-benchmark block, generated from one run's table: our engine vs HF `generate()`
per batch size, from a quickstart run (tables/throughput.csv) or a `decodelab bench decode` folder
(results/bench/decode-*/decode.csv + env.json). Written and checked by decodelab.suite.findings.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from decodelab.suite import answers, records, registry, report
from decodelab.suite.answers import NO_RUN, provenance_line, relative, run_line

BENCH_GLOB = "decode-*"


@dataclass
class BenchRun:
    """One decode benchmark: rows {batch, ours, hf, ratio, identical, rows} and where they came from."""

    source: str  # relative to the results root
    dir: Path
    env: dict
    params: dict
    rows: list[dict] = field(default_factory=list)
    command: str = ""
    date: str | None = None


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _identical(value: str, rows: Any) -> tuple[int, int]:
    """'3/4' or (3, 4) -> (3, 4)."""
    if "/" in str(value):
        same, total = str(value).split("/")
        return int(same), int(total)
    return int(float(value)), int(float(rows))


OPTIONAL = ("seconds", "seconds_max", "new_tokens", "repeats")  # per side, when the benchmark wrote them


def bench_rows(table: list[dict]) -> list[dict]:
    """throughput.csv / decode.csv, one row per batch and impl (or the older one row per batch, columns
    ours_tokens_per_s, hf_tokens_per_s, identical_rows "3/4", ratio) -> one dict per batch: ours, hf
    (tokens/s), ratio, identical (same, rows), and ours_seconds, hf_seconds_max, ... where recorded."""
    out: dict[int, dict] = {}
    for row in table:
        batch = int(float(row["batch"]))
        entry = out.setdefault(batch, {"batch": batch})
        if "impl" in row:
            impl = row["impl"]
            entry[impl] = float(row["tokens_per_s"])
            entry.update({f"{impl}_{k}": float(row[k]) for k in OPTIONAL if row.get(k) not in (None, "")})
            entry["identical"] = _identical(row["identical_rows"], row.get("rows"))
        else:
            entry.update(ours=float(row["ours_tokens_per_s"]), hf=float(row["hf_tokens_per_s"]),
                         identical=_identical(row["identical_rows"], row.get("rows")))
            entry.update({f"{impl}_{k}": float(row[f"{impl}_{k}"]) for impl in ("ours", "hf") for k in OPTIONAL
                          if row.get(f"{impl}_{k}") not in (None, "")})
            if row.get("ratio") not in (None, ""):
                entry["ratio"] = float(row["ratio"])
    for entry in out.values():
        entry.setdefault("ratio", entry["ours"] / entry["hf"])
    return [out[b] for b in sorted(out)]


def bench_from_quickstart(record: report.RunRecord, root: Path) -> BenchRun | None:
    table = record.dir / "tables" / "throughput.csv"
    if not table.is_file():
        return None
    return BenchRun(relative(record.dir, root), record.dir, record.env, record.params, bench_rows(_read_csv(table)),
                    registry.run_command("quickstart", record.env.get("profile") or "cpu"))


def bench_from_folder(path: Path, root: Path) -> BenchRun | None:
    """A `decodelab bench decode` folder: decode.csv + env.json (params under env["params"])."""
    if not (path / "decode.csv").is_file():
        return None
    env = records.read_json(path / "env.json", {}) or {}
    stamp = re.search(r"(\d{8})-(\d{6})", path.name)
    date = datetime.strptime(stamp.group(1), "%Y%m%d").date().isoformat() if stamp else None
    rows = bench_rows(_read_csv(path / "decode.csv"))
    return BenchRun(relative(path, root), path, env, env.get("params") or {}, rows, "decodelab bench decode",
                    env.get("started") or date)


def _when(bench: BenchRun) -> float:
    stamp = bench.env.get("started")
    if stamp:
        return datetime.fromisoformat(stamp).timestamp()
    found = re.search(r"(\d{8}-\d{6})", bench.dir.name)
    if found:
        return datetime.strptime(found.group(1), "%Y%m%d-%H%M%S").timestamp()
    return (bench.dir / "decode.csv").stat().st_mtime


def latest_bench(root: Path, profile: str) -> BenchRun | None:
    """The newest of: the latest ok quickstart run of `profile`, the latest results/bench/decode-* folder."""
    found = []
    record = report.latest_ok("quickstart", root=root, profile=profile)
    if record is not None:
        found.append(bench_from_quickstart(record, root))
    folders = sorted((root / "bench").glob(BENCH_GLOB)) if (root / "bench").is_dir() else []
    found += [bench_from_folder(folders[-1], root)] if folders else []
    found = [b for b in found if b is not None]
    return max(found, key=_when) if found else None


def load_bench(source: str, root: Path) -> BenchRun | None:
    """The bench run a block names ('quickstart/<id>' or 'bench/decode-...'); None when it is not here."""
    path = root / source
    if not path.is_dir():
        return None
    if source.startswith("bench/"):
        return bench_from_folder(path, root)
    return bench_from_quickstart(report.load(path), root)


def _rate(tokens_per_s: float) -> str:
    """Tokens/s with one decimal, or three significant digits below 10 (0.387, not 0.4)."""
    return f"{tokens_per_s:.1f}" if tokens_per_s >= 10 else f"{tokens_per_s:.3g}"


def render_bench(bench: BenchRun | None, profile: str) -> str:
    """The bench block (without the markers), generated from one run's table."""
    if bench is None:
        command = registry.run_command("quickstart", profile)
        return (f"{run_line('bench', NO_RUN)}\n_No decode benchmark yet: `{command}` "
                "or `decodelab bench decode`, then `make findings`._\n")
    spread = all("ours_seconds_max" in r and "hf_seconds_max" in r for r in bench.rows)
    counted = all("ours_new_tokens" in r and "hf_new_tokens" in r for r in bench.rows)
    head = ["batch", "ours tok/s", "HF generate tok/s", "ours / HF"]
    head += ["ours s (fastest-slowest)", "HF s (fastest-slowest)"] if spread else []
    head += ["new tokens (ours / HF)"] if counted else []
    lines = ["| " + " | ".join(head + ["identical greedy rows"]) + " |", "|" + "---|" * (len(head) + 1)]
    for r in bench.rows:
        cells = [str(r["batch"]), _rate(r["ours"]), _rate(r["hf"]), f"{r['ratio']:.2f}"]
        if spread:
            cells += [f"{r[f'{side}_seconds']:.2f}-{r[f'{side}_seconds_max']:.2f}" for side in ("ours", "hf")]
        if counted:
            cells.append(f"{r['ours_new_tokens']:.0f} / {r['hf_new_tokens']:.0f}")
        lines.append("| " + " | ".join(cells + [f"{r['identical'][0]}/{r['identical'][1]}"]) + " |")
    every = all(same == total for same, total in (r["identical"] for r in bench.rows))
    ratios = [r["ratio"] for r in bench.rows]
    state, load_text = answers.load_state(bench.env)
    new_tokens = bench.params.get("max_new_tokens")
    repeats = {r.get("ours_repeats") for r in bench.rows} - {None}
    intro = ("Greedy decoding of the same chat prompts on both sides, "
             + (f"{new_tokens} new tokens per row, " if new_tokens is not None else "")
             + (f"fastest of {min(repeats):.0f} interleaved calls per side, " if len(repeats) == 1 else "")
             + f"our engine vs `transformers` `generate()` on `{bench.params.get('model', 'unknown model')}`, "
             f"measured by `{bench.command}`."
             + (f" **{load_text}.**" if state == answers.LOADED else ""))
    summary = (f"Identical greedy tokens in every row: {'yes' if every else 'no'}. "
               f"ours / HF from {min(ratios):.2f} to {max(ratios):.2f} across batch sizes.") if ratios else ""
    return "\n".join([run_line("bench", bench.source), intro, "", *lines, "", summary, "",
                      provenance_line(bench.env, bench.source, bench.date)]) + "\n"
