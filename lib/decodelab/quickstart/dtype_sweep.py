"""The decode benchmark in every dtype offered: ours vs HF per dtype, the memory-limit fraction, bf16 vs fp32.

For each dtype the embedded model is loaded in it (same weights, cast), the bandwidth of its LM-head
matvec is calibrated (`bandwidth.matvec_bandwidth`) and `bench.decode_throughput` runs both sides;
each ours/HF row then carries the dtype, the per-step milliseconds (call seconds / new tokens per row,
prefill included) and the roofline columns of `bandwidth.add_roofline`.
"""
from __future__ import annotations

import numpy as np

from decodelab.core.engine import generate
from decodelab.core.models import available_dtypes, load_model
from decodelab.quickstart import bandwidth, bench

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_dtypes(dtypes, device) -> list[str]:
    """A non-empty list of dtype names this device supports, or ValueError naming what is available."""
    if not isinstance(dtypes, (list, tuple)) or not dtypes:
        raise ValueError(f"dtypes={dtypes!r} must be a non-empty list of names from {DTYPE_NAMES}")
    available = available_dtypes(device)
    for name in dtypes:
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtypes contains {name!r}; allowed: {DTYPE_NAMES}")
        if name not in available:
            raise ValueError(f"dtypes contains {name!r}, which device {device} does not support; available: "
                             f"{available}")
    return list(dtypes)


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two generations (same prompts, same lengths) emit the same token."""
    pairs = [(x, y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def dtype_name(model) -> str:
    return str(model.transformer.dtype).removeprefix("torch.")


def sweep(model_name: str, dtypes: list[str], batch_sizes: list[int], max_new_tokens: int, *, repeats: int,
          device=None, progress: bool = True, agreement_rows: int = 8, loaded=None) -> dict:
    """-> {"throughput": bench.decode_throughput rows with their dtype, "rows": ours/HF ratio rows with dtype,
    step ms and roofline columns, "calibration": {dtype: matvec bandwidth}, "greedy": {dtype: greedy tokens
    of the first `agreement_rows` bench prompts, EOS off}}. loaded: an already loaded model, reused for its dtype."""
    rows, throughput, calibration, greedy = [], [], {}, {}
    for name in dtypes:
        reuse = loaded is not None and dtype_name(loaded) == name
        lm = loaded if reuse else load_model(model_name, device=device, dtype=name)
        calibration[name] = bandwidth.matvec_bandwidth(lm)
        measured = bench.decode_throughput(lm, batch_sizes, max_new_tokens, repeats=repeats, progress=progress)
        throughput += [{**row, "dtype": name} for row in measured]
        table = bench.ratio_table(measured)
        for entry in bandwidth.add_roofline(table, lm, calibration[name]):
            entry["dtype"] = name
            entry["ours_step_ms"] = entry["ours_seconds"] / max_new_tokens * 1e3
            entry["hf_step_ms"] = entry["hf_seconds"] / max_new_tokens * 1e3
        rows += table
        prompts = bench.chat_prompts(lm.tokenizer)[:agreement_rows]
        greedy[name] = generate(lm, prompts, max_new_tokens=max_new_tokens, eos_token_ids=[]).tokens
        del lm
    return {"throughput": throughput, "rows": rows, "calibration": calibration, "greedy": greedy}


def speedup_over(rows: list[dict], dtype: str, base: str = "float32", batch: int = 1) -> float:
    """ours tokens/s in `dtype` over ours in `base` at `batch` (nan when either is missing)."""
    by = {(r["dtype"], r["batch"]): r["ours_tokens_per_s"] for r in rows}
    if (dtype, batch) not in by or (base, batch) not in by:
        return float("nan")
    return by[(dtype, batch)] / by[(base, batch)]


def head_to_head(model_name: str, dtypes: list[str], max_new_tokens: int, *, rounds: int, batch: int = 1,
                 device=None, loaded=None) -> list[dict]:
    """Our decode in each dtype on the same prompts, the calls interleaved round by round (the order flipping
    each round, `timing.alternating_times`) under one wall clock, so the machine's drift over the minutes
    between two dtypes' sweeps does not enter their ratio. Greedy, EOS off, prefill included, as the sweep.

    -> one row per dtype {dtype, batch, ours_tokens_per_s (new tokens / fastest call), seconds, seconds_max,
    spread (slowest / fastest - 1), rounds, round_seconds (one per round, in round order), new_tokens,
    same_tokens (every call returned the same tokens)}; feed the rows to `paired_speedup` (or to
    `speedup_over`, which compares fastest calls). loaded: an already loaded model, reused for its dtype.
    """
    from decodelab.common.timing import alternating_times

    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be an integer >= 1")
    models = {name: loaded if loaded is not None and dtype_name(loaded) == name
              else load_model(model_name, device=device, dtype=name) for name in dtypes}
    prompts = bench.prompt_batch(bench.chat_prompts(next(iter(models.values())).tokenizer), batch)
    tokens = {name: [] for name in models}

    def call(name):
        return lambda: tokens[name].append(generate(models[name], prompts, max_new_tokens=max_new_tokens,
                                                    eos_token_ids=[]).tokens)

    times = alternating_times({name: call(name) for name in models}, rounds,
                              device=next(iter(models.values())).device)
    rows = []
    for name, seconds in times.items():
        new_tokens = sum(len(row) for row in tokens[name][-1])
        rows.append({"dtype": name, "batch": batch, "ours_tokens_per_s": new_tokens / min(seconds),
                     "seconds": min(seconds), "seconds_max": max(seconds), "spread": max(seconds) / min(seconds) - 1,
                     "rounds": rounds, "round_seconds": [float(x) for x in seconds], "new_tokens": new_tokens,
                     "same_tokens": all(t == tokens[name][0] for t in tokens[name])})
    return rows


def paired_speedup(rows: list[dict], dtype: str, base: str = "float32", batch: int = 1) -> float:
    """`head_to_head` rows -> the median over rounds of `dtype`'s tokens/s over `base`'s in the same round
    (nan when either is missing). The two calls of a round run back to back, so a change in the machine's
    speed between rounds lands on both; the fastest calls of the two (`speedup_over`) may come from
    different rounds, and on a shared host whose speed moves by tens of percent within a minute their ratio
    moves with it."""
    by = {(r["dtype"], r["batch"]): r for r in rows}
    if (dtype, batch) not in by or (base, batch) not in by:
        return float("nan")
    a, b = by[(dtype, batch)], by[(base, batch)]
    if len(a["round_seconds"]) != len(b["round_seconds"]):
        raise ValueError(f"{dtype} ran {len(a['round_seconds'])} rounds and {base} {len(b['round_seconds'])}: "
                         "not one head-to-head")
    rates = [(a["new_tokens"] / sa) / (b["new_tokens"] / sb) for sa, sb in zip(a["round_seconds"], b["round_seconds"])]
    return float(np.median(rates))
