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
import numpy as np
import pytest
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow import (
    BackendError,
    ConfigError,
    GetStatus,
    KVFormat,
    KVLayout,
    KVPool,
    KVRequest,
    MemoryBackend,
    ParallelConfig,
    PoolClosedError,
    PoolConfig,
    PutStatus,
    RequestError,
    SyncLayerwisePool,
)
from kvflow.backends import ObjectRef
from kvflow.events import CpuEvent, LayerEvents
from kvflow.keys import decode_key, hash_blocks
from kvflow.layerwise import LayerOutcome, LayerwiseRetriever
from kvflow.profiles import is_book_key
from kvflow.sync_layerwise import _Step
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, block_bytes, kv_keys, kv_puts, zeros_like_caches
from tests.test_staging import LateDevice

TOKENS = list(range(500, 500 + BLOCK * 8))
ALL = list(range(8))


@attrs.define
class ScriptedBackend(FaultyBackend):
    """A memory backend whose gets can be slowed and fail, per layer."""

    get_delay_s: float = 0.0
    fail_get: set[int] = attrs.field(factory=set)

    @property
    def max_batch(self) -> int:
        return 64

    @staticmethod
    def _layers(objects: Sequence[ObjectRef]) -> set[int | None]:
        return {decode_key(o.key).scope.layers[0] for o in objects if not is_book_key(o.key)}

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
    keys = kv_keys(backend)
    assert len(keys) == 8 * 3 and {decode_key(k).scope.layers[0] for k in keys} == {0, 1, 2}
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
    block, hashes = 3, hash_blocks(TOKENS, BLOCK)
    victim = next(
        k
        for k in kv_keys(backend)
        if decode_key(k).scope.layers[0] == 2 and decode_key(k).block_hash == hashes[block]
    )
    backend._objects.pop(victim)  # one layer of one block is gone (evicted)
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == block * BLOCK
    dst = zeros_like_caches(src)
    got = await make_pool(dst, backend).retrieve(KVRequest(block_ids=ALL[:6], tokens=TOKENS))
    assert got.statuses[block] is GetStatus.MISS and got.hit_blocks == block
    # the scheduler's pool has no layout: the format it is given carries the layer count
    assert pool.format == KVFormat(BLOCK, 3, pool.format.meaning, pool.format.order)
    sched = KVPool.create(PoolConfig(layerwise=True), backend=backend, format=pool.format)
    assert await sched.lookup(KVRequest(tokens=TOKENS)) == block * BLOCK
    whole_blocks = KVPool.create(PoolConfig(), backend=backend, format=pool.format)
    # a whole-block engine reads per-layer objects through the store's profiles (docs/topology.md)
    assert await whole_blocks.lookup(KVRequest(tokens=TOKENS)) == block * BLOCK


async def test_replicas_store_each_layer_of_each_block_once_and_all_load_everything() -> None:
    backend = MemoryBackend()
    src = LAYOUTS["mla"]()
    pools = [make_pool(src, backend, tp_rank=r, tp_size=2, use_mla=True) for r in range(2)]
    results = [await p.store(KVRequest(block_ids=ALL, tokens=TOKENS)) for p in pools]
    for rank, result in enumerate(results):
        assert [s is PutStatus.STORED for s in result.statuses] == [i % 2 == rank for i in ALL]
        assert result.not_owned == 4
    assert kv_puts(backend) == 8 * 3 and len(kv_keys(backend)) == 8 * 3
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

LAYERS = 10
WAIT_S = 10.0  # how long a layer's compute waits for the next layer's get to start: only a broken
# overlap ever waits that long (the get starts as soon as the layer is handed out)


@attrs.define
class GetLog(ScriptedBackend):
    """Records when each layer's get starts (the loop thread), so that the engine (any thread) can
    wait for it and the test can check the order of events."""

    started: dict[int, threading.Event] = attrs.field(
        factory=lambda: {n: threading.Event() for n in range(LAYERS)}
    )
    log: list[tuple[str, int]] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def note(self, what: str, layer: int) -> None:
        with self.lock:
            self.log.append((what, layer))

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        (layer,) = self._layers(objects)
        assert layer is not None
        self.note("get", layer)
        self.started[layer].set()
        return await super().get(objects)


def overlap_caches() -> dict[str, object]:
    return {f"l{i}": torch.randn(8, 2, BLOCK, 8) for i in range(LAYERS)}


