"""Jump-forward decoding: append what the grammar forces without asking the model.

Two ways (see `constrained.generate`, jump_forward=...):
- `forced_tokens` ("tokens"): while the mask allows exactly one token, that token is the only choice any
  sampler could make, so appending it changes nothing; its forward pass is merged into the next one.
- `retokenize_forward` ("retokenize", SGLang 2024): the grammar forces a string (e.g. '","age":' after
  a string value); append it, re-tokenizing the boundary (the just-sampled token + the forced text) with
  the tokenizer, since e.g. '"' + ',"age":' tokenizes differently from the two parts. The model never
  chose that tokenization, so later tokens can differ from decoding without jump-forward.

`jump_forward_savings` runs a schema suite greedily with each mode and counts forward passes;
`jump_forward_summary` reads both modes' savings off those rows, with how many outputs each mode changed.
A saving is credited only to a mode that keeps outputs: "tokens" is exact, "retokenize" is not.
"""
from __future__ import annotations

from decodelab.constrained.masks import allocate_bitmask, bitmask_to_bool


def forced_tokens(matcher, vocab_size: int, budget: int) -> list[int]:
    """Accept tokens while the mask allows exactly one; -> those tokens (at most `budget`)."""
    out = []
    bitmask = allocate_bitmask(1, vocab_size)
    while len(out) < budget and not matcher.is_terminated():
        bitmask.zero_()
        matcher.fill(bitmask, 0)
        allowed = bitmask_to_bool(bitmask, vocab_size)[0].nonzero().flatten()
        if allowed.numel() != 1:
            break
        token = int(allowed[0])
        if not matcher.accept(token):
            break
        out.append(token)
    return out


def retokenize_forward(matcher, pending: list[int], tokenizer, budget: int) -> list[int]:
    """SGLang jump-forward: replace the just-sampled token by tokenize(its text + forced string).

    The sampled token has not been fed to the model yet, so swapping it costs nothing. If the grammar
    rejects the re-tokenized sequence, keep the sampled token and append the forced string's own tokens;
    if that fails too, do not jump.
    """
    forced = matcher.forced_string()
    if not forced or tokenizer is None:
        return pending
    last = pending[-1]
    merged = tokenizer(tokenizer.decode([last]) + forced, add_special_tokens=False).input_ids
    for candidate, drop in ((merged, 1), (tokenizer(forced, add_special_tokens=False).input_ids, 0)):
        if not candidate or len(candidate) - drop > budget:
            continue
        matcher.rollback(drop)
        accepted = 0
        for token in candidate:
            if not matcher.accept(token):
                break
            accepted += 1
        if accepted == len(candidate):
            return pending[: len(pending) - drop] + candidate
        matcher.rollback(accepted)
        if drop:
            matcher.accept(last)
    return pending


def jump_forward_savings(model, tokenizer, engine, items: list[dict], *, modes=("off", "tokens", "retokenize"),
                         max_new_tokens: int = 96) -> list[dict]:
    """Greedy constrained decoding of each {name, prompt, constraint} under each jump-forward mode.

    -> rows {schema, mode, forward_passes, new_tokens, jumped_tokens, same_tokens, same_text, valid};
    same_* compare with mode "off" (which must be in `modes`).
    """
    from decodelab.constrained.decode import generate

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
    whose output validates}, greedy_identical: every "tokens" output token-for-token equal to "off"
    (None if that mode was not run)}. The exact mode ("tokens") is the one whose saving can be credited
    without a caveat; "retokenize" saves more by choosing tokenizations the model did not.
    """
    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != "off"]
    schemas = sorted({r["schema"] for r in rows})
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in ["off"] + modes}
    exact = by_mode.get("tokens")
    return {
        "schemas": len(schemas),
        "saved_frac": {m: saved_fraction(rows, m) for m in modes},
        "changed": {m: sum(not r["same_text"] for r in by_mode[m]) for m in modes},
        "changed_tokens": {m: sum(not r["same_tokens"] for r in by_mode[m]) for m in modes},
        "valid": {m: sum(bool(r["valid"]) for r in by_mode[m]) for m in ["off"] + modes},
        "greedy_identical": None if not exact else all(r["same_tokens"] for r in exact),
    }
