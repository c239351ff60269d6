"""The C RMSNorm equals torch's ops bit for bit (the sum in ATen's order), and steps aside where it cannot."""
import pytest
import torch

from decodelab.core import native_norm


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (16, 4, 576), (70, 576), (3, 100), (2, 5, 3584), (4, 9)])
def test_kernel_equals_torch_bit_for_bit(dtype, shape):
    if native_norm.kernel() is None:
        pytest.skip("no C compiler here: torch runs the norm")
    g = torch.Generator().manual_seed(sum(shape))
    width = shape[-1]
    assert native_norm.lanes_for(dtype, width, 1e-5) is not None  # this torch build's sum order is reproduced
    weight = (1 + 0.3 * torch.randn(width, generator=g)).to(dtype)
    for scale in (1e-4, 1.0, 300.0):
        x = (torch.randn(*shape, generator=g) * scale).to(dtype)
        got = native_norm.rms_norm(weight, x, 1e-5)
        assert got is not None and got.shape == x.shape and got.dtype == dtype
        assert torch.equal(_bits(got), _bits(native_norm.reference(weight, x, 1e-5)))


def test_kernel_steps_aside_where_it_does_not_apply():
    weight = torch.ones(8)
    assert native_norm.rms_norm(weight.half(), torch.randn(2, 8).half(), 1e-5) is None  # another dtype
    assert native_norm.rms_norm(weight.bfloat16(), torch.randn(2, 8), 1e-5) is None  # weight and x differ
    assert native_norm.rms_norm(torch.ones(4), torch.randn(2, 8), 1e-5) is None  # weight of another width
    assert native_norm.rms_norm(weight, torch.randn(8, 2).T, 1e-5) is None  # torch sums a strided row otherwise
    with torch.enable_grad():  # autograd recording: torch's ops keep the graph
        assert native_norm.rms_norm(weight.requires_grad_(), torch.randn(2, 8), 1e-5) is None


def test_a_width_whose_sum_order_is_not_reproduced_is_left_to_torch(monkeypatch):
    # fp32 rows narrower than one vector are summed by another path of ATen's: the probe finds no lane width
    if native_norm.kernel() is None:
        pytest.skip("no C compiler here: torch runs the norm")
    monkeypatch.setattr(native_norm, "LANE_CANDIDATES", (3,))  # a width this torch build does not use
    native_norm.lanes_for.cache_clear()
    try:
        assert native_norm.lanes_for(torch.float32, 576, 1e-5) is None
        assert native_norm.rms_norm(torch.ones(576), torch.randn(2, 576), 1e-5) is None
    finally:
        native_norm.lanes_for.cache_clear()
