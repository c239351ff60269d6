"""Notebook 06's conclusions from its per-query rows: one table row per (method, batch size), paired accuracy
against plain decoding, the amortization curve, hit rate against similarity, goal rows and generated findings.

Every comparison is paired: the same queries (those after the warm-up) served by a method and by plain
chain-of-thought decoding at the same batch size. Speedups compare decode tokens/s (prefill excluded), where
every method's tokens/s is its new tokens after each row's first over its decode seconds.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from decodelab.common.goals import Goal
from decodelab.common.goals import format_value as fmt
from decodelab.common.stats import paired_bootstrap_diff

DRAFT_SPEEDUP_TARGET = 1.5  # trace-as-draft vs plain at batch 1 (SpecReason / Lookahead Reasoning: 1.4-3.0x)
DRAFT_VS_NGRAM_TARGET = 1.2  # trace-as-draft vs prompt-only n-gram at batch 1
TOKEN_CUT_TARGET, TOKEN_CUT_MOONSHOT = 2.0, 10.0  # target-chosen tokens per query, plain / method
ACCURACY_FLOOR = -0.02  # paired accuracy difference, judged on its 95% CI lower bound
AMORTIZATION_TARGET = 0.5  # cost per query after `amortization_point` queries / the first query's


def check_warmup(warmup: int, n_queries: int) -> int:
    """The warm-up must leave at least one query to compare on."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an integer >= 0")
    if n_queries <= warmup:
        raise ValueError(f"n_queries={n_queries!r} is not longer than the cache warm-up warmup={warmup}; "
                         f"allowed: n_queries > warmup (at least one query served with a warm cache)")
    return warmup


def _by(rows: Sequence[dict], method: str, batch: int) -> dict[int, dict]:
    return {r["query"]: r for r in rows if r["method"] == method and r["batch_size"] == batch}


def decode_tokens_per_s(batch_rows: Sequence[dict], method: str, batch: int) -> float | None:
    rows = [r for r in batch_rows if r["method"] == method and r["batch_size"] == batch]
    tokens = sum(r["new_tokens"] - r["rows"] for r in rows)
    seconds = sum(r["decode_s"] for r in rows)
    # nan seconds: nothing decoded (shared_prefix checked against plain's output in one forward) -> not measured
    return tokens / seconds if seconds > 0 else None


def method_table(query_rows: Sequence[dict], batch_rows: Sequence[dict], *, warmup: int, seed: int = 0,
                 plain: str = "plain") -> list[dict]:
    """One row per (method, batch size): per query (after the warm-up) forwards, new / target-chosen / reused
    tokens, accuracy and its paired difference to plain (95% bootstrap CI), identical-output share; decode
    tokens/s and its ratio to plain's over the whole stream."""
    out = []
    for method, batch in dict.fromkeys((r["method"], r["batch_size"]) for r in query_rows):
        rows, ref = _by(query_rows, method, batch), _by(query_rows, plain, batch)
        queries = [q for q in sorted(rows) if q >= warmup and q in ref]
        if not queries:
            continue
        pick = lambda table, key: np.array([float(table[q][key]) for q in queries])  # noqa: E731
        forwards, ref_forwards = pick(rows, "forwards"), pick(ref, "forwards")
        diff = paired_bootstrap_diff(pick(rows, "correct"), pick(ref, "correct"), seed=seed)
        tps, ref_tps = decode_tokens_per_s(batch_rows, method, batch), decode_tokens_per_s(batch_rows, plain, batch)
        first = rows[queries[0]]
        out.append({
            "method": method, "kind": first["kind"], "lossless": first["lossless"], "batch_size": batch,
            "queries": len(queries), "forwards_per_query": forwards.mean(),
            "new_tokens_per_query": pick(rows, "new_tokens").mean(), "target_tokens_per_query": forwards.mean(),
            "reused_tokens_per_query": pick(rows, "reused_tokens").mean(),
            "trace_tokens_per_query": pick(rows, "trace_tokens").mean(),
            "prefill_tokens_per_query": pick(rows, "prefill_tokens").mean(),
            "target_token_cut": ref_forwards.mean() / forwards.mean(),
            "accuracy": pick(rows, "correct").mean(), "accuracy_change": diff["difference"],
            "change_ci_low": diff["ci_low"], "change_ci_high": diff["ci_high"],
            "identical_to_plain": float(np.mean([rows[q]["tokens"] == ref[q]["tokens"] for q in queries])),
            "hit_rate": float(np.mean([rows[q]["hit"] for q in queries])),
            "decode_tokens_per_s": tps, "decode_speedup": tps / ref_tps if tps and ref_tps else None,
        })
    return out


