"""RoPE on a layer's float32 queries and keys in one C call (`rope_kernel.c`), bit for bit torch's ops.

`x * cos + rotate_half(x) * sin` runs on CPU as five ops (two products, a negation, a concatenation, a sum)
and their views. The kernel rounds each product and the sum as those ops do; it is used once a probe of random
values has shown it equal to torch bit for bit (else torch runs). Measured here, one call for the embedded
model's 12 q/k heads: 7.4 vs 10.1 us at batch 1, 31 vs 47 us at batch 64, 1.2 vs 3.4 ms for a 4096-token
prefill. bfloat16 stays with torch: a kernel written the same way (its conversions not vectorized by this
portable build) ran 2x slower than torch's ops beyond two rows and saved ~1 us a call at one.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from decodelab.core import native

PROBE_SHAPE = (2, 3, 5, 64)  # (B, T, heads, D) of the probe


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel with its signatures declared, or None where no C compiler works here."""
    lib = native.load("rope_kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rope_f32.argtypes, lib.rope_f32.restype = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64], ctypes.c_int
    return lib


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE with torch's ops: x (B, NH, T, D), cos/sin (B, 1, T, D) -> (B, NH, T, D)."""
    return x * cos + rotate_half(x) * sin


def _run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, NH, T, D) with D contiguous; cos/sin (B, 1, T, D) contiguous -> (B, NH, T, D), a view of a
    (B, T, NH, D) tensor (the layout torch's elementwise ops give a transposed view of the q/k product)."""
    batch, heads, n_new, dim = x.shape
    out = torch.empty(batch, n_new, heads, dim, dtype=x.dtype)
    sb, sh, st, _ = x.stride()
    kernel().rope_f32(x.data_ptr(), sb, st, sh, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                      batch, n_new, heads, dim)
    return out.transpose(1, 2)


@functools.cache
def matches_torch() -> bool:
    """Whether the kernel equals `reference` bit for bit on a probe of random float32 values (scales 1e-3 to 1e3,
    positions far apart), a transposed view as the forward passes it."""
    if kernel() is None:
        return False
    g = torch.Generator().manual_seed(0)
    batch, n_new, heads, dim = PROBE_SHAPE
    scales = torch.logspace(-3, 3, heads)[:, None]
    x = (torch.randn(batch, n_new, heads, dim, generator=g) * scales).transpose(1, 2)
    angles = torch.rand(batch, 1, n_new, dim, generator=g) * 4096
    cos, sin = angles.cos(), angles.sin()
    return torch.equal(_run(x, cos, sin).contiguous().view(torch.int32),
                       reference(x, cos, sin).contiguous().view(torch.int32))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`reference(x, cos, sin)` from the kernel, or None where it does not apply (not CPU, not all float32,
    shapes other than x (B, NH, T, D) with D contiguous and even, cos/sin (B, 1, T, D) contiguous, autograd
    recording, or the probe found the kernel unequal to torch here)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or cos.dtype != x.dtype
            or sin.dtype != x.dtype or x.dim() != 4 or x.shape[-1] % 2 or x.stride(-1) != 1 or x.numel() == 0):
        return None
    batch, _, n_new, dim = x.shape
    if (cos.shape != (batch, 1, n_new, dim) or sin.shape != cos.shape or not cos.is_contiguous()
            or not sin.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad))):
        return None
    return _run(x, cos, sin) if matches_torch() else None
