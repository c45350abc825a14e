"""Device events: CPU, CUDA (skipped without a GPU), NPU (a clear error without torch_npu), and
awaiting them on the loop without blocking it."""

from __future__ import annotations

import importlib.util
import itertools
import time

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import pytest
import torch

from kvflow import (
    ConfigError,
    KVLayout,
    KVPool,
    KVRequest,
    MemoryBackend,
    MissingDependencyError,
    PoolConfig,
    RequestError,
    events,
)
from kvflow.events import MAX_POLL_S, CpuEvent, CudaEvent, DeviceEvent, LayerEvents, make_event, wait_event
from tests.helpers import kv_keys

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@attrs.define
class TimedEvent:
    """Completes ``delay_s`` after it is recorded; counts how often it was asked."""

    delay_s: float
    recorded_at: float | None = None
    queries: int = 0

    def record(self) -> None:
        self.recorded_at = time.monotonic()

    def query(self) -> bool:
        self.queries += 1
        return self.recorded_at is not None and time.monotonic() >= self.recorded_at + self.delay_s


def test_cpu_event_is_complete_once_recorded() -> None:
    event = CpuEvent()
    assert isinstance(event, DeviceEvent)
    assert not event.query()
    event.record()
    assert event.query()


def test_make_event_picks_the_device_kind() -> None:
    assert isinstance(make_event(torch.device("cpu")), CpuEvent)
    assert isinstance(make_event("cpu"), CpuEvent)
    with pytest.raises(ConfigError, match="cpu, cuda and npu"):
        make_event("meta")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_npu_events_without_torch_npu_say_what_to_install() -> None:
    with pytest.raises(MissingDependencyError, match=r"torch_npu.*pip install 'kvflow\[npu\]'"):
        make_event("npu")


@attrs.define
class CountedEvent:
    """Completes at its ``done_at``-th query; records what the loop did between queries."""

    done_at: int
    log: list[str] = attrs.field(factory=list)
    queries: int = 0

    def record(self) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        self.log.append("query")
        return self.queries >= self.done_at