def family_accuracy(query_rows: Sequence[dict], *, warmup: int, batch: int = 1) -> list[dict]:
    """Accuracy per (template family, method) at one batch size, over the queries after the warm-up: which
    families the model can solve at all (plain decoding's accuracy) says where an accuracy comparison can move."""
    groups: dict[tuple, list[bool]] = {}
    for r in query_rows:
        if r["batch_size"] == batch and r["query"] >= warmup:
            groups.setdefault((r["family"], r["method"]), []).append(bool(r["correct"]))
    return [{"family": f, "method": m, "queries": len(v), "accuracy": float(np.mean(v))}
            for (f, m), v in groups.items()]


COLD_KIND = {"trace_draft": "prompt_ngram", "trace_draft_subst": "prompt_ngram"}  # else: plain (see below)


def cold_method(kind: str) -> str:
    """The method a kind *is* with an empty trace cache: trace drafting without references is prompt lookup
    (`TraceDrafter`, proposal for proposal); exemplar and step reuse without a hit are plain decoding; the
    kinds that never retrieve are their own cold start."""
    if kind in ("prompt_ngram", "shared_prefix", "plain"):
        return kind
    return COLD_KIND.get(kind, "plain")


def amortization(query_rows: Sequence[dict], method: str, batch: int, *, window: int = 10) -> list[dict]:
    """Cost per query along the stream, cost = target forward passes per query (prefill included; not wall
    time, which the loaded machine makes noisy). At each position N (1-based) the window is the `window`
    queries ending at N, and window_cost = their forwards under `method` (cache of the N-1 earlier queries)
    over their forwards under the method's cold start (`cold_method`: the same queries with an empty cache).
    The first query *is* served cold, so window_cost(1) = 1: the ratio at N reads as "cost per query after N
    queries / the first query's", paired on the same queries instead of resting on one query. -> rows."""
    rows = _by(query_rows, method, batch)
    if not rows:
        return []
    cold = _by(query_rows, cold_method(next(iter(rows.values()))["kind"]), batch)
    queries = [q for q in sorted(rows) if q in cold]
    warm, base = [rows[q]["forwards"] for q in queries], [cold[q]["forwards"] for q in queries]
    out = []
    for i in range(len(queries)):
        lo = max(0, i + 1 - window)
        out.append({"method": method, "batch_size": batch, "position": i + 1, "forwards": warm[i],
                    "cold_forwards": base[i], "window_cost": sum(warm[lo:i + 1]) / sum(base[lo:i + 1])})
    return out


def amortization_ratio(curve: Sequence[dict], point: int) -> float | None:
    """window_cost at query `point` (= cost per query after `point` queries / the first query's, paired on the
    window's queries); None when the stream is shorter."""
    if point < 1 or len(curve) < point:
        return None
    return curve[point - 1]["window_cost"]


def best_amortization(ratios: dict[str, float | None], table: Sequence[dict], batch: int = 1) -> tuple:
    """(method, ratio) with the lowest amortization ratio among the methods that keep accuracy (paired CI low
    >= ACCURACY_FLOOR; lossless methods always do); (None, None) when none was measured."""
    ok = {r["method"] for r in table if r["batch_size"] == batch and r["change_ci_low"] >= ACCURACY_FLOOR}
    measured = [(m, v) for m, v in ratios.items() if v is not None and m in ok]
    return min(measured, key=lambda mv: mv[1], default=(None, None))


