"""Speculation at long context (MagicDec's regime): the sweep context x batch x drafter, its goal rows and
figures. A context's shared document is prefilled once (`sparse_draft.prefill_once`) for the largest batch and
every smaller batch takes its first rows, so the sweep's time goes to decoding.

Speedup = plain decode seconds / speculative decode seconds for the same rows and the same number of tokens
(greedy, no early EOS: both emit exactly max_new_tokens per row, and the test `matches_plain` checks they emit
the same ones). A cell's runs (plain, each drafter, plain's A/A twin) are stepped side by side in each repeat
(`bench.run_methods`), and each repeat is one round of paired runs; the CI is
`speedup_stats.pooled_speedup_intervals` over the rounds (a t interval on paired log ratios, the round noise pooled
over the runs of a cell of like length; none with one round).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from decodelab.common.goals import Goal
from decodelab.core.engine import as_transformer
from decodelab.core.kv_cache import check_sink_window
from decodelab.core.models import cast_model
from decodelab.speculation.bench import run_methods
from decodelab.speculation.decode import Prefilled, generate
from decodelab.speculation.drafters import make_drafter
from decodelab.speculation.sparse_draft import DEFAULT_SINK, DEFAULT_WINDOW, SparseKVDrafter, prefill_once
from decodelab.workloads.long_context import long_context_workload

WARMUP_TOKENS = 4  # new tokens of each run's dropped warm-up: a draft and a verify step, a fraction of a round's cost


def kv_rows_needed(batches, drafters=(), max_batch: dict | None = None) -> int:
    """Cache rows alive at once at the sweep's peak: the largest batch's prefill (smaller batches are views of its
    rows; the sparse draft keeps a small ring) plus, in the cell that needs most, one copy of the cell's rows per
    run stepped side by side (plain, its A/A twin and each drafter running at that batch)."""
    max_batch = max_batch or {}
    runs = {b: 2 + sum(b <= max_batch.get(d, b) for d in drafters) for b in batches}
    return max(batches) + max(b * n for b, n in runs.items())


def kv_bytes_per_token(model) -> int:
    """Bytes of keys + values one position of one row takes in the target's cache (fp32 SmolLM2: 46 KB)."""
    tr = as_transformer(model)
    return 2 * tr.n_layers * tr.n_kv_heads * tr.head_dim * torch.finfo(tr.dtype).bits // 8


