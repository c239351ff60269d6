"""Constrained decoding on the decode engine: per-step masks, batched rows, jump-forward, validation.

Both decoders here are policies of the engine's one token loop (`core.engine.run_loop`): `GrammarPolicy`
(constrained `generate`) and `FreeJSONPolicy` (`sample_free`, free sampling until the reply's JSON closes).

The loop (per step, B rows):  logits (B, V) -> fill each row's mask (engine) -> disallowed at -inf ->
sampler picks (B,) -> matchers accept -> [jump-forward appends forced tokens] -> one forward of every
row's pending tokens (ragged, `n_new` per row) -> logits of each row's last token.

Jump-forward modes:
- "off": one token per forward pass.
- "tokens": while the mask allows exactly one token, append it without asking the model. Greedy output
  is token-for-token the same as "off" (a one-token mask leaves argmax no choice); those tokens then ride
  in the next forward together, so the forward passes for them are saved.
- "draft": the tokens of the forced string ride as a draft in the next forward, which also verifies them:
  the longest prefix equal to the masked argmax at each position is kept, then that argmax (greedy only;
  output token-for-token the same as "off", see `jump_forward.forced_draft`).
- "retokenize": SGLang-style. Append the whole string the grammar forces (`forced_string`), re-tokenizing
  the last sampled token + that string canonically, since the boundary token may merge with it. Saves more
  passes but picks the tokenization itself, so outputs can differ from "off" (the notebook measures how often).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from decodelab.constrained.jump_forward import forced_draft, forced_tokens, retokenize_forward
from decodelab.constrained.masks import (
    BatchMasker,
    Constraint,
    ConstraintError,
    MaskEngine,
    UnsupportedConstraint,
    apply_bitmask,
    make_engine,
)
from decodelab.core.engine import Feed, PolicyBase

JUMP_FORWARD = ("off", "tokens", "draft", "retokenize")


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


class GrammarPolicy(PolicyBase):
    """Constrained decoding as a `LoopPolicy` of the engine's token loop.

    The logits hook fills each alive row's mask and sets disallowed tokens to -inf before the sampler picks;
    the matcher accepts the pick; jump-forward queues the tokens the grammar forces (`loop.force`: no model
    call, no sampler draw; they ride in the next forward). A row ends when its grammar terminates.
    Finished rows leave the batch (`TokenLoop.compact`).
    """

    compact = True

    def __init__(self, masker: BatchMasker, engine: MaskEngine, jump_forward: str, tokenizer, result, extra: int):
        self.masker, self.engine, self.jump_forward, self.tokenizer = masker, engine, jump_forward, tokenizer
        self.result, self.extra = result, extra
        self.drafts: dict[int, list[int]] = {}  # "draft" mode: each row's draft riding in the next forward

    def _masked(self, loop, logits: torch.Tensor) -> torch.Tensor:
        """(B', V) logits of the current batch rows -> the same with what each alive row's grammar forbids at
        -inf (one mask fill per alive row, timed)."""
        start = time.perf_counter()
        bitmask = self.masker.fill(loop.alive)
        if len(loop.rows) < loop.batch:
            bitmask = bitmask[torch.tensor(loop.rows)]
        masked = apply_bitmask(logits.float(), bitmask.to(logits.device))
        self.result.mask_s.append(time.perf_counter() - start)
        return masked

    def first(self, loop, logits: torch.Tensor, kept: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
        alive = loop.alive
        picked = dict(zip(loop.rows, loop.pick(self._masked(loop, logits)).tolist()))
        emitted = {}
        for r in alive:
            matcher = self.masker.matchers[r]
            if not matcher.accept(picked[r]):
                raise RuntimeError(f"engine {self.engine.name!r} rejected token {picked[r]} it allowed (row {r})")
            emitted[r] = [*(kept or {}).get(r, []), picked[r]]
            budget = loop.max_new_tokens - len(loop.tokens[r]) - len(emitted[r])
            if self.jump_forward == "draft":
                self.drafts[r] = [] if matcher.is_terminated() else forced_draft(matcher, self.tokenizer, budget)
            elif self.jump_forward == "tokens":
                loop.force(r, forced_tokens(matcher, self.engine.vocab_size, budget))
            elif self.jump_forward == "retokenize" and not matcher.is_terminated():
                emitted[r] = retokenize_forward(matcher, emitted[r], self.tokenizer, budget)
            self.result.jumped_tokens += len(emitted[r]) + len(loop.forced[r]) - 1
        return emitted

    def feed(self, loop) -> Feed:
        if self.jump_forward == "draft":  # every row feeds its pending token + draft, padded: logits everywhere
            for r in loop.rows:  # the kept draft tokens are in the cache already: only the last pick is new
                loop.pending[r] = loop.pending[r][-1:] + self.drafts.pop(r, []) if not loop.done[r] else []
            return Feed(loop.pending_batch()[0], mode="all")
        tokens, n_new = loop.pending_batch()
        return Feed(tokens, mode="last", n_new=n_new)

    def accept(self, loop, logits: torch.Tensor, hidden) -> dict[int, list[int]]:
        self.result.forward_passes += 1
        if self.jump_forward != "draft":
            return self.first(loop, logits)
        return self._verify(loop, logits)

    def _verify(self, loop, logits: torch.Tensor) -> dict[int, list[int]]:
        """logits (B', T, V) after each row's pending token and draft -> keep the draft up to the first token
        that differs from the masked argmax there, then pick at that position (`first`), and roll the cache
        back past the rest. Position j's logits follow the pending token and draft[:j]."""
        kept = {}
        at = torch.zeros(len(loop.rows), dtype=torch.long)    # draft tokens kept per batch row
        keep = torch.zeros(len(loop.rows), dtype=torch.long)  # cache positions kept of this forward's T
        for i, r in enumerate(loop.rows):
            if loop.done[r]:
                continue
            draft, matcher = loop.pending[r][1:], self.masker.matchers[r]
            n = 0
            while n < len(draft):
                row_mask = self.masker.fill([r])[r:r + 1]
                best = int(apply_bitmask(logits[i, n][None].float(), row_mask.to(logits.device)).argmax())
                if best != draft[n] or not matcher.accept(best):
                    break
                n += 1
            kept[r], at[i], keep[i] = draft[:n], n, 1 + n  # the pending token + the kept draft
        lengths = loop.cache.lengths - logits.shape[1] + keep.to(loop.cache.lengths.device)
        loop.cache.truncate(lengths)
        index = at.to(logits.device).clamp(max=logits.shape[1] - 1)
        step_logits = logits[torch.arange(len(loop.rows), device=logits.device), index]
        return self.first(loop, step_logits, kept)  # counts the kept draft tokens as jumped

    def stopped(self, loop, row: int) -> bool:
        return self.masker.matchers[row].is_terminated()


@torch.inference_mode()
def generate(model, prompts: list[list[int]], constraint: Constraint | list[Constraint], engine: MaskEngine, *,
             max_new_tokens: int = 128, sampler=None, generator=None, jump_forward: str = "off",
             tokenizer=None) -> ConstrainedResult:
    """Constrained batched decoding. constraint: one for all rows or one per row.

    sampler: decodelab.core.sampling.Sampler (None = greedy); generator: torch.Generator (or a list, one per row:
    then each row's draws do not depend on the other rows). Rows leave the batch once they finish.
    tokenizer: needed to decode texts and for jump_forward="retokenize" (default: engine.tokenizer).
    Raises ConstraintError / UnsupportedConstraint before generation if a constraint does not compile.
    The loop is the engine's (`core.engine.run_loop`) with a `GrammarPolicy`.
    """
    from decodelab.core.engine import DecodeStats, run_loop, validate_generation_args

    if jump_forward not in JUMP_FORWARD:
        raise ValueError(f"jump_forward={jump_forward!r} must be one of {list(JUMP_FORWARD)}")
    if jump_forward == "draft" and sampler is not None:
        raise ValueError("jump_forward='draft' verifies drafts against the argmax, so it is exact for greedy "
                         "decoding only: pass sampler=None, or use jump_forward='tokens'")
    validate_generation_args(prompts, max_new_tokens)
    constraints = constraint if isinstance(constraint, list) else [constraint] * len(prompts)
    if len(constraints) != len(prompts):
        raise ValueError(f"got {len(constraints)} constraints for {len(prompts)} prompts; give one or one per row")
    tokenizer = tokenizer or engine.tokenizer
    masker = BatchMasker(engine, compile_all(engine, constraints))
    batch = len(prompts)
    result = ConstrainedResult([[] for _ in prompts], [], [False] * batch, [], 0, 0)
    # slack for jump-forward: a row may append up to max_new_tokens in one forward
    extra = max_new_tokens + 1 if jump_forward != "off" else 0
    policy = GrammarPolicy(masker, engine, jump_forward, tokenizer, result, extra)
    stats = DecodeStats(batch_size=batch, prompt_tokens=sum(map(len, prompts)))
    loop = run_loop(model, prompts, policy, max_new_tokens=max_new_tokens, stats=stats, eos_token_ids=[],
                    sampler=sampler, generator=generator)
    result.tokens, result.finished = loop.tokens, loop.finished
    result.prefill_s, result.step_s = stats.prefill_s, loop.forward_s
    stops = set(engine.stop_token_ids)
    result.texts = [tokenizer.decode([t for t in row if t not in stops]) if tokenizer is not None else ""
                    for row in result.tokens]
    result.valid = [f and validate_output(c, text) for f, c, text in zip(result.finished, constraints, result.texts)]
    return result


class FreeJSONPolicy(PolicyBase):
    """Unconstrained sampling as a `LoopPolicy` that ends a row once its reply holds a complete JSON object.
    Finished rows leave the batch; the ones still riding feed token 0 (their logits are ignored)."""

    compact = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def first(self, loop, logits: torch.Tensor) -> dict[int, list[int]]:
        return {r: [t] for r, t in zip(loop.rows, loop.pick(logits).tolist())}

    def feed(self, loop) -> Feed:
        step = [loop.tokens[r][-1] if not loop.done[r] else 0 for r in loop.rows]
        return Feed(torch.tensor(step, dtype=torch.long, device=loop.device)[:, None], mode="step")

    def stopped(self, loop, row: int) -> bool:
        return _first_object_closed(self.tokenizer.decode(loop.tokens[row], skip_special_tokens=True))


@torch.inference_mode()
def sample_free(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, sampler, generator,
                eos_token_ids: list[int] | None = None) -> tuple[list[str], list[bool]]:
    """Unconstrained sampling that ends a row at EOS or once its reply holds a complete JSON object.

    -> (texts without special tokens, ended). A row ends early when the object opened at the reply's first
    '{' is closed: `extract_json` reads that object first, so later tokens could not change what is
    validated, and sampling them (models add prose after the JSON) would only cost forward passes.
    generator: one torch.Generator or one per row. Finished rows leave the batch (`TokenLoop.compact`).
    """
    from decodelab.core.engine import DecodeStats, run_loop

    eos = list(eos_token_ids or getattr(model, "eos_token_ids", None) or [tokenizer.eos_token_id])
    stats = DecodeStats(batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)))
    loop = run_loop(model, prompts, FreeJSONPolicy(tokenizer), max_new_tokens=max_new_tokens, stats=stats,
                    eos_token_ids=eos, sampler=sampler, generator=generator)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in loop.tokens], loop.finished


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
