"""The tools at their edges (`kvflow demo`, `kvflow bench`, `kvflow store`, the CLI): a verdict
that cannot pass on lost or wrong bytes, nothing left in a store, clear errors. Every store lives
in pytest's tmp_path."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import attrs
import pytest
import torch

from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends import GetStatus, ObjectRef, PutStatus
from kvflow.cli import main
from kvflow.tools import bench, bench_scale
from kvflow.tools.demo import run_demo
from kvflow.tools.store_admin import clear_store, read_inventory
from kvflow.tools.workload import Geometry
from tests.helpers import FaultyBackend, _book

SMALL = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)

# --- kvflow demo ----------------------------------------------------------------------------------


@attrs.define
class DownAfterTwoPuts(FaultyBackend):
    """A store that takes the first two KV puts, then fails every put (the profile book's pass)."""

    ok_puts: int = 2

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if not _book(objects):
            self.ok_puts -= 1
            if self.ok_puts < 0:
                raise ConnectionError("injected: the store went down")
        return await super().put(objects)


async def test_demo_is_not_verified_when_most_stores_failed() -> None:
    """README: the demo "exits non-zero if anything did not verify": a run whose stores failed (so most
    blocks are never retrieved) is NOT VERIFIED, though every block it did retrieve is right."""
    summary = await run_demo(geometry=SMALL, progress=False, backend=DownAfterTwoPuts())  # type: ignore[arg-type]
    assert summary.blocks_stored < 10  # the store failed nearly everything
    assert summary.blocks_retrieved < summary.blocks_requested
    assert not summary.verified, summary.as_dict()


async def test_demo_on_a_local_store_removes_only_what_it_stored(tmp_path: Path) -> None:
    """A workload prefix stored before the run (by "someone else") is found,
    reused and left in place; what the demo stored itself is removed; another model's object stays."""
    url = f"local://{tmp_path}/store?capacity=64MiB"
    from kvflow.keys import hash_blocks
    from kvflow.tools.workload import chat_workload, fill_block, make_kv_caches

    first = chat_workload(SMALL.block_size)[0]
    hashes = hash_blocks(first, SMALL.block_size)[:3]
    caches = make_kv_caches(SMALL, 4)
    for i, h in enumerate(hashes):
        fill_block(caches, SMALL, i, h)
    layout = KVLayout.from_kv_caches(caches)
    async with KVPool.create(PoolConfig(backend=url, model="demo-llama"), layout=layout) as pool:
        assert (await pool.store(KVRequest(block_ids=[0, 1, 2], block_hashes=hashes))).stored == 3
    async with KVPool.create(PoolConfig(backend=url, model="other"), layout=layout) as pool:
        assert (await pool.store(KVRequest(block_ids=[0], block_hashes=hashes[:1]))).stored == 1
    summary = await run_demo(url, geometry=SMALL, progress=False)
    assert summary.verified and summary.blocks_found == 3
    assert summary.blocks_removed == summary.blocks_stored
    kv = [o for o in (await read_inventory(url)).objects if o.kind == "kv"]
    assert sorted(o.model or "" for o in kv) == ["demo-llama"] * 3 + ["other"]


# --- kvflow bench ---------------------------------------------------------------------------------


@attrs.define
class CopiesOnlyOnce(FaultyBackend):
    """Copies a key's bytes on its first get; later gets of it answer HIT and copy nothing."""

    seen: set[str] = attrs.field(factory=set)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if _book(objects):
            return await self.inner.get(objects)
        fresh = [o for o in objects if o.key not in self.seen]
        if fresh:
            await self.inner.get(fresh)
        self.seen.update(o.key for o in objects)
        return [GetStatus.HIT] * len(objects)


async def test_bench_verifies_the_retrieves_it_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/benchmarks.md: the benchmarks "verify what they moved": every timed retrieve, not only the
    first, must bring every byte (a retrieve that moved nothing would be the fastest, and best-of
    would report it)."""
    real_open = bench.open_backend
    made: list[CopiesOnlyOnce] = []

    def open_backend(url: str) -> CopiesOnlyOnce:
        made.append(CopiesOnlyOnce(inner=real_open(url)))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(bench, "open_backend", open_backend)
    with pytest.raises(RuntimeError):
        await bench._store_retrieve("memory://", 16 << 10, 4, repeat=2)


@pytest.mark.parametrize("case", ["store_retrieve", "lookup"])
async def test_bench_removes_its_kv_when_a_run_fails(case: str, tmp_path: Path) -> None:
    """docs/benchmarks.md: `kvflow bench --backend URL` removes the KV it stored, so it may be pointed at a
    store in use: also when a run fails part-way (here a store too small for one batch)."""
    url = f"local://{tmp_path}/store?capacity=" + ("40KiB" if case == "store_retrieve" else "1MiB")
    with pytest.raises(RuntimeError):
        if case == "store_retrieve":
            await bench._store_retrieve(url, 16 << 10, 4, repeat=2)
        else:
            await bench._lookup_ms(url, 10_000)
    left = [o for o in (await read_inventory(url)).objects if o.kind == "kv"]
    assert not left, f"{len(left)} KV objects of {left[0].model} left in the store"


async def test_bench_removes_only_its_own_kv(tmp_path: Path) -> None:
    """Another model's object in the same store is not touched (the profile announcements the
    bench leaves are documented in docs/benchmarks.md)."""
    url = f"local://{tmp_path}/store?capacity=64MiB"
    caches = {"l0": torch.randn(4, 1, 16, 8, dtype=torch.float16)}
    async with KVPool.create(
        PoolConfig(backend=url, model="bench"), layout=KVLayout.from_kv_caches(caches)
    ) as pool:
        assert (await pool.store(KVRequest(block_ids=[0], tokens=list(range(16))))).stored == 1
    await bench._store_retrieve(url, 16 << 10, 4, repeat=2)
    await bench._lookup_ms(url, 20)
    objects = (await read_inventory(url)).objects
    assert [(o.kind, o.model) for o in objects if o.kind == "kv"] == [("kv", "bench")]
    assert all(o.kind in ("kv", "profiles") for o in objects)


async def test_bench_catches_a_backend_that_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "open_backend", lambda url: bench.NullBackend())
    with pytest.raises(RuntimeError, match="different bytes"):
        await bench._store_retrieve("memory://", 16 << 10, 4, repeat=2)


@pytest.mark.parametrize("run", ["store_size", "many_requests"])
async def test_bench_scale_checks_the_bytes_it_retrieved(run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvflow bench --scale` verifies what it moved too: a backend that answers every get HIT
    and copies nothing reports every block loaded, so only the bytes can tell."""
    monkeypatch.setattr(bench_scale, "open_backend", lambda url: bench.NullBackend())
    with pytest.raises(RuntimeError, match="other bytes than were stored"):
        if run == "store_size":
            await bench_scale._per_block_us("memory://", 0)
        else:
            await bench_scale._many_requests("memory://", 4, 2)


