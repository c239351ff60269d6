"""Runs: the notebook registry, run directories, what a notebook records, and the papermill runner.

Layout of one run (a run never overwrites another)::

    results/<runner-name>/<run-id>/
        notebook.ipynb     the executed notebook (kept, with the error, when a cell fails)
        params.json        every parameter's final value
        metrics.json       the notebook's key numbers (run.log_metrics)
        env.json           versions, hardware, git commit, profile, times, status ("ok" | "failed" | ...)
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

import dataclasses
import json
import logging
import math
import os
import re
import secrets
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from decodelab import profiles
from decodelab.provenance import collect_env, kernel_env, repo_root

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


class RunFailed(RuntimeError):
    """A notebook run that did not finish; `run_dir` keeps what it wrote."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


# ---------------------------------------------------------------- where things live
def notebooks_dir() -> Path:
    """notebooks/ of the checkout, or $DECODELAB_NOTEBOOKS."""
    return Path(os.environ.get("DECODELAB_NOTEBOOKS") or repo_root() / "notebooks")


def results_root() -> Path:
    """results/ of the checkout, or $DECODELAB_RESULTS."""
    return Path(os.environ.get("DECODELAB_RESULTS") or repo_root() / "results")


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
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / new_run_id(prefix)
        try:
            path.mkdir()
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
            fig = getattr(fig, "figure", None) or getattr(fig, "fig")
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
        """Merge goal rows (`decodelab.goals.Goal`) into metrics.json["goals"] by name; returns all goals."""
        from decodelab import goals

        rows = list(rows)
        bad = [row for row in rows if not isinstance(row, goals.Goal)]
        if bad:
            raise TypeError(f"log_goals takes Goal rows (decodelab.goals.Goal.check(...)), got {bad[0]!r:.80}")
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


def latest_run(name: str, status: str | None = STATUS_OK, *, root: Path | None = None) -> Path | None:
    """The newest run directory of `name` with that status (default "ok"), or None."""
    runs = list_runs(name, status=status, root=root)
    return runs[-1] if runs else None


def load_run(run_dir: Path) -> dict:
    """Everything a run recorded: params, metrics, env, figure captions, figure and table paths."""
    run_dir = Path(run_dir)
    figures = run_dir / "figures"
    return {
        "dir": run_dir,
        "params": read_json(run_dir / "params.json", {}),
        "metrics": read_json(run_dir / "metrics.json", {}),
        "env": read_json(run_dir / "env.json", {}),
        "captions": read_json(figures / "captions.json", {}),
        "figures": sorted(figures.glob("*.png")) if figures.is_dir() else [],
        "tables": sorted((run_dir / "tables").glob("*.csv")) if (run_dir / "tables").is_dir() else [],
        "notebook": run_dir / "notebook.ipynb",
    }


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
    injected, merged = profiles.resolve(declared, profile_values, overrides or {})
    return path, injected, merged


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

    Raises ValueError (bad input, nothing written) or RunFailed (the run directory keeps the
    executed notebook up to the failing cell, params.json, and env.json with status "failed").
    """
    path, injected, merged = prepare(name, profile, overrides)
    run_dir = new_run_dir(name, root=root)
    write_json(run_dir / "params.json", merged, strict=False)
    kernel = kernel_name()
    env = collect_env(
        name=name, notebook=path.name, profile=profile, overrides=overrides or {}, run_dir=run_dir,
        command=sys.argv, kernel_name=kernel, started=_now(), status=STATUS_RUNNING,
    )
    write_json(run_dir / "env.json", env, strict=False)
    log(f"decodelab run {name} --profile {profile}: {run_dir}")
    t0 = time.perf_counter()

    def finish(status: str, **fields) -> None:
        env = read_json(run_dir / "env.json", {})  # keep what the kernel added
        env.update(status=status, finished=_now(), wall_s=round(time.perf_counter() - t0, 3), **fields)
        write_json(run_dir / "env.json", env, strict=False)

    import papermill
    from papermill.exceptions import PapermillExecutionError

    quiet = _QuietPapermill()
    for logger in QUIET_LOGGERS:
        logging.getLogger(logger).addFilter(quiet)
    try:
        papermill.execute_notebook(
            str(path), str(run_dir / "notebook.ipynb"),
            parameters={**injected, "output_dir": str(run_dir)},
            kernel_name=kernel, cwd=str(path.parent), progress_bar=progress,
            log_output=False, request_save_on_cell_execute=True,
        )
    except PapermillExecutionError as error:
        finish(STATUS_FAILED, error={"cell": error.exec_count, "ename": error.ename, "evalue": error.evalue})
        trace = _strip_ansi("\n".join(error.traceback or []))
        raise RunFailed(
            f"{name}: cell [{error.exec_count}] failed with {error.ename}: {error.evalue}\n{trace}\n"
            f"the run directory keeps what it wrote: {run_dir}", run_dir,
        ) from None
    except KeyboardInterrupt:
        finish(STATUS_INTERRUPTED)
        raise
    except Exception as error:  # kernel died, kernel missing, ...
        finish(STATUS_FAILED, error={"ename": type(error).__name__, "evalue": str(error)})
        raise RunFailed(f"{name}: {type(error).__name__}: {error}\nrun directory: {run_dir}", run_dir) from error
    finally:
        for logger in QUIET_LOGGERS:
            logging.getLogger(logger).removeFilter(quiet)
    finish(STATUS_OK)
    log(f"ok: {run_dir} ({time.perf_counter() - t0:.1f} s)")
    return run_dir


QUIET_LOGGERS = ("papermill", "papermill.translators")


class _QuietPapermill(logging.Filter):
    """Drop papermill's own parameter-cell parse warnings: its line parser gives up on comments
    containing "=" (e.g. "# >= 1") and then calls every later parameter unknown; `prepare` has
    already checked every name against the cell with Python's own parser."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Passed unknown parameter", "Unable to parse line"))


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