def hit_curve(query_rows: Sequence[dict], thresholds: Sequence[float]) -> list[dict]:
    """Per retrieval method (one method row set each) and threshold t: hit rate (queries whose nearest earlier
    query has similarity >= t) and the share of those hits from the query's own family."""
    out, seen = [], set()
    for r in query_rows:
        key = r["method"].split("[")[-1].split(",")[0].rstrip("]") if "[" in r["method"] else None
        if key in (None, *seen) or r["batch_size"] != 1:
            continue
        seen.add(key)
        rows = [x for x in query_rows if x["method"] == r["method"] and x["batch_size"] == 1
                and not math.isnan(x["similarity"])]
        for t in thresholds:
            hits = [x for x in rows if x["similarity"] >= t]
            out.append({"retrieval": key, "threshold": t, "hit_rate": len(hits) / len(rows) if rows else float("nan"),
                        "same_family": (float(np.mean([x["neighbour_family"] == x["family"] for x in hits]))
                                        if hits else float("nan"))})
    return out


def _row(table: Sequence[dict], method: str, batch: int = 1) -> dict | None:
    return next((r for r in table if r["method"] == method and r["batch_size"] == batch), None)


def best_token_cut(table: Sequence[dict], batch: int = 1) -> dict | None:
    """The method (not plain) with the largest target-token cut whose accuracy CI lower bound >= the floor."""
    ok = [r for r in table if r["batch_size"] == batch and r["kind"] != "plain"
          and r["change_ci_low"] >= ACCURACY_FLOOR]
    return max(ok, key=lambda r: r["target_token_cut"], default=None)


def notebook_goals(table: Sequence[dict], *, goal_draft: str, amortization_value: float | None,
                   amortization_point: int, amortization_method: str | None = None) -> list[Goal]:
    """Notebook 06's goal rows (None = not measured). amortization_value: `best_amortization`'s ratio, of
    `amortization_method`."""
    draft, ngram = _row(table, goal_draft), _row(table, "prompt_ngram")
    vs_ngram = draft["decode_tokens_per_s"] / ngram["decode_tokens_per_s"] if draft and ngram else None
    same = f"identical greedy output on {fmt(draft['identical_to_plain'], '%')} of queries" if draft else ""
    best = best_token_cut(table)
    best_note = (f"{best['method']}: accuracy change {fmt(best['accuracy_change'], 'points')} (95% CI "
                 f"{fmt(best['change_ci_low'], 'points')} to {fmt(best['change_ci_high'], 'points')})") if best else ""
    cut = best["target_token_cut"] if best else None
    return [
        Goal.check("trace_draft_speedup_vs_plain", draft and draft["decode_speedup"], ">=", DRAFT_SPEEDUP_TARGET,
                   unit="x", label=f"{goal_draft} decode speedup over plain, batch 1", note=same),
        Goal.check("trace_draft_speedup_vs_prompt_ngram", vs_ngram, ">=", DRAFT_VS_NGRAM_TARGET, unit="x",
                   label=f"{goal_draft} decode speedup over prompt-only n-gram, batch 1", note=same),
        Goal.check("target_token_cut", cut, ">=", TOKEN_CUT_TARGET, unit="x", note=best_note,
                   label="best cut of target-chosen tokens per query with accuracy CI low >= -2 points"),
        Goal.check("target_token_cut_moonshot", cut, ">=", TOKEN_CUT_MOONSHOT, unit="x", note=best_note,
                   moonshot=True, label="moonshot: target-chosen tokens cut 10x"),
        Goal.check("amortization_ratio", amortization_value, "<=", AMORTIZATION_TARGET, unit="x",
                   label=f"cost per query after {amortization_point} queries / first query's (target forwards, "
                         f"paired on the same queries), best method within the accuracy floor",
                   note=f"{amortization_method}" if amortization_method else ""),
    ]


