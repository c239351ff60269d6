"""Faults: no run lies about how it ended, and a bad results folder is refused before anything runs.

SIGTERM / Ctrl-C mark a run "interrupted" (last cell, time), keep its files and exit 143 / 130; a
kernel that dies is "failed" with kind "kernel died" and its cell; a run whose process is gone reads
"interrupted (process gone)"; two runs never share a folder; every run is tagged with the load.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime

import pytest

from decodelab.suite import cli, provenance, records, runner

PARAMETERS = """\
seconds = 60  # how long the slow cell sleeps [allowed: x >= 0]
marker = ""  # file the slow cell creates when it starts
output_dir = None  # set by the runner
"""
SLOW_CELL = "import time\nopen(marker, 'w').close()\ntime.sleep(seconds)"
DIE_CELL = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
SLOW_INDEX = 4  # import, parameters, injected-parameters, start, slow cell, end


def write_notebook(root, cell=SLOW_CELL):
    """<root>/notebooks/00_quickstart.ipynb: a model-free notebook whose 5th cell sleeps (or dies)."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from decodelab.suite import runs"),
        nbformat.v4.new_code_cell(PARAMETERS, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("run = runs.start('quickstart', output_dir)\nrun.log_metrics(started=True)"),
        nbformat.v4.new_code_cell(cell),
        nbformat.v4.new_code_cell("run.log_metrics(finished=True)"),
    ]
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    notebooks = root / "notebooks"
    (notebooks / "params" / "quickstart").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, notebooks / "00_quickstart.ipynb")
    (notebooks / "params" / "quickstart" / "smoke.yaml").write_text("seconds: 60\n")
    return notebooks


