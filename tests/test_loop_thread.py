"""The loop thread and the synchronous faces when callers give up, close, or race one another from
other threads (kvflow/loop.py, kvflow/sync.py, kvflow/sync_layerwise.py)."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence

import anyio
import attrs
import pytest

import kvflow.backends.base as backends_base
import kvflow.loop as loop_module
from kvflow import (
    ConfigError,
    GetStatus,
    KVLayout,
    KVRequest,
    MemoryBackend,
    PoolClosedError,
    PoolConfig,
    SyncLayerwisePool,
    SyncPool,
)
from kvflow.backends import ObjectRef
from kvflow.errors import BackendUnavailableError
from kvflow.loop import ANSWER_GRACE_S, CallFuture, LoopThread, wait_answer
from kvflow.profiles import is_book_key
from kvflow.sync_layerwise import StepResult
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, zeros_like_caches
from tests.test_sync import BlockingBackend

TOKENS = list(range(BLOCK * 4))


class CancelledInTheWindow(CallFuture[object]):
    """A future whose caller gives up (``cancel()``) after the loop thread found it not done and
    before it sets the answer: a race real waiters hit now and then."""

    armed = False

    def set_result(self, result: object) -> None:
        if type(self).armed:
            type(self).armed = False
            self.cancel()
        super().set_result(result)


def open_pool(backend: object | None = None, timeout_s: float = 5.0) -> SyncPool:
    return SyncPool.open(
        PoolConfig(timeout_s=timeout_s),
        layout=KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]()),
        backend=backend or MemoryBackend(),  # type: ignore[arg-type]
    )


def test_a_caller_giving_up_as_its_answer_arrives_leaves_the_pool_working(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loop_module, "CallFuture", CancelledInTheWindow)
    pool = open_pool()
    try:
        assert pool.store(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS)).stored == 4
        with caplog.at_level(logging.ERROR, logger="kvflow"):
            CancelledInTheWindow.armed = True
            future = pool.submit_lookup(KVRequest(tokens=TOKENS))
            assert future.ended.wait(5)
        assert future.cancelled()  # its caller gave up on it
        assert not [r for r in caplog.records if "crashed" in r.getMessage()]
        assert pool.lookup(KVRequest(tokens=TOKENS), timeout_s=2) == 4 * BLOCK  # the loop still runs
    finally:
        assert pool.close(timeout_s=2) is True


def test_close_says_false_when_the_loop_ended_before_the_pool_was_closed() -> None:
    closes: list[int] = []

    class Counted(MemoryBackend):
        async def aclose(self) -> None:
            closes.append(1)
            await super().aclose()

    pool = open_pool(Counted())
    assert pool._loop.stop(5)  # the loop ends under the pool, as a crash would end it
    with pytest.raises(PoolClosedError):
        pool.lookup(KVRequest(tokens=TOKENS))
    assert pool.close(timeout_s=2) is False and closes == []


def test_wait_answer_without_a_bound_waits_for_the_answer() -> None:
    loop = LoopThread().start()

    async def answer() -> int:
        await anyio.sleep(0.05)
        return 42

    try:
        assert wait_answer(loop.submit(answer)) == 42
    finally:
        loop.stop(2)


def test_a_store_the_loop_never_started_before_close_still_says_it_released_the_blocks() -> None:
    """Submitted while the loop thread is held, then the pool closed: the loop stops before it
    started the store, which still runs (cancelled) so that ``on_released`` is called."""
    backend = BlockingBackend(block_s=3.0)
    pool = open_pool(backend)
    released = threading.Event()
    stalled = pool.submit_lookup(KVRequest(tokens=TOKENS))  # holds the loop thread
    assert backend.entered.wait(10)
    queued = pool.submit_store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=released.set)
    assert pool.close(timeout_s=0.5) is False  # it abandoned the held call
    backend.release.set()
    assert stalled.ended.wait(10) and queued.ended.wait(10)
    assert released.wait(2)
    with pytest.raises(PoolClosedError):
        queued.result(1)


def test_two_threads_closing_one_pool_both_get_an_answer() -> None:
    answers: list[object] = []
    for _ in range(30):
        pool = open_pool()
        barrier = threading.Barrier(2)

        def close_it(pool: SyncPool = pool, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                answers.append(pool.close(timeout_s=2))
            except BaseException as exc:
                answers.append(exc)

        threads = [threading.Thread(target=close_it) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert answers == [True] * 60


def test_calls_racing_close_answer_or_say_the_pool_is_closed() -> None:
    odd: list[BaseException] = []
    answered = [0]
    for _ in range(10):
        pool = open_pool(timeout_s=2)
        stop = threading.Event()

        def hammer(pool: SyncPool = pool, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    pool.lookup(KVRequest(tokens=TOKENS), timeout_s=2)
                    answered[0] += 1
                except PoolClosedError:
                    return
                except BaseException as exc:
                    odd.append(exc)
                    return

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.05)
        pool.close(timeout_s=2)
        stop.set()
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive()
    assert odd == [] and answered[0] > 0


def test_a_raising_on_released_in_a_cancelled_store_leaves_no_call_counted() -> None:
    backend = FaultyBackend(hang_on={"exists"})
    pool = open_pool(backend, timeout_s=2)

    def boom() -> None:
        raise RuntimeError("the engine's callback failed")

    future = pool.submit_store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=boom)
    deadline = time.monotonic() + 5
    while "exists" not in backend.calls and time.monotonic() < deadline:
        time.sleep(0.005)
    future.cancel()
    assert future.ended.wait(5)
    start = time.monotonic()
    assert pool.close(timeout_s=1.0) is True  # nothing runs: no wait for a call counted for ever
    assert time.monotonic() - start < 0.5


@attrs.define(eq=False)
class ShieldedGets(FaultyBackend):
    """Gets of KV objects that ignore cancellation for ``hold_s``."""

    hold_s: float = 10.0

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if not any(is_book_key(o.key) for o in objects):
            self.calls.append("get")
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.hold_s)
        return await self.inner.get(objects)


def test_a_layerwise_close_keeps_one_bound_for_the_step_and_the_pool() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = ShieldedGets()
    config = PoolConfig(layerwise=True, timeout_s=30)
    with SyncLayerwisePool.open(config, layout=KVLayout.from_kv_caches(src), backend=backend) as writer:  # type: ignore[arg-type]
        writer.store(KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK]))
    pool = SyncLayerwisePool.open(
        config, layout=KVLayout.from_kv_caches(zeros_like_caches(src)), backend=backend
    )  # type: ignore[arg-type]
    pool.start_load([KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK])])
    deadline = time.monotonic() + 5
    while "get" not in backend.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    assert pool.close(timeout_s=2.0) is False  # a get still runs
    assert time.monotonic() - start < 2.0 + 2 * ANSWER_GRACE_S + 0.5  # before: 2 s, then 2 s more


def test_a_calls_own_timeout_error_reaches_its_caller_as_it_is() -> None:
    """A call that itself raises TimeoutError (a backend that gave up) is answered with it, not
    taken for a loop thread that is held up."""
    loop = LoopThread().start()

    async def gives_up() -> None:
        raise TimeoutError("the store did not answer in 2 s")

    try:
        with pytest.raises(TimeoutError, match="the store did not answer"):
            wait_answer(loop.submit(gives_up, answer_by=time.monotonic() + 5))
    finally:
        loop.stop(2)


def test_a_forked_child_is_refused_at_once_by_its_parents_pool() -> None:
    pool = open_pool()
    try:
        child = os.fork()
        if child == 0:  # the child: the loop thread stayed in the parent
            code = 3
            try:
                start = time.monotonic()
                pool.lookup(KVRequest(tokens=TOKENS), timeout_s=2)
            except PoolClosedError as exc:
                code = 0 if "forked" in str(exc) and time.monotonic() - start < 1 else 2
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.lookup(KVRequest(tokens=TOKENS)) == 0  # the parent's pool still works
    finally:
        assert pool.close(timeout_s=2) is True


@attrs.define(eq=False)
class CloseRaises(FaultyBackend):
    """A backend whose close fails (a peer gone while closing)."""

    async def aclose(self) -> None:
        raise ConnectionError("peer went away while closing")


def layerwise_pool(backend: object, timeout_s: float = 5.0, **kwargs: object) -> SyncLayerwisePool:
    return SyncLayerwisePool.open(
        PoolConfig(layerwise=True, timeout_s=timeout_s),
        layout=KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]()),
        backend=backend,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def reader_of_two_stored_blocks(backend: FaultyBackend, timeout_s: float) -> SyncLayerwisePool:
    """A layerwise pool over empty caches, after a writer stored blocks 0-1 of TOKENS in ``backend``."""
    with layerwise_pool(backend) as writer:
        assert writer.store(KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK])).stored == 2
    return SyncLayerwisePool.open(
        PoolConfig(layerwise=True, timeout_s=timeout_s),
        layout=KVLayout.from_kv_caches(zeros_like_caches(LAYOUTS["vllm_cpu"]())),
        backend=backend,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("face", ["SyncPool", "SyncLayerwisePool"])
def test_a_backend_close_that_raises_still_stops_the_loop_thread(face: str) -> None:
    pool = open_pool(CloseRaises()) if face == "SyncPool" else layerwise_pool(CloseRaises())
    thread = pool._loop._thread
    assert thread is not None and thread.is_alive()
    with pytest.raises(ConnectionError, match="peer went away"):  # the caller hears of it
        pool.close(timeout_s=2)
    assert not thread.is_alive() and not pool._loop.running  # and no loop thread is left behind


def test_a_refused_layerwise_pool_raises_its_own_error_and_stops_the_loop_thread() -> None:
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match="depth must be an integer > 0"):  # not the close's error
        layerwise_pool(CloseRaises(), depth=0)
    assert set(threading.enumerate()) - before == set()


def test_a_layerwise_close_from_another_thread_mid_step_says_no_layer_is_in_place() -> None:
    """The pool is closed (say, at shutdown) while the engine thread is in the middle of a step:
    the layer waits that follow say False and the step reports every block it loads failed, for
    the engine to recompute (before: they said True for layers never loaded, and the step
    reported nothing failed)."""
    backend = FaultyBackend(hang_on={"get"}, put_checks_present=True)
    kv = reader_of_two_stored_blocks(backend, timeout_s=5.0)
    kv.start_load([KVRequest(request_id="r", block_ids=[2, 3], tokens=TOKENS[: 2 * BLOCK])])
    closer = threading.Thread(target=kv.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert [kv.wait_for_layer_load(layer) for layer in range(kv.num_layers)] == [False] * kv.num_layers
    with pytest.raises(PoolClosedError):  # no new transfer starts in the closed step
        kv.start_store([KVRequest(request_id="r", block_ids=[2, 3], tokens=TOKENS[: 2 * BLOCK])])
    result = kv.wait_for_save()
    assert result.failed_block_ids == {2, 3}
    assert kv.wait_for_save() == StepResult({}, {})  # the step has ended
    with pytest.raises(PoolClosedError):
        kv.start_load([KVRequest(request_id="r", block_ids=[2, 3], tokens=TOKENS[: 2 * BLOCK])])


def test_a_step_begun_while_close_runs_ends_as_a_cancelled_one() -> None:
    """close() from another thread while no step is current, its pool's close still waiting for a
    call in flight; the engine thread then begins a step. Its transfers find the pool closed: the
    step ends as a cancelled one (layer waits False, loads reported failed), and wait_for_save
    does not raise (before: it raised PoolClosedError, and the engine got no StepResult)."""
    backend = FaultyBackend(put_checks_present=True)
    kv = reader_of_two_stored_blocks(backend, timeout_s=2.0)
    backend.hang_on = {"put"}
    kv.submit_store(KVRequest(block_ids=[5], tokens=TOKENS[2 * BLOCK : 3 * BLOCK]))  # hangs to its deadline
    time.sleep(0.1)
    closer = threading.Thread(target=kv.close, kwargs={"timeout_s": 4.0})
    closer.start()
    time.sleep(0.2)  # the pool's close waits for the store in flight
    kv.start_load([KVRequest(request_id="r", block_ids=[2, 3], tokens=TOKENS[: 2 * BLOCK])])
    kv.start_store([KVRequest(request_id="r", block_ids=[4], tokens=TOKENS[: 3 * BLOCK], block_offset=2)])
    assert kv.wait_for_layer_load(0) is False
    result = kv.wait_for_save()
    assert result.failed_block_ids == {2, 3}
    assert result.stored["r"].stored == 0
    closer.join(10)
    assert not closer.is_alive()


def test_a_close_racing_start_load_cancels_the_load_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() from another thread lands after start_load passed its "closed?" check and before
    its load reached the step's list: the load started after close cancelled the list (before: it
    was never cancelled, and close waited its whole bound for a get that hangs)."""
    backend = FaultyBackend(hang_on={"get"}, put_checks_present=True)
    kv = reader_of_two_stored_blocks(backend, timeout_s=4.0)
    submit, took = LoopThread.submit, []

    def close() -> None:
        started = time.monotonic()
        kv.close()
        took.append(time.monotonic() - started)

    closer = threading.Thread(target=close)

    def submit_as_close_runs(loop: LoopThread, *args: object, **kwargs: object) -> CallFuture[object]:
        if loop is not kv._loop or closer.ident is not None:
            return submit(loop, *args, **kwargs)  # type: ignore[arg-type]
        closer.start()
        until = time.monotonic() + 5
        while not kv._step.closed and time.monotonic() < until:  # type: ignore[union-attr]
            time.sleep(0.001)
        time.sleep(0.05)  # close has cancelled the step's (empty) list and waits for its drivers
        return submit(loop, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LoopThread, "submit", submit_as_close_runs)
    kv.start_load([KVRequest(request_id="r", block_ids=[2, 3], tokens=TOKENS[: 2 * BLOCK])])
    closer.join(10)
    assert not closer.is_alive() and took[0] < 2.0, took  # not the 4 s bound
    assert kv.wait_for_layer_load(0) is False
    assert kv.wait_for_save().failed_block_ids == {2, 3}


