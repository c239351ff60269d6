"""Timing and memory of a call, measured one way everywhere: host-synchronized wall clock, interleaved
repeats when two calls are compared, the minimum kept as the cost (noise only adds time) with the spread
beside it, and peak memory above what was live at entry.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from decodelab.core.engine import synchronize


def timed(fn: Callable, device: torch.device | str = "cpu"):
    """Run fn() once between two device synchronizations: -> (its result, wall seconds)."""
    device = torch.device(device)
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def repeat_times(fn: Callable, repeats: int, device: torch.device | str = "cpu", *, warmup: int = 0) -> list[float]:
    """Seconds of `repeats` synchronized calls of fn(), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return [timed(fn, device)[1] for _ in range(repeats)]


def best_time(fn: Callable, repeats: int, device: torch.device | str = "cpu") -> float:
    """The fastest of `repeats` synchronized calls: the call's cost on a quiet machine."""
    return min(repeat_times(fn, repeats, device))


def alternating_times(calls: dict[str, Callable], repeats: int, device: torch.device | str = "cpu", *,
                      warmup: bool = True) -> dict[str, list[float]]:
    """{name: [seconds per call]}: one warm-up each, then `repeats` rounds, the call order flipping each
    round, so drift in the machine's speed falls on every call alike."""
    if warmup:
        for call in calls.values():
            call()
    names, times = list(calls), {name: [] for name in calls}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed(calls[name], device)[1])
    return times


class PeakMemory:
    """Peak memory a block adds above what was live when it started, in bytes (`.peak_bytes`).

    CUDA: torch.cuda.max_memory_allocated above the allocated bytes at entry. CPU: the process's peak RSS
    (VmHWM, reset at entry by writing 5 to /proc/self/clear_refs) above its RSS at entry, after a garbage
    collection and malloc_trim so freed memory from earlier work is returned first. `.how` says which.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)

    def __enter__(self):
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.how = "cuda_max_allocated"
            return self
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.how = "vmhwm"
        except OSError:  # no reset: the peak may predate the block (reported as such)
            self.how = "maxrss_unreset"
        self._base = _proc_status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _proc_status_kb("VmHWM") * 1024
        self.peak_bytes = max(int(peak - self._base), 0)
        return False


def _proc_status_kb(field_name: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
