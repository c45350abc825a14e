"""The examples and the demo run as a user runs them, and prove what they claim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "script", ["examples/custom_engine.py", "examples/async_script.py", "examples/layerwise_engine.py"]
)
def test_example_runs_and_verifies(script: str) -> None:
    proc = run(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "True" in proc.stdout


def test_two_processes_share_kv_through_the_local_backend(tmp_path: Path) -> None:
    proc = run("examples/multiprocess_local.py", f"local://{tmp_path}/store")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stored 8 blocks" in proc.stdout and "identical: True" in proc.stdout


def test_demo_verifies_every_retrieved_block() -> None:
    proc = run("-m", "kvflow.cli", "demo", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True
    assert summary["blocks_retrieved"] == summary["blocks_verified"] > 0
    assert summary["blocks_stored"] > 0 and summary["blocks_reused"] > 0
    for key in ("store_gbps", "retrieve_gbps", "memcpy_gbps"):
        assert summary[key] > 0


def test_bench_reports_ratios_against_memcpy() -> None:
    proc = run("-m", "kvflow.cli", "bench", "--quick", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["backend"] == "memory://"
    assert len(result["store_retrieve"]) == 2
    for row in result["store_retrieve"]:
        assert row["retrieve_vs_memcpy"] == pytest.approx(row["retrieve_gbps"] / row["memcpy_gbps"])
        assert row["store_gbps"] > 0
    assert result["lookup_10k_ms"] > 0 and result["pipeline"]["store_us_per_block"] > 0


def test_demo_runs_on_the_local_shared_memory_backend(tmp_path: Path) -> None:
    proc = run("-m", "kvflow.cli", "demo", "--backend", f"local://{tmp_path}/store", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True and summary["blocks_retrieved"] > 0
    assert any((tmp_path / "store").rglob("*")), "the demo wrote no object files"