def check_overlap(log: list[tuple[str, int]], depth: int | None) -> None:
    """Layer l+1's get started before the engine finished computing layer l (it waited for it), and
    no get ran more than ``depth`` layers ahead of the last layer handed out (None: unbounded)."""
    at = {event: n for n, event in enumerate(log)}
    for layer in range(LAYERS - 1):
        assert at["get", layer + 1] < at["computed", layer], layer
    for layer in range(LAYERS if depth is not None else 0):
        handed = at["handed out", layer]
        assert all(at["get", later] > handed for later in range(layer + (depth or 0) + 1, LAYERS)), layer


def test_sync_face_loads_layer_l_plus_1_while_the_engine_computes_layer_l() -> None:
    src = overlap_caches()
    backend = GetLog()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    dst = zeros_like_caches(src)
    with make_engine(dst, backend) as kv:
        kv.start_load(request(ALL))
        arrived = []
        for layer in range(LAYERS):
            arrived.append(kv.wait_for_layer_load(layer))
            backend.note("handed out", layer)
            if layer + 1 < LAYERS:  # compute layer l: it ends only once layer l+1 is on its way
                assert backend.started[layer + 1].wait(WAIT_S), f"layer {layer + 1} did not start"
            backend.note("computed", layer)
            kv.save_layer(layer)
        result = kv.wait_for_save(timeout_s=5)
    assert arrived == [True] * LAYERS and result.failed_block_ids == frozenset()
    assert all(torch.equal(dst[n], src[n]) for n in src)  # type: ignore[arg-type]
    # the loop thread hands layers out as they arrive, ahead of the engine: no bound on the lead
    check_overlap(backend.log, depth=None)


@pytest.mark.parametrize("depth", [1, 3])
async def test_retriever_fetches_ahead_while_the_consumer_computes(depth: int) -> None:
    src = overlap_caches()
    backend = GetLog()
    await make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS))
    dst = zeros_like_caches(src)
    pool = make_pool(dst, backend)
    async with pool.layerwise_retrieve(request(ALL), depth=depth) as loader:
        async for outcome in loader:
            assert outcome.ok
            layer = outcome.layer
            backend.note("handed out", layer)
            if layer + 1 < LAYERS:  # compute the layer that just arrived, until the next one is on its way
                with anyio.fail_after(WAIT_S):
                    while not backend.started[layer + 1].is_set():
                        await anyio.sleep(0)
            backend.note("computed", layer)
    assert loader.results()[0].hit_blocks == 8
    assert all(torch.equal(dst[n], src[n]) for n in src)  # type: ignore[arg-type]
    check_overlap(backend.log, depth)


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
    with make_engine(zeros_like_caches(src), backend, timeout_s=30) as kv:
        kv.start_load(request([7, 6, 5, 4, 3, 2, 1, 0]))
        start = time.monotonic()
        assert forward(kv) == [True, False, False]  # later layers are still handed out
        assert time.monotonic() - start < 10  # not after the 30 s timeout: the failure ends the wait
        result = kv.wait_for_save(timeout_s=5)
    assert result.loaded["r"].statuses == (GetStatus.FAILED,) * 8
    assert result.failed_block_ids == frozenset(ALL)


def test_a_load_the_closed_pool_refused_fails_its_layers_at_once() -> None:
    """``start_load`` on a pool closed under the engine (or in a forked child) raises
    PoolClosedError; the step's layer waits then say False at once, not after the pool's timeout
    (before, each waited its 30 s: the refused load counted as still running)."""
    src = LAYOUTS["kv_tuple"]()
    kv = make_engine(zeros_like_caches(src), MemoryBackend(), timeout_s=30)
    kv.close()
    with pytest.raises(PoolClosedError):
        kv.start_load(request(ALL))
    start = time.monotonic()
    assert forward(kv) == [False, False, False]
    assert time.monotonic() - start < 10  # not after the 30 s timeout


