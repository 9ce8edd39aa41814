"""What machine a measurement ran on, for the records benchmarks and ablations write; a free port."""

from __future__ import annotations

import platform
import socket
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


def cpu_flags(wanted: tuple[str, ...]) -> list[str]:
    """Which of `wanted` (as /proc/cpuinfo spells them: "avx512_vnni", "amx_int8") this CPU has."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [f for f in wanted if f in flags]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for a server or a process group)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
