"""Token bitmasks, the format XGrammar and llguidance share: int32 (B, ceil(V / 32)), bit j of word w set
<=> token 32 * w + j allowed. Allocate, convert to and from (B, V) bool, and apply to logits."""
from __future__ import annotations

import torch


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask (B, ceil(V / 32))."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 -> (B, V) bool, True = allowed (bit j of word w is token 32 w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bool_to_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> (B, ceil(V / 32)) int32."""
    batch, vocab = allowed.shape
    padded = torch.zeros(batch, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    words = (padded.view(batch, -1, 32) * weights).sum(-1)
    # words are in [0, 2^32); reinterpret as int32 two's complement
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """(B, V) logits, (B, W) bitmask -> (B, V) logits with disallowed tokens at -inf (a new tensor).

    Model vocabularies may be padded beyond the tokenizer's (Qwen2.5: 151,936 vs 151,665): bits past the
    bitmask's end count as disallowed.
    """
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device)
    if vocab <= bitmask.shape[-1] * 32 and logits.dtype == torch.float32 and logits.is_contiguous():
        try:  # XGrammar's fused kernel (CPU / CUDA): same result, no (B, V) bool tensor
            import xgrammar as xgr

            out = logits.clone()
            xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab)
            return out
        except Exception:  # noqa: BLE001 - no kernel for this device/dtype: fall back to the torch path
            pass
    allowed = bitmask_to_bool(bitmask, min(vocab, bitmask.shape[-1] * 32))
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    return logits.masked_fill(~allowed, float("-inf"))