def test_a_step_stores_no_layer_after_a_failed_load() -> None:
    """After wait_for_layer_load said False, the rest of the forward rests on KV that did not
    arrive: the step's stores keep no layer from then on (never a block partly computed on
    missing KV in the store)."""
    src = LAYOUTS["kv_tuple"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.fail_get = {1}
    new_tokens = [t + 10_000 for t in TOKENS]
    with make_engine(zeros_like_caches(src), backend, timeout_s=30) as kv:
        kv.start_load(request([7, 6, 5, 4, 3, 2, 1, 0]))
        kv.start_store(request(ALL, "s", new_tokens))
        assert forward(kv) == [True, False, False]
        assert kv.wait_for_save(timeout_s=5).stored["s"].stored == 0
        new_hashes = {h.hex() for h in hash_blocks(new_tokens, BLOCK)}
        new_layers = {decode_key(k).scope.layers[0] for k in kv_keys(backend.inner) if k[-64:] in new_hashes}
    assert new_layers == {0}  # computed before the failure; nothing after it is stored


def test_a_layers_event_is_timed_from_its_load_not_from_the_store_start() -> None:
    """In a step that loads and stores, the engine computes a layer once its load arrived: the
    store gives the layer's event ``timeout_s`` from then. It gave it ``timeout_s`` from the start
    of the store (before the load), and a step whose layers each load and compute on time but not
    both within ``timeout_s`` stored nothing, with every layer saved."""
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    anyio.run(
        lambda: make_pool(src, backend).store(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS[: 4 * BLOCK]))
    )
    backend.get_delay_s = 0.4  # each layer's load, within the timeout
    with make_engine(zeros_like_caches(src), backend, timeout_s=0.6) as kv:
        kv.start_load(request([0, 1, 2, 3]))
        kv.start_store(
            [KVRequest(request_id="s", block_ids=[4, 5], tokens=TOKENS[: 6 * BLOCK], block_offset=4)]
        )
        assert forward(kv, compute_s=0.35) == [True] * kv.num_layers  # each layer's compute, within it too
        result = kv.wait_for_save(timeout_s=10)
    assert not result.failed_block_ids and result.stored["s"].stored == 2


async def test_a_loader_given_once_the_store_runs_still_keeps_unloaded_kv_out_of_the_store() -> None:
    """SyncLayerwisePool.start_load may come after start_store: the storer then runs before it
    knows its loader. A layer computed on KV that did not load (here, a prompt nobody stored) must
    still not be stored once its event fires."""
    src = LAYOUTS["kv_tuple"]()
    backend = MemoryBackend()
    pool = make_pool(src, backend)
    events = LayerEvents.create(pool.format.num_layers, CpuEvent)
    new_tokens = [t + 10_000 for t in TOKENS]
    stored = [KVRequest(request_id="s", block_ids=[0, 1], tokens=new_tokens[: 2 * BLOCK])]
    async with pool.layerwise_store(stored, events) as storer:
        await anyio.sleep(0.05)  # the storer waits at layer 0 before it has a loader
        loader = pool.layerwise_retrieve(request([2, 3], tokens=TOKENS[: 2 * BLOCK]), depth=1)
        storer.loaded_by = loader  # as SyncLayerwisePool.start_load does
        async with loader:
            async for outcome in loader:
                assert not outcome.ok  # nothing to load: the forward computes on what is not there
                events.record(outcome.layer)
        assert [outcome.ok async for outcome in storer] == [False] * pool.format.num_layers
    new_hashes = {h.hex() for h in hash_blocks(new_tokens, BLOCK)}
    assert not [k for k in kv_keys(backend) if k[-64:] in new_hashes]


@attrs.define
class MisconfiguredPut(FaultyBackend):
    """Layer 1's put raises BackendError: a misconfigured backend, which must reach the caller."""

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if 1 in ScriptedBackend._layers(objects):
            raise BackendError("injected: the backend is misconfigured")
        return await self.inner.put(objects)


def test_a_layers_backend_error_reaches_wait_for_save_as_it_is() -> None:
    """wait_for_save raises the error a transfer raised as that error (not an exception group of
    the storer's tasks), as the whole-block faces do; the vLLM connector catches BackendError."""
    with make_engine(LAYOUTS["vllm_cpu"](), MisconfiguredPut(), timeout_s=5) as kv:
        kv.start_store(request([0, 1, 2, 3]))
        forward(kv)
        with pytest.raises(BackendError, match="misconfigured"):
            kv.wait_for_save(timeout_s=5)


def test_the_vllm_layerwise_steps_count_a_backend_error_as_a_failed_step() -> None:
    from kvflow.integrations.vllm.steps import LayerwiseSteps

    with make_engine(LAYOUTS["vllm_cpu"](), MisconfiguredPut(), timeout_s=5) as kv:
        steps, saves = LayerwiseSteps(kv), request([0, 1, 2, 3])
        for layer in range(kv.num_layers):
            steps.save_layer(layer, saves)
        assert [s.request_id for s in steps.finish(saves).dropped] == ["r"]


