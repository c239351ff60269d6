"""A roofline cost model for decode and verify steps, and what it predicts for speculative decoding.

Step time of a dense decoder processing n tokens in each of B rows with context S:

    T(B, n) = max(FLOPs / peak, bytes / bandwidth) + overhead            (combine="max", a GPU)
    T(B, n) = FLOPs / peak + bytes / bandwidth + overhead                 (combine="sum", no overlap)
    FLOPs   = 2 * P_matmul * B * n + 4 * L * H * d_h * S * B * n          (weights + attention)
    bytes   = P_read * b_w + B * S * kv_bytes_per_token                   (weights once + the KV cache)

At small B the weights dominate the bytes and a verify step of n = k+1 tokens costs about as much as a
decode step: speculation is nearly free. When B*n grows the step turns compute-bound and a verify
step costs ~n times a decode step: speculation loses. Leviathan et al. (2023) give the expected
tokens per verify step with per-token acceptance a and k drafts: (1 - a^(k+1)) / (1 - a); with
batching the speedup is tokens(a, k) * T(B, 1) / (k * T_draft(B) + T(B, k+1)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from decodelab.core.transformer import head_dim_of
from decodelab.speculation import acceptance_model as am
from decodelab.speculation.acceptance_model import expected_tokens, fit_alpha  # public here too (roofline.fit_alpha)


@dataclass(frozen=True)
class Hardware:
    """peak: FLOP/s, bandwidth: bytes/s, overhead: seconds per step; combine: "max" or "sum";
    memory: bytes of device memory (0 = unknown: no capacity limit)."""

    name: str
    peak: float
    bandwidth: float
    overhead: float = 0.0
    combine: str = "max"
    memory: float = 0.0

    def tensor_parallel(self, n: int) -> "Hardware":
        """n such devices with the model split across them (peak, bandwidth, memory x n; the
        all-reduce cost is not modelled)."""
        return replace(self, name=f"{n}x{self.name}", peak=self.peak * n, bandwidth=self.bandwidth * n,
                       memory=self.memory * n)


# Spec sheets (dense bf16 tensor-core peak, HBM bandwidth). Overhead: a per-step launch/host cost
# typical of a CUDA-graphed decoder (vLLM/gpt-fast class); eager PyTorch is several ms more.
SPEC_SHEETS = {
    "A100-80GB": Hardware("A100-80GB", peak=312e12, bandwidth=2.039e12, overhead=1e-3, memory=80e9),
    "H100-SXM": Hardware("H100-SXM", peak=989e12, bandwidth=3.35e12, overhead=1e-3, memory=80e9),
    "H200": Hardware("H200", peak=989e12, bandwidth=4.8e12, overhead=1e-3, memory=141e9),
}
# Fraction of the spec sheet a tuned decoder reaches (rule of thumb: ~70% of peak FLOPs in large
# GEMMs, ~80% of HBM bandwidth in streaming reads).
ACHIEVABLE = {"peak": 0.7, "bandwidth": 0.8}


def spec_sheet(name: str, *, achievable: bool = True) -> Hardware:
    if name not in SPEC_SHEETS:
        raise ValueError(f"hardware={name!r} is unknown; allowed: {sorted(SPEC_SHEETS)}")
    hw = SPEC_SHEETS[name]
    if achievable:
        hw = replace(hw, peak=hw.peak * ACHIEVABLE["peak"], bandwidth=hw.bandwidth * ACHIEVABLE["bandwidth"])
    return hw


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs from a dense decoder's config."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: float = 2.0  # bf16
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config, *, name: str | None = None, bytes_per_param: float = 2.0) -> "ModelShape":
        return cls(name or getattr(config, "_name_or_path", "") or config.model_type, config.num_hidden_layers,
                   config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim_of(config),
                   config.intermediate_size, config.vocab_size, bytes_per_param,
                   bool(getattr(config, "tie_word_embeddings", False)))

    def with_layers(self, n_layers: int) -> "ModelShape":
        """The same model with n_layers decoder layers (a layer-skip draft's cost)."""
        return replace(self, name=f"{self.name}[{n_layers} layers]", n_layers=n_layers)

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)  # q, o, k, v
        return attn + 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: every layer + the LM head (the embedding is a lookup)."""
        return self.n_layers * self.layer_params + self.hidden * self.vocab

    @property
    def weight_bytes(self) -> float:
        """Bytes read per step: every matmul weight once (a tied embedding is the LM head)."""
        return self.matmul_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.bytes_per_param

    def flops(self, batch, n_tokens, context) -> np.ndarray:
        # (2 P + 4 L H d s) b n: the matmuls and attention's QK^T and PV over s cached positions
        b, n, s = (np.asarray(x, dtype=float) for x in (batch, n_tokens, context))
        return (2 * self.matmul_params + 4 * self.n_layers * self.n_heads * self.head_dim * s) * (b * n)

    def bytes(self, batch, n_tokens, context) -> np.ndarray:
        b, n, s = (np.asarray(x, dtype=float) for x in (batch, n_tokens, context))
        return self.weight_bytes + b * (s + n) * self.kv_bytes_per_token


# Dense reference models (configs as published on the hub).
SHAPES = {
    "Qwen2.5-7B": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "Qwen2.5-0.5B": ModelShape("Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151936, tied_embeddings=True),
    "Llama-3-70B": ModelShape("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
    "Llama-3-8B": ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
    "Llama-3.2-1B": ModelShape("Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, tied_embeddings=True),
}


def devices_needed(shape: ModelShape, hw: Hardware, *, weight_fraction: float = 0.5) -> int:
    """Smallest power-of-two device count whose memory holds the weights in `weight_fraction` of it
    (the rest for the KV cache and activations)."""
    if not hw.memory:
        return 1
    n = 1
    while shape.weight_bytes > weight_fraction * hw.memory * n:
        n *= 2
    return n


def max_batch(shape: ModelShape, hw: Hardware, context: float, *, draft: ModelShape | None = None) -> int:
    """Largest batch whose KV cache at `context` (target + draft) fits beside the weights (0 = none)."""
    if not hw.memory:
        return 2**31
    weights = shape.weight_bytes + (draft.weight_bytes if draft is not None else 0)
    per_row = context * (shape.kv_bytes_per_token + (draft.kv_bytes_per_token if draft is not None else 0))
    return max(0, int((hw.memory - weights) // per_row))


def step_time(shape: ModelShape, hw: Hardware, batch, n_tokens, context) -> np.ndarray:
    """Predicted seconds of one forward of n_tokens per row for `batch` rows at `context` positions.

    A scalar batch and context with n_tokens an array (a policy's per-step question: every width at this
    step's context) take a short path of a few array operations: the policy asks it after every forward,
    when the CPU's caches are cold and each numpy call costs several microseconds."""
    if np.isscalar(batch) and np.isscalar(context):
        b, s = float(batch), float(context)
        n = np.asarray(n_tokens, dtype=float)
        per_token_flops = (2 * shape.matmul_params + 4 * shape.n_layers * shape.n_heads * shape.head_dim * s) * b
        kv = b * shape.kv_bytes_per_token
        compute = n * (per_token_flops / hw.peak)
        memory = n * (kv / hw.bandwidth) + (shape.weight_bytes + s * kv) / hw.bandwidth
    else:
        compute = shape.flops(batch, n_tokens, context) / hw.peak
        memory = shape.bytes(batch, n_tokens, context) / hw.bandwidth
    core = np.maximum(compute, memory) if hw.combine == "max" else compute + memory
    return core + hw.overhead


@dataclass(frozen=True)
class Fit:
    hardware: Hardware
    median_rel_error: float  # of the fitted step times against the measured ones
    n_points: int
    parameters: tuple[str, ...] = ("peak", "bandwidth", "overhead")  # what the fit chose (the rest: dropped)
    note: str = ""  # why parameters were dropped, when they were


HARDWARE_PARAMETERS = ("peak", "bandwidth", "overhead")


def fit_hardware(shape: ModelShape, batch, n_tokens, context, seconds, *, combine: str = "max",
                 name: str = "fitted") -> Fit:
    """Least-squares fit (in relative error) of peak, bandwidth and overhead to measured step times.

    batch, n_tokens, context, seconds: equal-length sequences, one per measured step (median of repeats).
    Fewer than 3 steps cannot pin 3 numbers, so the fit narrows instead of failing: with 2 steps it
    fits peak and overhead (bandwidth -> infinity, the bytes term dropped: at one batch the bytes barely
    change with the tokens per row, so only FLOPs can tell two steps apart); with 1 step only the
    overhead (every step costs what was measured). `Fit.parameters` and `Fit.note` say which.
    """
    from scipy.optimize import least_squares

    if combine not in ("max", "sum"):
        raise ValueError(f"combine={combine!r} must be 'max' or 'sum'")
    t = np.asarray(seconds, dtype=float)
    if len(t) < 1:
        raise ValueError("need >= 1 measured step to fit the roofline, got none")
    free = [0, 1, 2] if len(t) >= 3 else [0, 2] if len(t) == 2 else [2]
    flops, nbytes = shape.flops(batch, n_tokens, context), shape.bytes(batch, n_tokens, context)

    def full(xf):  # x = log(1/peak), log(1/bandwidth), log(overhead); a dropped term is exp(-inf) = 0
        x = np.full(3, -np.inf)
        x[free] = xf
        return x

    def model(xf):
        x = full(xf)
        compute, memory = flops * np.exp(x[0]), nbytes * np.exp(x[1])
        core = np.maximum(compute, memory) if combine == "max" else compute + memory
        return core + np.exp(x[2])

    def residual(xf):
        return (model(xf) - t) / t

    # start from a compute-only and a memory-only reading of the data, at a small overhead
    x0 = np.log([np.median(t / flops), np.median(t / nbytes) / 2, max(t.min() / 10, 1e-6)])
    if len(free) == 1:
        x0[2] = np.log(np.median(t))
    best = None
    for shift in (np.array([0.0, 0.0, 0.0]), np.array([1.0, -1.0, 0.0]), np.array([-1.0, 1.0, 1.0])):
        sol = least_squares(residual, (x0 + shift)[free], method="lm" if len(t) > len(free) else "trf")
        if best is None or sol.cost < best.cost:
            best = sol
    with np.errstate(over="ignore"):
        peak, bandwidth, overhead = np.exp(-full(best.x)[:2]).tolist() + [float(np.exp(full(best.x)[2]))]
    hw = Hardware(name, peak=float(peak), bandwidth=float(bandwidth), overhead=overhead, combine=combine)
    parameters = tuple(HARDWARE_PARAMETERS[i] for i in free)
    note = "" if len(free) == 3 else (f"only {len(t)} measured step(s): fitted {', '.join(parameters)}; "
                                     f"{', '.join(p for p in HARDWARE_PARAMETERS if p not in parameters)} dropped")
    return Fit(hw, float(np.median(np.abs(residual(best.x)))), len(t), parameters, note)


def predicted_speedup(alpha, k, t_plain, t_draft_per_token, t_verify) -> np.ndarray:
    """tokens(a, k) * T(B, 1) / (k * T_draft(B) + T(B, k+1)); k = 0 gives 1 (plain decoding)."""
    return expected_tokens(alpha, k) * np.asarray(t_plain) / (np.asarray(k) * np.asarray(t_draft_per_token)
                                                              + np.asarray(t_verify))


def speculative_speedup(target: ModelShape, hw: Hardware, batch, *, alpha: float, k: int, context: float,
                        draft: ModelShape | None = None, draft_s_per_token: float = 0.0) -> np.ndarray:
    """Roofline-predicted speedup at `batch` for a draft model (`draft`) or a free drafter (n-gram)."""
    t_plain = step_time(target, hw, batch, 1, context)
    t_verify = step_time(target, hw, batch, k + 1, context)
    t_draft = step_time(draft, hw, batch, 1, context) if draft is not None else draft_s_per_token
    return predicted_speedup(alpha, k, t_plain, t_draft, t_verify)


def crossover_from_points(batches, speedups) -> float | None:
    """First batch where the speedup curve drops below 1, interpolated geometrically between the two
    straddling points; None if it never does. (batches increasing.)"""
    b, s = np.asarray(batches, dtype=float), np.asarray(speedups, dtype=float)
    below = np.nonzero(s < 1.0)[0]
    if len(below) == 0:
        return None
    i = below[0]
    if i == 0:
        return float(b[0])
    frac = (s[i - 1] - 1.0) / (s[i - 1] - s[i])
    return float(math.exp(math.log(b[i - 1]) + frac * (math.log(b[i]) - math.log(b[i - 1]))))


def crossover_batch(speedup_at, batches=None) -> float | None:
    """Smallest batch where speedup_at(batch) < 1, on a log grid of batches 1..8192 (None if never)."""
    grid = np.unique(np.round(np.logspace(0, 13, 200, base=2))).astype(int) if batches is None else np.asarray(batches)
    return crossover_from_points(grid, [float(speedup_at(b)) for b in grid])


def best_k_speedup(target: ModelShape, hw: Hardware, batch, *, alpha: float, ks=(1, 2, 4, 8), context: float,
                   draft: ModelShape | None = None, draft_s_per_token: float = 0.0) -> float:
    """The roofline speedup at `batch` with the best fixed k (what a tuned deployment would pick)."""
    return max(float(speculative_speedup(target, hw, batch, alpha=alpha, k=k, context=context, draft=draft,
                                         draft_s_per_token=draft_s_per_token)) for k in ks)


# ----------------------------------------------------------------------------------------------
# held-out validation of the speedup prediction


def split_cells(groups, *, seed: int, fraction: float = 0.5) -> np.ndarray:
    """Held-out flags, one per cell: within each group (e.g. a drafter's cells) a seeded random
    floor(n * fraction) of the n cells are held out, the rest fit. A group of one cell only fits.
    The same seed and groups always give the same split."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction={fraction!r} must be in [0, 1)")
    rng = np.random.default_rng(seed)
    groups = list(groups)
    held = np.zeros(len(groups), dtype=bool)
    for group in dict.fromkeys(groups):  # groups in order of first appearance: the split is reproducible
        idx = np.array([i for i, g in enumerate(groups) if g == group])
        held[rng.permutation(idx)[: int(len(idx) * fraction)]] = True
    return held


def calibrated_seconds(calibration, shape: ModelShape, hw: Hardware, batch, n_tokens, context) -> float | None:
    """Seconds of a forward of n_tokens per row at `batch` read off calibration steps {batch, n_tokens, context,
    seconds}: linear in n between the n calibrated at that batch (this CPU's cost is not monotone in n, which
    three roofline numbers cannot follow), times the roofline's T(context) / T(calibrated context). None where
    the batch was not calibrated or n lies outside its calibrated n."""
    here = [c for c in calibration or () if c["batch"] == batch]
    if not here:
        return None
    s_cal = min({c["context"] for c in here}, key=lambda s: abs(s - context))
    ns, ts = zip(*sorted((c["n_tokens"], c["seconds"]) for c in here if c["context"] == s_cal))
    if not ns[0] <= n_tokens <= ns[-1]:
        return None
    shift = step_time(shape, hw, batch, n_tokens, context) / step_time(shape, hw, batch, n_tokens, s_cal)
    return float(np.interp(n_tokens, ns, ts) * shift)


def _median_at(fit_rows: list[dict], value, levels: tuple, row: dict, default: float = float("nan")) -> float:
    """Median of value(f) over the fit rows f sharing `row`'s fields at the first level (a tuple of field
    names; most specific first) where some value is finite; `default` where none is."""
    for keys in levels:
        vals = [value(f) for f in fit_rows if all(f[key] == row[key] for key in keys)]
        vals = [v for v in vals if v is not None and math.isfinite(v)]
        if vals:
            return float(np.median(vals))
    return default


def predict_from(fit_rows: list[dict], rows: list[dict], shape: ModelShape, hw: Hardware, *,
                 calibration=None) -> list[float]:
    """Predicted speedup of each row {batch, drafter, k, context} from what `fit_rows` measured (a row's own
    tau, acceptance, times and speedup are never read: a row outside fit_rows is predicted blind):

        S = N g T(B, 1) / (E[max_b steps_b] (f T(B, k+1) + k r T(B, 1)))     (N / E[steps] -> tau if N unknown)

    acceptance: the drafter's fit rows' per-position rates pooled (`acceptance_model`; geometric a = fit_alpha
    where they carry none); N: the fit rows' new tokens per row after the first; E[max_b steps_b]: the batch's
    B rows drawn from that acceptance. T: the calibration steps at (B, 1) and (B, k+1) where both were
    calibrated (separate measurements, not cells: no leakage), else the roofline. Loop factors (the decode
    loop's step over the bare forward) from fit rows: f = verify s/step / T(B, k+1) (drafter and batch, else
    drafter, else batch, else all), g = the plain step a speedup implies, decode_s x speedup / N, over T(B, 1)
    (batch, else all; f = g = 1 where no fit row has one). r = the drafter's draft s/token / T(B, 1) (batch, else all).
    nan where the drafter has no fit row or k is not an int > 0; plain rows -> 1.0."""
    per_row = [(f["new_tokens"] - f["batch"]) / f["batch"] for f in fit_rows if f.get("new_tokens")]
    n_new = int(round(float(np.median(per_row)))) if per_row else 0

    def pair(r, k):  # (T(B, 1), T(B, k+1)): both calibrated or both from the roofline (one model's ratio)
        cal = [calibrated_seconds(calibration, shape, hw, r["batch"], n, r["context"]) for n in (1, k + 1)]
        return cal if None not in cal else list(step_time(shape, hw, r["batch"], np.array([1, k + 1]), r["context"]))

    def verify_factor(f):
        return f["verify_s"] / f["steps"] / pair(f, f["k"])[1] if f.get("steps") and "verify_s" in f else None

    def plain_factor(f):  # the plain step this cell's speedup implies, over T(B, 1)
        return f["decode_s"] * f["speedup"] / n_new / pair(f, f["k"])[0] if n_new and f.get("decode_s") else None

    def pooled(cs):  # one drafter's fit cells; weights: the row-steps each judged
        rates, weights = [list(c.get("acceptance", ())) for c in cs], [c.get("steps", 1) * c["batch"] for c in cs]
        return am.pooled_acceptance(rates, weights, fallback=fit_alpha([c["k"] for c in cs], [c["tau"] for c in cs]))

    acceptance = {d: pooled([f for f in fit_rows if f["drafter"] == d]) for d in {f["drafter"] for f in fit_rows}}
    out = []
    for r in rows:
        k, d = r["k"], r["drafter"]
        if d == "plain" or d not in acceptance or not isinstance(k, (int, np.integer)) or k <= 0:
            out.append(1.0 if d == "plain" else float("nan"))
            continue
        t1, tv = pair(r, k)
        g = _median_at(fit_rows, plain_factor, (("batch",), ()), r)  # loop factors in pairs (S reads g / f), or none
        levels = (("drafter", "batch"), ("drafter",), ("batch",), ())
        f, g = (_median_at(fit_rows, verify_factor, levels, r, 1.0), g) if math.isfinite(g) else (1.0, 1.0)
        draft = _median_at([x for x in fit_rows if x["drafter"] == d],
                           lambda x: x["draft_s_per_token"] / pair(x, x["k"])[0], (("batch",), ()), r) * t1
        per_token = (am.expected_batch_steps(acceptance[d].emission_pmf(k), n_new, r["batch"]) / n_new if n_new
                     else 1.0 / acceptance[d].expected_tokens(k))  # target forwards per token a row gets
        out.append(float(g * t1 / (per_token * (f * tv + k * draft))))
    return out


def median_rel_error(predicted, measured) -> float | None:
    """Median of |predicted - measured| / measured over the finite pairs (None when there are none)."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    ok = np.isfinite(p) & np.isfinite(m) & (m != 0)
    return float(np.median(np.abs(p[ok] - m[ok]) / np.abs(m[ok]))) if ok.any() else None


