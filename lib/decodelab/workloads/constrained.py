"""Notebook 04's inputs from data/: the JSON-schema suite (experiments 3-5) and the finite-language tasks
(experiments 1-2), each checked before any model work, with errors that name the file and what it holds."""
from __future__ import annotations

import json
from pathlib import Path

from decodelab.workloads.paths import data_file, resolve_path


def default_schemas_file() -> Path:
    """The shipped schema suite: data/schemas.json."""
    return data_file("schemas.json")


def default_tasks_file() -> Path:
    """The shipped finite-language tasks: data/constrained_tasks.json."""
    return data_file("constrained_tasks.json")


def schema_problem(schema, name: str = "") -> str | None:
    """Why `schema` is not a well-formed JSON schema (a message naming it), or None when it is one.

    A string is read as the schema's JSON text."""
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            return f"schema={schema[:80]!r} is not valid JSON: {error}"
    if not isinstance(schema, (dict, bool)):
        return f"schema={schema!r} must be a JSON object (dict) or boolean"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        return f"schema {name or ''} is malformed: {error.message}"
    return None


def load_schemas(path=None, names: list[str] | None = None) -> list[dict]:
    """Entries {name, prompt, fixed_keys, schema} from a JSON list; bare schemas get a name and a prompt.

    names: the schemas to keep, in that order; None = every schema of the file (a user's schemas_file is
    used whole unless names are given). Every error names the value and what the file holds, and comes
    before any model work: a missing file, an empty list, an unknown or duplicated name, a malformed schema.
    """
    path = resolve_path(path, name="schemas_file") if path else default_schemas_file()
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"schemas_file={str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"schemas_file={str(path)!r} must hold a non-empty JSON list of schemas")
    entries = []
    for index, item in enumerate(raw):
        if isinstance(item, dict) and "schema" in item:
            entry = dict(item)
        else:
            entry = {"name": (item.get("title") if isinstance(item, dict) else None) or f"schema_{index}",
                     "schema": item}
        problem = schema_problem(entry["schema"], str(entry["name"]))
        if problem:
            raise ValueError(f"schemas_file={str(path)!r}, entry {index} ({entry['name']!r}): {problem}")
        entry.setdefault("prompt",
                         "Reply with a JSON object that matches this JSON schema: " + json.dumps(entry["schema"]))
        entry.setdefault("fixed_keys", has_fixed_keys(entry["schema"]))
        entries.append(entry)
    by_name = {e["name"]: e for e in entries}
    if len(by_name) != len(entries):
        repeated = sorted({e["name"] for e in entries if sum(f["name"] == e["name"] for f in entries) > 1})
        raise ValueError(f"schemas_file={str(path)!r} names several schemas {repeated!r}; names must be unique")
    if names is None:
        return entries
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"schemas={names!r} must be None (every schema of the file) or a non-empty list of "
                         f"schema names from {str(path)!r}: {list(by_name)}")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"schemas={unknown!r} are not in schemas_file={str(path)!r}; its schemas: {list(by_name)}")
    return [by_name[n] for n in names]


def has_fixed_keys(schema) -> bool:
    """All properties required and no others allowed (recursively for nested objects): the schemas whose
    keys the grammar forces, where jump-forward has something to skip."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return True
    props = schema.get("properties", {})
    return (set(schema.get("required", [])) == set(props) and schema.get("additionalProperties") is False
            and all(has_fixed_keys(p) for p in props.values()))


def load_tasks(path=None, names: list[str] | None = None) -> list[dict]:
    """Task definitions {name, category, question, strings} from `path` (default: the shipped file)."""
    path = resolve_path(path, name="tasks_file") if path else default_tasks_file()
    try:
        tasks = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"tasks_file={str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) and {"name", "strings"} <= set(t)
                                                             for t in tasks):
        raise ValueError(f"tasks_file={str(path)!r} must hold a non-empty JSON list of {{name, question, strings}}")
    if names is None:
        return tasks
    by_name = {t["name"]: t for t in tasks}
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError(f"tasks={names!r} must be a non-empty list of task names from {str(path)!r}: {list(by_name)}")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"tasks={unknown!r} are not in tasks_file={str(path)!r}; its tasks: {list(by_name)}")
    return [by_name[n] for n in names]
