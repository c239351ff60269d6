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
from decodelab.speculation.acceptance_model import expected_tokens, fit_alpha  # noqa: F401  (public here too)


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
