"""The runner: execute a registered notebook with papermill into a new run directory, and mark how it
ended (ok, failed in a cell, kernel died, interrupted by SIGINT/SIGTERM) even when it did not finish.

Everything is checked before a kernel starts (`prepare`), so a typo costs a second, not a run.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from decodelab.suite import profiles
from decodelab.suite.provenance import LoadSampler, collect_env, runner_identity
from decodelab.suite.records import (
    STATUS_FAILED,
    STATUS_INTERRUPTED,
    STATUS_OK,
    STATUS_RUNNING,
    cell_seconds,
    check_results_root,
    describe_cell,
    last_cell,
    new_run_dir,
    notebook_path,
    now,
    params_dir,
    read_json,
    write_json,
)

KERNEL_NAME = "decodelab"
# env.json["error"]["kind"] of a failed run
ERROR_CELL, ERROR_KERNEL_DIED, ERROR_RUNNER = "cell raised", "kernel died", "runner error"


class RunFailed(RuntimeError):
    """A notebook run that did not finish; `run_dir` keeps what it wrote."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM; its env.json says "interrupted" and keeps every file.

    A KeyboardInterrupt, so code that already stops on Ctrl-C stops on SIGTERM too; the command line
    exits with `exit_code` (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int, run_dir: Path | None = None, last_cell: dict | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.run_dir = run_dir
        self.last_cell = last_cell

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

def kernel_name() -> str:
    """The registered "decodelab" kernel when it runs this very Python, else "python3" (which
    jupyter_client maps to the current interpreter)."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except Exception:  # no spec, or jupyter_client missing/odd
        return "python3"
    exe = spec.argv[0] if spec.argv else ""
    if exe in ("python", "python3") or os.path.abspath(exe) == os.path.abspath(sys.executable):
        return KERNEL_NAME
    return "python3"


def prepare(name: str, profile: str, overrides: dict | None = None) -> tuple[Path, dict, dict]:
    """Check everything before a kernel starts: (notebook path, injected params, merged params)."""
    if profile not in profiles.PROFILES:
        raise ValueError(f"profile={profile!r} is not a profile; allowed: {list(profiles.PROFILES)}")
    path = notebook_path(name)
    declared = profiles.notebook_parameters(path)
    profile_values = profiles.load_profile(params_dir(name), profile)
    profiles.validate(profile_values, declared, source=str(profiles.profile_path(params_dir(name), profile)))
    profiles.validate(overrides or {}, declared, source="-p")
    injected, merged = profiles.resolve(declared, profile_values, absolute_paths(overrides or {}))
    return path, injected, merged


PATH_SUFFIXES = ("_file", "_path", "_dir")


def absolute_paths(overrides: dict) -> dict:
    """-p values of path parameters (`*_file`, `*_path`, `*_dir`) that exist relative to the caller's
    directory, made absolute: the kernel runs in notebooks/, not where the user typed the command."""
    out = dict(overrides)
    for key, value in overrides.items():
        if key.endswith(PATH_SUFFIXES) and isinstance(value, str) and value and not os.path.isabs(value):
            candidate = Path.cwd() / value
            if candidate.exists():
                out[key] = str(candidate.resolve())
    return out


def execute(
    name: str,
    profile: str = "cpu",
    overrides: dict | None = None,
    *,
    root: Path | None = None,
    progress: bool = True,
    log=print,
) -> Path:
    """Run notebook `name` with a profile and overrides into a new run directory; return it.

    Raises ValueError (bad input, nothing written), RunFailed (a cell raised or the kernel died; the
    run directory keeps the executed notebook up to that cell, params.json, and env.json with status
    "failed" and the cell) or RunInterrupted (SIGINT/SIGTERM: status "interrupted", files kept).
    """
    path, injected, merged = prepare(name, profile, overrides)
    root = check_results_root(root)
    kernels_before = _child_pids()
    # On a signal, stop the kernel first (quietly, before papermill's own shutdown talks to it).
    with _signals_interrupt(lambda: _stop_processes(_child_pids() - kernels_before, grace_s=0)):
        return _execute(name, profile, overrides or {}, path, injected, merged, root, progress, log, kernels_before)


def _execute(name, profile, overrides, path, injected, merged, root, progress, log, kernels_before) -> Path:
    import papermill
    from nbclient.exceptions import DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    run_dir = new_run_dir(name, root=root)
    notebook_out = run_dir / "notebook.ipynb"
    sampler = LoadSampler().start()
    t0 = time.perf_counter()

    def finish(status: str, **fields) -> None:
        env = read_json(run_dir / "env.json", {})  # keep what the kernel added
        env.update(status=status, finished=now(), wall_s=round(time.perf_counter() - t0, 3),
                   load=sampler.stop(), slowest_cells=cell_seconds(notebook_out), **fields)
        write_json(run_dir / "env.json", env, strict=False)

    quiet = _QuietPapermill()
    for logger in QUIET_LOGGERS:
        logging.getLogger(logger).addFilter(quiet)
    try:
        write_json(run_dir / "params.json", merged, strict=False)
        kernel = kernel_name()
        env = collect_env(
            name=name, notebook=path.name, profile=profile, overrides=overrides, run_dir=run_dir,
            command=sys.argv, kernel_name=kernel, started=now(), status=STATUS_RUNNING,
            runner=runner_identity(), load=sampler.summary(),
        )
        write_json(run_dir / "env.json", env, strict=False)
        log(f"decodelab run {name} --profile {profile}: {run_dir}")
        papermill.execute_notebook(
            str(path), str(notebook_out),
            parameters={**injected, "output_dir": str(run_dir)},
            kernel_name=kernel, cwd=str(path.parent), progress_bar=progress,
            log_output=False, request_save_on_cell_execute=True,
        )
        finish(STATUS_OK)
    except PapermillExecutionError as error:
        cell = last_cell(notebook_out)
        if error.ename == "KeyboardInterrupt":  # the kernel itself was interrupted (SIGINT sent to it)
            finish(STATUS_INTERRUPTED, last_cell=cell, interrupted={"signal": "SIGINT (kernel)", "time": now()})
            raise RunInterrupted(signal.SIGINT, run_dir, cell) from None
        finish(STATUS_FAILED, last_cell=cell, error={
            "kind": ERROR_CELL, "cell": error.exec_count, "cell_index": cell and cell["index"],
            "ename": error.ename, "evalue": error.evalue,
        })
        # A ValueError is the library's "bad input" answer: its message says what to change, and a
        # traceback would only bury it (the executed notebook keeps the full one).
        trace = ("(traceback in the executed notebook)" if error.ename in INPUT_ERRORS
                 else _strip_ansi("\n".join(error.traceback or [])))
        raise RunFailed(
            f"{name}: cell [{error.exec_count}] failed with {error.ename}: {error.evalue}\n{trace}\n"
            f"the run directory keeps what it wrote: {run_dir}", run_dir,
        ) from None
    except KeyboardInterrupt as stop:  # RunInterrupted from SIGTERM/SIGINT, or a bare Ctrl-C
        signum = stop.signum if isinstance(stop, RunInterrupted) else signal.SIGINT
        _stop_processes(_child_pids() - kernels_before)
        cell = last_cell(notebook_out)
        finish(STATUS_INTERRUPTED, last_cell=cell,
               interrupted={"signal": signal.Signals(signum).name, "time": now()})
        raise RunInterrupted(signum, run_dir, cell) from None
    except DeadKernelError as error:
        cell = last_cell(notebook_out)
        finish(STATUS_FAILED, last_cell=cell, error={
            "kind": ERROR_KERNEL_DIED, "cell": cell and cell["execution_count"], "cell_index": cell and cell["index"],
            "ename": type(error).__name__, "evalue": str(error),
        })
        raise RunFailed(
            f"{name}: the kernel died in {describe_cell(cell)} (the process was killed or crashed, "
            f"e.g. out of memory: {error})\nthe run directory keeps what it wrote: {run_dir}", run_dir,
        ) from None
    except Exception as error:  # kernel missing, papermill or I/O trouble, ...
        _stop_processes(_child_pids() - kernels_before)
        cell = last_cell(notebook_out)
        finish(STATUS_FAILED, last_cell=cell, error={
            "kind": ERROR_RUNNER, "cell": cell and cell["execution_count"], "cell_index": cell and cell["index"],
            "ename": type(error).__name__, "evalue": str(error),
        })
        raise RunFailed(f"{name}: {type(error).__name__}: {error}\nrun directory: {run_dir}", run_dir) from error
    finally:
        for logger in QUIET_LOGGERS:
            logging.getLogger(logger).removeFilter(quiet)
    log(f"ok: {run_dir} ({time.perf_counter() - t0:.1f} s)")
    return run_dir


@contextlib.contextmanager
def _signals_interrupt(on_signal=None):
    """While a run executes, SIGTERM and SIGINT call `on_signal()` and raise RunInterrupted in the main
    thread, so the run can mark itself before the process ends; repeats are ignored while it does
    (outside the main thread, where Python allows no handlers, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = (signal.SIGINT, signal.SIGTERM)

    def handler(signum, frame):
        for sig in caught:
            signal.signal(sig, signal.SIG_IGN)
        if on_signal is not None:
            on_signal()
        raise RunInterrupted(signum)

    previous = {sig: signal.getsignal(sig) for sig in caught}
    for sig in caught:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _child_pids() -> set[int]:
    """Live (not zombie) child processes of this process, from /proc (empty where there is none)."""
    me, children = os.getpid(), set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                stat = handle.read()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2:].split()[:2]
        if int(ppid) == me and state != "Z":
            children.add(int(entry))
    return children


def _stop_processes(pids: set[int], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (0: no wait), to processes this run started (its kernel)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    if grace_s <= 0:
        return
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = pids & _child_pids()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


QUIET_LOGGERS = ("papermill", "papermill.translators")
INPUT_ERRORS = ("ValueError",)


class _QuietPapermill(logging.Filter):
    """Drop papermill's own parameter-cell parse warnings: its line parser gives up on comments
    containing "=" (e.g. "# >= 1") and then calls every later parameter unknown; `prepare` has
    already checked every name against the cell with Python's own parser."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Passed unknown parameter", "Unable to parse line"))


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
