"""Families of similar problems for the trace-reuse notebook: one template per family, different names and numbers.

A family is one sentence template (a one-step addition with operands <= 20, a two-step word problem, a three-step
one, a unit conversion, a running total) whose slots are filled from a seeded `random.Random`: a person (name +
pronouns), an item, and integers. Every
problem carries its `values` in a fixed order, the question's numbers first, then every intermediate result, then
the answer, so that two problems of one family can be aligned value for value: `slot_map(old, new)` says which
string of an earlier problem's worked solution stands for which string of the new one.

The stream the notebook serves is a list of problems in arrival order (`make_stream`): families interleaved by a
seeded draw, so a query's cache only holds what came before it. `data/trace_families.jsonl` is a frozen copy
(`data/make_trace_families.py`); `load_stream` reads it and keeps the families asked for, in file order.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from decodelab.workloads.paths import data_file

STREAM_FILE = "trace_families.jsonl"
PEOPLE = (("Tom", "he", "his"), ("Anna", "she", "her"), ("Ben", "he", "his"), ("Maria", "she", "her"),
          ("Sam", "he", "his"), ("Lena", "she", "her"), ("Omar", "he", "his"), ("Julia", "she", "her"),
          ("Ravi", "he", "his"), ("Emma", "she", "her"), ("Leo", "he", "his"), ("Nina", "she", "her"))
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "coins", "shells", "cards")
ACTIVITIES = (("reads", "pages"), ("runs", "kilometers"), ("writes", "lines"), ("swims", "laps"),
              ("bakes", "muffins"), ("folds", "cranes"))


@dataclass(frozen=True)
class FamilyProblem:
    """One problem of one family. values: question numbers, then intermediate results, then the answer."""

    id: str
    family: str
    question: str
    answer: int
    values: tuple[int, ...]
    slots: dict = field(default_factory=dict)  # word slots: name, subject, possessive, item / unit, verb

    def to_dict(self) -> dict:
        row = asdict(self)
        row["values"] = list(self.values)
        return row

    @classmethod
    def from_dict(cls, row: dict) -> "FamilyProblem":
        return cls(id=row["id"], family=row["family"], question=row["question"], answer=int(row["answer"]),
                   values=tuple(int(v) for v in row["values"]), slots=dict(row.get("slots", {})))


def _person(rng: random.Random) -> dict:
    name, subject, possessive = rng.choice(PEOPLE)
    return {"name": name, "subject": subject, "Subject": subject.capitalize(), "possessive": possessive}


def _distinct(rng: random.Random, draw, values_of) -> tuple:
    """Redraw until every value (question numbers and intermediates) differs: then the value-for-value
    alignment of two problems is unambiguous."""
    while True:
        numbers = draw()
        values = values_of(*numbers)
        if len(set(values)) == len(values) and min(values) >= 2:
            return numbers, values


def _one_step(rng: random.Random) -> tuple[str, tuple[int, ...], dict]:
    """The easy family: one addition with operands <= 20, the shape of the prompt's worked example, so the
    135M model answers a fair share correctly and accuracy comparisons against plain decoding can move."""
    person, item = _person(rng), rng.choice(ITEMS)
    (a, b), values = _distinct(rng, lambda: (rng.randint(2, 20), rng.randint(2, 20)), lambda a, b: (a, b, a + b))
    text = (f"{person['name']} has {a} {item}. {person['Subject']} buys {b} more {item}. "
            f"How many {item} does {person['name']} have now?")
    return text, values, {**person, "item": item}


def _two_step(rng: random.Random) -> tuple[str, tuple[int, ...], dict]:
    person, item = _person(rng), rng.choice(ITEMS)
    (a, b, c), values = _distinct(rng, lambda: (rng.randint(5, 20), rng.randint(2, 15), rng.randint(2, 9)),
                                  lambda a, b, c: (a, b, c, a + b, a + b - c))
    text = (f"{person['name']} has {a} {item}. {person['Subject']} buys {b} more {item}. Then {person['subject']} "
            f"gives {c} {item} to a friend. How many {item} does {person['name']} have now?")
    return text, values, {**person, "item": item}


def _three_step(rng: random.Random) -> tuple[str, tuple[int, ...], dict]:
    person, item = _person(rng), rng.choice(ITEMS)
    (a, b, c, d), values = _distinct(
        rng, lambda: (rng.randint(5, 20), rng.randint(2, 12), rng.randint(2, 9), rng.randint(2, 12)),
        lambda a, b, c, d: (a, b, c, d, a + b, a + b - c, a + b - c + d))
    text = (f"{person['name']} has {a} {item}. {person['Subject']} buys {b} more {item}. {person['Subject']} "
            f"loses {c} {item}. Then {person['subject']} finds {d} more {item}. "
            f"How many {item} does {person['name']} have now?")
    return text, values, {**person, "item": item}


def _unit_conversion(rng: random.Random) -> tuple[str, tuple[int, ...], dict]:
    person = _person(rng)
    (a, b), values = _distinct(rng, lambda: (rng.randint(2, 9), rng.randint(2, 59)),
                               lambda a, b: (a, b, 60 * a, 60 * a + b))
    text = (f"{person['name']} walks for {a} hours and {b} minutes. "
            f"How many minutes does {person['name']} walk in total?")
    return text, values, person


def _running_total(rng: random.Random) -> tuple[str, tuple[int, ...], dict]:
    person, (verb, unit) = _person(rng), rng.choice(ACTIVITIES)
    (a, b, c), values = _distinct(rng, lambda: (rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 30)),
                                  lambda a, b, c: (a, b, c, a + b, a + b + c))
    text = (f"{person['name']} {verb} {a} {unit} on Monday, {b} {unit} on Tuesday and {c} {unit} on Wednesday. "
            f"How many {unit} does {person['name']} {verb[:-1]} in total?")
    return text, values, {**person, "unit": unit, "verb": verb, "verb_base": verb[:-1]}


TEMPLATES = {"one_step": _one_step, "two_step": _two_step, "three_step": _three_step,
             "unit_conversion": _unit_conversion,
             "running_total": _running_total}
FAMILIES = tuple(TEMPLATES)


def check_families(families) -> list[str]:
    """The family names asked for, checked: a non-empty list of known names."""
    names = [families] if isinstance(families, str) else list(families or [])
    if not names:
        raise ValueError(f"families={families!r} is empty; allowed: a non-empty list from {list(FAMILIES)}")
    unknown = [name for name in names if name not in TEMPLATES]
    if unknown:
        raise ValueError(f"families={families!r}: unknown {unknown}; allowed: {list(FAMILIES)}")
    return names


def make_problem(family: str, rng: random.Random, index: int) -> FamilyProblem:
    """Problem `index` of `family`, drawn from `rng` (the only randomness used)."""
    check_families([family])
    question, values, slots = TEMPLATES[family](rng)
    return FamilyProblem(id=f"{family}-{index}", family=family, question=question, answer=values[-1],
                         values=tuple(values), slots=slots)


def make_stream(n: int, families=FAMILIES, seed: int = 0) -> list[FamilyProblem]:
    """n problems in arrival order: each arrival's family drawn uniformly, then its problem from that family's
    own stream (so a family's k-th problem does not depend on the other families). Deterministic in the args."""
    names = check_families(families)
    if n < 1:
        raise ValueError(f"n={n!r} must be >= 1")
    order_rng = random.Random(f"trace-stream-{seed}")
    family_rngs = {name: random.Random(f"trace-family-{name}-{seed}") for name in names}
    counts = dict.fromkeys(names, 0)
    stream = []
    for _ in range(n):
        name = order_rng.choice(names)
        stream.append(make_problem(name, family_rngs[name], counts[name]))
        counts[name] += 1
    return stream


def save_stream(problems: list[FamilyProblem], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in problems), encoding="utf-8")
    return path


