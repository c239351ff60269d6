"""Reason freely, then constrain the answer (CRANE, ICML 2025; DCCD 2026) against free and fully constrained output.

Three ways to answer the suite's arithmetic word problems (`workloads.tasks`), on the same prompt (chain of
thought, then "The answer is N."), the same problems and greedy decoding, so every comparison is paired:

- "free": unconstrained until EOS or `reasoning_budget` tokens; the answer is read with
  `workloads.tasks.extract_answer` (lenient); valid = the reply states it in the requested form "The answer is N".
- "constrained": the whole reply is masked to the answer schema's JSON from its first token (no room to
  reason: the strict format the "Let Me Speak Freely?" study finds costly).
- "crane": the free reply is the draft (the same picks, the same budget, so it is the "free" reply token for
  token); when it ends (EOS, the budget, or an optional delimiter) a handoff is forced and the grammar writes
  the answer schema's JSON conditioned on the whole draft (DCCD). Handoffs (HANDOFFS): "line" (default) puts
  the JSON on a new line after the draft; "turn" closes the assistant turn and asks for the answer as JSON in a
  new user turn; "none" glues it to the draft.

Measured on SmolLM2-135M (greedy, the cpu profile's 40 level-2 problems; accuracy does not depend on load):
with compact JSON switched on at the cue "The answer is" (a continuation the model never writes: '...is{"answer":')
the JSON kept 22 of free output's 24 right answers; in both misses the draft had the right number. Compact
JSON after the whole draft: "line" 19, "turn" 6, "none" 12 of 40. Any-whitespace JSON: 12 (at the cue) and 0
("line"): the masked model spends its tokens on newlines. The model writes a number after a space token
("is 5" is "is", " ", "5") which compact JSON forbids after the colon; with one optional space there
(`answer_constraint` spacing "space") and the "line" handoff the JSON read the draft's own answer in 40 of 40
problems (24 of 40 right, as free); at the cue the same spacing kept 23 of 24.

One `ReasonThenConstrainPolicy` on the engine's token loop runs all three (a row's mode decides when its
grammar starts: never, at once, or after the draft and its handoff). Finished rows leave the batch.
"""
from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass

import torch

from decodelab.constrained.bitmask import allocate_bitmask, apply_bitmask
from decodelab.constrained.constraint import Constraint
from decodelab.constrained.decode import validate_output
from decodelab.core.engine import Feed, PolicyBase, pick_tokens

MODES = ("free", "constrained", "crane")
# bounded, so the grammar ends within ANSWER_TOKENS ({"answer":-999999} is 12 tokens with one-digit tokens)
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
                 "properties": {"answer": {"type": "integer", "minimum": -999_999, "maximum": 999_999}}}
ANSWER_KEY = "answer"  # the field the task's answer is read from
DELIMITER = None  # text after which the draft ends early (None: at EOS or the budget)
HANDOFFS = ("turn", "line", "none")
HANDOFF = "line"
FOLLOW_UP = 'Write only the final answer as JSON: {"answer": N}.'  # the "turn" handoff's user message
SPACINGS = ("space", "compact", "flexible")  # see answer_constraint
SPACING = "space"
ANSWER_TOKENS = 24  # budget for the JSON answer after the switch ({"answer": 1234} is ~8 tokens)
_STRICT = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)
_MARK = "\x00draft\x00"  # stands for the draft while the chat template renders the handoff


