"""Arithmetic problems are deterministic and correct; answer extraction works on real model outputs."""
import json
import re
from pathlib import Path

import pytest

from decodelab.workloads import tasks

FIXTURES = Path(__file__).parents[1] / "fixtures"
DATA = Path(__file__).parents[2] / "data"


def _replay(question: str) -> int:
    """Recompute a problem's answer from its text alone."""
    sentences = question.split(". ")
    value = int(re.search(r"has (\d+)", sentences[0]).group(1))
    for s in sentences[1:-1] + [sentences[-1].split("?")[0]]:
        if m := re.search(r"(\d+) times as many", s):
            value *= int(m.group(1))
        elif m := re.search(r"(\d+) more", s):
            value += int(m.group(1))
        elif m := re.search(r"(?:gives|loses|uses) (\d+)", s):
            value -= int(m.group(1))
    return value


@pytest.mark.parametrize("level", sorted(tasks.DIFFICULTIES))
def test_answers_follow_from_question_text(level):
    for p in tasks.make_arithmetic(50, seed=3, difficulty=level):
        assert p.answer == _replay(p.question), p.question
        assert p.answer >= 2


def test_generator_is_deterministic_and_prefix_stable():
    a = tasks.make_arithmetic(20, seed=7, difficulty=4)
    assert a == tasks.make_arithmetic(20, seed=7, difficulty=4)
    assert a[:5] == tasks.make_arithmetic(5, seed=7, difficulty=4)
    assert a != tasks.make_arithmetic(20, seed=8, difficulty=4)


def test_difficulty_sets_number_of_steps():
    for level, spec in tasks.DIFFICULTIES.items():
        for p in tasks.make_arithmetic(10, seed=0, difficulty=level):
            assert p.question.count(".") == spec.steps + 1  # start sentence + one per step
            assert p.steps == spec.steps


def test_unknown_difficulty_names_allowed_levels():
    with pytest.raises(ValueError, match="difficulty=99"):
        tasks.make_arithmetic(1, difficulty=99)
    with pytest.raises(ValueError, match="steps=0"):
        tasks.Difficulty(steps=0, max_operand=5)


def test_shipped_file_matches_generator():
    for level in tasks.DIFFICULTIES:
        shipped = tasks.load_arithmetic(DATA / "arithmetic.jsonl", difficulty=level)
        assert shipped == tasks.make_arithmetic(len(shipped), seed=0, difficulty=level)


def test_save_load_round_trip(tmp_path):
    problems = tasks.make_arithmetic(5, seed=1, difficulty=5)
    assert tasks.load_arithmetic(tasks.save_arithmetic(problems, tmp_path / "p.jsonl")) == problems


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4 + 3 = 7.\nThe answer is 7.", 7),
        ("The answer is: 12", 12),
        ("the answer is **15**.", 15),
        ("The answer is $1,234.", 1234),
        ("Answer: 9", 9),
        ("answer = 42", 42),
        ("so \\boxed{8}", 8),
        ("#### 21", 21),
        ("The answer is 5. Wait, recount. The answer is 6.", 6),  # last stated answer wins
        ("He has 3 + 4 = 7 apples", 7),  # fallback: last number
        ("The answer is 12.0", 12),
        ("The answer is 2.5", None),  # stated but not an integer
        ("I do not know.", None),
        ("", None),
        ("She had -3 left", -3),
        ("pick from 3,4,5", 5),  # a list, not a thousands separator
        ("Omar has 2x16 coins", 2),  # "x16" is not a standalone number
    ],
)
def test_extract_answer_forms(text, expected):
    assert tasks.extract_answer(text) == expected


def test_extract_answer_on_saved_model_outputs():
    """Real SmolLM2-135M-Instruct outputs (greedy and T=1.5 samples), each labelled by hand with the
    integer the text commits to (None when it commits to none)."""
    rows = [json.loads(line) for line in (FIXTURES / "arithmetic_outputs.jsonl").read_text().splitlines()]
    assert len(rows) >= 20
    for row in rows:
        assert tasks.extract_answer(row["output"]) == row["expected"], row["output"]


class _ChatTokenizer:
    """Stands in for a HF tokenizer: a fixed chat template and one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens):
        class Encoding:
            input_ids = [ord(ch) for ch in text]

        return Encoding()


def test_arithmetic_prompt_asks_for_fixed_answer_form():
    problem = tasks.make_arithmetic(1, seed=0, difficulty=2)[0]
    ids = tasks.arithmetic_prompt(problem, _ChatTokenizer())
    text = "".join(map(chr, ids))
    assert text.endswith("<assistant>")
    assert problem.question in text and tasks.ANSWER_FORMAT in text
    assert text.count("<user>") == 2  # one worked example + the problem
    zero_shot = "".join(map(chr, tasks.arithmetic_prompt(problem, _ChatTokenizer(), shots=0)))
    assert zero_shot.count("<user>") == 1


def test_writing_prompts_file_is_well_formed():
    prompts = tasks.load_writing_prompts(DATA / "writing_prompts.jsonl")
    assert len(prompts) >= 32 and len(set(prompts)) == len(prompts)
    assert all(10 < len(p) < 300 for p in prompts)
