"""Runs: the notebook registry, run directories, what a notebook records, and the papermill runner.

Layout of one run (a run never overwrites another)::

    results/<runner-name>/<run-id>/
        notebook.ipynb     the executed notebook (kept, with the error, when a cell fails)
        params.json        every parameter's final value
        metrics.json       the notebook's key numbers (run.log_metrics)
        env.json           versions, hardware, git commit, profile, times, status ("ok" | "failed" |
                           "interrupted" | "running" | "interactive"), the runner's pid and host,
                           the load average around the run ("load"), and for a run that did not
                           finish the last cell it reached ("last_cell") and why ("error" / "interrupted")
        figures/<name>.png + .svg, figures/captions.json
        tables/<name>.csv

Inside a notebook::

    run = runs.start("quickstart", output_dir, params=dict(model=model, seed=seed))
    run.save_figure(fig, "throughput", caption="...")
    run.save_table(df, "throughput")
    run.log_metrics(greedy_match=True)
    run.log_goals([Goal.check("speedup_b1", 1.9, ">=", 1.7, label="speedup at batch 1", unit="x")])
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from decodelab.suite import profiles
from decodelab.suite.provenance import LoadSampler, collect_env, kernel_env, process_alive, repo_root, runner_identity

# runner name -> notebook file under notebooks/
NOTEBOOKS = {
    "quickstart": "00_quickstart.ipynb",
    "speculation": "01_speculation_vs_batch.ipynb",
    "sampling": "02_minp_vs_topp.ipynb",
    "mtp": "03_mtp_training.ipynb",
    "masking": "04_masking_distortion.ipynb",
    "consistency": "05_self_consistency_kv.ipynb",
}
KERNEL_NAME = "decodelab"
STATUS_OK, STATUS_FAILED, STATUS_RUNNING, STATUS_INTERRUPTED, STATUS_INTERACTIVE = (
    "ok", "failed", "running", "interrupted", "interactive",
)
# What `effective_status` says of a run still marked "running" whose runner process is gone.
STATUS_PROCESS_GONE = "interrupted (process gone)"
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


# ---------------------------------------------------------------- where things live
def notebooks_dir() -> Path:
    """notebooks/ of the checkout, or $DECODELAB_NOTEBOOKS."""
    return Path(os.environ.get("DECODELAB_NOTEBOOKS") or repo_root() / "notebooks")


def results_root() -> Path:
    """results/ of the checkout, or $DECODELAB_RESULTS."""
    return Path(os.environ.get("DECODELAB_RESULTS") or repo_root() / "results")


def check_results_root(root: Path | None = None) -> Path:
    """The results root (`root`, else $DECODELAB_RESULTS, else results/), made if missing.

    Raises ValueError naming the setting before anything runs when it is a file, lies under a file,
    cannot be made, or cannot be written.
    """
    path = Path(root) if root is not None else results_root()
    if root is None and os.environ.get("DECODELAB_RESULTS"):
        setting = f"DECODELAB_RESULTS={os.environ['DECODELAB_RESULTS']!r}"
    else:
        setting = f"the results folder {str(path)!r}"
    fix = "point DECODELAB_RESULTS at a folder you can write (it is made if missing)"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{setting} is a file, not a folder; {fix}")
    blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{setting} lies under {str(blocking)!r}, which is a file, not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".decodelab-write-check-", dir=path)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"{setting} is not writable ({error.strerror or error}); {fix}") from None
    return path


def check_name(name: str) -> str:
    if name not in NOTEBOOKS:
        raise ValueError(f"notebook={name!r} is not registered; allowed: {sorted(NOTEBOOKS)}")
    return name


def notebook_path(name: str) -> Path:
    path = notebooks_dir() / NOTEBOOKS[check_name(name)]
    if not path.exists():
        present = [n for n, f in NOTEBOOKS.items() if (notebooks_dir() / f).exists()]
        raise ValueError(f"notebook={name!r}: {path} does not exist yet; notebooks present: {present}")
    return path


def params_dir(name: str) -> Path:
    """notebooks/params/<runner-name>/ holding smoke.yaml, cpu.yaml, gpu.yaml."""
    return notebooks_dir() / "params" / check_name(name)


def parameters(name: str) -> dict[str, profiles.Parameter]:
    """The parameters declared in a registered notebook's `parameters` cell."""
    return profiles.notebook_parameters(notebook_path(name))


