"""The runner and results contract: profiles, validation before execution, run directories, records."""
from __future__ import annotations

import json
import math
import os
import socket

import pytest

from decodelab.suite import profiles, provenance, records, registry, runner, runs

PARAMETERS = """\
x = 1  # an integer, any value
names = ["a", "b"]  # list of strings
fail = False  # raise in the cell after start()
seed = 0  # random seed
output_dir = None  # set by the runner
"""
BODY = """\
run = runs.start("tiny", output_dir, params=dict(x=x, names=names, seed=seed))
run.log_metrics(x2=x * 2, names=names, seed=seed)
"""
FAIL = """\
if fail:
    raise RuntimeError(f"boom x={x}")
run.log_metrics(after=True)
"""


def write_tiny_notebook(root, *, profiles_yaml=None, imports="from decodelab.suite import runs",
                        parameters=PARAMETERS, body=BODY):
    """notebooks/tiny.ipynb with a parameters cell, and notebooks/params/tiny/<profile>.yaml."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        nbformat.v4.new_code_cell(imports),
        nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(body),
        nbformat.v4.new_code_cell(FAIL),
    ]
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    notebooks = root / "notebooks"
    (notebooks / "params" / "tiny").mkdir(parents=True)
    nbformat.write(nb, notebooks / "tiny.ipynb")
    for profile, text in (profiles_yaml or {"smoke": "x: 2\n", "cpu": "x: 3\nnames: [c]\n"}).items():
        (notebooks / "params" / "tiny" / f"{profile}.yaml").write_text(text)
    return notebooks


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A registered throwaway notebook `tiny` and an empty results root; returns the results root."""
    notebooks = write_tiny_notebook(tmp_path)
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "results"))
    monkeypatch.setitem(registry.NOTEBOOKS, "tiny", registry.Notebook("tiny", "tiny.ipynb", "tiny", "?", ()))
    return tmp_path / "results"


def test_parameters_cell_gives_defaults_and_help():
    declared = profiles.parse_parameters(PARAMETERS + 'model = DEFAULT_MODEL  # a constant\n')
    assert list(declared) == ["x", "names", "fail", "seed", "output_dir", "model"]
    assert declared["names"].default == ["a", "b"]
    assert declared["x"].help == "an integer, any value"
    assert declared["model"].default == "DEFAULT_MODEL" and not declared["model"].is_literal


def test_profile_overrides_defaults_and_p_overrides_profile(tiny):
    _, injected, merged = runner.prepare("tiny", "cpu", {"x": 7})
    assert injected == {"x": 7, "names": ["c"]}
    assert merged == {"x": 7, "names": ["c"], "fail": False, "seed": 0}


def test_empty_profile_is_empty_mapping(tmp_path):
    (tmp_path / "smoke.yaml").write_text("# nothing\n")
    assert profiles.load_profile(tmp_path, "smoke") == {}


def test_unknown_profile_lists_allowed(tiny):
    with pytest.raises(ValueError, match=r"profile='fast'.*'smoke', 'cpu', 'gpu'"):
        runner.prepare("tiny", "fast")


def test_missing_profile_file_lists_available(tiny):
    with pytest.raises(ValueError, match=r"profile='gpu'.*\['smoke', 'cpu'\]"):
        runner.prepare("tiny", "gpu")


def test_unknown_notebook_lists_registered(tiny):
    with pytest.raises(ValueError, match=r"notebook='nope'.*'quickstart'"):
        runner.execute("nope", "smoke")


def test_unknown_parameter_rejected_before_execution(tiny):
    with pytest.raises(ValueError, match=r"\['batch'\].*valid parameters: \['x', 'names', 'fail', 'seed'\]"):
        runner.execute("tiny", "smoke", {"batch": 4})
    assert not tiny.exists()  # nothing written, no kernel started


def test_unknown_parameter_in_profile_file_rejected(tiny, tmp_path):
    (tmp_path / "notebooks" / "params" / "tiny" / "smoke.yaml").write_text("typo: 1\n")
    with pytest.raises(ValueError, match=r"\['typo'\] in .*smoke.yaml"):
        runner.prepare("tiny", "smoke")


def test_output_dir_is_reserved_for_the_runner(tiny):
    with pytest.raises(ValueError, match="output_dir"):
        runner.prepare("tiny", "smoke", {"output_dir": "/tmp/x"})


def test_run_ids_never_repeat(tmp_path):
    dirs = {records.new_run_dir("tiny", root=tmp_path) for _ in range(200)}
    assert len(dirs) == 200 and all(d.is_dir() for d in dirs)