def only_run(results):
    [run_dir] = list((results / "quickstart").iterdir())
    return run_dir, json.loads((run_dir / "env.json").read_text())


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------- SIGTERM and Ctrl-C
def interrupt_a_run(tmp_path, signum):
    """`python -m decodelab run quickstart` in a subprocess, signalled once its slow cell has started."""
    notebooks = write_notebook(tmp_path)
    results, marker = tmp_path / "results", tmp_path / "slow-cell-started"
    env = {**os.environ, "DECODELAB_NOTEBOOKS": str(notebooks), "DECODELAB_RESULTS": str(results)}
    process = subprocess.Popen(
        [sys.executable, "-m", "decodelab", "run", "quickstart", "--profile", "smoke", "-p", f"marker={marker}",
         "--no-progress"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert wait_until(marker.exists), "the slow cell never started"
        process.send_signal(signum)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err, results


def assert_interrupted(returncode, err, results, signum, code):
    assert returncode == code, err
    run_dir, env = only_run(results)
    name = signal.Signals(signum).name
    assert env["status"] == "interrupted" and records.effective_status(env) == "interrupted"
    assert env["interrupted"]["signal"] == name and env["interrupted"]["time"] and env["finished"]
    assert env["last_cell"]["index"] == SLOW_INDEX and env["last_cell"]["first_line"] == "import time"
    # every file kept: the metrics the earlier cell wrote, the params, the notebook up to the slow cell
    assert json.loads((run_dir / "metrics.json").read_text()) == {"started": True}
    assert json.loads((run_dir / "params.json").read_text())["seconds"] == 60
    cells = json.loads((run_dir / "notebook.ipynb").read_text())["cells"]
    assert cells[SLOW_INDEX]["metadata"]["papermill"]["start_time"]
    assert f"interrupted by {name} in cell {SLOW_INDEX} of 6" in err and "Traceback" not in err
    # the kernel does not outlive the run
    kernel = env["kernel"]["pid"]
    assert wait_until(lambda: not provenance.process_alive(kernel), timeout=5), f"kernel {kernel} still running"
    return env


@pytest.mark.slow
def test_sigterm_marks_run_interrupted_and_exits_143(tmp_path):
    assert_interrupted(*interrupt_a_run(tmp_path, signal.SIGTERM), signal.SIGTERM, 143)


@pytest.mark.slow
def test_ctrl_c_marks_run_interrupted_and_exits_130(tmp_path):
    assert_interrupted(*interrupt_a_run(tmp_path, signal.SIGINT), signal.SIGINT, 130)


@pytest.mark.slow
def test_dead_kernel_is_reported_as_kernel_died_with_its_cell(tmp_path, monkeypatch, capsys):
    notebooks = write_notebook(tmp_path, DIE_CELL)
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "results"))
    assert cli.main(["run", "quickstart", "--profile", "smoke", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"the kernel died in cell {SLOW_INDEX} of 6" in err and "out of memory" in err
    run_dir, env = only_run(tmp_path / "results")
    assert env["status"] == "failed" and records.effective_status(env) == "failed"
    assert env["error"]["kind"] == "kernel died" and env["error"]["cell_index"] == SLOW_INDEX
    assert env["error"]["ename"] == "DeadKernelError"
    assert env["last_cell"]["first_line"] == "import os, signal"
    assert json.loads((run_dir / "metrics.json").read_text()) == {"started": True}


@pytest.mark.slow
def test_bad_input_raised_inside_a_notebook_prints_its_message_without_a_traceback(tmp_path, monkeypatch, capsys):
    cell = "raise ValueError('schemas=[\\'person\\'] are not in the schemas file; its schemas: [\\'answer\\']')"
    notebooks = write_notebook(tmp_path, cell)
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "results"))
    assert cli.main(["run", "quickstart", "--profile", "smoke", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: schemas=['person'] are not in the schemas file" in err
    assert "Traceback" not in err and "----> " not in err and "traceback in the executed notebook" in err
    run_dir, env = only_run(tmp_path / "results")
    assert env["status"] == "failed" and env["error"]["ename"] == "ValueError"


# ---------------------------------------------------------------- a run whose process is gone
def gone_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def running_env(pid, *, hostname=None, start_ticks=None):
    return {"status": "running", "runner": {"pid": pid, "hostname": hostname or socket.gethostname(),
                                            "start_ticks": start_ticks}}


def test_running_run_whose_process_is_gone_reads_interrupted():
    assert records.effective_status(running_env(gone_pid())) == "interrupted (process gone)"


def test_running_run_whose_process_lives_reads_running():
    me = os.getpid()
    assert records.effective_status(running_env(me, start_ticks=provenance.process_start_ticks(me))) == "running"


def test_reused_pid_counts_as_gone():
    me = os.getpid()
    ticks = provenance.process_start_ticks(me)
    if ticks is None:
        pytest.skip("no /proc/<pid>/stat here")
    assert records.effective_status(running_env(me, start_ticks=ticks - 1)) == "interrupted (process gone)"


def test_run_on_another_host_or_without_runner_stays_running():
    assert records.effective_status(running_env(gone_pid(), hostname="elsewhere.example")) == "running"
    assert records.effective_status({"status": "running"}) == "running"


@pytest.mark.parametrize("status", ["ok", "failed", "interrupted", "interactive"])
def test_finished_statuses_are_reported_as_written(status):
    assert records.effective_status({**running_env(gone_pid()), "status": status}) == status
    assert records.effective_status({}) == "unknown"


def test_list_runs_shows_each_run_with_its_effective_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path))
    envs = {
        "20260101-000000-aaaaaa": {"status": "ok", "profile": "smoke", "started": "2026-01-01T00:00:00", "wall_s": 3.2,
                                   "load": {"cores": 2, "peak_1min": 5.5, "loaded": True}},
        "20260101-000001-bbbbbb": {**running_env(gone_pid()), "profile": "cpu", "started": "2026-01-01T00:00:01"},
        "20260101-000002-cccccc": {"status": "interrupted", "profile": "smoke", "started": "2026-01-01T00:00:02",
                                   "interrupted": {"signal": "SIGTERM"},
                                   "last_cell": {"index": 11, "of": 25, "execution_count": None,
                                                 "first_line": "x = 1"}},
    }
    for run_id, env in envs.items():
        (tmp_path / "consistency" / run_id).mkdir(parents=True)
        records.write_json(tmp_path / "consistency" / run_id / "env.json", env)
    assert cli.main(["list", "--runs", "consistency"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"runs in {tmp_path}", "consistency:"]
    ok, gone, stopped = lines[2:]
    assert ok.split()[:3] == ["20260101-000000-aaaaaa", "ok", "smoke"]
    assert "load peak 5.5 on 2 cores (loaded: timings not comparable)" in ok
    assert gone.split()[:4] == ["20260101-000001-bbbbbb", "interrupted", "(process", "gone)"]
    assert stopped.split()[:2] == ["20260101-000002-cccccc", "interrupted"]
    assert stopped.endswith("by SIGTERM in cell 11 of 25 `x = 1`")


def test_list_runs_of_an_unknown_name_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path))
    assert cli.main(["list", "--runs", "nope"]) == 2
    assert "notebook='nope' has no runs" in capsys.readouterr().err


