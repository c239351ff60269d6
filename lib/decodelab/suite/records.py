"""Run directories: where notebooks, profiles and results live, how a run folder is made and read,
and how a reader finds runs and tells how each ended.

Layout of one run (a run never overwrites another)::

    results/<runner-name>/<run-id>/
        notebook.ipynb     the executed notebook (kept, with the error, when a cell fails)
        params.json        every declared parameter's final value
        metrics.json       the notebook's key numbers (run.log_metrics)
        env.json           versions, hardware, git commit, profile, times, status ("ok" | "failed" |
                           "interrupted" | "running" | "interactive"), the runner's pid and host,
                           the load average around the run ("load"), and for a run that did not
                           finish the last cell it reached ("last_cell") and why ("error" / "interrupted")
        figures/<name>.png + .svg, figures/captions.json
        tables/<name>.csv
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import socket
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from decodelab.suite import profiles, registry
from decodelab.suite.provenance import process_alive, repo_root

STATUS_OK, STATUS_FAILED, STATUS_RUNNING, STATUS_INTERRUPTED, STATUS_INTERACTIVE = (
    "ok", "failed", "running", "interrupted", "interactive",
)
# What `effective_status` says of a run still marked "running" whose runner process is gone.
STATUS_PROCESS_GONE = "interrupted (process gone)"


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


def notebook_path(name: str) -> Path:
    """notebooks/<file> of registered notebook `name` (ValueError when unregistered or not written yet)."""
    path = notebooks_dir() / registry.check_name(name).file
    if not path.exists():
        present = [n for n, nb in registry.NOTEBOOKS.items() if (notebooks_dir() / nb.file).exists()]
        raise ValueError(f"notebook={name!r}: {path} does not exist yet; notebooks present: {present}")
    return path


def params_dir(name: str) -> Path:
    """notebooks/params/<runner-name>/ holding smoke.yaml, cpu.yaml, gpu.yaml."""
    return notebooks_dir() / "params" / registry.check_name(name).name


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


def now() -> str:
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


def _executed_cells(notebook_path: Path) -> list[dict] | None:
    """The cells of an executed notebook, or None when it cannot be read."""
    try:
        return json.loads(Path(notebook_path).read_text(encoding="utf-8")).get("cells", [])
    except (OSError, ValueError):
        return None


def _first_line(cell: dict, width: int = 100) -> str:
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else source
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    return first if len(first) <= width else first[:width - 3] + "..."


def last_cell(notebook_path: Path) -> dict | None:
    """The last cell a run reached, from the executed notebook papermill saves at every cell start:
    {"index", "of", "execution_count", "first_line", "started"} (index 0-based, counting the injected
    parameters cell), or None when no cell started or the notebook cannot be read."""
    cells = _executed_cells(notebook_path)
    reached = [
        (index, cell) for index, cell in enumerate(cells or [])
        if (cell.get("metadata", {}).get("papermill") or {}).get("start_time")
    ]
    if not reached:
        return None
    index, cell = reached[-1]
    return {
        "index": index, "of": len(cells), "execution_count": cell.get("execution_count"),
        "first_line": _first_line(cell), "started": cell["metadata"]["papermill"]["start_time"],
    }


def cell_seconds(notebook_path: Path, *, top: int = 8) -> list[dict]:
    """The `top` slowest cells of an executed notebook, slowest first, from papermill's per-cell durations:
    [{"index", "seconds", "first_line"}] (index as in `last_cell`); [] when the notebook cannot be read.
    Where a notebook's wall time goes, for trimming a profile without guessing."""
    timed = [
        {"index": index, "seconds": round(float(duration), 2), "first_line": _first_line(cell, 80)}
        for index, cell in enumerate(_executed_cells(notebook_path) or [])
        if (duration := (cell.get("metadata", {}).get("papermill") or {}).get("duration")) is not None
    ]
    return sorted(timed, key=lambda c: -c["seconds"])[:top]


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
