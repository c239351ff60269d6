"""The row-invariant fp32 linear layer of `linear_kernel.c`, from Python: pack a weight once, multiply by it.

    packed = pack(weight)                # (N, K) fp32 -> panels, or None where the kernel cannot run here
    y = linear(x, packed, bias)          # x (..., K) fp32 -> (..., N), as x @ weight.T + bias

Each output element is summed over k in order with one fused multiply-add per k whatever the number of rows,
so a row's result never depends on the rows beside it (tested at M = 1..200); the errors are fp32's own
(another summation order than a BLAS, the same size). Where the kernel is unavailable (no C compiler, a CPU
without AVX-512) `pack` returns None and `core.packed_linear` keeps oneDNN, which is row-invariant too.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from decodelab.core import native


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel with its signatures declared, or None where it cannot run on this machine."""
    lib = native.load("linear_kernel")
    if lib is None or not lib.linear_kernel_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.packed_floats.argtypes, lib.packed_floats.restype = [i64, i64], i64
    lib.pack_weight.argtypes, lib.pack_weight.restype = [ptr, i64, i64, ptr], None
    lib.linear.argtypes, lib.linear.restype = [ptr, i64, i64, ptr, i64, ptr, ptr], None
    return lib


@dataclass(frozen=True)
class PackedWeight:
    """A weight (N, K) in the kernel's panel layout; `panels` owns the memory the kernel reads."""
    panels: torch.Tensor
    out_features: int
    in_features: int


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """weight (N, K) fp32 on CPU -> its packed copy, or None where the kernel cannot run here."""
    lib = kernel()
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    weight = weight.detach().contiguous()
    panels = torch.empty(lib.packed_floats(n, k), dtype=torch.float32)
    lib.pack_weight(weight.data_ptr(), n, k, panels.data_ptr())
    return PackedWeight(panels, n, k)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 -> x @ W.T + bias (..., N), W the packed weight; bias (N,) fp32 or None."""
    if x.shape[-1] != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"x is {x.dtype} with {x.shape[-1]} features; the packed weight takes torch.float32 "
                         f"with {weight.in_features}")
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], weight.out_features), dtype=torch.float32)
    rows = x.numel() // weight.in_features
    if rows:
        bias = None if bias is None else bias.float().contiguous()  # held until the kernel has read it
        kernel().linear(x.data_ptr(), rows, weight.in_features, weight.panels.data_ptr(), weight.out_features,
                        None if bias is None else bias.data_ptr(), out.data_ptr())
    return out
