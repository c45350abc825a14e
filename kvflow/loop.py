"""The one thread kvflow starts: an event loop for synchronous engines, and the rule for waiting on it.

A synchronous engine cannot await. :class:`LoopThread` runs one asyncio event loop (through anyio)
in one dedicated daemon thread, with a task group that owns every task submitted to it. Engine
threads :meth:`~LoopThread.submit` a coroutine function and get a :class:`CallFuture` back at once:
submission never waits for the loop, so a loop held up by a slow call cannot hold up the engine.
A call runs on a task of the group that ran an earlier call and waits idle for the next (a few
do), or on a new one where none waits: handing it over then costs no turn of the loop for the
group's host and no new task.

The wait rule (one for every synchronous face): a call given ``timeout_s`` has a *deadline*,
``timeout_s`` after the call was made (not after the loop picked it up). The pool bounds its own
work by that deadline and answers with results (failed blocks, no hit) by then; a caller that waits
gives the loop :data:`ANSWER_GRACE_S` more to deliver that answer, then gives up with TimeoutError
and cancels the call. :attr:`CallFuture.answer_by` is that moment. A wait made on the loop thread
itself (from an ``on_released`` or a future's done-callback, which run there) could only end by its
timeout, the loop frozen meanwhile: it raises RuntimeError at once instead.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import attrs

from kvflow.errors import BackendUnavailableError, PoolClosedError

__all__ = ["ANSWER_GRACE_S", "CallFuture", "LoopThread", "wait_answer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long after a call's deadline a waiting caller still expects the loop to deliver its answer.
ANSWER_GRACE_S = 1.0
#: How many tasks of the loop thread wait idle for the next call at most.
_IDLE = 4
#: How long :meth:`LoopThread.start` waits for the new thread's loop to run.
_START_TIMEOUT_S = 30.0
_FORKED = "this pool's loop thread runs in the process this one was forked from; open a new pool here"
_STOPPED = "the kvflow loop thread has stopped; open a new pool"
_CANCELLED_INSIDE = (
    "the call was cancelled from inside it (a backend's client cancelling its own call: a dropped "
    "connection?); check the store's connection"
)


class CallFuture(concurrent.futures.Future[T]):
    """A ``concurrent.futures.Future`` of a call on the loop thread. ``answer_by``: the
    ``time.monotonic()`` second by which the call's answer is due (its deadline plus the grace);
    ``cancel()`` cancels the call on the loop, even while it runs."""

    def __init__(self, answer_by: float) -> None:
        super().__init__()
        self.answer_by = answer_by
        #: set once the call itself has ended on the loop (or will never run). A cancelled future
        #: is done at once, while its call may still run to its end (a copy on the device, a
        #: backend call that does not return when cancelled) and touch its blocks until then.
        self.ended = threading.Event()
        #: the thread whose loop answers it (set by :meth:`LoopThread.submit`): waits there are refused
        self.loop_thread: threading.Thread | None = None


def wait_answer(future: CallFuture[T], *, holds_blocks: bool = False) -> T:
    """Block until the call answers; after ``future.answer_by`` cancel it and raise TimeoutError.

    ``holds_blocks``: the call reads or writes the caller's KV blocks (a store, a retrieve). Then a
    cancelled call is given :data:`ANSWER_GRACE_S` more to really end, and a TimeoutError that
    says "stuck" means it did not: its blocks may still be read or written, so they must not be
    reused (restart the pool). RuntimeError at once (and the call cancelled) on a kvflow loop thread:
    on the one that answers the call the wait would block the answer, on another it would hold that
    loop's own calls meanwhile (and two loops waiting on each other would never answer)."""
    if not future.done() and (future.loop_thread is threading.current_thread() or _on_a_loop_thread()):
        future.cancel()
        raise RuntimeError(_on_loop_message("waiting for a kvflow call", own=future.loop_thread))
    no_bound = future.answer_by == float("inf")  # submitted without one: wait for the answer
    try:
        return future.result(None if no_bound else max(0.0, future.answer_by - time.monotonic()))
    except concurrent.futures.TimeoutError:
        if not future.cancel():  # answered after all (the call's own TimeoutError, or an answer just now)
            return future.result()
        if holds_blocks and not future.ended.wait(ANSWER_GRACE_S):
            raise TimeoutError(
                "a kvflow transfer is stuck: it did not end within its timeout, nor once cancelled (a "
                "copy on the device or a backend call that does not return), so do not reuse its "
                "blocks, which it may still read or write: restart the pool"
            ) from None
        raise TimeoutError(
            "kvflow did not answer within its timeout: its loop thread is held up (a backend call "
            "that blocks?); the call was cancelled"
        ) from None