# ---------------------------------------------------------------- run directories
def new_run_id(prefix: str = "") -> str:
    """`[prefix-]YYYYmmdd-HHMMSS-xxxxxx`: sortable by time, unique by its random tail."""
    return f"{prefix}{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def new_run_dir(name: str, *, root: Path | None = None, prefix: str = "") -> Path:
    """Create `results/<name>/<new-run-id>/`; never returns a directory that existed before."""
    parent = Path(root or results_root()) / name
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"cannot make the folder {str(parent)!r} for runs of {name!r}: {error.strerror or error}"
        ) from None
    while True:
        path = parent / new_run_id(prefix)
        try:
            path.mkdir()  # atomic: of two runs drawing the same id, one gets FileExistsError and draws again
            return path
        except FileExistsError:
            continue


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------- JSON
def to_jsonable(value: Any, *, strict: bool = True) -> Any:
    """numpy/torch scalars and arrays, pandas, dataclasses, paths -> plain JSON; NaN/inf -> None.

    strict=False turns anything else into its str() instead of raising TypeError.
    """
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, strict=strict) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, strict=strict) for v in value]
    if isinstance(value, (set, frozenset)):
        return [to_jsonable(v, strict=strict) for v in sorted(value, key=repr)]
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value), strict=strict)
    if hasattr(value, "columns") and hasattr(value, "to_dict"):  # pandas DataFrame
        return to_jsonable(value.to_dict(orient="records"), strict=strict)
    if hasattr(value, "to_dict") and hasattr(value, "index"):  # pandas Series
        return to_jsonable(value.to_dict(), strict=strict)
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays
        return to_jsonable(value.tolist(), strict=strict)
    if hasattr(value, "item"):
        return to_jsonable(value.item(), strict=strict)
    if strict:
        raise TypeError(f"cannot record a {type(value).__name__} as JSON: {value!r:.80}")
    return str(value)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return default


