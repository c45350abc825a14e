from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Sequence

import anyio
import attrs
import pytest
import torch

from kvflow import (
    ConfigError,
    GetStatus,
    KVLayout,
    KVRequest,
    MemoryBackend,
    PoolClosedError,
    PoolConfig,
    RetrieveResult,
    SyncPool,
)
from kvflow.backends import ObjectRef
from kvflow.loop import ANSWER_GRACE_S, wait_answer
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, block_bytes, kv_keys, zeros_like_caches
from tests.test_chaos import ChaosBackend
from tests.test_staging import StuckDevice

TOKENS = list(range(BLOCK * 6))


def test_sync_facade_round_trip_starts_exactly_one_thread() -> None:
    src = LAYOUTS["vllm_cpu"]()
    dst = zeros_like_caches(src)
    backend = MemoryBackend()
    before = set(threading.enumerate())
    writer = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    started = set(threading.enumerate()) - before
    assert len(started) == 1
    future = writer.submit_store(KVRequest(block_ids=list(range(6)), tokens=TOKENS))
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(5).stored == 6
    assert writer.lookup(KVRequest(tokens=TOKENS), timeout_s=5) == 6 * BLOCK
    assert set(threading.enumerate()) - before == started
    reader = SyncPool.open(layout=KVLayout.from_kv_caches(dst), backend=backend)  # type: ignore[arg-type]
    result = reader.retrieve(KVRequest(block_ids=list(range(6)), tokens=TOKENS), timeout_s=5)
    assert result.hit_blocks == 6
    assert all(block_bytes(dst["l0"], i) == block_bytes(src["l0"], i) for i in range(6))
    assert len(set(threading.enumerate()) - before) == 2  # one loop thread per SyncPool, nothing else
    reader.close()
    writer.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(PoolClosedError):
        writer.lookup(KVRequest(tokens=TOKENS))


def test_a_hanging_backend_gives_failed_results_by_the_timeout() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend(hang_on={"get"})
    with SyncPool.open(
        PoolConfig(timeout_s=60), layout=KVLayout.from_kv_caches(src), backend=backend
    ) as pool:  # type: ignore[arg-type]
        start = time.monotonic()
        result = pool.retrieve(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), timeout_s=0.3)
        assert result.failed_block_ids == (0,)
        assert time.monotonic() - start < 10  # the call's 0.3 s, not the pool's 60 s
        # the loop is still healthy after a call that timed out inside
        assert pool.store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), timeout_s=5).stored == 1


@attrs.define
class BlockingBackend(FaultyBackend):
    """A backend whose exists() blocks the loop thread itself (a synchronous call that stalls) until
    ``release`` is set (at most ``block_s``); ``entered`` is set once it blocks."""

    block_s: float = 30.0
    close_hangs: bool = False
    entered: threading.Event = attrs.field(factory=threading.Event)
    release: threading.Event = attrs.field(factory=threading.Event)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self.entered.set()
        self.release.wait(self.block_s)  # holds the event loop: nothing else on it runs meanwhile
        return await self.inner.exists(keys)

    async def aclose(self) -> None:
        if self.close_hangs:
            await anyio.sleep_forever()
        await self.inner.aclose()


def test_a_timeout_counts_from_the_call_even_when_the_loop_thread_is_held() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = BlockingBackend()
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    try:
        stalled = pool.submit_lookup(KVRequest(tokens=TOKENS))  # holds the loop thread until released
        assert backend.entered.wait(10)
        queued = pool.submit_lookup(KVRequest(tokens=TOKENS), timeout_s=1.0)
        assert not stalled.done()  # submitting returned while the loop was held: it never waits for it
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="loop thread is held up"):
            pool.lookup(KVRequest(tokens=TOKENS), timeout_s=1.0)
        # within its 1 s (and the grace), not when the loop is free again (after 30 s)
        assert time.monotonic() - start < 1.0 + ANSWER_GRACE_S + 5
        assert not stalled.done()
        backend.release.set()
        assert stalled.result(10) == 0
        with pytest.raises(TimeoutError, match="grace passed before kvflow's loop thread could start it"):
            queued.result(10)  # its time and its grace were up before the loop could run it
    finally:
        pool.close(timeout_s=10)


