"""Layerwise stores and loads: gated by events, overlapped with compute, bit-exact, failure-proof."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import threading
import time
from collections.abc import Callable, Sequence

import anyio
import attrs
import pytest
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvflow import (
    ConfigError,
    GetStatus,
    KVFormat,
    KVLayout,
    KVPool,
    KVRequest,
    MemoryBackend,
    ParallelConfig,
    PoolConfig,
    PutStatus,
    RequestError,
    SyncLayerwisePool,
)
from kvflow.backends import ObjectRef
from kvflow.events import CpuEvent, LayerEvents
from kvflow.keys import decode_key
from kvflow.layerwise import LayerwiseRetriever
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, block_bytes, zeros_like_caches

TOKENS = list(range(500, 500 + BLOCK * 8))
ALL = list(range(8))


@attrs.define
class ScriptedBackend(FaultyBackend):
    """A memory backend whose gets can be slowed and whose calls can fail or hang, per layer."""

    get_delay_s: float = 0.0
    fail_get: set[int] = attrs.field(factory=set)
    fail_put: set[int] = attrs.field(factory=set)
    hang_put: set[int] = attrs.field(factory=set)
    put_log: list[tuple[float, int | None]] = attrs.field(factory=list)

    @property
    def max_batch(self) -> int:
        return 64

    @staticmethod
    def _layers(objects: Sequence[ObjectRef]) -> set[int | None]:
        return {decode_key(o.key).layer for o in objects}

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        layers = self._layers(objects)
        self.put_log.extend((time.monotonic(), layer) for layer in layers)
        if layers & self.hang_put:
            await anyio.sleep_forever()
        if layers & self.fail_put:
            raise ConnectionError("injected put failure")
        return await self.inner.put(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        await anyio.sleep(self.get_delay_s)
        if self._layers(objects) & self.fail_get:
            raise ConnectionError("injected get failure")
        return await self.inner.get(objects)


def make_pool(
    caches: dict[str, object], backend: object, timeout_s: float = 5.0, **parallel: object
) -> KVPool:
    return KVPool.create(
        PoolConfig(layerwise=True, timeout_s=timeout_s),
        layout=KVLayout.from_kv_caches(caches),  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        parallel=ParallelConfig(**parallel),  # type: ignore[arg-type]
    )


def make_engine(
    caches: dict[str, object],
    backend: object,
    *,
    timeout_s: float = 5.0,
    event_factory: Callable[[], CpuEvent] | None = None,
    **parallel: object,
) -> SyncLayerwisePool:
    return SyncLayerwisePool.open(
        PoolConfig(layerwise=True, timeout_s=timeout_s),
        layout=KVLayout.from_kv_caches(caches),  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        parallel=ParallelConfig(**parallel),  # type: ignore[arg-type]
        event_factory=event_factory,
    )


def request(block_ids: Sequence[int], rid: str = "r", tokens: Sequence[int] = TOKENS) -> list[KVRequest]:
    return [KVRequest(request_id=rid, block_ids=block_ids, tokens=tokens)]


def forward(kv: SyncLayerwisePool, compute_s: float = 0.0) -> list[bool]:
    """One forward pass through the sync face, as vLLM drives a connector."""
    arrived = []
    for layer in range(kv.num_layers):
        arrived.append(kv.wait_for_layer_load(layer))
        if compute_s:
            time.sleep(compute_s)
        kv.save_layer(layer)
    return arrived


# -- layout coverage and lookups ------------------------------------------------------------------


def test_round_trip_of_every_layout_through_the_sync_face_is_bit_exact(layout_name: str) -> None:
    src = LAYOUTS[layout_name]()
    dst = zeros_like_caches(src)
    backend = MemoryBackend()
    src_ids, dst_ids = [3, 1, 4, 0, 5, 9, 2, 6], [10, 11, 7, 8, 0, 1, 2, 3]
    writer, reader = make_engine(src, backend), make_engine(dst, backend)  # a pool closes its backend
    writer.start_store(request(src_ids))
    forward(writer)
    stored = writer.wait_for_save(timeout_s=5).stored["r"]
    assert stored.stored == 8 and stored.ok
    keys = backend.stored_keys()
    assert len(keys) == 8 * 3 and {decode_key(k).layer for k in keys} == {0, 1, 2}
    reader.start_load(request(dst_ids))
    assert forward(reader) == [True] * 3
    loaded = reader.wait_for_save(timeout_s=5).loaded["r"]
    assert loaded.hit_blocks == 8 and loaded.failed_block_ids == ()
    reader.close()
    writer.close()
    for s, d in zip(src_ids, dst_ids):
        for name in src:
            assert block_bytes(dst[name], d) == block_bytes(src[name], s)


async def test_lookup_counts_a_block_only_when_every_layer_is_present() -> None:
    src = LAYOUTS["flash_attn"]()
    backend = MemoryBackend()
    pool = make_pool(src, backend)
    assert (await pool.store(KVRequest(block_ids=ALL[:6], tokens=TOKENS))).stored == 6
    assert (await pool.store(KVRequest(block_ids=ALL[:6], tokens=TOKENS))).present == 6  # skipped, per key
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 6 * BLOCK
    victim = next(k for k in backend.stored_keys() if decode_key(k).layer == 2)
    block = [decode_key(k).block_hash for k in backend.stored_keys() if decode_key(k).layer == 0].index(
        decode_key(victim).block_hash
    )
    backend._objects.pop(victim)  # one layer of one block is gone (evicted)
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == block * BLOCK
    dst = zeros_like_caches(src)
    got = await make_pool(dst, backend).retrieve(KVRequest(block_ids=ALL[:6], tokens=TOKENS))
    assert got.statuses[block] is GetStatus.MISS and got.hit_blocks == block
    # the scheduler's pool has no layout: the format it is given carries the layer count
    assert pool.format == KVFormat(BLOCK, 3, pool.format.fingerprint)
    sched = KVPool.create(PoolConfig(layerwise=True), backend=backend, format=pool.format)
    assert await sched.lookup(KVRequest(tokens=TOKENS)) == block * BLOCK
    whole_blocks = KVPool.create(PoolConfig(), backend=backend, format=pool.format)
    assert await whole_blocks.lookup(KVRequest(tokens=TOKENS)) == 0  # per-layer objects are not whole blocks


async def test_replicas_store_each_layer_of_each_block_once_and_all_load_everything() -> None:
    backend = MemoryBackend()
    src = LAYOUTS["mla"]()
    pools = [make_pool(src, backend, tp_rank=r, tp_size=2, use_mla=True) for r in range(2)]
    results = [await p.store(KVRequest(block_ids=ALL, tokens=TOKENS)) for p in pools]
    for rank, result in enumerate(results):
        assert [s is PutStatus.STORED for s in result.statuses] == [i % 2 == rank for i in ALL]
        assert result.not_owned == 4
    assert backend.stats().puts == 8 * 3 and len(backend.stored_keys()) == 8 * 3
    for rank in range(2):
        dst = zeros_like_caches(src)
        got = await make_pool(dst, backend, tp_rank=rank, tp_size=2, use_mla=True).retrieve(
            KVRequest(block_ids=ALL, tokens=TOKENS)
        )
        assert got.hit_blocks == 8
        assert all(block_bytes(dst[n], i) == block_bytes(src[n], i) for n in src for i in ALL)


# -- events gate every read ------------------------------------------------------------------------


@attrs.define
class FakeStream:
    """A device stream: kernels and event markers complete in order; a kernel takes a random time
    and writes its layer's memory only when it completes."""

    rng: random.Random
    send: MemoryObjectSendStream[Callable[[], object]]

    def launch(self, write: Callable[[], object], max_delay_s: float) -> None:
        delay = self.rng.uniform(0, max_delay_s)

        async def kernel() -> None:
            await anyio.sleep(delay)
            write()

        self.send.send_nowait(kernel)

    def event(self) -> StreamEvent:
        return StreamEvent(self)