def findings(table: Sequence[dict], *, goal_draft: str, amortization_value, amortization_point: int,
             prefix: dict, amortization_method: str | None = None,
             family_rows: Sequence[dict] | None = None) -> list[str]:
    """Sentences stating what this run measured, generated from its tables (never typed)."""
    out = []
    lossless = [r for r in table if r["lossless"] and r["kind"] != "plain"]
    same = [f"{r['method']} (B={r['batch_size']}) {fmt(r['identical_to_plain'], '%')}" for r in lossless]
    out.append("Greedy output identical to plain decoding, share of queries: " + "; ".join(same) + ".")
    for batch in sorted({r["batch_size"] for r in table}):
        rows = [r for r in table if r["batch_size"] == batch and r["kind"] != "plain"]
        parts = [f"{r['method']} {r['forwards_per_query']:.1f} forwards/query ({fmt(r['target_token_cut'], 'x')} "
                 f"fewer), {fmt(r['decode_speedup'], 'x')} decode tokens/s, accuracy "
                 f"{fmt(r['accuracy_change'], 'points')} [{fmt(r['change_ci_low'], 'points')}, "
                 f"{fmt(r['change_ci_high'], 'points')}]" for r in rows]
        plain = _row(table, "plain", batch)
        if plain and parts:
            out.append(f"Batch {batch}, against plain ({plain['forwards_per_query']:.1f} forwards/query, accuracy "
                       f"{fmt(plain['accuracy'], '%')}, {fmt(plain['decode_tokens_per_s'])} decode tok/s): "
                       + "; ".join(parts) + ".")
    plain_by_family = [r for r in (family_rows or []) if r["method"] == "plain"]
    if plain_by_family:
        out.append("Plain decoding's accuracy by family (batch 1): " + "; ".join(
            f"{r['family']} {fmt(r['accuracy'], '%')} of {r['queries']}" for r in plain_by_family) + ".")
    best = best_token_cut(table)
    if best:
        out.append(f"Largest cut of target-chosen tokens within the accuracy floor: {best['method']}, "
                   f"{fmt(best['target_token_cut'], 'x')}.")
    if prefix:
        out.append(f"Shared prefix: {prefix['prefix_tokens']} prompt tokens prefilled once; time to first token "
                   f"{prefix['suffix_prefill_s'] * 1e3:.3g} ms (suffix only) against "
                   f"{prefix['full_prefill_s'] * 1e3:.3g} ms (whole prompt) per batch of {prefix['batch_size']}, "
                   f"{fmt(prefix['saved'], '%')} of prefill time saved.")
    if amortization_value is not None:
        out.append(f"Amortization, {amortization_method}: after {amortization_point} queries a query costs "
                   f"{fmt(amortization_value, 'x')} the target forwards it cost with an empty cache (the first "
                   "query's cost; paired on the same window of queries).")
    else:
        out.append(f"The stream is shorter than {amortization_point} queries: amortization not measured at that point.")
    return out


def prefix_summary(batch_rows: Sequence[dict], batch: int) -> dict:
    """Time to first token with and without the shared prefix (sums over the stream's batches)."""
    rows = [r for r in batch_rows if r["kind"] == "shared_prefix" and r["batch_size"] == batch]
    if not rows:
        return {}
    full, suffix = sum(r["full_prefill_s"] for r in rows), sum(r["suffix_prefill_s"] for r in rows)
    return {"batch_size": batch, "prefix_tokens": rows[0]["prefix_tokens"], "full_prefill_s": full / len(rows),
            "suffix_prefill_s": suffix / len(rows), "prefix_once_s": rows[0]["prefix_once_s"],
            "saved": 1 - suffix / full if full > 0 else float("nan")}
