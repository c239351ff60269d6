"""The top-p (nucleus) threshold without sorting the vocabulary, row by row, equal to the full-sort one.

``top_p_threshold(logits, top_p)`` (decodelab.core.filters) sorts each row ascending, takes the
float32 cumulative softmax c_i and removes the prefix with c_i <= tail, tail = fl32(1 - top_p); the
threshold is the first kept value (ties with it are kept; the top token always). In descending order
(b_1 >= b_2 >= ..., weights w_k = exp(b_k - max), Z = sum_k w_k, prefix sums s_k = w_1 + ... + w_k)
token k is kept iff s_{k-1} < P Z with P = 1 - tail, so the number kept is K = min{k : s_k >= P Z}
(at least 1) and the threshold is b_K. Only the largest K values are needed, plus Z.

``top_p_threshold_rows`` finds them per row. Where a C compiler works (``core.native``) the kernel
``nucleus_kernel.c`` does it in one pass over the row plus a small sort: a window of the values with
probability >= (1 - P) / 512 when few of them hold P Z (a peaked row), else a radix select on the
weights' float32 bits (each bucket's mass, the bucket where the mass from the top crosses P Z, then a
sort of that bucket alone). Elsewhere, in numpy, a window {x >= lo} with lo = max + log((1 - P) Z /
(2 S)) (every value left out has probability < (1 - P) / (2 S)), sorted on its own: the window holds
the nucleus iff its mass reaches P Z, which is checked exactly. S = _GUESS, then 16 _GUESS for the
rows that failed, then V (the window that provably holds the nucleus: the at most V values left out
hold < (1 - P) / 2 of the mass); flat rows (a window of more than V / _WIDE values) take the full sort.

Exactness: sums are in float64 over float32 weights (error ~1e-12 of Z). The reference's float32
softmax scales every probability by the rounding of its float32 normalizer, so its cumulative mass at
the boundary (the removed tail, about 1 - P) errs in proportion to the tail: at most 4.3e-7 (1 - P)
over 320 flat rows of 49152 (the notebook-02 prompts at T = 1..5 and heavy-tailed rows, top_p 0.5 to
0.99, measured in issue 15), and the normalizer's rounding grows with the vocabulary. So where s_{K-1}
or s_K lies within band = _BAND (1 - P) Z max(1, V / _BAND_VOCAB) of P Z the two may disagree, and the
row takes the reference (its full sort). So do rows without a finite maximum (NaN, +inf, all -inf) and
every row off CPU: the result equals ``top_p_threshold`` bit for bit, and only the rows that need it
are sorted.

``row_weights(x, rows)`` gives a :class:`RowWeights`: the (B, 1) row max and the float32 weights
exp(x - max) of the rows asked for (those with top_p < 1: only their weights are ever needed here); the
caller may pass them in (``weights=``) and reuse them for the draw (``draw.sample_inverse_cdf(...,
weights=)``): the same numbers the draw computes from x. Each (B, V) pass costs memory traffic (a row
of 49152 float32 is 196 kB), so rows that need no weights get none.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from decodelab.core import native

# the window's guess: values with probability >= (1 - P) / (2 * this)
_GUESS = 256
# a row whose window holds more than V // this values takes the full sort (the window would cost as much)
_WIDE = 8
# the decision margin, a fraction of the tail mass (1 - P) Z: 7x the reference's largest measured error
_BAND = 3e-6
# the vocabulary that error was measured on; larger ones widen the margin in proportion
_BAND_VOCAB = 49152


def _band_per_tail(vocab: int) -> float:
    """The decision margin as a fraction of the tail mass (1 - P) Z, for this vocabulary size."""
    return _BAND * max(1.0, vocab / _BAND_VOCAB)


def _reference_rows(logits: torch.Tensor, top_p: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    from decodelab.core.filters import top_p_threshold

    return top_p_threshold(logits[torch.from_numpy(rows)], top_p[torch.from_numpy(rows)])


def _resolve(desc: np.ndarray, above: np.ndarray, m: np.ndarray, z: np.ndarray, big_p: np.ndarray, vocab: int):
    """Per row: the descending candidates `desc` (R, L) (-inf padding after them) with `above` (R, 1) the
    mass of the values over them -> (threshold (R,), clear (R,) bool). clear: the candidates hold the
    K-th largest value and s_{K-1}, s_K lie more than the band from P Z (the reference decides alike)."""
    s = above + np.cumsum(np.exp(desc.astype(np.float64) - m.astype(np.float64)), axis=-1)  # s_k
    target = big_p * z
    n_in = np.minimum((s < target).sum(-1, keepdims=True), desc.shape[-1] - 1)  # index of the K-th in desc
    s_k = np.take_along_axis(s, n_in, axis=-1)
    s_before = np.where(n_in > 0, np.take_along_axis(s, np.maximum(n_in - 1, 0), axis=-1), above)
    band = _band_per_tail(vocab) * (1 - big_p) * z
    clear = (s_k >= target + band) & (s_before < target - band) & np.isfinite(np.take_along_axis(desc, n_in, -1))
    clear |= (above == 0) & (n_in == 0) & (target <= 0)  # P <= 0: the reference keeps the top token alone
    return np.take_along_axis(desc, n_in, axis=-1)[:, 0], clear[:, 0]


def _window_threshold(xr: np.ndarray, m, z, big_p) -> float | None:
    """One row (V,) float32, its max, Z and P -> the threshold from the narrowest window that decides it
    (spread _GUESS, 16 _GUESS, then V: {x >= max + log((1 - P) Z / (2 spread))}, sorted descending), or
    None: no window decides it, or a window holds more than V // _WIDE values (a flat row; a wider
    spread only widens it), and the row takes the full sort."""
    V = xr.shape[-1]
    for spread in (_GUESS, 16 * _GUESS, V):  # narrow windows first; then one that provably holds the nucleus
        with np.errstate(divide="ignore"):
            lo = np.float32(m + np.log((1 - big_p) * z / (2 * spread)))
        keep = xr >= min(lo, m)  # the max at least
        if np.count_nonzero(keep) > V // _WIDE:
            return None
        desc = np.sort(xr[keep])[::-1].reshape(1, -1)
        thr, clear = _resolve(desc, np.zeros((1, 1)), np.full((1, 1), m), np.full((1, 1), z), np.full((1, 1), big_p),
                               V)
        if clear[0]:
            return thr[0]
    return None


def _kernel_rows(kernel, x: np.ndarray, weights: "RowWeights", big_p: np.ndarray, rows: np.ndarray):
    """The C radix select (nucleus_kernel.c) on `rows` of x (B, V) float32, each row's weights read from
    `weights` -> (threshold (R,), clear (R,))."""
    B, V = x.shape
    m = np.ascontiguousarray(weights.max.numpy(), dtype=np.float32).reshape(B)
    big_p = np.ascontiguousarray(big_p, dtype=np.float64).reshape(B)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    addresses = weights.addresses(rows)
    thr = np.empty(rows.size, dtype=np.float32)
    clear = np.zeros(rows.size, dtype=np.uint8)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    kernel.top_p_rows(ptr(x), ptr(addresses), ptr(m), ptr(big_p), ptr(rows), ctypes.c_int64(rows.size),
                      ctypes.c_int64(V), ctypes.c_double(_band_per_tail(V)), ptr(thr), ptr(clear))
    return thr, clear.astype(bool)


@dataclass(frozen=True)
class RowWeights:
    """exp(x - max) for some rows of a (B, V) float32 CPU x, as the draw computes them (``torch.sub`` then
    ``exp_``: 1 at the max, 0 at -inf).

    max: (B, 1) every row's max; rows: (R,) int64 ascending, the rows with weights;
    w: (R, V) float32 contiguous, w[j] = exp(x[rows[j]] - max[rows[j]]);
    head: (B, 1) int64, each row's first maximal id (``draw.argmax_rows``), or None."""

    max: torch.Tensor
    rows: np.ndarray
    w: torch.Tensor
    head: torch.Tensor | None = None

    def has(self, rows: np.ndarray) -> np.ndarray:
        """(R',) row ids -> (R',) bool: which of them have weights here."""
        return np.isin(rows, self.rows)

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """(R',) row ids, each with weights here -> their positions in w."""
        return np.searchsorted(self.rows, rows)

    def addresses(self, rows: np.ndarray) -> np.ndarray:
        """(R',) row ids, each with weights here -> (R',) uint64: the address of each one's V weights."""
        step = np.uint64(self.w.shape[-1] * self.w.element_size())
        return np.uint64(self.w.data_ptr()) + self.positions(rows).astype(np.uint64) * step


