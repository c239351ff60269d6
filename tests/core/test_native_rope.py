"""The C RoPE equals torch's ops bit for bit in fp32, and steps aside where it does not apply."""
import pytest
import torch

from decodelab.core import native_rope


def _bits(t):
    return t.contiguous().view(torch.int32)


def _qk_view(batch, n_new, heads, dim, dtype, g, scale):
    """q and k as the forward passes them: a (B, NH, T, D) transposed view into a wider q/k/v product."""
    qkv = (torch.randn(batch, n_new, heads + 3, dim, generator=g) * scale).to(dtype)
    return qkv[:, :, :heads].transpose(1, 2)


@pytest.mark.parametrize("shape", [(1, 1, 12, 64), (16, 1, 12, 64), (2, 5, 3, 128), (1, 300, 16, 64), (3, 2, 1, 2)])
def test_kernel_equals_torch_bit_for_bit(shape):
    dtype = torch.float32
    if native_rope.kernel() is None:
        pytest.skip("no C compiler here: torch runs RoPE")
    batch, n_new, heads, dim = shape
    g = torch.Generator().manual_seed(sum(shape))
    angles = torch.rand(batch, 1, n_new, dim, generator=g) * 8192  # far positions: every rounding case
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for scale in (1e-3, 1.0, 500.0):
        x = _qk_view(batch, n_new, heads, dim, dtype, g, scale)
        got = native_rope.rope(x, cos, sin)
        assert got is not None and got.shape == x.shape and got.dtype == dtype
        assert torch.equal(_bits(got), _bits(native_rope.reference(x, cos, sin)))


def test_kernel_steps_aside_where_it_does_not_apply():
    x, cos = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    assert native_rope.rope(x.half(), cos.half(), cos.half()) is None  # another dtype
    assert native_rope.rope(x.bfloat16(), cos.bfloat16(), cos.bfloat16()) is None  # bf16: torch's ops are faster
    assert native_rope.rope(x, cos.bfloat16(), cos.bfloat16()) is None  # mixed dtypes
    assert native_rope.rope(torch.randn(1, 2, 3, 7), torch.randn(1, 1, 3, 7), torch.randn(1, 1, 3, 7)) is None  # odd D
    assert native_rope.rope(torch.randn(1, 2, 8, 3).transpose(2, 3), cos, cos) is None  # D not contiguous
    assert native_rope.rope(x, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)) is None  # cos/sin broadcast over T
    with torch.enable_grad():  # autograd recording: torch's ops keep the graph
        assert native_rope.rope(x.requires_grad_(), cos, cos) is None


def test_a_kernel_the_probe_finds_unequal_is_left_to_torch(monkeypatch):
    if native_rope.kernel() is None:
        pytest.skip("no C compiler here: torch runs RoPE")
    real = native_rope._run
    monkeypatch.setattr(native_rope, "_run", lambda x, cos, sin: real(x, cos, sin) * 1.0001)
    native_rope.matches_torch.cache_clear()
    try:
        assert not native_rope.matches_torch()
        assert native_rope.rope(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)) is None
    finally:
        native_rope.matches_torch.cache_clear()