@attrs.define
class SlowBookPuts(FaultyBackend):
    """A store whose put of a profile announcement takes 50 ms (a remote store's round trip)."""

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if objects and all(is_book_key(o.key) for o in objects):
            await anyio.sleep(0.05)
        return await super().put(objects)


def test_a_layerwise_storing_engine_announces_its_profile() -> None:
    """Every storing pool announces its profile (docs/topology.md), also when a layerwise step's
    puts end before the announcement's: a whole-block pool then finds its blocks."""
    src = LAYOUTS["vllm_cpu"]()
    backend = SlowBookPuts()
    with make_engine(src, backend, timeout_s=5) as kv:
        for step in range(3):
            tokens = [step * 1000 + t for t in range(BLOCK * 4)]
            kv.start_store(request([0, 1, 2, 3], tokens=tokens))
            forward(kv)
            assert kv.wait_for_save(timeout_s=5).stored["r"].stored == 4

        async def whole_block_lookup() -> int:
            reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
            return await reader.lookup(KVRequest(tokens=tokens))

        assert anyio.run(whole_block_lookup) == BLOCK * 4


def test_wait_for_layer_load_returns_within_its_timeout_when_the_copies_are_late() -> None:
    """docs/layerwise.md, event contract 4: False after the timeout, also when the layer's staged
    copies into the cache are late: one bound for the wait and the copies."""
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    staged = PoolConfig(layerwise=True, staging="always", staging_bytes=1 << 20, timeout_s=10.0)
    anyio.run(
        lambda: KVPool.create(staged, layout=KVLayout.from_kv_caches(src), backend=backend).store(  # type: ignore[arg-type]
            KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS)
        )
    )
    backend.get_delay_s = 0.25
    device = LateDevice(torch.device("cpu"))
    device.rng.uniform = lambda a, b: 0.6  # type: ignore[method-assign]  # every copy lands 0.6 s late
    with SyncLayerwisePool.open(
        staged,
        layout=KVLayout.from_kv_caches(zeros_like_caches(src)),
        backend=backend,
        device=device,  # type: ignore[arg-type]
    ) as kv:
        kv.start_load(request([0, 1, 2, 3]))
        start = time.monotonic()
        arrived = kv.wait_for_layer_load(0, timeout_s=0.4)
        took = time.monotonic() - start
        kv.wait_for_save(timeout_s=10)
    assert not arrived and took < 0.4 + 0.15, f"took {took:.3f} s"


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("call", ["wait_for_layer_load", "wait_for_save"])
def test_step_calls_refuse_a_timeout_that_is_not_finite_and_positive(call: str, bad: float) -> None:
    """As every other face: a NaN would wait for ever, 0 or less would cancel a healthy step."""
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS)))
    backend.get_delay_s = 60  # the load hangs (cancellable)
    with make_engine(zeros_like_caches(src), backend, timeout_s=30) as kv:
        kv.start_load(request([0, 1, 2, 3]))
        with pytest.raises(ConfigError, match="timeout_s"):
            if call == "wait_for_layer_load":
                kv.wait_for_layer_load(0, timeout_s=bad)
            else:
                kv.wait_for_save(timeout_s=bad)
        kv.close(timeout_s=5)


@attrs.define
class SlowFailingLayer(ScriptedBackend):
    """Layer 1's put fails (or hangs) only after layer 2's put started, if it ever does (a store that
    puts one layer after another runs it to its deadline first); every put's start and end is logged."""

    fault: str = "fail"
    log: list[tuple[str, int | None]] = attrs.field(factory=list)
    layer2: anyio.Event | None = None

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        layers = self._layers(objects)
        if self.layer2 is None:
            self.layer2 = anyio.Event()
        self.log += [("start", layer) for layer in layers]
        try:
            if 1 in layers:
                with anyio.move_on_after(WAIT_S):
                    await self.layer2.wait()
                if self.fault == "hang":
                    await anyio.sleep_forever()
                raise ConnectionError("injected put failure")
            if 2 in layers:
                self.layer2.set()
            return await self.inner.put(objects)
        finally:
            self.log += [("end", layer) for layer in layers]