def answer_constraint(schema: dict | None, answers: list[int], *, name: str = "answer_schema",
                      spacing: str = SPACING) -> Constraint:
    """The answer's generation constraint, after checking the schema can hold every task answer as {ANSWER_KEY: n}.

    spacing "compact": the schema's compact JSON grammar; "flexible": any JSON whitespace; "space": one
    optional space after the colon, the tokenization the model writes numbers in ("is 5": "is", " ", "5"),
    which compact JSON forbids ('":5'); it is a regex of the same language (`integer_field_pattern`) where the
    schema is one integer field with bounds 0 or +-(10^k - 1), else compact JSON.
    Raises ValueError naming the parameter, the schema and the first answer it rejects, before generation."""
    import jsonschema

    if spacing not in SPACINGS:
        raise ValueError(f"spacing={spacing!r} must be one of {list(SPACINGS)}")
    schema = ANSWER_SCHEMA if schema is None else schema
    # malformed: ConstraintError (a ValueError) here
    constraint = Constraint.json(schema, name=name, whitespace="flexible" if spacing == "flexible" else "compact")
    for answer in answers:
        try:
            jsonschema.validate({ANSWER_KEY: answer}, constraint.spec)
        except jsonschema.ValidationError as error:
            raise ValueError(
                f"{name}={json.dumps(schema)[:120]} cannot hold the task answer {{{ANSWER_KEY!r}: {answer}}} "
                f"({error.message}); allowed: a JSON schema that validates {{{ANSWER_KEY!r}: n}} for every "
                "answer n of the problems") from None
    pattern = integer_field_pattern(schema) if spacing == "space" else None
    return Constraint.regex(pattern, name=name) if pattern else constraint


def integer_field_pattern(schema: dict) -> str | None:
    """A regex for exactly the compact JSON of `schema`, plus one optional space after the colon, when the schema
    is {ANSWER_KEY: integer} alone (required, no other properties) with minimum 0 or -(10^k - 1) and maximum
    10^m - 1; else None. Integers as JSON writes them: no leading zeros, no "-0"."""
    field = schema.get("properties", {}).get(ANSWER_KEY, {})
    if (schema.get("type") != "object" or schema.get("required") != [ANSWER_KEY]
            or schema.get("additionalProperties") is not False or set(schema.get("properties", {})) != {ANSWER_KEY}
            or set(field) != {"type", "minimum", "maximum"} or field["type"] != "integer"):
        return None
    low, high = field["minimum"], field["maximum"]
    if not (isinstance(low, int) and isinstance(high, int)) or high < 9 or str(high) != "9" * len(str(high)):
        return None
    if low != 0 and str(-low) != "9" * len(str(-low)):
        return None
    positive = f"(0|[1-9][0-9]{{0,{len(str(high)) - 1}}})"
    negative = f"|-[1-9][0-9]{{0,{len(str(-low)) - 1}}}" if low < 0 else ""
    return rf'\{{"{ANSWER_KEY}": ?({positive}{negative})\}}'


def handoff_ids(tokenizer, handoff: str = HANDOFF) -> list[int]:
    """The tokens forced between a draft cut short (no EOS) and the answer's JSON.

    "turn": the chat template's end of the assistant turn, a user turn asking FOLLOW_UP, the next assistant
    header (rendered by the tokenizer's own template around a placeholder draft); "line": a newline; "none": []."""
    if handoff not in HANDOFFS:
        raise ValueError(f"handoff={handoff!r} must be one of {list(HANDOFFS)}")
    if handoff == "none":
        return []
    if handoff == "line":
        return list(tokenizer("\n", add_special_tokens=False).input_ids)
    from decodelab.workloads.prompts import chat_text

    text = chat_text(tokenizer, [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK},
                                 {"role": "user", "content": FOLLOW_UP}])
    return list(tokenizer(text[text.index(_MARK) + len(_MARK):], add_special_tokens=False).input_ids)


