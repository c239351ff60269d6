"""The roofline's speedup prediction judged on cells it was not fitted to: a seeded split of the measured cells
into fit and held-out, the prediction of each held-out cell from the fit cells' acceptance and the calibrated
step times, and the median relative error in and out of sample (notebook 01's held-out roofline goal)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decodelab.speculation import acceptance_model as am
from decodelab.speculation.acceptance_model import fit_alpha
from decodelab.speculation.roofline import Hardware, ModelShape, step_time


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