@pytest.mark.parametrize(
    ("face", "call"),
    [
        ("SyncPool", "close"),
        ("SyncPool", "store"),
        ("SyncPool", "lookup"),
        ("SyncLayerwisePool", "close"),
        ("SyncLayerwisePool", "wait_for_save"),
    ],
)
def test_a_blocking_call_on_the_loop_thread_is_refused_at_once(face: str, call: str) -> None:
    """``on_released`` runs on the loop thread: a blocking call made there would wait on the loop
    it blocks (before: the loop froze for the call's timeout, then a misleading TimeoutError, or
    a close that failed to join its own thread and left the pool half closed)."""
    pool = open_pool(timeout_s=1.0) if face == "SyncPool" else layerwise_pool(MemoryBackend(), timeout_s=1.0)
    calls = {
        "close": lambda: pool.close(timeout_s=1.0),
        "store": lambda: pool.store(KVRequest(block_ids=[1], tokens=TOKENS[BLOCK : 2 * BLOCK])),
        "lookup": lambda: pool.lookup(KVRequest(tokens=TOKENS)),
        "wait_for_save": lambda: pool.wait_for_save(),  # type: ignore[attr-defined]
    }
    seen: list[BaseException] = []

    def on_released() -> None:
        try:
            calls[call]()
        except BaseException as exc:
            seen.append(exc)

    try:
        future = pool.submit_store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=on_released)
        assert future.result(5).stored == 1
        assert len(seen) == 1 and isinstance(seen[0], RuntimeError)  # at once: no TimeoutError
        assert "from another thread" in str(seen[0])
        assert pool.lookup(KVRequest(tokens=TOKENS)) == BLOCK  # the pool still works
    finally:
        assert pool.close(timeout_s=2) is True


