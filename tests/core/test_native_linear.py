"""The row-invariant fp32 linear kernel (`core.native_linear`, `linear_kernel.c`): a row's output never depends
on the rows beside it or on the thread count, the products are fp32-accurate, and `PackedLinears` falls back
to oneDNN where the kernel cannot run."""

import pytest
import torch

from decodelab.core import native_linear
from decodelab.core.packed_linear import PackedLinears

pytestmark = pytest.mark.skipif(native_linear.kernel() is None, reason="the kernel needs a C compiler and AVX-512")

# (N, K): panels cut short (N not a multiple of 32), one panel, a decode layer's shapes
SHAPES = [(70, 40), (16, 8), (96, 576), (33, 1536)]


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_rows_output_is_the_same_bits_whatever_rows_share_the_call(n, k):
    weight, bias = weights(n, k, seed=n + k)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(1))
    for b in (None, bias):
        packed = native_linear.pack(weight)
        full = native_linear.linear(x, packed, b)
        for rows in list(range(1, 30)) + [95, 96, 97, 131, 199]:  # every tile height, row blocks cut anywhere
            assert torch.equal(native_linear.linear(x[:rows], packed, b), full[:rows])
        for row in (0, 13, 96, 150):
            assert torch.equal(native_linear.linear(x[row:row + 1], packed, b), full[row:row + 1])


def test_products_are_fp32_accurate_and_shapes_follow_x():
    weight, bias = weights(96, 576, seed=3)
    x = torch.randn(2, 5, 576, generator=torch.Generator().manual_seed(4))
    out = native_linear.linear(x, native_linear.pack(weight), bias)
    assert out.shape == (2, 5, 96) and out.dtype == torch.float32
    exact = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    strided = x.transpose(0, 1)  # not contiguous: read as its values
    assert torch.equal(native_linear.linear(strided, native_linear.pack(weight), bias), out.transpose(0, 1))
    assert native_linear.linear(x[:0], native_linear.pack(weight)).shape == (0, 5, 96)


def test_the_thread_count_does_not_change_a_bit():
    weight, _ = weights(300, 576, seed=5)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(6))
    packed, threads = native_linear.pack(weight), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_linear.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, native_linear.linear(x, packed))


def test_pack_declines_what_the_kernel_does_not_take_and_a_wrong_width_is_a_clear_error():
    assert native_linear.pack(torch.zeros(4, 8, dtype=torch.bfloat16)) is None  # bf16 stays on oneDNN
    assert native_linear.pack(torch.zeros(8)) is None
    packed = native_linear.pack(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="x is torch.float32 with 7 features; the packed weight takes torch.float32 "
                                         "with 8"):
        native_linear.linear(torch.zeros(2, 7), packed)
    with pytest.raises(ValueError, match="x is torch.bfloat16 with 8 features"):
        native_linear.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed)


def test_packed_linears_use_the_kernel_for_fp32_and_onednn_where_it_is_unavailable(monkeypatch):
    layer = torch.nn.Linear(40, 24)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        linear = PackedLinears(True)
        ours = linear(layer, x)
        assert isinstance(linear._packed[(layer,)][2], native_linear.PackedWeight)
        monkeypatch.setattr(native_linear, "kernel", lambda: None)
        fallback = PackedLinears(True)
        onednn = fallback(layer, x)
        assert isinstance(fallback._packed[(layer,)][2], torch.Tensor)
        torch.testing.assert_close(ours, onednn, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, layer(x), rtol=1e-5, atol=1e-5)
