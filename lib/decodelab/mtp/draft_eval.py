"""The retrofit module measured as a drafter for the frozen model, beside n-gram and layer-skip drafters.

`drafter_rows`: for each workload category (data/spec_workloads.jsonl: code_edit, extraction, chat) and batch
size, plain greedy decoding against greedy speculative decoding through the generic loop
(`decodelab.speculation.decode.generate`) with each drafter: same prompts, same `max_new_tokens`, same EOS
set, runs alternating (order flipped each repeat), fastest of `repeats` kept, greedy output compared row by
row. Acceptance per draft position is the loop's own count (`SpecStats.acceptance_per_position`).

Batch 1 decodes `batch1_prompts` prompts one at a time inside each timed call (their times add up, their
acceptance counts pool): one prompt of 48 tokens gives a drafter ~20 judged drafts, too few to read an
acceptance rate or a speedup from.

`prompt_acceptance`: the acceptance a goal reads, untimed, over many prompts decoded one at a time, with a
bootstrap interval over prompts (a few prompts' ~100 judged drafts leave about +-5 points of sampling noise).
"""
from __future__ import annotations

import math

from decodelab.common.timing import alternating_times


def category_prompts(tokenizer, categories: list[str], n: int) -> dict[str, list[list[int]]]:
    """{category: n chat-formatted prompts (cycled)} from the shipped speculation workloads."""
    from decodelab.workloads.spec import load_workloads, workload_prompts

    return {c: workload_prompts(tokenizer, load_workloads(categories=[c]), n) for c in categories}


def distinct_prompts(tokenizer, category: str, n: int) -> list[list[int]]:
    """The first min(n, all) chat-formatted prompts of one workload category, none repeated (an interval over
    prompts must not count a prompt twice)."""
    from decodelab.workloads.spec import load_workloads, workload_prompts

    items = load_workloads(categories=[category])
    return workload_prompts(tokenizer, items, min(n, len(items)))


class _Pooled:
    """Several batch-1 runs read as one: their rows in order; for speculative runs, one `SpecStats` holding
    the runs' summed acceptance counts (so tau and acceptance pool counts, not rates)."""

    def __init__(self, results: list):
        from decodelab.speculation.decode import SpecStats

        self.tokens = [row for r in results for row in r.tokens]
        spec = [r.stats for r in results if isinstance(r.stats, SpecStats)]
        self.stats = SpecStats(batch_size=len(results), prompt_tokens=sum(s.prompt_tokens for s in spec),
                               row_steps=sum(s.row_steps for s in spec), emitted=sum(s.emitted for s in spec),
                               reached=[sum(v) for v in zip(*(s.reached for s in spec))],
                               accepted=[sum(v) for v in zip(*(s.accepted for s in spec))]) if spec else None


def _finite(values: list[float], k: int) -> list[float | None]:
    return [None if (v != v or math.isinf(v)) else v for v in list(values)[:k]]


def drafter_rows(target, drafters: dict, prompts_by_category: dict[str, list[list[int]]], batch_sizes: list[int], *,
                 k: int, max_new_tokens: int, eos_token_ids: list[int] | None = None, repeats: int = 1,
                 batch1_prompts: int = 1) -> list[dict]:
    """One row per (category, batch, drafter): {"category", "batch", "rows" (rows decoded: the batch, or at
    batch 1 the prompts decoded one at a time), "drafter", "k", "tau", "acceptance" (per draft position, None
    where no draft reached it), "speedup" (plain s / speculative s, fastest runs), "plain_s", "spec_s",
    "greedy_match", "rows_identical", "vocab_coverage" (the share of plain greedy's tokens the drafter's
    vocabulary holds, for drafters that draft from part of it; else None)}.

    target: the frozen model's `Transformer`; drafters: {name: a zero-argument factory of a fresh `Drafter`};
    batch1_prompts: prompts decoded one after another at batch 1 (module doc).
    """
    from decodelab.core.engine import generate as plain_generate
    from decodelab.speculation.decode import generate as spec_generate

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1")
    if isinstance(batch1_prompts, bool) or not isinstance(batch1_prompts, int) or batch1_prompts < 1:
        raise ValueError(f"batch1_prompts={batch1_prompts!r} must be an int >= 1")
    eos = list(eos_token_ids or [])
    rows = []
    for category, prompts in prompts_by_category.items():
        for batch in batch_sizes:
            groups = ([[prompts[i % len(prompts)]] for i in range(batch1_prompts)] if batch == 1
                      else [[prompts[i % len(prompts)] for i in range(batch)]])
            chosen = [p for group in groups for p in group]
            outputs: dict = {}
            plain_one = lambda g: plain_generate(target, g, max_new_tokens=max_new_tokens, eos_token_ids=eos)  # noqa: E731
            calls = {"plain": lambda: _Pooled([plain_one(g) for g in groups])}
            for name, factory in drafters.items():
                spec_one = lambda g, f=factory: spec_generate(target, g, f(), k=k, max_new_tokens=max_new_tokens,  # noqa: E731
                                                              eos_token_ids=eos)
                calls[name] = lambda one=spec_one: _Pooled([one(g) for g in groups])

            def keeping(name):
                def call():
                    outputs[name] = calls[name]()
                return call

            times = alternating_times({name: keeping(name) for name in calls}, repeats, target.device, warmup=False)
            plain_s, plain = min(times["plain"]), outputs["plain"]
            for name in drafters:
                out = outputs[name]
                same = sum(a == b for a, b in zip(out.tokens, plain.tokens))
                probe = drafters[name]()
                covered = probe.vocab_coverage(chosen, plain.tokens) if hasattr(probe, "vocab_coverage") else None
                rows.append({"category": category, "batch": batch, "rows": len(chosen), "drafter": name, "k": k,
                             "tau": out.stats.tau, "acceptance": _finite(out.stats.acceptance_per_position, k),
                             "speedup": plain_s / min(times[name]), "plain_s": plain_s, "spec_s": min(times[name]),
                             "greedy_match": same == len(chosen), "rows_identical": same, "vocab_coverage": covered})
    return rows