def test_two_pools_whose_callbacks_wait_on_each_other_are_refused_at_once_not_deadlocked() -> None:
    """Pool A's ``on_released`` runs on A's loop thread; a blocking call there on pool B would hold
    A's loop until B answers, and B's callback waiting on A then waits on a loop that waits on it
    (before: both loops froze until the timeouts ran out). Every blocking call on any kvflow loop
    thread is refused at once; the submit_* forms still work there."""
    a, b = open_pool(timeout_s=3.0), open_pool(timeout_s=3.0)
    seen: list[tuple[str, BaseException | int]] = []

    def on_released(other: SyncPool, name: str) -> None:
        for what, call in (
            ("lookup", lambda: other.lookup(KVRequest(tokens=TOKENS))),
            ("store", lambda: other.store(KVRequest(block_ids=[5], tokens=TOKENS[: 2 * BLOCK]))),
            ("close", lambda: other.close(timeout_s=1.0)),
            ("wait", lambda: wait_answer(CallFuture(time.monotonic() + 1.0))),  # an answer not yet in
        ):
            try:
                seen.append((f"{name}:{what}", call()))
            except BaseException as exc:
                seen.append((f"{name}:{what}", exc))
        other.submit_lookup(KVRequest(tokens=TOKENS))  # submitting never waits: allowed

    try:
        started = time.monotonic()
        futures = [
            a.submit_store(
                KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=lambda: on_released(b, "a")
            ),
            b.submit_store(
                KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=lambda: on_released(a, "b")
            ),
        ]
        assert [future.result(10).stored for future in futures] == [1, 1]
        assert time.monotonic() - started < 2.0  # refused at once, not after a timeout
        assert sorted(name for name, _ in seen) == sorted(
            f"{pool}:{what}" for pool in "ab" for what in ("lookup", "store", "close", "wait")
        )
        assert all(isinstance(answer, RuntimeError) for _, answer in seen), seen
        assert all("hold that loop" in str(answer) for _, answer in seen)
        assert a.lookup(KVRequest(tokens=TOKENS)) == BLOCK and b.lookup(KVRequest(tokens=TOKENS)) == BLOCK
    finally:
        assert a.close(timeout_s=2) is True
        assert b.close(timeout_s=2) is True


