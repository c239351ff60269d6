"""What an output must match: a JSON schema, a regex, or a finite list of strings, checked when it is made.

Errors: a malformed constraint raises `ConstraintError` (a ValueError) before any engine runs; a
well-formed one an engine cannot handle raises `UnsupportedConstraint` (see `constrained.engines`); one
whose language is empty raises `ConstraintError` at compile time, before generation starts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from decodelab.workloads.constrained import schema_problem

KINDS = ("json", "regex", "choices")
WHITESPACE = ("compact", "flexible")


class ConstraintError(ValueError):
    """A malformed or unsatisfiable schema / regex / choice list."""


class UnsupportedConstraint(ConstraintError):
    """A well-formed constraint that one engine cannot compile (reported, never generated from)."""


@dataclass(frozen=True)
class Constraint:
    """What an output must match. kind: "json" (spec: schema dict), "regex" (spec: pattern),
    "choices" (spec: strings)."""

    kind: str
    spec: Any = field(hash=False)
    name: str = ""
    whitespace: str = "compact"  # JSON only: "compact" (separators "," ":") or "flexible" (any whitespace)

    @classmethod
    def json(cls, schema: dict | str, name: str = "", whitespace: str = "compact") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ConstraintError(f"schema={schema[:80]!r} is not valid JSON: {error}") from None
        return cls("json", schema, name, whitespace).checked()

    @classmethod
    def regex(cls, pattern: str, name: str = "") -> "Constraint":
        return cls("regex", pattern, name).checked()

    @classmethod
    def choices(cls, strings: list[str], name: str = "") -> "Constraint":
        return cls("choices", list(strings), name).checked()

    @property
    def pattern(self) -> str:
        """Regex source for "regex" and "choices" constraints."""
        import re

        if self.kind == "regex":
            return self.spec
        if self.kind == "choices":
            return "(" + "|".join(re.escape(s) for s in self.spec) + ")"
        raise ValueError(f"Constraint kind={self.kind!r} has no regex pattern; allowed for 'regex' and 'choices'")

    @property
    def label(self) -> str:
        """The constraint's name, else the start of its spec: how error messages refer to it."""
        return self.name or describe_spec(self.spec)

    def checked(self) -> "Constraint":
        """Validate the constraint itself (independent of any engine); raise ConstraintError if malformed."""
        if self.kind not in KINDS:
            raise ConstraintError(f"kind={self.kind!r} is not a constraint kind; allowed: 'json', 'regex', 'choices'")
        if self.whitespace not in WHITESPACE:
            raise ConstraintError(f"whitespace={self.whitespace!r} must be one of {WHITESPACE}")
        if self.kind == "json":
            if not isinstance(self.spec, (dict, bool)):
                raise ConstraintError(f"schema={self.spec!r} must be a JSON object (dict) or boolean")
            problem = schema_problem(self.spec, self.name)
            if problem:
                raise ConstraintError(problem)
        elif self.kind == "choices":
            if not self.spec or not all(isinstance(s, str) and s for s in self.spec):
                raise ConstraintError(f"choices={self.spec!r} must be a non-empty list of non-empty strings")
        else:
            import regex

            if not isinstance(self.spec, str):
                raise ConstraintError(f"pattern={self.spec!r} must be a string")
            try:
                regex.compile(self.spec)
            except regex.error as error:
                raise ConstraintError(f"pattern={self.spec!r} is not a valid regex: {error}") from None
        return self


def describe_spec(spec) -> str:
    """The first 80 characters of a spec (its JSON text for a schema), quoted."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return repr(text[:80])
