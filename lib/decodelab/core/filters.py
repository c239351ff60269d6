"""Truncation filters and their thresholds: pure functions over a batch of logits.

Every filter is a pure function ``(B, V) -> (B, V)`` that sets removed tokens to ``-inf`` and takes
its parameter per row (a float, or a tensor of shape ``(B,)``), so one batch may mix settings. A row
whose parameter disables the filter (``top_k=0``, ``top_p=1``, ``min_p=0``, ``typical_p=1``,
``epsilon=0``, ``eta=0``, ``temperature=1``) passes through unchanged. Semantics follow the
transformers warpers with ``min_tokens_to_keep=1``, so the filters can be checked against them.

Apart from typical sampling, every filter keeps the tokens whose logit is at least a per-row
threshold ``thr`` (B, 1): the ``*_threshold`` functions compute it, so a pipeline
(:class:`decodelab.core.sampling.Sampler`) can apply one threshold to the logits and to a sorted copy
of them alike. ``sort_values`` is that sorted copy (values only, no indices: on CPU numpy's SIMD sort
is ~25x faster than ``torch.sort``).

Most rows need only the top of that sorted copy. ``top_values_ascending(logits, n)`` is the last n
entries of ``sort_values(logits)`` (the n largest values, ascending) without sorting the row, and
``sorted_kept(logits)`` returns such a window whenever it holds every kept (> -inf) value of every row:
a window whose first entry is -inf stands for the full sorted row (the entries left out are all -inf).
Thresholds, the top-p cumulative mass and the inverse-CDF draw computed on such a window equal those
on the full sorted row, bit for bit (see ``sorted_kept``). ``row_max`` is ``amax`` (the same value)
at numpy's speed on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")
# sorted_kept uses a window when every row keeps at most V // _WINDOW_FRACTION values (else a full sort)
_WINDOW_FRACTION = 8
# window lengths keep a full row's length modulo this, so the softmax kernel sees the kept values at the
# same offset within its vector lanes as in the full sorted row
_ALIGN = 64

# ----------------------------------------------------------------------------------------------
# helpers


def _row_param(value, logits: torch.Tensor, dtype=None) -> torch.Tensor:
    """A float/int or a (B,) tensor -> (B, 1) tensor on the logits' device (broadcasts over V)."""
    dtype = dtype or logits.dtype
    t = torch.as_tensor(value, dtype=dtype, device=logits.device)
    return t.reshape(-1, 1) if t.ndim else t.reshape(1, 1)


def _keep_at_least(logits: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """(B, V), (B, 1) -> (B, V): tokens with logit < thr set to -inf."""
    return logits.masked_fill(logits < thr, NEG_INF)


def sort_values(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, V) each row's values in ascending order (no indices).

    On CPU numpy's SIMD sort is used: for (64, 49152) float32 it takes ~13 ms where ``torch.sort``
    takes ~350 ms on one thread. Elsewhere ``torch.sort``.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        import numpy as np

        return torch.from_numpy(np.sort(logits.detach().contiguous().numpy(), axis=-1))
    return torch.sort(logits, dim=-1).values


def _numpy_ok(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)


def row_max(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, 1): each row's largest value, as ``amax`` (numpy's on CPU: ~10x faster)."""
    if _numpy_ok(logits):
        return torch.from_numpy(logits.detach().contiguous().numpy().max(axis=-1, keepdims=True))
    return logits.amax(dim=-1, keepdim=True)


def top_values_ascending(logits: torch.Tensor, n: int) -> torch.Tensor:
    """(B, V) -> (B, n): each row's n largest values in ascending order, i.e. ``sort_values(logits)[:, V-n:]``
    as values (the same numbers in the same order), without sorting the row: a partition (numpy's
    introselect on CPU, ``torch.topk`` elsewhere) and a sort of the n selected values. 1 <= n <= V."""
    V = logits.shape[-1]
    if not 1 <= n <= V:
        raise ValueError(f"n={n} must be in [1, {V}] (the row length)")
    if n == V:
        return sort_values(logits)
    if _numpy_ok(logits):
        top = np.partition(logits.detach().contiguous().numpy(), V - n, axis=-1)[:, V - n:]
        return torch.from_numpy(np.sort(top, axis=-1))
    return torch.topk(logits, n, dim=-1, sorted=True).values.flip(-1)


def window_length(n: int, V: int) -> int:
    """The window length for n kept values in a row of V: n rounded up so that V - length is a multiple
    of the alignment (what the full sorted row has before its last `length` entries), at most V."""
    return min(V, n + (V - n) % _ALIGN)


def is_full_window(window: torch.Tensor) -> bool:
    """(B, L) ascending window -> bool: it stands for the whole sorted row (every row starts at -inf,
    so every value left out of it is -inf)."""
    return bool((window[:, 0] == NEG_INF).all())


def sorted_kept(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, L), L <= V: ``sort_values(logits)``, or its last L entries when the rest is -inf.

    On CPU, when every row keeps at most V // 8 values (> -inf) and none is NaN or +inf, the window of
    the L = max kept (aligned) largest values is returned: entries before it are -inf in the full sort,
    so they add exactly 0 to every softmax sum and cumulative sum (exp(-inf) = 0 and x + 0 = x), and
    every search on the window lands at the same offset from the row's end. Elsewhere the full sort:
    the window's softmax is only known (tested) to match the full row's bit for bit on CPU.
    """
    V = logits.shape[-1]
    if not _numpy_ok(logits):
        return sort_values(logits)
    xn = logits.detach().contiguous().numpy()
    kept = xn > -np.inf
    counts = np.count_nonzero(kept, axis=-1)
    n = int(counts.max())
    if int(counts.min()) == 0 or n > V // _WINDOW_FRACTION or not np.isfinite(xn.max(axis=-1)).all():
        return sort_values(logits)  # NaN, +inf or empty rows (or a broad kept set): the reference path
    return _right_aligned_sorted(xn, kept, window_length(n, V))