def available_bytes() -> int:
    """MemAvailable of this machine (Linux), else 0 (unknown: no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_memory(model, contexts, batches, *, max_new_tokens: int, max_k: int, drafters=(),
                 max_batch: dict | None = None, available: int | None = None) -> None:
    """ValueError naming the context and batch when their KV caches (`kv_rows_needed` rows) do not fit in memory."""
    available = available_bytes() if available is None else available
    if not available:
        return
    per_token = kv_bytes_per_token(model)
    rows = kv_rows_needed(batches, drafters, max_batch)
    for context in contexts:
        need = rows * (context + max_new_tokens + max_k + 1) * per_token
        if need > 0.8 * available:
            raise ValueError(f"context={context} at batch={max(batches)} needs {need / 2**30:.1f} GiB of KV cache "
                             f"({rows} rows alive at once: the prefill and a copy per run stepped side by side, x "
                             f"{per_token / 1024:.0f} KB per token per row), but only {available / 2**30:.1f} GiB "
                             "is available (80% usable): lower the batch, the context or the drafters")


def check_grid(contexts, batches, drafters, k, max_batch=None) -> None:
    for name, values in (("contexts", contexts), ("batches", batches)):
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={values!r} must be a non-empty list of positive ints")
    allowed = ("ngram", "sparse_kv", "layer_skip")
    if not drafters or any(d not in allowed for d in drafters):
        raise ValueError(f"long_drafters={drafters!r}: allowed drafters are {list(allowed)}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"long_k={k!r} must be an int >= 1")
    for name, cap in (max_batch or {}).items():
        if name not in drafters:
            raise ValueError(f"long_drafter_max_batch names {name!r}, which is not in long_drafters={list(drafters)}")
        if not isinstance(cap, int) or cap < min(batches):
            raise ValueError(f"long_drafter_max_batch[{name!r}]={cap!r} must be an int >= the smallest batch "
                             f"({min(batches)})")


def batch_prefilled(full: Prefilled, batch: int) -> Prefilled:
    """The first `batch` rows of a prefill, as a Prefilled of their own whose cache shares `full`'s storage
    (`KVCache.first_rows`: every run truncates back to the prompts, so runs never see each other's writes)."""
    return Prefilled(prompts=full.prompts[:batch], cache=full.cache.first_rows(batch),
                     last_logits=full.last_logits[:batch], last_hidden=full.last_hidden[:batch],
                     prompt_hidden=full.prompt_hidden[:batch], prompt_lengths=full.prompt_lengths[:batch].clone(),
                     prefill_s=full.prefill_s, max_new_tokens=full.max_new_tokens, max_k=full.max_k)


@torch.inference_mode()
def shared_prefill(model, prompts, *, max_new_tokens: int, max_k: int) -> Prefilled:
    """A Prefilled of prompts sharing a document, the document prefilled once."""
    import time

    start = time.perf_counter()
    max_len = max(map(len, prompts)) + max_new_tokens + max_k + 1
    cache, logits, hidden = prefill_once(model, prompts, max_len=max_len, return_hidden=True)
    lengths = cache.lengths.clone()
    last_hidden = hidden[torch.arange(len(prompts)), lengths - 1]
    return Prefilled(prompts=[list(p) for p in prompts], cache=cache, last_logits=logits, last_hidden=last_hidden,
                     prompt_hidden=hidden, prompt_lengths=lengths, prefill_s=time.perf_counter() - start,
                     max_new_tokens=max_new_tokens, max_k=max_k)


def long_context_sweep(model, *, contexts, batches, drafters, k: int, max_new_tokens: int, repeats: int,
                       sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW, task: str = "edit",
                       max_batch: dict | None = None, sparse_dtype=None, progress: bool = False) -> list[dict]:
    """-> one row per (context, batch, drafter): {context, batch, drafter, k, speedup, speedup_low,
    speedup_high, ratios, plain_s, spec_s (fastest round), tau, draft_s, verify_s, steps, draft_s_per_token,
    matches_plain} (the fields `heldout.validate` reads, so the roofline can be judged on held-out cells).
    max_batch: {drafter: the largest batch it runs at} (CPU time); absent drafters run at every batch.
    sparse_dtype: the sparse-KV self-draft's weights in this dtype (`models.cast_model`; None: the target's).

    Each cell's runs go through `bench.run_methods`: a warm-up of every run (WARMUP_TOKENS, dropped), then
    `repeats` rounds in which plain, each drafter and plain's A/A twin advance one step in turn, each on its
    own copy of the prefill's rows (`kv_rows_needed`). Stepped side by side, a shift in the machine's speed
    lands on every run of the round alike, where whole runs back to back (seconds each) took it unevenly; the
    twin gives the cell's noise floor and more degrees of freedom to its interval (`speedup_stats`)."""
    check_grid(contexts, batches, drafters, k, max_batch)
    max_batch = max_batch or {}
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"long_repeats={repeats!r} must be an int >= 1")
    check_memory(model, contexts, batches, max_new_tokens=max_new_tokens, max_k=k, drafters=drafters,
                 max_batch=max_batch)
    sparse_model = model
    if "sparse_kv" in drafters and sparse_dtype is not None:  # a bad dtype fails here, before any forward
        sparse_model = cast_model(model, sparse_dtype)
    works = {c: long_context_workload(model.tokenizer, context=c, batch=max(batches), task=task) for c in contexts}
    if "sparse_kv" in drafters:  # bad sink/window fail here, before any forward
        for work in works.values():
            check_sink_window(sink, window, context=min(map(len, work.prompts)))
    rows = []
    for context, work in works.items():
        full = shared_prefill(model, work.prompts, max_new_tokens=max_new_tokens, max_k=k)
        for batch in sorted(batches):
            pre = batch_prefilled(full, batch)
            here = [d for d in drafters if batch <= max_batch.get(d, batch)]
            made = {d: (SparseKVDrafter(sparse_model, sink=sink, window=window).share(pre.cache) if d == "sparse_kv"
                        else make_drafter(d, model)) for d in here}
            for name in [None, *here]:  # warm every code path (a few tokens each); run_methods warms plain only
                generate(model, drafter=made.get(name), k=k if name else 0, prefilled=pre, eos_token_ids=[],
                         max_new_tokens=min(WARMUP_TOKENS, max_new_tokens))
            out = run_methods(model, pre.prompts, [(d, lambda d=d: made[d], k) for d in here],
                              max_new_tokens=max_new_tokens, eos_token_ids=[], repeats=repeats, prefilled=pre,
                              warmup=False)
            plain = out[0]
            for r in out[1:]:
                rows.append({"context": context, "batch": batch, "drafter": r["drafter"], "k": k,
                             "speedup": r["speedup"], "speedup_low": r["speedup_low"],
                             "speedup_high": r["speedup_high"], "ratios": r["round_speedups"],
                             "plain_s": plain["decode_s"], "spec_s": r["decode_s"], "tau": r["tau"],
                             "draft_s": r["draft_s"], "verify_s": r["verify_s"], "steps": r["steps"],
                             "draft_s_per_token": r["draft_s"] / (k * r["steps"]),
                             "matches_plain": r["tokens"] == plain["tokens"]})
            if progress:
                print(f"context {context} batch {batch}: " + ", ".join(
                    f"{r['drafter']} {r['speedup']:.2f}x" for r in rows[-len(here):]), flush=True)
    return rows