@pytest.mark.parametrize("mode", ["--layerwise", "--staged", "--topology"])
def test_bench_modes_do_not_silently_ignore_backend(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--layerwise, --staged and --topology run on an in-process store of their own: a --backend given with
    them is refused, not dropped without a word."""
    ran: list[str] = []
    monkeypatch.setattr("kvflow.tools.bench_layerwise.layerwise_main", lambda **k: ran.append("l") or 0)
    monkeypatch.setattr("kvflow.tools.bench_staged.staged_main", lambda **k: ran.append("s") or 0)
    monkeypatch.setattr("kvflow.tools.bench_topology.topology_main", lambda **k: ran.append("t") or 0)
    try:
        rc = main(["bench", mode, "--backend", "local:///tmp/some-store"])
    except SystemExit as exc:
        rc = exc.code  # type: ignore[assignment]
    assert rc != 0 or not ran, "the --backend was silently ignored"


# --- kvflow store ---------------------------------------------------------------------------------


def test_store_stats_creates_nothing_in_a_directory_that_is_no_store(tmp_path: Path) -> None:
    """docs/operations.md: for local stores "the directory must be a store an engine made": a directory
    that is not a store (a typo naming a home directory) is refused, and nothing is made in it."""
    plain = tmp_path / "just-a-directory"
    plain.mkdir(mode=0o700)  # private, as a home directory is (a 0755 one is refused, with "run chmod 700")
    rc = main(["store", "stats", f"local://{plain}"])
    assert sorted(p.name for p in plain.iterdir()) == [], (
        f"rc={rc}, created {sorted(p.name for p in plain.iterdir())}"
    )


def test_clear_with_an_empty_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model ""` (an unset shell variable, say) is refused, not announced as "every kvflow object" and
    then matched against nothing."""
    store = tmp_path / "store"
    anyio.run(_fill_two_models, f"local://{store}")
    rc = main(["store", "clear", f"local://{store}", "--model", "", "--yes"])
    out = capsys.readouterr()
    assert rc != 0 and "model" in out.err, (rc, out.out)


async def _fill_two_models(url: str, models: Sequence[str] = ("a", "ab")) -> None:
    caches = {"l0": torch.randn(4, 1, 16, 8, dtype=torch.float16)}
    for model in models:
        async with KVPool.create(
            PoolConfig(backend=url, model=model), layout=KVLayout.from_kv_caches(caches)
        ) as pool:
            assert (await pool.store(KVRequest(block_ids=[0, 1], tokens=list(range(33))))).stored == 2


def test_clear_and_ls_match_the_model_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model a` never touches "ab", "A", "a b", "a@b" or "%61"."""
    url = f"local://{tmp_path}/store"
    models = ("a", "ab", "A", "a b", "a@b", "%61", "a/")
    anyio.run(_fill_two_models, url, models)
    assert main(["store", "ls", url, "--model", "a", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {o["model"] for o in listed} == {"a"} and len(listed) == 3  # 2 blocks + 1 announcement
    assert main(["store", "clear", url, "--model", "a", "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 3
    left = anyio.run(read_inventory, url).objects
    assert sorted({o.model or "" for o in left}) == sorted(set(models) - {"a"})
    assert len(left) == 3 * (len(models) - 1)


def test_clear_refuses_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2, nothing removed."""
    url = f"local://{tmp_path}/store"
    anyio.run(_fill_two_models, url)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["store", "clear", url]) == 2
    assert len(anyio.run(read_inventory, url).objects) == 6
    assert anyio.run(clear_store, url) == {"removed": 6, "failed": 0}


# --- the CLI --------------------------------------------------------------------------------------


def test_demo_with_a_bad_url_says_what_to_do_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad URL is a one-line error and exit 2 (not a traceback with exit 1, NOT VERIFIED's code)."""
    assert main(["demo", "--backend", "foo://"]) == 2
    assert "unknown backend URL 'foo://'" in capsys.readouterr().err


def test_a_models_name_finds_its_objects_under_every_engine_variant() -> None:
    """A vLLM engine keys its model as ``name#variant`` (kvflow.integrations.vllm.topology): ``--model
    name`` finds those, and never another name's."""
    from kvflow.tools.store_admin import _names

    assert _names("llama", "llama") and _names("llama#0123456789abcdef", "llama")
    assert not _names("llama2#0123456789abcdef", "llama") and not _names("llama#x", "llama")
    assert not _names("llama#0123456789abcdef", "llama#") and not _names("a#llama", "llama")