@pytest.mark.parametrize("held_s", [0.3, 0.3 + ANSWER_GRACE_S], ids=["within the grace", "past it"])
def test_a_store_the_loop_could_not_start_in_time_still_says_it_released_the_blocks(held_s: float) -> None:
    """``on_released`` is called once also for a store the loop thread could not start within its
    timeout (the loop held): an engine waiting for it to reuse its blocks is not left waiting.
    Within the grace the store still answers, with no time left; past it, TimeoutError."""
    src = LAYOUTS["vllm_cpu"]()
    backend = BlockingBackend()
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    released = threading.Event()
    try:
        stalled = pool.submit_lookup(KVRequest(tokens=TOKENS))
        assert backend.entered.wait(10)
        queued = pool.submit_store_many(
            [KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])], on_released=released.set, timeout_s=0.2
        )
        time.sleep(held_s)
        backend.release.set()
        assert stalled.result(10) == 0
        if held_s > ANSWER_GRACE_S:
            with pytest.raises(TimeoutError, match="grace passed before kvflow's loop thread could start it"):
                queued.result(10)
        else:
            (result,) = queued.result(10)  # what it did with no time left: its answer says so
            assert pool.lookup(KVRequest(tokens=TOKENS[:BLOCK])) == result.stored * BLOCK
        assert released.is_set()
    finally:
        pool.close(timeout_s=10)


def test_blocking_calls_the_loop_starts_after_their_timeout_answer_instead_of_raising() -> None:
    """The wait rule: a blocking call answers within its timeout (failed blocks, no hit), and
    raises TimeoutError only when no answer came within the grace after it. A lookup and a
    retrieve queued behind a held loop thread past their timeout, but not their grace, answer."""
    src = LAYOUTS["vllm_cpu"]()
    backend = BlockingBackend()
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    request = KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK])
    try:
        stalled = pool.submit_lookup(KVRequest(tokens=TOKENS))
        assert backend.entered.wait(10)
        got: dict[str, object] = {}

        def call(name: str, fn: Callable[[], object]) -> None:
            try:
                got[name] = fn()
            except TimeoutError as exc:
                got[name] = exc

        waiters = [
            threading.Thread(target=call, args=("lookup", lambda: pool.lookup(request, timeout_s=0.05))),
            threading.Thread(target=call, args=("retrieve", lambda: pool.retrieve(request, timeout_s=0.05))),
        ]
        for waiter in waiters:
            waiter.start()
        time.sleep(0.3)  # past both timeouts, within their grace
        backend.release.set()
        for waiter in waiters:
            waiter.join(10)
        assert stalled.result(10) == 0
        assert got["lookup"] == 0  # nothing stored: no hit, answered, not raised
        retrieved = got["retrieve"]
        assert isinstance(retrieved, RetrieveResult) and retrieved.failed_block_ids == (0, 1)
    finally:
        pool.close(timeout_s=10)


def test_close_returns_within_its_bound_when_the_backend_never_closes() -> None:
    src = LAYOUTS["vllm_cpu"]()
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=BlockingBackend(close_hangs=True))  # type: ignore[arg-type]
    start = time.monotonic()
    assert pool.close(timeout_s=1.0) is False  # reports that it abandoned the backend
    assert time.monotonic() - start < 1.0 + ANSWER_GRACE_S + 5  # its bound, not the backend's never


def test_close_returns_within_its_bound_when_a_call_blocks_the_loop_thread() -> None:
    src = LAYOUTS["vllm_cpu"]()
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=BlockingBackend(block_s=5.0))  # type: ignore[arg-type]
    pool.submit_lookup(KVRequest(tokens=TOKENS))
    time.sleep(0.1)
    start = time.monotonic()
    assert pool.close(timeout_s=1.0) is False
    assert time.monotonic() - start < 1.0 + 2 * ANSWER_GRACE_S + 0.5


def test_stop_cancels_a_call_that_was_given_up_on() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend(hang_on={"put"})
    pool = SyncPool.open(PoolConfig(timeout_s=600), layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    stuck = pool.submit_store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]))
    with pytest.raises(concurrent.futures.TimeoutError):
        stuck.result(0.2)
    start = time.monotonic()
    # the pool gives up waiting, and says so: the put may still be reading the blocks then
    # (stopping the loop cancels it)
    assert pool.close(timeout_s=0.2) is False
    assert time.monotonic() - start < 5
    assert stuck.done()


