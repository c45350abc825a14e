"""The examples and the demo run as a user runs them, and prove what they claim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.profiles import is_book_key

ROOT = Path(__file__).resolve().parents[1]


def kv_files(store: Path) -> list[Path]:
    """The store's KV objects (the profile book's announcements are the store's, not a run's)."""
    return [p for p in (store / "objects").iterdir() if not is_book_key(p.name)]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "script", ["examples/custom_engine.py", "examples/async_script.py", "examples/layerwise_engine.py"]
)
def test_example_runs_and_verifies(script: str, tmp_path: Path) -> None:
    proc = run(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "True" in proc.stdout
    # On a store that outlives the run, the example removes what it stored.
    proc = run(script, f"local://{tmp_path}/store")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "True" in proc.stdout
    assert kv_files(tmp_path / "store") == []


def test_two_processes_share_kv_through_the_local_backend(tmp_path: Path) -> None:
    proc = run("examples/multiprocess_local.py", f"local://{tmp_path}/store")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stored 8 blocks" in proc.stdout and "identical: True" in proc.stdout
    assert kv_files(tmp_path / "store") == []  # it removed what it stored
    kept = run("examples/multiprocess_local.py", f"local://{tmp_path}/store", "--keep")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert len(kv_files(tmp_path / "store")) == 8


def test_the_multiprocess_example_cleans_up_its_own_store() -> None:
    before = set(Path("/dev/shm").glob("kvflow-example-*"))
    proc = run("examples/multiprocess_local.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical: True" in proc.stdout
    assert set(Path("/dev/shm").glob("kvflow-example-*")) == before


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
        # puts and gets stream: both against the faster of memmove and the streamed copy (regions
        # gathered for a store, scattered for a retrieve)
        best = max(row["memcpy_gbps"], row["streamed_memcpy_gbps"])
        assert row["best_memcpy_gbps"] == best
        memcpy = {"store": best, "retrieve": best}
        regions = {"store": row["regions_gbps"], "retrieve": row["retrieve_regions_gbps"]}
        floor = {"store": row["floor_gbps"], "retrieve": row["retrieve_floor_gbps"]}
        assert row["floor_vs_memcpy"] == pytest.approx(row["floor_gbps"] / memcpy["store"])
        assert row["retrieve_floor_vs_memcpy"] == pytest.approx(
            row["retrieve_floor_gbps"] / memcpy["retrieve"]
        )
        for op in ("store", "retrieve"):
            assert row[f"{op}_gbps"] > 0 and regions[op] > 0
            assert row[f"{op}_vs_memcpy"] == pytest.approx(row[f"{op}_gbps"] / memcpy[op])
            assert row[f"{op}_vs_regions"] == pytest.approx(row[f"{op}_gbps"] / regions[op])
            # the floor adds the hash chain to the region copies: never faster than the copies alone
            assert 0 < floor[op] < regions[op]
            assert row[f"{op}_vs_floor"] == pytest.approx(row[f"{op}_gbps"] / floor[op])
            # the bare call does the floor's work and more
            assert 0 < row[f"bare_{op}_gbps"] < floor[op] * 1.5
            assert row[f"bare_{op}_vs_memcpy"] == pytest.approx(row[f"bare_{op}_gbps"] / memcpy[op])
            assert row[f"{op}_vs_bare"] == pytest.approx(row[f"{op}_gbps"] / row[f"bare_{op}_gbps"])
    assert result["lookup_10k_ms"] > 0 and result["pipeline"]["store_us_per_block"] > 0


def test_demo_runs_on_the_local_shared_memory_backend(tmp_path: Path) -> None:
    url = f"local://{tmp_path}/store"
    store = tmp_path / "store"

    def demo(*extra: str) -> dict[str, int]:
        proc = run("-m", "kvflow.cli", "demo", "--backend", url, "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout)
        assert summary["verified"] is True and summary["blocks_retrieved"] > 0
        return summary  # type: ignore[no-any-return]

    first = demo()
    assert first["blocks_found"] == 0 and first["blocks_removed"] == first["blocks_stored"] > 0
    assert kv_files(store) == []  # it removed what it stored
    kept = demo("--keep")
    assert kept["blocks_removed"] == 0 and len(kv_files(store)) == kept["blocks_stored"]
    again = demo()  # finds the kept blocks from the earlier run, stores and removes nothing
    assert again["blocks_found"] == kept["blocks_stored"] and again["blocks_stored"] == 0
    assert again["blocks_removed"] == 0 and len(kv_files(store)) == kept["blocks_stored"]


def test_the_staged_demo_verifies_and_the_staged_bench_reports_both_paths() -> None:
    """The device path, forced on the CPU: the demo verifies every block; the bench measures the
    staged and the direct path in one run."""
    demo = run("-m", "kvflow.cli", "demo", "--staged", "--json")
    assert demo.returncode == 0, demo.stderr
    summary = json.loads(demo.stdout)
    assert summary["verified"] is True and summary["staged"] is True and summary["blocks_retrieved"] > 0
    bench = run("-m", "kvflow.cli", "bench", "--staged", "--quick", "--json")
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout)
    assert result["device"] == "cpu"
    for op in ("store", "retrieve"):
        ratio = result[f"staged_{op}_gbps"] / result[f"direct_{op}_gbps"]
        assert result[f"{op}_staged_vs_direct"] == pytest.approx(ratio)
