"""Samplers: a per-row pipeline of temperature and truncation filters, and the inverse-CDF draw.

The filters themselves (pure ``(B, V) -> (B, V)`` functions and their per-row thresholds) are in
:mod:`decodelab.core.filters`; their names are importable from here too. :class:`Sampler` runs them in
a chosen stage order over a batch whose rows may each have their own :class:`SamplerConfig`.

Apart from typical sampling every filter is a threshold on the logit, and the pipeline exploits that:
it keeps one ascending copy of each row's values, and applies each threshold both to the logits and to
that copy, which stays sorted. Top-p and the final inverse-CDF draw read it.

Cost: the copy is a full sort only where it has to be. The temperature and min-p stages need none (min-p is a
threshold on the row's max); top-k reads its k-th largest value from the values above a one-pass lower
bound (``filters.chunk_max_bound``), sorted: no full sort; after top-k or min-p the kept set is
small, and the copy is the window of the L largest values, which stands for the
full sorted row because everything left out of it is -inf (``filters.sorted_kept``). The full sort
stays where the kept set is broad: plain temperature sampling and top-p applied first. There the
draw's float rounding depends on the softmax normalizer summed over the whole sorted row, which no
window reproduces; a window would change a draw where a uniform falls within rounding of an interval
boundary, so same seed -> same token could not be promised.

Common random numbers: ``Sampler.sample`` draws exactly one uniform u per row from the passed generator
(also for greedy rows) and maps it to a token by the inverse CDF over the tokens ranked from least to
most probable (``sample_inverse_cdf``): u near 0 picks the most probable token. Two samplers given
generators in the same state therefore use the same u for each row and step, and their draws are
coupled: a filter that keeps the head moves each head token's interval only by the renormalization, so
paired comparisons between samplers see the differences of the filters, not of the noise. The fast
paths above change no arithmetic that decides a token (the same values, in the same order, through the
same kernels), so tokens are identical to the full-sort pipeline's for the same generator state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from decodelab.core.filters import (
    _WINDOW_FRACTION,
    NEG_INF,
    apply_temperature,
    candidates_window,
    chunk_max_bound,
    epsilon_filter,
    epsilon_threshold,
    eta_filter,
    eta_threshold,
    is_full_window,
    min_p_filter,
    min_p_threshold,
    sort_values,
    sorted_kept,
    top_k_filter,
    top_k_threshold,
    top_p_filter,
    top_p_threshold,
    typical_filter,
)

__all__ = [  # the filters are re-exported: callers import every sampling name from here
    "HF_ORDER", "NEG_INF", "STAGES", "VLLM_ORDER", "Sampler", "SamplerConfig", "apply_temperature",
    "argmax_rows", "draw_uniforms", "epsilon_filter", "epsilon_threshold", "eta_filter", "eta_threshold",
    "min_p_filter", "min_p_threshold", "sample_inverse_cdf", "sort_values", "top_k_filter", "top_k_threshold",
    "top_p_filter", "top_p_threshold", "typical_filter",
]

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


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) long: each row's first maximal index, as ``torch.argmax``.

    On CPU numpy's argmax is used: for (64, 49152) float32 it is ~10x faster than torch's, which
    matters in greedy decoding's per-step path.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        import numpy as np

        return torch.from_numpy(np.argmax(logits.detach().contiguous().numpy(), axis=-1).astype(np.int64))
    return logits.argmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# sampling


def sample_inverse_cdf(logits: torch.Tensor, u: torch.Tensor, sorted_asc: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits, (B,) uniforms in [0, 1) -> (B,) long token ids drawn from softmax(logits).

    Rank-ordered inverse CDF: with tokens ordered from least to most probable and c their cumulative
    mass (total C), pick the first position i with c_i > (1 - u) * C. So u near 0 picks the most
    probable token, and the same u gives paired draws across samplers that share the ranking
    (truncating the tail never moves the head's intervals by more than the renormalization).
    P(i) = (c_i - c_{i-1}) / C exactly. A chosen i always has p_i > 0: c strictly increases there
    (adding a float 0 never does), and the clamp for (1 - u) C rounding up to C lands on the argmax.
    Ties (equal logits) share the rank interval: the j-th of them in the order goes to the j-th
    such token id.
    `sorted_asc` may be a window of the sorted row that stands for all of it (``filters.sorted_kept``):
    the left-out entries are -inf, add 0 to every sum, and positions keep their offset from the end.
    """
    sa = sort_values(logits) if sorted_asc is None else sorted_asc
    B, V = sa.shape
    cum = sa.softmax(dim=-1).cumsum_(dim=-1)
    target = (1 - u.to(cum.device, cum.dtype)).reshape(B, 1) * cum[:, -1:]
    pos = torch.searchsorted(cum, target, right=True).clamp(max=V - 1)  # (B, 1)
    value = sa.gather(-1, pos)
    # position within the run of equal values; 0 for every row unless logits tie
    tie_rank = pos - torch.searchsorted(sa, value, right=False)
    return _nth_token_with_value(logits, value, tie_rank)