def test_a_loop_thread_refuses_to_wait_on_itself() -> None:
    loop = LoopThread().start()

    async def answer() -> int:
        return 42

    async def waits_on_its_own_loop() -> list[str]:
        refused = []
        for wait in (
            lambda: loop.call(answer, timeout_s=0.5),
            lambda: wait_answer(loop.submit(answer, answer_by=time.monotonic() + 0.5)),
            lambda: loop.stop(0.5),
        ):
            try:
                wait()
            except RuntimeError as exc:
                refused.append(str(exc))
        return refused

    try:
        refused = loop.call(waits_on_its_own_loop, timeout_s=10)
        assert len(refused) == 3 and all("from another thread" in message for message in refused)
        assert loop.running and loop.call(answer, timeout_s=2) == 42
    finally:
        assert loop.stop(2)


def test_a_store_that_reaches_the_inbox_after_the_loops_last_look_says_it_released_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store submitted as close() runs: it passed the "stopping?" check before close began,
    and reaches the inbox only after the loop took its last look there (the loop still open, in
    its teardown). It is refused with PoolClosedError and its on_released is called (before: it
    was queued, never run, and its on_released never called)."""
    passed, drained, submitted = threading.Event(), threading.Event(), threading.Event()
    main = LoopThread._main

    async def main_then_tear_down(self: LoopThread) -> None:
        await main(self)
        drained.set()  # the loop's last look at its inbox is over; the loop is still open
        submitted.wait(5)  # its teardown takes until the store was submitted

    class PausedAfterTheCheck(CallFuture[object]):
        def __init__(self, answer_by: float) -> None:
            if threading.current_thread().name == "submitter":
                passed.set()
                drained.wait(5)
            super().__init__(answer_by)

    monkeypatch.setattr(LoopThread, "_main", main_then_tear_down)
    monkeypatch.setattr(loop_module, "CallFuture", PausedAfterTheCheck)
    pool = open_pool()
    released = threading.Event()
    refused: list[BaseException] = []

    def submit() -> None:
        try:
            pool.submit_store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=released.set)
        except BaseException as exc:
            refused.append(exc)
        finally:
            submitted.set()

    submitter = threading.Thread(target=submit, name="submitter")
    submitter.start()
    assert passed.wait(5)
    pool.close(timeout_s=5)
    submitter.join(10)
    assert not submitter.is_alive()
    assert released.wait(2)
    assert len(refused) == 1 and isinstance(refused[0], PoolClosedError)


def test_an_answer_that_arrives_as_its_waiter_gives_up_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    class AnsweredInTheWindow(CallFuture[object]):
        """The loop answers after the waiter's timed wait ran out, before it cancels."""

        def cancel(self) -> bool:
            if not self.done():
                self.set_result("the answer")
            return super().cancel()

    async def slow() -> str:
        await anyio.sleep(10)
        return "late"

    loop = LoopThread().start()
    monkeypatch.setattr(loop_module, "CallFuture", AnsweredInTheWindow)
    try:
        assert wait_answer(loop.submit(slow, answer_by=time.monotonic() + 0.05)) == "the answer"
    finally:
        assert loop.stop(2)


