"""Reason freely, then constrain the answer (CRANE, ICML 2025; DCCD 2026) against free and fully constrained output.

Three ways to answer the suite's arithmetic word problems (`workloads.tasks`), on the same prompt (chain of
thought, then "The answer is N."), the same problems and greedy decoding, so every comparison is paired:

- "free": unconstrained until EOS; the answer is read with `workloads.tasks.extract_answer` (lenient);
  valid = the reply states it in the requested form "The answer is N".
- "constrained": the whole reply is masked to the answer schema's JSON from its first token (no room to
  reason: the strict format the "Let Me Speak Freely?" study finds costly).
- "crane": unconstrained reasoning until the reply writes the delimiter (default: the prompt's answer cue
  "The answer is"), samples EOS, or spends `reasoning_budget` tokens; from there the grammar takes over
  and the reply ends with the answer schema's JSON. At EOS the same logits are re-picked under the mask,
  so EOS never ends a reasoning row. Measured on SmolLM2-135M (greedy, level-2 problems, loaded machine):
  switching at the cue kept 7 of 8 of free output's correct answers in a 12-problem trial; switching only
  at EOS (JSON after "The answer is 3.") kept 0 of 3 in the smoke run, the model then writes an earlier
  number of the problem inside the JSON.

One `ReasonThenConstrainPolicy` on the engine's token loop runs all three (a row's mode decides when its
grammar starts: never, at once, or after the switch). Finished rows leave the batch.
"""
from __future__ import annotations

import json
import re
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
DELIMITER = "The answer is"  # text after which the grammar takes over (None: only at EOS or the budget)
ANSWER_TOKENS = 24  # budget for the JSON answer after the switch ({"answer": 1234} is ~8 tokens)
_STRICT = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


def answer_constraint(schema: dict | None, answers: list[int], *, name: str = "answer_schema") -> Constraint:
    """The answer schema as a Constraint, after checking it can hold every task answer as {ANSWER_KEY: n}.

    Raises ValueError naming the parameter, the schema and the first answer it rejects, before generation."""
    import jsonschema

    schema = ANSWER_SCHEMA if schema is None else schema
    constraint = Constraint.json(schema, name=name)  # malformed: ConstraintError (a ValueError) here
    for answer in answers:
        try:
            jsonschema.validate({ANSWER_KEY: answer}, constraint.spec)
        except jsonschema.ValidationError as error:
            raise ValueError(
                f"{name}={json.dumps(schema)[:120]} cannot hold the task answer {{{ANSWER_KEY!r}: {answer}}} "
                f"({error.message}); allowed: a JSON schema that validates {{{ANSWER_KEY!r}: n}} for every "
                "answer n of the problems") from None
    return constraint


class ReasonThenConstrainPolicy(PolicyBase):
    """Per row: free picks until its switch, then masked picks until the grammar terminates.

    modes[r] in MODES; a "free" row ends at EOS, the others when their grammar terminates."""

    compact = True

    def __init__(self, modes: list[str], matchers: list, engine, tokenizer, *, reasoning_budget: int,
                 delimiter: str | None = DELIMITER):
        self.modes, self.matchers, self.engine, self.tokenizer = modes, matchers, engine, tokenizer
        self.budget, self.delimiter = reasoning_budget, delimiter
        self.grammar = [m == "constrained" for m in modes]
        self.switch_at = [0 if m == "constrained" else None for m in modes]
        self.eos = set(engine.stop_token_ids)
        self.bitmask = allocate_bitmask(1, engine.vocab_size)

    def _masked(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """(V,) -> (1, V): the row's logits with what its grammar forbids at -inf."""
        self.matchers[row].fill(self.bitmask, 0)
        return apply_bitmask(logits[None].float(), self.bitmask.to(logits.device))

    def _switch(self, loop, r: int) -> None:
        self.grammar[r], self.switch_at[r] = True, len(loop.tokens[r])

    def first(self, loop, logits: torch.Tensor) -> dict[int, list[int]]:
        gens = loop.generators()
        emitted = {}
        for i, r in enumerate(loop.rows):
            if loop.done[r]:
                continue
            gen = gens[i:i + 1] if isinstance(gens, list) else gens
            if self.modes[r] == "crane" and not self.grammar[r] and len(loop.tokens[r]) >= self.budget:
                self._switch(loop, r)
            row_logits = self._masked(r, logits[i]) if self.grammar[r] else logits[i:i + 1]
            token = int(pick_tokens(row_logits, loop.sampler, gen)[0])
            if self.modes[r] == "crane" and not self.grammar[r] and token in self.eos:
                self._switch(loop, r)  # reasoning ended without the cue: the answer starts here
                token = int(pick_tokens(self._masked(r, logits[i]), loop.sampler, gen)[0])
            if self.grammar[r] and not self.matchers[r].accept(token):
                raise RuntimeError(f"engine {self.engine.name!r} rejected token {token} it allowed (row {r})")
            if self.modes[r] == "crane" and not self.grammar[r] and self.delimiter:
                text = self.tokenizer.decode(loop.tokens[r] + [token], skip_special_tokens=True)
                if self.delimiter in text:
                    self._switch(loop, r)
                    self.switch_at[r] += 1  # the cue's last token is reasoning; the answer follows it
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
    tokens: int        # new tokens, EOS included
    finished: bool     # free: ended at EOS; else the grammar terminated
    valid: bool
    answer: int | None


@torch.inference_mode()
def answer_problems(model, tokenizer, prompts: list[list[int]], mode: str, engine, constraint: Constraint, *,
                    reasoning_budget: int, delimiter: str | None = DELIMITER, sampler=None,
                    generator=None) -> list[Reply]:
    """Answer each prompt in `mode` (see the module doc); greedy without a sampler. -> one Reply per prompt.

    Every mode gets reasoning_budget + ANSWER_TOKENS new tokens at most."""
    from decodelab.core.engine import DecodeStats, run_loop
    from decodelab.workloads.tasks import extract_answer

    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {list(MODES)}")
    if reasoning_budget < 1:
        raise ValueError(f"reasoning_budget={reasoning_budget!r} must be >= 1")
    compiled = engine.compile(constraint)
    matchers = [engine.matcher(compiled) for _ in prompts]
    policy = ReasonThenConstrainPolicy([mode] * len(prompts), matchers, engine, tokenizer,
                                       reasoning_budget=reasoning_budget, delimiter=delimiter)
    stats = DecodeStats(batch_size=len(prompts), prompt_tokens=sum(map(len, prompts)))
    loop = run_loop(model, prompts, policy, max_new_tokens=reasoning_budget + ANSWER_TOKENS, stats=stats,
                    eos_token_ids=[], sampler=sampler, generator=generator)
    replies = []
    for r, tokens in enumerate(loop.tokens):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if mode == "free":
            strict = _STRICT.findall(text)
            replies.append(Reply(mode, text, text, len(tokens), loop.finished[r], bool(strict), extract_answer(text)))
            continue
        start = policy.switch_at[r] if policy.switch_at[r] is not None else len(tokens)
        answer_text = tokenizer.decode([t for t in tokens[start:] if t not in policy.eos], skip_special_tokens=True)
        valid = loop.finished[r] and validate_output(constraint, answer_text)
        answer = json.loads(answer_text).get(ANSWER_KEY) if valid else None
        replies.append(Reply(mode, text, answer_text, len(tokens), loop.finished[r], valid,
                             answer if isinstance(answer, int) and not isinstance(answer, bool) else None))
    return replies