def write_json(path: Path, data: Any, *, strict: bool = True) -> None:
    """Write atomically (tmp + rename) so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(to_jsonable(data, strict=strict), handle, indent=2, allow_nan=False)
        handle.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- what a notebook records
@dataclass
class Run:
    """One run directory, handed to the notebook by `start`."""

    name: str
    dir: Path

    @property
    def figures_dir(self) -> Path:
        return self.dir / "figures"

    @property
    def tables_dir(self) -> Path:
        return self.dir / "tables"

    @property
    def metrics(self) -> dict:
        return read_json(self.dir / "metrics.json", {})

    def save_figure(self, fig, name: str, caption: str = "", *, dpi: int = 150) -> Path:
        """Save `fig` (Figure, Axes or seaborn grid) as figures/<name>.png and .svg; record its caption."""
        import matplotlib
        from matplotlib.figure import Figure

        _check_file_name(name)
        if not isinstance(fig, Figure):
            fig = getattr(fig, "figure", None) or fig.fig
        if not caption:
            warnings.warn(f"figure {name!r} has no caption; every figure needs a one-line caption", stacklevel=2)
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        png = self.figures_dir / f"{name}.png"
        # Fixed SVG ids and no date: the same figure gives the same file.
        with matplotlib.rc_context({"svg.hashsalt": "decodelab"}):
            fig.savefig(png, dpi=dpi, bbox_inches="tight")
            fig.savefig(self.figures_dir / f"{name}.svg", bbox_inches="tight", metadata={"Date": None})
        captions_path = self.figures_dir / "captions.json"
        captions = read_json(captions_path, {})
        captions[name] = caption
        write_json(captions_path, captions)
        return png

    def save_table(self, table, name: str) -> Path:
        """Save a DataFrame (or records / dict of columns) as tables/<name>.csv."""
        import pandas as pd

        _check_file_name(name)
        df = table if isinstance(table, pd.DataFrame) else pd.DataFrame(table)
        self.tables_dir.mkdir(parents=True, exist_ok=True)
        path = self.tables_dir / f"{name}.csv"
        # A RangeIndex carries nothing; a named or pivoted index does.
        df.to_csv(path, index=not isinstance(df.index, pd.RangeIndex))
        return path

    def log_metrics(self, **metrics) -> dict:
        """Merge key numbers into metrics.json (numpy/torch converted, NaN -> null); returns all metrics."""
        merged = {**self.metrics, **to_jsonable(metrics)}
        write_json(self.dir / "metrics.json", merged)
        return merged

    def log_goals(self, rows) -> list:
        """Merge goal rows (`decodelab.common.goals.Goal`) into metrics.json["goals"] by name; returns all goals."""
        from decodelab.common import goals

        rows = list(rows)
        bad = [row for row in rows if not isinstance(row, goals.Goal)]
        if bad:
            raise TypeError(f"log_goals takes Goal rows (decodelab.common.goals.Goal.check(...)), got {bad[0]!r:.80}")
        old = self.metrics.get("goals")
        merged = goals.merge(old if isinstance(old, list) else [], rows)
        self.log_metrics(goals=merged)
        return goals.from_rows(merged)


def _check_file_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ValueError(f"name={name!r} must be a plain file stem (letters, digits, _ . -)")


def start(name: str, output_dir: str | Path | None = None, params: dict | None = None) -> Run:
    """Open the run directory a notebook writes into.

    Under the runner `output_dir` is injected and already holds params.json and env.json; the
    notebook's `params` (evaluated values, e.g. the model name behind a constant) are merged in.
    With output_dir None (interactive JupyterLab) a fresh `results/<name>/interactive-<stamp>/` is made.
    """
    if output_dir is None:
        run_dir = new_run_dir(name, prefix="interactive-")
    else:
        run_dir = Path(output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    params_path = run_dir / "params.json"
    write_json(params_path, {**read_json(params_path, {}), **(params or {})}, strict=False)
    env_path = run_dir / "env.json"
    env = read_json(env_path)
    if env is None:  # not started by the runner
        env = collect_env(name=name, profile=None, run_dir=run_dir)
        env.update(status=STATUS_INTERACTIVE, started=_now())
    env["kernel"] = kernel_env()
    write_json(env_path, env, strict=False)
    return Run(name=name, dir=run_dir)


# ---------------------------------------------------------------- finding runs (report side)
def list_runs(name: str, *, status: str | None = None, root: Path | None = None) -> list[Path]:
    """Run directories of `name`, oldest first; `status` keeps only runs whose env.json says so."""
    parent = Path(root or results_root()) / name
    if not parent.is_dir():
        return []
    runs = []
    for path in parent.iterdir():
        env = read_json(path / "env.json") if path.is_dir() else None
        if env is None or (status is not None and env.get("status") != status):
            continue
        runs.append((env.get("started") or "", path.name, path))
    return [path for *_, path in sorted(runs)]


def effective_status(env: dict) -> str:
    """The status a reader should see: env["status"], except that a run still marked "running"
    whose runner process is gone (checked on the same host only) reads "interrupted (process gone)".

    Values: "ok", "failed", "interrupted", "interrupted (process gone)", "running", "interactive",
    or "unknown" for an env.json without a status. A run on another host stays "running" (no way to tell).
    """
    status = (env or {}).get("status") or "unknown"
    if status != STATUS_RUNNING:
        return status
    runner = env.get("runner") or {}
    pid = runner.get("pid")
    if not isinstance(pid, int) or runner.get("hostname") != socket.gethostname():
        return status
    return status if process_alive(pid, runner.get("start_ticks")) else STATUS_PROCESS_GONE


def last_cell(notebook_path: Path) -> dict | None:
    """The last cell a run reached, from the executed notebook papermill saves at every cell start:
    {"index", "of", "execution_count", "first_line", "started"} (index 0-based, counting the injected
    parameters cell), or None when no cell started or the notebook cannot be read."""
    try:
        cells = json.loads(Path(notebook_path).read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError):
        return None
    reached = [
        (index, cell) for index, cell in enumerate(cells)
        if (cell.get("metadata", {}).get("papermill") or {}).get("start_time")
    ]
    if not reached:
        return None
    index, cell = reached[-1]
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else source
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return {
        "index": index, "of": len(cells), "execution_count": cell.get("execution_count"),
        "first_line": first if len(first) <= 100 else first[:97] + "...",
        "started": cell["metadata"]["papermill"]["start_time"],
    }


def describe_cell(cell: dict | None) -> str:
    """'cell 5 of 9 [3] `time.sleep(60)`' for messages and listings."""
    if not cell:
        return "before the first cell"
    count = f" [{cell['execution_count']}]" if cell.get("execution_count") is not None else ""
    return f"cell {cell['index']} of {cell['of']}{count} `{cell['first_line']}`"


def latest_run(name: str, status: str | None = STATUS_OK, *, root: Path | None = None) -> Path | None:
    """The newest run directory of `name` with that status (default "ok"), or None."""
    runs = list_runs(name, status=status, root=root)
    return runs[-1] if runs else None


# ---------------------------------------------------------------- the runner
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
        env.update(status=status, finished=_now(), wall_s=round(time.perf_counter() - t0, 3),
                   load=sampler.stop(), **fields)
        write_json(run_dir / "env.json", env, strict=False)

    quiet = _QuietPapermill()
    for logger in QUIET_LOGGERS:
        logging.getLogger(logger).addFilter(quiet)
    try:
        write_json(run_dir / "params.json", merged, strict=False)
        kernel = kernel_name()
        env = collect_env(
            name=name, notebook=path.name, profile=profile, overrides=overrides, run_dir=run_dir,
            command=sys.argv, kernel_name=kernel, started=_now(), status=STATUS_RUNNING,
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
            finish(STATUS_INTERRUPTED, last_cell=cell, interrupted={"signal": "SIGINT (kernel)", "time": _now()})
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
               interrupted={"signal": signal.Signals(signum).name, "time": _now()})
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