def test_a_child_forked_mid_step_is_refused_at_once_by_the_step() -> None:
    """Forked while a layerwise step is current (its storer waits for layer events): in the child
    wait_for_save raises PoolClosedError and close returns False, both at once (before: the
    parent's transfers were waited for, 2x the timeout, then a misleading "stuck")."""
    kv = layerwise_pool(MemoryBackend(), timeout_s=2.0)
    try:
        kv.start_store([KVRequest(request_id="r", block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK])])
        child = os.fork()
        if child == 0:  # the child: the loop thread stayed in the parent
            code = 3
            try:
                start = time.monotonic()
                try:
                    kv.wait_for_save()
                    code = 1
                except PoolClosedError as exc:
                    code = 0 if "forked" in str(exc) else 2
                if code == 0 and (kv.close() is not False or time.monotonic() - start > 1):
                    code = 4
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for layer in range(kv.num_layers):  # the parent's step goes on
            kv.save_layer(layer)
        assert kv.wait_for_save().stored["r"].stored == 2
    finally:
        assert kv.close(timeout_s=2) is True


@attrs.define(eq=False)
class DroppedRemove(FaultyBackend):
    """A hand-written asyncio client: its remove awaits a reply future it cancels itself when the
    connection drops."""

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        reply = asyncio.get_running_loop().create_future()
        reply.cancel()
        return await reply  # type: ignore[no-any-return]


