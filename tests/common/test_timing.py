"""The shared timers' memory peak: what the CPU allocator trace counts."""
import torch

from decodelab.common.timing import PeakMemory, peak_above_entry


def test_peak_above_entry_measures_from_the_counter_before_the_first_event():
    # counter at entry 100 (left by earlier work), +50, +30, -80: peak 180 -> 80 above entry
    assert peak_above_entry([(50, 150), (30, 180), (-80, 100)]) == 80
    assert peak_above_entry([(-40, 60), (10, 70)]) == 0  # frees only: nothing above entry
    assert peak_above_entry([]) == 0


def test_cpu_allocator_peak_does_not_charge_bytes_an_earlier_trace_left_in_the_counter():
    kept = []
    with PeakMemory("cpu", how="allocator"):
        kept.append(torch.ones(1 << 20))  # 4 MiB allocated inside a trace ...
    kept.clear()  # ... and freed outside one: the profiler's process-wide counter keeps its bytes
    with PeakMemory("cpu", how="allocator") as memory:
        torch.ones(1 << 18).sum()  # a 1 MiB block
    assert (1 << 20) <= memory.peak_bytes < (1 << 20) + (64 << 10)
