"""The staging path (how device caches move), proven on the CPU through the same code.

``PoolConfig(staging="always")`` makes a pool over host caches move every block through its host
staging chunks, exactly as it does for a GPU or NPU cache over a backend that cannot reach device
memory. :class:`LateDevice` stands in for a device: its copies run only when their event completes,
at a random later moment, and its events say so only then; a test can also make it fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import anyio
import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvflow import (
    ConfigError,
    GetStatus,
    KVLayout,
    KVPool,
    KVRequest,
    LayoutError,
    MemoryBackend,
    ParallelConfig,
    PoolConfig,
    PutStatus,
)
from kvflow.backends import ObjectRef
from kvflow.device import Device
from kvflow.events import CpuEvent
from kvflow.profiles import is_book_key
from kvflow.transfer import staging as staging_module
from kvflow.transfer.staging import Chunk, StagingPool
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, block_bytes, kv_keys, zeros_like_caches

TOKENS = list(range(700, 700 + BLOCK * 10))
SRC_IDS = [3, 1, 4, 0, 5, 9, 2, 6, 11, 7]
DST_IDS = [10, 11, 7, 8, 0, 1, 2, 3, 4, 5]


def staged(layerwise: bool = False, staging_bytes: int = 3 * 4096, timeout_s: float = 10.0) -> PoolConfig:
    """A pool config whose staging holds only a few objects: every request goes in chunks."""
    return PoolConfig(staging="always", staging_bytes=staging_bytes, layerwise=layerwise, timeout_s=timeout_s)


@attrs.define(eq=False)
class LateEvent:
    """Completes ``delay_s`` after it is recorded, running ``on_complete`` (the copies) first."""

    delay_s: float
    on_complete: list[object] = attrs.field(factory=list)
    _at: float | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def record(self) -> None:
        self._at = time.monotonic() + self.delay_s

    def query(self) -> bool:
        with self._lock:
            if self._at is None or time.monotonic() < self._at:
                return False
            while self.on_complete:
                self.on_complete.pop(0)()  # type: ignore[operator]
            return True


@attrs.define(eq=False)
class LateDevice(Device):
    """A CPU "device" whose copies happen only when the event recorded after them completes
    (at a random delay up to ``max_delay_s``), like a copy stream the host does not wait for."""

    max_delay_s: float = 0.02
    fail_gather: bool = False
    fail_scatter: bool = False
    fail_gather_calls: set[int] = attrs.field(factory=set)  # these calls (0, 1, ...) fail
    fail_scatter_calls: set[int] = attrs.field(factory=set)
    gathers: int = 0
    scatters: int = 0
    _queued: list[object] = attrs.field(factory=list)
    rng: random.Random = attrs.field(factory=lambda: random.Random(7))

    def gather_rows(self, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        self.gathers += 1
        if self.fail_gather or self.gathers - 1 in self.fail_gather_calls:
            raise RuntimeError("injected device error in a copy out of the cache")
        index = index.clone()
        self._queued.append(lambda: torch.index_select(source, 0, index, out=out))

    def scatter_rows(
        self, target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor | None = None
    ) -> None:
        self.scatters += 1
        rows = rows[: len(index)] if pick is None else rows.index_select(0, pick)
        if self.fail_scatter or self.scatters - 1 in self.fail_scatter_calls:
            target.index_copy_(0, index[:1], rows[:1])  # half-written, then the device errs
            raise RuntimeError("injected device error in a copy into the cache")
        index, rows = index.clone(), rows.clone()
        self._queued.append(lambda: target.index_copy_(0, index, rows))

    def record(self) -> LateEvent:  # type: ignore[override]
        event = LateEvent(self.rng.uniform(0, self.max_delay_s), on_complete=self._queued)
        self._queued = []
        event.record()
        return event


def late_device() -> LateDevice:
    return LateDevice(torch.device("cpu"))


def pool(
    caches: dict[str, object], backend: object, config: PoolConfig, device: Device | None = None
) -> KVPool:
    return KVPool.create(config, layout=KVLayout.from_kv_caches(caches), backend=backend, device=device)  # type: ignore[arg-type]


def same_blocks(src: dict[str, object], dst: dict[str, object], pairs: Sequence[tuple[int, int]]) -> bool:
    return all(block_bytes(dst[n], d) == block_bytes(src[n], s) for s, d in pairs for n in src)


@pytest.mark.parametrize("layerwise", [False, True])
async def test_every_layout_round_trips_bit_exact_through_staging(layout_name: str, layerwise: bool) -> None:
    src = LAYOUTS[layout_name]()
    dst = zeros_like_caches(src)
    backend = MemoryBackend()
    writer = pool(src, backend, staged(layerwise), late_device())
    reader = pool(dst, backend, staged(layerwise), late_device())
    stored = await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    assert stored.stored == 10 and stored.ok
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.hit_blocks == 10  # retrieve returns once every deferred copy has run
    assert same_blocks(src, dst, list(zip(SRC_IDS, DST_IDS)))


async def test_staging_is_allocated_once_reused_and_bounded() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    writer = pool(src, backend, staged(staging_bytes=2 * 4096), late_device())
    staging = writer._transfer.staging
    assert staging is not None and staging.allocations == 1 and writer._transfer.shape(None).capacity == 2
    for n in range(8):  # requests of up to 10 blocks through 2-object chunks
        tokens = [n, *TOKENS[1:]]
        await writer.store(KVRequest(block_ids=SRC_IDS[: n + 3], tokens=tokens))
        dst = zeros_like_caches(src)
        reader = pool(dst, backend, staged(staging_bytes=2 * 4096), late_device())
        got = await reader.retrieve(KVRequest(block_ids=DST_IDS[: n + 3], tokens=tokens))
        assert got.hit_blocks == n + 3
        assert same_blocks(src, dst, list(zip(SRC_IDS[: n + 3], DST_IDS[: n + 3])))
    assert staging.allocations == 1 and staging.peak_in_use == 1 and staging.in_use == 0


async def test_concurrent_requests_share_the_staging_chunks_and_all_complete() -> None:
    src = LAYOUTS["kv_tuple"]()
    backend = MemoryBackend()
    writer = pool(src, backend, staged(staging_bytes=4096), late_device())  # one chunk of one object
    requests = [KVRequest(block_ids=[i, i + 6], tokens=[i, *TOKENS[1 : 2 * BLOCK]]) for i in range(6)]
    results: list[object] = []
    async with anyio.create_task_group() as tg:
        for request in requests:
            tg.start_soon(lambda r: _append(results, writer.store(r)), request)
    assert sorted(r.stored for r in results) == [2] * 6  # type: ignore[attr-defined]
    staging = writer._transfer.staging
    assert staging is not None and staging.allocations == 1 and staging.in_use == 0


async def _append(results: list[object], call: object) -> None:
    results.append(await call)  # type: ignore[misc]


async def test_a_store_reads_no_block_before_the_engines_event() -> None:
    """The engine's event completes late; the "forward" writes the blocks' final bytes just before
    it does. What is stored must be those final bytes."""
    src = LAYOUTS["flash_attn"]()
    backend = MemoryBackend()
    writer = pool(src, backend, staged(), late_device())
    final = {name: t.clone() + 1 for name, t in src.items()}  # type: ignore[attr-defined]

    def forward_finishes() -> None:
        for name, tensor in src.items():
            tensor.copy_(final[name])  # type: ignore[attr-defined]

    forward = LateEvent(0.05, on_complete=[forward_finishes])
    forward.record()
    released: list[float] = []
    stored = await writer.store(
        KVRequest(block_ids=SRC_IDS, tokens=TOKENS), after=forward, on_released=lambda: released.append(1)
    )
    assert stored.stored == 10 and released == [1]
    dst = zeros_like_caches(src)
    got = await pool(dst, backend, staged()).retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.hit_blocks == 10 and same_blocks(final, dst, list(zip(SRC_IDS, DST_IDS)))


@pytest.mark.parametrize("comes_after_s", [0.6, 3600.0])
@pytest.mark.parametrize("staging", ["always", "never"])
async def test_a_store_whose_engine_event_comes_too_late_gives_up(staging: str, comes_after_s: float) -> None:
    """The forward completes only after the store's deadline (0.6 s after a 0.1 s one), or never:
    the store, staged or not, waits for it only until its deadline, reads no block and stores
    nothing."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    config = attrs.evolve(staged(timeout_s=0.1), staging=staging)
    writer = pool(src, backend, config, late_device() if staging == "always" else None)
    late = LateEvent(comes_after_s)
    late.record()
    with anyio.fail_after(10):  # a guard against a hang; the store ends at its own 0.1 s deadline
        stored = await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS), after=late)
    assert stored.stored == 0 and stored.failed_indices == tuple(range(10))
    assert kv_keys(backend) == []  # nothing was read from the cache, nothing stored
    staged_pool = writer._transfer.staging
    assert staged_pool is None if staging == "never" else staged_pool is not None and staged_pool.in_use == 0


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [(1, [True] * 3), (5, [False] * 4 + [True])],  # one chunk put in 3 batches; 5 chunks, one put each
)
async def test_a_store_releases_its_blocks_before_its_put_ends(chunks: int, expected: list[bool]) -> None:
    """Once the last chunk is copied out of the cache (before its puts), not after the puts."""
    src = LAYOUTS["vllm_cpu"]()
    gate = anyio.Event()
    seen_released: list[bool] = []
    released = anyio.Event()

    async def slow_put(objects: object) -> None:
        seen_released.append(released.is_set())
        if len(seen_released) == len(expected):
            await gate.wait()  # the last put waits until the test saw the release

    writer = pool(src, FaultyBackend(put_hook=slow_put), staged(staging_bytes=10 // chunks * 4096))
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS), on_released=released.set)
        )
        with anyio.fail_after(5):
            await released.wait()  # the blocks were copied out; the put is still waiting
        gate.set()
    assert seen_released == expected