@pytest.mark.parametrize("told_apart", [True, False], ids=["by the task", "by the loop (Python 3.10)"])
def test_a_cancellation_a_backend_raises_itself_is_an_error_of_the_call_not_the_loops_end(
    told_apart: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CancelledError of a remove reached the loop's task group as a cancellation nobody
    asked for, and ended the loop thread: every later call was refused. It is the call's error now
    (BackendUnavailableError, as remove raises when the store cannot be reached): told apart by
    the task's pending cancellations where Python 3.11 has them, else by the loop, which knows
    every cancel scope of its own."""
    if not told_apart:
        monkeypatch.setattr(backends_base, "stray_cancellation", lambda: False)
    pool = open_pool(DroppedRemove())
    said = "the backend cancelled its own call" if told_apart else "the call was cancelled from inside it"
    with pytest.raises(BackendUnavailableError, match=f"^{said}"):
        pool.remove(KVRequest(tokens=TOKENS[:BLOCK]))
    assert pool._loop.running and pool.lookup(KVRequest(tokens=TOKENS[:BLOCK])) == 0
    assert pool.close(timeout_s=5) is True


def test_a_call_goes_to_a_task_that_waits_idle_unless_a_call_changed_its_context() -> None:
    """Calls one after another run on one task of the group, which waits idle between them (a
    call handed over costs no new task); a call that set a context variable leaves its task, so
    the next call does not see it."""
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")
    thread = LoopThread(name="test-idle").start()

    async def task_and_marker(set_to: str | None) -> tuple[asyncio.Task[object] | None, str]:
        seen = marker.get()
        if set_to is not None:
            marker.set(set_to)
        return asyncio.current_task(), seen

    try:
        first, seen_first = thread.call(task_and_marker, None, timeout_s=5)
        second, seen_second = thread.call(task_and_marker, "changed", timeout_s=5)
        third, seen_third = thread.call(task_and_marker, None, timeout_s=5)
    finally:
        assert thread.stop()
    assert first is second  # the task that ran the first call ran the second
    assert third is not second and (seen_first, seen_second, seen_third) == ("unset", "unset", "unset")


@pytest.mark.parametrize("call", ["handed before", "none", "arriving after"])
def test_a_stray_cancellation_of_an_idle_task_ends_that_task_not_the_loop(call: str) -> None:
    """A cancellation of a task waiting idle (one a finished call left behind) ends that task
    only: a call handed to it in the same turn is still answered, one that arrives after the
    cancellation in that turn goes to another task, and the loop goes on."""
    thread = LoopThread(name="test-idle-cancel").start()

    async def answer() -> str:
        return "answered"

    async def its_task() -> asyncio.Task[object] | None:
        return asyncio.current_task()

    try:
        idle = thread.call(its_task, timeout_s=5)  # the task that ran it now waits idle
        loop = thread._loop
        assert idle is not None and loop is not None
        handed_calls: list[CallFuture[str]] = []
        done = threading.Event()

        def cancel_in_one_turn() -> None:  # on the loop
            if call == "handed before":
                handed_calls.append(thread.submit(answer, answer_by=time.monotonic() + 3))
                thread._notify()  # the idle task is handed the call...
            idle.cancel()  # ...and cancelled before it runs again
            if call == "arriving after":  # its waiter cancelled: the call goes to a new task
                handed_calls.append(thread.submit(answer, answer_by=time.monotonic() + 3))
                thread._notify()
            done.set()

        loop.call_soon_threadsafe(cancel_in_one_turn)
        assert done.wait(5)
        if call != "none":
            started = time.monotonic()
            assert wait_answer(handed_calls[0]) == "answered"
            assert time.monotonic() - started < 2.5
        assert thread.call(answer, timeout_s=5) == "answered"  # the loop goes on
        assert thread.running
    finally:
        assert thread.stop()


def test_a_call_that_cancelled_itself_leaves_its_task_and_an_idle_task_keeps_no_call_alive() -> None:
    """After a call that cancelled its own task (a client's stray cancellation, an error of that
    call), the next call runs on a fresh task with no cancellation pending; and a task waiting
    idle holds no reference to the call it ran (its arguments, its result)."""
    thread = LoopThread(name="test-idle-residue").start()

    class Result:
        pass

    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    async def cancelling() -> int:
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling() if sys.version_info >= (3, 11) else 0

    async def result(argument: Result) -> Result:
        return Result()

    try:
        with pytest.raises(BackendUnavailableError):
            thread.call(cancels_itself, timeout_s=5)
        assert thread.call(cancelling, timeout_s=5) == 0
        argument = Result()
        returned = thread.call(result, argument, timeout_s=5)
        refs = weakref.ref(argument), weakref.ref(returned)
        del argument, returned
        gc.collect()
        assert refs[0]() is None and refs[1]() is None
    finally:
        assert thread.stop()
