"""The bf16 linear layer of `amx_kernel.c`, from Python: pack a weight once, multiply by it.

    packed = pack(weight)                # (N, K) bf16 -> AMX tiles, or None where the kernel cannot run here
    y = linear(x, packed)                # x (..., K) bf16 -> (..., N) bf16, as F.linear(x, weight)

The products are oneDNN's own (the same AMX instruction over the same k chunks in the same order), so the
outputs equal `F.linear`'s bit for bit (tested) and transformers' bf16 greedy tokens stay ours; a row's result
never depends on the rows beside it. The kernel saves oneDNN's fixed cost per call and prefetches the weight
stream. Where it cannot run (no C compiler, no AMX-BF16, K not a multiple of 32, a bias) `pack` returns None
and `core.packed_linear` keeps oneDNN.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from decodelab.core import native

CHUNK = 32  # k values per AMX dot-product instruction: K must be a multiple


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel with its signatures declared, or None where it cannot run on this machine."""
    lib = native.load("amx_kernel")
    if lib is None or not lib.amx_supported():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_packed_elems.argtypes, lib.amx_packed_elems.restype = [i64, i64], i64
    lib.amx_pack.argtypes, lib.amx_pack.restype = [ptr, i64, i64, ptr], None
    lib.amx_linear.argtypes, lib.amx_linear.restype = [ptr, i64, i64, ptr, i64, ptr], None
    return lib


@dataclass(frozen=True)
class PackedBF16:
    """A bf16 weight (N, K) in the kernel's tile layout; `tiles` owns the memory the kernel reads."""
    tiles: torch.Tensor
    out_features: int
    in_features: int


def pack(weight: torch.Tensor) -> PackedBF16 | None:
    """weight (N, K) bf16 on CPU -> its packed copy, or None where the kernel cannot run here."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    lib = kernel() if k % CHUNK == 0 else None
    if lib is None:
        return None
    weight = weight.detach().contiguous()
    tiles = torch.empty(lib.amx_packed_elems(n, k), dtype=torch.bfloat16)
    lib.amx_pack(weight.data_ptr(), n, k, tiles.data_ptr())
    return PackedBF16(tiles, n, k)


def linear(x: torch.Tensor, weight: PackedBF16) -> torch.Tensor:
    """x (..., K) bf16 -> x @ W.T (..., N) bf16, W the packed weight."""
    if x.shape[-1] != weight.in_features or x.dtype != torch.bfloat16:
        raise ValueError(f"x is {x.dtype} with {x.shape[-1]} features; the packed weight takes torch.bfloat16 "
                         f"with {weight.in_features}")
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], weight.out_features), dtype=torch.bfloat16)
    rows = x.numel() // weight.in_features
    if rows:
        kernel().amx_linear(x.data_ptr(), rows, weight.in_features, weight.tiles.data_ptr(), weight.out_features,
                            out.data_ptr())
    return out