@dataclass(frozen=True)
class Validation:
    """The speedup prediction judged on cells it did not see, and (beside it) on cells it did.

    held_out[i]: cell i was left out of the held-out fit; predicted[i]: that fit's prediction (blind for
    held-out cells); predicted_insample[i]: the prediction of a fit on every cell."""

    held_out: list[bool]
    predicted: list[float]
    predicted_insample: list[float]
    heldout_error: float | None  # median relative error over held-out cells (None: none predictable)
    insample_error: float | None  # median relative error of the all-cells fit over all cells
    n_fit: int
    n_heldout: int


def validate(rows: list[dict], shape: ModelShape, hw: Hardware, *, seed: int, fraction: float = 0.5,
             calibration=None) -> Validation:
    """Split measured fixed-k cells {batch, drafter, k, context, tau, draft_s_per_token, speedup; optionally
    acceptance, steps, verify_s, decode_s, new_tokens} per drafter with `split_cells`, predict every cell from
    the fit cells (`predict_from`; `calibration`: the calibration steps, else the roofline alone) and score the
    held-out ones; the in-sample prediction fits every cell."""
    held = split_cells([r["drafter"] for r in rows], seed=seed, fraction=fraction)
    fit_rows = [r for r, h in zip(rows, held) if not h]
    predicted = predict_from(fit_rows, rows, shape, hw, calibration=calibration)
    insample = predict_from(rows, rows, shape, hw, calibration=calibration)
    measured = [r["speedup"] for r in rows]
    heldout_error = median_rel_error([p for p, h in zip(predicted, held) if h],
                                     [m for m, h in zip(measured, held) if h])
    return Validation(held.tolist(), predicted, insample, heldout_error, median_rel_error(insample, measured),
                      n_fit=len(fit_rows), n_heldout=int(held.sum()))
