"""The sort-free draw: a head-first inverse CDF over (B, V) logits, dense (two-level chunked search) or
over the kept ids only (few kept per row); on CPU float32 both run in C (``draw_kernel.c``: one read of
each row, no masked copies), elsewhere in torch and numpy. Its law and the coupling it gives are described in
:mod:`decodelab.core.sampling`, which re-exports ``argmax_rows`` and ``sample_inverse_cdf``."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from decodelab.core import native
from decodelab.core.filters import NEG_INF

# a row is drawn over its kept ids alone when they are at most 1 / this of its vocabulary
_SPARSE_FRACTION = 16
# ids per chunk of the draw's two-level search: (64, 49152) logits give 192 chunk sums per row
_CHUNK = 256


_SCRATCH = threading.local()


def scratch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 CPU buffer of this shape, reused by every later call with the same name on this thread:
    a fresh (64, 49152) tensor costs ~0.25 ms of page faults, a twentieth of the whole draw. Only for
    values that never leave the call that fills them (a sampler's temperature-scaled logits, its weights)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = buffers.get(name)
    if buf is None or tuple(buf.shape) != tuple(shape):
        with torch.inference_mode(False):  # a normal tensor: writable both inside the token loop and outside it
            buf = buffers[name] = torch.empty(shape, dtype=torch.float32)
    return buf


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) long: each row's first maximal index, as ``torch.argmax`` (a NaN counts as the maximum).
    On CPU: float32 through draw_kernel.c's `argmax_rows` (AVX-512, rows shared among threads), else numpy's:
    for (64, 49152) float32 numpy's is ~5x faster than torch's and the kernel ~1.7x faster again (0.28 against
    0.46 ms), which greedy decoding's per-step path and every sampled step's head pay."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        xn = logits.detach().contiguous().numpy()
        kernel = native.load("draw_kernel") if xn.dtype == np.float32 and xn.ndim == 2 and xn.shape[-1] else None
        head = np.empty(xn.shape[0], dtype=np.int64)
        if kernel is None or kernel.argmax_rows(_ptr(xn), ctypes.c_int64(xn.shape[0]), ctypes.c_int64(xn.shape[1]),
                                                _ptr(head)) != 0:  # -1: no AVX-512 here
            return torch.from_numpy(np.argmax(xn, axis=-1).astype(np.int64))
        return torch.from_numpy(head)
    return logits.argmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# sampling


def sample_inverse_cdf(logits: torch.Tensor, u: torch.Tensor, threshold: torch.Tensor | None = None,
                       weights=None, floor: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits, (B,) uniforms in [0, 1) -> (B,) long token ids drawn from softmax(logits), no sort.

    Head-first inverse CDF: the row's argmax a (its first maximal id) comes first, then every other
    token in vocabulary order. With weights w_i = exp(x_i - x_a) (w_a = 1, removed tokens 0) and
    C = sum_i w_i, a is picked when u C < 1, else the first token i != a with 1 + c_i > u C, where c_i
    sums the non-head weights up to id i. P(i) = w_i / C (up to float rounding), so the law is
    softmax(logits) exactly as a sort-based draw; only which token a given u maps to differs.
    `threshold` (B, 1), optional: tokens with x_i < threshold count as removed (weight 0), the same as
    masking them to -inf first, without the masked copy (a pipeline's last threshold stage is deferred here).
    `floor` (B, 1), optional: the running maximum of earlier thresholds whose masking of x was skipped
    (or done: the same result): tokens with x_i < floor count as removed too. Rows whose `threshold` is
    -inf are drawn dense, as when x had been masked (a -inf threshold keeps every entry), so the draw
    takes the same path, and gives the same token, as on the masked logits.
    `weights` ``nucleus.RowWeights``, optional (CPU float32, every row's max finite): exp(x - max) for
    some rows, ``nucleus.row_weights(x, rows)``, computed once for the top-p search; the dense draw of
    those rows then needs no exp of its own and counts them as 0 where x < max(threshold, floor): the
    numbers it would compute from the masked x. It only reads them.
    The search is two-level: per-chunk sums of w (chunks of _CHUNK ids), their cumulative sum in float64,
    then a cumulative sum inside the one chunk picked (on CPU float32 the C kernel draw_kernel.c, which
    masks as it sums; the torch search elsewhere and where no C compiler works: the same law, a u within
    float rounding of an interval boundary may map to the neighbouring token). A picked token always has
    w_i > 0: each search takes the first entry whose cumulative sum exceeds the target, and is clamped to
    the last entry that still increases it (where rounding leaves the target at or past the end).
    """
    x = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    B, V = x.shape
    if weights is not None and weights.head is not None and x.device.type == "cpu" and x.dtype == torch.float32:
        head, m = weights.head, weights.max  # found with the weights, on these logits
    else:
        head = argmax_rows(x).to(x.device).reshape(B, 1)
        m = x.gather(-1, head)
    finite = bool(torch.isfinite(m).all())
    if weights is not None and not (finite and x.device.type == "cpu" and x.dtype == torch.float32):
        weights = None  # the shared weights are only those of finite CPU float32 rows
    if threshold is not None and x.device.type == "cpu" and finite:
        xn = x.detach().contiguous().numpy()
        cut = _cut(threshold, floor).detach().numpy()
        rows = np.arange(B)  # rows that may be sparse: as on masked logits, a -inf threshold is drawn dense
        if floor is not None:
            rows = np.flatnonzero(threshold.detach().numpy()[:, 0] > -np.inf)
        if rows.size:
            drawn = _sparse_draw(xn, cut, rows, head, m, u, max_kept=V // _SPARSE_FRACTION)  # -1: many kept
            sparse = drawn >= 0
            if sparse.all() and rows.size == B:
                return drawn
            if sparse.any():  # the sparse rows by their kept ids, the others dense
                tokens = torch.empty(B, dtype=torch.long)
                tokens[rows[sparse]] = drawn[sparse]
                dense = np.setdiff1d(np.arange(B), rows[sparse])
                tokens[dense] = _dense_draw(x, u, head, m, torch.from_numpy(cut), weights, rows=dense)
                return tokens
    return _dense_draw(x, u, head, m, _cut(threshold, floor), weights)


def kept_per_row(xn: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """(B, V) values, (B, 1) cut -> (B,) int64: how many values per row are >= the cut (one count_nonzero
    per row: numpy's axis=-1 count is ~7x slower)."""
    return np.fromiter((np.count_nonzero(row >= c) for row, c in zip(xn, cut[:, 0])), dtype=np.int64,
                       count=xn.shape[0])


def _float32_cut(cut: np.ndarray) -> np.ndarray:
    """(B,) cut in any float dtype -> float32 c with x >= c exactly where x >= cut, for every float32 x:
    rounded up where float32 rounds it down."""
    c = np.ascontiguousarray(cut, dtype=np.float32)
    low = c.astype(np.float64) < cut.astype(np.float64)
    c[low] = np.nextafter(c[low], np.float32(np.inf))
    return c


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _cut(threshold, floor):
    """(B, 1) or None each -> the threshold tokens below which are removed: the larger of the two."""
    if floor is None:
        return threshold
    return floor if threshold is None else torch.maximum(threshold, floor.to(threshold.dtype))


def _dense_draw(x: torch.Tensor, u: torch.Tensor, head: torch.Tensor, m: torch.Tensor, threshold, weights,
                rows: np.ndarray | None = None) -> torch.Tensor:
    """The head-first inverse CDF over every id of (B, V) x, for `rows` (all when None) -> (R,) long:
    ``sample_inverse_cdf``'s dense search. weights: ``nucleus.RowWeights`` or None; rows without weights
    there get exp(x - m) computed here, for those rows only. On CPU float32 the C kernel (draw_kernel.c:
    reads the weights, masks by the threshold as it sums), else the same search in torch."""
    B, V = x.shape
    rows = np.arange(B, dtype=np.int64) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    kernel = native.load("draw_kernel") if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if kernel is not None and x.is_contiguous():
        return _kernel_draw(kernel, x, u, head, m, threshold, weights, rows)
    index = torch.from_numpy(rows).to(x.device)
    x, u, head, m = x[index], u[index], head[index], m[index]
    threshold = None if threshold is None else threshold.to(x.device)[index]
    w = torch.sub(x, torch.where(torch.isfinite(m), m, 0.0))  # rows without a finite max: drawn as the head
    w.exp_()
    if weights is not None:  # the same numbers where the caller has them: taken over, not recomputed
        have = weights.has(rows)
        w[torch.from_numpy(have)] = weights.w[torch.from_numpy(weights.positions(rows[have]))]
    if threshold is not None:
        _fill_below_(w, x, threshold, 0.0)
    w.scatter_(-1, head, 0.0)  # the head's weight 1 is handled apart: it comes first
    R = x.shape[0]
    width = _CHUNK if V >= 4 * _CHUNK else V
    pad = (-V) % width
    chunks = (torch.nn.functional.pad(w, (0, pad)) if pad else w).view(R, -1, width)
    chunk_cum = chunks.sum(-1).double().cumsum_(-1)  # (R, n_chunks) non-head mass up to each chunk's end
    rest = chunk_cum[:, -1:]  # (R, 1) C - 1
    target = u.to(x.device, torch.float64).reshape(R, 1) * (1 + rest) - 1  # < 0: the head
    c = _first_exceeding(chunk_cum, target)
    before = torch.where(c > 0, chunk_cum.gather(-1, (c - 1).clamp(min=0)), 0.0)
    inside = chunks.gather(1, c.unsqueeze(-1).expand(R, 1, width)).squeeze(1).double().cumsum_(-1)
    token = c * width + _first_exceeding(inside, target - before)
    pick_head = (target < 0) | (rest <= 0) | ~torch.isfinite(m)
    return torch.where(pick_head, head, token).reshape(R)


def _kernel_draw(kernel, x, u, head, m, threshold, weights, rows) -> torch.Tensor:
    """``_dense_draw`` by the C kernel for `rows` of x (B, V) contiguous CPU float32: each row's weights
    from `weights` where it has them, else exp(x - m) computed here as the torch path does."""
    B, V = x.shape
    addresses = np.empty(rows.size, dtype=np.uint64)
    have = np.zeros(rows.size, dtype=bool) if weights is None else weights.has(rows)
    if have.any():
        addresses[have] = weights.addresses(rows[have])
    if not have.all():
        index = torch.from_numpy(rows[~have])
        mr = m[index]
        w = torch.index_select(x, 0, index, out=scratch("draw.weights", (index.numel(), V)))  # (R', V): index's order
        w.sub_(torch.where(torch.isfinite(mr), mr, 0.0)).exp_()
        addresses[~have] = np.uint64(w.data_ptr()) + np.arange(index.numel(), dtype=np.uint64) * np.uint64(V * 4)
    cut = None if threshold is None else _float32_cut(threshold.detach().cpu().numpy().reshape(B))
    heads = np.ascontiguousarray(head.cpu().numpy().reshape(B), dtype=np.int64)
    uniforms = np.ascontiguousarray(u.cpu().numpy().reshape(B), dtype=np.float64)
    tokens = np.empty(rows.size, dtype=np.int64)
    status = kernel.dense_draw_rows(_ptr(x.detach().numpy()), _ptr(addresses), None if cut is None else _ptr(cut),
                                    _ptr(heads), _ptr(uniforms), _ptr(rows), ctypes.c_int64(rows.size),
                                    ctypes.c_int64(V), _ptr(tokens))
    if status != 0:
        raise MemoryError("draw_kernel.dense_draw_rows: no scratch memory")
    return torch.from_numpy(tokens)


def _sparse_draw(xn: np.ndarray, cut: np.ndarray, rows: np.ndarray, head: torch.Tensor, m: torch.Tensor,
                 u: torch.Tensor, max_kept: int) -> torch.Tensor:
    """-> (R,) long for `rows` of xn (B, V): the same head-first inverse CDF over only the ids with
    x >= cut: their float64 weights in vocabulary order, one running sum, clamped to the row's last id
    with w > 0; -1 for rows that keep more than max_kept ids. The C kernel (draw_kernel.c) where it
    builds, else numpy."""
    kernel = native.load("draw_kernel")
    if kernel is not None and xn.dtype == np.float32 and xn.flags.c_contiguous:
        B, V = xn.shape
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        cut32 = _float32_cut(cut.reshape(B))
        heads = np.ascontiguousarray(head.numpy().reshape(B), dtype=np.int64)
        uniforms = np.ascontiguousarray(u.numpy().reshape(B), dtype=np.float64)
        tokens = np.empty(rows.size, dtype=np.int64)
        if kernel.sparse_draw_rows(_ptr(xn), _ptr(cut32), _ptr(heads), _ptr(uniforms), _ptr(rows),
                                   ctypes.c_int64(rows.size), ctypes.c_int64(V), ctypes.c_int64(max_kept),
                                   _ptr(tokens)) != 0:
            raise MemoryError("draw_kernel.sparse_draw_rows: no scratch memory")
        return torch.from_numpy(tokens)
    tokens = np.full(len(rows), -1, dtype=np.int64)
    few = kept_per_row(xn[rows], cut[rows]) <= max_kept
    if few.any():
        tokens[few] = _sparse_draw_numpy(xn, cut, rows[few], head, m, u)
    return torch.from_numpy(tokens)


def _sparse_draw_numpy(xn: np.ndarray, cut: np.ndarray, rows: np.ndarray, head: torch.Tensor, m: torch.Tensor,
                       u: torch.Tensor) -> np.ndarray:
    """``_sparse_draw`` in numpy, for rows that keep few ids: one float64 cumulative sum over every row's
    kept weights (it increases across rows, so one search finds each row's token)."""
    xn, head, m, u = xn[rows], head[torch.from_numpy(rows)], m[torch.from_numpy(rows)], u[torch.from_numpy(rows)]
    keep = xn >= cut[rows]
    rows, cols = np.divmod(np.flatnonzero(keep), keep.shape[1])  # ids ascending within each row
    w = np.exp(xn[rows, cols].astype(np.float64) - m.numpy()[rows, 0])
    w[cols == head.numpy()[rows, 0]] = 0.0  # the head comes first, apart
    cum = np.cumsum(w)
    end = np.cumsum(np.bincount(rows, minlength=xn.shape[0]))  # one past each row's last kept id
    start = end - np.bincount(rows, minlength=xn.shape[0])
    base = np.where(start > 0, cum[np.maximum(start - 1, 0)], 0.0)
    rest = cum[end - 1] - base  # every row keeps its head, so end > start
    target = u.numpy().astype(np.float64) * (1 + rest) - 1  # < 0: the head
    last = np.searchsorted(cum, cum[end - 1], side="left")  # the row's last id that adds weight
    pos = np.minimum(np.searchsorted(cum, base + target, side="right"), last)
    tokens = np.where((target < 0) | (rest <= 0), head.numpy()[:, 0], cols[np.clip(pos, 0, cols.size - 1)])
    return tokens.astype(np.int64)


def _first_exceeding(cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B, n) non-decreasing, (B, 1) -> (B, 1): the first index with cum > target, clamped to the first
    index holding the row's total (the last one that increases the sum, so its own weight is > 0)."""
    first = torch.searchsorted(cum, target.contiguous(), right=True)
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)
    return torch.minimum(first, last)


def _fill_below_(out: torch.Tensor, x: torch.Tensor, thr: torch.Tensor, value: float) -> None:
    """In place: out[x < thr] = value, out and x (B, V), thr (B, 1); numpy on CPU. value 0 (the draw's
    weights, finite where it matters): out *= (x >= thr), a vectorized multiply by 0 or 1 (~15x faster
    here than numpy's masked copy, ~3x faster than torch's masked_fill); it writes NaN for +inf or NaN
    weights, which only rows without a finite max have, and those the draw gives their head anyway."""
    if out.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and out.is_contiguous():
        on, xn, t = out.numpy(), x.detach().contiguous().numpy(), thr.detach().cpu().numpy()
        rows = np.flatnonzero(t.reshape(-1) > -np.inf)  # rows at -inf (a stage off there) keep everything
        if value == 0.0 and not np.shares_memory(on, xn) and t.size == x.shape[0]:
            if rows.size * 2 > x.shape[0]:
                np.multiply(on, xn >= t, out=on)  # a -inf threshold keeps the row: x >= -inf everywhere
            else:
                for row in rows:
                    np.multiply(on[row], xn[row] >= t[row], out=on[row])
            return
        if t.size != x.shape[0] or rows.size * 2 > x.shape[0]:
            np.copyto(on, value, where=xn < t)
        else:
            for row in rows:
                np.copyto(on[row], value, where=xn[row] < t[row])
    else:
        out.masked_fill_(x < thr.to(x.device), value)


def _mask_below_(x: torch.Tensor, thr: torch.Tensor) -> None:
    """In place: x[x < thr] = -inf, (B, V) and (B, 1) (numpy promotes the compare as torch does)."""
    _fill_below_(x, x, thr, NEG_INF)


def chosen_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, V), (B,) -> (B,): log softmax(logits)[token], in float32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]


def pick_tokens(logits: torch.Tensor, sampler, generator) -> torch.Tensor:
    """(B, V) -> (B,): greedy argmax without a sampler, else the sampler's draw."""
    if sampler is None:
        return argmax_rows(logits)
    return sampler.sample(logits, generator)
