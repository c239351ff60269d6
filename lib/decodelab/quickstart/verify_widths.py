"""Verify cost against the tokens per row T: measure it, derive the padded-width table, show before/after.

One verify forward of T tokens per row is timed at a fixed context (the cache rolled back after each
call, so every call sees the same context); the widths are timed interleaved (1, 2, ..., k, k, ..., 1)
and each keeps its fastest call. `core.verify_width.cheapest_widths` turns those costs (padding only
past a 5% noise margin) into the {T: W} table `verify_step(widths=...)` uses; it is stored once per
machine under the model cache dir.
"""
from __future__ import annotations

from pathlib import Path

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


def verify_costs(model, max_width: int, *, context: int = 256, batch: int = 1, repeats: int = 5,
                 widths: dict[int, int] | None = None) -> dict[int, float]:
    """{T: fastest seconds of one verify forward of T tokens per row} for T = 1..max_width.

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

    times = alternating_times({t: call(t) for t in range(1, max_width + 1)}, repeats, tr.device)
    return {t: min(seconds) for t, seconds in times.items()}


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
    rows {tokens, plain_ms, width, padded_ms}. The padded column is monotone up to timing noise."""
    plain = verify_costs(model, max_width, context=context, batch=batch, repeats=repeats)
    widths = cheapest_widths(plain)
    padded = verify_costs(model, max_width, context=context, batch=batch, repeats=repeats, widths=widths)
    return [dict(tokens=t, plain_ms=plain[t] * 1e3, width=widths[t], padded_ms=padded[t] * 1e3) for t in plain]


def markdown_widths(rows: list[dict]) -> str:
    lines = ["| tokens per row T | verify ms (T as is) | runs at width | verify ms (padded) |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['plain_ms']:.1f} | {r['width']} | {r['padded_ms']:.1f} |" for r in rows]
    return "\n".join(lines)
