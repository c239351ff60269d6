"""Samplers: a per-row pipeline of temperature and truncation filters, and a sort-free inverse-CDF draw.

The filters themselves (pure ``(B, V) -> (B, V)`` functions and their per-row thresholds) are in
:mod:`decodelab.core.filters`; their names are importable from here too. :class:`Sampler` runs them in
a chosen stage order over a batch whose rows may each have their own :class:`SamplerConfig`.

Apart from typical sampling every filter is a threshold on the logit. Cost: nothing sorts the whole
vocabulary unless it must. Temperature and min-p need no sort (min-p is a threshold on the row's max); top-k
reads its k-th largest value from each row's k + 1 largest (``filters.top_window``, one ``torch.topk``);
top-p on CPU takes each row's threshold from a window of its largest values that provably holds the nucleus,
checked exactly, and sorts only the rows no window decides (flat rows, or a boundary within rounding of the
float32 reference): ``nucleus.top_p_threshold_rows``, bit for bit the full-sort threshold. The last
threshold of the pipeline is not applied as a masked copy: the draw applies it (``sample_inverse_cdf(x, u,
threshold)``), each row over its kept ids alone when they are few. In a batch mixing greedy and sampled
rows, ``sample`` runs the pipeline with placeholder rows in place of the greedy ones and gives those their
argmax after (the same thresholds and law per row). In ``sample`` the top-p search's weights exp(x - max)
(``nucleus.row_weights``, for the rows with top_p < 1 only) are computed once and handed to the draw, and x
is not masked before a last min-p stage (min-p reads the row max alone): the draw applies the earlier
thresholds as a floor (``sample_inverse_cdf(x, u, thr, weights=, floor=)``), which gives the tokens the
masked logits give, token for token (tests/core/test_sampler_shared.py).

The draw (``sample_inverse_cdf``, in :mod:`decodelab.core.draw`) needs no sort: head-first inverse CDF
(the argmax, then the other tokens in vocabulary order), P(token i) = softmax(processed logits)_i up to
float rounding. (Until issue 15 it ranked tokens by probability, a full sort per row: the same seed now
draws other tokens, same law.)

Common random numbers: ``Sampler.sample`` draws exactly one uniform u per row from the passed generator
(also for greedy rows) and maps it to a token by that inverse CDF. Two samplers given generators in the
same state therefore use the same u for each row and step, and their draws are coupled this way: u below
both samplers' (renormalized) argmax probabilities picks the argmax in both, which every threshold
filter keeps; above that, the tokens follow in vocabulary order, so where the two kept sets differ the
intervals of later ids shift and the two draws decouple (a rank-ordered draw kept the head's intervals
aligned further down the ranking, at the price of the sort). Paired comparisons stay coupled on the
argmax, which holds most of the mass of a confident LM step: equal uniforms -> equal tokens for two
samplers that keep the same set (e.g. top_p = 1 and plain temperature sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from decodelab.core.draw import _mask_below_, argmax_rows, sample_inverse_cdf, scratch
from decodelab.core.filters import (
    _WINDOW_FRACTION,
    NEG_INF,
    apply_temperature,
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
    top_window,
    typical_filter,
)
from decodelab.core.nucleus import row_weights, top_p_threshold_rows

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
        # sample() draws a mixed batch with a sampler whose greedy rows are placeholders, then gives those
        # rows their argmax: the same thresholds and law per row, without masking greedy rows to one-hot
        # or copying the sampled rows out (every stage works row by row). The placeholder keeps only the
        # max (min_p = 1), so its draw takes the cheap path over one kept id.
        self._sampled = None
        if self._any_greedy and not self.is_greedy:
            placeholder = SamplerConfig(min_p=1.0) if "min_p" in self.order else SamplerConfig()
            rows = [placeholder if c.temperature == 0 else c for c in self.configs]
            self._sampled = (self._greedy_rows.nonzero().reshape(-1), Sampler(rows, order=self.order))

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

    def _run(self, logits: torch.Tensor, defer_last: bool = False):
        """(B, V) -> (processed (B, V) float32, deferred threshold (B, 1) or None, shared).

        With defer_last, a last stage that is a threshold is not applied to the logits: its threshold is
        returned instead, for the draw to apply (``sample_inverse_cdf``), which saves a masked copy.
        shared: {"weights", "floor"} for the draw when the top-p search computed exp(x - max) for its rows
        and only thresholds (running maximum: floor) masked x since, else {}."""
        self._check(logits)
        x = logits.float()
        p = self._params(x.device)
        sa = None  # an ascending copy of x's values (or a window standing for it), when a stage has one
        shared = {}  # the top-p search's weights, kept for the draw while x changes only by masking
        row_m = None  # x's row max once known (masking by thresholds keeps it: the max is always kept)
        for i, stage in enumerate(self.stages):
            if stage == "temperature":
                shared, row_m = {}, None
                if self._any_greedy:
                    x, sa = apply_temperature(x, p["temperature"]), None
                    continue
                t = p["temperature"].reshape(-1, 1).to(x.dtype)
                if defer_last and x.device.type == "cpu" and x.dtype == torch.float32:  # sample(): x stays inside
                    x = torch.div(x, t, out=scratch("sampler.x", tuple(x.shape)))
                else:
                    x = x / t  # the one copy; later stages work in place on x and sa
                if sa is not None:
                    sa.div_(t)
                continue
            if stage == "typical_p":
                x, sa, shared, row_m = typical_filter(x, p["typical_p"]), None, {}, None  # not a threshold
                continue
            thr = None
            if stage == "top_p" and sa is None:
                # a window of the largest values that provably holds every row's nucleus: no full sort
                if x.device.type == "cpu":  # per row: a window that holds the nucleus, or the row's sort
                    weights = None
                    # the draw reuses exp(x - max) for the rows it draws dense (flat nuclei, or a later
                    # stage off); peaked rows are drawn by their few kept ids and read x alone
                    if defer_last and x.dtype == torch.float32:
                        needs = np.broadcast_to(self._cpu["top_p"].numpy() < 1, (x.shape[0],))
                        weights = row_weights(x, rows=np.flatnonzero(needs), out="sampler.weights")  # the search's rows
                        row_m = weights.max
                        shared = {"weights": weights, "floor": torch.full_like(row_m, NEG_INF)}
                        if not bool(torch.isfinite(row_m).all()):
                            shared = {}
                    thr = top_p_threshold_rows(x, p["top_p"], weights=weights)
                else:
                    sa = sorted_kept(x)
            if stage == "top_k" and sa is None and x.device.type == "cpu":
                # each row's k + 1 largest values (and more, aligned): the k-th largest is read from them, and
                # after the cut the window stands for the full sort (its first entry falls below the cut)
                k_max, V = int(self._cpu["top_k"].max()), x.shape[-1]
                if 0 < k_max <= V // (4 * _WINDOW_FRACTION) and bool((self._cpu["top_k"] > 0).all()):
                    sa = top_window(x, k_max + 1)
            if thr is None:
                thr = {
                    "top_k": lambda: top_k_threshold(x, p["top_k"], sa),
                    "top_p": lambda: top_p_threshold(x, p["top_p"], sa),
                    "min_p": lambda: min_p_threshold(x if sa is None else sa, p["min_p"], row_m),  # same row max
                    "epsilon": lambda: epsilon_threshold(x, p["epsilon"]),
                    "eta": lambda: eta_threshold(x, p["eta"]),
                }[stage]()
            if defer_last and i == len(self.stages) - 1:
                if self._any_greedy:  # greedy rows keep their one-hot (below) whole
                    thr = torch.where(p["greedy"], NEG_INF, thr.to(x.device))
                    shared = {}
                return self._greedy_rows_onehot(logits, x, p), thr, shared
            if shared:
                shared["floor"] = torch.maximum(shared["floor"], thr.to(shared["floor"].dtype))
                if sa is None and set(self.stages[i + 1:]) <= {"min_p"}:
                    continue  # min-p reads the row max alone, and the draw applies the floor: no masked x
            # the same threshold on the logits and on their sorted copy keeps the two consistent
            x = x.clone() if x.data_ptr() == logits.data_ptr() else x
            _mask_below_(x, thr)
            if sa is not None:
                _mask_below_(sa, thr)
                if sa.shape[-1] < x.shape[-1] and not is_full_window(sa):
                    sa = None  # a kept value may lie outside the window (top-k off in a row, long ties)
        return self._greedy_rows_onehot(logits, x, p), None, {} if self._any_greedy else shared

    def _greedy_rows_onehot(self, logits: torch.Tensor, x: torch.Tensor, p: dict) -> torch.Tensor:
        """T = 0 rows: one-hot on the raw argmax, whatever ran before; other rows x."""
        if not self._any_greedy:
            return x
        raw = logits.float()
        onehot = torch.zeros_like(raw, dtype=torch.bool).scatter_(-1, raw.argmax(-1, keepdim=True), True)
        return torch.where(p["greedy"], raw.masked_fill(~onehot, NEG_INF), x)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) -> (B, V) float32: temperature and filters in order, removed tokens at -inf."""
        return self._run(logits)[0]

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
        if self._sampled is not None:
            greedy, sampler = self._sampled
            greedy = greedy.to(logits.device)
            x, thr, shared = sampler._run(logits, defer_last=True)
            tokens = sample_inverse_cdf(x, u, thr, **shared)
            tokens[greedy] = argmax_rows(logits.index_select(0, greedy)).to(tokens.device)
            return tokens
        x, thr, shared = self._run(logits, defer_last=True)
        return sample_inverse_cdf(x, u, thr, **shared)
