"""The machine a benchmark ran on, as ``kvflow bench`` records it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvflow.tools import machine
from kvflow.tools.baselines import flush_bytes, last_level_cache_bytes
from kvflow.tools.machine import Machine, cpu_model, this_machine


def test_the_cpu_model_is_the_first_model_name_linux_gives(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 143\n"
        "model name\t: Intel(R) Xeon(R) Processor\n\nprocessor\t: 1\nmodel name\t: Other\n"
    )
    assert cpu_model(cpuinfo) == "Intel(R) Xeon(R) Processor"  # not "model", nor the second CPU's


def test_without_a_model_name_the_cpu_model_is_pythons_word_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(machine.platform, "processor", lambda: "arm")
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t:\n")  # (an empty one counts not)
    assert cpu_model(tmp_path / "cpuinfo") == "arm"
    assert cpu_model(tmp_path / "missing") == "arm"
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    assert cpu_model(tmp_path / "missing") == "unknown"


def test_this_machine_is_the_one_the_process_runs_on() -> None:
    here = this_machine()
    assert here.cores == len(os.sched_getaffinity(0))
    assert here.cache_bytes == last_level_cache_bytes()
    assert here.flush_bytes == flush_bytes(here.cache_bytes)
    assert here.cpu and here.cpu == cpu_model()


def test_a_machine_describes_its_cores_cache_and_flush() -> None:
    text = Machine("Some CPU", 2, 300 << 20, 1 << 30).describe()
    assert text == "Some CPU, 2 cores, largest cache 300 MiB (a cache flush reads 1024 MiB)"
    assert "no cache size reported" in Machine("Some CPU", 8, None, 256 << 20).describe()
    assert "largest cache 512 KiB" in Machine("Some CPU", 1, 512 << 10, 256 << 20).describe()
