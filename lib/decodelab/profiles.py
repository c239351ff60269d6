"""A notebook's parameters: the `parameters` cell, the profile files, `-p key=value` overrides.

Each default is defined once, in the notebook's parameters cell; a profile
(`notebooks/params/<runner-name>/<profile>.yaml`) overrides some of them, `-p` overrides on top.
Everything here is checked before a kernel starts, so a typo costs a second, not a run.
"""
from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILES = ("smoke", "cpu", "gpu")
PARAMETERS_TAG = "parameters"
# Set by the runner, never by a profile or `-p`.
RESERVED = ("output_dir",)


@dataclass(frozen=True)
class Parameter:
    """One assignment of a parameters cell: `name = default  # help`."""

    name: str
    source: str  # the default as written, e.g. "[1, 4, 16]" or "DEFAULT_MODEL"
    help: str = ""

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
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = _comments_by_line(source)
    params: dict[str, Parameter] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if not targets or getattr(node, "value", None) is None:
            continue
        value_source = ast.get_source_segment(source, node.value) or ""
        # The comment after the value, after the opening line of a multi-line value, or just above.
        help_text = (
            comments.get(node.end_lineno) or comments.get(node.lineno)
            or (comments.get(node.lineno - 1) if _is_comment_line(lines, node.lineno - 1) else "")
        )
        for target in targets:
            if isinstance(target, ast.Name):
                params[target.id] = Parameter(target.id, value_source, help_text or "")
    return params


def _comments_by_line(source: str) -> dict[int, str]:
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    return comments


def _is_comment_line(lines: list[str], lineno: int) -> bool:
    return 1 <= lineno <= len(lines) and lines[lineno - 1].lstrip().startswith("#")


def notebook_parameters(path: Path) -> dict[str, Parameter]:
    """Parameters declared by the notebook file at `path`."""
    with open(path, encoding="utf-8") as handle:
        notebook = json.load(handle)
    try:
        return parse_parameters(parameters_cell(notebook))
    except ValueError as error:
        raise ValueError(f"{path.name}: {error}") from None


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
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"profile file {path} must hold a YAML mapping of parameter -> value, got {type(data).__name__}")
    return data


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
    """Reject names the parameters cell does not declare, and names only the runner may set."""
    unknown = sorted(set(params) - set(declared))
    if unknown:
        valid = [name for name in declared if name not in RESERVED]
        raise ValueError(f"unknown parameter(s) {unknown} in {source}; valid parameters: {valid}")
    reserved = sorted(set(params) & set(RESERVED))
    if reserved:
        raise ValueError(f"parameter(s) {reserved} in {source} are set by the runner and cannot be given")


def resolve(
    declared: dict[str, Parameter], profile_values: dict[str, Any], overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(injected, merged): what papermill injects (profile + overrides) and every parameter's final value.

    Non-literal defaults (e.g. `model = DEFAULT_MODEL`) appear in `merged` as their source text until
    the notebook reports the evaluated value through `runs.start(..., params=...)`.
    """
    injected = {**profile_values, **overrides}
    merged = {name: p.default for name, p in declared.items() if name not in RESERVED}
    merged.update(injected)
    return injected, merged
