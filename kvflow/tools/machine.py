"""The machine a benchmark ran on, recorded beside its figures: ratios are comparable across
runs of one machine, and docs/benchmarks.md holds runs of two (one core's memory twice as fast on
the first)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import attrs

from kvflow.tools.baselines import flush_bytes, last_level_cache_bytes

__all__ = ["Machine", "cpu_model", "this_machine"]

_CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Path = _CPUINFO) -> str:
    """The first CPU's model name as Linux gives it (``model name`` in ``/proc/cpuinfo``), else
    what Python's :func:`platform.processor` says, else ``"unknown"``."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or "unknown"


@attrs.frozen
class Machine:
    """What a run's figures depend on: the CPU, the cores this process may run on, the largest
    cache the CPU reports (None where Linux says nothing) and what each cache flush reads."""

    cpu: str
    cores: int
    cache_bytes: int | None
    flush_bytes: int

    def describe(self) -> str:
        cache = "no cache size reported"
        if self.cache_bytes is not None:
            size = self.cache_bytes
            amount = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            cache = f"largest cache {amount}"
        return f"{self.cpu}, {self.cores} cores, {cache} (a cache flush reads {self.flush_bytes >> 20} MiB)"


def this_machine() -> Machine:
    """The machine this process runs on."""
    cache = last_level_cache_bytes()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Machine(cpu_model(), cores, cache, flush_bytes(cache))
