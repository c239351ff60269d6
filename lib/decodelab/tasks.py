"""Tasks with checkable answers and open-ended prompts: arithmetic word problems, writing prompts.

Arithmetic word problems are generated, not downloaded: a seed and a difficulty level fix every
problem, so two notebooks that ask for `make_arithmetic(50, seed=0, difficulty=2)` see the same
problems. A problem is a chain of `steps` integer operations on one running quantity
("Tom has 7 apples. He buys 5 more. He gives 3 away. How many apples does Tom have now?"),
with every intermediate count kept >= 2 so the story stays sensible.

The model is asked to reason step by step and to end with "The answer is N." (`ANSWER_FORMAT`);
`extract_answer` reads N back, falling back to looser forms and finally to the last number.

`run_grid` runs a task under a grid of sampler settings (`sampler_grid`): every (setting, prompt,
sample) is a row of shared batches with per-row sampler configs and a per-(prompt, sample) generator
stream that is the same under every setting, so comparisons between samplers are paired.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

ANSWER_FORMAT = "The answer is N."
DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # the checkout's data/ (shipped task files)
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


# Numbered levels, easiest first. Level 1 is RESEARCH.md's "Tom has a apples, buys b more" with
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


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids ending with the assistant turn's opening."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


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


def is_correct(text: str, answer: int) -> bool:
    return extract_answer(text) == answer


# --- writing prompts -------------------------------------------------------------------------------


def load_writing_prompts(path: str | Path, n: int | None = None) -> list[str]:
    """Open-ended writing prompts from a JSONL file of {"id", "prompt"} objects (first `n`)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows]
    return prompts[:n] if n is not None else prompts


def writing_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def writing_prompt(prompt: str, tokenizer) -> list[int]:
    """Token ids of the chat prompt for one open-ended writing prompt."""
    return chat_prompt_ids(tokenizer, writing_messages(prompt))


# --- running a task under a grid of sampler settings ---------------------------------------------

# Sampler names (the suite's plot names) -> the SamplerConfig field their grid values set.
SAMPLER_FIELDS = {
    "top_p": "top_p", "min_p": "min_p", "top_k": "top_k", "typical": "typical_p", "eta": "eta", "epsilon": "epsilon",
}
BASELINES = ("temperature", "greedy")  # plain softmax sampling at T; argmax (T = 0)


@dataclass(frozen=True)
class Setting:
    """One cell of the grid: a sampler, its parameter value, a temperature, and the order of stages."""

    sampler: str  # a SAMPLER_FIELDS key or a BASELINES name
    param: float | None  # the sampler's own knob (None for the baselines)
    temperature: float
    order: str | tuple = "hf"  # Sampler order: "hf", "vllm", or stage names (e.g. truncate first)

    @property
    def config(self):
        from decodelab.sampling import SamplerConfig

        if self.sampler == "greedy":
            return SamplerConfig(temperature=0.0)
        if self.sampler == "temperature":
            return SamplerConfig(temperature=self.temperature)
        value = int(self.param) if self.sampler == "top_k" else self.param
        return SamplerConfig(temperature=self.temperature, **{SAMPLER_FIELDS[self.sampler]: value})

    @property
    def order_name(self) -> str:
        return self.order if isinstance(self.order, str) else "truncate_first"

    @property
    def label(self) -> str:
        if self.sampler == "greedy":
            return "greedy"
        knob = "" if self.param is None else f"={self.param:g}"
        suffix = "" if self.order == "hf" else f",{self.order_name}"
        return f"{self.sampler}{knob},T={self.temperature:g}{suffix}"


# Every filter on the T = 1 distribution, then temperature on what survives (one order for all samplers,
# so truncate-first rows of different samplers can share a batch).
TRUNCATE_FIRST = ("top_k", "top_p", "min_p", "typical_p", "epsilon", "eta", "temperature")


def truncate_first_order(sampler: str | None = None) -> tuple[str, ...]:
    """Stage order that truncates on the T = 1 distribution, then applies temperature to the kept set."""
    return TRUNCATE_FIRST


def sampler_grid(
    samplers: dict[str, list], temperatures: list[float], *, baselines: bool = True, greedy: bool = True, order="hf"
) -> list[Setting]:
    """Every sampler x each of its values x each temperature, plus (baselines) plain temperature
    sampling at each temperature and greedy once (unless greedy=False). Fairness by construction:
    every sampler must list the same number of values (the same tuning budget)."""
    unknown = set(samplers) - set(SAMPLER_FIELDS)
    if unknown:
        raise ValueError(f"samplers has unknown names {sorted(unknown)}; allowed: {sorted(SAMPLER_FIELDS)}")
    sizes = {name: len(values) for name, values in samplers.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"samplers={sizes} (values per sampler): every sampler needs the same number of settings")
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures={temperatures!r} must all be > 0 (greedy is added separately)")
    grid = [Setting(name, float(v), float(t), order) for t in temperatures for name, values in samplers.items() for v in values]
    if baselines:
        grid += [Setting("temperature", None, float(t), order) for t in temperatures]
        grid += [Setting("greedy", None, 0.0)] if greedy else []
    return grid