async def test_a_store_copies_the_next_chunk_out_of_the_cache_while_it_puts_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Five chunks' worth of blocks through three chunks of two objects, on a device whose copies
    land late: every chunk's put starts only once the next chunk's copies were queued (on a GPU
    the copy stream runs beside the put), but the last one's. What is stored is the cache's bytes."""
    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 2 * 4096)
    src = LAYOUTS["vllm_cpu"]()
    device = late_device()
    queued: list[int] = []  # copies out of the cache queued when each put started

    async def record(objects: Sequence[ObjectRef]) -> None:
        queued.append(device.gathers)

    writer = pool(
        src, FaultyBackend(put_hook=record), staged(staging_bytes=3 * 2 * 3072), device
    )  # 3 KiB blocks
    stored = await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    per_chunk = len(src)  # one copy per layer
    assert stored.stored == 10
    assert queued == [2 * per_chunk, 3 * per_chunk, 4 * per_chunk, 5 * per_chunk, 5 * per_chunk]
    backend = writer._transfer.backend
    dst = zeros_like_caches(src)
    got = await pool(dst, backend, staged()).retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.hit_blocks == 10 and same_blocks(src, dst, list(zip(SRC_IDS, DST_IDS)))
    staging = writer._transfer.staging
    assert staging is not None and staging.in_use == 0 and staging.allocations == 3


async def test_a_store_by_layers_releases_its_blocks_once_the_last_layer_is_copied_out() -> None:
    """A pool that moves KV layer by layer stores a request one layer at a time through its one
    chunk: the blocks are released once the last layer is in staging, before that layer's put."""
    src = LAYOUTS["vllm_cpu"]()
    released = anyio.Event()
    seen_released: list[bool] = []

    async def record(objects: object) -> None:
        seen_released.append(released.is_set())

    writer = pool(src, FaultyBackend(put_hook=record), staged(layerwise=True, staging_bytes=1 << 20))
    stored = await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS), on_released=released.set)
    assert stored.stored == 10 and len(seen_released) > 1
    # the first layers' puts ran while later layers were still to be read; the last layer's did not
    assert not seen_released[0] and seen_released[-1] and seen_released == sorted(seen_released)


async def test_a_load_is_not_done_before_its_copies_into_the_cache() -> None:
    """With copies that land late, every face reports a layer or a block only once it is in place."""
    src = LAYOUTS["mla_tuple"]()
    backend = MemoryBackend()
    await pool(src, backend, staged(layerwise=True)).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    dst = zeros_like_caches(src)
    device = LateDevice(torch.device("cpu"), max_delay_s=0.05)
    reader = pool(dst, backend, staged(layerwise=True), device)
    request = KVRequest(request_id="r", block_ids=DST_IDS, tokens=TOKENS)
    names = list(src)
    async with reader.layerwise_retrieve([request], depth=2) as loader:
        async for outcome in loader:
            for event in outcome.ready:  # what an engine's stream would wait for
                with anyio.fail_after(5):
                    while not event.query():
                        await anyio.sleep(0.001)
            layer = {names[outcome.layer]: src[names[outcome.layer]]}
            assert same_blocks(layer, dst, list(zip(SRC_IDS, DST_IDS)))
    assert loader.results()[0].hit_blocks == 10


def test_the_synchronous_layerwise_face_waits_for_each_layers_copies() -> None:
    from kvflow import SyncLayerwisePool

    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    anyio.run(
        lambda: pool(src, backend, staged(layerwise=True)).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    )
    dst = zeros_like_caches(src)
    device = LateDevice(torch.device("cpu"), max_delay_s=0.05)
    with SyncLayerwisePool.open(
        staged(layerwise=True), layout=KVLayout.from_kv_caches(dst), backend=backend, device=device, depth=2
    ) as kv:
        kv.start_load([KVRequest(request_id="r", block_ids=DST_IDS, tokens=TOKENS)])
        for layer, name in enumerate(src):
            assert kv.wait_for_layer_load(layer) is True
            assert same_blocks({name: src[name]}, dst, list(zip(SRC_IDS, DST_IDS)))  # in place
        assert kv.wait_for_save().loaded["r"].hit_blocks == 10


def test_a_layer_whose_copies_into_the_cache_outlast_the_wait_fails_the_steps_loads() -> None:
    """``wait_for_layer_load`` returns False (it does not raise) when a layer's staged copies
    into the cache have not completed within its timeout, and the step then reports every loaded
    block failed: the engine computed without that layer."""
    from kvflow import SyncLayerwisePool

    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    anyio.run(
        lambda: pool(src, backend, staged(layerwise=True)).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    )
    dst = zeros_like_caches(src)
    device = LateDevice(torch.device("cpu"))
    device.rng.uniform = lambda a, b: 0.5  # type: ignore[method-assign]  # every copy lands 0.5 s late
    with SyncLayerwisePool.open(
        staged(layerwise=True), layout=KVLayout.from_kv_caches(dst), backend=backend, device=device
    ) as kv:
        kv.start_load([KVRequest(request_id="r", block_ids=DST_IDS, tokens=TOKENS)])
        assert kv.wait_for_layer_load(0, timeout_s=0.05) is False
        assert all(kv.wait_for_layer_load(layer) is False for layer in range(1, kv.num_layers))
        result = kv.wait_for_save(timeout_s=5)
    assert result.failed_block_ids == frozenset(DST_IDS)
    assert result.loaded["r"].hit_blocks == 0


@attrs.define
class ScribblingBackend(FaultyBackend):
    """Gets write junk into their regions, then report FAILED (the first half) or MISS."""

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        await self.inner.get(objects)
        for obj in objects:
            for addr, size in zip(obj.addrs, obj.sizes):
                ctypes.memset(addr, 0x5A, size)
        return [GetStatus.FAILED if i % 2 == 0 else GetStatus.MISS for i in range(len(objects))]


async def test_a_failed_or_corrupt_get_never_reaches_the_cache() -> None:
    src = LAYOUTS["vllm_cpu"]()
    inner = MemoryBackend()
    await pool(src, inner, staged()).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    dst = zeros_like_caches(src)
    reader = pool(dst, ScribblingBackend(inner), staged(), late_device())
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.failed_block_ids == tuple(DST_IDS)
    assert all(bool((t == 0).all()) for t in dst.values())  # type: ignore[attr-defined]