@attrs.define(eq=False)
class StreamEvent:
    stream: FakeStream
    done: bool = False

    def record(self) -> None:
        async def marker() -> None:
            self.done = True

        self.stream.send.send_nowait(marker)

    def query(self) -> bool:
        return self.done


async def run_device(receive: MemoryObjectReceiveStream[Callable[[], object]]) -> None:
    async with receive:
        async for op in receive:
            await op()  # type: ignore[misc]


async def test_storer_stores_what_the_kernels_wrote_never_stale_memory() -> None:
    rng = random.Random(1234)
    for trial in range(25):
        caches = {f"l{i}": torch.full((6, 2, BLOCK, 8), -1.0) for i in range(3)}  # stale contents
        fresh = {name: torch.randn(6, 2, BLOCK, 8) for name in caches}
        backend = MemoryBackend()
        pool = make_pool(caches, backend)  # type: ignore[arg-type]
        tokens = [trial * 1000 + t for t in range(6 * BLOCK)]
        send, receive = anyio.create_memory_object_stream[Callable[[], object]](100)
        stream = FakeStream(rng, send)
        events = LayerEvents.create(3, stream.event)
        async with anyio.create_task_group() as device:
            device.start_soon(run_device, receive)
            async with pool.layerwise_store(request(range(6), tokens=tokens), events) as storer:
                for layer, name in enumerate(caches):  # the engine: launch a layer, record, go on
                    stream.launch(functools.partial(caches[name].copy_, fresh[name]), max_delay_s=0.004)
                    events.record(layer)
                    await anyio.sleep(rng.uniform(0, 0.002))
                outcomes = [o async for o in storer]
            send.close()
        assert [o.ok for o in outcomes] == [True] * 3
        dst = zeros_like_caches(caches)  # type: ignore[arg-type]
        got = await make_pool(dst, backend).retrieve(KVRequest(block_ids=list(range(6)), tokens=tokens))
        assert got.hit_blocks == 6
        for name in caches:
            assert torch.equal(dst[name], fresh[name]), f"trial {trial}: stale KV stored for {name}"  # type: ignore[arg-type]