def _right_aligned_sorted(xn: np.ndarray, keep: np.ndarray, length: int) -> torch.Tensor:
    """Each row's values where keep, sorted ascending, at the end of a -inf row of `length`."""
    out = np.full((xn.shape[0], length), -np.inf, dtype=xn.dtype)
    for row in range(xn.shape[0]):  # boolean selection + sort of the few kept values: no partition, which
        values = np.sort(xn[row][keep[row]])  # degrades on rows full of equal (-inf) values
        out[row, length - values.size:] = values
    return torch.from_numpy(out)


def top_window(logits: torch.Tensor, n: int) -> torch.Tensor | None:
    """(B, V) -> (B, L): each row's L = window_length(n, V) largest values, ascending (the last L entries of
    ``sort_values(logits)``: the same numbers in the same order), from one ``torch.topk``; None where a row
    holds NaN or +inf (the caller takes the full sort there). A top-k cut at k < n leaves the window's first
    entry below the cut, and the window then stands for the full sort, unless ties with the k-th largest
    reach it (``is_full_window`` tells)."""
    window = torch.topk(logits, window_length(n, logits.shape[-1]), dim=-1, sorted=True).values.flip(-1)
    top = window[:, -1]
    if bool(torch.isnan(top).any()) or bool(torch.isposinf(top).any()):
        return None
    return window


# ----------------------------------------------------------------------------------------------
# thresholds: (B, V) logits -> (B, 1) smallest logit kept. `sorted_asc` is sort_values(logits).


def top_k_threshold(logits: torch.Tensor, top_k, sorted_asc: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1): the k-th largest logit (ties with it are kept, as in TopKLogitsWarper).

    top_k = 0 disables (threshold -inf); top_k >= V keeps everything. Without `sorted_asc` no sort:
    the largest max(k) values are selected (``top_values_ascending``), and the k-th largest is the same
    number there as in the full sort. `sorted_asc` may be a window that stands for the full sort.
    """
    if sorted_asc is None:
        k_max = int(torch.as_tensor(top_k).max())
        sa = top_values_ascending(logits, min(max(k_max, 1), logits.shape[-1]))
    else:
        sa = sorted_asc
    V = sa.shape[-1]
    k = _row_param(top_k, sa, torch.long).expand(sa.shape[0], 1)
    kth = sa.gather(-1, (V - k.clamp(1, V)))  # ascending: the k-th largest sits at V - k
    return torch.where(k > 0, kth, NEG_INF)


def top_p_threshold(logits: torch.Tensor, top_p, sorted_asc: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1): nucleus threshold, as TopPLogitsWarper.

    Ascending order, cumulative mass c_i = sum_{j <= i} p_j: token i is removed iff c_i <= 1 - top_p
    (the tail it closes holds at most 1 - top_p), the most probable token is always kept.
    Removed tokens form a prefix of the ascending order, so the cut is a threshold on the logit.
    top_p = 1 disables. `sorted_asc` may be a window that stands for the full sort (``sorted_kept``).
    """
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    V = sa.shape[-1]
    p = _row_param(top_p, sa, torch.float64).expand(sa.shape[0], 1)
    cum = sa.softmax(dim=-1).cumsum_(dim=-1)  # non-decreasing, so the removed count is a binary search
    tail = (1 - p).to(sa.dtype)  # 1 - top_p in double, then rounded, as the warper's scalar compare
    n_removed = torch.searchsorted(cum, tail.contiguous(), right=True).clamp(max=V - 1)
    return torch.where(p < 1, sa.gather(-1, n_removed), NEG_INF)


