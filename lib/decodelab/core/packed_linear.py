"""bf16 linear layers on CPU through oneDNN with weights packed once, instead of on every call.

Why: `F.linear` on a bf16 CPU tensor hands oneDNN the weight in PyTorch's plain (N, K) layout, and oneDNN
reorders it into its blocked layout on every call; at decode shapes (a few rows, K = hidden size) that
reorder reads and writes the whole weight again, so bf16 paid more than it saved and decoded at ~1.3x
fp32 although a bf16 matrix-vector product moves half the bytes. Packing each weight once
(`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise` runs the same oneDNN kernel
(fp32 accumulation, output rounded to bf16) on the blocked copy: the outputs are bit-identical to
`F.linear` (tested), so greedy tokens still equal transformers' own bf16 forward.

A packed copy is derived data: it is rebuilt when the weight tensor changed (its version counter or its
storage), so in-place updates (training, `_identity_init`) are never served stale. Gradients never flow
through the packed path (it is only used under no_grad, for bf16 inputs on CPU).
"""
from __future__ import annotations

import torch


def bf16_packing_available(device: torch.device) -> bool:
    """Whether this machine runs oneDNN bf16 linear layers on `device` (CPU with AVX512-BF16 / AMX)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinears:
    """Per `nn.Linear` module: its oneDNN-packed bf16 weight, packed on first use and re-packed on change."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    def __call__(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> module(x) (..., N), bit-identical to it; packed when enabled and x is bf16 without grad."""
        weight = module.weight
        if not self.enabled or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or torch.is_grad_enabled():
            return module(x)
        stamp = (weight._version, weight.data_ptr())
        entry = self._packed.get(id(module))
        if entry is None or entry[0] != stamp:
            entry = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
            self._packed[id(module)] = entry
        return torch.ops.mkldnn._linear_pointwise(x, entry[1], module.bias, "none", [], "")
