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


PEAK_MEMORY_HOWS = ("process", "allocator")


class PeakMemory:
    """Peak memory a block adds above what was live when it started, in bytes (`.peak_bytes`).

    CUDA (either `how`): torch.cuda.max_memory_allocated above the allocated bytes at entry.
    CPU, how="process" (the default): the process's peak RSS (VmHWM, reset at entry by writing 5 to
    /proc/self/clear_refs) above its RSS at entry, after a garbage collection and malloc_trim so freed
    memory from earlier work is returned first. It sees everything the process maps (tensors, caches,
    Python objects), which is what a whole decoding call costs.
    CPU, how="allocator": the largest running "Total Allocated" of PyTorch's CPU allocator over the block,
    from `torch.profiler(profile_memory=True)`'s record of every allocation and free. Tensor bytes only, and
    deterministic (same work -> same bytes). The MTP training-step comparison needs this one: its steps
    run warm (their buffers were allocated and freed by a warm-up step), so glibc hands the same pages
    back and RSS barely moves, and the differences it compares (one head's (B, T, V) logits against n
    heads') are a few MiB inside a process of hundreds; the allocator trace counts them exactly. (Not
    tracemalloc: it does not see tensor storage.) No garbage collection or trim runs first: freeing
    nothing changes what the allocator reports, and the trace's counter carries allocations still alive
    from earlier traced blocks, which a collection would change.
    `.how` says which instrument measured: "cuda_max_allocated", "vmhwm", "maxrss_unreset" (no reset was
    possible: the peak may predate the block) or "cpu_allocator_trace".
    """

    def __init__(self, device, *, how: str = "process"):
        if how not in PEAK_MEMORY_HOWS:
            raise ValueError(f"how={how!r} must be one of {PEAK_MEMORY_HOWS}")
        self.device = torch.device(device)
        self.requested = how

    def __enter__(self):
        import gc

        if self.device.type == "cuda":
            if self.requested == "process":
                gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.how = "cuda_max_allocated"
            return self
        if self.requested == "allocator":
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
            self.how = "cpu_allocator_trace"
            return self
        gc.collect()
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(int(torch.cuda.max_memory_allocated(self.device) - self._base), 0)
        elif self.how == "cpu_allocator_trace":
            self._profile.__exit__(*exc)
            self.peak_bytes = _allocator_trace_peak(self._profile)
        else:
            self.peak_bytes = max(int(_proc_status_kb("VmHWM") * 1024 - self._base), 0)
        return False


def peak_above_entry(events: list[tuple[int, int]]) -> int:
    """Peak of a running allocation counter above its value before the first event: events [(bytes, total
    after the event)] in order (bytes < 0 for a free) -> bytes (0 for no events or nothing above entry)."""
    if not events:
        return 0
    entry = events[0][1] - events[0][0]
    return max(0, max(total for _, total in events) - entry)


def _allocator_trace_peak(prof) -> int:
    """Peak CPU "Total Allocated" of a finished profiler's memory events above its value just before the first
    one (0 if none). Not the counter's raw maximum: the counter is process-wide and keeps the bytes of every
    tensor allocated inside an earlier trace and freed outside one, which the raw maximum would charge here."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle)["traceEvents"]
    finally:
        os.unlink(path)
    memory = [e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0]
    memory.sort(key=lambda e: e["ts"])  # stable: events sharing a timestamp keep the trace's order
    return peak_above_entry([(e["args"]["Bytes"], e["args"]["Total Allocated"]) for e in memory])


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