def min_p_threshold(logits: torch.Tensor, min_p, row_max_: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1): min-p keeps p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p).

    The softmax normalizer cancels, so no softmax is needed; the argmax always survives (min_p <= 1).
    min_p = 0 disables (log 0 = -inf). row_max_: the (B, 1) row max when the caller has it (the same
    numbers as ``row_max(logits)``), which saves a pass.
    """
    m = _row_param(min_p, logits)
    top = row_max(logits) if row_max_ is None else row_max_
    return top.to(logits.device) + torch.log(m)


def epsilon_threshold(logits: torch.Tensor, epsilon) -> torch.Tensor:
    """(B, V) -> (B, 1): epsilon sampling keeps p_i >= epsilon  <=>  logit_i >= logsumexp + log(epsilon),
    and always the argmax (EpsilonLogitsWarper). epsilon = 0 disables."""
    eps = _row_param(epsilon, logits)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    return torch.minimum(lse + torch.log(eps), row_max(logits).to(logits.device))


def eta_threshold(logits: torch.Tensor, eta) -> torch.Tensor:
    """(B, V) -> (B, 1): eta sampling (Hewitt et al. 2022, EtaLogitsWarper) keeps p_i >= cut with
    cut = min(eta, sqrt(eta) * exp(-H)), H the entropy of the row; always the argmax. eta = 0 disables."""
    e = _row_param(eta, logits)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    entropy = torch.special.entr((logits - lse).exp()).sum(dim=-1, keepdim=True)  # H = -sum p log p
    cut = torch.minimum(e, e.sqrt() * torch.exp(-entropy))
    return torch.minimum(lse + torch.log(cut), row_max(logits).to(logits.device))


# ----------------------------------------------------------------------------------------------
# filters: (B, V) -> (B, V), removed tokens at -inf


def apply_temperature(logits: torch.Tensor, temperature) -> torch.Tensor:
    """(B, V) -> (B, V): logits / T per row. T = 0 rows become greedy: the argmax (first one on ties)
    keeps its logit, every other token -inf (the T -> 0 limit of softmax(logits / T))."""
    t = _row_param(temperature, logits)
    scaled = logits / torch.where(t > 0, t, 1.0)
    if not bool((t == 0).any()):
        return scaled
    onehot = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.argmax(-1, keepdim=True), True)
    return torch.where(t == 0, logits.masked_fill(~onehot, NEG_INF), scaled)


def top_k_filter(logits: torch.Tensor, top_k) -> torch.Tensor:
    """(B, V) -> (B, V): keep the k most probable tokens per row (ties at the k-th kept); 0 disables."""
    return _keep_at_least(logits, top_k_threshold(logits, top_k))


def top_p_filter(logits: torch.Tensor, top_p) -> torch.Tensor:
    """(B, V) -> (B, V): keep the smallest most-probable set with mass >= top_p (nucleus); 1 disables."""
    return _keep_at_least(logits, top_p_threshold(logits, top_p))


def min_p_filter(logits: torch.Tensor, min_p) -> torch.Tensor:
    """(B, V) -> (B, V): keep tokens with p >= min_p * p_max; 0 disables."""
    return _keep_at_least(logits, min_p_threshold(logits, min_p))


def epsilon_filter(logits: torch.Tensor, epsilon) -> torch.Tensor:
    """(B, V) -> (B, V): keep tokens with p >= epsilon (and the argmax); 0 disables."""
    return _keep_at_least(logits, epsilon_threshold(logits, epsilon))


def eta_filter(logits: torch.Tensor, eta) -> torch.Tensor:
    """(B, V) -> (B, V): keep tokens with p >= min(eta, sqrt(eta) exp(-H)) (and the argmax); 0 disables."""
    return _keep_at_least(logits, eta_threshold(logits, eta))


def typical_filter(logits: torch.Tensor, typical_p) -> torch.Tensor:
    """(B, V) -> (B, V): locally typical sampling (Meister et al. 2023, TypicalLogitsWarper).

    Rank tokens by |-log p_i - H| (distance of their surprisal from the entropy H), keep the
    smallest set of most typical tokens whose mass reaches typical_p (the most typical token always).
    Not a threshold on the logit: the kept set need not contain the argmax. typical_p = 1 disables.
    One full argsort (torch.sort), so it is the one costly filter.
    """
    mass = _row_param(typical_p, logits)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)  # 0 * -inf = nan -> dropped
    shifted = (-logp - entropy).abs()
    sorted_shifted, order = torch.sort(shifted, dim=-1)
    cum = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(-1, last)
    remove_sorted[..., :1] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted) & (mass < 1)
    return logits.masked_fill(remove, NEG_INF)