@pytest.mark.parametrize("fault", ["fail", "hang"])
async def test_a_failing_put_does_not_hold_back_later_layers(fault: str) -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = SlowFailingLayer(fault=fault)
    pool = make_pool(src, backend, timeout_s=0.5)
    async with pool.layerwise_store(request(ALL), LayerEvents.completed(3)) as storer:
        outcomes = {o.layer: o for o in [o async for o in storer]}
    assert outcomes[0].ok and outcomes[2].ok and outcomes[1].failed == 8
    # layer 2's put started while layer 1's was still running: it did not wait for it to fail or time out
    assert backend.log.index(("start", 2)) < backend.log.index(("end", 1))
    assert storer.results()[0].failed_indices == tuple(ALL)  # a block with a missing layer is not stored
    assert {decode_key(k).scope.layers[0] for k in kv_keys(backend.inner)} == {0, 2}
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
        assert time.monotonic() - start < 10  # it did not wait out the 30 s timeout for layers 1, 2
        assert result.stored["r"].failed_indices == tuple(ALL)
        assert kv.lookup(KVRequest(tokens=TOKENS), timeout_s=5) == 0
        kv.start_store(request(ALL))  # the next step works as usual
        forward(kv)
        assert kv.wait_for_save().stored["r"].stored == 8


def test_a_layer_that_does_not_arrive_in_time_fails_the_steps_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.get_delay_s = 60  # the store hangs; the pool gives up after 0.5 s
    waits: list[tuple[int, float]] = []
    wait_layer = _Step.wait_layer

    def recorded(step: _Step, layer: int, timeout_s: float) -> LayerOutcome | bool | None:
        waits.append((layer, timeout_s))
        return wait_layer(step, layer, timeout_s)

    monkeypatch.setattr(_Step, "wait_layer", recorded)
    with make_engine(zeros_like_caches(src), backend, timeout_s=0.5) as kv:
        kv.start_load(request(ALL))
        start = time.monotonic()
        assert kv.wait_for_layer_load(0, timeout_s=0.1) is False
        assert kv.wait_for_layer_load(1) is False
        assert waits == [(0, pytest.approx(0.1, abs=0.01))]  # no second wait once the step gave up
        result = kv.wait_for_save()
        assert result.failed_block_ids == frozenset(ALL)
        assert time.monotonic() - start < 10  # the pool's 0.5 s, not the backend's 60 s


def test_a_loader_that_ends_early_does_not_stall_the_layer_wait_behind_the_storer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken(self: LayerwiseRetriever) -> LayerwiseRetriever:
        raise RuntimeError("a bug in the retriever")

    monkeypatch.setattr(LayerwiseRetriever, "__aenter__", broken)
    src = LAYOUTS["vllm_cpu"]()
    with make_engine(zeros_like_caches(src), MemoryBackend(), timeout_s=30) as kv:
        kv.start_store(request([8, 9], "s", tokens=list(range(2 * BLOCK))))  # waits for layer events
        kv.start_load(request(ALL))
        start = time.monotonic()
        assert kv.wait_for_layer_load(0) is False
        assert time.monotonic() - start < 10  # not after the 30 s timeout the storer may wait
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
    backend.get_delay_s = 60
    before = set(threading.enumerate())
    kv = make_engine(zeros_like_caches(src), backend, timeout_s=30)
    kv.start_load(request(ALL))
    kv.start_store(request([8, 9], "s", tokens=list(range(2 * BLOCK))))
    kv.save_layer(0)
    start = time.monotonic()
    kv.close()
    assert time.monotonic() - start < 10  # cancelled: neither the 60 s get nor the 30 s timeout ran out
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


