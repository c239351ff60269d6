"""Samplers: temperature and truncation filters over a batch of logits, and inverse-CDF sampling.

Every filter is a pure function ``(B, V) -> (B, V)`` that sets removed tokens to ``-inf`` and takes
its parameter per row (a float, or a tensor of shape ``(B,)``), so one batch may mix settings. A row
whose parameter disables the filter (``top_k=0``, ``top_p=1``, ``min_p=0``, ``typical_p=1``,
``epsilon=0``, ``eta=0``, ``temperature=1``) passes through unchanged. Semantics follow the
transformers warpers with ``min_tokens_to_keep=1``, so the filters can be checked against them.

Apart from typical sampling, every filter keeps the tokens whose logit is at least a per-row
threshold ``thr`` (B, 1). The pipeline in :class:`Sampler` exploits that: the stages compose into one
threshold (the max of theirs, each computed on the distribution the earlier ones kept), applied once.
Nothing sorts all V logits: top-k, top-p and the inverse-CDF draw read a sorted window of the top of
each row (`top_window`, a few thousand values found through block maxima), and only rows whose
nucleus or draw reaches below that window sort their whole row (numpy's SIMD sort: on CPU ~25x faster
than ``torch.sort``). The results do not depend on the window's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

NEG_INF = float("-inf")

# Stage names, as SamplerConfig fields.
STAGES = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon", "eta")
# transformers `GenerationMixin._get_logits_processor`: temperature, top-k, top-p, min-p, typical,
# epsilon, eta.
HF_ORDER = STAGES
# vLLM V1 `Sampler.sample`: temperature, then the argmax-invariant processors (min-p), then top-k and
# top-p together (top-k first). vLLM has no typical/epsilon/eta; they follow in Hugging Face's order.
VLLM_ORDER = ("temperature", "min_p", "top_k", "top_p", "typical_p", "epsilon", "eta")
# A row with this value leaves the stage a no-op.
_NEUTRAL = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, epsilon=0.0, eta=0.0)


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


# ----------------------------------------------------------------------------------------------
# thresholds: (B, V) logits -> (B, 1) smallest logit kept. `sorted_asc` is sort_values(logits).


def top_k_threshold(logits: torch.Tensor, top_k, sorted_asc: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1): the k-th largest logit (ties with it are kept, as in TopKLogitsWarper).

    top_k = 0 disables (threshold -inf); top_k >= V keeps everything.
    """
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    V = sa.shape[-1]
    k = _row_param(top_k, sa, torch.long).expand(sa.shape[0], 1)
    kth = sa.gather(-1, (V - k.clamp(1, V)))  # ascending: the k-th largest sits at V - k
    return torch.where(k > 0, kth, NEG_INF)


