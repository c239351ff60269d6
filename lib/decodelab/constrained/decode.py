"""Constrained decoding on the decode engine: per-step masks, batched rows, jump-forward, validation.

The loop (per step, B rows):  logits (B, V) -> fill each row's mask (engine) -> disallowed at -inf ->
sampler picks (B,) -> matchers accept -> [jump-forward appends forced tokens] -> one forward of every
row's pending tokens (ragged, `n_new` per row) -> logits of each row's last token.

Jump-forward modes:
- "off": one token per forward pass.
- "tokens": while the mask allows exactly one token, append it without asking the model. Greedy output
  is token-for-token the same as "off" (a one-token mask leaves argmax no choice); those tokens then ride
  in the next forward together, so the forward passes for them are saved.
- "retokenize": SGLang-style. Append the whole string the grammar forces (`forced_string`), re-tokenizing
  the last sampled token + that string canonically, since the boundary token may merge with it. Saves more
  passes but picks the tokenization itself, so outputs can differ from "off" (the notebook measures how often).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from decodelab.constrained.jump_forward import forced_tokens, retokenize_forward
from decodelab.constrained.masks import (
    BatchMasker,
    Constraint,
    ConstraintError,
    MaskEngine,
    UnsupportedConstraint,
    apply_bitmask,
    make_engine,
)

JUMP_FORWARD = ("off", "tokens", "retokenize")


__all__ = ["Constraint", "ConstraintError", "UnsupportedConstraint", "make_engine", "generate", "validate_output",
           "ConstrainedResult", "JUMP_FORWARD", "sample_free"]


@dataclass
class ConstrainedResult:
    tokens: list[list[int]]          # new tokens per row, EOS included when the grammar ended
    texts: list[str]                 # decoded outputs (EOS dropped)
    finished: list[bool]             # whether each row's grammar terminated (False: ran out of max_new_tokens)
    valid: list[bool]                # parses and validates (jsonschema / regex full match)
    forward_passes: int              # model calls after the prefill
    jumped_tokens: int               # tokens appended by jump-forward without a model call of their own
    mask_s: list[float] = field(default_factory=list)   # wall seconds filling all rows' masks, per step
    step_s: list[float] = field(default_factory=list)   # wall seconds of the model forward, per step
    prefill_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def validate_output(constraint: Constraint, text: str) -> bool:
    """Does `text` satisfy the constraint? JSON: parses and validates (jsonschema); regex: full match."""
    if constraint.kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), constraint.spec)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    import regex

    return regex.fullmatch(constraint.pattern, text) is not None


def compile_all(engine: MaskEngine, constraints: list[Constraint]) -> list:
    """Compile each distinct constraint once (errors raise here, before any generation)."""
    cache: dict[int, object] = {}
    out = []
    for c in constraints:
        key = id(c)
        if key not in cache:
            cache[key] = engine.compile(c)
        out.append(cache[key])
    return out


@torch.inference_mode()
def generate(model, prompts: list[list[int]], constraint: Constraint | list[Constraint], engine: MaskEngine, *,
             max_new_tokens: int = 128, sampler=None, generator=None, jump_forward: str = "off",
             tokenizer=None) -> ConstrainedResult:
    """Constrained batched decoding. constraint: one for all rows or one per row.

    sampler: decodelab.core.sampling.Sampler (None = greedy); generator: torch.Generator (or a list, one per row:
    then each row's draws do not depend on the other rows). Rows leave the batch once they finish.
    tokenizer: needed to decode texts and for jump_forward="retokenize" (default: engine.tokenizer).
    Raises ConstraintError / UnsupportedConstraint before generation if a constraint does not compile.
    """
    from decodelab.core.engine import as_transformer, pick_tokens, prefill, synchronize

    if jump_forward not in JUMP_FORWARD:
        raise ValueError(f"jump_forward={jump_forward!r} must be one of {list(JUMP_FORWARD)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    constraints = constraint if isinstance(constraint, list) else [constraint] * len(prompts)
    if len(constraints) != len(prompts):
        raise ValueError(f"got {len(constraints)} constraints for {len(prompts)} prompts; give one or one per row")
    tokenizer = tokenizer or engine.tokenizer
    masker = BatchMasker(engine, compile_all(engine, constraints))
    tr = as_transformer(model)
    batch = len(prompts)

    synchronize(tr.device)
    start = time.perf_counter()
    # slack for jump-forward: a row may append up to max_new_tokens in one forward
    extra = max_new_tokens + 1 if jump_forward != "off" else 0
    cache, logits = prefill(tr, prompts, max_new_tokens=max_new_tokens, extra=extra)
    synchronize(tr.device)
    result = ConstrainedResult([[] for _ in prompts], [], [False] * batch, [], 0, 0,
                               prefill_s=time.perf_counter() - start)
    done = [False] * batch
    rows = list(range(batch))  # original row of each cache / logits row (finished rows are dropped)
    while True:
        alive = [r for r in rows if not done[r]]
        start = time.perf_counter()
        bitmask = masker.fill(alive)
        if len(rows) < batch:
            bitmask = bitmask[torch.tensor(rows)]
        masked = apply_bitmask(logits.float(), bitmask.to(logits.device))
        result.mask_s.append(time.perf_counter() - start)
        picked = dict(zip(rows, pick_tokens(masked, sampler, _rows_of(generator, rows, batch)).tolist()))
        pending: dict[int, list[int]] = {r: [] for r in rows}
        for r in alive:
            matcher = masker.matchers[r]
            if not matcher.accept(picked[r]):
                raise RuntimeError(f"engine {engine.name!r} rejected token {picked[r]} it allowed (row {r})")
            pending[r].append(picked[r])
            budget = max_new_tokens - len(result.tokens[r]) - 1
            if jump_forward == "tokens":
                pending[r] += forced_tokens(matcher, engine.vocab_size, budget)
            elif jump_forward == "retokenize" and not matcher.is_terminated():
                pending[r] = retokenize_forward(matcher, pending[r], tokenizer, budget)
            result.jumped_tokens += len(pending[r]) - 1
            result.tokens[r] += pending[r]
            if matcher.is_terminated():
                done[r], result.finished[r] = True, True
            elif len(result.tokens[r]) >= max_new_tokens:
                done[r] = True
        if all(done):
            break
        cache, rows = _drop_finished(cache, rows, done)
        width = max(len(pending[r]) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(pending[r])] = torch.tensor(pending[r], dtype=torch.long)
        n_new = torch.tensor([len(pending[r]) for r in rows], dtype=torch.long)
        start = time.perf_counter()
        logits = _forward_last(tr, cache, tokens.to(tr.device), n_new.to(tr.device))
        synchronize(tr.device)
        result.step_s.append(time.perf_counter() - start)
        result.forward_passes += 1
    stops = set(engine.stop_token_ids)
    result.texts = [tokenizer.decode([t for t in row if t not in stops]) if tokenizer is not None else ""
                    for row in result.tokens]
    result.valid = [f and validate_output(c, text) for f, c, text in zip(result.finished, constraints, result.texts)]
    return result


def _rows_of(generator, rows: list[int], batch: int):
    """The generators of the batch's current rows: a per-row list follows its rows; a shared one is shared."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch:
            raise ValueError(f"generator: got a list of {len(generator)} generators, need one per row ({batch})")
        return [generator[r] for r in rows]
    return generator


def _drop_finished(cache, rows: list[int], done: list[bool]):
    """Drop finished rows from the batch once they are a quarter of it (-> cache, rows).

    Finished rows would otherwise ride along in every forward until the slowest row ends (on CPU a forward
    costs about linearly in the rows once the batch is a few dozen). `select` copies the kept rows' cache,
    so it runs only when a quarter has finished: O(log B) copies per generation.
    """
    keep = [i for i, r in enumerate(rows) if not done[r]]
    if len(rows) - len(keep) < max(1, len(rows) // 4):
        return cache, rows
    return cache.select(keep), [rows[i] for i in keep]


def _forward_last(tr, cache, tokens: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """Append each row's n_new tokens (right-padded) -> logits after each row's last new token (B, V).

    Finished rows pass n_new = 0: nothing is appended for them and their logits are ignored.
    """
    if tokens.shape[1] == 1 and bool((n_new == 1).all()):
        return tr.forward(tokens, cache, logits_at="all")[:, 0]
    safe = torch.clamp(n_new, min=1)
    logits = tr.forward(tokens, cache, n_new=safe, logits_at="last")
    cache.crop(cache.lengths - (safe - n_new))
    return logits


@torch.inference_mode()
def sample_free(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, sampler, generator,
                eos_token_ids: list[int] | None = None) -> tuple[list[str], list[bool]]:
    """Unconstrained sampling that ends a row at EOS or once its reply holds a complete JSON object.

    -> (texts without special tokens, ended). A row ends early when the object opened at the reply's first
    '{' is closed: `extract_json` reads that object first, so later tokens could not change what is
    validated, and sampling them (models add prose after the JSON) would only cost forward passes.
    generator: one torch.Generator or one per row. Finished rows leave the batch (see `_drop_finished`).
    """
    from decodelab.core.engine import as_transformer, pick_tokens, prefill

    tr = as_transformer(model)
    eos = set(eos_token_ids or getattr(model, "eos_token_ids", None) or [tokenizer.eos_token_id])
    batch = len(prompts)
    cache, logits = prefill(tr, prompts, max_new_tokens=max_new_tokens)
    tokens: list[list[int]] = [[] for _ in prompts]
    ended, done = [False] * batch, [False] * batch
    rows = list(range(batch))
    while True:
        picked = pick_tokens(logits, sampler, _rows_of(generator, rows, batch)).tolist()
        for r, token in zip(rows, picked):
            if done[r]:
                continue
            tokens[r].append(token)
            if token in eos or _first_object_closed(tokenizer.decode(tokens[r], skip_special_tokens=True)):
                done[r] = ended[r] = True
            elif len(tokens[r]) >= max_new_tokens:
                done[r] = True
        if all(done):
            break
        cache, rows = _drop_finished(cache, rows, done)
        step = torch.tensor([tokens[r][-1] if not done[r] else 0 for r in rows], dtype=torch.long, device=tr.device)
        logits = tr.forward(step[:, None], cache, logits_at="all")[:, 0]
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens], ended


def _first_object_closed(text: str) -> bool:
    """Does the JSON value starting at the first '{' of text end within it?"""
    start = text.find("{")
    if start == -1 or "}" not in text[start:]:
        return False
    try:
        json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return False
    return True