def test_a_step_of_several_requests_reports_each_ones_failed_blocks() -> None:
    """A step's result is by request id: a step of several requests needs an id on each (without
    one, all but one request's results, and the blocks it must recompute, would be lost), and
    with them each request's missing blocks are reported failed beside another's hits."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    absent = list(range(5000, 5000 + BLOCK * 2))
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=[2, 3], tokens=TOKENS[: 2 * BLOCK])))
    with make_engine(zeros_like_caches(src), backend) as kv:
        unnamed = [
            KVRequest(block_ids=[0, 1], tokens=absent),
            KVRequest(block_ids=[4, 5], tokens=TOKENS[: 2 * BLOCK]),
        ]
        with pytest.raises(RequestError, match="request_id on each"):
            kv.start_load(unnamed)
        with pytest.raises(RequestError, match="request_id on each"):
            kv.start_store(unnamed)
        kv.start_load([attrs.evolve(unnamed[0], request_id="a"), attrs.evolve(unnamed[1], request_id="b")])
        assert forward(kv) == [False] * kv.num_layers
        result = kv.wait_for_save(timeout_s=5)
    assert result.failed_block_ids == {0, 1}
    assert result.loaded["a"].hit_blocks == 0 and result.loaded["b"].hit_blocks == 2


def test_the_layerwise_bench_verifies_its_load_and_reports_every_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvflow.tools.bench_layerwise import layerwise_main

    assert layerwise_main(as_json=True, quick=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is True and report["layers"] == 8 and report["blocks"] == 64
    for key in ("compute_alone_s", "whole_then_compute_s", "layerwise_s", "layerwise_retrieve_s"):
        assert report[key] > 0
    for key in ("layerwise_vs_compute", "whole_then_compute_vs_compute", "layerwise_speedup"):
        assert report[key] > 0


async def test_each_layer_reports_exactly_the_blocks_it_could_not_move() -> None:
    """Stores: 3 of 8 blocks are already in the store; layer 0's event fires, layer 1's never does,
    so layers 1 and 2 are abandoned and fail only the 5 blocks not present. Loads: layer 0 of every
    block is in the store, layers 1 and 2 of 5 blocks: each layer reports the blocks it missed."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    pool = make_pool(src, backend, timeout_s=0.2)
    await pool.store(KVRequest(block_ids=[0, 1, 2], tokens=TOKENS[: 3 * BLOCK]))
    events = LayerEvents.create(3, CpuEvent)
    async with pool.layerwise_store(request(ALL), events) as storer:
        events.record(0)  # the engine wrote layer 0, then stopped
        outcomes = [o async for o in storer]
    assert [(o.layer, o.failed) for o in outcomes] == [(0, 0), (1, 5), (2, 5)]
    assert storer.results()[0].failed_indices == (3, 4, 5, 6, 7)

    async with pool.layerwise_store(
        request([0, 1, 2], tokens=TOKENS[: 3 * BLOCK]), LayerEvents.completed(3)
    ) as again:
        assert [(o.layer, o.failed) async for o in again] == [
            (0, 0),
            (1, 0),
            (2, 0),
        ]  # all present: none fail
    assert again.results()[0].statuses == (PutStatus.PRESENT,) * 3

    await pool.store(KVRequest(block_ids=[3, 4], tokens=TOKENS[: 5 * BLOCK], block_offset=3))
    dst = zeros_like_caches(src)
    async with make_pool(dst, backend).layerwise_retrieve(
        request([7, 6, 5, 4, 3, 2, 1, 0]), depth=2
    ) as loader:
        loaded = [(o.layer, o.failed) async for o in loader]
    assert loaded == [(0, 0), (1, 3), (2, 3)]
    assert loader.results()[0].hit_blocks == 5


async def test_each_blocks_status_stays_its_own_when_layers_miss_different_blocks() -> None:
    """Layer 0 of block 1 and layer 1 of block 3 are gone from the store: a layer-by-layer
    retrieve fails exactly blocks 1 and 3 (a later layer loads only the blocks still whole, and
    its answers must land on those blocks, not on the request's first ones)."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    ids = [5, 2, 7, 0, 6, 1, 4, 3]
    await make_pool(src, backend).store(request(ids)[0])
    hashes = hash_blocks(TOKENS, BLOCK)
    wanted = {(0, hashes[1]), (1, hashes[3])}  # (first layer of the object, its block's hash)
    gone = [
        k for k in kv_keys(backend) if (decode_key(k).scope.layers[0], decode_key(k).block_hash) in wanted
    ]
    assert len(gone) == 2 and await backend.remove(gone) == [True, True]
    dst = zeros_like_caches(src)
    retriever = make_pool(dst, backend).layerwise_retrieve(request(ids))  # layer by layer, in turn
    async with retriever:
        outcomes = [outcome async for outcome in retriever]
    assert [o.failed for o in outcomes] == [1, 2, 2]  # blocks failed so far, after each layer
    (got,) = retriever.results()
    assert got.failed_block_ids == (ids[1], ids[3])
    assert [s is GetStatus.HIT for s in got.statuses] == [i not in (1, 3) for i in range(8)]
    for i in (0, 2, 4, 5, 6, 7):  # every block reported loaded holds its bytes, every layer
        assert all(block_bytes(dst[name], ids[i]) == block_bytes(src[name], ids[i]) for name in src)


@attrs.define
class FullForLayer1(ScriptedBackend):
    """A store with no room for layer 1's objects: their puts report NO_SPACE."""

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if 1 in self._layers(objects):
            return [PutStatus.NO_SPACE] * len(objects)
        return await self.inner.put(objects)