def test_sync_face_waits_for_each_layers_event_before_reading_it() -> None:
    """Events recorded on the engine thread complete later; the write they guard happens at that
    moment. Whatever the delays, the stored values are the written ones."""
    rng = random.Random(99)
    backend = MemoryBackend()
    caches = {f"l{i}": torch.full((8, 2, BLOCK, 8), -1.0) for i in range(4)}
    fresh = {name: torch.randn(8, 2, BLOCK, 8) for name in caches}
    pending: list[Callable[[], object]] = []
    lock = threading.Lock()

    @attrs.define(eq=False)
    class LateEvent:
        """Completes after a random delay; the kernels queued before it write on completion."""

        writes: list[Callable[[], object]] = attrs.field(factory=list)
        due: float = 0.0

        def record(self) -> None:
            with lock:
                self.writes, pending[:] = list(pending), []
            self.due = time.monotonic() + rng.uniform(0, 0.005)

        def query(self) -> bool:
            if time.monotonic() < self.due:
                return False
            for write in self.writes:
                write()
            self.writes = []
            return True

    with make_engine(caches, backend, event_factory=LateEvent) as kv:  # type: ignore[arg-type]
        for step in range(10):
            tokens = [step * 10_000 + t for t in range(8 * BLOCK)]
            for cache in caches.values():
                cache.fill_(-1.0)
            kv.start_store(request(ALL, tokens=tokens))
            for layer, name in enumerate(caches):
                with lock:
                    pending.append(functools.partial(caches[name].copy_, fresh[name]))
                kv.save_layer(layer)
            assert kv.wait_for_save(timeout_s=5).stored["r"].stored == 8
            dst = zeros_like_caches(caches)  # type: ignore[arg-type]
            reader = make_pool(dst, backend)
            got = anyio.run(reader.retrieve, KVRequest(block_ids=ALL, tokens=tokens))
            assert got.hit_blocks == 8
            assert all(torch.equal(dst[n], fresh[n]) for n in caches), f"step {step}"  # type: ignore[arg-type]


