"""Verify widths: run a T-token verify forward at the cheapest measured width W >= T, so cost is monotone in T.

Why: on CPU one forward of T tokens per row is not monotone in T (measured at batch 1, context 256:
T=1 58 ms, 2: 88, 3: 106, 4: 81 ms): oneDNN/MKL pick different kernels for different row counts of
`x (B*T, E) @ W.T`. Padding the T tokens of each row with W - T scratch tokens computes the same
real positions: every new query attends causally, so position t < T never sees a padded position
(those sit after it), the padded keys/values land past the row's length (scratch, overwritten by the
next write), and only the first T positions reach the LM head. The padded forward therefore returns
the real positions' logits, up to the summation order of a matmul with more rows, and leaves the
cache's valid entries and lengths exactly as the unpadded forward does (tested).

The width table {T: W} comes from a per-machine calibration (`decodelab.quickstart.verify_widths`)
stored as JSON under the model cache dir (and with runs); `cheapest_widths` turns measured costs into it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from decodelab.core.kv_cache import KVCache
from decodelab.core.machine import cpu_model

PAD_MARGIN = 0.05  # pad only when the wider forward is >= 5% cheaper: smaller gaps are timing noise


def cheapest_widths(costs: dict[int, float], margin: float = PAD_MARGIN) -> dict[int, int]:
    """Measured cost per width {T: seconds} -> {T: W}: W the smallest width >= T whose cost is within `margin` of
    the cheapest width >= T, kept only when cost(W) < (1 - margin) * cost(T), else T itself.

    Widths within the margin of the cheapest are alike up to timing noise, so the smallest of them is taken:
    fewer padded positions, and the choice does not follow noise (measured here: T = 3 padded past width 4 to
    width 5 because width 5's fastest call was 1% below width 4's, while T = 4 stayed at width 4; the padded
    costs then dipped 5.5% from T = 3 to T = 4, as width 4 ran cheaper than width 5 in the paired rounds).
    With margin 0 this is the cheapest width >= T (ties: the smallest), whose cost, the suffix minimum, is
    non-decreasing in T. With a margin the padded cost is within (1 + margin) of that suffix minimum, or
    unpadded where padding would gain less than the margin."""
    widths = sorted(costs)
    if not widths or widths[0] < 1:
        raise ValueError(f"costs must map widths >= 1 to seconds; got widths {widths}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be in [0, 1)")
    table = {}
    for t in widths:
        later = [w for w in widths if w >= t]
        floor = min(costs[w] for w in later)
        near = min(w for w in later if costs[w] <= (1 + margin) * floor)
        table[t] = near if costs[near] < (1 - margin) * costs[t] else t
    return table


def padded_width(n_tokens: int, widths: dict[int, int] | None, cache) -> int:
    """The width to run T = n_tokens at: widths[T] when calibrated, the cache is a plain KVCache (causal per
    row; tree caches have their own masks) and every row has room for the padding; else T."""
    if not widths or n_tokens not in widths or type(cache) is not KVCache:
        return n_tokens
    width = widths[n_tokens]
    room = cache.max_len - int(cache.lengths.max())
    return width if n_tokens <= width <= room else n_tokens


def pad_tokens(tokens: torch.Tensor, width: int, fill: int = 0) -> torch.Tensor:
    """(B, T) -> (B, width) with `fill` in the scratch columns T..width-1."""
    batch, n_tokens = tokens.shape
    if width == n_tokens:
        return tokens
    pad = torch.full((batch, width - n_tokens), fill, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([tokens, pad], dim=1)


def machine_key(model_name: str, dtype: torch.dtype, batch: int) -> str:
    """What a width table depends on: the model, the dtype, the batch, this CPU and torch build, threads."""
    key = (f"{model_name}-{str(dtype).removeprefix('torch.')}-B{batch}-{cpu_model()}-t{torch.get_num_threads()}"
           f"-torch{torch.__version__}")
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", key)  # a file name on every OS: CPU models hold spaces, (R), @


def table_path(directory: Path, key: str) -> Path:
    return Path(directory) / "verify_widths" / f"{key}.json"


def save_table(path: Path, costs: dict[int, float], meta: dict) -> None:
    """Write measured costs, the derived width table and what they were measured on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"costs_s": {str(k): v for k, v in costs.items()},
              "widths": {str(k): v for k, v in cheapest_widths(costs).items()}, **meta}
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")


def load_table(path: Path) -> dict[int, int] | None:
    """The width table stored at `path`, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        return {int(k): int(v) for k, v in record["widths"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
