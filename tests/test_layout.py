"""The library's shape, measured from its code: the import graph of lib/decodelab (every import, the ones
inside functions too), its layers, module sizes, and where the transformer's forward is called.

    core                                   imports no other decodelab package
    common, workloads                      import core (and each other, without a circle)
    question packages (QUESTION_PACKAGES)  import core / common / workloads, and another question package
                                           only along QUESTION_EDGES (each with its reason)
    suite                                  imports no question package (it names them in its registry);
                                           nothing outside suite imports suite

`python tests/test_layout.py [LIB_DIR]` prints the numbers (modules, edges, circles, upward imports).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "lib" / "decodelab"
FOUNDATION = ("core", "common", "workloads")
QUESTION_PACKAGES = ("quickstart", "speculation", "sampling_study", "mtp", "constrained", "consistency", "reuse")
# (importer, imported) between question packages, measured; anything new fails until it is argued here.
QUESTION_EDGES = {
    ("mtp", "speculation"): "MTP heads draft for speculative decoding: the Drafter protocol and the verify loop",
    ("reuse", "speculation"): "reuse drafters are speculation Drafters (DrafterBase, NGramDrafter) run by its decode",
}
MAX_LINES = 400


# ---------------------------------------------------------------- the graph
def module_name(path: Path, lib: Path = LIB) -> str:
    """lib/decodelab/core/engine.py -> "decodelab.core.engine"; a package's __init__ -> the package."""
    parts = ("decodelab", *path.relative_to(lib).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(lib: Path = LIB) -> dict[str, Path]:
    return {module_name(path, lib): path for path in sorted(lib.rglob("*.py"))}


def imported(node: ast.AST, importer: str, is_package: bool, known: set[str]) -> list[str]:
    """The decodelab modules one import statement names (a `from package import module` names the module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = importer.split(".") if is_package else importer.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    else:
        return []
    found = []
    for name in names:
        while name and name not in known:  # `import decodelab.core.engine.x` -> the longest known prefix
            name = name.rpartition(".")[0]
        if name and name.startswith("decodelab"):
            found.append(name)
    return found


def import_graph(lib: Path = LIB) -> dict[str, set[str]]:
    """Module -> the decodelab modules it imports anywhere in its file (self-imports left out)."""
    mods = modules(lib)
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        graph[name] = {dep for node in ast.walk(tree) for dep in imported(node, name, is_package, known)} - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def package_of(module: str) -> str:
    """ "decodelab.core.engine" -> "core"; the top-level modules (decodelab, decodelab.__main__) -> "" ."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] != "__main__") else ""


def allowed(importer: str, dep: str) -> bool:
    """The layering rule for one edge between packages (see the module docstring)."""
    if importer == dep or importer == "":  # inside a package; decodelab/__main__.py runs the suite's cli
        return True
    if dep == "suite":
        return False
    if importer == "core":
        return False
    if importer in ("common", "workloads"):
        return dep in FOUNDATION
    if importer in QUESTION_PACKAGES:
        return dep in FOUNDATION or (importer, dep) in QUESTION_EDGES
    if importer == "suite":
        return dep not in QUESTION_PACKAGES
    return False  # a package the rule does not know yet: give it a place above


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() for d in deps if not allowed(package_of(m), package_of(d)))


def long_modules(lib: Path = LIB) -> list[tuple[str, int]]:
    sizes = ((name, len(path.read_text(encoding="utf-8").splitlines())) for name, path in modules(lib).items())
    return sorted((name, n) for name, n in sizes if n > MAX_LINES)


def forward_calls(lib: Path = LIB) -> list[str]:
    """`x.forward(...)` calls (or `Transformer.forward` references) outside core: the token loop owns them."""
    found = []
    for name, path in modules(lib).items():
        if package_of(name) == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "forward":
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


# ---------------------------------------------------------------- the checks
GRAPH = import_graph()


def test_every_module_parses_and_the_graph_is_not_empty():
    assert len(GRAPH) > 20 and sum(map(len, GRAPH.values())) > 20


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_packages_import_only_downwards():
    assert upward_imports(GRAPH) == []


def test_no_package_circle_between_common_and_workloads():
    edges = {(package_of(m), package_of(d)) for m, deps in GRAPH.items() for d in deps}
    assert not {("common", "workloads"), ("workloads", "common")} <= edges


def test_every_allowed_question_edge_is_still_used():
    edges = {(package_of(m), package_of(d)) for m, deps in GRAPH.items() for d in deps}
    assert set(QUESTION_EDGES) <= edges, "remove an allow-list entry no import needs any more"


def test_suite_imports_no_question_package_and_nothing_imports_suite():
    for module, deps in GRAPH.items():
        importer = package_of(module)
        for dep in deps:
            if importer == "suite":
                assert package_of(dep) not in QUESTION_PACKAGES, f"{module} imports {dep}"
            elif package_of(dep) == "suite":
                assert importer == "", f"{module} imports {dep}: research code never imports the suite"


def test_no_library_module_over_400_lines():
    assert long_modules() == [], f"split these modules (one concern each, <= {MAX_LINES} lines)"


def test_research_code_never_calls_the_transformers_forward_outside_core():
    assert forward_calls() == [], "decode through decodelab.core.engine (prefill / extend / decode_step / verify_step)"


@pytest.mark.parametrize("package", QUESTION_PACKAGES)
def test_question_packages_are_packages_when_present(package):
    path = LIB / package
    if not path.exists():
        pytest.skip(f"{package} does not exist (yet)")
    assert (path / "__init__.py").is_file()


def summary(lib: Path) -> dict:
    graph = import_graph(lib)
    return {
        "modules": len(graph), "import edges": sum(map(len, graph.values())), "circles": circles(graph),
        "upward imports": upward_imports(graph), "modules over 400 lines": long_modules(lib),
        "forward calls outside core": forward_calls(lib),
    }


if __name__ == "__main__":
    for key, value in summary(Path(sys.argv[1]) if len(sys.argv) > 1 else LIB).items():
        print(f"{key}: {len(value) if isinstance(value, list) else value}")
        if isinstance(value, list):
            for item in value:
                print(f"    {item}")
