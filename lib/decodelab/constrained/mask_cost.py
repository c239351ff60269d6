"""Notebook 04's experiment 4: what a mask costs per token, next to the model's own decode step.

Each schema's recorded output is replayed through every engine (`replay_mask_times`: identical grammar
states, paired timings); the overhead of B rows is (B * fill + one bitmask application) / one decode step
at B rows (`mask_overhead_summary`), judged on the mean fill (`overhead_goal`).
"""
from __future__ import annotations

import json

import numpy as np
import torch

from decodelab.common.goals import Goal, format_value
from decodelab.common.timing import best_time, timed
from decodelab.constrained.bitmask import allocate_bitmask, apply_bitmask
from decodelab.constrained.constraint import Constraint, UnsupportedConstraint
from decodelab.constrained.decode import validate_output
from decodelab.constrained.engines import MaskEngine
from decodelab.constrained.study import parse_json
from decodelab.core.engine import as_transformer, decode_step, prefill


def replay_mask_times(engine: MaskEngine, compiled, tokens: list[int], *, max_steps: int | None = None) -> list[float]:
    """Seconds to fill one row's mask at each prefix of `tokens` (a recorded output), accepting as it goes.

    Replaying the same token sequence through every engine gives paired timings on identical states.
    Stops early at max_steps (the naive engine takes ~0.1-0.4 s per step) or when a token is rejected.
    """
    matcher = engine.matcher(compiled)
    bitmask = allocate_bitmask(1, engine.vocab_size)
    out = []
    for token in tokens[: max_steps or len(tokens)]:
        out.append(timed(lambda: matcher.fill(bitmask, 0))[1])
        if not matcher.accept(token):
            break
    return out


def replay_outputs(items: list[dict], samples: dict, engines) -> dict[str, str]:
    """schema name -> the first masked output that validates, from the first engine (in `engines` order) with
    a valid output for it; samples: `validity_study`'s {(schema, engine): outputs}. Schemas without one are left
    out (nothing to replay)."""
    outputs = {}
    for item in items:
        for name in engines:
            sample = samples[(item["name"], name)]
            if sample["objects"]:
                outputs[item["name"]] = next(t for t in sample["texts"] if validate_output(item["constraint"], t))
                break
    return outputs


def decode_step_seconds(model, prompt: list[int], batch_size: int, *, steps: int = 8) -> list[float]:
    """Wall seconds of `steps` decode steps at `batch_size` rows of `prompt` (the reference for mask cost)."""
    tr = as_transformer(model)
    cache, logits = prefill(tr, [prompt] * batch_size, max_new_tokens=steps + 1)
    tokens = logits.argmax(-1)
    out = []
    for _ in range(steps):
        tokens, seconds = timed(lambda: decode_step(tr, cache, tokens).argmax(-1), tr.device)
        out.append(seconds)
    return out


def mask_cost_study(engines: dict[str, MaskEngine], items: list[dict], outputs: dict[str, str], tokenizer, *,
                    naive_steps: int = 3) -> list[dict]:
    """Experiment 4: replay each schema's recorded output through every engine, timing each mask fill.

    outputs: schema name -> one valid output text. Two trajectories per schema: that output tokenized
    (compact) and the same object re-serialized with indent=2 (whitespace-heavy; the constraint is
    recompiled with flexible whitespace), each ending in EOS. -> rows {engine, schema, trajectory, step, us}.
    """
    rows = []
    eos = next(iter(engines.values())).stop_token_ids[0]
    for item in items:
        text = outputs.get(item["name"])
        value = parse_json(text) if text else None
        if value is None:
            continue
        tokens = tokenizer(text, add_special_tokens=False).input_ids + [eos]
        indented = tokenizer(json.dumps(value, indent=2), add_special_tokens=False).input_ids + [eos]
        flexible = Constraint.json(item["constraint"].spec, name=item["name"], whitespace="flexible")
        for trajectory, constraint, seq in (("compact", item["constraint"], tokens), ("indented", flexible, indented)):
            for name, engine in engines.items():
                try:
                    compiled = engine.compile(constraint)
                except UnsupportedConstraint:
                    continue
                times = replay_mask_times(engine, compiled, seq, max_steps=naive_steps if name == "naive" else None)
                rows += [{"engine": name, "schema": item["name"], "trajectory": trajectory, "step": i, "us": t * 1e6}
                         for i, t in enumerate(times)]
    return rows


def mask_apply_seconds(vocab_size: int, batch_size: int, *, device="cpu", repeats: int = 20) -> float:
    """Fastest of `repeats` wall-second timings of applying a (B, W) bitmask to (B, V) float32 logits.

    The minimum, like the decode step it is added to in `mask_overhead_summary`: both are costs, and the
    fastest repeat is the one least disturbed by whatever else the machine runs.
    """
    device = torch.device(device)
    logits = torch.randn(batch_size, vocab_size, device=device)
    bitmask = allocate_bitmask(batch_size, vocab_size)
    return best_time(lambda: apply_bitmask(logits, bitmask), repeats, device)


