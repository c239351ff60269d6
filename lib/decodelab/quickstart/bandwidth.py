"""How close decoding runs to this machine's memory limit: a matvec bandwidth calibration and roofline points.

At batch 1 a decode step reads every weight once and does little else, so its floor is
    step_s >= weight_bytes / bandwidth,
with `bandwidth` the bytes/s this machine's matrix-vector product reaches on the model's largest
matrix (the LM head, V x E, far larger than the caches). So the fraction of the memory limit a decode
reaches is (weight_bytes / bandwidth) / measured step_s = weight_bytes * steps_per_s / bandwidth, where
steps_per_s = tokens_per_s / B. At larger B each step still reads the weights once but does B times
the arithmetic: the roofline point is (arithmetic intensity, attained FLOP/s) with
    intensity = 2 * n_params * B / weight_bytes  FLOP/byte,  attained = 2 * n_params * tokens_per_s,
and the memory roof at that intensity is bandwidth * intensity (the fraction shrinks once compute binds).
"""
from __future__ import annotations

import torch

from decodelab.common.timing import repeat_times


def weight_bytes(model) -> int:
    """Bytes of the distinct parameters a decode step reads (tied embeddings counted once)."""
    seen, total = set(), 0
    for param in model.hf_model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def n_params(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for param in model.hf_model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel()
    return total


def matvec_bandwidth(model, *, repeats: int = 10) -> dict:
    """Bytes/s of the LM head matvec `x (1, E) @ W.T` in the model's dtype, through the engine's own
    linear path (packed oneDNN in bf16): {bandwidth_Bps, matvec_s, matrix_bytes, dtype} (fastest call)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    tr = model.transformer
    head = tr.lm_head
    x = torch.randn(1, tr.hidden_size, generator=torch.Generator().manual_seed(0)).to(tr.device, tr.dtype)
    with torch.no_grad():
        seconds = min(repeat_times(lambda: tr.linear(head, x), repeats, tr.device, warmup=2))
    matrix = head.weight.numel() * head.weight.element_size()
    return {"bandwidth_Bps": matrix / seconds, "matvec_s": seconds, "matrix_bytes": matrix,
            "dtype": str(tr.dtype).removeprefix("torch.")}


def roofline_point(tokens_per_s: float, batch: int, *, weights: int, params: int, bandwidth: float) -> dict:
    """One decode measurement against the memory roof (see the module docstring for the algebra)."""
    steps_per_s = tokens_per_s / batch
    intensity = 2 * params * batch / weights
    return {"memory_fraction": weights * steps_per_s / bandwidth, "flop_per_byte": intensity,
            "attained_gflops": 2 * params * tokens_per_s / 1e9, "memory_roof_gflops": bandwidth * intensity / 1e9}


def add_roofline(table: list[dict], model, calibration: dict, impl: str = "ours") -> list[dict]:
    """Add `impl`'s roofline columns (memory_fraction, flop_per_byte, attained_gflops) to each ratio_table row."""
    weights, params = weight_bytes(model), n_params(model)
    for row in table:
        point = roofline_point(row[f"{impl}_tokens_per_s"], row["batch"], weights=weights, params=params,
                               bandwidth=calibration["bandwidth_Bps"])
        row.update({f"{impl}_{key}": value for key, value in point.items()})
    return table