# ---------------------------------------------------------------- run folders
def test_two_runs_drawing_the_same_id_get_different_folders(tmp_path, monkeypatch):
    class FrozenClock(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 1, 12, 0, 0, tzinfo=tz)

    tails = iter(["aaaaaa", "aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(records, "datetime", FrozenClock)
    monkeypatch.setattr(records.secrets, "token_hex", lambda n: next(tails))
    first = records.new_run_dir("tiny", root=tmp_path)
    (first / "metrics.json").write_text('{"first": true}')
    second = records.new_run_dir("tiny", root=tmp_path)
    assert first.name == "20260101-120000-aaaaaa" and second.name == "20260101-120000-bbbbbb"
    assert (first / "metrics.json").read_text() == '{"first": true}' and list(second.iterdir()) == []


# ---------------------------------------------------------------- the results folder
@pytest.fixture
def notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(write_notebook(tmp_path)))
    return tmp_path


def test_results_setting_pointing_at_a_file_fails_before_anything_runs(notebook, monkeypatch, capsys):
    target = notebook / "results.txt"
    target.write_text("keep me")
    monkeypatch.setenv("DECODELAB_RESULTS", str(target))
    assert cli.main(["run", "quickstart", "--profile", "smoke"]) == 2
    assert capsys.readouterr().err == (
        f"decodelab run: error: DECODELAB_RESULTS={str(target)!r} is a file, not a folder; "
        "point DECODELAB_RESULTS at a folder you can write (it is made if missing)\n"
    )
    assert target.read_text() == "keep me"


def test_results_setting_under_a_file_fails_before_anything_runs(notebook, monkeypatch, capsys):
    target = notebook / "results.txt"
    target.write_text("keep me")
    monkeypatch.setenv("DECODELAB_RESULTS", str(target / "runs"))
    assert cli.main(["run", "quickstart", "--profile", "smoke"]) == 2
    err = capsys.readouterr().err
    assert f"DECODELAB_RESULTS={str(target / 'runs')!r} lies under {str(target)!r}, which is a file" in err
    assert target.read_text() == "keep me"


def test_unwritable_results_folder_fails_before_anything_runs(notebook, monkeypatch):
    folder = notebook / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        probe = folder / "probe"
        try:
            probe.touch()
        except PermissionError:
            pass
        else:
            probe.unlink()
            pytest.skip("this user (root) can write a read-only folder")
        monkeypatch.setenv("DECODELAB_RESULTS", str(folder))
        with pytest.raises(ValueError, match=r"DECODELAB_RESULTS=.* is not writable \(Permission denied\)"):
            runner.execute("quickstart", "smoke", log=lambda *_: None)
    finally:
        folder.chmod(0o700)


def test_results_folder_that_refuses_writes_is_named(notebook, monkeypatch):
    """The same check where the filesystem says no even to root (simulated: read-only mount)."""
    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setenv("DECODELAB_RESULTS", str(notebook / "results"))
    monkeypatch.setattr(records.tempfile, "mkstemp", refuse)
    with pytest.raises(ValueError) as error:
        runner.execute("quickstart", "smoke", log=lambda *_: None)
    assert str(error.value) == (
        f"DECODELAB_RESULTS={str(notebook / 'results')!r} is not writable (Read-only file system); "
        "point DECODELAB_RESULTS at a folder you can write (it is made if missing)"
    )
    assert list((notebook / "results").iterdir()) == []  # no run folder


def test_notebook_results_folder_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "quickstart").write_text("not a folder")
    with pytest.raises(ValueError, match=r"cannot make the folder .*quickstart' for runs of 'quickstart'"):
        records.new_run_dir("quickstart", root=tmp_path)