def best_at(rows: list[dict], context: int, batch: int) -> dict | None:
    """The row of the drafter with the highest speedup at (context, batch)."""
    cell = [r for r in rows if r["context"] == context and r["batch"] == batch]
    return max(cell, key=lambda r: r["speedup"]) if cell else None


def long_context_goals(rows: list[dict], *, min_context: int = 2048, batch: int = 16,
                       target: float = 1.3) -> list[Goal]:
    """The issue's long-context goal rows, at the longest measured context >= min_context (none: nan rows).
    Speedup at `batch` judged on the CI lower bound of its best drafter (on the point estimate, said so, when one
    round gave no interval); growth = speedup(batch) - speedup(1)."""
    long = [c for c in sorted({r["context"] for r in rows}) if c >= min_context]
    context = long[-1] if long else None
    hi = best_at(rows, context, batch) if context else None
    one = [r for r in rows if hi and r["context"] == context and r["batch"] == 1 and r["drafter"] == hi["drafter"]]
    growth = hi["speedup"] - one[0]["speedup"] if hi and one else None
    where = f" (context {context}, {hi['drafter']})" if hi else ""
    judged = None if not hi else hi["speedup"] if hi["speedup_low"] is None else hi["speedup_low"]
    return [
        Goal.check("long_context_speedup_b16", judged, ">=", target,
                   label=f"best drafter's speedup at batch {batch}, CI low{where}", unit="x",
                   note="" if not hi or hi["speedup_low"] is not None
                   else "one round: no interval, point estimate judged"),
        Goal.check("long_context_speedup_grows", growth, ">", 0.0,
                   label=f"speedup at batch {batch} minus at batch 1{where}", unit="x"),
        Goal.check("long_context_exact", all(r["matches_plain"] for r in rows) if rows else None, "==", True,
                   label="greedy speculative == plain at every long-context cell"),
    ]