def _nth_token_with_value(logits: torch.Tensor, value: torch.Tensor, tie_rank: torch.Tensor) -> torch.Tensor:
    """(B, V), (B, 1), (B, 1) -> (B,) long: per row the (tie_rank + 1)-th token id whose logit equals value."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        xn, vn, rn = logits.detach().contiguous().numpy(), value.numpy(), tie_rank.numpy()[:, 0]
        equal = xn == vn
        tokens = np.argmax(equal, axis=-1)  # the first token holding that value
        for row in np.flatnonzero(rn > 0):  # ties: slot j of the run goes to the j-th such token id
            tokens[row] = np.flatnonzero(equal[row])[rn[row]]
        return torch.from_numpy(tokens.astype(np.int64))
    equal = logits == value
    if not bool((tie_rank > 0).any()):
        return equal.view(torch.uint8).argmax(dim=-1)  # the one token holding that value
    # the run of equal values holds one slot per tied token: slot j goes to the j-th such token id
    nth = equal.cumsum(dim=-1)  # 1-based count of equal tokens up to each id
    return (equal & (nth == tie_rank + 1)).view(torch.uint8).argmax(dim=-1)


def _mask_below_(x: torch.Tensor, thr: torch.Tensor) -> None:
    """In place: x[x < thr] = -inf, (B, V) and (B, 1); numpy's masked copy on CPU (same values, ~5x faster)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.is_contiguous():
        xn = x.numpy()
        np.copyto(xn, NEG_INF, where=xn < thr.detach().numpy())  # numpy promotes as torch does
    else:
        x.masked_fill_(x < thr, NEG_INF)


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

    def __init__(self, configs: SamplerConfig | Sequence[SamplerConfig] = SamplerConfig(), order="hf"):
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

    def _run(self, logits: torch.Tensor, need_sorted: bool):
        """(B, V) -> processed (B, V) float32 and, if need_sorted, its ascending copy (or None): the full
        sort or a window of it that stands for the full sort (``filters.sorted_kept``)."""
        self._check(logits)
        x = logits.float()
        p = self._params(x.device)
        sa = None
        for stage in self.stages:
            if stage == "temperature":
                if self._any_greedy:
                    x, sa = apply_temperature(x, p["temperature"]), None
                    continue
                t = p["temperature"].reshape(-1, 1).to(x.dtype)
                x = x / t  # the one copy; later stages work in place on x and sa
                if sa is not None:
                    sa.div_(t)
                continue
            if stage == "typical_p":
                x, sa = typical_filter(x, p["typical_p"]), None  # not a threshold: the sort goes stale
                continue
            if stage == "top_p" and sa is None:
                sa = sorted_kept(x)
            if stage == "top_k" and sa is None and x.device.type == "cpu":
                # every value >= a lower bound on the k-th largest: a window holding each row's top k,
                # so the k-th largest is read from it; after the cut it stands for the full sort
                k_max, V = int(self._cpu["top_k"].max()), x.shape[-1]
                bound = None
                if 0 < k_max <= V // (4 * _WINDOW_FRACTION) and bool((self._cpu["top_k"] > 0).all()):
                    bound = chunk_max_bound(x, k_max)
                if bound is not None:
                    sa = candidates_window(x, bound, min_length=k_max)
            thr = {
                "top_k": lambda: top_k_threshold(x, p["top_k"], sa),
                "top_p": lambda: top_p_threshold(x, p["top_p"], sa),
                "min_p": lambda: min_p_threshold(x if sa is None else sa, p["min_p"]),  # same row max
                "epsilon": lambda: epsilon_threshold(x, p["epsilon"]),
                "eta": lambda: eta_threshold(x, p["eta"]),
            }[stage]()
            # the same threshold on the logits and on their sorted copy keeps the two consistent
            x = x.clone() if x.data_ptr() == logits.data_ptr() else x
            _mask_below_(x, thr)
            if sa is not None:
                _mask_below_(sa, thr)
                if sa.shape[-1] < x.shape[-1] and not is_full_window(sa):
                    sa = None  # a kept value may lie outside the window (top-k off in a row, long ties)
        if self._any_greedy:  # T = 0: one-hot on the raw argmax, whatever ran before
            raw = logits.float()
            onehot = torch.zeros_like(raw, dtype=torch.bool).scatter_(-1, raw.argmax(-1, keepdim=True), True)
            x = torch.where(p["greedy"], raw.masked_fill(~onehot, NEG_INF), x)
            sa = None
        if need_sorted and sa is None:
            sa = sorted_kept(x)
        return x, sa

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V) float32: temperature and filters in order, removed tokens at -inf."""
        return self._run(logits, need_sorted=False)[0]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V): the sampling distribution, rows sum to 1; temperature-0 rows one-hot."""
        return self.process(logits).softmax(dim=-1)

    def sample(self, logits: torch.Tensor, generator) -> torch.Tensor:
        """(B, V) -> (B,) long. One uniform per row from `generator` (a torch.Generator, or a list of B),
        drawn even for greedy rows so that generator streams stay aligned across samplers."""
        self._check(logits)
        u = draw_uniforms(generator, logits.shape[0], logits.device)
        if self.is_greedy:
            return argmax_rows(logits)
        x, sa = self._run(logits, need_sorted=True)
        return sample_inverse_cdf(x, u, sa)
