"""Tasks with checkable answers and open-ended prompts: arithmetic word problems, writing prompts.

Arithmetic word problems are generated, not downloaded: a seed and a difficulty level fix every
problem, so two notebooks that ask for `make_arithmetic(50, seed=0, difficulty=2)` see the same
problems. A problem is a chain of `steps` integer operations on one running quantity
("Tom has 7 apples. He buys 5 more. He gives 3 away. How many apples does Tom have now?"),
with every intermediate count kept >= 2 so the story stays sensible.

The model is asked to reason step by step and to end with "The answer is N." (`ANSWER_FORMAT`);
`extract_answer` reads N back, falling back to looser forms and finally to the last number.

The grid runner that samples these tasks under many sampler settings lives in `sampling_study`.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from decodelab.workloads.paths import data_file
from decodelab.workloads.prompts import chat_prompt_ids

ANSWER_FORMAT = "The answer is N."
OPERATIONS = ("add", "sub", "mul")


@dataclass(frozen=True)
class Difficulty:
    """How hard a problem is: how many operations, which ones, and how large the operands."""

    steps: int  # operations applied to the starting quantity (1 = one-step problem)
    max_operand: int  # operands drawn from 2..max_operand (multipliers from 2..min(max_operand, 5))
    operations: tuple[str, ...] = ("add", "sub")

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps!r} must be >= 1")
        if self.max_operand < 2:
            raise ValueError(f"max_operand={self.max_operand!r} must be >= 2")
        unknown = set(self.operations) - set(OPERATIONS)
        if not self.operations or unknown:
            raise ValueError(f"operations={self.operations!r} must be a non-empty subset of {OPERATIONS}")


# Numbered levels, easiest first. Level 1 is docs/RESEARCH.md's "Tom has a apples, buys b more" with
# single-digit operands; each level adds an operation kind, larger operands, or a step.
# SmolLM2-135M-Instruct greedy, one-shot prompt, 40 tokens, our engine, problems 0-59 of seed 0
# (2 shared cores, noisy only in time): level 2 55%, level 3 32%; level 1 ~70-78% and two-step levels
# ~9% (32 problems, transformers generate). Multi-step levels are for larger models.
DIFFICULTIES: dict[int, Difficulty] = {
    1: Difficulty(steps=1, max_operand=9, operations=("add",)),
    2: Difficulty(steps=1, max_operand=20, operations=("add", "sub")),
    3: Difficulty(steps=1, max_operand=50, operations=("add", "sub")),
    4: Difficulty(steps=2, max_operand=9, operations=("add", "sub")),
    5: Difficulty(steps=2, max_operand=20, operations=("add", "sub")),
    6: Difficulty(steps=2, max_operand=12, operations=("add", "sub", "mul")),
    7: Difficulty(steps=3, max_operand=20, operations=("add", "sub", "mul")),
}


@dataclass(frozen=True)
class ArithmeticProblem:
    id: str
    question: str
    answer: int
    difficulty: int | str  # level number, or "custom" for an ad-hoc Difficulty
    steps: int

    def to_dict(self) -> dict:
        return asdict(self)


_NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lena", "Omar", "Julia", "Ravi", "Emma", "Leo", "Nina")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "coins", "shells", "cards")
_ADD = ("{name} buys {k} more {item}.", "A friend gives {name} {k} more {item}.", "{name} finds {k} more {item}.")
_SUB = ("{name} gives {k} {item} to a friend.", "{name} loses {k} {item}.", "{name} uses {k} {item}.")
_MUL = ("Now {name} has {k} times as many {item} as before.",)


def resolve_difficulty(difficulty: int | Difficulty) -> Difficulty:
    if isinstance(difficulty, Difficulty):
        return difficulty
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r} must be one of {sorted(DIFFICULTIES)} or a Difficulty")
    return DIFFICULTIES[difficulty]


def make_problem(rng: random.Random, difficulty: int | Difficulty, index: int = 0) -> ArithmeticProblem:
    """One problem drawn from `rng` (a `random.Random`; the only randomness used)."""
    level = resolve_difficulty(difficulty)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(2, level.max_operand)
    sentences = [f"{name} has {value} {item}."]
    for _ in range(level.steps):
        op = rng.choice(level.operations)
        if op == "sub" and value < 4:  # keep every count >= 2 (and every "k items" plural)
            op = "add"
        if op == "add":
            k = rng.randint(2, level.max_operand)
            value += k
            template = rng.choice(_ADD)
        elif op == "sub":
            k = rng.randint(2, min(level.max_operand, value - 2))
            value -= k
            template = rng.choice(_SUB)
        else:
            k = rng.randint(2, min(level.max_operand, 5))
            value *= k
            template = rng.choice(_MUL)
        sentences.append(template.format(name=name, item=item, k=k))
    sentences.append(f"How many {item} does {name} have now?")
    label = difficulty if isinstance(difficulty, int) else "custom"
    return ArithmeticProblem(
        id=f"arith-{label}-{index}", question=" ".join(sentences), answer=value, difficulty=label, steps=level.steps
    )


def make_arithmetic(n: int, seed: int = 0, difficulty: int | Difficulty = 3) -> list[ArithmeticProblem]:
    """`n` word problems, deterministic in (`n`, `seed`, `difficulty`); problem i is the same for any n > i."""
    if n < 0:
        raise ValueError(f"n={n!r} must be >= 0")
    rng = random.Random(f"arithmetic-{seed}")
    return [make_problem(rng, difficulty, index=i) for i in range(n)]


def save_arithmetic(problems: list[ArithmeticProblem], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in problems))
    return path


def load_arithmetic(path: str | Path, n: int | None = None, difficulty: int | None = None) -> list[ArithmeticProblem]:
    """Problems from a JSONL file (one `ArithmeticProblem.to_dict()` per line), optionally the first `n`
    of one `difficulty` level."""
    problems = [ArithmeticProblem(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
    if difficulty is not None:
        problems = [p for p in problems if p.difficulty == difficulty]
    return problems[:n] if n is not None else problems


# --- prompts ---------------------------------------------------------------------------------------

COT_INSTRUCTION = (
    "Solve the problem step by step. Then write the final answer on its own line as "
    f'"{ANSWER_FORMAT}" where N is a whole number.'
)
# One worked example keeps a 135M model on the answer format. It is a one-step problem: with a two-step
# example SmolLM2-135M-Instruct's greedy accuracy on one-step problems fell (level 2: 41% -> 25%, 32
# problems) and two-step problems stayed near 9%, so multi-step levels are for larger models.
COT_EXAMPLE = (
    "Problem: Sara has 4 pens. Sara buys 3 more pens. How many pens does Sara have now?",
    "Sara has 4 pens. She buys 3 more, so 4 + 3 = 7.\nThe answer is 7.",
)


def arithmetic_messages(problem: ArithmeticProblem | str, *, shots: int = 1) -> list[dict]:
    """Chat messages asking for chain-of-thought and a final "The answer is N." line."""
    question = problem.question if isinstance(problem, ArithmeticProblem) else problem
    if shots not in (0, 1):
        raise ValueError(f"shots={shots!r} must be 0 or 1")
    messages = []
    if shots:
        messages += [
            {"role": "user", "content": f"{COT_INSTRUCTION}\n\n{COT_EXAMPLE[0]}"},
            {"role": "assistant", "content": COT_EXAMPLE[1]},
        ]
    messages.append({"role": "user", "content": f"{COT_INSTRUCTION}\n\nProblem: {question}"})
    return messages


def arithmetic_prompt(problem: ArithmeticProblem | str, tokenizer, *, shots: int = 1) -> list[int]:
    """Token ids of the chain-of-thought chat prompt for one problem."""
    return chat_prompt_ids(tokenizer, arithmetic_messages(problem, shots=shots))


# --- answer extraction -----------------------------------------------------------------------------

# an integer with optional thousands separators ("1,234", not "3,4"), optionally with decimals
_NUMBER = r"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"
# Tried in order; within a pattern the LAST match wins (models restate, then conclude).
_ANSWER_PATTERNS = (
    re.compile(r"answer\s+is\s*[:=]?\s*\**\s*\$?\s*" + _NUMBER, re.IGNORECASE),
    re.compile(r"answer\s*[:=]\s*\**\s*\$?\s*" + _NUMBER, re.IGNORECASE),
    re.compile(r"\\boxed\{\s*" + _NUMBER + r"\s*\}"),
    re.compile(r"####\s*" + _NUMBER),
)
_ANY_NUMBER = re.compile(r"(?<![\w.])" + _NUMBER)


def _to_int(token: str) -> int | None:
    token = token.replace(",", "")
    try:
        value = float(token)
    except ValueError:
        return None
    return int(value) if value == int(value) else None


def extract_answer(text: str) -> int | None:
    """The integer a model's output commits to, or None.

    Order: "The answer is N" (also "answer is: N", "**N**", "$N"), then "answer: N" / "answer = N",
    then "\\boxed{N}", then "#### N"; within each form the last occurrence counts. If none of these
    appears, fall back to the LAST number in the text (a model that stops mid-format usually ends
    on its result). Thousands separators are dropped ("1,234" -> 1234); "12.0" -> 12; a non-integer
    like "12.5" is not an integer answer -> None for that form. No number at all -> None.
    """
    if not text:
        return None
    for pattern in _ANSWER_PATTERNS:
        matches = pattern.findall(text)
        if matches:
            return _to_int(matches[-1])
    numbers = _ANY_NUMBER.findall(text)
    return _to_int(numbers[-1]) if numbers else None


# --- writing prompts -------------------------------------------------------------------------------


def load_writing_prompts(path: str | Path | None = None, n: int | None = None) -> list[str]:
    """Open-ended writing prompts from a JSONL file of {"id", "prompt"} objects (first `n`; default file:
    the shipped data/writing_prompts.jsonl)."""
    path = data_file("writing_prompts.jsonl") if path is None else Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows]
    return prompts[:n] if n is not None else prompts


def writing_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def writing_prompt(prompt: str, tokenizer) -> list[int]:
    """Token ids of the chat prompt for one open-ended writing prompt."""
    return chat_prompt_ids(tokenizer, writing_messages(prompt))
