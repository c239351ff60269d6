"""Provenance: versions, hardware and git state recorded beside every run's outputs.

Cheap to call from the runner process: nothing here imports torch (the kernel reports its own torch
build through `kernel_env`).

Load tags: a run records the load average before and after, and the peak a background sampler saw
while it ran (`LoadSampler`), as env.json["load"]; a run whose peak 1-minute load exceeded the core
count by more than LOAD_MARGIN is `is_loaded`: its timings are not comparable with a quiet run's.
A run that keeps every core busy brings the load to about the core count by itself (torch uses one
thread per core), so only load beyond that comes from other work competing for the cores.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

from decodelab.core.machine import cpu_model
from decodelab.workloads.paths import repo_root

PACKAGES = (
    "decodelab", "torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "gguf",
    "numpy", "pandas", "scipy", "matplotlib", "seaborn", "papermill", "nbformat", "nbclient", "ipykernel",
    "jupyterlab", "tqdm", "pyyaml", "xgrammar", "llguidance", "jsonschema",
)


def collect_env(**extra) -> dict:
    """Versions, hardware and git state, without importing torch (cheap in the runner process)."""
    import platform

    return {
        **extra,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(), "usable_cores": _usable_cores()},
        "memory_gib": _memory_gib(),
        "gpu": _gpu_names(),
        "git": git_state(repo_root()),
        "env_vars": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in os.environ},
    }


def environment_info() -> dict:
    """collect_env() without run fields: what the benchmark records next to its table."""
    return collect_env()


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    from importlib import metadata

    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _run_quiet(cmd: list[str]) -> str | None:
    import subprocess

    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _gpu_names() -> list[str]:
    """GPU names from nvidia-smi (no torch/CUDA initialisation in the runner)."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return []
    out = _run_quiet(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()] if out else []


def git_state(root: Path) -> dict:
    """Commit and dirty flag of the checkout (read-only git calls; no index lock taken)."""
    commit = _run_quiet(["git", "-C", str(root), "rev-parse", "HEAD"])
    status = _run_quiet(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain"])
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def kernel_env() -> dict:
    """What the kernel itself sees: torch's build, threads and accelerator, when torch is loaded."""
    torch = sys.modules.get("torch")
    info = {"python_executable": sys.executable, "pid": os.getpid()}
    if torch is not None:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), cuda=torch.cuda.is_available())
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------- the runner process
def runner_identity() -> dict:
    """pid, hostname and the process's start time (clock ticks since boot, Linux): enough to tell later
    whether the process that wrote "running" is still alive, even after its pid is reused."""
    return {"pid": os.getpid(), "hostname": socket.gethostname(), "start_ticks": process_start_ticks(os.getpid())}


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time since boot, in clock ticks), None where unreadable."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, or None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ")".
    return stat[stat.rfind(")") + 2:].split()


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process `pid` on this host runs (not a zombie; given `start_ticks`, the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    except (OSError, OverflowError, TypeError):
        return False
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):  # exited, not yet reaped
        return False
    if start_ticks is not None and fields:
        try:
            return int(fields[19]) == start_ticks  # else the pid was reused by another process
        except (IndexError, ValueError):
            pass
    return True


# ---------------------------------------------------------------- load average
LOAD_SAMPLE_EVERY_S = 2.0


def load_cores() -> int:
    """Cores the load average is measured against: the machine's (load is machine-wide)."""
    return os.cpu_count() or 1


def load_now() -> list[float] | None:
    """[1 min, 5 min, 15 min] load average now (/proc/loadavg), None where the OS has none."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


LOAD_MARGIN = 0.5  # runnable threads beyond the core count (a run's own threads fill the cores)
MEMORY_PROBE_BYTES = 256 << 20  # far past any core's caches (a whole host's L3 may be larger: it is shared)


def memory_read_GBps(nbytes: int = MEMORY_PROBE_BYTES, passes: int = 3) -> float | None:
    """One core's streaming read rate now, GB/s: the fastest of `passes` sums over `nbytes` of float64.

    Why beside the load average: on a shared host, other tenants' memory traffic slows a memory-bound
    decode while this machine's load stays quiet (here, identical notebook runs took 569, 650 and 743 s in
    one day while this probe's two-core equivalent fell from 26.7 to 19.6 GB/s). None if it cannot run."""
    import numpy as np

    try:
        data = np.ones(nbytes // 8)
    except MemoryError:
        return None
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return round(data.nbytes / best / 1e9, 2)


def over_core_count(load_1min: float | None, cores: float | None) -> bool:
    """Whether a 1-minute load average means other work competed with a run using every core."""
    return load_1min is not None and cores is not None and load_1min > cores + LOAD_MARGIN


def is_loaded(env: dict) -> bool:
    """Whether a run's recorded load means its timings are not comparable: any of its 1-minute loads
    (before, peak, after) above the core count by more than LOAD_MARGIN. The numbers are the evidence;
    the runner's own `loaded` flag speaks only where they are missing. False when nothing was recorded."""
    load = (env or {}).get("load") or {}
    first = lambda v: v[0] if isinstance(v, (list, tuple)) and v else v  # noqa: E731
    seen = [x for x in (first(load.get(k)) for k in ("before", "peak_1min", "after")) if isinstance(x, (int, float))]
    cores = load.get("cores")
    if seen and isinstance(cores, (int, float)):
        return over_core_count(max(seen), cores)
    return load.get("loaded") is True


class LoadSampler:
    """Samples the 1-minute load average every `every_s` seconds in a daemon thread while a run executes.

        sampler = LoadSampler().start()   # records `before`
        ...
        env["load"] = sampler.stop()      # {"cores", "before", "after", "peak_1min", "loaded", "samples",
                                          #  "memory_read_GBps": [at start, at stop]}

    `summary()` gives the same record so far (for a run still going); the peak includes before/after.
    """

    def __init__(self, every_s: float = LOAD_SAMPLE_EVERY_S):
        self.every_s = every_s
        self.cores = load_cores()
        self.before: list[float] | None = None
        self.after: list[float] | None = None
        self.peak_1min: float | None = None
        self.samples = 0
        self.memory_read: list[float | None] = []  # `memory_read_GBps` at start and at stop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> LoadSampler:
        self.memory_read = [memory_read_GBps()]
        self.before = load_now()
        self._note(self.before)
        self._thread = threading.Thread(target=self._loop, name="decodelab-load-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 1)
        self.after = load_now()
        self._note(self.after)
        self.memory_read.append(memory_read_GBps())
        return self.summary()

    def summary(self) -> dict:
        with self._lock:
            peak = self.peak_1min
            return {
                "cores": self.cores, "before": self.before, "after": self.after, "peak_1min": peak,
                "loaded": over_core_count(peak, self.cores), "samples": self.samples,
                "every_s": self.every_s, "memory_read_GBps": list(self.memory_read),
            }

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._note(load_now())

    def _note(self, load: list[float] | None) -> None:
        if load is None:
            return
        with self._lock:
            self.samples += 1
            self.peak_1min = load[0] if self.peak_1min is None else max(self.peak_1min, load[0])