def plot_speedup_vs_batch(rows: list[dict], ax=None):
    """The MagicDec picture: speedup vs batch, one line per context x drafter, CI as error bars."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for context in sorted({r["context"] for r in rows}):
        for d in sorted({r["drafter"] for r in rows}):
            cell = sorted((r for r in rows if r["context"] == context and r["drafter"] == d), key=lambda r: r["batch"])
            if not cell:
                continue
            b = [r["batch"] for r in cell]
            s = np.array([r["speedup"] for r in cell])
            err = np.array([[0.0, 0.0] if r["speedup_low"] is None else
                             [max(0.0, r["speedup"] - r["speedup_low"]), max(0.0, r["speedup_high"] - r["speedup"])]
                            for r in cell]).T
            ax.errorbar(b, s, yerr=err, marker="o", capsize=3, label=f"{d}, context {context}")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch", ylabel="speedup over plain decoding", title="Speculation at long context: speedup vs batch")
    ax.legend(fontsize=8)
    return ax


# GPU predictions at long context: size label -> roofline.SHAPES name (Llama-3-like shapes, bf16)
LONG_GPU_TARGETS = {"8B": "Llama-3-8B", "70B": "Llama-3-70B"}
LONG_GPU_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bytes_per_param(dtype) -> float | None:
    """Bytes of one weight in `dtype` (a torch dtype or its name), None for None."""
    if dtype is None:
        return None
    return float(torch.empty(0, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size())


def sparse_draft_speedup(shape, hw, batch, *, alpha: float, k: int, context: float, sink: int, window: int,
                         draft_bytes_per_param: float | None = None) -> float:
    """Roofline speedup of the sparse-KV self-draft: k draft steps of the target reading sink + window KV
    positions per row, then one verify of k + 1 tokens over the whole context (MagicDec's model).
    draft_bytes_per_param: the draft's weights and KV in another width (a bf16 draft of an fp32 target: 2)."""
    from decodelab.speculation import roofline

    draft = shape if draft_bytes_per_param is None else replace(shape, bytes_per_param=draft_bytes_per_param)
    t_draft = roofline.step_time(draft, hw, batch, 1, min(context, sink + window))
    return float(roofline.speculative_speedup(shape, hw, batch, alpha=alpha, k=k, context=context,
                                              draft_s_per_token=float(t_draft)))


def paying_batch(batches, speedups) -> float | None:
    """Smallest batch from which speculation pays (speedup >= 1), interpolated geometrically between the two
    straddling points; None when it never does within `batches` (increasing). A sparse self-draft costs a full
    weight read per draft token, so it loses at batch 1 and pays once the rows' KV reads outweigh the weights."""
    b, s = np.asarray(batches, dtype=float), np.asarray(speedups, dtype=float)
    above = np.nonzero(s >= 1.0)[0]
    if len(above) == 0:
        return None
    i = above[0]
    if i == 0:
        return float(b[0])
    frac = (1.0 - s[i - 1]) / (s[i] - s[i - 1])
    return float(np.exp(np.log(b[i - 1]) + frac * (np.log(b[i]) - np.log(b[i - 1]))))


def gpu_long_context(hardware_names=("H100-SXM", "H200"), *, contexts=(1024, 4096, 16384, 65536), alpha: float,
                     sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW, ks=(1, 2, 3, 4),
                     batches=LONG_GPU_BATCHES) -> tuple[list[dict], list[dict]]:
    """Best-k speedup of the sparse-KV self-draft vs batch on spec-sheet GPUs (7B- and 70B-class Llama shapes,
    tensor-parallel where the weights need it), at every context, batches that fit in memory only.
    -> (rows {hardware, model, context, batch, speedup}, crossovers {hardware, model, context, crossover
    (`paying_batch`: first batch at >= 1x, None = never within memory), max_batch, grows (speedup at the
    largest batch in memory > at batch 1)})."""
    from decodelab.speculation import roofline
    from decodelab.speculation.extrapolation import gpu_hardware_for

    rows, crossovers = [], []
    for hw_name in hardware_names:
        for size, shape_name in LONG_GPU_TARGETS.items():
            shape = roofline.SHAPES[shape_name]
            hw, n_dev = gpu_hardware_for(shape, hw_name)
            label = f"{n_dev}x {hw_name}" if n_dev > 1 else hw_name
            for context in contexts:
                fits = [b for b in batches if b <= roofline.max_batch(shape, hw, context)]
                speed = [max(sparse_draft_speedup(shape, hw, b, alpha=alpha, k=k, context=context, sink=sink,
                                                  window=window) for k in ks) for b in fits]
                rows += [{"hardware": label, "model": size, "context": context, "batch": b, "speedup": s}
                         for b, s in zip(fits, speed)]
                crossovers.append({"hardware": label, "model": size, "context": context,
                                   "crossover": paying_batch(fits, speed) if fits else None,
                                   "max_batch": max(fits) if fits else 0,
                                   "grows": bool(len(speed) > 1 and speed[-1] > speed[0])})
    return rows, crossovers


def plot_gpu_long_context(rows: list[dict], ax=None):
    """Predicted sparse-draft speedup vs batch on GPUs, one line per hardware x model x context."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    keys = sorted({(r["hardware"], r["model"], r["context"]) for r in rows}, key=str)
    for hw, model, context in keys:
        cell = [r for r in rows if (r["hardware"], r["model"], r["context"]) == (hw, model, context)]
        ax.plot([r["batch"] for r in cell], [r["speedup"] for r in cell], marker=".",
                label=f"{model} on {hw}, context {context}")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch", ylabel="predicted speedup (roofline)", title="Sparse-KV self-draft on GPUs (predicted)")
    ax.legend(fontsize=6, ncol=2)
    return ax


def plot_crossover_vs_context(crossovers: list[dict], ax=None):
    """Predicted crossover batch (from which the sparse self-draft pays, speedup >= 1) vs context; a cell that
    never pays within memory is drawn at its largest batch that fits, hollow."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for hw, model in sorted({(c["hardware"], c["model"]) for c in crossovers}):
        cell = [c for c in crossovers if (c["hardware"], c["model"]) == (hw, model)]
        x = [c["context"] for c in cell]
        y = [c["crossover"] if c["crossover"] is not None else c["max_batch"] for c in cell]
        line, = ax.plot(x, y, label=f"{model} on {hw}")
        for c, xi, yi in zip(cell, x, y):
            ax.plot(xi, yi, "o", color=line.get_color(), fillstyle="full" if c["crossover"] is not None else "none")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set(xlabel="context (tokens)", ylabel="batch from which it pays (hollow: never in memory)",
           title="Where the sparse self-draft starts paying (predicted)")
    ax.legend(fontsize=7)
    return ax


def predict_long_rows(rows: list[dict], shape, hw, *, sink: int, window: int,
                      draft_bytes_per_param: float | None = None) -> list[dict]:
    """The roofline's reading of each measured cell on the calibrated machine `hw`: the drafter's acceptance
    alpha fitted from the cell's own tau, then the predicted speedup (n-gram: free drafts; sparse_kv: full-weight
    draft steps over sink + window positions; layer_skip: not modelled, nan), and the verify/decode step-time
    ratio T(B, k+1) / T(B, 1) that decides whether verifying is nearly free. -> rows + {alpha, predicted,
    verify_ratio, attention_share (attention FLOPs / all FLOPs of the verify step)}. draft_bytes_per_param: see
    `sparse_draft_speedup`."""
    from decodelab.speculation import roofline

    out = []
    for r in rows:
        k, b, s = r["k"], r["batch"], r["context"]
        alpha = roofline.fit_alpha([k], [r["tau"]]) if math.isfinite(r["tau"]) else float("nan")
        if r["drafter"] == "ngram":
            pred = float(roofline.speculative_speedup(shape, hw, b, alpha=alpha, k=k, context=s))
        elif r["drafter"] == "sparse_kv":
            pred = sparse_draft_speedup(shape, hw, b, alpha=alpha, k=k, context=s, sink=sink, window=window,
                                        draft_bytes_per_param=draft_bytes_per_param)
        else:
            pred = float("nan")
        ratio = float(roofline.step_time(shape, hw, b, k + 1, s) / roofline.step_time(shape, hw, b, 1, s))
        total = float(shape.flops(b, k + 1, s))
        attention = total - 2 * shape.matmul_params * b * (k + 1)
        out.append({**r, "alpha": alpha, "predicted": pred, "verify_ratio": ratio,
                    "attention_share": attention / total})
    return out
