"""Every name a notebook takes from decodelab exists: `from decodelab.x import y` resolves, and each
`module.attribute` used on an imported decodelab module is defined (a moved or renamed function fails here,
in a second, instead of minutes into a smoke run)."""
import ast
import importlib
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def code_of(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def decodelab_names(tree: ast.AST) -> tuple[dict[str, object], list[str]]:
    """-> (local name -> imported decodelab object, problems with the imports themselves)."""
    bound, problems = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decodelab"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                try:
                    bound[alias.asname or alias.name] = getattr(module, alias.name)
                except AttributeError:
                    try:
                        bound[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        problems.append(f"from {node.module} import {alias.name}")
    return bound, problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_decodelab_name_a_notebook_uses_exists(path):
    tree = ast.parse(code_of(path))
    bound, problems = decodelab_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            target = bound[node.value.id]
            if getattr(target, "__name__", "").startswith("decodelab") and not hasattr(target, node.attr):
                problems.append(f"{node.value.id}.{node.attr} (line {node.lineno} of the notebook's code)")
    assert not problems, f"{path.name} uses names decodelab does not define: {problems}"