def mask_overhead_summary(cost_rows: list[dict], step_seconds: dict[int, list[float]],
                          apply_seconds: dict[int, float]) -> list[dict]:
    """Mask fill time per token and its overhead on a decode step, per (engine, trajectory).

    cost_rows: `mask_cost_study` rows {engine, trajectory, us}; step_seconds: batch size B -> timed decode
    steps at B rows (`decode_step_seconds`); apply_seconds: B -> seconds to apply a (B, V) bitmask.
    -> rows {engine, trajectory, fills, p50_us, p99_us, mean_us, and for each B: overhead_b{B}_mean,
    overhead_b{B}_p50, overhead_b{B}_p99, step_b{B}_ms}, with

        overhead_b{B}_{stat} = (B * fill_{stat} + apply(B)) / step(B)

    B rows' masks are filled one after another on the CPU, one bitmask application covers the batch, and
    step(B) is the fastest timed decode step (the least disturbed measure of the model's cost, so the
    ratio errs high). Judge a goal on the mean: it is what a generation pays per token on average, while
    p50 hides the slow fills (a grammar state's first visit, free-text fields) that make up much of the total.
    """
    steps = {b: min(times) for b, times in step_seconds.items()}
    groups: dict[tuple[str, str], list[float]] = {}
    for r in cost_rows:
        groups.setdefault((r["engine"], r["trajectory"]), []).append(float(r["us"]))
    out = []
    for (engine, trajectory), us in groups.items():
        stats = {"mean": float(np.mean(us)), "p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99))}
        row = {"engine": engine, "trajectory": trajectory, "fills": len(us),
               **{f"{k}_us": v for k, v in stats.items()}}
        for b, step in steps.items():
            for k, v in stats.items():
                row[f"overhead_b{b}_{k}"] = (b * v * 1e-6 + apply_seconds[b]) / step
            row[f"step_b{b}_ms"] = step * 1e3
        out.append(row)
    return out


def naive_slowdown(cost_rows: list[dict], reference: str = "xgrammar", naive: str = "naive") -> float | None:
    """Mean naive fill time / mean `reference` fill time over the grammar states both engines timed.

    The naive engine times only the first `naive_steps` fills of each trajectory, so the reference is
    averaged over the same (schema, trajectory, step) states, never over all of its own fills.
    -> None when the two engines share no timed state (e.g. one of them was not run).
    """
    times: dict[str, dict[tuple, float]] = {naive: {}, reference: {}}
    for r in cost_rows:
        if r["engine"] in times:
            times[r["engine"]][(r["schema"], r["trajectory"], r["step"])] = float(r["us"])
    shared = sorted(set(times[naive]) & set(times[reference]))
    if not shared:
        return None
    ref = sum(times[reference][k] for k in shared)
    return sum(times[naive][k] for k in shared) / ref if ref > 0 else None


def overhead_of(summary_rows: list[dict], engine: str, batch_size: int, stat: str = "mean",
                trajectory: str = "compact") -> float | None:
    """One engine's mask overhead at `batch_size` from `mask_overhead_summary` rows (None: not measured)."""
    for row in summary_rows:
        if row["engine"] == engine and row["trajectory"] == trajectory:
            return row.get(f"overhead_b{batch_size}_{stat}")
    return None


def overhead_goal(summary_rows: list[dict], engine: str, batch_size: int, *, target: float,
                  trajectory: str = "compact"):
    """The goal "mask overhead <= target of a decode step", judged on the mean fill; p50 and p99 in the note."""
    spread = {s: overhead_of(summary_rows, engine, batch_size, s, trajectory) for s in ("p50", "p99")}
    note = ", ".join(f"{s} fill: {format_value(v, '%')}" for s, v in spread.items() if v is not None)
    label = f"{engine} mask overhead per decode step at batch {batch_size} (mean fill, {trajectory} JSON)"
    value = overhead_of(summary_rows, engine, batch_size, "mean", trajectory)
    return Goal.check(f"mask_overhead_{engine}_b{batch_size}", value, "<=", target, unit="%", note=note, label=label)


def naive_slowdowns(cost_rows: list[dict], references) -> dict[str, float | None]:
    """{reference engine: `naive_slowdown` against it}."""
    return {e: naive_slowdown(cost_rows, reference=e) for e in references}


def mask_cost_metrics(overhead_rows: list[dict], step_seconds: dict[int, list[float]], slowdowns: dict,
                      engines) -> dict:
    """The run's mask-cost metrics: fill statistics per (engine, trajectory), overhead (mean / p50 / p99) per
    batch size and engine, the naive slowdown (against XGrammar, and against each engine), and the decode
    step's min / median / max in ms per batch size (step_seconds: `decode_step_seconds` per batch size)."""
    return {
        "mask_fill_us": [{k: r[k] for k in ("engine", "trajectory", "fills", "mean_us", "p50_us", "p99_us")}
                         for r in overhead_rows],
        **{f"mask_overhead_{s}": {f"b{b}": {e: overhead_of(overhead_rows, e, b, s) for e in engines}
                                  for b in step_seconds} for s in ("mean", "p50", "p99")},
        "naive_slowdown": slowdowns.get("xgrammar"), "naive_slowdown_vs": slowdowns,
        "decode_step_ms": {f"b{b}": {"min": min(t) * 1e3, "median": float(np.median(t)) * 1e3, "max": max(t) * 1e3}
                           for b, t in step_seconds.items()},
    }


def mask_cost_goals(overhead_rows: list[dict], slowdowns: dict, engines, batch_sizes, *,
                    overhead_target: float = 0.05, slowdown_target: float = 100) -> list[Goal]:
    """Goals: each engine's mean mask overhead <= overhead_target of a decode step at each batch size, and the
    naive check of every token >= slowdown_target times slower than XGrammar on the same states."""
    return [
        *[overhead_goal(overhead_rows, e, b, target=overhead_target) for e in engines for b in batch_sizes],
        Goal.check("naive_slowdown_vs_xgrammar", slowdowns.get("xgrammar"), ">=", slowdown_target, unit="x",
                   label="naive mask fill / XGrammar mask fill (mean over the same grammar states)"),
    ]