@attrs.define(eq=False)
class LoopThread:
    """One event loop in one daemon thread. Start, submit to and stop it from any other thread."""

    name: str = "kvflow-loop"
    _thread: threading.Thread | None = attrs.field(default=None, init=False)
    _loop: asyncio.AbstractEventLoop | None = attrs.field(default=None, init=False)
    _wake: anyio.Event | None = attrs.field(default=None, init=False)
    # tasks of the group that ran a call and wait for the next (each its own future), oldest first
    _idle: collections.deque[asyncio.Future[Any]] = attrs.field(factory=collections.deque, init=False)
    _inbox: collections.deque[tuple[Any, tuple[Any, ...], CallFuture[Any]]] = attrs.field(
        factory=collections.deque, init=False
    )
    _stop_requested: bool = attrs.field(default=False, init=False)
    _ready: threading.Event = attrs.field(factory=threading.Event, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    # Futures not yet resolved: the loop's end cancels them, so no caller waits on a dead loop.
    _pending: set[CallFuture[Any]] = attrs.field(factory=set, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    # Set under _lock before the loop's last look at the inbox: nothing appended after it would run.
    _inbox_closed: bool = attrs.field(default=False, init=False)
    _forked: bool = attrs.field(default=False, init=False)  # this is a child forked after start

    def start(self) -> LoopThread:
        """Start the thread and wait (bounded) until its loop runs."""
        if self._thread is not None:
            return self
        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread = thread
        _STARTED.add(self)
        thread.start()
        if not self._ready.wait(_START_TIMEOUT_S) or self._loop is None:
            raise RuntimeError(f"the kvflow loop thread did not start within {_START_TIMEOUT_S} s")
        return self

    @property
    def running(self) -> bool:
        return self._loop is not None and not self._stopping

    @property
    def forked(self) -> bool:
        """This is a child process forked after :meth:`start`: the loop runs in the parent."""
        return self._forked

    def check_off_loop(self, what: str) -> None:
        """RuntimeError when called on a kvflow loop thread: on this one ``what`` would wait on the
        loop it blocks, on another it would hold that loop (see :func:`wait_answer`)."""
        if threading.current_thread() is self._thread or _on_a_loop_thread():
            raise RuntimeError(_on_loop_message(what, own=self._thread))

    def check_can_wait(self, what: str) -> None:
        """:meth:`check_off_loop`, and PoolClosedError in a forked child (whose wait nothing would end)."""
        self.check_off_loop(what)
        if self._forked:
            raise PoolClosedError(_FORKED)

    def submit(
        self, fn: Callable[..., Awaitable[T]], *args: Any, answer_by: float | None = None
    ) -> CallFuture[T]:
        """Run ``fn(*args)`` on the loop; never waits for the loop. The future resolves with its
        result or exception; cancelling the future cancels the call (one cancelled before it
        started still starts, cancelled, so its own cleanup runs). ``answer_by`` (default: never)
        is recorded on the future for :func:`wait_answer`. PoolClosedError when the call would
        never run (a stopped or forked loop)."""
        loop = self._loop
        if self._forked:
            raise PoolClosedError(_FORKED)
        if loop is None or self._stopping:
            raise PoolClosedError("the kvflow loop thread is not running; open a new pool")
        future: CallFuture[T] = CallFuture(float("inf") if answer_by is None else answer_by)
        future.loop_thread = self._thread
        with self._lock:  # one step with the loop's last look at the inbox: run, or refused here
            if self._inbox_closed:
                raise PoolClosedError(_STOPPED)
            self._pending.add(future)
            self._inbox.append((fn, args, future))
        future.add_done_callback(self._forget)
        try:
            loop.call_soon_threadsafe(self._notify)
        except RuntimeError:  # the loop closed meanwhile, after its last look ran the call, cancelled
            future.cancel()
            future.ended.set()
            raise PoolClosedError(_STOPPED) from None
        return future

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout_s: float) -> T:
        """Run ``fn(*args)`` on the loop and wait for it; TimeoutError (and the call cancelled)
        after ``timeout_s``. RuntimeError at once on the loop thread."""
        self.check_off_loop("LoopThread.call")
        return wait_answer(self.submit(fn, *args, answer_by=time.monotonic() + timeout_s))

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Cancel the tasks still on the loop, stop it and wait (at most ``timeout_s``) for the thread.

        Owners close their work first; whatever is left was given up on. Returns False when the
        thread did not end in time (a call blocking the loop); it is then abandoned, and ends with
        the process (a daemon thread). RuntimeError at once on the loop thread (it cannot wait
        for itself to end).
        """
        self.check_off_loop("stopping the kvflow loop thread")
        thread, loop = self._thread, self._loop
        if thread is None:
            return True
        if self._stopping:  # another thread stops it: wait as long for the same end
            thread.join(timeout_s)
            return not thread.is_alive()
        self._stopping = True
        if loop is not None:
            _call_soon(loop, self._request_stop)
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning(
                "the kvflow loop thread did not stop within %.1f s (a call is blocking it); abandoning it",
                timeout_s,
            )
            return False
        return True

    def forget_in_forked_child(self) -> None:
        """In a child forked after :meth:`start` (run by an at-fork hook): the thread and its loop
        stayed in the parent, so every call is refused at once rather than waited for."""
        self._forked, self._stopping, self._thread = True, True, None

    # -- the loop thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        _LOOP_THREADS.here = True
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException:  # pragma: no cover - a crash of the loop itself
            log.exception("the kvflow loop thread crashed")
        finally:
            self._loop = None
            self._ready.set()
            with self._lock:
                self._inbox_closed = True
                orphans, self._pending = self._pending, set()
            for future in orphans:  # submitted, but the loop ended before they ran
                _answer(future, error=PoolClosedError(_STOPPED))
                future.ended.set()

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    async def _main(self) -> None:
        """Start every submitted call in the task group, until asked to stop."""
        self._wake = anyio.Event()
        async with anyio.create_task_group() as tg:
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            while not self._stop_requested:
                await self._wake.wait()
                self._wake = anyio.Event()
                while self._inbox and not self._stop_requested:
                    tg.start_soon(self._serve, self._inbox.popleft())
            tg.cancel_scope.cancel()
            with self._lock:  # from now on submit refuses calls, rather than leave them unrun
                self._inbox_closed = True
                left, self._inbox = self._inbox, collections.deque()
            for call in left:  # submitted before the stop: started cancelled, so their cleanup runs
                tg.start_soon(self._call, *call)

    def _notify(self) -> None:
        """On the loop (a plain callback): new calls are in the inbox, or a stop was asked for.
        Each call goes to a task that waits idle for one, the rest to new tasks (the main task
        starts them, and ends the group on a stop)."""
        idle = self._idle
        while self._inbox and idle and not self._stop_requested:
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(self._inbox.popleft())
        if (self._inbox or self._stop_requested) and self._wake is not None:
            self._wake.set()

    async def _serve(self, call: tuple[Any, tuple[Any, ...], CallFuture[Any]]) -> None:
        """Run ``call``, then wait idle for the next, as long as at most :data:`_IDLE` tasks wait
        and the call left the task as it found it: its context variables unchanged, no
        cancellation of the task pending (a call that cancelled itself). Handing a call to a
        waiting task saves a turn of the loop and the start of a task: a round trip from an
        engine's thread took 1.04-1.34x ``run_coroutine_threadsafe``'s from cold caches, against
        1.27-1.59x with a task started for each call (``benchmarks/cold_costs.py``, six runs in turns).

        A cancellation of the task that arrives while it waits idle (left behind by an earlier
        call: a client cancelling its own task late) ends this task only, not the loop; a call it
        was handed in the same turn runs all the same. One that arrives during a later call fails
        that call, as its own would (:meth:`_run_call`)."""
        loop, context, task = asyncio.get_running_loop(), contextvars.copy_context(), asyncio.current_task()
        while True:
            await self._call(*call)
            del call  # (not kept alive while idle: its arguments, its future and result)
            if (
                len(self._idle) >= _IDLE
                or self._stop_requested
                or contextvars.copy_context() != context
                or (sys.version_info >= (3, 11) and task is not None and task.cancelling())
            ):
                return
            waiter: asyncio.Future[Any] = loop.create_future()
            self._idle.append(waiter)
            try:
                call = await waiter
                continue
            except anyio.get_cancelled_exc_class() as exc:
                cancelled = exc
            finally:
                if waiter in self._idle:
                    self._idle.remove(waiter)
            # Cancelled while idle. A call handed in the same turn runs all the same, outside the
            # except block, so that its own errors are not chained to this cancellation.
            if waiter.done() and not waiter.cancelled():
                await self._call(*waiter.result())
            if self._stop_requested:
                raise cancelled
            return  # a stray cancellation: this task ends, the loop's group goes on

    def _request_stop(self) -> None:
        self._stop_requested = True
        self._notify()

    async def _call(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], future: CallFuture[T]
    ) -> None:
        try:
            await self._run_call(fn, args, future)
        finally:
            future.ended.set()

    async def _run_call(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], future: CallFuture[T]
    ) -> None:
        loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:
            if future.cancelled():  # run it anyway, cancelled: its own cleanup must run
                scope.cancel()

            def cancel_if_cancelled(f: concurrent.futures.Future[T]) -> None:
                if f.cancelled():
                    _call_soon(loop, scope.cancel)

            future.add_done_callback(cancel_if_cancelled)
            try:
                result = await fn(*args)
            except anyio.get_cancelled_exc_class():
                # Every cancel scope around the call is the loop's (its own, the task group's): when
                # none of them was cancelled, the call cancelled itself (a backend's client, its own
                # future), which works on every Python (kvflow.backends.base.stray_cancellation
                # cannot tell before 3.11). It is the call's error, not the loop's end.
                if anyio.current_effective_deadline() != -math.inf:
                    _answer(future, error=BackendUnavailableError(_CANCELLED_INSIDE))
                    return
                if self._stop_requested:  # the loop stops under it: the pool was closed
                    _answer(future, error=PoolClosedError(_STOPPED))
                future.cancel()
                raise
            except BaseException as exc:
                _answer(future, error=exc)
                if not isinstance(exc, Exception):
                    raise
                return
            _answer(future, result=result)
        if not future.done():  # the scope was cancelled from the future's side
            future.cancel()


def _after_fork_in_child() -> None:
    """A forked child has no copy of the loop threads: its calls would wait for ever."""
    for loop_thread in list(_STARTED):
        loop_thread.forget_in_forked_child()


_STARTED: weakref.WeakSet[LoopThread] = weakref.WeakSet()
os.register_at_fork(after_in_child=_after_fork_in_child)


_LOOP_THREADS = threading.local()  # ``here`` is set on every kvflow loop thread


def _on_a_loop_thread() -> bool:
    return getattr(_LOOP_THREADS, "here", False) is True


def _on_loop_message(what: str, *, own: threading.Thread | None) -> str:
    if threading.current_thread() is own:
        why = "it would wait on the loop it blocks"
    else:
        why = "it would hold that loop's calls until this one answers (two waiting on each other never would)"
    return (
        f"{what} was called on a kvflow loop thread (from an on_released or a future's done-callback, "
        f"which run there): {why}. Call it from another thread, or use a submit_* method (or the async "
        "KVPool) there"
    )


def _answer(future: CallFuture[T], *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it is done: its caller may cancel it at any moment, from another
    thread, even between a check and the answer (an answer to a cancelled future is dropped)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Schedule ``fn`` on ``loop`` from any thread; nothing when the loop has already closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn)
