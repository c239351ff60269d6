"""Notebook 05's DeepConf experiment on the pools of `experiment.sample_pools`: offline confidence-weighted and
-filtered votes, online stopping replayed on the same samples (paired with majority, log-prob weighting, ESC
and adaptive consistency in `votes.early_stop_table`), one real online decode checked against the replay,
and the goal rows and generated sentences that say whether it helped on this model.
"""
from __future__ import annotations

from collections.abc import Sequence

from decodelab.consistency import confidence as conf
from decodelab.consistency.votes import check_keep, vote_accuracy_vs_n

TOKENS_SAVED_TARGET = 0.5  # the bar adaptive consistency is held to (issue 17 asks for honest token savings)
ACCURACY_CHANGE_TARGET = -0.02  # vs the whole-pool majority, judged on the 95% CI lower bound


def check_settings(*, window: int, max_new_tokens: int, keeps: Sequence[float], n_warmup: int, pool_size: int,
                   top_k: int, consensus: float | None = None) -> None:
    """Every DeepConf parameter checked before any generation, each error naming the parameter."""
    conf.check_window(window, max_new_tokens)
    try:
        conf.check_consensus(consensus)
    except (TypeError, ValueError):
        raise ValueError(f"confidence_consensus={consensus!r} must be None or a vote share in (0, 1]") from None
    if not keeps:
        raise ValueError("confidence_keep=[] must hold at least one share in (0, 1]")
    for keep in keeps:
        check_keep(keep)
    if not 1 <= n_warmup < pool_size:
        raise ValueError(f"confidence_warmup={n_warmup!r} must be in [1, {pool_size - 1}]: warm-up samples per "
                         f"problem, fewer than the pool (max(n_values) = {pool_size}) so some can stop")
    if top_k < 1:
        raise ValueError(f"confidence_top_k={top_k!r} must be >= 1")


def trace_confidences(pools, window: int) -> list[list[float]]:
    """Per problem, per sample: its lowest group confidence."""
    return [[conf.trace_confidence(c, window) for c in pool] for pool in pools.confidences]


def accuracy_vs_n(pools, n_values: Sequence[int], *, window: int, keeps: Sequence[float], n_subsets: int,
                  seed: int) -> list[dict]:
    """Offline DeepConf votes on the same subset draws as `experiment.accuracy_vs_n` (same seed): weighted by
    the lowest group confidence ("confidence"), then filtered to each subset's top share ("conf_top{keep}")."""
    weights = trace_confidences(pools, window)
    common = dict(lengths=pools.lengths, n_subsets=n_subsets, seed=seed, weights=weights)
    rows = vote_accuracy_vs_n(pools.answers, pools.truths, n_values, vote="confidence", **common)
    for keep in keeps:
        rows += vote_accuracy_vs_n(pools.answers, pools.truths, n_values, vote=f"conf_top{keep:g}", keep=keep,
                                   **common)
    return rows


def online_rules(pools, *, window: int, keeps: Sequence[float], n_warmup: int,
                 consensus: float | None = None) -> dict:
    """`votes.early_stop_table` extra rules: DeepConf online at each kept share, replayed on full traces, with
    the paper's adaptive sampling (stop drawing at `consensus`) when it is not None."""
    tail = "" if consensus is None else f",consensus={consensus:g}"
    return {("deepconf_online", f"keep={keep:g},warmup={n_warmup}{tail}"):
            (lambda i, keep=keep: conf.online_rule(pools.answers[i], pools.confidences[i], window=window,
                                                   n_warmup=n_warmup, keep=keep, consensus=consensus))
            for keep in keeps}