class ReasonThenConstrainPolicy(PolicyBase):
    """Per row: free picks until its draft ends, the forced handoff, then masked picks until the grammar ends.

    modes[r] in MODES; a "free" row ends at EOS, the others when their grammar terminates. A crane draft ends
    at EOS (kept when the handoff starts with it, as a chat turn's end; otherwise replaced by the handoff),
    at `reasoning_budget` tokens, or after the token that completes `delimiter`. switch_at[r]: where the
    grammar's tokens start; draft_end[r]: the draft's length (its EOS excluded)."""

    compact = True

    def __init__(self, modes: list[str], matchers: list, engine, tokenizer, *, reasoning_budget: int,
                 delimiter: str | None = DELIMITER, handoff: list[int] | None = None):
        self.modes, self.matchers, self.engine, self.tokenizer = modes, matchers, engine, tokenizer
        self.budget, self.delimiter, self.handoff = reasoning_budget, delimiter, list(handoff or [])
        self.grammar = [m == "constrained" for m in modes]
        self.switch_at = [0 if m == "constrained" else None for m in modes]
        self.draft_end = [0 if m == "constrained" else None for m in modes]
        self.draft_eos = [False] * len(modes)  # the draft ended at the model's own EOS
        self.queue = [deque() for _ in modes]
        self.eos = set(engine.stop_token_ids)
        self.bitmask = allocate_bitmask(1, engine.vocab_size)

    def _masked(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """(V,) -> (1, V): the row's logits with what its grammar forbids at -inf."""
        self.matchers[row].fill(self.bitmask, 0)
        return apply_bitmask(logits[None].float(), self.bitmask.to(logits.device))

    def _end_draft(self, loop, r: int, eos: int | None = None) -> list[int]:
        """Start row r's handoff at its current length -> the tokens it emits now (the rest is queued)."""
        self.draft_end[r], self.draft_eos[r] = len(loop.tokens[r]), eos is not None
        handoff = list(self.handoff)
        if eos is not None and handoff[:1] == [eos]:
            handoff = handoff[1:]
            now = [eos]
        else:
            now = handoff[:1]
            handoff = handoff[1:]
        self.queue[r].extend(handoff)
        if not self.queue[r] and now:
            self._start_grammar(r, len(loop.tokens[r]) + 1)
        return now

    def _start_grammar(self, r: int, at: int) -> None:
        self.grammar[r], self.switch_at[r] = True, at

    def _draft_pick(self, loop, r: int, logits: torch.Tensor, gen) -> list[int]:
        """One crane row's step before its grammar: a queued handoff token, a free pick, or the draft's end."""
        if self.queue[r]:
            token = self.queue[r].popleft()
            if not self.queue[r]:
                self._start_grammar(r, len(loop.tokens[r]) + 1)
            return [token]
        if self.draft_end[r] is None and len(loop.tokens[r]) >= self.budget:
            now = self._end_draft(loop, r)
            if now:
                return now
        elif self.draft_end[r] is None:
            token = int(pick_tokens(logits, loop.sampler, gen)[0])
            if token in self.eos:
                now = self._end_draft(loop, r, eos=token)
                if now:
                    return now
            else:
                if self.delimiter:
                    text = self.tokenizer.decode(loop.tokens[r] + [token], skip_special_tokens=True)
                    if self.delimiter in text:
                        self.draft_end[r] = len(loop.tokens[r]) + 1  # the cue's last token is the draft's
                        self.queue[r].extend(self.handoff)
                        if not self.queue[r]:
                            self._start_grammar(r, len(loop.tokens[r]) + 1)
                return [token]
        self._start_grammar(r, len(loop.tokens[r]))  # an empty handoff: the grammar picks from these logits
        return []

    def first(self, loop, logits: torch.Tensor) -> dict[int, list[int]]:
        gens = loop.generators()
        emitted = {}
        for i, r in enumerate(loop.rows):
            if loop.done[r]:
                continue
            gen = gens[i:i + 1] if isinstance(gens, list) else gens
            if self.modes[r] == "crane" and not self.grammar[r]:
                tokens = self._draft_pick(loop, r, logits[i:i + 1], gen)
                if tokens or not self.grammar[r]:
                    emitted[r] = tokens
                    continue
            row_logits = self._masked(r, logits[i]) if self.grammar[r] else logits[i:i + 1]
            token = int(pick_tokens(row_logits, loop.sampler, gen)[0])
            if self.grammar[r] and not self.matchers[r].accept(token):
                raise RuntimeError(f"engine {self.engine.name!r} rejected token {token} it allowed (row {r})")
            emitted[r] = [token]
        return emitted

    def feed(self, loop) -> Feed:
        step = [loop.tokens[r][-1] if not loop.done[r] else 0 for r in loop.rows]
        return Feed(torch.tensor(step, dtype=torch.long, device=loop.device)[:, None], mode="step")

    def stopped(self, loop, row: int) -> bool:
        if self.modes[row] == "free":
            return loop.tokens[row][-1] in self.eos
        return self.grammar[row] and self.matchers[row].is_terminated()


@dataclass
class Reply:
    mode: str
    text: str          # the whole reply (special tokens dropped)
    answer_text: str   # free: the whole reply; else the part the grammar wrote
    tokens: int        # new tokens, EOS and handoff included
    finished: bool     # free: ended at EOS; else the grammar terminated
    valid: bool
    answer: int | None
    draft: list[int] | None = None  # crane: the draft's tokens (its EOS excluded); free: the reply's
    draft_finished: bool = False    # the draft ended at the model's own EOS (not the budget or a delimiter)


def free_reply(tokenizer, draft: list[int], finished: bool, mode: str = "free") -> Reply:
    """A free reply (or a crane draft read as one): the lenient answer, valid if it says "The answer is N"."""
    from decodelab.workloads.tasks import extract_answer

    text = tokenizer.decode(draft, skip_special_tokens=True)
    return Reply(mode, text, text, len(draft) + finished, finished, bool(_STRICT.findall(text)),
                 extract_answer(text), draft=list(draft), draft_finished=finished)


@torch.inference_mode()
def answer_problems(model, tokenizer, prompts: list[list[int]], mode: str, engine, constraint: Constraint, *,
                    reasoning_budget: int, delimiter: str | None = DELIMITER, handoff: str = HANDOFF,
                    sampler=None, generator=None) -> list[Reply]:
    """Answer each prompt in `mode` (see the module doc); greedy without a sampler. -> one Reply per prompt.

    A free reply and a crane draft get reasoning_budget tokens; crane adds the handoff and ANSWER_TOKENS,
    constrained gets ANSWER_TOKENS."""
    from decodelab.core.engine import DecodeStats, run_loop

    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {list(MODES)}")
    if reasoning_budget < 1:
        raise ValueError(f"reasoning_budget={reasoning_budget!r} must be >= 1")
    forced = handoff_ids(tokenizer, handoff)
    compiled = engine.compile(constraint)
    matchers = [engine.matcher(compiled) for _ in prompts]
    policy = ReasonThenConstrainPolicy([mode] * len(prompts), matchers, engine, tokenizer,
                                       reasoning_budget=reasoning_budget, delimiter=delimiter, handoff=forced)
    budget = {"free": reasoning_budget, "constrained": ANSWER_TOKENS,
              "crane": reasoning_budget + len(forced) + ANSWER_TOKENS}[mode]
    stats = DecodeStats(batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)))
    loop = run_loop(model, prompts, policy, max_new_tokens=budget, stats=stats, eos_token_ids=[], sampler=sampler,
                    generator=generator)
    replies = []
    for r, tokens in enumerate(loop.tokens):
        if mode == "free":
            ended = loop.finished[r] and tokens[-1] in policy.eos
            replies.append(free_reply(tokenizer, tokens[:len(tokens) - ended], ended))
            continue
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        start = policy.switch_at[r] if policy.switch_at[r] is not None else len(tokens)
        end = policy.draft_end[r] if policy.draft_end[r] is not None else len(tokens)
        answer_text = tokenizer.decode([t for t in tokens[start:] if t not in policy.eos], skip_special_tokens=True)
        valid = loop.finished[r] and validate_output(constraint, answer_text)
        answer = json.loads(answer_text).get(ANSWER_KEY) if valid else None
        replies.append(Reply(mode, text, answer_text, len(tokens), loop.finished[r], valid,
                             answer if isinstance(answer, int) and not isinstance(answer, bool) else None,
                             draft=tokens[:end], draft_finished=policy.draft_eos[r]))
    return replies
