"""RMSNorm in one C call (`norm_kernel.c`), bit for bit what `transformer.rms_norm` computes with torch's ops.

At decode shapes torch runs `F.rms_norm` on CPU as about ten ops (upcast, square, sum, divide, add, rsqrt,
multiply, cast) plus the weight's product, ~65 us a call for one 576-wide row: a bf16 batch-1 step of the
embedded model calls it 61 times, ~4 ms of a ~26 ms step. The kernel computes the same float32 values in the
same order, the sum in ATen's vectorized reduction order, whose vector width depends on the torch build: the
width is found once per (dtype, width, eps) by comparing the kernel with torch on a probe of random rows over
several scales, and the kernel is used only where one width reproduces torch bit for bit (else torch runs).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from decodelab.core import native

LANE_CANDIDATES = (8, 16, 4)  # vector widths (floats) ATen's CPU sum may use: AVX2, AVX-512, then a narrow build
PROBE_ROWS = 64


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel with its signatures declared, or None where no C compiler works here."""
    lib = native.load("norm_kernel")
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    for name in ("rms_norm_f32", "rms_norm_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ptr, ptr, ptr, i64, i64, f32, i64], ctypes.c_int
    return lib


def reference(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """What `transformer.rms_norm` computes with torch: the weight times torch's unweighted RMSNorm."""
    return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps)


def _run(x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
    out = torch.empty_like(x)
    width = x.shape[-1]
    fn = kernel().rms_norm_bf16 if x.dtype == torch.bfloat16 else kernel().rms_norm_f32
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, eps, lanes)
    return out


@functools.cache
def lanes_for(dtype: torch.dtype, width: int, eps: float) -> int | None:
    """The vector width with which the kernel equals torch bit for bit on a probe of PROBE_ROWS random rows
    (scales 1e-3 to 1e3, a weight near 1), or None: then torch keeps running the norm."""
    if kernel() is None:
        return None
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 3, PROBE_ROWS)[:, None]
    x = (torch.randn(PROBE_ROWS, width, generator=g) * scales).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    want = reference(weight, x, eps)
    for lanes in LANE_CANDIDATES:
        if torch.equal(_run(x, weight, eps, lanes).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)):
            return lanes
    return None


def rms_norm(weight: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`reference(weight, x, eps)` from the kernel, or None where it does not apply (not CPU, another dtype,
    a weight of another dtype or shape, x not contiguous (torch then sums in a strided order), autograd
    recording, or no lane width reproduced torch here)."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype
            or weight.shape != (x.shape[-1],) or x.numel() == 0 or not x.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    lanes = lanes_for(x.dtype, x.shape[-1], float(eps))
    if lanes is None:
        return None
    return _run(x, weight.contiguous(), eps, lanes)