# ---------------------------------------------------------------- load tags
def test_load_sampler_records_before_after_and_peak(monkeypatch):
    readings = iter([[1.0, 1.0, 1.0], [3.5, 1.2, 1.0], [2.5, 1.3, 1.0]] + [[0.5, 0.5, 0.5]] * 1000)
    monkeypatch.setattr(provenance, "load_now", lambda: next(readings))
    monkeypatch.setattr(provenance, "load_cores", lambda: 2)
    sampler = provenance.LoadSampler(every_s=0.01).start()
    assert wait_until(lambda: sampler.samples >= 3, timeout=5)
    load = sampler.stop()
    assert load["cores"] == 2 and load["before"] == [1.0, 1.0, 1.0] and load["after"] == [0.5, 0.5, 0.5]
    assert load["peak_1min"] == 3.5 and load["loaded"] is True
    assert provenance.is_loaded({"load": load}) is True


def test_the_sampler_probes_memory_reads_at_start_and_stop_and_the_answer_shows_them(monkeypatch):
    from decodelab.suite import answers

    rates = iter([21.5, 14.25])
    monkeypatch.setattr(provenance, "memory_read_GBps", lambda: next(rates))
    monkeypatch.setattr(provenance, "load_now", lambda: [0.5, 0.4, 0.3])
    load = provenance.LoadSampler(every_s=10).start().stop()
    assert load["memory_read_GBps"] == [21.5, 14.25]
    assert answers.load_state({"load": load}) == (
        answers.QUIET, "quiet (peak load 0.50 on %d cores; one core read memory at 21.5 then 14.2 GB/s)"
        % provenance.load_cores())
    assert "memory" not in answers.load_state({"load": {**load, "memory_read_GBps": [21.5, None]}})[1]


def test_the_memory_probe_reads_its_bytes_at_a_positive_rate():
    rate = provenance.memory_read_GBps(nbytes=8 << 20, passes=2)
    assert isinstance(rate, float) and 0 < rate < 10_000


def test_quiet_run_is_not_loaded(monkeypatch):
    monkeypatch.setattr(provenance, "load_now", lambda: [0.5, 0.4, 0.3])
    monkeypatch.setattr(provenance, "load_cores", lambda: 2)
    load = provenance.LoadSampler(every_s=10).start().stop()
    assert load["peak_1min"] == 0.5 and load["loaded"] is False
    assert provenance.is_loaded({"load": load}) is False


def test_a_run_filling_its_own_cores_is_not_loaded_but_competing_work_is(monkeypatch):
    monkeypatch.setattr(provenance, "load_cores", lambda: 2)
    # torch's two threads alone hold the 1-minute load near 2 (plus the kernel's and runner's own moments)
    monkeypatch.setattr(provenance, "load_now", lambda: [2.4, 2.0, 2.0])
    assert provenance.LoadSampler(every_s=10).start().stop()["loaded"] is False
    monkeypatch.setattr(provenance, "load_now", lambda: [2.6, 2.0, 2.0])
    assert provenance.LoadSampler(every_s=10).start().stop()["loaded"] is True


def test_run_without_a_load_record_is_not_called_loaded():
    assert provenance.is_loaded({}) is False and provenance.is_loaded({"load": None}) is False


def test_load_now_reads_three_averages():
    load = provenance.load_now()
    assert load is None or (len(load) == 3 and all(v >= 0 for v in load))


def test_the_recorded_loads_decide_loaded_not_the_stored_flag():
    quiet_numbers = {"cores": 2, "before": [0.9, 1.0, 1.0], "peak_1min": 2.2, "after": [2.0, 1.8, 1.5], "loaded": True}
    assert provenance.is_loaded({"load": quiet_numbers}) is False
    assert provenance.is_loaded({"load": {**quiet_numbers, "after": [2.7, 2.0, 1.8], "loaded": False}}) is True
    assert provenance.is_loaded({"load": {"loaded": True}}) is True  # only the flag: it speaks