def prompt_acceptance(target, factory, prompts: list[list[int]], *, k: int, max_new_tokens: int,
                      eos_token_ids: list[int] | None = None, level: float = 0.95) -> dict:
    """A drafter's acceptance per draft position, each prompt decoded alone by greedy speculative decoding
    (untimed: acceptance does not depend on load), pooled over prompts as a ratio of counts, with a percentile
    bootstrap interval over prompts (prompts resampled whole, so their drafts' correlation is kept).

    factory: a zero-argument factory of a fresh `Drafter` (one per prompt).
    -> {"prompts", "k", "acceptance" (per position, None where no draft reached it), "ci" ((low, high) or None
        per position), "level", "tau" (pooled), "accepted" / "reached" (per prompt, per position)}.
    """
    import numpy as np

    from decodelab.common.stats import bootstrap_ci
    from decodelab.speculation.decode import generate as spec_generate

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an int >= 1")
    if not prompts:
        raise ValueError("prompts is empty: need at least one prompt to measure acceptance on")
    stats = [spec_generate(target, [p], factory(), k=k, max_new_tokens=max_new_tokens,
                           eos_token_ids=list(eos_token_ids or [])).stats for p in prompts]
    accepted = [list(s.accepted[:k]) for s in stats]
    reached = [list(s.reached[:k]) for s in stats]
    pooled = lambda x: x[..., 0].sum(-1) / np.maximum(x[..., 1].sum(-1), 1)  # noqa: E731  (accepted, reached) units
    acceptance, ci = [], []
    for i in range(k):
        counts = np.array([[a[i], r[i]] for a, r in zip(accepted, reached)], dtype=float)
        if counts[:, 1].sum() == 0:
            acceptance.append(None)
            ci.append(None)
            continue
        rate, low, high = bootstrap_ci(counts, statistic=pooled, level=level)
        acceptance.append(rate)
        ci.append((low, high))
    tau = sum(s.emitted for s in stats) / max(sum(s.row_steps for s in stats), 1)
    return {"prompts": len(prompts), "k": k, "max_new_tokens": max_new_tokens, "acceptance": acceptance, "ci": ci,
            "level": level, "tau": tau, "accepted": accepted, "reached": reached}


def acceptance_note(result: dict | None, position: int = 0) -> str:
    """"24 prompts decoded alone, k = 3, up to 48 tokens, 610 judged drafts; 95% interval over prompts
    55.0%-63.1%; " for a goal's note from `prompt_acceptance`'s result ("" for None)."""
    if result is None:
        return ""
    judged = sum(r[position] for r in result["reached"])
    ci = result["ci"][position]
    interval = (f"{result['level']:.0%} interval over prompts {ci[0]:.1%}-{ci[1]:.1%}; " if ci is not None
                else "no draft reached this position; ")
    return (f"{result['prompts']} prompts decoded alone, k = {result['k']}, up to {result['max_new_tokens']} tokens, "
            f"{judged} judged drafts; " + interval)


def pick(rows: list[dict], key: str, *, drafter: str, category: str, batch: int | None = None,
         position: int | None = None, k: int | None = None):
    """One value from `drafter_rows` (batch None: the smallest batch measured; k None: the first row, the
    comparison's own draft length), or None if not measured."""
    mine = [r for r in rows if r["drafter"] == drafter and r["category"] == category and (k is None or r["k"] == k)]
    if batch is None and mine:
        batch = min(r["batch"] for r in mine)
    mine = [r for r in mine if r["batch"] == batch]
    if not mine:
        return None
    value = mine[0][key]
    if position is not None:
        value = value[position] if value is not None and len(value) > position else None
    return value


def best_k(rows: list[dict], *, drafter: str, category: str, batch: int) -> dict | None:
    """The fastest of a drafter's rows over the draft lengths measured at (category, batch), each against
    its own interleaved plain runs, or None. (The best of a few noisy speedups leans high by about their
    spread: read it with the row's k and the other k's rows.)"""
    mine = [r for r in rows if r["drafter"] == drafter and r["category"] == category and r["batch"] == batch]
    return max(mine, key=lambda r: r["speedup"]) if mine else None


def best_k_note(rows: list[dict], *, drafter: str, category: str, batch: int) -> str:
    """"k = 2 of [1, 2, 3] (k = 1: 1.27x, k = 2: 1.33x, k = 3: 1.25x); " for `best_k`'s goal note, "" if none."""
    mine = sorted((r for r in rows if r["drafter"] == drafter and r["category"] == category and r["batch"] == batch),
                  key=lambda r: r["k"])
    if not mine:
        return ""
    fastest = best_k(rows, drafter=drafter, category=category, batch=batch)
    each = ", ".join(f"k = {r['k']}: {r['speedup']:.2f}x" for r in mine)
    return f"k = {fastest['k']} of {[r['k'] for r in mine]} ({each}); "
