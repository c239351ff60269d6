"""Linear layers on CPU through oneDNN with weights packed once, instead of PyTorch's default path.

Why, in bf16: `F.linear` on a bf16 CPU tensor hands oneDNN the weight in PyTorch's plain (N, K) layout,
and oneDNN reorders it into its blocked layout on every call; at decode shapes (a few rows, K = hidden
size) that reorder reads and writes the whole weight again, so bf16 paid more than it saved. Packing each
weight once (`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise` runs the same oneDNN
kernel (fp32 accumulation, output rounded to bf16) on the blocked copy: the outputs are bit-identical to
`F.linear` (tested), so greedy tokens still equal transformers' own bf16 forward.

Why, in fp32: there `F.linear` goes to the BLAS (MKL), whose decode-shape paths are slow on this CPU
(measured quiet, x (M, 576) times the (49152, 576) LM head: MKL 10.4 / 17.8 / 23.0 / 50.2 ms at
M = 1 / 4 / 16 / 64, the packed oneDNN call 5.2 / 4.8 / 8.1 / 20.2 ms; the decoder layers' matrices gain
1.2-2x at M = 2-200). The packed fp32 product is not bit-identical to MKL's (another summation order, errors
of the same fp32 size), so fp32 greedy equality with transformers is checked end to end (tests), not
inherited. A row's result does not depend on how many rows share the call for K = 576 (checked at
M = 1..200), which MKL's does. The gain depends on the CPU: the figures above are an AMD EPYC host; on an
Intel Xeon host (issue 15, later session) MKL's M = 1 path is the faster one (decode step at batch 1:
packed 64 ms, MKL 55 ms; batch 4 and 16: packed 52 / 69 ms, MKL 63 / 77 ms; batch 64 equal), mostly
oneDNN's per-call overhead (~0.02 ms more per small linear, 7 per layer). Packing stays on for every
batch: mixing the two paths by batch size would make a row's logits depend on its batch and break
the token-for-token equality of speculative and plain greedy decoding.

A packed copy is derived data: it is rebuilt when the weight tensor changed (its version counter or its
storage), so in-place updates (training, `_identity_init`) are never served stale. Gradients never flow
through the packed path (it is only used under no_grad). The copy doubles the resident weights.
"""
from __future__ import annotations

import torch

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
        """x (..., K) -> (module(x) for each module): one oneDNN call on their weights packed side by side
        (q/k/v, gate/up), where each separate call would pay oneDNN's fixed cost (~20 us here, as much as
        a 576 x 576 bf16 product) again. Each output column is the same dot product over K either way:
        the results equal the separate calls bit for bit (tested); they are views into one output."""
        entry = self._entry(modules, x)
        if entry is None:
            return tuple(m(x) for m in modules)
        out = torch.ops.mkldnn._linear_pointwise(x, entry[2], entry[3], "none", [], "")
        return out.split([m.out_features for m in modules], dim=-1) if len(modules) > 1 else (out,)

    def fused(self, modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """`group`'s outputs side by side in one tensor (..., sum of N): packed, the one product itself; else
        the modules' outputs concatenated."""
        entry = self._entry(modules, x)
        if entry is None:
            outs = [m(x) for m in modules]
            return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], entry[3], "none", [], "")

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
        entry = (weight.dtype, _stamps(modules), torch.ops.mkldnn._reorder_linear_weight(weight), bias)
        self._packed[modules] = entry
        return entry


def _stamps(modules: tuple[torch.nn.Linear, ...]) -> tuple:
    """What changes when a weight does: its version counter (in-place updates) and storage (a new tensor).
    Read through `_parameters`, not the module's attribute lookup, which costs more than the check."""
    weights = [m._parameters["weight"] for m in modules]
    return tuple((w._version, w.data_ptr()) for w in weights)