def online_check(model, problems, pools, *, n_problems: int, max_new_tokens: int, window: int, keep: float,
                 n_warmup: int, top_k: int, temperature: float, sampler: dict | None, seed: int,
                 prompts_per_batch: int) -> dict:
    """Decode the pools' first batches again (whole batches of `prompts_per_batch` until `n_problems` are
    covered: the same batch shapes, so the same logits) with online stopping for real (the first n_warmup rows
    of each problem run to the end, the rest stop below the threshold their warm-up set), with the pools'
    per-row streams, and compare with the replay: every row must equal its pool sample cut at the replayed
    stop. -> {problems, rows, equal_to_replay, stopped, tokens, tokens_unstopped, seconds,
    seconds_unstopped (the pools' time for the same batches; one run each, not interleaved)}."""
    from decodelab.common.seeding import row_generator
    from decodelab.common.timing import timed
    from decodelab.consistency.experiment import make_sampler
    from decodelab.workloads import tasks

    n = pools.pool_size
    count = min(-(-n_problems // prompts_per_batch) * prompts_per_batch, len(problems))
    thresholds = conf.warmup_thresholds(pools.confidences[:count], window=window, n_warmup=n_warmup, keep=keep)
    stops = conf.stream_stops(pools.confidences[:count], thresholds, window=window, n_warmup=n_warmup)
    sampler_obj = make_sampler(temperature, sampler)
    out = {"problems": count, "rows": count * n, "equal_to_replay": True, "stopped": 0, "tokens": 0,
           "tokens_unstopped": sum(sum(pools.lengths[i]) for i in range(count)), "seconds": 0.0,
           "seconds_unstopped": sum(pools.batch_seconds[:-(-count // prompts_per_batch)])}
    for start in range(0, count, prompts_per_batch):
        chunk = list(range(start, min(start + prompts_per_batch, count)))
        prompts = [tasks.arithmetic_prompt(problems[i], model.tokenizer) for i in chunk]
        row_thresholds = [conf.NEVER_STOP if s < n_warmup else thresholds[i] for i in chunk for s in range(n)]
        generators = [row_generator(seed, i, s, device=model.device) for i in chunk for s in range(n)]
        (policy, loop, _), seconds = timed(lambda: conf.decode_with_confidence(
            model, prompts, n, max_new_tokens=max_new_tokens, thresholds=row_thresholds, window=window,
            top_k=top_k, sampler=sampler_obj, generator=generators), model.device)
        out["seconds"] += seconds
        for b, (i, s) in enumerate((i, s) for i in chunk for s in range(n)):
            want = pools.lengths[i][s] if stops[i][s] is None else stops[i][s]
            same = loop.tokens[b] == pools.tokens[i][s][:want] and len(loop.tokens[b]) == want
            out["equal_to_replay"] &= same and policy.stopped_low[b] == (stops[i][s] is not None)
            out["stopped"] += int(policy.stopped_low[b])
            out["tokens"] += len(loop.tokens[b])
    out["tokens_saved"] = 1.0 - out["tokens"] / out["tokens_unstopped"] if out["tokens_unstopped"] else 0.0
    return out


def goals(early_rows: Sequence[dict]) -> list:
    """DeepConf's goal rows from the first online setting of `early_stop_table`: tokens saved (vs the
    whole-pool majority's tokens) and the paired accuracy change (CI lower bound)."""
    from decodelab.common.goals import Goal

    row = next((r for r in early_rows if r["method"] == "deepconf_online"), None)
    rule = f"DeepConf online ({row['setting']})" if row else "DeepConf online"
    return [
        Goal.check("deepconf_tokens_saved", row["tokens_saved"] if row else None, ">=", TOKENS_SAVED_TARGET,
                   unit="%", label=f"tokens {rule} saves vs majority over the whole pool",
                   note="the same bar as adaptive consistency's samples saved"),
        Goal.check("deepconf_accuracy_change", row["change_ci_low"] if row else None, ">=", ACCURACY_CHANGE_TARGET,
                   unit="points", label=f"accuracy change of {rule} (95% CI lower bound)",
                   estimate=row["accuracy_change"] if row else None,
                   ci=(row["change_ci_low"], row["change_ci_high"]) if row else None),
    ]


def findings(*, accuracy_rows: Sequence[dict], early_rows: Sequence[dict], check: dict | None) -> list[str]:
    """What DeepConf did on this model, generated from the tables: the offline votes against majority at the
    largest n, the online rule's tokens and accuracy against majority and against the other stopping rules,
    a verdict, and the real online run against its replay."""
    from decodelab.common.goals import format_value as fmt

    out = []
    largest = max(r["n"] for r in accuracy_rows)
    at = {r["vote"]: r for r in accuracy_rows if r["n"] == largest}
    if "majority" in at:
        parts = [f"{vote} {fmt(r['accuracy'], '%')} (95% CI {fmt(r['ci_low'], '%')}-{fmt(r['ci_high'], '%')})"
                 for vote, r in at.items()]
        out.append(f"Votes over n = {largest} samples: " + "; ".join(parts) + ".")
    online = [r for r in early_rows if r["method"] == "deepconf_online"]
    reference = early_rows[0]
    for r in online:
        helped = r["tokens_saved"] >= TOKENS_SAVED_TARGET and r["change_ci_low"] >= ACCURACY_CHANGE_TARGET
        kept_accuracy = r["change_ci_low"] >= ACCURACY_CHANGE_TARGET
        verdict = ("it helps on this model" if helped else
                   "it does NOT help on this model: it saves too few tokens" if kept_accuracy
                   else "it does NOT help on this model: it loses accuracy")
        out.append(f"DeepConf online ({r['setting']}) generated {r['mean_tokens']:.0f} tokens per problem against "
                   f"{reference['mean_tokens']:.0f} for majority over the whole pool ({fmt(r['tokens_saved'], '%')} "
                   f"saved), accuracy change {fmt(r['accuracy_change'], 'points')} (95% CI "
                   f"{fmt(r['change_ci_low'], 'points')} to {fmt(r['change_ci_high'], 'points')}): {verdict}.")
    others = [r for r in early_rows[1:] if r["method"] != "deepconf_online"]
    if online and others:
        best = max(others, key=lambda r: r["tokens_saved"] if r["change_ci_low"] >= ACCURACY_CHANGE_TARGET else -1)
        out.append(f"Of the other stopping rules, {best['method']} ({best['setting']}) saved the most tokens within "
                   f"the accuracy bar: {fmt(best['tokens_saved'], '%')} (accuracy change "
                   f"{fmt(best['accuracy_change'], 'points')}).")
    if check:
        out.append(f"Online stopping run for real on {check['problems']} problems ({check['rows']} rows): "
                   f"{'equal' if check['equal_to_replay'] else 'NOT equal'} to the replay token for token; "
                   f"{check['stopped']} rows stopped, {fmt(check['tokens_saved'], '%')} of tokens saved, wall time "
                   f"{check['seconds']:.3g} s against {check['seconds_unstopped']:.3g} s unstopped (one run each, not "
                   "interleaved; stopped rows leave the shared-prefix batch once a quarter of it has stopped, "
                   "so tokens saved turn into time saved only as the batch shrinks).")
    return out