def test_metrics_merge_and_convert_numpy_torch_and_nan(tmp_path):
    import numpy as np
    import torch

    run = runs.start("tiny", tmp_path / "run", params={"seed": 0})
    run.log_metrics(a=np.float32(0.5), b=torch.tensor(3), c=float("nan"), rows=[{"v": np.int64(2)}])
    merged = run.log_metrics(a=1.0, d=torch.arange(3), e=np.array([1.0, math.inf]))
    on_disk = json.loads((run.dir / "metrics.json").read_text())
    assert on_disk == merged == {"a": 1.0, "b": 3, "c": None, "rows": [{"v": 2}], "d": [0, 1, 2], "e": [1.0, None]}


def test_metrics_reject_unrecordable_values(tmp_path):
    run = runs.start("tiny", tmp_path / "run")
    with pytest.raises(TypeError, match="object"):
        run.log_metrics(thing=object())


def test_save_figure_writes_png_svg_and_caption(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = runs.start("tiny", tmp_path / "run")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    run.save_figure(fig, "line", caption="a line")
    run.save_figure(ax, "line2", caption="the same line")
    plt.close(fig)
    figures = run.dir / "figures"
    assert (figures / "line.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (figures / "line.svg").read_text().lstrip().startswith("<?xml")
    assert json.loads((figures / "captions.json").read_text()) == {"line": "a line", "line2": "the same line"}


def test_save_table_writes_csv(tmp_path):
    import pandas as pd

    run = runs.start("tiny", tmp_path / "run")
    path = run.save_table(pd.DataFrame({"batch": [1, 4], "tokens_per_s": [10.5, 30.25]}), "throughput")
    assert path.read_text().splitlines() == ["batch,tokens_per_s", "1,10.5", "4,30.25"]
    run.save_table([{"a": 1}], "records")
    assert (run.dir / "tables" / "records.csv").read_text().splitlines() == ["a", "1"]


def test_interactive_start_makes_a_fresh_directory(tiny):
    first = runs.start("tiny", None, params={"x": 1})
    second = runs.start("tiny", None, params={"x": 1})
    assert first.dir != second.dir
    assert first.dir.parent == tiny / "tiny" and first.dir.name.startswith("interactive-")
    env = json.loads((first.dir / "env.json").read_text())
    assert env["status"] == "interactive" and "git" in env and "packages" in env


def test_start_records_every_declared_parameter_even_when_params_omits_some(tiny):
    kernel = {"x": 5, "names": ["k"], "fail": False, "seed": 3, "unrelated": 1}
    run = runs.start("tiny", None, params={"x": 6}, namespace=kernel)
    assert json.loads((run.dir / "params.json").read_text()) == {"x": 6, "names": ["k"], "fail": False, "seed": 3}
    bare = runs.start("tiny", None, namespace=kernel)  # no params=: the declared names, the kernel's values
    assert json.loads((bare.dir / "params.json").read_text()) == {"x": 5, "names": ["k"], "fail": False, "seed": 3}


def test_start_replaces_a_non_literal_default_with_the_kernels_value(tmp_path):
    """Under the runner params.json holds every declared name, a non-literal default as its source text."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records.write_json(run_dir / "params.json", {"model": "DEFAULT_MODEL", "seed": 0})
    runs.start("unregistered", run_dir, namespace={"model": "smollm2-135m", "seed": 0, "other": 2})
    assert json.loads((run_dir / "params.json").read_text()) == {"model": "smollm2-135m", "seed": 0}


def test_latest_run_picks_newest_with_status(tmp_path):
    for i, status in enumerate(["ok", "ok", "failed"]):
        d = tmp_path / "tiny" / f"run{i}"
        d.mkdir(parents=True)
        records.write_json(d / "env.json", {"status": status, "started": f"2026-01-0{i + 1}T00:00:00"})
    assert records.latest_run("tiny", root=tmp_path).name == "run1"
    assert records.latest_run("tiny", status="failed", root=tmp_path).name == "run2"
    assert records.latest_run("other", root=tmp_path) is None


@pytest.mark.slow
def test_execute_writes_params_metrics_env_and_notebook(tiny):
    run_dir = runner.execute("tiny", "smoke", {"names": ["z"]}, progress=False, log=lambda *_: None)
    assert run_dir.parent == tiny / "tiny"
    assert json.loads((run_dir / "params.json").read_text()) == {"x": 2, "names": ["z"], "fail": False, "seed": 0}
    assert json.loads((run_dir / "metrics.json").read_text()) == {"x2": 4, "names": ["z"], "seed": 0, "after": True}
    env = json.loads((run_dir / "env.json").read_text())
    assert env["status"] == "ok" and env["profile"] == "smoke" and env["wall_s"] > 0
    assert env["kernel"]["python_executable"]
    assert env["runner"]["pid"] == os.getpid() and env["runner"]["hostname"] == socket.gethostname()
    assert records.effective_status(env) == "ok"
    load = env["load"]
    assert set(load) >= {"cores", "before", "after", "peak_1min", "loaded"} and load["cores"] == os.cpu_count()
    assert load["peak_1min"] >= max(load["before"][0], load["after"][0])
    # the run's own threads fill the cores, so only load beyond cores + LOAD_MARGIN marks it loaded
    assert load["loaded"] is (load["peak_1min"] > load["cores"] + provenance.LOAD_MARGIN)
    assert provenance.is_loaded(env) is load["loaded"]
    executed = json.loads((run_dir / "notebook.ipynb").read_text())
    assert any("injected-parameters" in c["metadata"].get("tags", []) for c in executed["cells"])
    durations = {i: c["metadata"]["papermill"]["duration"] for i, c in enumerate(executed["cells"])
                 if c["metadata"].get("papermill", {}).get("duration") is not None}
    slowest = env["slowest_cells"]  # papermill's own per-cell durations, slowest first
    assert slowest and [c["seconds"] for c in slowest] == sorted((c["seconds"] for c in slowest), reverse=True)
    assert all(c["seconds"] == round(durations[c["index"]], 2) for c in slowest)
    assert len(slowest) == min(8, len(durations))
    # same parameters and seed -> same metrics, in a new directory
    again = runner.execute("tiny", "smoke", {"names": ["z"]}, progress=False, log=lambda *_: None)
    assert again != run_dir
    assert (again / "metrics.json").read_text() == (run_dir / "metrics.json").read_text()


@pytest.mark.slow
def test_params_json_holds_every_declared_parameter_without_params_in_the_notebook(tmp_path, monkeypatch):
    notebooks = write_tiny_notebook(
        tmp_path, imports="from decodelab.suite import runs\nfrom decodelab.core.models import DEFAULT_MODEL",
        parameters=PARAMETERS + "model = DEFAULT_MODEL  # a constant\n",
        body='run = runs.start("tiny", output_dir)\nrun.log_metrics(x=x)\n')
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(notebooks))
    monkeypatch.setitem(registry.NOTEBOOKS, "tiny", registry.Notebook("tiny", "tiny.ipynb", "tiny", "?", ()))
    run_dir = runner.execute("tiny", "smoke", {"seed": 4}, root=tmp_path / "results", progress=False,
                             log=lambda *_: None)
    assert json.loads((run_dir / "params.json").read_text()) == {
        "x": 2, "names": ["a", "b"], "fail": False, "seed": 4, "model": "smollm2-135m"}


def test_relative_path_overrides_resolve_from_the_callers_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    out = runner.absolute_paths({"schemas_file": "mine.json", "model": "mine.json", "tasks_file": "absent.json"})
    assert out["schemas_file"] == str((tmp_path / "mine.json").resolve())
    assert out["model"] == "mine.json" and out["tasks_file"] == "absent.json"


def test_log_env_merges_run_facts_into_env_json_and_keeps_the_rest(tmp_path):
    run = runs.start("quickstart", output_dir=tmp_path / "run", namespace={})
    before = json.loads((run.dir / "env.json").read_text())
    run.log_env(compile={"requested": True, "compiled": False, "reason": "no compiler"})
    facts = run.log_env(verify_widths={1: 1, 2: 4})
    env = json.loads((run.dir / "env.json").read_text())
    assert facts == env["run_facts"] == {"compile": {"requested": True, "compiled": False, "reason": "no compiler"},
                                         "verify_widths": {"1": 1, "2": 4}}
    assert {k: v for k, v in env.items() if k != "run_facts"} == before


def test_cell_seconds_ranks_cells_by_papermill_duration_and_reads_nothing_from_a_missing_notebook(tmp_path):
    cells = [{"cell_type": "code", "source": f"step_{i}()\n", "metadata": {"papermill": {"duration": d}}}
             for i, d in enumerate([0.5, 3.25, None, 1.0])]
    cells.append({"cell_type": "markdown", "source": "# notes", "metadata": {}})
    path = tmp_path / "notebook.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert records.cell_seconds(path) == [{"index": 1, "seconds": 3.25, "first_line": "step_1()"},
                                          {"index": 3, "seconds": 1.0, "first_line": "step_3()"},
                                          {"index": 0, "seconds": 0.5, "first_line": "step_0()"}]
    assert records.cell_seconds(path, top=1) == [{"index": 1, "seconds": 3.25, "first_line": "step_1()"}]
    assert records.cell_seconds(tmp_path / "missing.ipynb") == []
