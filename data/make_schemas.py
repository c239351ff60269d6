"""Write the shipped inputs of notebook 04 (masking distortion):

- data/schemas.json: a list of {name, prompt, fixed_keys, schema}: JSON schemas with free-text fields
  for experiments 3-5 (validity, mask cost, jump-forward). Strings carry maxLength and integers ranges,
  so even random-logit walks end; `fixed_keys` marks schemas whose keys are all required and closed
  (what jump-forward can skip).
- data/constrained_tasks.json: small finite languages with real prompts for experiments 1-2 (exact
  enumeration): answer sets, enumerations whose tokenization lengths differ, short formats, tiny JSON.

Run: python data/make_schemas.py  (deterministic; no network)
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def text(n: int = 24) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": n}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS = [
    {"name": "person", "fixed_keys": True,
     "prompt": "Describe a fictional person as JSON with keys name, age and city.",
     "schema": obj({"name": text(), "age": integer(0, 120), "city": text()})},
    {"name": "answer_confidence", "fixed_keys": True,
     "prompt": "Is the Great Wall of China visible from the Moon with the naked eye? Reply as JSON with "
               "keys answer (yes or no) and confidence (low, medium or high).",
     "schema": obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"enum": ["low", "medium", "high"]}})},
    {"name": "weather", "fixed_keys": True,
     "prompt": "Give today's weather report for a city of your choice as JSON with keys city, "
               "temperature_c, condition (sunny, cloudy, rainy or snowy) and windy (true or false).",
     "schema": obj({"city": text(), "temperature_c": integer(-50, 60),
                    "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}, "windy": {"type": "boolean"}})},
    {"name": "product", "fixed_keys": True,
     "prompt": "Invent a product for an online shop as JSON with keys name, price_cents, tags (up to three "
               "short words) and in_stock.",
     "schema": obj({"name": text(), "price_cents": integer(0, 100000),
                    "tags": {"type": "array", "items": text(12), "maxItems": 3},
                    "in_stock": {"type": "boolean"}})},
    {"name": "event", "fixed_keys": True,
     "prompt": "Describe a conference as JSON with keys title, date (YYYY-MM-DD) and attendees.",
     "schema": obj({"title": text(32), "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                    "attendees": integer(0, 5000)})},
    {"name": "user_roles", "fixed_keys": True,
     "prompt": "Create a user account as JSON: user (with name and email) and roles (a list drawn from "
               "admin, editor, viewer).",
     "schema": obj({"user": obj({"name": text(),
                                 "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}}),
                    "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]},
                              "minItems": 1, "maxItems": 3}})},
    {"name": "book_optional", "fixed_keys": False,
     "prompt": "Recommend a book as JSON with keys title, author and year, and optionally genre.",
     "schema": obj({"title": text(40), "author": text(), "year": integer(1450, 2025),
                    "genre": {"enum": ["fiction", "science", "history", "poetry"]}},
                   required=["title", "author", "year"])},
    {"name": "colour_pick", "fixed_keys": True,
     "prompt": "What colour is a ripe banana? Reply as JSON with the key colour.",
     "schema": obj({"colour": {"enum": ["red", "orange", "yellow", "green", "blue", "purple", "brown"]}})},
]

TASKS = [
    {"name": "yes_no", "category": "answer set",
     "question": "Is Paris the capital of France? Answer with exactly one word: yes, no or unsure.",
     "strings": ["yes", "no", "unsure"]},
    {"name": "Yes_No", "category": "answer set",
     "question": "Can penguins fly? Answer with exactly one word: Yes, No or Unsure.",
     "strings": ["Yes", "No", "Unsure"]},
    {"name": "colour", "category": "enumeration",
     "question": "What colour is a ripe banana? Answer with one colour from: red, orange, yellow, green, blue, "
                 "indigo, violet, turquoise, magenta.",
     "strings": ["red", "orange", "yellow", "green", "blue", "indigo", "violet", "turquoise", "magenta"]},
    {"name": "country", "category": "enumeration",
     "question": "In which country is the city of Zurich? Answer with one country from: France, Germany, "
                 "Italy, Austria, Switzerland.",
     "strings": ["France", "Germany", "Italy", "Austria", "Switzerland"]},
    {"name": "small_int", "category": "short format",
     "question": "How many legs does a spider have? Answer with a number only.",
     "strings": [str(i) for i in range(21)]},
    {"name": "month_day", "category": "short format",
     "question": "On which date is Christmas Day? Answer as MM-DD only.",
     "strings": [f"{m:02d}-{d:02d}" for m in range(1, 13) for d in range(1, 32)
                 if d <= [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][m - 1]]},
    {"name": "json_yes_no", "category": "JSON enum",
     "question": 'Is water wet? Reply only with JSON like {"a":"yes"} where a is yes or no.',
     "strings": ['{"a":"yes"}', '{"a":"no"}']},
]


def main() -> None:
    (HERE / "schemas.json").write_text(json.dumps(SCHEMAS, indent=1) + "\n", encoding="utf-8")
    (HERE / "constrained_tasks.json").write_text(json.dumps(TASKS, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(SCHEMAS)} schemas and {len(TASKS)} tasks to {HERE}")


if __name__ == "__main__":
    main()
