"""Linear layers on CPU through weights packed once, instead of PyTorch's default path: our row-invariant
fp32 kernel (`core.native_linear`) in fp32, oneDNN in bf16 (and in fp32 where the kernel cannot run), with our
AMX kernel (`core.amx_linear`: oneDNN's own products without its fixed cost per call) for bf16 calls of up to
`AMX_ROWS` rows.

Why, in bf16: `F.linear` on a bf16 CPU tensor hands oneDNN the weight in PyTorch's plain (N, K) layout,
and oneDNN reorders it into its blocked layout on every call; at decode shapes (a few rows, K = hidden
size) that reorder reads and writes the whole weight again, so bf16 paid more than it saved. Packing each
weight once (`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise` runs the same oneDNN
kernel (fp32 accumulation, output rounded to bf16) on the blocked copy: the outputs are bit-identical to
`F.linear` (tested), so greedy tokens still equal transformers' own bf16 forward.

Why, in fp32: there `F.linear` goes to the BLAS (MKL), whose summation order changes with the number of
rows (M = 1 differs from M = 2..15 at K = 576), so a row's logits would depend on how many rows share the
step and speculative greedy decoding would drift from plain. Packed oneDNN is row-invariant but pays a fixed
cost per call that a decode step's ~120 small products feel: on the Intel Xeon host (issue 15), decode at
batch 1 took 38.5 ms a step packed, 32.9 ms with MKL, 35.2 ms in transformers. Our kernel sums every
output in k order whatever M is (row-invariant by construction, tested) and streams the weights as fast as
MKL at M = 1 (34.0 ms a step; batch 4 / 16 / 64: 43 / 70 / 190 ms against oneDNN's 50 / 78 / 191, quiet,
32 tokens with prefill). Its products are not bit-identical to MKL's (another summation order, errors of
the same fp32 size), so fp32 greedy equality with transformers is checked end to end (tests), not inherited.
Packing stays on for every batch: mixing paths by batch size would make a row's logits depend on its
batch and break the token-for-token equality of speculative and plain greedy decoding.

A packed copy is derived data: it is rebuilt when the weight tensor changed (its version counter or its
storage), so in-place updates (training, `_identity_init`) are never served stale. Gradients never flow
through the packed path (it is only used under no_grad). The copy doubles the resident weights.
"""
from __future__ import annotations

import torch

from decodelab.core import amx_linear, native_linear

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this machine runs oneDNN linear layers on `device` in `dtype` (CPU; bf16 needs AVX512-BF16 / AMX)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_packing_available(device: torch.device) -> bool:
    """Whether this machine runs oneDNN bf16 linear layers on `device` (CPU with AVX512-BF16 / AMX)."""
    return packing_available(device, torch.bfloat16)


class PackedLinears:
    """Per `nn.Linear` module: its oneDNN-packed weight, packed on first use and re-packed on change."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._packed: dict[tuple[torch.nn.Linear, ...], tuple] = {}  # modules -> (dtype, stamps, packed, bias)

    def _usable(self, module: torch.nn.Linear, x: torch.Tensor) -> bool:
        return (self.enabled and x.dtype in PACKED_DTYPES and module.weight.dtype == x.dtype
                and x.device.type == "cpu" and not torch.is_grad_enabled())

    def __call__(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> module(x) (..., N): through the packed weight when enabled, x is a CPU fp32/bf16 tensor
        of the weight's dtype and no gradient is recorded; else the module itself."""
        return self.group((module,), x)[0]

    def group(self, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (..., K) -> (module(x) for each module): one product on their weights packed side by side
        (q/k/v, gate/up), where each separate call would pay the fixed cost of a call again (oneDNN's ~20 us
        here, as much as a 576 x 576 bf16 product). Each output column is the same dot product over K either way:
        the results equal the separate calls bit for bit (tested); they are views into one output."""
        entry = self._entry(modules, x)
        if entry is None:
            return tuple(m(x) for m in modules)
        out = _product(entry, x)
        return out.split([m.out_features for m in modules], dim=-1) if len(modules) > 1 else (out,)

    def fused(self, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """`group`'s outputs side by side in one tensor (..., sum of N): packed, the one product itself; else
        the modules' outputs concatenated."""
        entry = self._entry(modules, x)
        if entry is None:
            outs = [m(x) for m in modules]
            return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return _product(entry, x)

    def _entry(self, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> tuple | None:
        """The packed entry for these modules and x, (re)packed when missing or stale; None where the packed
        path does not apply. A decode step asks ~120 times, so a hit checks only what can change between
        calls: x's dtype and device, grad mode, and each weight's (version, storage) stamp."""
        entry = self._packed.get(modules)
        if (entry is None or not self.enabled or x.dtype != entry[0] or x.device.type != "cpu"
                or torch.is_grad_enabled() or entry[1] != _stamps(modules)):
            if not all(self._usable(m, x) for m in modules):
                return None
            entry = self._pack(modules)
        return entry

    def _pack(self, modules: tuple[torch.nn.Linear, ...]) -> tuple:
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        bias = None
        if any(m.bias is not None for m in modules):  # a missing bias adds zeros: the same numbers
            bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in modules])
        packed = native_linear.pack(weight) if weight.dtype == torch.float32 else None
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        # bf16 up to AMX_ROWS rows: the AMX kernel, oneDNN's own products there (no bias: oneDNN adds it first)
        amx = amx_linear.pack(weight) if weight.dtype == torch.bfloat16 and bias is None else None
        entry = (weight.dtype, _stamps(modules), packed, bias, amx)
        self._packed[modules] = entry
        return entry


# oneDNN's bf16 products of up to 32 rows equal each row's product alone (its one-row AMX arithmetic, which our
# kernel reproduces bit for bit); from 33 rows it switches kernel and they do not (measured at every decode shape
# of the embedded model). So the AMX kernel takes exactly the calls where it gives oneDNN's numbers, and bf16 keeps
# oneDNN's behaviour everywhere: transformers' bf16 greedy tokens, and no row-invariance above 32 rows.
AMX_ROWS = 32


def _product(entry: tuple, x: torch.Tensor) -> torch.Tensor:
    """x (..., K) times an entry's packed weight (+ its bias): the fp32 kernel's panels or oneDNN's blocks."""
    if isinstance(entry[2], native_linear.PackedWeight):
        return native_linear.linear(x, entry[2], entry[3])
    if entry[4] is not None and x.numel() <= AMX_ROWS * x.shape[-1]:
        return amx_linear.linear(x, entry[4])
    return torch.ops.mkldnn._linear_pointwise(x, entry[2], entry[3], "none", [], "")


def _stamps(modules: tuple[torch.nn.Linear, ...]) -> tuple:
    """What changes when a weight does: its version counter (in-place updates) and storage (a new tensor).
    Read through `_parameters`, not the module's attribute lookup, which costs more than the check."""
    weights = [m._parameters["weight"] for m in modules]
    return tuple((w._version, w.data_ptr()) for w in weights)
