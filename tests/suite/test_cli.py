"""`decodelab` command line: -p parsing, clear errors before execution, failed runs, delegation."""
from __future__ import annotations

import importlib
import json
import sys
import types

import pytest

from decodelab.suite import cli, profiles, registry, runner

PARAMETERS = """\
x = 1  # an integer
fail = False  # raise after start()
seed = 0  # random seed
output_dir = None  # set by the runner
"""
BODY = """\
run = runs.start("tiny", output_dir, params=dict(x=x, seed=seed))
run.log_metrics(x=x)
if fail:
    raise ZeroDivisionError(f"planted failure x={x}")
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A registered throwaway notebook `tiny` with smoke and cpu profiles; returns the results root."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from decodelab.suite import runs"),
        nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(BODY),
    ]
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    notebooks = tmp_path / "notebooks"
    (notebooks / "params" / "tiny").mkdir(parents=True)
    nbformat.write(nb, notebooks / "tiny.ipynb")
    (notebooks / "params" / "tiny" / "smoke.yaml").write_text("x: 2\n")
    (notebooks / "params" / "tiny" / "cpu.yaml").write_text("x: 3\n")
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "results"))
    monkeypatch.setitem(registry.NOTEBOOKS, "tiny", registry.Notebook("tiny", "tiny.ipynb", "tiny", "?", ()))
    return tmp_path / "results"


@pytest.mark.parametrize(
    "item, expected",
    [
        ("batch_sizes=[1,3]", ("batch_sizes", [1, 3])),
        ("max_new_tokens=64", ("max_new_tokens", 64)),
        ("top_p=0.9", ("top_p", 0.9)),
        ("model=Qwen/Qwen2.5-0.5B-Instruct", ("model", "Qwen/Qwen2.5-0.5B-Instruct")),
        ("greedy=true", ("greedy", True)),
        ("draft=null", ("draft", None)),
        ("prompt=a=b", ("prompt", "a=b")),
        ("cfg={k: 2}", ("cfg", {"k": 2})),
    ],
)
def test_p_values_parse_as_yaml(item, expected):
    assert profiles.parse_override(item) == expected


@pytest.mark.parametrize("item", ["batch_sizes", "=3", "1x=2", "batch_sizes=[1,3", "a={b"])
def test_malformed_p_is_named_in_the_error(item, tiny, capsys):
    assert cli.main(["run", "tiny", "--profile", "smoke", "-p", item]) == 2
    err = capsys.readouterr().err
    assert repr(item) in err and "malformed" in err
    assert not tiny.exists()


def test_unknown_parameter_exits_before_running_and_lists_valid(tiny, capsys):
    assert cli.main(["run", "tiny", "--profile", "smoke", "-p", "batchsize=4"]) == 2
    err = capsys.readouterr().err
    assert "['batchsize']" in err and "valid parameters: ['x', 'fail', 'seed']" in err
    assert not tiny.exists()


def test_unknown_profile_and_notebook_list_allowed(tiny, capsys):
    assert cli.main(["run", "tiny", "--profile", "fast"]) == 2
    assert "['smoke', 'cpu', 'gpu']" in capsys.readouterr().err
    assert cli.main(["run", "tinny", "--profile", "smoke"]) == 2
    err = capsys.readouterr().err
    assert "notebook='tinny'" in err and "'tiny'" in err


def test_list_shows_profiles_and_parameters_with_defaults(tiny, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "tiny  (tiny.ipynb)  profiles: smoke, cpu" in out
    assert "x          = 1  # an integer" in out


@pytest.mark.slow
def test_failed_run_keeps_files_exits_nonzero_and_prints_cell_error(tiny, capsys):
    (tiny / "tiny").mkdir(parents=True)
    (tiny / "tiny" / "earlier").mkdir()
    (tiny / "tiny" / "earlier" / "metrics.json").write_text('{"kept": true}')
    code = cli.main(["run", "tiny", "--profile", "smoke", "-p", "fail=true", "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err and "planted failure x=2" in err
    [run_dir] = [d for d in (tiny / "tiny").iterdir() if d.name != "earlier"]
    env = json.loads((run_dir / "env.json").read_text())
    assert env["status"] == "failed" and env["error"]["ename"] == "ZeroDivisionError"
    assert json.loads((run_dir / "params.json").read_text())["fail"] is True
    assert json.loads((run_dir / "metrics.json").read_text()) == {"x": 2}  # written before the failure
    assert "planted failure" in (run_dir / "notebook.ipynb").read_text()
    assert (tiny / "tiny" / "earlier" / "metrics.json").read_text() == '{"kept": true}'  # nothing lost


def test_bench_report_findings_delegate_with_their_arguments(monkeypatch):
    calls = []
    fakes = {name: types.SimpleNamespace(main=lambda argv, name=name: calls.append((name, argv)) or 0)
             for name in ("bench_cli", "report", "findings")}
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, f"decodelab.suite.{name}", module)
        monkeypatch.setattr(importlib.import_module("decodelab.suite"), name, module, raising=False)
    assert cli.main(["bench", "decode", "--batch-sizes", "1", "4"]) == 0
    assert cli.main(["report", "--hide-code"]) == 0
    assert cli.main(["findings"]) == 0
    assert calls == [("bench_cli", ["decode", "--batch-sizes", "1", "4"]), ("report", ["--hide-code"]),
                     ("findings", [])]


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "list", "prepare", "bench", "report", "findings"):
        assert command in out


def test_prepare_prints_where_the_weights_are(monkeypatch, capsys, tmp_path):
    from decodelab.core import models

    monkeypatch.setattr(models, "embedded_model_dir", lambda name=models.DEFAULT_MODEL, **_: tmp_path / name)
    assert cli.main(["prepare"]) == 0
    assert str(tmp_path / models.DEFAULT_MODEL) in capsys.readouterr().out


def test_interrupted_run_prints_signal_cell_and_folder_and_exits_128_plus_signal(tiny, monkeypatch, capsys):
    import signal

    cell = {"index": 11, "of": 25, "execution_count": 9, "first_line": "study = run_study(...)"}

    def interrupted(*args, **kwargs):
        raise runner.RunInterrupted(signal.SIGTERM, tiny / "tiny" / "run-1", cell)

    monkeypatch.setattr(runner, "execute", interrupted)
    assert cli.main(["run", "tiny", "--profile", "smoke"]) == 143
    assert capsys.readouterr().err == (
        "decodelab run: interrupted by SIGTERM in cell 11 of 25 [9] `study = run_study(...)`; "
        f"the run directory keeps what it wrote: {tiny / 'tiny' / 'run-1'}\n"
    )
    assert runner.RunInterrupted(signal.SIGINT).exit_code == 130


def test_list_runs_without_results_says_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "empty"))
    assert cli.main(["list", "--runs"]) == 0
    assert capsys.readouterr().out == f"runs in {tmp_path / 'empty'}\n  (none)\n"
