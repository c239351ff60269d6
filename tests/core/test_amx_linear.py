"""The bf16 AMX linear kernel: bit for bit oneDNN's (and so transformers') products row by row, whatever the
number of rows or threads; oneDNN itself still right after it ran; it steps aside where it cannot apply."""
import pytest
import torch

from decodelab.core import amx_linear
from decodelab.core.packed_linear import PackedLinears

pytestmark = pytest.mark.skipif(amx_linear.kernel() is None, reason="no AMX-BF16 (or no C compiler) here")


def _weight(n, k, seed=0):
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def _rows_alone(x, w):
    return torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(len(x))])


@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (49152, 576), (100, 64), (1000, 96)])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
@torch.inference_mode()
def test_each_row_equals_f_linear_of_that_row_bit_for_bit(n, k, m):
    w = _weight(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    ours = amx_linear.linear(x, amx_linear.pack(w))
    assert torch.equal(ours.view(torch.int16), _rows_alone(x, w).view(torch.int16))
    if m <= 32:  # oneDNN keeps the one-row arithmetic up to 32 rows (it changes kernel above: not row-invariant)
        assert torch.equal(ours.view(torch.int16), torch.nn.functional.linear(x, w).view(torch.int16))


@torch.inference_mode()
def test_the_thread_count_does_not_change_a_bit_and_onednn_still_runs_after_it():
    w, x = _weight(1536, 576), torch.randn(5, 576).bfloat16()
    packed = amx_linear.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx_linear.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, amx_linear.linear(x, packed))
    onednn = torch.ops.mkldnn._reorder_linear_weight(w)  # oneDNN's own AMX products after ours released the tiles
    assert torch.equal(torch.ops.mkldnn._linear_pointwise(x[:1], onednn, None, "none", [], ""), one[:1])


def test_it_steps_aside_where_it_cannot_apply():
    assert amx_linear.pack(_weight(64, 48)) is None  # K not a multiple of 32
    assert amx_linear.pack(torch.randn(64, 64)) is None  # fp32
    with pytest.raises(ValueError, match="takes torch.bfloat16 with 64"):
        amx_linear.linear(torch.randn(2, 64), amx_linear.pack(_weight(8, 64)))
    plain, biased = torch.nn.Linear(64, 32, bias=False).bfloat16(), torch.nn.Linear(64, 32).bfloat16()
    linears = PackedLinears(enabled=True)
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(linears(plain, x), _rows_alone(x, plain.weight))
        assert torch.equal(linears(biased, x), biased(x))  # with a bias: oneDNN, which adds it before rounding
    amx = [entry[4] for entry in linears._packed.values()]
    assert sum(isinstance(a, amx_linear.PackedBF16) for a in amx) == 1 and None in amx
