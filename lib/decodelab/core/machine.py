"""What this machine is, cheaply and without torch: the CPU model string that keys per-machine caches and records.

`platform.processor()` is empty on many Linux VMs (and names only the architecture elsewhere), so two different
hosts behind one hostname pool would share a cache key; /proc/cpuinfo's "model name" tells them apart.
"""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """"AMD EPYC 9R14", "Intel(R) Xeon(R) Platinum 8488C", ...; the platform's processor or machine name where
    /proc/cpuinfo has no model name (macOS, some ARM boards)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
