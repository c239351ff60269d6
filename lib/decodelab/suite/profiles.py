"""A notebook's parameters: the `parameters` cell, the profile files, `-p key=value` overrides.

Each default is defined once, in the notebook's parameters cell; a profile
(`notebooks/params/<runner-name>/<profile>.yaml`) holds only the values that differ from it, `-p`
overrides on top. Everything here is checked before a kernel starts, so a typo costs a second, not a
run. What a value may be (type from the default, `[allowed: ...]` / `[each: ...]` checks) is
decodelab.suite.parameter.
"""
from __future__ import annotations

import ast
import importlib
import io
import json
import re
import tokenize
from pathlib import Path
from typing import Any

from decodelab.suite.parameter import Check, Parameter, check_value, check_values, split_checks  # noqa: F401

PROFILES = ("smoke", "cpu", "gpu")
PARAMETERS_TAG = "parameters"
# Set by the runner, never by a profile or `-p`.
RESERVED = ("output_dir",)

# ---------------------------------------------------------------- the parameters cell
def parameters_cell(notebook: dict) -> str:
    """Source of the one cell tagged `parameters` in a notebook (nbformat JSON as a dict)."""
    tagged = [
        cell for cell in notebook.get("cells", [])
        if PARAMETERS_TAG in cell.get("metadata", {}).get("tags", [])
    ]
    if len(tagged) != 1:
        raise ValueError(f"a notebook needs exactly one cell tagged {PARAMETERS_TAG!r}; found {len(tagged)}")
    source = tagged[0]["source"]
    return "".join(source) if isinstance(source, list) else source


def parse_parameters(source: str) -> dict[str, Parameter]:
    """`name = value  # comment` lines of a parameters cell -> {name: Parameter}, in order.

    A comment on the line above an assignment also counts as its help (for long defaults).
    Checks at the end of the comment (`[allowed: ...]`, `[each: ...]`) are split off into `checks`;
    one that does not parse raises ValueError naming the parameter.
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = _comments_by_line(source)
    params: dict[str, Parameter] = {}
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if not targets or getattr(node, "value", None) is None:
            continue
        value_source = ast.get_source_segment(source, node.value) or ""
        # The comment after the value, after the opening line of a multi-line value, or just above.
        help_text = (
            comments.get(node.end_lineno) or comments.get(node.lineno)
            or (comments.get(node.lineno - 1) if _is_comment_line(lines, node.lineno - 1) else "")
        )
        names = [target.id for target in targets if isinstance(target, ast.Name)]
        try:
            help_text, checks = split_checks(help_text or "")
        except ValueError as error:
            raise ValueError(f"parameter {names[0] if names else '?'!r}: {error}") from None
        for name in names:
            params[name] = Parameter(name, value_source, help_text, checks)
    return params


def _comments_by_line(source: str) -> dict[int, str]:
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    return comments


def _is_comment_line(lines: list[str], lineno: int) -> bool:
    return 1 <= lineno <= len(lines) and lines[lineno - 1].lstrip().startswith("#")


def read_notebook(path: Path) -> dict:
    """The nbformat JSON of the notebook at `path` (ValueError naming the file when it is not JSON)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a notebook (invalid JSON at line {error.lineno}: {error.msg})") from None


def notebook_parameters(path: Path) -> dict[str, Parameter]:
    """Parameters declared by the notebook file at `path` (ValueError naming the file when unreadable)."""
    notebook = read_notebook(path)
    try:
        return parse_parameters(parameters_cell(notebook))
    except SyntaxError as error:
        raise ValueError(
            f"{path.name}: the parameters cell does not parse (line {error.lineno}: {error.msg})"
        ) from None
    except ValueError as error:
        raise ValueError(f"{path.name}: {error}") from None


def imported_names(notebook: dict) -> dict[str, tuple[str, str]]:
    """`from MODULE import NAME [as ALIAS]` in the code cells above the parameters cell ->
    {ALIAS: (MODULE, NAME)}: what a non-literal default such as `DEFAULT_MODEL` can refer to."""
    names: dict[str, tuple[str, str]] = {}
    for cell in notebook.get("cells", []):
        if PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            break
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"]
        try:
            tree = ast.parse("".join(source) if isinstance(source, list) else source)
        except SyntaxError:  # IPython magics: such a cell imports nothing a default can name
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
    return names


