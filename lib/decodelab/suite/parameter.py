"""One declared parameter (`name = default  # help [allowed: ...] [each: ...]`) and the values it allows.

A value's type comes from its parameter's default: int, float (ints accepted), str, bool, list, dict;
a None or non-literal default (e.g. `DEFAULT_MODEL`) accepts any value. The comment may end with
checks over the value `x`, evaluated by a small safe evaluator (no attribute access, no arbitrary calls)::

    top_p = 0.9  # nucleus mass [allowed: 0 < x <= 1]
    batch_sizes = [1, 4, 16]  # batch sizes [each: x >= 1] [allowed: len(x) >= 1]

`allowed:` applies to the whole value, `each:` to every element of a list (every value of a dict).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from types import CodeType
from typing import Any


@dataclass(frozen=True)
class Parameter:
    """One assignment of a parameters cell: `name = default  # help`."""

    name: str
    source: str  # the default as written, e.g. "[1, 4, 16]" or "DEFAULT_MODEL"
    help: str = ""  # the comment without its checks
    checks: tuple[Check, ...] = ()

    @property
    def kind(self) -> str | None:
        """The type a value must have ("int", "float", "str", "bool", "list", "dict"), None = any."""
        if not self.is_literal:
            return None
        return _kind_of(self.default)

    @property
    def allowed_text(self) -> str:
        """The checks as written, e.g. "allowed: 0 < x <= 1; each: x >= 1" ("" when none)."""
        return "; ".join(f"{check.kind}: {check.expr}" for check in self.checks)

    @property
    def default(self) -> Any:
        """The default as a Python value when it is a literal, else its source text."""
        try:
            return ast.literal_eval(self.source)
        except (ValueError, SyntaxError):
            return self.source

    @property
    def display(self) -> str:
        """The default on one line (multi-line literals compacted), for listings."""
        if "\n" not in self.source:
            return self.source
        text = repr(self.default) if self.is_literal else " ".join(self.source.split())
        return text if len(text) <= 120 else text[:117] + "..."

    @property
    def is_literal(self) -> bool:
        try:
            ast.literal_eval(self.source)
        except (ValueError, SyntaxError):
            return False
        return True


# ---------------------------------------------------------------- checks: `[allowed: EXPR]`, `[each: EXPR]`
CHECK_KINDS = ("allowed", "each")
SAFE_FUNCTIONS = {f.__name__: f for f in (
    len, min, max, sorted, all, any, isinstance, int, float, str, list, dict, bool, tuple, set, abs,
)}
SAFE_NAMES = ("x", *SAFE_FUNCTIONS)
# Everything else (attributes, lambdas, comprehensions, `**`, starred arguments) is refused, so a
# check can only look at `x`: a notebook's comment can never run code in the runner.
_SAFE_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Is, ast.IsNot,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod,
    ast.Constant, ast.Name, ast.Load, ast.Tuple, ast.List, ast.Set, ast.Dict,
    ast.Call, ast.keyword, ast.Subscript, ast.Slice,
)
_CHECK_START = re.compile(r"\[\s*(allowed|each)\s*:")


@dataclass(frozen=True)
class Check:
    """One `[allowed: EXPR]` or `[each: EXPR]` annotation, compiled after a whitelist check of its AST."""

    kind: str  # "allowed" (the whole value) or "each" (every list element / dict value)
    expr: str  # the expression over x, as written
    code: CodeType = field(compare=False, repr=False)

    @classmethod
    def parse(cls, kind: str, expr: str) -> Check:
        """Raise ValueError naming the annotation when it is not a safe expression over x."""
        where = f"[{kind}: {expr}]"
        if not expr:
            raise ValueError(f"the check {where} is empty; write an expression over x, e.g. [{kind}: x >= 1]")
        try:
            tree = ast.parse(expr, mode="eval")
        except SyntaxError as error:
            raise ValueError(f"the check {where} does not parse as Python: {error.msg}") from None
        for node in ast.walk(tree):
            if not isinstance(node, _SAFE_NODES):
                shown = f" ({ast.unparse(node)})" if isinstance(node, ast.expr) else ""
                raise ValueError(
                    f"the check {where} uses {type(node).__name__}{shown}, "
                    f"which a check may not; allowed: the names {list(SAFE_NAMES)}, True/False/None, literals, "
                    "comparisons (in, is), and/or/not, + - * / // %, indexing"
                )
            if isinstance(node, ast.Name) and node.id not in SAFE_NAMES:
                raise ValueError(f"the check {where} names {node.id!r}; a check may name only {list(SAFE_NAMES)}")
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in SAFE_FUNCTIONS):
                raise ValueError(f"the check {where} calls {ast.unparse(node.func)}; callable: {list(SAFE_FUNCTIONS)}")
            if isinstance(node, ast.keyword) and node.arg is None:
                raise ValueError(f"the check {where} passes **keywords, which a check may not")
        return cls(kind, expr, compile(tree, f"<check {where}>", "eval"))

    def passes(self, x: Any) -> tuple[bool, str]:
        """(ok, why not): evaluates the expression with `x` bound; an exception counts as not allowed."""
        try:
            ok = eval(self.code, {"__builtins__": {}}, {**SAFE_FUNCTIONS, "x": x})  # noqa: S307 - whitelisted AST
        except Exception as error:  # noqa: BLE001 - a check that cannot be evaluated on x rejects x
            return False, f"the check raised {type(error).__name__}: {error}"
        return bool(ok), ""


def split_checks(comment: str) -> tuple[str, tuple[Check, ...]]:
    """A parameter comment -> (help text without the checks, the checks in order)."""
    parts, checks, pos = [], [], 0
    while (match := _CHECK_START.search(comment, pos)) is not None:
        end = _closing_bracket(comment, match.end())
        if end is None:
            raise ValueError(f"the check {comment[match.start():]!r} has no closing ']'")
        checks.append(Check.parse(match.group(1), comment[match.end():end].strip()))
        parts.append(comment[pos:match.start()])
        pos = end + 1
    parts.append(comment[pos:])
    return " ".join(part.strip() for part in parts if part.strip()), tuple(checks)


def _closing_bracket(text: str, start: int) -> int | None:
    """Index of the `]` closing a check whose expression starts at `start` (brackets and quotes nest)."""
    depth, quote, i = 0, None, start
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return i if char == "]" else None
            depth -= 1
        i += 1
    return None


# ---------------------------------------------------------------- value checks
_KINDS = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), ((list, tuple), "list"), (dict, "dict"))
EXPECTED = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
    "list": "a list", "dict": "a mapping",
}


def _kind_of(value: Any) -> str | None:
    for types, kind in _KINDS:
        if isinstance(value, types):
            return kind
    return None  # None, or a literal of another type: any value


def _has_kind(value: Any, kind: str | None) -> bool:
    if kind is None:
        return True
    if isinstance(value, bool):  # bool is an int to Python, never to a parameter
        return kind == "bool"
    return {
        "int": lambda v: isinstance(v, int),
        "float": lambda v: isinstance(v, (int, float)),
        "str": lambda v: isinstance(v, str),
        "bool": lambda v: False,
        "list": lambda v: isinstance(v, (list, tuple)),
        "dict": lambda v: isinstance(v, dict),
    }[kind](value)


def check_value(param: Parameter, value: Any, *, source: str = "-p") -> list[str]:
    """Why `value` is not allowed for `param` (type from the default, then its checks); [] when it is.

    Each message names where the value came from, the parameter, the value and what is allowed:
    `-p max_new_tokens='abc': expected an integer, got a string (default 64; allowed: x >= 1)`.
    Null is accepted only where the default is None; a non-literal default accepts any other value.
    """
    where = f"-p {param.name}=" if source == "-p" else f"{source}: {param.name}="
    default = f"default {param.display}"
    kind = param.kind
    if (value is None and param.source != "None") or not _has_kind(value, kind):
        context = "; ".join(filter(None, (default, param.allowed_text)))
        hint = ""
        if value is None:
            hint = "; an empty value is YAML null, which only parameters whose default is None accept"
        elif kind == "list" and source == "-p":
            hint = f"; a list is written -p {param.name}=[{_show(value)}]"
        elif kind == "str":
            hint = "; YAML read the value as " + _type_name(value) + ": quote it to pass a string"
        expected = EXPECTED[kind] if kind else "a value"
        return [f"{where}{_show(value)}: expected {expected}, got {_type_name(value)} ({context}){hint}"]
    problems = []
    for check in param.checks:
        if check.kind == "allowed":
            ok, why = check.passes(value)
            if not ok:
                problems.append(f"{where}{_show(value)}: not allowed ({_join(check, why, default)})")
            continue
        if value is None:  # `each:` has nothing to look at (None stands for the notebook's default choice)
            continue
        if not isinstance(value, (list, tuple, dict)):
            problems.append(f"{where}{_show(value)}: expected a list or mapping for [each: {check.expr}] ({default})")
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            ok, why = check.passes(item)
            if not ok:
                problems.append(
                    f"{where}{_show(value)}: element {param.name}[{key!r}]={_show(item)} is not allowed "
                    f"({_join(check, why, default)})"
                )
                break
    return problems


def _join(check: Check, why: str, context: str) -> str:
    return "; ".join(filter(None, (f"{check.kind}: {check.expr}", why, context)))


def _type_name(value: Any) -> str:
    names = {**EXPECTED, "bool": "a boolean"}
    return "null" if value is None else names.get(_kind_of(value), f"a {type(value).__name__}")


def _show(value: Any) -> str:
    """A value as the user would write it: null, true/false, 'text', [1, 2]."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return repr(value)


def check_values(params: dict[str, Any], declared: dict[str, Parameter], *, source: str) -> None:
    """Raise one ValueError listing every value of `params` its declared parameter does not allow."""
    problems = [
        problem for name, value in params.items() if name in declared
        for problem in check_value(declared[name], value, source=source)
    ]
    if problems:
        raise ValueError("\n".join(problems))
