"""What this host's CPU is, from /proc/cpuinfo: its model name and the feature flags that pick kernels."""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The flags that decide which matmul units and vector widths a CPU offers (reported beside every number).
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
                "asimddp", "i8mm")


def _field(name: str, cpuinfo: Path) -> str | None:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == name), None)


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags (x86 `flags`, arm64 `Features`); empty where the file says neither."""
    return set((_field("flags", cpuinfo) or _field("Features", cpuinfo) or "").split())


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    return _field("model name", cpuinfo) or "unknown CPU"


def describe(cpuinfo: Path = CPUINFO) -> str:
    """One line: the model name and which of MATMUL_FLAGS it has."""
    flags = cpu_flags(cpuinfo)
    return f"{cpu_model(cpuinfo)} ({' '.join(f for f in MATMUL_FLAGS if f in flags) or 'no matmul extensions'})"


def usable_threads() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count): what peers are given."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