def order_grid(settings: dict[str, float], temperatures: list[float]) -> list[Setting]:
    """Each {sampler: value} at each temperature twice: temperature first (Hugging Face and vLLM) and
    truncation first (the kept set chosen on the T = 1 distribution, then temperature applied to it)."""
    return [Setting(name, float(value), float(t), order)
            for name, value in settings.items() for t in temperatures
            for order in ("hf", truncate_first_order(name))]


def row_seed(seed: int, unit: int, sample: int) -> int:
    """The generator seed of (unit, sample): shared by every setting, so draws are paired across samplers.
    A hash, so streams of different (seed, unit, sample) never coincide in practice."""
    digest = hashlib.sha256(f"decodelab-row-{seed}-{unit}-{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # torch seeds are < 2**64; keep it positive


def run_grid(
    model, prompts: list[list[int]], settings: list[Setting], *, n_samples: int = 1, max_new_tokens: int = 128,
    seed: int = 0, batch_size: int = 64, progress: bool = True,
):
    """Generate for every (setting, prompt, sample) as rows of shared batches (per-row sampler configs).

    Row (setting s, unit u, sample j) draws its uniforms from a generator seeded with row_seed(seed, u, j),
    the same for every setting: differences between settings are not seed noise. Greedy settings run
    one sample per unit (more would be copies). Rows are batched unit by unit, so a batch holds the
    rows of one or a few prompts and each prompt is prefilled once (`shared_prefix.generate_shared`).
    Returns (DataFrame, one row per generation: setting, sampler, param, temperature, order, label,
    unit, sample, tokens, n_tokens, finished, logprob (sum of log p_model(token), T = 1, over the
    tokens); list of DecodeStats).
    """
    import pandas as pd
    import torch

    from decodelab.sampling import Sampler
    from decodelab.shared_prefix import generate_shared

    rows = [
        (s, u, j)
        for s, setting in enumerate(settings)
        for u in range(len(prompts))
        for j in range(1 if setting.sampler == "greedy" else n_samples)
    ]
    # one stage order per batch (a Sampler has one); greedy rows apart (an all-greedy batch takes the
    # argmax fast path, and sampled batches skip the greedy masking); the rows of a unit stay together
    rows.sort(key=lambda r: (settings[r[0]].order_name, settings[r[0]].sampler == "greedy", r[1], r[0], r[2]))
    batches = [chunk[i : i + batch_size] for chunk in _split_by_order(rows, settings)
               for i in range(0, len(chunk), batch_size)]
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=f"{len(rows)} generations")
    records, stats = [], []
    for batch in batches:
        units = list(dict.fromkeys(u for _, u, _ in batch))
        counts = [sum(1 for _, u, _ in batch if u == unit) for unit in units]
        sampler = Sampler([settings[s].config for s, _, _ in batch], order=settings[batch[0][0]].order)
        gens = [torch.Generator(device=model.device).manual_seed(row_seed(seed, u, j)) for _, u, j in batch]
        result = generate_shared(model, [prompts[u] for u in units], counts, max_new_tokens=max_new_tokens,
                                 sampler=sampler, generator=gens)
        stats.append(result.stats)
        for (s, u, j), tokens, finished, logprob in zip(batch, result.tokens, result.finished, result.logprobs):
            st = settings[s]
            records.append(dict(setting=s, sampler=st.sampler, param=st.param, temperature=st.temperature,
                                order=st.order_name, label=st.label, unit=u, sample=j, tokens=tokens,
                                n_tokens=len(tokens), finished=finished, logprob=logprob))
    return pd.DataFrame.from_records(records).sort_values(["setting", "unit", "sample"], ignore_index=True), stats


def _split_by_order(rows, settings):
    """Rows (already sorted) -> runs of rows sharing the stage order and greediness."""
    chunks: dict = {}
    for r in rows:
        chunks.setdefault((settings[r[0]].order_name, settings[r[0]].sampler == "greedy"), []).append(r)
    return list(chunks.values())


def decode_texts(tokenizer, token_lists: list[list[int]]) -> list[str]:
    return [tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]


def score_arithmetic(frame, problems: list[ArithmeticProblem], tokenizer):
    """Add text, pred (extracted integer or None), answer and correct (0/1) columns to run_grid's frame."""
    frame = frame.copy()
    frame["text"] = decode_texts(tokenizer, list(frame["tokens"]))
    frame["pred"] = [extract_answer(t) for t in frame["text"]]
    frame["answer"] = [problems[u].answer for u in frame["unit"]]
    frame["correct"] = [int(p is not None and p == a) for p, a in zip(frame["pred"], frame["answer"])]
    return frame