def top_p_threshold(logits: torch.Tensor, top_p, sorted_asc: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) -> (B, 1): nucleus threshold, as TopPLogitsWarper.

    Ascending order, cumulative mass c_i = sum_{j <= i} p_j: token i is removed iff c_i <= 1 - top_p
    (the tail it closes holds at most 1 - top_p), the most probable token is always kept.
    Removed tokens form a prefix of the ascending order, so the cut is a threshold on the logit.
    top_p = 1 disables.
    """
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    V = sa.shape[-1]
    p = _row_param(top_p, sa, torch.float64).expand(sa.shape[0], 1)
    cum = sa.softmax(dim=-1).cumsum_(dim=-1)  # non-decreasing, so the removed count is a binary search
    tail = (1 - p).to(sa.dtype)  # 1 - top_p in double, then rounded, as the warper's scalar compare
    n_removed = torch.searchsorted(cum, tail.contiguous(), right=True).clamp(max=V - 1)
    return torch.where(p < 1, sa.gather(-1, n_removed), NEG_INF)


def min_p_threshold(logits: torch.Tensor, min_p) -> torch.Tensor:
    """(B, V) -> (B, 1): min-p keeps p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p).

    The softmax normalizer cancels, so no softmax is needed; the argmax always survives (min_p <= 1).
    min_p = 0 disables (log 0 = -inf).
    """
    m = _row_param(min_p, logits)
    return logits.amax(dim=-1, keepdim=True) + torch.log(m)


def epsilon_threshold(logits: torch.Tensor, epsilon) -> torch.Tensor:
    """(B, V) -> (B, 1): epsilon sampling keeps p_i >= epsilon  <=>  logit_i >= logsumexp + log(epsilon),
    and always the argmax (EpsilonLogitsWarper). epsilon = 0 disables."""
    eps = _row_param(epsilon, logits)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    return torch.minimum(lse + torch.log(eps), logits.amax(dim=-1, keepdim=True))


def eta_threshold(logits: torch.Tensor, eta) -> torch.Tensor:
    """(B, V) -> (B, 1): eta sampling (Hewitt et al. 2022, EtaLogitsWarper) keeps p_i >= cut with
    cut = min(eta, sqrt(eta) * exp(-H)), H the entropy of the row; always the argmax. eta = 0 disables."""
    e = _row_param(eta, logits)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    entropy = torch.special.entr((logits - lse).exp()).sum(dim=-1, keepdim=True)  # H = -sum p log p
    cut = torch.minimum(e, e.sqrt() * torch.exp(-entropy))
    return torch.minimum(lse + torch.log(cut), logits.amax(dim=-1, keepdim=True))


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


# ----------------------------------------------------------------------------------------------
# the top of each row: a sorted window that avoids sorting all V logits


@dataclass
class Window:
    """The top of each row of (B, V) logits, where tokens below ``thr`` count as removed.

    asc (B, W): ascending values; every kept token with logit > floor is among them, so positions
    with asc > floor are exactly the top of the row (tokens equal to floor may be missing); W is
    trimmed to the longest such top over the rows.
    cand (B, C): the candidate logits in token-id order (removed ones -inf), ids (B, C) their token ids
    (None: cand is the whole row). floor (B, 1): -inf when the window holds every kept token.
    """

    asc: torch.Tensor
    cand: torch.Tensor
    ids: torch.Tensor | None
    floor: torch.Tensor


def top_window(x: torch.Tensor, thr=NEG_INF, blocks: int = 256, block: int = 32) -> Window:
    """(B, V) -> Window over the logits with tokens < thr (B, 1) removed, sorting ~blocks * block values.

    Split each row into V / block blocks and take the `blocks` blocks with the largest maxima; f, the
    smallest of those maxima, is the blocks-th largest block maximum. A token > f lies in a taken block
    (its own block's maximum exceeds f), and at least `blocks` tokens are >= f (the taken maxima). So
    the taken blocks hold the top of the row down to f, and the k-th largest logit is
    max(asc[W - k], f) for every k <= blocks. When at most a quarter of the blocks hold a kept token,
    all of those are taken (floor -inf: the window is every kept token). Rows too short to gain use
    the whole row (floor -inf).
    """
    B, V = x.shape
    removed = torch.as_tensor(thr, dtype=x.dtype, device=x.device).reshape(-1, 1).expand(B, 1)
    any_removed = bool((removed > NEG_INF).any())
    if V % block or 4 * blocks * block > V:
        return whole_row_window(x, removed)
    bmax = x.view(B, V // block, block).amax(dim=-1)  # a block's maximum survives iff it is >= thr
    bmax = bmax.masked_fill(bmax < removed, NEG_INF) if any_removed else bmax
    live = int((bmax > NEG_INF).sum(dim=-1).max()) if any_removed else bmax.shape[-1]
    if blocks <= live <= V // block // 4:  # few blocks hold a kept token: take them all, floor -inf
        blocks = live
    top = bmax.topk(blocks, dim=-1)
    first = top.indices.sort(dim=-1).values * block  # blocks in id order -> candidates in id order
    ids = (first.unsqueeze(-1) + torch.arange(block, device=x.device)).reshape(B, blocks * block)
    cand = x.gather(-1, ids)
    cand = cand.masked_fill(cand < removed, NEG_INF) if any_removed else cand
    floor = top.values[:, -1:] if blocks < live else torch.full_like(top.values[:, -1:], NEG_INF)
    return _trimmed(Window(sort_values(cand), cand, ids, floor))


def whole_row_window(x: torch.Tensor, thr=NEG_INF) -> Window:
    """(B, V) -> Window of the whole rows (floor -inf), tokens < thr (B, 1) removed."""
    if bool((torch.as_tensor(thr) > NEG_INF).any()):
        x = x.masked_fill(x < thr, NEG_INF)
    return _trimmed(Window(sort_values(x), x, None, torch.full_like(x[:, :1], NEG_INF)))


def _trimmed(w: Window) -> Window:
    """Drop the leading positions no row needs (asc <= floor: removed or incomplete), keeping W >= 1."""
    n = max(int((w.asc > w.floor).sum(dim=-1).max()), 1)
    return Window(w.asc[:, w.asc.shape[-1] - n :].contiguous(), w.cand, w.ids, w.floor)


def kept_mass(x: torch.Tensor, m: torch.Tensor, thr=NEG_INF) -> torch.Tensor:
    """(B, V), max (B, 1), thr (B, 1) -> (B, 1) float64: S = sum_{x_i >= thr} exp(x_i - m), the kept
    mass relative to the max token (the softmax normalizer times exp(-m)). Removed tokens add exactly 0,
    so a row that already has them at -inf gives the same bits."""
    e = (x - m).exp_()
    if bool((torch.as_tensor(thr) > NEG_INF).any()):
        e.masked_fill_(x < thr, 0.0)
    return e.sum(dim=-1, keepdim=True).double()


def window_mass(w: Window, m: torch.Tensor, thr=NEG_INF, total: torch.Tensor | None = None):
    """Window, max m (B, 1) -> (cum (B, W), tail (B, 1)) float64: ascending cumulative kept mass
    c_j = tail + sum_{i <= j} exp(asc_i - m) over kept tokens inside the window (asc > floor), with
    tail = S - (window's kept mass) the mass of kept tokens below the window; 0 when floor = -inf."""
    keep = (w.asc > w.floor) & (w.asc >= thr)
    e = torch.exp(w.asc - m).masked_fill_(~keep, 0.0).double()
    cum = e.cumsum_(dim=-1)
    covered = (w.floor == NEG_INF) | (torch.as_tensor(thr, dtype=w.asc.dtype) > w.floor)  # no kept token below
    if total is None or bool(covered.all()):
        return cum, torch.zeros_like(cum[:, :1])
    tail = torch.where(covered, 0.0, (total - cum[:, -1:]).clamp_(min=0.0))
    return cum + tail, tail


def _window_token(w: Window, pos: torch.Tensor) -> torch.Tensor:
    """Window, (B, 1) positions in asc -> (B,) token ids. Ties (equal logits) share the rank interval:
    the j-th slot of a run of equal values goes to the j-th such token id (cand is in id order and
    holds every token equal to a value > floor)."""
    value = w.asc.gather(-1, pos)
    tie_rank = pos - torch.searchsorted(w.asc, value, right=False)  # 0 unless logits tie
    equal = w.cand == value
    if bool((tie_rank > 0).any()):
        equal &= equal.cumsum(dim=-1) == tie_rank + 1
    at = equal.byte().argmax(dim=-1, keepdim=True)  # the first (or the j-th) token holding the value
    return (at if w.ids is None else w.ids.gather(-1, at)).squeeze(-1)


def sample_inverse_cdf(logits: torch.Tensor, u: torch.Tensor, window: tuple[int, int] = (256, 32)) -> torch.Tensor:
    """(B, V) logits (removed tokens -inf), (B,) uniforms in [0, 1) -> (B,) long token ids drawn from
    softmax(logits).

    Rank-ordered inverse CDF: with tokens ordered from least to most probable and c their cumulative
    mass (total C), pick the first position i with c_i > (1 - u) * C. So u near 0 picks the most
    probable token, and the same u gives paired draws across samplers that share the ranking.
    P(i) = (c_i - c_{i-1}) / C exactly. A chosen i always has p_i > 0: c strictly increases there.
    Only the top of the row is sorted (see `top_window`, sizes `window`): the tokens below it form one
    interval [0, tail) of c; rows whose draw lands there ((1 - u) C < tail) sort their whole row.
    """
    m = logits.amax(dim=-1, keepdim=True)
    w = top_window(logits, NEG_INF, *window)
    total = kept_mass(logits, m) if bool((w.floor > NEG_INF).any()) else None
    return _draw(logits, NEG_INF, m, w, total, u)


def _draw(x, thr, m, w: Window, total, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of `sample_inverse_cdf` for x with tokens < thr removed -> (B,) long."""
    cum, tail = window_mass(w, m, NEG_INF, total)  # w already holds only the kept tokens
    target = (1 - u.to(cum.device, torch.float64)).reshape(-1, 1) * cum[:, -1:]
    pos = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[-1] - 1)
    tokens = _window_token(w, pos)
    below = (tail > target).squeeze(-1)  # the draw lands below the window: sort those whole rows
    if bool(below.any()):
        rows = below.nonzero().squeeze(-1)
        xr = x[rows]  # a copy: remove the tokens below thr in place
        if torch.is_tensor(thr) and bool((thr > NEG_INF).any()):
            xr.masked_fill_(xr < thr.expand(x.shape[0], 1)[rows], NEG_INF)
        full = whole_row_window(xr)
        cum_r, _ = window_mass(full, m[rows])
        target_r = (1 - u.to(cum.device, torch.float64)[rows]).reshape(-1, 1) * cum_r[:, -1:]
        pos_r = torch.searchsorted(cum_r, target_r, right=True).clamp_(max=cum_r.shape[-1] - 1)
        tokens[rows] = _window_token(full, pos_r)
    return tokens


def _top_p_cut(x, m, w: Window, thr, top_p) -> torch.Tensor:
    """Scaled (B, V), max (B, 1), Window of x, kept thr (B, 1), top_p (B, 1) -> (B, 1) nucleus threshold
    on the kept distribution (as `top_p_threshold` on x with tokens < thr removed).

    With ascending cumulative kept mass c (total C), token j is removed iff c_j <= (1 - top_p) C. The
    tokens below the window hold the interval [0, tail): all are removed iff tail <= (1 - top_p) C, and
    then the cut is inside the window; other rows (a flat row: the nucleus is wider than the window)
    take `top_p_threshold` on their whole row.
    """
    covered = (w.floor == NEG_INF) | (thr > w.floor)  # every kept token is in the window
    total = None if bool(covered.all()) else kept_mass(x, m, thr)
    cum, tail = window_mass(w, m, thr, total)
    cut = (1 - top_p).float().double() * cum[:, -1:]  # 1 - top_p rounded to float32, as the warper
    s = w.asc.gather(-1, torch.searchsorted(cum, cut, right=True).clamp_(max=cum.shape[-1] - 1))
    wide = ((tail > cut) & (top_p < 1)).squeeze(-1)
    if bool(wide.any()):
        rows = wide.nonzero().squeeze(-1)
        xr = x[rows]  # a copy: remove the tokens below thr in place
        s[rows] = top_p_threshold(xr.masked_fill_(xr < thr[rows], NEG_INF), top_p[rows])
    return torch.where(top_p < 1, s, NEG_INF)


def draw_uniforms(generator, batch_size: int, device=None) -> torch.Tensor:
    """One uniform per row, (B,) float32: `torch.rand(B, generator=g)` or one from each of B generators.
    Never touches the global RNG."""
    if isinstance(generator, torch.Generator):
        return torch.rand(batch_size, generator=generator, device=generator.device).to(device)
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch_size:
            raise ValueError(f"generator: got a list of {len(generator)} generators, need one per row ({batch_size})")
        return torch.cat([torch.rand(1, generator=g, device=g.device).to(device) for g in generator])
    raise ValueError(f"generator={generator!r} must be a torch.Generator or a list of {batch_size} of them")


# ----------------------------------------------------------------------------------------------
# configuration and pipeline


@dataclass(frozen=True)
class SamplerConfig:
    """One row's sampling settings. Defaults disable every filter (plain softmax sampling at T=1)."""

    temperature: float = 1.0  # >= 0; 0 = greedy
    top_k: int = 0  # >= 0; 0 = off
    top_p: float = 1.0  # (0, 1]; 1 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    typical_p: float = 1.0  # (0, 1]; 1 = off
    epsilon: float = 0.0  # [0, 1); 0 = off
    eta: float = 0.0  # [0, 1); 0 = off

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k)")
        checks = dict(
            temperature=(lambda v: v >= 0, ">= 0 (0 means greedy)"),
            top_p=(lambda v: 0 < v <= 1, "in (0, 1] (1 disables top-p)"),
            min_p=(lambda v: 0 <= v <= 1, "in [0, 1] (0 disables min-p)"),
            typical_p=(lambda v: 0 < v <= 1, "in (0, 1] (1 disables typical sampling)"),
            epsilon=(lambda v: 0 <= v < 1, "in [0, 1) (0 disables epsilon sampling)"),
            eta=(lambda v: 0 <= v < 1, "in [0, 1) (0 disables eta sampling)"),
        )
        for name, (ok, allowed) in checks.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):  # NaN fails ok()
                raise ValueError(f"{name}={value!r} must be a number {allowed}")
            object.__setattr__(self, name, float(value))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def label(self) -> str:
        """Short readable label: the active filters, then T, e.g. "min_p=0.1,T=1.0"; "greedy" at T=0."""
        if self.is_greedy:
            return "greedy"
        parts = [f"{f}={getattr(self, f):g}" for f in STAGES[1:] if getattr(self, f) != _NEUTRAL[f]]
        return ",".join(parts + [f"T={self.temperature}"])

    @property
    def name(self) -> str:
        return self.label()


def _resolve_order(order) -> tuple[str, ...]:
    if isinstance(order, str):
        presets = {"hf": HF_ORDER, "vllm": VLLM_ORDER}
        if order not in presets:
            raise ValueError(f"order={order!r} must be 'hf', 'vllm' or a list of stage names from {list(STAGES)}")
        return presets[order]
    names = tuple(order)
    for n in names:
        if n not in STAGES:
            raise ValueError(f"order: unknown stage {n!r}; allowed stage names are {list(STAGES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"order={list(names)!r} names a stage twice")
    return names


class Sampler:
    """Per-row sampling pipeline over (B, V) logits.

    Sampler(cfg) applies one config to every row; Sampler([cfg_0, ..., cfg_{B-1}]) one per row.
    order: "hf" (transformers: temperature, top-k, top-p, min-p, typical, epsilon, eta), "vllm"
    (vLLM V1: temperature, min-p, top-k, top-p, then typical, epsilon, eta), or an explicit list of
    stage names, e.g. ["top_p", "temperature"] to truncate before scaling. A stage missing from an
    explicit list is not applied, so a config that uses it raises ValueError.
    Temperature-0 rows are greedy whatever the order: one-hot on the raw argmax.
    """

    def __init__(self, configs: SamplerConfig | Sequence[SamplerConfig] = SamplerConfig(), order="hf",
                 window: tuple[int, int] = (256, 32)):
        self.configs = [configs] if isinstance(configs, SamplerConfig) else list(configs)
        if not self.configs or not all(isinstance(c, SamplerConfig) for c in self.configs):
            raise ValueError(f"configs={configs!r} must be a SamplerConfig or a non-empty list of them")
        self.per_row = not isinstance(configs, SamplerConfig)
        self.order = _resolve_order(order)
        self._cpu = {
            f: torch.tensor([getattr(c, f) for c in self.configs], dtype=torch.long if f == "top_k" else torch.float64)
            for f in STAGES
        }
        # stages some row actually uses, in pipeline order (the others are exact no-ops: skipped)
        active = {f for f in STAGES if bool((self._cpu[f] != _NEUTRAL[f]).any())}
        missing = sorted(active - set(self.order))
        if missing:
            raise ValueError(f"order={list(self.order)!r} leaves out {missing}, which the configs use")
        self.stages = [f for f in self.order if f in active]
        self._greedy_rows = self._cpu["temperature"] == 0
        self.is_greedy = bool(self._greedy_rows.all())
        self._any_greedy = bool(self._greedy_rows.any())
        self._on: dict = {}
        # (blocks, block size) of the sorted top window (speed only: the results do not depend on it);
        # top-k reads its k-th largest there, so the window takes at least max(top_k) blocks
        self.window = tuple(window)
        self._blocks = max(self.window[0], int(self._cpu["top_k"].max()))
        # threshold stages compose into one threshold when temperature (if any) comes first
        self._by_threshold = "typical_p" not in self.stages and "temperature" not in self.stages[1:]

    def __repr__(self) -> str:
        labels = sorted({c.label() for c in self.configs})
        return f"Sampler({'; '.join(labels)}, order={list(self.order)})"

    def label(self) -> str:
        return self.configs[0].label() if len(set(self.configs)) == 1 else "mixed"

    def to(self, device) -> "Sampler":
        """Move the per-row parameter tensors to device (done lazily anyway on first use)."""
        self._params(torch.device(device))
        return self

    def _params(self, device) -> dict:
        device = torch.device(device)
        if device not in self._on:
            p = {f: t.to(device) for f, t in self._cpu.items()}
            p["greedy"] = self._greedy_rows.to(device).reshape(-1, 1)
            self._on[device] = p
        return self._on[device]

    def _check(self, logits: torch.Tensor) -> None:
        if logits.ndim != 2:
            raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
        if self.per_row and logits.shape[0] != len(self.configs):
            raise ValueError(f"logits have {logits.shape[0]} rows but the sampler has {len(self.configs)} configs")

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V) float32 logits / T (T = 0 rows: / 1; they are made greedy at the end)."""
        x = logits.float()
        if "temperature" not in self.stages:
            return x
        t = self._params(x.device)["temperature"].reshape(-1, 1).to(x.dtype)
        return x / torch.where(t > 0, t, 1.0)

    def _thresholds(self, x: torch.Tensor):
        """Scaled (B, V) -> (max m (B, 1), thr (B, 1)): the pipeline keeps exactly x >= thr.

        Each threshold stage keeps x >= s on the tokens the earlier stages kept, x >= thr, so the
        stages compose to thr = max(thr, s), with s computed on the kept distribution: top-k's k-th
        largest of the kept tokens is max(thr, k-th largest of x); min-p's max never moves
        (s = m + log min_p); top-p, epsilon and eta renormalize over the kept mass. Greedy rows
        keep their max (thr = m); the one-hot or the argmax is taken by the caller.
        """
        p = {f: v.reshape(-1, 1).expand(x.shape[0], 1) for f, v in self._params(x.device).items()}  # (B, 1)
        m = x.amax(dim=-1, keepdim=True)
        thr = torch.full_like(m, NEG_INF)
        w = top_window(x, NEG_INF, self._blocks, self.window[1]) if {"top_k", "top_p"} & set(self.stages) else None
        for stage in self.stages:
            if stage == "top_k":
                k = p["top_k"]
                W = w.asc.shape[-1]
                kth = torch.maximum(w.asc.gather(-1, W - k.clamp(1, W)), w.floor)  # see top_window
                kth = torch.where(k > W, w.floor, kth)  # fewer than k tokens above floor: floor is the k-th
                s = torch.where(k > 0, kth, NEG_INF)
            elif stage == "top_p":
                s = _top_p_cut(x, m, w, thr, p["top_p"])
            elif stage == "min_p":
                s = m + torch.log(p["min_p"].to(x.dtype))
            elif stage in ("epsilon", "eta"):
                fn = epsilon_threshold if stage == "epsilon" else eta_threshold
                s = fn(x.masked_fill(x < thr, NEG_INF), p[stage])
            else:  # temperature: already in x
                continue
            thr = torch.maximum(thr, s)
        return m, (torch.where(p["greedy"], m, thr) if self._any_greedy else thr)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B,) long: argmax of the raw logits, the first id on ties (numpy's is ~20x faster on CPU)."""
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            return torch.from_numpy(logits.detach().contiguous().numpy().argmax(axis=-1)).long()
        return logits.argmax(dim=-1)

    def _one_hot_greedy_rows(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Temperature-0 rows of out (B, V) become one-hot on the raw argmax, in place."""
        if self._any_greedy:
            rows = self._params(out.device)["greedy"].reshape(-1).nonzero().squeeze(-1)
            ids = self._greedy(logits.float())[rows].to(out.device)
            kept = logits.float()[rows, ids]
            out[rows] = NEG_INF
            out[rows, ids] = kept
        return out

    def _legacy(self, logits: torch.Tensor) -> torch.Tensor:
        """Stage by stage, for pipelines the threshold algebra does not cover (typical sampling, or
        temperature after truncation)."""
        x, p = logits.float(), self._params(logits.device)
        filters = dict(top_k=top_k_filter, top_p=top_p_filter, min_p=min_p_filter, typical_p=typical_filter,
                       epsilon=epsilon_filter, eta=eta_filter)
        for stage in self.stages:
            if stage == "temperature":
                t = p["temperature"].reshape(-1, 1).to(x.dtype)
                x = x / torch.where(t > 0, t, 1.0)
            else:
                x = filters[stage](x, p[stage])
        return self._one_hot_greedy_rows(logits, x.clone() if x.data_ptr() == logits.data_ptr() else x)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V) float32: temperature and filters in order, removed tokens at -inf."""
        self._check(logits)
        if self._by_threshold:
            x = self._scaled(logits)
            m, thr = self._thresholds(x)
            out = x.masked_fill(x < thr, NEG_INF)
            return self._one_hot_greedy_rows(logits, out)
        return self._legacy(logits)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V): the sampling distribution, rows sum to 1; temperature-0 rows one-hot."""
        return self.process(logits).softmax(dim=-1)

    def sample(self, logits: torch.Tensor, generator) -> torch.Tensor:
        """(B, V) -> (B,) long. One uniform per row from `generator` (a torch.Generator, or a list of B),
        drawn even for greedy rows so that generator streams stay aligned across samplers.
        The same draw as ``sample_inverse_cdf(self.process(logits), u)``, without writing the
        processed (B, V) logits: only the window above the kept threshold is sorted."""
        self._check(logits)
        u = draw_uniforms(generator, logits.shape[0], logits.device)
        if self.is_greedy:
            return self._greedy(logits)
        if not self._by_threshold:
            return sample_inverse_cdf(self._legacy(logits), u, self.window)
        x = self._scaled(logits)
        m, thr = self._thresholds(x)
        w = top_window(x, thr, *self.window)
        total = kept_mass(x, m, thr) if bool((w.floor > NEG_INF).any()) else None
        tokens = _draw(x, thr, m, w, total, u)
        if self._any_greedy:
            tokens = torch.where(self._params(x.device)["greedy"].reshape(-1), self._greedy(logits.float()), tokens)
        return tokens
