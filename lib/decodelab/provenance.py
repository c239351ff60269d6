"""Provenance: versions, hardware and git state recorded beside every run's outputs.

Cheap to call from the runner process: nothing here imports torch (the kernel reports its own torch
build through `kernel_env`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def repo_root() -> Path:
    """The checkout holding lib/decodelab (two levels above this package)."""
    return Path(__file__).resolve().parents[2]


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
        "cpu": {"model": _cpu_model(), "cores": os.cpu_count(), "usable_cores": _usable_cores()},
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


def _cpu_model() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