async def test_a_device_error_fails_the_request_and_the_pool_keeps_working() -> None:
    src = LAYOUTS["kv_tuple"]()
    backend = MemoryBackend()
    device = late_device()
    writer = pool(src, backend, staged(), device)
    device.fail_gather = True
    failed = await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    assert failed.stored == 0 and len(failed.failed_indices) == 10 and kv_keys(backend) == []
    device.fail_gather = False
    assert (await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))).stored == 10

    dst = zeros_like_caches(src)
    reader_device = late_device()
    reader = pool(dst, backend, staged(), reader_device)
    reader_device.fail_scatter = True
    broken = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert broken.hit_blocks == 0  # blocks the copy half-wrote are reported failed: recomputed
    reader_device.fail_scatter = False
    fine = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert fine.hit_blocks == 10 and same_blocks(src, dst, list(zip(SRC_IDS, DST_IDS)))
    staging = reader._transfer.staging
    assert staging is not None and staging.in_use == 0


async def test_a_store_waits_for_full_staging_only_until_its_deadline() -> None:
    src = LAYOUTS["vllm_cpu"]()
    hang = FaultyBackend(hang_on={"put"})
    writer = pool(src, hang, staged(staging_bytes=4096, timeout_s=0.3))  # one chunk, held by a hung put
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        results: list[object] = []
        tg.start_soon(_append, results, writer.store(KVRequest(block_ids=[0, 1], tokens=TOKENS)))
        tg.start_soon(_append, results, writer.store(KVRequest(block_ids=[2, 3], tokens=[9, *TOKENS[1:]])))
    assert time.monotonic() - started < 3
    for result in results:
        assert result.stored == 0 and result.failed_indices  # type: ignore[attr-defined]
    staging = writer._transfer.staging
    assert staging is not None and staging.in_use == 0 and staging.allocations == 1


def test_a_cache_the_backend_cannot_reach_is_refused_without_staging() -> None:
    meta = {f"l{i}": torch.empty(4, 2, BLOCK, 16, device="meta") for i in range(2)}
    layout = KVLayout.from_kv_caches(meta)
    with pytest.raises(LayoutError, match="staging='auto'"):
        KVPool.create(PoolConfig(staging="never"), layout=layout, backend=MemoryBackend())


async def test_a_store_that_finds_staging_full_until_its_deadline_fails_and_does_not_wait_on() -> None:
    """Staging exhausted: the store waits for a chunk only until its own deadline, then reports its
    objects failed (it neither allocates more nor waits for the store that holds the chunk, which
    gives the chunk back 0.6 s in, after the waiting store's 0.3 s deadline)."""
    src = LAYOUTS["vllm_cpu"]()
    release = anyio.Event()

    async def held(objects: Sequence[ObjectRef]) -> None:
        await release.wait()  # the first store's put keeps its staging chunk

    backend = FaultyBackend(put_hook=held)
    writer = pool(src, backend, staged(staging_bytes=4096), late_device())  # one chunk
    first = KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])
    second = KVRequest(block_ids=[1], tokens=[1, *TOKENS[1:BLOCK]])
    results: dict[str, object] = {}

    async def store(name: str, request: KVRequest, timeout_s: float) -> None:
        results[name] = await writer.store(request, timeout_s=timeout_s)

    async def release_in(delay_s: float) -> None:
        await anyio.sleep(delay_s)
        release.set()

    with anyio.fail_after(20):  # only a hang trips this
        async with anyio.create_task_group() as tg:
            tg.start_soon(store, "first", first, 15.0)
            await wait_until(lambda: backend.calls.count("put") == 1)
            tg.start_soon(release_in, 0.6)
            await store("second", second, 0.3)  # while the first holds the only chunk
            assert "first" not in results  # the second ended first: it did not wait for the chunk
    assert results["second"].failed_indices == (0,)  # type: ignore[attr-defined]
    assert results["first"].stored == 1  # type: ignore[attr-defined]
    staging = writer._transfer.staging
    assert staging is not None and staging.allocations == 1 and staging.in_use == 0


async def wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await anyio.sleep(0.01)


@attrs.define(eq=False)
class StuckDevice(LateDevice):
    """Every copy completes ``delay_s`` after it was queued: longer than the request's deadline."""

    delay_s: float = 0.3

    def record(self) -> LateEvent:  # type: ignore[override]
        event = LateEvent(self.delay_s, on_complete=self._queued)
        self._queued = []
        event.record()
        return event


async def test_a_copy_that_outlives_the_deadline_is_waited_for_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A staging chunk is never reused (nor its blocks reported) while the device may still write
    it: past the deadline the wait goes on, and says so once per interval."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    await pool(src, backend, staged()).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    dst = zeros_like_caches(src)
    device = StuckDevice(torch.device("cpu"))
    reader = pool(dst, backend, staged(timeout_s=0.05), device)
    writer_backend = MemoryBackend()
    writer = pool(src, writer_backend, staged(timeout_s=0.05), StuckDevice(torch.device("cpu")))
    with caplog.at_level("ERROR", logger="kvflow"):
        got = await reader.retrieve(KVRequest(block_ids=DST_IDS[:2], tokens=TOKENS))
        stored = await writer.store(KVRequest(block_ids=SRC_IDS[:2], tokens=TOKENS))
    stuck = "a staging copy is still running on the device; waiting for it (check the device)"
    assert [r.getMessage() for r in caplog.records] == [stuck, stuck]  # one per call
    # The load waited for its copies: the blocks are in place when it reports them.
    assert got.hit_blocks == 2 and same_blocks(src, dst, list(zip(SRC_IDS[:2], DST_IDS[:2])))
    # The store waited for its copies out of the cache before putting the chunk (its deadline had
    # passed, so it reports failure): whatever reached the backend is the cache's bytes.
    assert stored.failed_indices == (0, 1)
    check = zeros_like_caches(src)
    found = await pool(check, writer_backend, staged()).retrieve(KVRequest(block_ids=[0, 1], tokens=TOKENS))
    pairs = list(zip(SRC_IDS[:2], [0, 1]))[: found.hit_blocks]
    assert found.failed_block_ids == (0, 1)[found.hit_blocks :] and same_blocks(src, check, pairs)
    for p in (reader, writer):
        staging = p._transfer.staging
        assert staging is not None and staging.in_use == 0


async def test_a_device_error_in_one_chunk_fails_only_that_chunks_blocks() -> None:
    """Chunks of two blocks, one plane per layer: the copies of the chunk of blocks 2 and 3 fail
    (out of the cache on the store, into it on the load); its two blocks fail, every other block
    moves. (The memory backend's calls go in turn, so a request's chunks go last first: blocks 8-9,
    6-7, 4-5, then 2-3, the fourth chunk.)"""
    src = LAYOUTS["vllm_cpu"]()  # three layers: three copies per chunk
    backend = MemoryBackend()
    device = LateDevice(torch.device("cpu"), fail_gather_calls={9})  # the fourth chunk, first layer
    writer = pool(src, backend, staged(staging_bytes=2 * 4096), device)
    released: list[int] = []
    stored = await writer.store(
        KVRequest(block_ids=SRC_IDS, tokens=TOKENS), on_released=lambda: released.append(1)
    )
    assert stored.failed_indices == (2, 3) and stored.stored == 8 and released == [1]
    assert await writer.lookup(KVRequest(tokens=TOKENS)) == 2 * BLOCK  # blocks 2 and 3 were not stored
    await pool(src, backend, staged()).store(
        KVRequest(block_ids=SRC_IDS[2:4], tokens=TOKENS[: 4 * BLOCK], block_offset=2)
    )

    dst = zeros_like_caches(src)
    reader_device = LateDevice(torch.device("cpu"), fail_scatter_calls={9})
    reader = pool(dst, backend, staged(staging_bytes=2 * 4096), reader_device)
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.failed_block_ids == tuple(DST_IDS[2:4])
    good = [(s, d) for i, (s, d) in enumerate(zip(SRC_IDS, DST_IDS)) if i not in (2, 3)]
    assert same_blocks(src, dst, good)
    staging = reader._transfer.staging
    assert staging is not None and staging.in_use == 0


