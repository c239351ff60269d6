"""Verify cost against the tokens per row T: measure it, derive the padded-width table, show before/after.

One verify forward of T tokens per row is timed at a fixed context (the cache rolled back after each
call, so every call sees the same context); the widths are timed interleaved (1, 2, ..., k, k, ..., 1)
and each keeps its fastest call. Whether a wider T ran cheaper is judged per round, T beside T + 1
(`paired_dips`). `core.verify_width.cheapest_widths` turns those costs (padding only
past a 5% noise margin) into the {T: W} table `verify_step(widths=...)` uses; it is stored once per
machine under the model cache dir.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from decodelab.common.timing import alternating_times
from decodelab.core.engine import prefill, verify_step
from decodelab.core.models import cache_dir
from decodelab.core.verify_width import cheapest_widths, load_table, machine_key, save_table, table_path


def check_widths_args(max_width: int, context: int, batch: int, repeats: int) -> None:
    for name, value, low in (("max_width", max_width, 1), ("context", context, 1), ("batch", batch, 1),
                             ("repeats", repeats, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def verify_times(model, max_width: int, *, context: int = 256, batch: int = 1, repeats: int = 5,
                 widths: dict[int, int] | None = None) -> dict[int, list[float]]:
    """{T: seconds of one verify forward of T tokens per row, one per round} for T = 1..max_width, the widths
    interleaved (`timing.alternating_times`: T and T + 1 run next to each other in every round).

    The context is `context` cached positions per row (token ids cycling through the vocabulary);
    widths: run each T through `verify_step(widths=...)` (the padded path) instead of at T itself."""
    check_widths_args(max_width, context, batch, repeats)
    tr = model.transformer if hasattr(model, "transformer") else model
    ids = [3 + (i % (tr.vocab_size - 3)) for i in range(context)]
    cache, _ = prefill(model, [ids] * batch, max_new_tokens=2 * max_width + 1)
    base = cache.lengths.clone()
    drafts = torch.arange(max_width, device=tr.device).repeat(batch, 1) + 5

    def call(n_tokens: int):
        def run():
            verify_step(model, cache, drafts[:, :n_tokens], widths=widths)
            cache.truncate(base)
        return run

    return alternating_times({t: call(t) for t in range(1, max_width + 1)}, repeats, tr.device)


def verify_costs(model, max_width: int, **options) -> dict[int, float]:
    """{T: fastest seconds of one verify forward of T tokens per row}: `verify_times`' fastest round per T."""
    return {t: min(seconds) for t, seconds in verify_times(model, max_width, **options).items()}


def paired_dips(times: dict[int, list[float]]) -> dict[int, float]:
    """{T: median over rounds of seconds(T) / seconds(T + 1) - 1} for every T but the largest (> 0: the wider
    T + 1 was cheaper). The two forwards of a pair run next to each other in each round, so a shift in the
    machine's speed between rounds lands on both; the fastest call of each T, by contrast, may come from
    different rounds (this shared host's speed moved ~30% within a minute: one width's fastest of 15 calls read
    33 to 48 ms from one measurement to the next), and their ratio then measures the machine, not the widths."""
    ts = sorted(times)
    return {t: float(np.median(np.asarray(times[t], dtype=float) / np.asarray(times[u], dtype=float))) - 1.0
            for t, u in zip(ts, ts[1:])}


def calibrated_widths(model, *, name: str, max_width: int = 9, context: int = 256, batch: int = 1,
                      repeats: int = 5, directory: Path | None = None, refresh: bool = False) -> tuple[dict, Path]:
    """This machine's {T: W} table for `model` (loaded from the cache dir, measured and stored if absent)
    -> (widths, path of the stored JSON, to copy into a run)."""
    tr = model.transformer if hasattr(model, "transformer") else model
    path = table_path(directory or cache_dir(), machine_key(name, tr.dtype, batch))
    widths = None if refresh else load_table(path)
    if widths is None or max(widths) < max_width:
        costs = verify_costs(model, max_width, context=context, batch=batch, repeats=repeats)
        save_table(path, costs, {"model": name, "dtype": str(tr.dtype), "batch": batch, "context": context,
                                 "repeats": repeats, "threads": torch.get_num_threads()})
        widths = cheapest_widths(costs)
    return widths, path


def before_after_table(model, max_width: int, *, context: int = 256, batch: int = 1, repeats: int = 5) -> list[dict]:
    """Per T: the plain verify cost, the width it pads to, and the padded cost (measured again, padded):
    rows {tokens, plain_ms, width, padded_ms, padded_dip}. ms columns: the fastest round; padded_dip: how much
    cheaper T + 1 ran than T padded, paired by round (`paired_dips`; None for the largest T). The padded
    column is monotone up to timing noise."""
    plain = verify_costs(model, max_width, context=context, batch=batch, repeats=repeats)
    widths = cheapest_widths(plain)
    padded_times = verify_times(model, max_width, context=context, batch=batch, repeats=repeats, widths=widths)
    dips = paired_dips(padded_times)
    return [dict(tokens=t, plain_ms=plain[t] * 1e3, width=widths[t], padded_ms=min(padded_times[t]) * 1e3,
                 padded_dip=dips.get(t)) for t in plain]


def worst_dip(rows: list[dict]) -> float:
    """The largest paired dip of `before_after_table`'s rows, 0 when no wider T ran cheaper."""
    return max([0.0] + [r["padded_dip"] for r in rows if r["padded_dip"] is not None])


def worst_dip_of_minima(rows: list[dict]) -> float:
    """The largest relative drop between consecutive rows' fastest padded calls (`padded_ms`), 0 when none:
    the unpaired reading `worst_dip` replaces, kept as a metric beside it."""
    padded = [r["padded_ms"] for r in rows]
    return max([0.0] + [(a - b) / b for a, b in zip(padded, padded[1:])])


def markdown_widths(rows: list[dict]) -> str:
    lines = ["| tokens per row T | verify ms (T as is) | runs at width | verify ms (padded) "
             "| T + 1 cheaper by (paired rounds, median) |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['plain_ms']:.1f} | {r['width']} | {r['padded_ms']:.1f} | "
              + ("" if r.get("padded_dip") is None else f"{r['padded_dip']:.1%}") + " |" for r in rows]
    return "\n".join(lines)