def evaluated_defaults(path: Path) -> dict[str, Any]:
    """Each declared parameter's default as the kernel evaluates it (the runner's reserved names aside):
    a literal as written, a bare name imported above the parameters cell (`model = DEFAULT_MODEL`,
    with `from decodelab.core.models import DEFAULT_MODEL`) as that constant's value, anything else as
    its source text."""
    imports = imported_names(read_notebook(path))
    values = {}
    for name, param in notebook_parameters(path).items():
        if name in RESERVED:
            continue
        values[name] = param.default
        if not param.is_literal and param.source in imports:
            module, attribute = imports[param.source]
            values[name] = getattr(importlib.import_module(module), attribute)
    return values


def same_value(a: Any, b: Any) -> bool:
    """Equal as parameter values: equal after parsing, a bool never equal to a number (True != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def redundant_entries(profile_values: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """The names whose profile value equals the notebook's default (`evaluated_defaults`): entries a
    profile must not hold, since a profile carries only what differs from the parameters cell."""
    return [name for name, value in profile_values.items() if name in defaults and same_value(value, defaults[name])]


def profile_path(params_dir: Path, profile: str) -> Path:
    return params_dir / f"{profile}.yaml"


def available_profiles(params_dir: Path) -> list[str]:
    """Profiles that exist for one notebook, in the canonical order smoke, cpu, gpu."""
    return [p for p in PROFILES if profile_path(params_dir, p).exists()]


def load_profile(params_dir: Path, profile: str) -> dict[str, Any]:
    """The YAML mapping of `<params_dir>/<profile>.yaml` (an empty file is an empty mapping)."""
    import yaml

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not a profile; allowed: {list(PROFILES)}")
    path = profile_path(params_dir, profile)
    if not path.exists():
        raise ValueError(
            f"profile={profile!r} has no file {path}; profiles available here: {available_profiles(params_dir)}"
        )
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"profile file {path}: {_yaml_problem(error, text)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"profile file {path} must hold a YAML mapping of parameter -> value, "
                         f"got {type(data).__name__}")
    return data


def _yaml_problem(error, text: str) -> str:
    """"line 2: not valid YAML (<what>): '<the line>'" from a YAML error (at the end of the file: the
    last line with text)."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    what = ", ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None)))) or str(error)
    lines = text.splitlines()
    line = mark.line if mark is not None else None  # 0-based
    if line is not None and (line >= len(lines) or not lines[line].strip()):
        line = next((i for i in range(min(line, len(lines)) - 1, -1, -1) if lines[i].strip()), None)
    if line is None:
        return f"not valid YAML ({what})"
    return f"line {line + 1}: not valid YAML ({what}): {lines[line].strip()!r}"


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_override(item: str) -> tuple[str, Any]:
    """`-p key=value` -> (key, value parsed as YAML): `batch_sizes=[1,3]` -> ("batch_sizes", [1, 3])."""
    import yaml

    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise ValueError(
            f"-p {item!r} is malformed: expected key=value with a parameter name as key "
            "and a YAML value (e.g. -p batch_sizes=[1,4] or -p model=smollm2-135m)"
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        first = str(error).splitlines()[0]
        raise ValueError(f"-p {item!r} is malformed: the value {raw!r} is not valid YAML ({first})") from None
    return key, value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """Several `-p key=value` items -> one dict (a later key wins)."""
    return dict(parse_override(item) for item in items or [])


def validate(params: dict[str, Any], declared: dict[str, Parameter], *, source: str) -> None:
    """Reject names the parameters cell does not declare, names only the runner may set, and values
    of the wrong type or outside the parameter's checks (`check_values`)."""
    unknown = sorted(set(params) - set(declared))
    if unknown:
        valid = [name for name in declared if name not in RESERVED]
        raise ValueError(f"unknown parameter(s) {unknown} in {source}; valid parameters: {valid}")
    reserved = sorted(set(params) & set(RESERVED))
    if reserved:
        raise ValueError(f"parameter(s) {reserved} in {source} are set by the runner and cannot be given")
    check_values(params, declared, source=source)


def resolve(
    declared: dict[str, Parameter], profile_values: dict[str, Any], overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(injected, merged): what papermill injects (profile + overrides) and every parameter's final value.

    Non-literal defaults (e.g. `model = DEFAULT_MODEL`) appear in `merged` as their source text until
    `runs.start` records the kernel's evaluated value.
    """
    injected = {**profile_values, **overrides}
    merged = {name: p.default for name, p in declared.items() if name not in RESERVED}
    merged.update(injected)
    return injected, merged