async def test_a_load_whose_staging_stays_busy_past_its_deadline_reports_only_what_arrived() -> None:
    """One chunk of two objects; the first get ends late, past the request's deadline (a backend
    call that cannot be cancelled, such as one run in a thread). Its two blocks arrive; the other
    eight find no chunk free in time, are never asked for, and fail: none is reported loaded."""
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend()
    await pool(src, backend, staged()).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    late: list[int] = []

    async def uncancellable(objects: Sequence[ObjectRef]) -> None:
        if not late:
            late.append(len(objects))
            with anyio.CancelScope(shield=True):
                await anyio.sleep(1.0)

    backend.get_hook = uncancellable
    dst = zeros_like_caches(src)
    reader = pool(dst, backend, staged(staging_bytes=2 * 4096, timeout_s=0.5), late_device())
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert late == [2] and backend.calls.count("get") == 1
    assert got.hit_blocks == 2 and got.failed_block_ids == tuple(DST_IDS[2:])
    assert same_blocks(src, dst, list(zip(SRC_IDS[:2], DST_IDS[:2])))
    staging = reader._transfer.staging
    assert staging is not None and staging.in_use == 0


@attrs.define(eq=False)
class CancellingDevice(StuckDevice):
    """A :class:`StuckDevice` that calls ``on_gather`` as each copy out of the cache is queued."""

    on_gather: Callable[[], None] | None = None

    def gather_rows(self, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        super().gather_rows(source, index, out)
        if self.on_gather is not None:
            self.on_gather()


def give_backs_before_their_copies_ended(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each chunk given back from now on, whether a copy into or out of it was still running."""
    early: list[bool] = []
    give_back = StagingPool.give_back

    def checked(self: StagingPool, chunk: Chunk) -> None:
        early.append(chunk.copied is not None and not chunk.copied.query())
        give_back(self, chunk)

    monkeypatch.setattr(StagingPool, "give_back", checked)
    return early


@pytest.mark.parametrize("op", ["store", "retrieve"])
async def test_cancelling_a_staged_request_gives_every_chunk_back_once_its_copies_are_done(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two chunks of two objects and copies that take 0.3 s on the device. The store is cancelled
    as its first copy out of the cache starts (it sees it at its next await, once its second chunk
    is copying: a chunk is put while the next one copies); the load when its second chunk's get starts (its
    first chunk's copy into the cache still running) and that get never ends. Every chunk comes
    back, none before its copy completed (the device could still be writing it), and the store
    releases the cache."""
    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 2 * 4096)
    early = give_backs_before_their_copies_ended(monkeypatch)
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend()
    await pool(src, backend, staged()).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    early.clear()
    backend.calls.clear()

    scope = anyio.CancelScope()

    async def cancel_at_the_second(objects: Sequence[ObjectRef]) -> None:
        if backend.calls.count("get") == 2:
            scope.cancel()  # while the first chunk's copy into the cache still runs
            await anyio.sleep_forever()

    backend.get_hook = cancel_at_the_second
    caches = src if op == "store" else zeros_like_caches(src)
    device = CancellingDevice(torch.device("cpu"))
    if op == "store":
        device.on_gather = scope.cancel  # as the first copy out of the cache starts
    other = pool(caches, backend, staged(staging_bytes=2 * 2 * 3072), device)  # 3 KiB blocks
    staging = other._transfer.staging
    assert staging is not None and staging.allocations == 2
    released: list[int] = []
    with scope:
        if op == "store":
            fresh = KVRequest(block_ids=SRC_IDS, tokens=[5, *TOKENS[1:]])
            await other.store(fresh, on_released=lambda: released.append(1))
        else:
            await other.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert scope.cancelled_caught
    assert staging.in_use == 0 and early and not any(early)
    if op == "store":
        # two of the five chunks copied out (one is put while the next copies), then it stopped
        assert released == [1] and device.gathers == 2 * len(src)
    else:
        assert backend.calls.count("get") == 2
        assert same_blocks(src, caches, list(zip(SRC_IDS[:2], DST_IDS[:2])))  # the first chunk landed


@pytest.mark.parametrize("layerwise", [True, False])
def test_staging_must_hold_one_object_of_the_pools_own_unit(layerwise: bool) -> None:
    """A layerwise pool's objects are one layer of a block, the others' a whole block: staging of
    two layers' size serves the first and is refused for the second, with the size it needs."""
    src = LAYOUTS["vllm_cpu"]()
    layout = KVLayout.from_kv_caches(src)
    per_layer = layout.block_nbytes // layout.num_layers
    config = PoolConfig(staging="always", staging_bytes=2 * per_layer, layerwise=layerwise)
    if layerwise:
        assert pool(src, MemoryBackend(), config)._transfer.staging is not None
    else:
        with pytest.raises(ConfigError, match=f"raise it to at least {layout.block_nbytes}"):
            pool(src, MemoryBackend(), config)


# -- loads of another engine's objects (a TP=1 writer, a TP=2 reader), through staging -------------


@attrs.define(eq=False)
class RecordingDevice(LateDevice):
    """A :class:`LateDevice` that keeps every event it recorded, and counts the blocks of copies
    issued on its copy stream that ended with no event recorded (nothing to wait for on a device)."""

    recorded: list[LateEvent] = attrs.field(factory=list)
    copy_blocks: int = 0
    unmarked: int = 0

    def record(self) -> LateEvent:
        event = super().record()
        self.recorded.append(event)
        return event

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        before = len(self.recorded)
        with super().on_copy_stream():
            yield
        self.copy_blocks += 1
        self.unmarked += len(self.recorded) == before


def gqa_caches(heads: int, block: int, blocks: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, three layers: ``[blocks, heads, block, K|V of 8 columns each]``."""
    return {f"l{i}": torch.randn(blocks, heads, block, 16).half() for i in range(3)}


async def stored_by_a_tp1_writer(
    backend: object, writer_block: int
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Both KV heads of TOKENS, stored by an engine of one rank in blocks of ``writer_block``
    tokens; its caches and block ids."""
    count = len(TOKENS) // writer_block
    src = gqa_caches(2, writer_block, count + 1)
    ids = [(5 * i + 1) % (count + 1) for i in range(count)]  # every block elsewhere
    writer = pool(src, backend, PoolConfig())  # type: ignore[arg-type]
    assert (await writer.store(KVRequest(block_ids=ids, tokens=TOKENS))).stored == count
    return src, ids


def tp2_reader(
    backend: object, config: PoolConfig, device: Device, writer_block: int
) -> tuple[KVPool, dict[str, torch.Tensor]]:
    """Rank 1 of a TP=2 engine: one KV head of each layer, blocks of BLOCK tokens, hashed as often
    as the writer's blocks (so that it can read them)."""
    dst = {name: torch.zeros(16, 1, BLOCK, 16).half() for name in ("l0", "l1", "l2")}
    reader = KVPool.create(
        attrs.evolve(config, hash_tokens=writer_block),
        layout=KVLayout.from_kv_caches(dst),
        backend=backend,  # type: ignore[arg-type]
        parallel=ParallelConfig(tp_rank=1, tp_size=2, num_kv_heads=2),
        device=device,
    )
    return reader, dst


def head_of(src: dict[str, torch.Tensor], ids: list[int], name: str, block: int, rank: int) -> torch.Tensor:
    """The writer's KV head ``rank`` of the reader's block ``block`` (one or more writer blocks)."""
    per = BLOCK // src[name].size(2)
    return torch.cat([src[name][ids[block * per + k], rank] for k in range(per)])


@pytest.mark.parametrize("writer_block", [BLOCK, BLOCK // 2], ids=["same block size", "half blocks"])
async def test_a_reshaped_layerwise_load_hands_each_layer_the_events_of_its_copies(writer_block: int) -> None:
    """The reader's own keys all miss; each layer comes from the writer's objects, through staging
    on a device whose events complete late. Every event recorded after copies into the cache is
    handed to the engine with the layer it belongs to (what its stream waits for before reading the
    layer), and each layer holds the writer's head of this rank once they completed."""
    backend = MemoryBackend()
    src, ids = await stored_by_a_tp1_writer(backend, writer_block)
    device = RecordingDevice(torch.device("cpu"), max_delay_s=0.05)
    reader, dst = tp2_reader(backend, staged(layerwise=True, staging_bytes=4 * 4096), device, writer_block)
    dst_ids = DST_IDS
    handed: dict[int, list[LateEvent]] = {}
    async with reader.layerwise_retrieve([KVRequest(block_ids=dst_ids, tokens=TOKENS)], depth=2) as loader:
        async for outcome in loader:
            handed[outcome.layer] = list(outcome.ready)  # type: ignore[arg-type]
            for event in outcome.ready:
                with anyio.fail_after(5):
                    while not event.query():
                        await anyio.sleep(0.001)
            name = f"l{outcome.layer}"
            for i, block in enumerate(dst_ids):
                assert torch.equal(dst[name][block, 0], head_of(src, ids, name, i, 1)), (name, i)
    assert loader.results()[0].hit_blocks == len(dst_ids)
    every = [id(e) for events in handed.values() for e in events]
    assert sorted(every) == sorted(id(e) for e in device.recorded) and len(set(every)) == len(every)
    assert sorted(handed) == [0, 1, 2] and all(handed.values())
    assert device.copy_blocks > 0 and device.unmarked == 0


@pytest.mark.parametrize("writer_block", [BLOCK, BLOCK // 2], ids=["same block size", "half blocks"])
async def test_a_reshaped_load_whose_staging_stays_busy_past_its_deadline_reports_only_what_arrived(
    writer_block: int,
) -> None:
    """One staging chunk, holding the writer's objects of two blocks; the first get of them ends
    past the request's deadline (a call that cannot be cancelled). Those two blocks arrive; the
    others find no chunk free in time and fail, never asked for."""
    backend = FaultyBackend()
    src, ids = await stored_by_a_tp1_writer(backend, writer_block)
    writers = set(kv_keys(backend.inner))
    asked: list[int] = []

    async def late_first(objects: Sequence[ObjectRef]) -> None:
        if any(o.key in writers for o in objects):
            asked.append(len(objects))
            if len(asked) == 1:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(1.0)

    backend.get_hook = late_first
    block_nbytes = 3 * 2 * BLOCK * 16 * 2  # the writer's two heads of one reader block, three layers
    reader, dst = tp2_reader(
        backend, staged(staging_bytes=2 * block_nbytes, timeout_s=0.5), late_device(), writer_block
    )
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert len(asked) == 1 and got.statuses.count(GetStatus.HIT) == 2  # rank 1 starts mid-prompt
    for i, block in enumerate(DST_IDS):
        for name in dst:
            if got.statuses[i] is GetStatus.HIT:
                assert torch.equal(dst[name][block, 0], head_of(src, ids, name, i, 1)), (name, i)
            else:
                assert not dst[name][block].any(), (name, i)  # never written
    staging = reader._transfer.staging
    assert staging is not None and staging.in_use == 0 and staging.allocations == 1


@attrs.define(eq=False)
class MetaDevice(Device):
    """A device other than the host: the ``meta`` device checks that a copy's tensors are on one
    device, and holds no data (so nothing can be read back: only whether each copy was allowed)."""

    def index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device="meta")


async def test_a_reshaped_load_into_a_cache_on_another_device_moves_its_index_and_rows_there() -> None:
    """A cache that is not on the host: the blocks taken out of another engine's objects (staged in
    host memory) are copied in with their index and rows moved to the cache's device first.
    Left on the host, every copy fails on the mixed devices and no block is loaded."""
    backend = MemoryBackend()
    await stored_by_a_tp1_writer(backend, BLOCK)
    caches = {
        name: torch.empty(16, 1, BLOCK, 16, dtype=torch.float16, device="meta") for name in ("l0", "l1", "l2")
    }
    reader = KVPool.create(
        staged(),
        layout=KVLayout.from_kv_caches(caches),
        backend=backend,
        parallel=ParallelConfig(tp_rank=1, tp_size=2, num_kv_heads=2),
        device=MetaDevice(torch.device("meta"), event_factory=CpuEvent),
    )
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.hit_blocks == len(DST_IDS)


@attrs.define(eq=False)
class SlowFirstCopyDevice(LateDevice):
    """Copies complete when their event does; the event after the first copy into ``slow_target``
    completes ``slow_s`` after it is recorded, every other one at once."""

    slow_target: int = 0  # data_ptr of a layer's cache
    slow_s: float = 0.4
    _slow_next: bool = False
    _done: bool = False

    def scatter_rows(
        self, target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor | None = None
    ) -> None:
        super().scatter_rows(target, index, rows, pick)
        if target.data_ptr() == self.slow_target and not self._done:
            self._slow_next = self._done = True

    def record(self) -> LateEvent:  # type: ignore[override]
        event = LateEvent(self.slow_s if self._slow_next else 0.0, on_complete=self._queued)
        self._slow_next, self._queued = False, []
        event.record()
        return event


async def test_a_layer_is_handed_out_with_the_event_of_a_copy_another_layer_finishes_for_its_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three staging chunks of four blocks, two layers of ten blocks loading at once. Layer 0
    copies its first four blocks out of chunk A (the copy lands late) and waits on a slow get for
    the next four in chunk C; layer 1, finding no chunk free, finishes layer 0's oldest copy to
    reuse A. Layer 0 is then handed out: the events it comes with must include that copy's, or the
    engine reads those blocks before they landed."""
    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 4 * 1024)
    src = LAYOUTS["vllm_cpu"]()  # 1 KiB per block and layer
    backend = FaultyBackend()
    await pool(src, backend, staged(layerwise=True)).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    layer0_gets: list[int] = []

    async def slow_second_half_of_layer_0(objects: Sequence[ObjectRef]) -> None:
        if "@l0-1@" in objects[0].key:
            layer0_gets.append(len(objects))
            if len(layer0_gets) == 2:
                await anyio.sleep(0.1)

    backend.get_hook = slow_second_half_of_layer_0
    dst = zeros_like_caches(src)
    names = list(src)
    device = SlowFirstCopyDevice(torch.device("cpu"), slow_target=dst[names[0]].data_ptr())  # type: ignore[attr-defined]
    reader = pool(dst, backend, staged(layerwise=True, staging_bytes=3 * 4 * 1024), device)
    request = KVRequest(block_ids=DST_IDS, tokens=TOKENS)
    async with reader.layerwise_retrieve([request], depth=2) as loader:
        async for outcome in loader:
            for event in outcome.ready:
                with anyio.fail_after(5):
                    while not event.query():
                        await anyio.sleep(0.001)
            layer = {names[outcome.layer]: src[names[outcome.layer]]}
            assert same_blocks(layer, dst, list(zip(SRC_IDS, DST_IDS))), outcome.layer
    assert layer0_gets == [4, 4, 2] and loader.results()[0].hit_blocks == 10


# -- a copy that fails part-way: the copies queued before the error still run -------------------

TOKENS_P = list(range(100, 100 + BLOCK))  # prompt A of the tests below
TOKENS_Q = list(range(900, 900 + BLOCK))  # prompt B


@attrs.define(eq=False)
class LazyDevice(LateDevice):
    """A :class:`LateDevice` whose copies into the cache read their host rows when they run, not
    when issued, as an asynchronous host-to-device copy reads pinned memory when its DMA runs."""

    def scatter_rows(
        self, target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor | None = None
    ) -> None:
        self.scatters += 1
        if self.fail_scatter or self.scatters - 1 in self.fail_scatter_calls:
            raise RuntimeError("injected device error in a copy into the cache")
        index, pick = index.clone(), None if pick is None else pick.clone()
        self._queued.append(  # the rows are read (and picked) when the copy runs
            lambda: target.index_copy_(
                0, index, rows[: len(index)] if pick is None else rows.index_select(0, pick)
            )
        )


def staged_one_chunk() -> PoolConfig:
    return PoolConfig(staging="always", staging_bytes=4096)  # one chunk of one whole block (3 KiB)


async def test_a_store_whose_copy_out_fails_part_way_never_leaks_into_a_later_load() -> None:
    """The engine's pool stores block 5 (prompt A) through its one staging chunk; the copy out of
    the cache fails at the second layer, the first layer's copy still queued on the copy stream.
    The same pool then loads prompt B (stored earlier by another engine) into block 7 through that
    chunk: the backend writes B into the chunk, the copy into the cache is queued after the stale
    copy out, which overwrites the chunk's first layer with A's block 5 before it is read. The load
    reports block 7 loaded: its first layer must be B's, not A's."""
    other = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    writer = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(other), backend=backend)
    assert (await writer.store(KVRequest(block_ids=[2], tokens=TOKENS_Q))).stored == 1

    mine = LAYOUTS["vllm_cpu"]()
    device = LazyDevice(torch.device("cpu"), max_delay_s=0.0, fail_gather_calls={1})  # its second layer
    pool = KVPool.create(
        staged_one_chunk(), layout=KVLayout.from_kv_caches(mine), backend=backend, device=device
    )
    stored = await pool.store(KVRequest(block_ids=[5], tokens=TOKENS_P))
    assert stored.failed_indices == (0,)  # the device error is reported

    got = await pool.retrieve(KVRequest(block_ids=[7], tokens=TOKENS_Q))
    assert got.statuses == (GetStatus.HIT,)
    for name in mine:
        assert block_bytes(mine[name], 7) == block_bytes(other[name], 2), f"{name} of block 7 is not B's"


async def test_a_load_whose_copy_in_fails_part_way_writes_nothing_after_it_returned() -> None:
    """A load of prompt B into block 7 fails at the second layer's copy into the cache (the first
    layer's copy queued). It reports block 7 failed and returns; the engine recomputes block 7.
    The pool then loads prompt A into block 4 through the same chunk: when its copies run, the
    stale first-layer copy runs too, now reading A's bytes, into block 7. Nothing kvflow does after
    a retrieve returned may write that retrieve's blocks."""
    other = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    writer = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(other), backend=backend)
    assert (await writer.store(KVRequest(block_ids=[2], tokens=TOKENS_Q))).stored == 1
    assert (await writer.store(KVRequest(block_ids=[3], tokens=TOKENS_P))).stored == 1

    mine = LAYOUTS["vllm_cpu"]()
    device = LazyDevice(torch.device("cpu"), max_delay_s=0.0, fail_scatter_calls={1})
    pool = KVPool.create(
        staged_one_chunk(), layout=KVLayout.from_kv_caches(mine), backend=backend, device=device
    )
    got = await pool.retrieve(KVRequest(block_ids=[7], tokens=TOKENS_Q))
    assert got.failed_block_ids == (7,)
    recomputed = {name: mine[name][7].clone() for name in mine}  # type: ignore[index]
    # (the engine's recompute: block 7 keeps these bytes)
    assert (await pool.retrieve(KVRequest(block_ids=[4], tokens=TOKENS_P))).hit_blocks == 1
    for name in mine:
        assert torch.equal(mine[name][7], recomputed[name]), (
            f"{name}: block 7 written after its load returned"
        )  # type: ignore[index]


@attrs.define(eq=False)
class FailingEvent(LateEvent):
    """A copy's event that reports a device error at its first query once due (as a CUDA or NPU
    event reports an asynchronous copy error); the copies never happened."""

    def query(self) -> bool:
        with self._lock:
            if self._at is None or time.monotonic() < self._at:
                return False
            self.on_complete.clear()
        raise RuntimeError("injected device error, reported by the copy's event")


@attrs.define(eq=False)
class FailsFirstCopy(LateDevice):
    """The first copy of ``kind`` ("scatter": into the cache; "gather": out of it) fails on the
    device, reported by its event."""

    kind: str = "scatter"
    failed: bool = False

    def record(self) -> LateEvent:  # type: ignore[override]
        if not self.failed and (self.scatters if self.kind == "scatter" else self.gathers):
            self.failed = True
            event = FailingEvent(0.0, on_complete=self._queued)
            self._queued = []
            event.record()
            return event
        return super().record()


async def test_a_copy_the_device_reports_failed_fails_its_blocks_and_gives_its_chunk_back() -> None:
    """docs/device.md, faults: a copy the device reports failed at its event fails its chunk's
    blocks (never a HIT, never a put of the chunk's bytes), the chunk goes back, and the pool
    keeps working. Chunks of one block: the first copied of the load and of the store fails, the
    rest move (the request's last block: the memory backend's calls go in turn, last first)."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    writer = pool(
        src, backend, staged(staging_bytes=4096), FailsFirstCopy(torch.device("cpu"), kind="gather")
    )
    stored = await writer.store(KVRequest(block_ids=SRC_IDS[:3], tokens=TOKENS[: 3 * BLOCK]))
    assert stored.statuses == (PutStatus.STORED, PutStatus.STORED, PutStatus.FAILED)
    assert writer._transfer.staging.in_use == 0  # type: ignore[union-attr]
    await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))  # block 2 this time
    dst = zeros_like_caches(src)
    reader = pool(dst, backend, staged(staging_bytes=4096), FailsFirstCopy(torch.device("cpu")))
    loaded = await reader.retrieve(KVRequest(block_ids=DST_IDS[:3], tokens=TOKENS[: 3 * BLOCK]))
    assert loaded.statuses == (GetStatus.HIT, GetStatus.HIT, GetStatus.FAILED)
    assert reader._transfer.staging.in_use == 0  # type: ignore[union-attr]
    again = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert again.hit_blocks == len(DST_IDS)
    assert same_blocks(src, dst, list(zip(SRC_IDS, DST_IDS)))


# -- loads into blocks an earlier step on the engine's stream may still write ----------------------


def earlier_step_writing(caches: dict[str, torch.Tensor], delay_s: float = 0.05) -> LateEvent:
    """The engine's event after work still queued on its stream (with asynchronous scheduling, an
    earlier step writing the previous owner's KV into blocks vLLM has just handed to a loading
    request): it completes ``delay_s`` from now, those writes landing just before it does."""

    def earlier_step_finishes() -> None:
        for tensor in caches.values():
            tensor.fill_(7)  # every block, the loaded ones among them

    event = LateEvent(delay_s, on_complete=[earlier_step_finishes])
    event.record()
    return event


async def finish_the_device(event: LateEvent) -> None:
    """Whatever the load did, the engine's stream runs its queued work to the end."""
    with anyio.fail_after(5):
        while not event.query():
            await anyio.sleep(0.001)


async def load(reader: KVPool, request: KVRequest, *, layerwise: bool, after: LateEvent) -> int:
    """Retrieve ``request`` through the whole-block or the layerwise face; its hit blocks."""
    if not layerwise:
        return (await reader.retrieve(request, after=after)).hit_blocks
    async with reader.layerwise_retrieve([request], depth=2, after=after) as loader:
        async for outcome in loader:
            for event in outcome.ready:
                await finish_the_device(event)  # type: ignore[arg-type]
    return loader.results()[0].hit_blocks


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole blocks", "layerwise"])
@pytest.mark.parametrize("staging", ["always", "never"])
async def test_a_load_writes_no_block_before_the_engines_event(staging: str, layerwise: bool) -> None:
    """The blocks a load fills are still written by an earlier step on the engine's stream; the
    load, staged (the copy stream waits) or not (the backend writes the cache: the loop waits),
    writes them only after the event recorded after that step, so they hold what was stored."""
    src = LAYOUTS["flash_attn"]()
    backend = MemoryBackend()
    config = attrs.evolve(staged(layerwise=layerwise), staging=staging)
    device = late_device() if staging == "always" else None
    await pool(src, backend, config, device).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    dst = zeros_like_caches(src)
    reader = pool(dst, backend, config, late_device() if staging == "always" else None)
    earlier = earlier_step_writing(dst)  # type: ignore[arg-type]
    hit = await load(reader, KVRequest(block_ids=DST_IDS, tokens=TOKENS), layerwise=layerwise, after=earlier)
    await finish_the_device(earlier)
    assert hit == 10 and same_blocks(src, dst, list(zip(SRC_IDS, DST_IDS)))


@pytest.mark.parametrize("writer_block", [BLOCK, BLOCK // 2], ids=["same block size", "half blocks"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole blocks", "layerwise"])
async def test_a_reshaped_load_writes_no_block_before_the_engines_event(
    layerwise: bool, writer_block: int
) -> None:
    """As above for a load of another engine's objects (a TP=1 writer's, read by rank 1 of TP=2)."""
    backend = MemoryBackend()
    src, ids = await stored_by_a_tp1_writer(backend, writer_block)
    config = staged(layerwise=layerwise, staging_bytes=4 * 4096)
    reader, dst = tp2_reader(backend, config, late_device(), writer_block)
    earlier = earlier_step_writing(dst)
    hit = await load(reader, KVRequest(block_ids=DST_IDS, tokens=TOKENS), layerwise=layerwise, after=earlier)
    await finish_the_device(earlier)
    assert hit == len(DST_IDS)
    for name in dst:
        for i, block in enumerate(DST_IDS):
            assert torch.equal(dst[name][block, 0], head_of(src, ids, name, i, 1)), (name, i)


@pytest.mark.parametrize("staging", ["always", "never"])
async def test_a_load_whose_engine_event_never_comes_writes_nothing_and_fails(staging: str) -> None:
    """The earlier step never completes within the load's 0.1 s deadline: the load writes no block
    (the earlier step's bytes stay), reports every block failed, and gives its chunks back."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    config = attrs.evolve(staged(timeout_s=0.1), staging=staging)
    await pool(src, backend, config, late_device() if staging == "always" else None).store(
        KVRequest(block_ids=SRC_IDS, tokens=TOKENS)
    )
    dst = zeros_like_caches(src)
    reader = pool(dst, backend, config, late_device() if staging == "always" else None)
    never = LateEvent(3600.0)
    never.record()
    with anyio.fail_after(10):  # a guard against a hang; the load ends at its own deadline
        got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS), after=never)
    assert got.hit_blocks == 0 and set(got.failed_block_ids) == set(DST_IDS)
    assert all(not t.any() for t in dst.values())  # type: ignore[attr-defined]
    staging_pool = reader._transfer.staging
    assert (
        staging_pool is None if staging == "never" else staging_pool is not None and staging_pool.in_use == 0
    )


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole blocks", "layerwise"])
async def test_a_load_cancelled_while_waiting_for_the_engines_event_gives_its_chunks_back(
    layerwise: bool,
) -> None:
    """The gets are done and the load waits for an earlier step on the engine's stream when its
    caller gives up (a cancelled SyncPool future, a layerwise step left): every chunk comes back."""
    src = LAYOUTS["flash_attn"]()
    backend = MemoryBackend()
    config = staged(layerwise=layerwise, staging_bytes=64 * 4096)
    await pool(src, backend, config, late_device()).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    reader = pool(zeros_like_caches(src), backend, config, late_device())
    staging_pool = reader._transfer.staging
    assert staging_pool is not None
    slow = LateEvent(3600.0)
    slow.record()
    request = KVRequest(block_ids=DST_IDS, tokens=TOKENS)
    with anyio.move_on_after(0.3) as scope:
        await load(reader, request, layerwise=layerwise, after=slow)
    assert scope.cancelled_caught and staging_pool.in_use == 0


@attrs.define(eq=False)
class CountedLateEvent(LateEvent):
    queries: int = 0

    def query(self) -> bool:
        self.queries += 1
        return super().query()


@pytest.mark.parametrize("staging", ["always", "never"])
async def test_a_layerwise_load_waits_for_an_engine_event_that_never_comes_once(staging: str) -> None:
    """Each layer has its own deadline; once one layer's wait for the event ran out, the other
    layers fail at once instead of each waiting its own timeout for the same event."""
    src = LAYOUTS["flash_attn"]()  # three layers
    backend = MemoryBackend()
    config = attrs.evolve(staged(layerwise=True, timeout_s=0.2), staging=staging)
    device = late_device() if staging == "always" else None
    await pool(src, backend, config, device).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    reader = pool(zeros_like_caches(src), backend, config, late_device() if device else None)
    never = CountedLateEvent(3600.0)
    never.record()
    queried: list[int] = []
    with anyio.fail_after(10):
        async with reader.layerwise_retrieve(
            [KVRequest(block_ids=DST_IDS, tokens=TOKENS)], depth=1, after=never
        ) as loader:
            async for outcome in loader:
                assert not outcome.ok
                queried.append(never.queries)
    assert loader.results()[0].hit_blocks == 0
    assert queried[0] > 0 and queried == [queried[0]] * 3  # no layer after the first asked again


async def test_a_reshaped_load_copies_into_the_cache_on_the_staging_device() -> None:
    """Objects of another split too large for a staging chunk go through chunks of their own;
    their copies into the cache use the staging chunks' device (one copy stream, which ``after``
    orders once), not a device of their own."""
    backend = MemoryBackend()
    src, ids = await stored_by_a_tp1_writer(backend, BLOCK)
    device = late_device()
    reader, dst = tp2_reader(backend, staged(staging_bytes=3 * 1 * BLOCK * 16 * 2), device, BLOCK)
    earlier = earlier_step_writing(dst)
    got = await reader.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS), after=earlier)
    await finish_the_device(earlier)
    transfer = reader._transfer
    assert transfer.staging is not None and transfer._scratch is not None
    assert transfer._scratch.device is transfer.staging.device is device
    assert got.hit_blocks == len(DST_IDS)
    for name in dst:
        for i, block in enumerate(DST_IDS):
            assert torch.equal(dst[name][block, 0], head_of(src, ids, name, i, 1)), (name, i)


@given(total=st.integers(1, 10_000), unit=st.integers(1, 10_000), largest=st.integers(1, 4_000))
def test_staging_bytes_are_split_into_chunks_that_use_them(total: int, unit: int, largest: int) -> None:
    """``staging_bytes`` is split into chunks of whole objects, of at most MAX_CHUNK_BYTES (larger
    only to hold one object), that hold at least as many objects as one chunk of the largest size
    repeated would, and all but less than a chunk's worth (before: 48 MiB of 64 KiB objects made
    one chunk of 32 MiB, and 16 MiB of the setting was never used)."""
    if total < unit:
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staging_module, "MAX_CHUNK_BYTES", largest)
        pool = StagingPool.create(Device.of("cpu"), total, unit)
    chunks = pool.buffers()
    assert len(chunks) == pool.allocations >= 1
    sizes = {chunk.numel() * chunk.element_size() for chunk in chunks}
    assert len(sizes) == 1
    (size,) = sizes
    assert size % unit == 0 and unit <= size <= max(unit, largest) and size * len(chunks) <= total
    held, per_chunk = len(chunks) * (size // unit), size // unit
    assert held > total // unit - per_chunk  # less than a chunk's worth of objects left out
    biggest = min(total, max(unit, largest))  # chunks of the largest size, as many as fit
    assert held >= (total // biggest) * (biggest // unit)


def test_chunks_filled_whole_are_taken_where_evening_them_out_would_hold_fewer_objects() -> None:
    """1122 objects, 59 a chunk at most: 19 full chunks hold 1121, where 20 evened-out chunks of
    56 would hold 1120 (the case the random search above found)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staging_module, "MAX_CHUNK_BYTES", 59)
        pool = StagingPool.create(Device.of("cpu"), 1122, 1)
    assert (pool.allocations, pool.chunk_bytes) == (19, 59)


def test_48_mib_of_staging_holds_48_mib_of_objects() -> None:
    pool = StagingPool.create(Device.of("cpu"), 48 << 20, 64 << 10)
    assert pool.allocations == 2 and pool.chunk_bytes == 24 << 20


def test_a_layer_whose_copy_the_device_reports_failed_to_a_host_wait_says_false_not_raises() -> None:
    """A host wait on a layer's copies (a device whose events the host polls) that hears the
    device report a copy failed: ``wait_for_layer_load`` says False, as for any layer that did not
    arrive, and the step reports its loaded blocks failed (before: the device's error reached the
    engine, and the step went on saving layers)."""
    from kvflow import SyncLayerwisePool

    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    anyio.run(
        lambda: pool(src, backend, staged(layerwise=True)).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))
    )
    dst = zeros_like_caches(src)
    device = FailsFirstCopy(torch.device("cpu"), max_delay_s=0.0)
    with SyncLayerwisePool.open(
        staged(layerwise=True), layout=KVLayout.from_kv_caches(dst), backend=backend, device=device
    ) as kv:
        kv.start_load([KVRequest(request_id="r", block_ids=DST_IDS, tokens=TOKENS)])
        assert [kv.wait_for_layer_load(layer) for layer in range(kv.num_layers)] == [False] * kv.num_layers
        result = kv.wait_for_save()
    assert result.failed_block_ids == frozenset(DST_IDS)


