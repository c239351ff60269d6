"""The per-row KV cache and grouped-query attention over it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Preallocated per-row KV cache: keys/values (n_layers, B, K, S_max, D), lengths (B,).

    Row b's valid entries are positions [0, lengths[b]). Entries past a row's length are scratch:
    never attended, overwritten by the next write. So rollback is `crop` (set lengths) and costs nothing.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 *, dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._rows = torch.arange(batch_size, device=device)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def nbytes(self) -> int:
        """Bytes allocated for keys and values."""
        return self.keys.numel() * self.keys.element_size() * 2

    def used_nbytes(self) -> int:
        """Bytes of keys and values that hold valid positions (analytic KV size of the batch)."""
        per_position = self.keys.shape[0] * self.keys.shape[2] * self.keys.shape[4] * self.keys.element_size() * 2
        return int(self.lengths.sum().item()) * per_position

    def crop(self, new_lengths: torch.Tensor) -> None:
        """Set each row's length: (B,) long (kept while callers move to `advance` / `truncate`)."""
        self.lengths = new_lengths.to(self.lengths)

    def advance(self, n_new: torch.Tensor) -> None:
        """Count n_new (B,) freshly written positions of each row as valid."""
        self.lengths = self.lengths + n_new.to(self.lengths)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll rows back to new_lengths (B,) long, each <= the current length (rejected drafts cost nothing)."""
        new_lengths = new_lengths.to(self.lengths)
        if bool((new_lengths > self.lengths).any()):
            raise ValueError("truncate only rolls rows back; a new length exceeds the current one")
        self.lengths = new_lengths

    def select(self, rows: torch.Tensor | list[int]) -> "KVCache":
        """A new cache holding only `rows` (in that order); copies their entries."""
        rows = torch.as_tensor(rows, device=self.lengths.device, dtype=torch.long)
        out = KVCache.__new__(KVCache)
        out.keys = self.keys[:, rows].clone()
        out.values = self.values[:, rows].clone()
        out.lengths = self.lengths[rows].clone()
        out._rows = torch.arange(len(rows), device=rows.device)
        return out

    def positions(self, n_tokens: int) -> torch.Tensor:
        """Cache positions of the next `n_tokens` tokens of each row: (B, T)."""
        return self.lengths[:, None] + torch.arange(n_tokens, device=self.lengths.device)

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Called once per forward with the new tokens' positions (B, T), before any layer attends.

        Works out what every layer shares (the visible span and mask), so the per-layer `attend` does no
        host sync. Query t of row b sees cache position j iff j <= positions[b, t].
        """
        span = int(positions[:, -1].max()) + 1  # the one host sync of a forward
        if span > self.max_len:
            raise ValueError(f"KV cache overflow: need {span} positions, max_len={self.max_len}")
        self._span = span
        self._visible = torch.arange(span, device=positions.device)[None, None, :] <= positions[:, :, None]

    def attend(self, slot: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Write this call's keys/values at `positions`, then attend causally over each row's valid prefix.

        q: (B, H, T, D); k_new, v_new: (B, K, T, D); positions: (B, T) -> (B, H, T, D).
        """
        keys, values = self.keys[slot], self.values[slot]
        rows = self._rows[:, None]
        keys[rows, :, positions] = k_new.transpose(1, 2)
        values[rows, :, positions] = v_new.transpose(1, 2)
        span = self._span
        return grouped_attention(q, keys[:, :, :span], values[:, :, :span], self._visible)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a boolean visibility mask.

    q: (B, H, T, D); keys, values: (B, K, S, D); visible: (B, T, S) -> (B, H, T, D).
    The H/K query heads sharing one KV head are folded into the query axis, so each KV head is read once.
    """
    batch, n_heads, n_new, head_dim = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    q = q.reshape(batch, n_kv, group * n_new, head_dim)
    mask = visible[:, None, :, :].expand(batch, 1, n_new, visible.shape[-1])
    mask = mask.repeat(1, 1, group, 1) if group > 1 else mask
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.reshape(batch, n_heads, n_new, head_dim)
