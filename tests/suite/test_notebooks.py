"""Every notebook: committed clean with one parameters cell and valid profiles; runs end to end on smoke."""
from __future__ import annotations

import json

import pytest

from decodelab.common import goals
from decodelab.suite import profiles, records, registry

NOTEBOOKS_DIR = records.notebooks_dir()
PRESENT = [name for name, file in registry.NOTEBOOKS.items() if (NOTEBOOKS_DIR / file.file).exists()]
COMMITTED = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
ALLOWED_NOTEBOOK_METADATA = {"kernelspec", "language_info"}
ALLOWED_CELL_METADATA = {"tags"}


def load(path):
    return json.loads(path.read_text(encoding="utf-8"))


def test_quickstart_is_registered_and_present():
    assert "quickstart" in PRESENT


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_notebook_is_registered(path):
    assert path.name in [nb.file for nb in registry.NOTEBOOKS.values()], f"{path.name} has no registry record"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs_or_execution_counts(path):
    for index, cell in enumerate(load(path)["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {index} has outputs"
            assert cell.get("execution_count") is None, f"{path.name} cell {index} has an execution count"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_notebook_has_no_editor_metadata(path):
    nb = load(path)
    assert set(nb["metadata"]) <= ALLOWED_NOTEBOOK_METADATA, sorted(set(nb["metadata"]) - ALLOWED_NOTEBOOK_METADATA)
    for index, cell in enumerate(nb["cells"]):
        extra = set(cell.get("metadata", {})) - ALLOWED_CELL_METADATA
        assert not extra, f"{path.name} cell {index} carries editor metadata {sorted(extra)}"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_one_parameters_cell_with_output_dir_and_seed_commented(path):
    nb = load(path)
    tagged = [i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged parameters"
    assert nb["cells"][tagged[0]]["cell_type"] == "code"
    declared = profiles.notebook_parameters(path)
    assert {"output_dir", "seed"} <= set(declared)
    assert declared["output_dir"].source == "None"
    missing_help = [name for name, p in declared.items() if not p.help]
    assert not missing_help, f"{path.name}: parameters without a comment: {missing_help}"


@pytest.mark.parametrize("name", PRESENT)
@pytest.mark.parametrize("profile", profiles.PROFILES)
def test_profile_exists_and_names_only_declared_parameters(name, profile):
    values = profiles.load_profile(records.params_dir(name), profile)
    declared = records.parameters(name)
    profiles.validate(values, declared, source=f"{name}/{profile}.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESENT)
def test_smoke_run_writes_the_results_contract(name, smoke_runs):
    run_dir = smoke_runs(name)
    assert run_dir.parent == smoke_runs.root / name

    params = load(run_dir / "params.json")
    assert set(params) >= set(profiles.load_profile(records.params_dir(name), "smoke"))
    metrics = load(run_dir / "metrics.json")
    assert metrics, "metrics.json is empty"
    goal_rows = metrics.get("goals")
    assert isinstance(goal_rows, list) and goal_rows, "metrics.json has no goal rows (run.log_goals)"
    for row in goal_rows:
        assert {"name", "value", "target", "op", "met"} <= set(row), f"goal row without value/target/op/met: {row}"
        assert row["met"] in (True, False, None)
        judged = None if row["value"] is None else bool(goals.OPS[row["op"]](row["value"], row["target"]))
        assert row["met"] is judged, f"goal row whose met disagrees with value {row['op']} target: {row}"
    env = load(run_dir / "env.json")
    assert env["status"] == "ok" and env["profile"] == "smoke"
    assert env["packages"]["torch"] and "commit" in env["git"]

    figures = run_dir / "figures"
    pngs = sorted(figures.glob("*.png"))
    assert pngs, "no figure written"
    captions = load(figures / "captions.json")
    for png in pngs:
        assert png.with_suffix(".svg").exists(), f"{png.stem}: PNG without SVG"
        assert captions.get(png.stem), f"{png.stem}: no caption"

    executed = load(run_dir / "notebook.ipynb")
    code_cells = [c for c in executed["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code_cells), "a cell did not run"
    errors = [o for c in code_cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