# -- overlap ---------------------------------------------------------------------------------------

LAYERS, STEP_S = 10, 0.03
OVERLAPPED_S = (LAYERS + 1) * STEP_S  # max(sum compute, sum load) + one layer: 0.33 s
SERIAL_S = 2 * LAYERS * STEP_S  # load everything, then compute: 0.60 s
MARGIN_S = 0.12  # generous, for a busy machine; still far below SERIAL_S


def overlap_caches() -> dict[str, object]:
    return {f"l{i}": torch.randn(8, 2, BLOCK, 8) for i in range(LAYERS)}  # the copies take no time


def test_sync_face_loads_layer_l_plus_1_while_the_engine_computes_layer_l() -> None:
    src = overlap_caches()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.get_delay_s = STEP_S  # every layer's get takes 30 ms
    dst = zeros_like_caches(src)
    with make_engine(dst, backend) as kv:
        start = time.monotonic()
        kv.start_load(request(ALL))
        arrived = forward(kv, compute_s=STEP_S)  # every layer's compute takes 30 ms
        result = kv.wait_for_save(timeout_s=5)
        elapsed = time.monotonic() - start
    assert arrived == [True] * LAYERS and result.failed_block_ids == frozenset()
    assert all(torch.equal(dst[n], src[n]) for n in src)  # type: ignore[arg-type]
    assert LAYERS * STEP_S <= elapsed < OVERLAPPED_S + MARGIN_S < SERIAL_S, elapsed


async def test_retriever_fetches_ahead_while_the_consumer_computes() -> None:
    src = overlap_caches()
    backend = ScriptedBackend()
    await make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS))
    backend.get_delay_s = STEP_S
    dst = zeros_like_caches(src)
    pool = make_pool(dst, backend)
    start = time.monotonic()
    async with pool.layerwise_retrieve(request(ALL), depth=1) as loader:
        async for outcome in loader:
            assert outcome.ok
            await anyio.sleep(STEP_S)  # compute the layer that just arrived
    elapsed = time.monotonic() - start
    assert loader.results()[0].hit_blocks == 8
    assert all(torch.equal(dst[n], src[n]) for n in src)  # type: ignore[arg-type]
    assert LAYERS * STEP_S <= elapsed < OVERLAPPED_S + MARGIN_S < SERIAL_S, elapsed


# -- threads ---------------------------------------------------------------------------------------


def test_a_full_cycle_through_the_sync_face_starts_only_the_loop_thread() -> None:
    src = LAYOUTS["vllm_cpu"]()
    dst = zeros_like_caches(src)
    backend = MemoryBackend()
    before = set(threading.enumerate())
    kv = make_engine(src, backend)
    started = set(threading.enumerate()) - before
    assert len(started) == 1
    for _ in range(3):
        kv.start_store(request(ALL))
        forward(kv)
        assert kv.wait_for_save(timeout_s=5).stored["r"].ok
    assert set(threading.enumerate()) - before == started
    reader = make_engine(dst, backend)
    assert len(set(threading.enumerate()) - before) == 2  # one loop thread per engine, nothing else
    reader.start_load(request(ALL))
    reader.start_store(request([8, 9], "other", tokens=list(range(2 * BLOCK))))
    forward(reader)
    result = reader.wait_for_save(timeout_s=5)
    assert len(set(threading.enumerate()) - before) == 2
    assert result.loaded["r"].hit_blocks == 8 and result.stored["other"].stored == 2
    reader.close()
    kv.close()
    assert set(threading.enumerate()) == before


# -- failures --------------------------------------------------------------------------------------


