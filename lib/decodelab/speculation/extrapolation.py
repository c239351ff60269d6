"""Where speculation stops paying: crossover batches predicted by the roofline, on this machine and on GPUs.

Notebook 01 measures speedup vs batch here, then asks the roofline (`decodelab.speculation.roofline`) two
questions: at which batch does the best fixed k drop below plain decoding on the calibrated machine, and
where would it on spec-sheet GPUs for 7B and 70B targets. The predicted speedup of k drafts at batch B is

    S(B, k) = tokens(a, k) T(B, 1) / (k t_draft(B) + T(B, k+1)),    S_best(B) = max_k S(B, k)

with a the drafter's per-token acceptance and t_draft its seconds per drafted token: the roofline of the
draft's own layers (layer-skip, draft model) or, for the n-gram drafter (no model), its measured median.
Every function returns plain rows / dicts; the notebook only tabulates and plots them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decodelab.speculation import roofline
from decodelab.speculation.roofline import Hardware, ModelShape

# GPU extrapolation targets: size label -> (target shape, its small same-family draft), names in roofline.SHAPES
GPU_TARGETS = {"7B": ("Qwen2.5-7B", "Qwen2.5-0.5B"), "70B": ("Llama-3-70B", "Llama-3.2-1B")}
# batches of the GPU curves: 49 log-spaced points 1..4096 (rounded, deduplicated)
GPU_BATCHES = np.unique(np.round(np.logspace(0, 12, 49, base=2))).astype(int)
# n-gram acceptance assumed on GPU when this run did not measure the n-gram drafter
UNMEASURED_NGRAM_ALPHA = 0.5


def drafter_shapes(shape: ModelShape, *, n_skip_layers: int, draft) -> dict[str, ModelShape]:
    """Cost shapes of the model drafters: "layer_skip" = the target with its n_skip_layers layers,
    "draft_model" = `draft`'s (a LoadedModel) own config at its weights' dtype."""
    return {"layer_skip": shape.with_layers(n_skip_layers),
            "draft_model": ModelShape.from_config(draft.hf_model.config, name=draft.name,
                                                  bytes_per_param=draft.transformer.dtype.itemsize)}


def measured_draft_cost(fixed_rows: list[dict]) -> dict[str, float]:
    """{drafter: median seconds per drafted token} over measured cells {drafter, draft_s_per_token} (NaNs skipped)."""
    out = {}
    for d in dict.fromkeys(r["drafter"] for r in fixed_rows):
        values = np.asarray([r["draft_s_per_token"] for r in fixed_rows if r["drafter"] == d], dtype=float)
        values = values[~np.isnan(values)]
        out[d] = float(np.median(values)) if len(values) else float("nan")
    return out


def draft_seconds_per_token(drafter: str, batch, hw: Hardware, context: float, *,
                            draft_shapes: dict[str, ModelShape], measured: dict[str, float]) -> float:
    """Seconds per drafted token at `batch`: the roofline of the draft's own layers when `drafter` has a
    shape in draft_shapes, else (n-gram) its measured median (nan when it was not measured)."""
    if drafter in draft_shapes:
        return float(roofline.step_time(draft_shapes[drafter], hw, batch, 1, context))
    return float(measured.get(drafter, float("nan")))


def predicted_best_speedup(drafter: str, batch, *, shape: ModelShape, hw: Hardware, context: float, alpha: float,
                           ks, draft_shapes: dict[str, ModelShape], measured: dict[str, float]) -> float:
    """S_best(batch) = max over ks of tokens(alpha, k) T(B, 1) / (k t_draft + T(B, k+1)) on `hw`."""
    t_draft = draft_seconds_per_token(drafter, batch, hw, context, draft_shapes=draft_shapes, measured=measured)
    t_plain = roofline.step_time(shape, hw, batch, 1, context)

    def speedup(k):
        t_verify = roofline.step_time(shape, hw, batch, k + 1, context)
        return float(roofline.predicted_speedup(alpha, k, t_plain, t_draft, t_verify))

    return max(speedup(k) for k in ks)


def local_crossovers(best_rows: list[dict], fixed_rows: list[dict], *, drafters, shape: ModelShape, hw: Hardware,
                     context: float, alphas: dict[str, float], ks, drafter_ks: dict,
                     draft_shapes: dict[str, ModelShape], batches=None) -> dict[str, dict]:
    """{drafter: {"measured", "predicted"}}: the first batch where the best fixed-k speedup drops below 1.

    measured: interpolated on best_rows {drafter, batch, speedup} (one per drafter and batch); predicted:
    on the calibrated roofline `hw` with the drafter's fitted `alphas[d]`, its ks (drafter_ks.get(d, ks)) and
    its draft cost (`draft_seconds_per_token`; the n-gram's from fixed_rows {drafter, draft_s_per_token}),
    over `batches` (None: roofline.crossover_batch's log grid). None = no crossover.
    """
    measured = measured_draft_cost(fixed_rows)
    out = {}
    for d in drafters:
        part = sorted((r for r in best_rows if r["drafter"] == d), key=lambda r: r["batch"])

        def speedup_at(b, d=d):
            return predicted_best_speedup(d, b, shape=shape, hw=hw, context=context, alpha=alphas[d],
                                          ks=drafter_ks.get(d, ks), draft_shapes=draft_shapes, measured=measured)

        out[d] = {"measured": roofline.crossover_from_points([r["batch"] for r in part], [r["speedup"] for r in part]),
                  "predicted": roofline.crossover_batch(speedup_at, batches)}
    return out


@dataclass(frozen=True)
class GpuExtrapolation:
    """rows: {hardware, model, drafter, batch, speedup} per batch that fits in memory; crossovers:
    {"drafter/size/hardware": {predicted, devices, max_batch_in_memory}}."""

    rows: list[dict]
    crossovers: dict[str, dict]


def gpu_hardware_for(target: ModelShape, hardware_name: str) -> tuple[Hardware, int]:
    """The spec sheet (achievable fractions) of `hardware_name`, tensor-parallel over as many devices as
    the target's weights need: -> (hardware, device count)."""
    one = roofline.spec_sheet(hardware_name)
    n_dev = roofline.devices_needed(target, one)  # 70B: tensor-parallel over several GPUs
    return (one.tensor_parallel(n_dev) if n_dev > 1 else one), n_dev


def gpu_extrapolation(hardware_names, *, ks, context: float, alphas: dict[str, float], draft_alpha: float,
                      targets: dict = GPU_TARGETS, batches=GPU_BATCHES) -> GpuExtrapolation:
    """Best-fixed-k speedup vs batch on spec-sheet GPUs for every hardware x target size x drafter.

    Drafters: "ngram" (free to draft, acceptance alphas["ngram"], else UNMEASURED_NGRAM_ALPHA) and
    "draft_model" (the target's small sibling from `targets`, acceptance `draft_alpha`). Batches stop where
    the KV cache at `context` no longer fits beside the weights (roofline.max_batch).
    """
    batches = np.asarray(batches)
    rows, crossovers = [], {}
    for hw_name in hardware_names:
        for size, (t_name, d_name) in targets.items():
            target, small = roofline.SHAPES[t_name], roofline.SHAPES[d_name]
            hw, n_dev = gpu_hardware_for(target, hw_name)
            label = f"{n_dev}x {hw_name}" if n_dev > 1 else hw_name
            for d, kw in {"ngram": dict(alpha=alphas.get("ngram", UNMEASURED_NGRAM_ALPHA)),
                          "draft_model": dict(alpha=draft_alpha, draft=small)}.items():
                fits = batches[batches <= roofline.max_batch(target, hw, context, draft=kw.get("draft"))]

                def at(b, hw=hw, target=target, kw=kw):
                    return roofline.best_k_speedup(target, hw, b, ks=ks, context=context, **kw)

                crossovers[f"{d}/{size}/{hw_name}"] = {
                    "predicted": roofline.crossover_batch(at, fits), "devices": n_dev,
                    "max_batch_in_memory": int(fits.max()) if len(fits) else 0}
                rows += [{"hardware": label, "model": size, "drafter": d, "batch": int(b), "speedup": at(b)}
                         for b in fits]
    return GpuExtrapolation(rows, crossovers)