async def test_a_layer_the_store_has_no_room_for_counts_its_blocks_failed() -> None:
    """NO_SPACE is a failure to store: the layer's outcome counts every block of it, and no block
    of the request is stored whole."""
    pool = make_pool(LAYOUTS["vllm_cpu"](), FullForLayer1())
    async with pool.layerwise_store(request(ALL), LayerEvents.completed(3)) as storer:
        outcomes = {o.layer: o for o in [o async for o in storer]}
    assert [outcomes[layer].failed for layer in range(3)] == [0, 8, 0]
    (result,) = storer.results()
    assert result.statuses == (PutStatus.NO_SPACE,) * 8 and result.failed_indices == tuple(ALL)


@attrs.define
class SlowWholeBlocks(ScriptedBackend):
    """Gets of whole-block objects (every layer in one) take ``whole_delay_s``."""

    whole_delay_s: float = 0.0

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if any(decode_key(o.key).scope.layers[1] - decode_key(o.key).scope.layers[0] > 1 for o in objects
               if not is_book_key(o.key)):  # fmt: skip
            await anyio.sleep(self.whole_delay_s)
        return await super().get(objects)


async def test_a_layerwise_reader_of_whole_block_objects_loads_every_layer_with_layers_in_flight() -> None:
    """Each layer takes its blocks from another profile's whole-block objects. While layer 2 looked
    there (slowly), its blocks were marked missed, and layer 3, started then (its turn came when the
    engine took layer 1), skipped them as failed: layer 3 was never loaded, yet layer 2's success
    marked every block loaded again and the load reported every block a hit: an engine computing on
    KV that was not there. Every layer must arrive, bit for bit, and the results say so."""
    src = LAYOUTS["flash_attn"]()
    src["l3"] = torch.randn_like(src["l0"])  # type: ignore[arg-type]
    backend = SlowWholeBlocks(whole_delay_s=0.05)
    writer = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    assert (await writer.store(KVRequest(block_ids=ALL, tokens=TOKENS))).stored == len(ALL)
    dst = zeros_like_caches(src)
    reader = make_pool(dst, backend)
    outcomes = []
    async with reader.layerwise_retrieve(request(ALL), depth=2) as loader:
        async for outcome in loader:  # layers 0 and 1 end together; layer 2 starts as 0 is taken
            outcomes.append((outcome.layer, outcome.failed))
            await anyio.sleep(0.02)  # the engine computes layer 0: layer 2 is in its slow get
    assert outcomes == [(layer, 0) for layer in range(4)]
    assert loader.results()[0].hit_blocks == len(ALL)
    for name in src:
        for block in ALL:
            assert block_bytes(dst[name], block) == block_bytes(src[name], block), (name, block)
    await writer.aclose()
    await reader.aclose()


@attrs.define
class JitteryBackend(ScriptedBackend):
    """Each get waits 0, 1 or 4 ms first, at random (seeded): the layers' fetches interleave every way."""

    jitter: random.Random = attrs.field(factory=random.Random)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        await anyio.sleep(self.jitter.choice((0, 0, 0.001, 0.004)))
        return await super().get(objects)