def test_a_layer_whose_get_fails_fails_every_block_of_the_request() -> None:
    src = LAYOUTS["kv_tuple"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.fail_get = {1}
    with make_engine(zeros_like_caches(src), backend) as kv:
        kv.start_load(request([7, 6, 5, 4, 3, 2, 1, 0]))
        start = time.monotonic()
        assert forward(kv) == [True, False, False]  # later layers are still handed out
        assert time.monotonic() - start < 1.0
        result = kv.wait_for_save(timeout_s=5)
    assert result.loaded["r"].statuses == (GetStatus.FAILED,) * 8
    assert result.failed_block_ids == frozenset(ALL)


@pytest.mark.parametrize("fault", ["fail", "hang"])
async def test_a_failing_put_does_not_hold_back_later_layers(fault: str) -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    setattr(backend, f"{fault}_put", {1})
    pool = make_pool(src, backend, timeout_s=0.5)
    start = time.monotonic()
    async with pool.layerwise_store(request(ALL), LayerEvents.completed(3)) as storer:
        outcomes = {o.layer: o for o in [o async for o in storer]}
    assert outcomes[0].ok and outcomes[2].ok and outcomes[1].failed == 8
    layer2_put = min(t for t, layer in backend.put_log if layer == 2)
    assert layer2_put - start < 0.2  # did not wait for layer 1's put to fail or time out
    assert storer.results()[0].failed_indices == tuple(ALL)  # a block with a missing layer is not stored
    assert {decode_key(k).layer for k in backend.inner.stored_keys()} == {0, 2}
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 0  # the partly stored blocks are invisible


async def test_cancelling_a_store_or_load_mid_request_leaves_no_tasks_and_nothing_visible() -> None:
    src = LAYOUTS["mla"]()
    backend = ScriptedBackend()
    pool = make_pool(src, backend)
    tasks_before = len(asyncio.all_tasks())
    events = LayerEvents.create(3, CpuEvent)
    with anyio.move_on_after(0.1) as scope:
        async with pool.layerwise_store(request(ALL), events) as storer:
            events.record(0)  # the engine dies before layer 1
            async for _ in storer:
                pass
    assert scope.cancelled_caught
    assert len(asyncio.all_tasks()) == tasks_before
    assert storer.results()[0].failed_indices == tuple(ALL)
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 0  # layer 0 is there, but no block is complete

    await pool.store(KVRequest(block_ids=ALL, tokens=TOKENS))
    backend.get_delay_s = 10
    dst = zeros_like_caches(src)
    reader = make_pool(dst, backend)
    with anyio.move_on_after(0.1):
        async with reader.layerwise_retrieve(request(ALL), depth=3) as loader:
            async for _ in loader:
                pass
    assert len(asyncio.all_tasks()) == tasks_before
    assert loader.results()[0].failed_block_ids == tuple(ALL)
    with anyio.fail_after(1):
        await reader.aclose()  # nothing in flight any more


def test_wait_for_save_skips_layers_that_were_never_saved() -> None:
    src = LAYOUTS["flashinfer"]()
    backend = MemoryBackend()
    with make_engine(src, backend, timeout_s=30) as kv:
        kv.start_store(request(ALL))
        kv.save_layer(0)  # the forward raised after layer 0; vLLM still calls wait_for_save
        start = time.monotonic()
        result = kv.wait_for_save()
        assert time.monotonic() - start < 1.0
        assert result.stored["r"].failed_indices == tuple(ALL)
        assert kv.lookup(KVRequest(tokens=TOKENS), timeout_s=5) == 0
        kv.start_store(request(ALL))  # the next step works as usual
        forward(kv)
        assert kv.wait_for_save().stored["r"].stored == 8


def test_a_layer_that_does_not_arrive_in_time_fails_the_steps_loads() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.get_delay_s = 10  # the store hangs; the pool gives up after 0.5 s
    with make_engine(zeros_like_caches(src), backend, timeout_s=0.5) as kv:
        kv.start_load(request(ALL))
        start = time.monotonic()
        assert kv.wait_for_layer_load(0, timeout_s=0.1) is False
        assert kv.wait_for_layer_load(1) is False  # no second wait once the step gave up
        assert time.monotonic() - start < 0.3
        result = kv.wait_for_save()
        assert result.failed_block_ids == frozenset(ALL)
        assert time.monotonic() - start < 2.0


def test_a_loader_that_ends_early_does_not_stall_the_layer_wait_behind_the_storer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken(self: LayerwiseRetriever) -> LayerwiseRetriever:
        raise RuntimeError("a bug in the retriever")

    monkeypatch.setattr(LayerwiseRetriever, "__aenter__", broken)
    src = LAYOUTS["vllm_cpu"]()
    with make_engine(zeros_like_caches(src), MemoryBackend(), timeout_s=5) as kv:
        kv.start_store(request([8, 9], "s", tokens=list(range(2 * BLOCK))))  # waits for layer events
        kv.start_load(request(ALL))
        start = time.monotonic()
        assert kv.wait_for_layer_load(0) is False
        assert time.monotonic() - start < 1.0
        with pytest.raises(RuntimeError, match="a bug in the retriever"):
            kv.wait_for_save()


def test_a_stuck_step_raises_and_stays_current_so_close_still_waits_for_it() -> None:
    @attrs.define
    class StuckPuts(ScriptedBackend):
        async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
            with anyio.CancelScope(shield=True):  # a backend call that ignores cancellation
                await anyio.sleep(1.0)
            return await self.inner.put(objects)

    src = LAYOUTS["vllm_cpu"]()
    kv = make_engine(src, StuckPuts(), timeout_s=0.1)
    kv.start_store(request(ALL))
    forward(kv)
    stuck = kv._step
    with pytest.raises(TimeoutError, match="stuck"):
        kv.wait_for_save(timeout_s=0.1)
    assert kv._step is stuck  # still reachable: close() cancels and waits for it
    kv.close(timeout_s=5)
    assert stuck is not None and all(f.done() for f in stuck.futures)


def test_close_mid_step_cancels_the_transfers_and_stops_the_thread() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.get_delay_s = 10
    before = set(threading.enumerate())
    kv = make_engine(zeros_like_caches(src), backend, timeout_s=30)
    kv.start_load(request(ALL))
    kv.start_store(request([8, 9], "s", tokens=list(range(2 * BLOCK))))
    kv.save_layer(0)
    start = time.monotonic()
    kv.close()
    assert time.monotonic() - start < 2.0
    assert set(threading.enumerate()) == before


def test_misuse_is_refused_with_a_clear_error() -> None:
    src = LAYOUTS["vllm_cpu"]()
    with pytest.raises(ConfigError, match="layerwise=True"):
        SyncLayerwisePool.open(PoolConfig(), layout=KVLayout.from_kv_caches(src))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="depth"):
        SyncLayerwisePool.open(layout=KVLayout.from_kv_caches(src), depth=0)  # type: ignore[arg-type]
    with make_engine(src, MemoryBackend()) as kv:
        with pytest.raises(RequestError, match="out of range"):
            kv.save_layer(3)
        with pytest.raises(RequestError, match="out of range"):
            kv.start_load(request([99]))
        kv.start_load(request([0]))
        with pytest.raises(RequestError, match="already called"):
            kv.start_load(request([1]))
        kv.save_layer(0)
        with pytest.raises(RequestError, match="before the first save_layer"):
            kv.start_store(request([0]))
        with pytest.raises(RequestError, match="twice"):
            make_pool(src, MemoryBackend()).layerwise_retrieve(request([0]) + request([1]))
        kv.wait_for_save(timeout_s=5)


def test_the_layerwise_bench_verifies_its_load_and_reports_every_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvflow.tools.bench_layerwise import layerwise_main

    assert layerwise_main(as_json=True, quick=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is True and report["layers"] == 8 and report["blocks"] == 64
    for key in ("compute_alone_s", "whole_then_compute_s", "layerwise_s", "layerwise_retrieve_s"):
        assert report[key] > 0
    assert report["whole_then_compute_s"] > report["compute_alone_s"]  # the load is not free
    for key in ("layerwise_vs_compute", "whole_then_compute_vs_compute", "layerwise_speedup"):
        assert report[key] > 0