def row_weights(x: torch.Tensor, rows: np.ndarray | None = None, out: str | None = None) -> RowWeights:
    """(B, V) float32 CPU -> RowWeights: every row's max and argmax, and exp(x - max) for `rows` (all
    when None).
    out: a ``draw.scratch`` buffer name to write the weights into (values that stay inside one call)."""
    from decodelab.core.draw import argmax_rows, scratch

    xn = x.detach().contiguous().numpy()
    head = argmax_rows(x).numpy().reshape(-1, 1)  # the draw's head too: one pass for both
    m = torch.from_numpy(np.take_along_axis(xn, head, axis=-1))
    rows = np.arange(x.shape[0], dtype=np.int64) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    index = torch.from_numpy(rows)
    w = torch.empty(rows.size, x.shape[-1]) if out is None else scratch(out, (rows.size, x.shape[-1]))
    if rows.size == x.shape[0]:
        torch.sub(x, m, out=w)
    else:
        torch.index_select(x, 0, index, out=w).sub_(m.index_select(0, index))
    return RowWeights(m, rows, w.exp_(), torch.from_numpy(head))


def top_p_threshold_rows(logits: torch.Tensor, top_p, weights: RowWeights | None = None) -> torch.Tensor:
    """(B, V) logits, top_p float or (B,) -> (B, 1) threshold, equal to ``filters.top_p_threshold``
    bit for bit, sorting only the rows the window cannot decide (see the module docstring).
    weights: ``row_weights(logits, rows)`` when the caller has them (CPU float32 only; every row with
    top_p < 1 among `rows`), else computed here."""
    from decodelab.core.filters import _row_param

    B, V = logits.shape
    p = _row_param(top_p, logits, torch.float64).expand(B, 1).contiguous()
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return _reference_rows(logits, p.reshape(B), np.arange(B))
    thr = np.full((B, 1), -np.inf, dtype=np.float32)
    rows = np.flatnonzero(p.numpy()[:, 0] < 1)
    if rows.size == 0:
        return torch.from_numpy(thr)
    x = logits.detach().contiguous()
    xn = x.numpy()
    if weights is not None:
        rows_without = rows[~weights.has(rows)]
        if rows_without.size:
            raise ValueError(f"weights: rows {rows_without.tolist()} have top_p < 1 but no weights")
    m = xn.max(axis=-1, keepdims=True) if weights is None else weights.max.numpy()
    rows = rows[np.isfinite(m[rows, 0])]  # NaN, +inf or all -inf: the reference
    tail = (1 - p.numpy()[:, 0]).astype(np.float32)  # as the reference rounds 1 - top_p
    big_p = 1 - tail.astype(np.float64)  # token k kept iff s_{k-1} < big_p * Z
    done = np.zeros(B, dtype=bool)  # rows whose threshold a window (or the kernel) decided
    kernel = native.load("nucleus_kernel") if rows.size else None
    if kernel is not None:  # the weights as the draw computes them, from the row max found above
        if weights is None:
            index = torch.from_numpy(rows)
            w = torch.sub(x.index_select(0, index), torch.from_numpy(m[rows])).exp_()
            weights = RowWeights(torch.from_numpy(m), rows, w)
        thr[rows, 0], done[rows] = _kernel_rows(kernel, xn, weights, big_p, rows)
    else:
        for r in rows:  # one row at a time: no copies of the batch
            if weights is None:
                wr = torch.sub(x[r], torch.from_numpy(m[r])).exp_().numpy()
            else:
                wr = weights.w[int(weights.positions(np.array([r]))[0])].numpy()
            z = wr.sum(dtype=np.float64)  # numpy's pairwise float64 sum
            t = _window_threshold(xn[r], m[r, 0], z, big_p[r])
            if t is not None:
                thr[r, 0], done[r] = t, True
    rest = np.flatnonzero(~done & (p.numpy()[:, 0] < 1))
    if rest.size:
        thr[rest] = _reference_rows(logits, p.reshape(B), rest).numpy()
    return torch.from_numpy(thr)