@settings(max_examples=60, deadline=None)
@given(
    whole=st.sets(st.sampled_from(ALL)),
    layered=st.sets(st.sampled_from(ALL)),
    depth=st.integers(1, 4),
    staged=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_layerwise_load_from_mixed_profiles_reports_exactly_the_blocks_it_loaded(
    whole: set[int], layered: set[int], depth: int, staged: bool, seed: int
) -> None:
    """Some blocks stored by a whole-block engine, some by a layerwise one like the reader, some by
    none; gets that take random times and an engine that takes random times per layer. A block is
    reported loaded exactly when some profile holds it, and every block reported loaded holds the
    writers' KV in every layer, bit for bit."""

    async def run() -> None:
        jitter = random.Random(seed)
        src = LAYOUTS["flash_attn"]()
        src["l3"] = torch.randn_like(src["l0"])  # type: ignore[arg-type]
        backend = JitteryBackend(jitter=jitter)
        for layerwise, blocks in ((False, whole), (True, layered)):
            writer = KVPool.create(
                PoolConfig(layerwise=layerwise),
                layout=KVLayout.from_kv_caches(src),
                backend=backend,  # type: ignore[arg-type]
            )
            for block in blocks:  # one block a request: a store stores the prefix it is given
                tokens = TOKENS[: (block + 1) * BLOCK]
                await writer.store(KVRequest(block_ids=list(range(block + 1)), tokens=tokens))
        dst = zeros_like_caches(src)
        config = PoolConfig(layerwise=True, timeout_s=5.0)
        if staged:
            config = attrs.evolve(config, staging="always", staging_bytes=8 * 1024)
        reader = KVPool.create(config, layout=KVLayout.from_kv_caches(dst), backend=backend)  # type: ignore[arg-type]
        async with reader.layerwise_retrieve(request(ALL), depth=depth) as loader:
            async for _ in loader:
                await anyio.sleep(jitter.choice((0, 0.002)))  # the engine computes the layer
        result = loader.results()[0]
        await reader.aclose()
        held = {b for b in ALL if any(b <= w for w in whole) or any(b <= lw for lw in layered)}
        assert set(ALL) - set(result.failed_block_ids) == held
        for block in held:
            for name in src:
                assert block_bytes(dst[name], block) == block_bytes(src[name], block), (name, block)

    anyio.run(run)


@pytest.mark.parametrize("layer", [True, 1.0, "1"])
def test_a_layer_that_is_not_an_integer_is_refused(layer: object) -> None:
    """Block ids and offsets refuse bools and non-integers (KVRequest); so does the step face's
    ``layer``, by the same check: before, ``True`` silently meant layer 1 and ``1.0`` passed the
    range check to fail later with a bare TypeError. Nothing is recorded for a refused layer; an
    integer numpy layer is taken as the int it is."""
    src = LAYOUTS["vllm_cpu"]()
    with make_engine(src, MemoryBackend()) as kv:
        kv.start_store(request([0, 1]))
        with pytest.raises(RequestError, match="a layer must be"):
            kv.save_layer(layer)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match="a layer must be"):
            kv.wait_for_layer_load(layer)  # type: ignore[arg-type]
        for n in range(kv.num_layers):
            kv.save_layer(np.int64(n))  # type: ignore[arg-type]
        result = kv.wait_for_save()
        assert result.stored["r"].ok and result.stored["r"].stored == 2


def test_a_steps_loads_are_known_once_its_forward_waited_for_every_layer_before_the_step_ends() -> None:
    """vLLM with speculative decoding asks for a step's load errors before wait_for_save:
    wait_for_load has them once the forward waited for every layer (a failed layer-1 get fails
    its blocks), and wait_for_save reports the same. A step that loads nothing has none."""
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend(fail_get={1})
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    with make_engine(zeros_like_caches(src), backend) as kv:
        assert kv.wait_for_load() == {}
        kv.start_load(request([7, 6]))
        assert forward(kv) == [True, False, False]  # (a failed layer fails the rest of the forward)
        early = kv.wait_for_load()
        assert set(early) == {"r"} and early["r"].failed_block_ids == (7, 6)
        assert kv.wait_for_save().loaded == early


def test_the_loads_of_a_step_whose_layer_wait_timed_out_are_failed_at_once() -> None:
    """Once a layer's wait ran out, the step's loads are failed whatever the loader says later:
    wait_for_load answers at once instead of waiting up to the pool's timeout for the loader."""
    src = LAYOUTS["vllm_cpu"]()
    backend = ScriptedBackend()
    anyio.run(lambda: make_pool(src, backend).store(KVRequest(block_ids=ALL, tokens=TOKENS)))
    backend.get_delay_s = 1.0
    with make_engine(zeros_like_caches(src), backend, timeout_s=3) as kv:
        kv.start_load(request([7, 6]))
        assert kv.wait_for_layer_load(0, timeout_s=0.1) is False
        start = time.monotonic()
        loaded = kv.wait_for_load()
        assert time.monotonic() - start < 0.5
        assert loaded["r"].failed_block_ids == (7, 6)
        assert kv.wait_for_save().loaded == loaded
