"""What machine a measurement ran on, for the records benchmarks and ablations write."""

from __future__ import annotations

import platform
from functools import cache


@cache
def processor_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ...", "AMD EPYC ..."): on Linux
    `platform.processor()` says only "x86_64", and figures from different CPUs must not pass
    for one machine's."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