@attrs.define(eq=False)
class FailsLateOnTheDevice(FailsFirstCopy):
    """The first copy into the cache fails at its event ``delay_s`` after it is recorded, and the
    engine's waits are the device's own (CUDA's ``wait_event``): the host learns nothing of it."""

    delay_s: float = 0.2

    def record(self) -> LateEvent:  # type: ignore[override]
        if not self.failed and self.scatters:
            self.failed = True
            event = FailingEvent(self.delay_s, on_complete=self._queued)
            self._queued = []
            event.record()
            return event
        return LateDevice.record(self)

    def wait_current(self, event: object, timeout_s: float) -> None:
        return None


def test_a_step_stores_nothing_computed_on_a_layer_the_device_reports_failed_after_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device reports layer 0's copy into the cache failed only after the engine's stream
    waited on it and the forward computed every layer on it: every layer wait said True, and the
    engine saved every layer. The step's stores rest on that junk, so none is put (before: the
    new blocks were STORED, and a lookup of the prompt found all of them); the block the copy
    was to fill is reported failed."""
    from kvflow import SyncLayerwisePool

    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    anyio.run(
        lambda: pool(src, backend, staged(layerwise=True)).store(
            KVRequest(block_ids=SRC_IDS[:6], tokens=TOKENS[: 6 * BLOCK])
        )
    )
    before = {k for k in backend.stored_keys() if not is_book_key(k)}
    engine = zeros_like_caches(src)
    device = FailsLateOnTheDevice(torch.device("cpu"), max_delay_s=0.0)
    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 1)  # chunks of one object: none waits for another
    config = staged(layerwise=True, staging_bytes=1 << 20)
    with SyncLayerwisePool.open(
        config, layout=KVLayout.from_kv_caches(engine), backend=backend, device=device
    ) as kv:
        kv.start_load([KVRequest(request_id="r", block_ids=DST_IDS[:6], tokens=TOKENS)])
        kv.start_store([KVRequest(request_id="r", block_ids=DST_IDS[6:], tokens=TOKENS, block_offset=6)])
        for layer in range(kv.num_layers):
            assert kv.wait_for_layer_load(layer) is True  # the host cannot know yet
            kv.save_layer(layer)
        result = kv.wait_for_save()
        assert result.failed_block_ids == {DST_IDS[5]}  # the one block of the failed (first) copy: the last
        assert result.stored["r"].stored == 0
        added = {k for k in backend.stored_keys() if not is_book_key(k)} - before
        assert added == set()  # no layer's objects either (layer 0's rests on its own load too)
        assert kv.lookup(KVRequest(tokens=TOKENS)) == 6 * BLOCK  # only the blocks stored before


def test_a_layer_whose_failed_copy_another_layer_finished_is_not_taken_as_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Staging short of chunks: layer 1's get, waiting for a chunk, finishes layer 0's oldest copy
    into the cache itself, and the device reports that copy failed. Layer 0's settle must wait for
    it and see the failure: before, it found none of its copies left, called the layer whole, and
    the step put layer 0 of the new blocks computed on the failed load, which a later correct
    store then skipped as present and a later load returned."""
    from kvflow import SyncLayerwisePool

    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 4096)  # chunks of a few objects
    src = LAYOUTS["vllm_cpu"]()
    src_ids, dst_ids, new = SRC_IDS[:8], [10, 11, 7, 8, 0, 1, 2, 3], [4, 5]
    backend = FaultyBackend()
    anyio.run(
        lambda: pool(src, backend, staged(layerwise=True)).store(
            KVRequest(block_ids=src_ids, tokens=TOKENS[: 8 * BLOCK])
        )
    )
    before = {k for k in backend.inner.stored_keys() if not is_book_key(k)}
    layer0_gets = 0

    async def second_get_of_layer_0_slow(objects: Sequence[ObjectRef]) -> None:
        nonlocal layer0_gets
        if "@l0-1@" in objects[0].key:
            layer0_gets += 1
            if layer0_gets == 2:  # layer 1 runs short of chunks meanwhile, and takes layer 0's copy
                await anyio.sleep(0.1)

    backend.get_hook = second_get_of_layer_0_slow
    engine = zeros_like_caches(src)
    names = list(engine)
    device = FailsLateOnTheDevice(torch.device("cpu"), max_delay_s=0.0)
    config = staged(layerwise=True, staging_bytes=3 * 4096)
    with SyncLayerwisePool.open(
        config, layout=KVLayout.from_kv_caches(engine), backend=backend, device=device, depth=2
    ) as kv:
        kv.start_load([KVRequest(request_id="r", block_ids=dst_ids, tokens=TOKENS)])
        kv.start_store([KVRequest(request_id="r", block_ids=new, tokens=TOKENS, block_offset=8)])
        for layer in range(kv.num_layers):
            kv.wait_for_layer_load(layer)
            for b in new:  # computed on what loaded: junk where a copy failed
                engine[names[layer]][b].fill_(1.0)
            kv.save_layer(layer)
        result = kv.wait_for_save()
        assert result.failed_block_ids and result.stored["r"].stored == 0
        added = {k for k in backend.inner.stored_keys() if not is_book_key(k)} - before
        assert added == set()  # no layer's objects: every layer rests on a load that failed
        for name in names:  # the engine recomputes the blocks and stores them whole
            for b in new:
                engine[name][b].fill_(2.0)
        assert kv.store(KVRequest(block_ids=new, tokens=TOKENS, block_offset=8)).stored == 2
        got = kv.retrieve(KVRequest(block_ids=[6, 7], tokens=TOKENS, block_offset=8))
        assert got.hit_blocks == 2
        assert all(bool((engine[name][b] == 2.0).all()) for name in names for b in (6, 7))