def test_a_store_given_up_on_never_publishes_what_the_engine_writes_after_it_gave_up() -> None:
    """A staged store (0.2 s timeout) whose copy out of the cache the device finishes at 2 s: the
    caller gets TimeoutError once the store ended, its deadline past, and the engine writes another
    request's KV into the block; the copy read the block before that, and no put starts after
    the deadline, so the store publishes nothing under the prompt's key."""
    caches = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    config = PoolConfig(staging="always", staging_bytes=4096, timeout_s=0.2)
    request = KVRequest(block_ids=[3], tokens=TOKENS[:BLOCK])
    kept = ChaosBackend(backend, random.Random(0), faults=False)  # passes calls through, never closes it
    sync = SyncPool.open(
        config,
        layout=KVLayout.from_kv_caches(caches),
        backend=kept,  # type: ignore[arg-type]
        device=StuckDevice(torch.device("cpu"), delay_s=2.0),
    )
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="held up"):  # it ended within the grace: not stuck
            sync.store(request)
        for name in caches:  # the engine reuses block 3 for another request
            caches[name][3].fill_(7.0)  # type: ignore[index]
        time.sleep(max(0.0, started + 2.5 - time.monotonic()))  # the device is done by now
    finally:
        sync.close(timeout_s=5)
    check = zeros_like_caches(caches)
    reader = SyncPool.open(layout=KVLayout.from_kv_caches(check), backend=backend)  # type: ignore[arg-type]
    try:
        assert kv_keys(backend) == []  # no KV object at all
        assert reader.retrieve(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])).failed_block_ids == (0,)
    finally:
        reader.close()


def test_a_blocking_transfer_that_does_not_end_once_cancelled_says_it_is_stuck() -> None:
    """A get that ignores cancellation for 3 s: the blocking retrieve gives up at its timeout plus
    the grace, cancels, waits the grace again for the call to end, and then says the call is
    stuck (its blocks may still be written) instead of letting the caller reuse them unawares."""

    @attrs.define
    class StuckGets(FaultyBackend):
        async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(3.0)
            return await super().get(objects)

    src = LAYOUTS["vllm_cpu"]()
    backend = StuckGets()
    sync = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    try:
        assert sync.store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])).stored == 1
        future = sync.submit_retrieve(KVRequest(block_ids=[1], tokens=TOKENS[:BLOCK]), timeout_s=0.1)
        with pytest.raises(TimeoutError, match="stuck"):
            wait_answer(future, holds_blocks=True)
        assert future.cancelled() and not future.ended.is_set()  # done for the caller, still running
        assert future.ended.wait(10)  # it ends once the get returns
    finally:
        sync.close(timeout_s=10)


@pytest.mark.parametrize("call", ["submit_store", "submit_store_many"])
def test_a_store_refused_at_submission_still_says_it_released_the_blocks(call: str) -> None:
    """``on_released`` is promised also for a store that never started, as the async face does for
    one it refuses: a store refused at submission (a bad timeout, an ``after`` that is not an
    event, a closed pool) calls it once, on the calling thread, before the error is raised. An
    engine waiting for it to reuse its blocks is not left waiting."""
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]()), backend=MemoryBackend())  # type: ignore[arg-type]
    request = KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])
    released: list[str] = []

    def submit(**kwargs: object) -> object:
        if call == "submit_store":
            return pool.submit_store(request, on_released=lambda: released.append("x"), **kwargs)  # type: ignore[arg-type]
        return pool.submit_store_many([request], on_released=lambda: released.append("x"), **kwargs)  # type: ignore[arg-type]

    try:
        with pytest.raises(ConfigError, match="timeout_s must be a finite number"):
            submit(timeout_s=-1.0)
        assert released == ["x"]
        with pytest.raises(TypeError, match="after= must be a kvflow DeviceEvent"):
            submit(after=threading.Event())
        assert released == ["x", "x"]
    finally:
        assert pool.close()
    with pytest.raises(PoolClosedError):
        submit()
    assert released == ["x", "x", "x"]


def test_every_submit_refuses_an_after_that_is_not_an_event_at_once() -> None:
    """A non-event ``after`` is refused on the calling thread with a TypeError that says what to
    pass, never sent to the loop (where a retrieve took it for an event that never completed)."""
    src = LAYOUTS["vllm_cpu"]()
    pool = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=MemoryBackend())  # type: ignore[arg-type]
    request = KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])
    wrong = threading.Event()
    try:
        for submit in (
            lambda: pool.submit_retrieve(request, after=wrong),  # type: ignore[arg-type]
            lambda: pool.submit_retrieve_many([request], after=wrong),  # type: ignore[arg-type]
            lambda: pool.retrieve(request, after=wrong),  # type: ignore[arg-type]
            lambda: pool.store(request, after=wrong),  # type: ignore[arg-type]
        ):
            with pytest.raises(
                TypeError, match=r"after= must be a kvflow DeviceEvent .* got threading.Event"
            ):
                submit()
        assert pool.lookup(KVRequest(tokens=TOKENS[:BLOCK])) == 0  # nothing stored
    finally:
        assert pool.close()