async def test_wait_event_polls_with_a_capped_back_off_without_blocking_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order of events, not the clock: between two queries the waiter sleeps (50 us doubling to
    ``MAX_POLL_S``, so a completed event is noticed within one such step) and other tasks run; the
    waiter returns at the first query that answers complete."""
    event = CountedEvent(done_at=30)
    sleeps: list[float] = []
    sleep = anyio.sleep

    async def recorded(delay: float) -> None:
        sleeps.append(delay)
        await sleep(delay)

    async def ticker() -> None:
        while True:
            event.log.append("tick")
            await anyio.lowlevel.checkpoint()

    monkeypatch.setattr(events.anyio, "sleep", recorded)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        await wait_event(event, timeout_s=5)
        tg.cancel_scope.cancel()
    assert event.queries == 30  # returned at the query that said "complete", no query more
    assert sleeps and all(delay <= MAX_POLL_S for delay in sleeps)  # never longer than the cap
    assert sleeps == sorted(sleeps) and sleeps[-1] == MAX_POLL_S and sleeps[0] < MAX_POLL_S / 10
    assert all(b == min(2 * a, MAX_POLL_S) for a, b in itertools.pairwise(sleeps))  # doubling
    queries = [n for n, what in enumerate(event.log) if what == "query"]
    gaps = [event.log[a + 1 : b] for a, b in itertools.pairwise(queries)]
    assert sum(1 for gap in gaps if "tick" in gap) >= len(sleeps)  # the loop ran between sleeping queries


async def test_wait_event_times_out_with_a_clear_error() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not complete within 0\.1 s"):
        await wait_event(TimedEvent(delay_s=0), timeout_s=0.1)  # never recorded
    assert time.monotonic() - start < 5  # its 0.1 s (with room for a busy machine), not forever


async def test_layer_events_wait_for_their_layer_and_stop_when_sealed() -> None:
    events = LayerEvents.create(3, CpuEvent)
    assert events.num_layers == 3 and not events.recorded(0)
    events.record(0)
    assert await events.wait(0, timeout_s=1) is True
    with pytest.raises(RequestError, match="already recorded"):
        events.record(0)
    with pytest.raises(RequestError, match="out of range"):
        events.record(3)
    with pytest.raises(TimeoutError):
        await events.wait(1, timeout_s=0.05)
    results: list[bool] = []

    async def waiter() -> None:
        results.append(await events.wait(2, timeout_s=5))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.01)
        assert results == []
        events.record(1)
        events.seal()  # layer 2 will never be written: its waiter stops, and is told so
    assert results == [False]
    assert await events.wait(1, timeout_s=1) is True
    with pytest.raises(RequestError, match="after the pass ended"):
        events.record(2)
    done = LayerEvents.completed(4)
    assert all([await done.wait(layer, timeout_s=0.1) for layer in range(4)])


async def test_a_layer_is_not_read_before_its_event_fires() -> None:
    caches = {f"l{i}": torch.zeros(4, 2, 16, 8) for i in range(2)}
    backend = MemoryBackend()
    pool = KVPool.create(PoolConfig(layerwise=True), layout=KVLayout.from_kv_caches(caches), backend=backend)
    slow = TimedEvent(delay_s=0.1)
    events = LayerEvents.create(2, lambda: slow)
    tokens = list(range(16 * 4))
    async with pool.layerwise_store(
        [KVRequest(request_id="r", block_ids=[0, 1], tokens=tokens)], events
    ) as storer:
        events.record(0)
        await anyio.sleep(0.05)
        assert kv_keys(backend) == []  # recorded, but the device has not finished
        outcome = await storer.__anext__()
        assert outcome.layer == 0 and outcome.ok
        assert len(kv_keys(backend)) == 2
        events.seal()  # layer 1 never written
    assert storer.results()[0].failed_indices == (0, 1)
    assert await pool.lookup(KVRequest(tokens=tokens)) == 0


# -- CUDA: the same contract on a real stream -----------------------------------------------------


@cuda
@pytest.mark.cuda
async def test_cuda_event_completes_after_the_work_before_it() -> None:
    event = CudaEvent(torch.device("cuda"))
    assert isinstance(event, DeviceEvent) and not event.query()  # unlike a bare torch.cuda.Event
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    event.record()
    await wait_event(event, timeout_s=30)
    assert event.query()
    assert isinstance(make_event("cuda"), CudaEvent)


@cuda
@pytest.mark.cuda
async def test_cuda_event_gates_a_store_of_a_device_to_host_copy() -> None:
    """A layer is copied from the GPU into pinned host KV caches asynchronously; the storer must
    store the copied values, never what the host memory held before."""
    layers, blocks = 3, 8
    host = {f"l{i}": torch.zeros(blocks, 2, 16, 64).pin_memory() for i in range(layers)}
    gpu = {name: torch.randn(t.shape, device="cuda") for name, t in host.items()}
    backend = MemoryBackend()
    pool = KVPool.create(PoolConfig(layerwise=True), layout=KVLayout.from_kv_caches(host), backend=backend)
    events = LayerEvents.create(layers, lambda: CudaEvent(torch.device("cuda")))
    tokens = list(range(16 * blocks))
    async with pool.layerwise_store(
        [KVRequest(request_id="r", block_ids=range(blocks), tokens=tokens)], events
    ) as s:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            for layer, name in enumerate(host):
                torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # the copy lands late
                host[name].copy_(gpu[name], non_blocking=True)
                events.record(layer)
        async for outcome in s:
            assert outcome.ok
    dst = {name: torch.zeros_like(t) for name, t in host.items()}
    reader = KVPool.create(PoolConfig(layerwise=True), layout=KVLayout.from_kv_caches(dst), backend=backend)
    got = await reader.retrieve(KVRequest(block_ids=list(range(blocks)), tokens=tokens))
    assert got.hit_blocks == blocks
    for name in host:
        assert torch.equal(dst[name], gpu[name].cpu())


@pytest.mark.parametrize("layer", [True, 1.0])
def test_layer_events_refuse_a_layer_that_is_not_an_integer(layer: object) -> None:
    """``record(True)`` used to record layer 1 and ``record(1.0)`` to raise a bare TypeError from a
    list index: a layer is checked as KVRequest checks block ids. Nothing is recorded then."""
    events = LayerEvents.create(3, CpuEvent)
    with pytest.raises(RequestError, match="a layer must be"):
        events.record(layer)  # type: ignore[arg-type]
    assert not any(events.recorded(n) for n in range(3))
    events.record(np.int64(1))  # type: ignore[arg-type]
    assert events.recorded(1)
