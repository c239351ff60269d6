"""The recorder a notebook uses inside its kernel: open the run directory, save figures, tables,
metrics and goal rows into it (layout: decodelab.suite.records).

Inside a notebook::

    run = runs.start("quickstart", output_dir)
    run.save_figure(fig, "throughput", caption="...")
    run.save_table(df, "throughput")
    run.log_metrics(greedy_match=True)
    run.log_goals([Goal.check("speedup_b1", 1.9, ">=", 1.7, label="speedup at batch 1", unit="x")])

`start` records every parameter the notebook's parameters cell declares, with the kernel's values.
"""
from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from decodelab.suite import profiles, records
from decodelab.suite.provenance import collect_env, kernel_env
from decodelab.suite.records import STATUS_INTERACTIVE, new_run_dir, now, read_json, to_jsonable, write_json


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

    def log_env(self, **facts) -> dict:
        """Merge facts about how the run executed into env.json["run_facts"] (e.g. compile=status from
        `static_step_for(...).status()`, the verify-width calibration used); returns them all."""
        env_path = self.dir / "env.json"
        env = read_json(env_path, {})
        env["run_facts"] = {**env.get("run_facts", {}), **to_jsonable(facts)}
        write_json(env_path, env, strict=False)
        return env["run_facts"]

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


def start(name: str, output_dir: str | Path | None = None, params: dict | None = None, *,
          namespace: dict | None = None) -> Run:
    """Open the run directory a notebook writes into; record every declared parameter in params.json.

    The declared parameters are the names params.json already holds (the runner writes every one of
    them, defaults included), else those of the registered notebook's parameters cell. Each is recorded
    with its value in `namespace` (default: the caller's globals, i.e. the kernel's), so a non-literal
    default (`model = DEFAULT_MODEL`) is recorded evaluated ("smollm2-135m"). `params` (optional, kept for
    notebooks that still pass one) is merged on top. Under the runner `output_dir` is injected and
    already holds params.json and env.json; with output_dir None (interactive JupyterLab) a fresh
    `results/<name>/interactive-<stamp>/` is made.
    """
    if output_dir is None:
        run_dir = new_run_dir(name, prefix="interactive-")
    else:
        run_dir = Path(output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    if namespace is None:
        namespace = sys._getframe(1).f_globals
    params_path = run_dir / "params.json"
    recorded = read_json(params_path, {})
    names = list(recorded) or declared_names(name)
    kernel_values = {key: namespace[key] for key in names if key in namespace}
    write_json(params_path, {**recorded, **kernel_values, **(params or {})}, strict=False)
    env_path = run_dir / "env.json"
    env = read_json(env_path)
    if env is None:  # not started by the runner
        env = collect_env(name=name, profile=None, run_dir=run_dir)
        env.update(status=STATUS_INTERACTIVE, started=now())
    env["kernel"] = kernel_env()
    write_json(env_path, env, strict=False)
    return Run(name=name, dir=run_dir)


def declared_names(name: str) -> list[str]:
    """The parameters registered notebook `name` declares (the runner's reserved names aside); [] when
    it is not registered or its file cannot be read (a throwaway run)."""
    try:
        declared = records.parameters(name)
    except (ValueError, OSError):
        return []
    return [key for key in declared if key not in profiles.RESERVED]
