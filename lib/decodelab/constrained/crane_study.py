"""Notebook 04's reasoning-then-constraint experiment: the three modes of `constrained.crane` on the same
arithmetic problems, paired accuracy differences with bootstrap CIs, validity, tokens, and the goal rows.

The "free" rows are the crane rows' drafts read as free replies: a crane draft is the free reply token for token
(same prompt, greedy picks, budget and EOS; tests/constrained/test_crane.py checks it), so one generation gives
both and the pair differs only in how the answer is read (lenient regex vs the grammar's JSON field)."""
from __future__ import annotations

import numpy as np

from decodelab.common.goals import Goal
from decodelab.common.stats import bootstrap_ci, paired_bootstrap_diff
from decodelab.constrained.crane import (
    DELIMITER,
    HANDOFF,
    MODES,
    SPACING,
    answer_constraint,
    answer_problems,
    free_reply,
)

NON_INFERIORITY = 0.05  # crane may trail free reasoning by at most this accuracy (CI lower bound of the difference)


def crane_study(model, tokenizer, problems, engine, *, answer_schema: dict | None, reasoning_budget: int,
                delimiter: str | None = DELIMITER, handoff: str = HANDOFF, spacing: str = SPACING,
                batch_size: int = 64) -> list[dict]:
    """Rows {problem, mode, correct, valid, finished, tokens, answer, truth, text} for every problem x mode
    (free rows: the crane drafts, see the module doc).

    The answer schema is checked against every problem's answer first (a clear error before generation)."""
    from decodelab.workloads.tasks import arithmetic_prompt

    if not problems:
        raise ValueError("problems=[] must hold at least one arithmetic problem")
    constraint = answer_constraint(answer_schema, [p.answer for p in problems], spacing=spacing)
    prompts = [arithmetic_prompt(p, tokenizer) for p in problems]
    replies: dict[str, list] = {mode: [] for mode in MODES}
    for mode in ("constrained", "crane"):
        for start in range(0, len(prompts), batch_size):
            replies[mode] += answer_problems(model, tokenizer, prompts[start:start + batch_size], mode, engine,
                                             constraint, reasoning_budget=reasoning_budget, delimiter=delimiter,
                                             handoff=handoff)
    replies["free"] = [free_reply(tokenizer, r.draft, r.draft_finished) for r in replies["crane"]]
    rows = []
    for mode in MODES:
        for problem, reply in zip(problems, replies[mode]):
            rows.append({"problem": problem.id, "mode": mode, "correct": reply.answer == problem.answer,
                         "valid": reply.valid, "finished": reply.finished, "tokens": reply.tokens,
                         "answer": reply.answer, "truth": problem.answer, "text": reply.text})
    return rows


def disagreements(rows: list[dict], a: str = "free", b: str = "crane") -> list[dict]:
    """Problems where modes a and b read different answers: {problem, truth, a, b, text (b's reply)}."""
    by = {(r["mode"], r["problem"]): r for r in rows}
    out = []
    for r in rows:
        other = by.get((a, r["problem"]))
        if r["mode"] == b and other is not None and other.get("answer") != r.get("answer"):
            out.append({"problem": r["problem"], "truth": r.get("truth"), a: other.get("answer"),
                        b: r.get("answer"), "text": r.get("text", "")})
    return out


def _by_mode(rows: list[dict], key: str) -> dict[str, np.ndarray]:
    """{mode: values of `key` in problem order} (every mode holds the same problems, in the same order)."""
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(r["mode"], []).append(float(r[key]))
    return {m: np.array(v) for m, v in out.items()}


def crane_summary(rows: list[dict], *, seed: int = 0) -> dict:
    """-> {modes: rows {mode, n, accuracy, accuracy_ci, validity, tokens_mean}, differences: paired
    accuracy differences crane - constrained and crane - free, each {difference, ci_low, ci_high, ...},
    disagreements: `disagreements(rows)` (where the JSON field and the free draft read different answers)}."""
    correct, valid, tokens = _by_mode(rows, "correct"), _by_mode(rows, "valid"), _by_mode(rows, "tokens")
    modes = []
    for mode in correct:
        acc, low, high = bootstrap_ci(correct[mode], seed=seed)
        modes.append({"mode": mode, "n": len(correct[mode]), "accuracy": acc, "accuracy_ci": [low, high],
                      "validity": float(valid[mode].mean()), "tokens_mean": float(tokens[mode].mean())})
    differences = {}
    for other in ("constrained", "free"):
        if "crane" in correct and other in correct:
            differences[f"crane_minus_{other}"] = paired_bootstrap_diff(correct["crane"], correct[other], seed=seed)
    return {"modes": modes, "differences": differences, "disagreements": disagreements(rows)}


def crane_goals(summary: dict) -> list[Goal]:
    """(c) every answer valid; (c) beats fully constrained output (CI lower bound > 0); (c) is within
    NON_INFERIORITY of free reasoning (CI lower bound >= -NON_INFERIORITY)."""
    by_mode = {m["mode"]: m for m in summary["modes"]}
    crane = by_mode.get("crane", {})
    out = [Goal.check("crane_validity", crane.get("validity"), "==", 1.0, unit="%",
                      label="reason then constrain: share of answers that validate against the answer schema")]
    for other, op, target, label in (
            ("constrained", ">", 0.0, "accuracy: reason-then-constrain minus fully constrained JSON (CI lower bound)"),
            ("free", ">=", -NON_INFERIORITY, "accuracy: reason-then-constrain minus free output (CI lower bound)")):
        d = summary["differences"].get(f"crane_minus_{other}")
        note = disagreement_note(summary) if other == "free" else ""
        out.append(Goal.check(f"crane_vs_{other}_accuracy", d and d["ci_low"], op, target, unit="%", label=label,
                              estimate=d and d["difference"], ci=d and (d["ci_low"], d["ci_high"]), note=note))
    return out


def disagreement_upper_bound(k: int, n: int, level: float = 0.95) -> float:
    """Exact one-sided (Clopper-Pearson) upper bound on a rate seen k times in n trials: the paired bootstrap's
    interval collapses to [0, 0] when no pair differs, but 0 of n still allows a rate up to ~3/n."""
    from scipy.stats import beta

    return 1.0 if k >= n else float(beta.ppf(level, k + 1, n - k))


def disagreement_note(summary: dict) -> str:
    """The goal row's note: on how many problems the answer field and the free text read different answers."""
    n = next((m["n"] for m in summary["modes"] if m["mode"] == "crane"), 0)
    if not n:
        return ""
    k = len(summary.get("disagreements", []))
    return (f"the answer field and the free text disagree on {k} of {n} problems "
            f"(95% upper bound on the rate: {disagreement_upper_bound(k, n):.1%})")


def crane_metrics(summary: dict) -> dict:
    """The run's metrics of this experiment (flat dicts keyed by mode / comparison)."""
    return {"crane_accuracy": {m["mode"]: m["accuracy"] for m in summary["modes"]},
            "crane_accuracy_ci": {m["mode"]: m["accuracy_ci"] for m in summary["modes"]},
            "crane_validity": {m["mode"]: m["validity"] for m in summary["modes"]},
            "crane_tokens": {m["mode"]: m["tokens_mean"] for m in summary["modes"]},
            "crane_differences": summary["differences"],
            "crane_disagreements": len(summary.get("disagreements", [])),
            "crane_disagreements_free_right": sum(d["free"] == d["truth"] for d in summary.get("disagreements", []))}