@attrs.define(eq=False)
class SerialCopies(CancellingDevice):
    """Copies on one copy stream: each completes ``delay_s`` after the one before it."""

    last: float = 0.0

    def record(self) -> LateEvent:  # type: ignore[override]
        now = time.monotonic()
        self.last = max(now, self.last) + self.delay_s
        event = LateEvent(self.last - now, on_complete=self._queued)
        self._queued = []
        event.record()
        return event


async def test_a_cancelled_staged_store_gives_no_chunk_back_before_its_copies_on_one_stream_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled at its first copy out, a staged store whose copies complete one after another
    (a real copy stream) gives each chunk back only once the copies into it completed: the
    device may still write it until then."""
    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 2 * 4096)
    early = give_backs_before_their_copies_ended(monkeypatch)
    src = LAYOUTS["vllm_cpu"]()
    scope = anyio.CancelScope()
    device = SerialCopies(torch.device("cpu"))
    device.on_gather = scope.cancel
    writer = pool(src, FaultyBackend(), staged(staging_bytes=2 * 2 * 3072), device)  # 3 KiB blocks
    with scope:
        await writer.store(KVRequest(block_ids=SRC_IDS, tokens=[5, *TOKENS[1:]]))
    assert scope.cancelled_caught
    assert early and not any(early), early
