"""Notebook 04's experiment 5: forward passes saved by jump-forward on fixed-key JSON, and what it changes.

`jump_forward_savings` runs a schema suite greedily with each mode and counts forward passes;
`jump_forward_summary` reads both modes' savings off those rows, with how many outputs each mode changed.
A saving is credited only to a mode that keeps outputs: "tokens" and "draft" are exact, "retokenize" is not.
"""
from __future__ import annotations

from decodelab.common.goals import Goal, format_value
from decodelab.constrained.decode import generate

EXACT_MODES = ("tokens", "draft")  # modes whose greedy output is token-for-token that of "off"


def jump_forward_savings(model, tokenizer, engine, items: list[dict], *,
                         modes=("off", "tokens", "draft", "retokenize"),
                         max_new_tokens: int = 96) -> list[dict]:
    """Greedy constrained decoding of each {name, prompt, constraint} under each jump-forward mode.

    -> rows {schema, mode, forward_passes, new_tokens, jumped_tokens, same_tokens, same_text, valid};
    same_* compare with mode "off" (which must be in `modes`).
    """
    if "off" not in modes:
        raise ValueError(f"modes={modes!r} must include 'off' (the reference)")
    rows = []
    for item in items:
        base = None
        for mode in ["off"] + [m for m in modes if m != "off"]:
            res = generate(model, [item["prompt"]], item["constraint"], engine, max_new_tokens=max_new_tokens,
                           jump_forward=mode, tokenizer=tokenizer)
            if mode == "off":
                base = res
            rows.append({"schema": item["name"], "mode": mode, "forward_passes": res.forward_passes + 1,
                         "new_tokens": res.new_tokens, "jumped_tokens": res.jumped_tokens,
                         "same_tokens": res.tokens == base.tokens, "same_text": res.texts == base.texts,
                         "valid": res.valid[0]})
    return rows


def saved_fraction(rows: list[dict], mode: str) -> float:
    """1 - (forward passes with `mode`) / (forward passes without jump-forward), over all schemas.

    Forward passes count the prefill's last position as the first (it yields the first token's logits).
    """
    off = sum(r["forward_passes"] for r in rows if r["mode"] == "off")
    on = sum(r["forward_passes"] for r in rows if r["mode"] == mode)
    return 1.0 - on / off if off else float("nan")


def jump_forward_summary(rows: list[dict]) -> dict:
    """Both modes' savings and what they cost in changed outputs, from `jump_forward_savings` rows.

    -> {schemas, saved_frac: {mode: fraction of forward passes saved}, changed: {mode: schemas whose text
    differs from mode "off"}, changed_tokens: {mode: schemas whose tokens differ}, valid: {mode: schemas
    whose output validates}, greedy_identical: every exact-mode ("tokens", "draft") output token-for-token
    equal to "off" (None if neither ran), exact_mode: the exact mode that saved most}. The exact modes are the
    ones whose saving can be credited without a caveat; "retokenize" saves more by choosing tokenizations
    the model did not.
    """
    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "off"]
    schemas = sorted({r["schema"] for r in rows})
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in ["off"] + modes}
    exact = [r for m in EXACT_MODES for r in by_mode.get(m, [])]
    return {
        "schemas": len(schemas),
        "saved_frac": {m: saved_fraction(rows, m) for m in modes},
        "changed": {m: sum(not r["same_text"] for r in by_mode[m]) for m in modes},
        "changed_tokens": {m: sum(not r["same_tokens"] for r in by_mode[m]) for m in modes},
        "valid": {m: sum(bool(r["valid"]) for r in by_mode[m]) for m in ["off"] + modes},
        "greedy_identical": None if not exact else all(r["same_tokens"] for r in exact),
        "exact_mode": max((m for m in EXACT_MODES if m in modes), default=None,
                          key=lambda m: saved_fraction(rows, m)),
    }


def jump_forward_metrics(summary: dict, engine_name: str) -> dict:
    """The run's jump-forward metrics from a `jump_forward_summary`: each mode's saved fraction, outputs and
    tokens changed, schemas, the engine, and whether exact jump-forward kept greedy output identical."""
    return {**{f"jump_forward_saved_frac_{mode}": saved for mode, saved in summary["saved_frac"].items()},
            "jump_forward_outputs_changed": summary["changed"],
            "jump_forward_tokens_changed": summary["changed_tokens"],
            "jump_forward_schemas": summary["schemas"], "jump_forward_engine": engine_name,
            "jump_forward_greedy_identical": summary["greedy_identical"]}


def jump_forward_goal(summary: dict, *, target: float = 0.30) -> Goal:
    """The goal "output-preserving jump-forward saves >= target of forward passes"; the re-tokenizing mode's
    saving and the outputs it changed go in the note."""
    mode = summary.get("exact_mode") or "tokens"
    exact = summary["saved_frac"].get(mode) if summary.get("greedy_identical") is not False else None
    return Goal.check("jump_forward_saved_exact", exact, ">=", target, unit="%",
                      label="forward passes saved by output-preserving jump-forward (fixed-key schemas, greedy)",
                      note=f"exact mode {mode!r} (tokens: {format_value(summary['saved_frac'].get('tokens'), '%')}, "
                           f"draft: {format_value(summary['saved_frac'].get('draft'), '%')}); "
                           f"re-tokenizing mode: saves {format_value(summary['saved_frac'].get('retokenize'), '%')}, "
                           f"changes the text of {summary['changed'].get('retokenize', 0)} and the tokens of "
                           f"{summary['changed_tokens'].get('retokenize', 0)} of {summary['schemas']} outputs")
