"""The top-p (nucleus) threshold without sorting the vocabulary, row by row, equal to the full-sort one.

``top_p_threshold(logits, top_p)`` (decodelab.core.filters) sorts each row ascending, takes the
float32 cumulative softmax c_i and removes the prefix with c_i <= tail, tail = fl32(1 - top_p); the
threshold is the first kept value (ties with it are kept; the top token always). In descending order
(b_1 >= b_2 >= ..., weights w_k = exp(b_k - max), Z = sum_k w_k, prefix sums s_k = w_1 + ... + w_k)
token k is kept iff s_{k-1} < P Z with P = 1 - tail, so the number kept is K = min{k : s_k >= P Z}
(at least 1) and the threshold is b_K. Only the largest K values are needed, plus Z.

``top_p_threshold_rows`` finds them per row from a window {x >= lo} with lo = max + log((1 - P) Z /
(2 S)) (every value left out has probability < (1 - P) / (2 S)), sorted on its own: the window holds
the nucleus iff its mass reaches P Z, which is checked exactly. S = _GUESS, then 16 _GUESS for the rows
that failed, then V (the window that provably holds the nucleus: the at most V values left out hold
< (1 - P) / 2 of the mass). Sums are in float64 over
float32 weights (error ~1e-8 of Z); the reference's float32 softmax and cumulative sum err by up to
~3e-7 (measured on flat rows of 49152), so where s_{K-1} or s_K lies within _BAND * Z of P Z the two
may disagree and the row takes the reference (its full sort). So do rows whose window is too wide (flat
rows: a sort of most of the row), rows without a finite maximum (NaN, +inf, all -inf) and every row
off CPU: the result equals ``top_p_threshold`` bit for bit, and only the rows that need it are sorted.
"""

from __future__ import annotations

import numpy as np
import torch

# the window's guess: values with probability >= (1 - P) / (2 * this)
_GUESS = 256
# a row whose window holds more than V // this values takes the full sort (the window would cost as much)
_WIDE = 8
# the decision margin, a fraction of Z: 3x the reference's largest measured rounding error
_BAND = 1e-6


def descending_windows(xn: np.ndarray, keep: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(R, V) float32 values, (R, V) bool, the rows to take (n,) and their kept counts (n,) -> (n, L)
    float32: each row's kept values in descending order, left-aligned, -inf after them (L = max count)."""
    out = np.full((rows.size, max(int(counts.max()), 1)), -np.inf, dtype=np.float32)
    for i, row in enumerate(rows):  # a boolean selection and a sort of the few kept values per row
        out[i, : counts[i]] = np.sort(xn[row][keep[row]])[::-1]
    return out


def _reference_rows(logits: torch.Tensor, top_p: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    from decodelab.core.filters import top_p_threshold

    return top_p_threshold(logits[torch.from_numpy(rows)], top_p[torch.from_numpy(rows)])


def _resolve(desc: np.ndarray, above: np.ndarray, m: np.ndarray, z: np.ndarray, big_p: np.ndarray):
    """Per row: the descending candidates `desc` (R, L) (-inf padding after them) with `above` (R, 1) the
    mass of the values over them -> (threshold (R,), clear (R,) bool). clear: the candidates hold the
    K-th largest value and s_{K-1}, s_K lie more than _BAND * Z from P Z (the reference decides alike)."""
    s = above + np.cumsum(np.exp(desc.astype(np.float64) - m.astype(np.float64)), axis=-1)  # s_k
    target = big_p * z
    n_in = np.minimum((s < target).sum(-1, keepdims=True), desc.shape[-1] - 1)  # index of the K-th in desc
    s_k = np.take_along_axis(s, n_in, axis=-1)
    s_before = np.where(n_in > 0, np.take_along_axis(s, np.maximum(n_in - 1, 0), axis=-1), above)
    band = _BAND * z
    clear = (s_k >= target + band) & (s_before < target - band) & np.isfinite(np.take_along_axis(desc, n_in, -1))
    clear |= (above == 0) & (n_in == 0) & (target <= 0)  # P <= 0: the reference keeps the top token alone
    return np.take_along_axis(desc, n_in, axis=-1)[:, 0], clear[:, 0]


def _window_pass(xn, m, z, big_p, spread):
    """Rows' windows {x >= max + log((1 - P) Z / (2 spread))} -> (threshold (R,), clear (R,) bool);
    a row whose window holds more than V // _WIDE values is not clear."""
    V = xn.shape[-1]
    with np.errstate(divide="ignore"):
        lo = (m + np.log((1 - big_p) * z / (2 * spread))).astype(np.float32)
    keep = xn >= np.minimum(lo, m)  # the max at least
    counts = np.count_nonzero(keep, axis=-1)
    sel = np.flatnonzero(counts <= V // _WIDE)
    thr = np.full(xn.shape[0], -np.inf, dtype=np.float32)
    clear = np.zeros(xn.shape[0], dtype=bool)
    if sel.size:
        desc = descending_windows(xn, keep, sel, counts[sel])
        thr[sel], clear[sel] = _resolve(desc, np.zeros((sel.size, 1)), m[sel], z[sel], big_p[sel])
    return thr, clear


def top_p_threshold_rows(logits: torch.Tensor, top_p) -> torch.Tensor:
    """(B, V) logits, top_p float or (B,) -> (B, 1) threshold, equal to ``filters.top_p_threshold``
    bit for bit, sorting only the rows the window cannot decide (see the module docstring)."""
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
    m = x.amax(dim=-1, keepdim=True).numpy()
    rows = rows[np.isfinite(m[rows, 0])]  # NaN, +inf or all -inf: the reference
    whole = rows.size == B
    xn = x.numpy() if whole else x.numpy()[rows]  # no copy when every row takes part
    m = m if whole else m[rows]
    tail = (1 - p.numpy()[rows]).astype(np.float32)  # as the reference rounds 1 - top_p
    big_p = 1 - tail.astype(np.float64)  # token k kept iff s_{k-1} < big_p * Z
    weights = torch.sub(torch.from_numpy(xn), torch.from_numpy(m)).exp_().numpy()
    z = weights.sum(axis=-1, keepdims=True, dtype=np.float64)  # numpy's pairwise float64 sum
    todo = np.arange(rows.size)
    for spread in (_GUESS, 16 * _GUESS, V):  # narrow windows first; then one that provably holds the nucleus
        part = xn if todo.size == xn.shape[0] else xn[todo]
        t, clear = _window_pass(part, m[todo], z[todo], big_p[todo], spread)
        thr[rows[todo[clear]], 0] = t[clear]
        todo = todo[~clear]
        if todo.size == 0:
            break
    rest = np.setdiff1d(np.arange(B), rows[np.setdiff1d(np.arange(rows.size), todo)])
    rest = rest[p.numpy()[rest, 0] < 1]
    if rest.size:
        thr[rest] = _reference_rows(logits, p.reshape(B), rest).numpy()
    return torch.from_numpy(thr)