def load_stream(n: int, families=FAMILIES, path: str | Path | None = None) -> list[FamilyProblem]:
    """The first n problems of `families` in the stream file (default data/trace_families.jsonl), in arrival order.

    Raises ValueError naming the family when one has no problem in the file (an empty family), and when the
    file holds fewer than n problems of the families asked for."""
    names = check_families(families)
    path = Path(path) if path is not None else data_file(STREAM_FILE)
    rows = [FamilyProblem.from_dict(json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    present = {p.family for p in rows}
    empty = [name for name in names if name not in present]
    if empty:
        raise ValueError(f"families={names!r}: {empty} have no problems in {path} (an empty family); "
                         f"allowed: families present there, {sorted(present)}")
    kept = [p for p in rows if p.family in names]
    if n < 1 or n > len(kept):
        raise ValueError(f"n_queries={n!r} must be between 1 and {len(kept)} (problems of {names} in {path})")
    return kept[:n]


def slot_map(old: FamilyProblem, new: FamilyProblem) -> dict[str, str]:
    """Which string of `old`'s worked solution stands for which of `new`'s: every value by position (question
    numbers, intermediates, answer) and every word slot by name. Same family only; identity pairs left out."""
    if old.family != new.family:
        raise ValueError(f"slot_map: problems {old.id!r} and {new.id!r} are of different families "
                         f"({old.family!r}, {new.family!r}); only a same-family pair aligns")
    pairs = {str(a): str(b) for a, b in zip(old.values, new.values)}
    pairs.update({str(old.slots[key]): str(new.slots[key]) for key in old.slots if key in new.slots})
    return {a: b for a, b in pairs.items() if a != b}
