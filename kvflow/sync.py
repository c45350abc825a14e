"""SyncPool: the synchronous face of a :class:`~kvflow.KVPool`, for engines that cannot await.

The pool lives on kvflow's loop thread (:class:`~kvflow.loop.LoopThread`). Every method may be
called from any thread but the loop thread; there (in an ``on_released``, a future's done-callback)
only ``submit_*`` work, and a blocking call raises RuntimeError at once rather than wait on the loop
it blocks. ``submit_*`` return a :class:`~kvflow.loop.CallFuture` at once; the blocking forms wait
by the one rule of :mod:`kvflow.loop`: a call's ``timeout_s`` (default: the pool's) counts from the
call, the pool answers within it, and a caller gives up with TimeoutError only when the loop did not
deliver that answer in time.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import attrs

from kvflow.backends import Backend
from kvflow.config import PoolConfig
from kvflow.device import Device
from kvflow.errors import PoolClosedError
from kvflow.events import DeviceEvent, check_after
from kvflow.layout import KVFormat, KVLayout
from kvflow.loop import ANSWER_GRACE_S, CallFuture, LoopThread, wait_answer
from kvflow.ownership import ParallelConfig
from kvflow.pool import KVPool, check_create_arguments, check_timeout
from kvflow.profiles import Profile
from kvflow.request import KVRequest
from kvflow.results import RetrieveResult, StoreResult

if TYPE_CHECKING:
    from typing import Self

__all__ = ["SyncPool", "start_pool", "stop_pool"]

T = TypeVar("T")

_OPEN = object()  # SyncPool's constructor is private: make it with SyncPool.open


@attrs.define(eq=False)
class SyncPool:
    """A :class:`KVPool` for synchronous callers, on kvflow's loop thread. Make it with :meth:`open`."""

    _loop: LoopThread = attrs.field(alias="_loop")
    _pool: KVPool = attrs.field(alias="_pool")
    _token: object = attrs.field(alias="_token", repr=False)

    def __attrs_post_init__(self) -> None:
        if self._token is not _OPEN:
            raise TypeError("make a synchronous pool with SyncPool.open(...)")

    @classmethod
    def open(
        cls,
        config: PoolConfig | None = None,
        *,
        layout: KVLayout | None = None,
        format: KVFormat | None = None,
        parallel: ParallelConfig | None = None,
        backend: Backend | None = None,
        device: Device | None = None,
    ) -> SyncPool:
        """Start the loop thread and create the pool on it (arguments as :meth:`KVPool.create`)."""
        loop, pool = start_pool(
            config, layout=layout, format=format, parallel=parallel, backend=backend, device=device
        )
        return cls(_loop=loop, _pool=pool, _token=_OPEN)

    @classmethod
    def _on_loop(cls, loop: LoopThread, pool: KVPool, **fields: object) -> Self:
        """Wrap a pool already running on ``loop`` (for subclasses' named constructors)."""
        return cls(_loop=loop, _pool=pool, _token=_OPEN, **fields)

    # -- what it is ------------------------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        return self._pool.config

    @property
    def format(self) -> KVFormat:
        return self._pool.format

    @property
    def layout(self) -> KVLayout | None:
        return self._pool.layout

    @property
    def parallel(self) -> ParallelConfig:
        return self._pool.parallel

    @property
    def device(self) -> Device | None:
        """The caches' device shim when blocks move through host staging, else None."""
        return self._pool.device

    # -- calls -----------------------------------------------------------------------------------

    def submit_lookup(self, request: KVRequest, *, timeout_s: float | None = None) -> CallFuture[int]:
        """Start :meth:`KVPool.lookup`; the future's answer is due by ``future.answer_by``."""
        return self._submit(lambda t: self._pool.lookup(request, timeout_s=t), timeout_s)

    def submit_store(
        self,
        request: KVRequest,
        *,
        after: DeviceEvent | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> CallFuture[StoreResult]:
        """Start :meth:`KVPool.store`, reading no block before ``after`` (an event recorded on the
        engine's stream after the forward) completed. ``on_released`` is called from the loop
        thread (so it must be thread-safe, e.g. ``threading.Event.set``) once the blocks are no
        longer read (also for a store that never started; from the calling thread, before the
        error is raised, for one refused here: a bad ``after`` or timeout, a closed pool); the
        future resolves when the store ended (a cancelled one is done at once: ``future.ended``
        says when its call ended)."""
        return self._submit_store(
            lambda t, released: self._pool.store(request, after=after, on_released=released, timeout_s=t),
            after,
            on_released,
            timeout_s,
        )

    def submit_retrieve(
        self, request: KVRequest, *, after: DeviceEvent | None = None, timeout_s: float | None = None
    ) -> CallFuture[RetrieveResult]:
        """Start :meth:`KVPool.retrieve`, writing no block before ``after`` (an event recorded on
        the engine's stream now, after the work that may still write the blocks) completed. Do
        not reuse the request's blocks before the future is done, or, once you cancelled it,
        before ``future.ended`` is set: a get may write them until the call has ended."""
        check_after(after)
        return self._submit(lambda t: self._pool.retrieve(request, after=after, timeout_s=t), timeout_s)

    def submit_store_many(
        self,
        requests: Sequence[KVRequest],
        *,
        after: DeviceEvent | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> CallFuture[list[StoreResult]]:
        """Start :meth:`KVPool.store_many` (an engine step's stores in one call), as
        :meth:`submit_store`; the future's answer is one result per request, in order."""
        return self._submit_store(
            lambda t, released: self._pool.store_many(
                requests, after=after, on_released=released, timeout_s=t
            ),
            after,
            on_released,
            timeout_s,
        )

    def submit_retrieve_many(
        self,
        requests: Sequence[KVRequest],
        *,
        after: DeviceEvent | None = None,
        timeout_s: float | None = None,
    ) -> CallFuture[list[RetrieveResult]]:
        """Start :meth:`KVPool.retrieve_many` (an engine step's loads in one call), as
        :meth:`submit_retrieve`; the future's answer is one result per request, in order."""
        check_after(after)
        return self._submit(lambda t: self._pool.retrieve_many(requests, after=after, timeout_s=t), timeout_s)

    def lookup(self, request: KVRequest, *, timeout_s: float | None = None) -> int:
        """Blocking lookup; TimeoutError when no answer came by its timeout (plus the grace).
        RuntimeError at once on the loop thread, as every blocking call's here."""
        self._loop.check_off_loop("SyncPool.lookup")
        return wait_answer(self.submit_lookup(request, timeout_s=timeout_s))

    def store(
        self, request: KVRequest, *, after: DeviceEvent | None = None, timeout_s: float | None = None
    ) -> StoreResult:
        """Blocking store; TimeoutError when no answer came by its timeout (plus the grace), one
        that says "stuck" when the store did not end once cancelled either (do not reuse the
        blocks then: :func:`kvflow.loop.wait_answer`)."""
        self._loop.check_off_loop("SyncPool.store")
        return wait_answer(self.submit_store(request, after=after, timeout_s=timeout_s), holds_blocks=True)

    def retrieve(
        self, request: KVRequest, *, after: DeviceEvent | None = None, timeout_s: float | None = None
    ) -> RetrieveResult:
        """Blocking retrieve; TimeoutError as :meth:`store`'s."""
        self._loop.check_off_loop("SyncPool.retrieve")
        return wait_answer(self.submit_retrieve(request, after=after, timeout_s=timeout_s), holds_blocks=True)

    def remove(self, request: KVRequest, *, timeout_s: float | None = None) -> int:
        """Blocking :meth:`KVPool.remove`: delete this rank's objects of the prompt's blocks."""
        self._loop.check_off_loop("SyncPool.remove")
        return wait_answer(self._submit(lambda t: self._pool.remove(request, timeout_s=t), timeout_s))

    def profiles(self, *, timeout_s: float | None = None) -> tuple[Profile, ...]:
        """Blocking :meth:`KVPool.profiles`: the other engines' splits of this model in the store."""
        self._loop.check_off_loop("SyncPool.profiles")
        return wait_answer(self._submit(lambda t: self._pool.profiles(timeout_s=t), timeout_s))

    # -- the end ---------------------------------------------------------------------------------

    def __enter__(self) -> SyncPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self, timeout_s: float | None = None) -> bool:
        """Close the pool (waiting for calls in flight) and stop the loop thread, all within
        ``timeout_s`` (default: the pool's timeout), plus :data:`~kvflow.loop.ANSWER_GRACE_S` when a
        call blocks the loop thread. Returns False when something had to be
        abandoned (a call still running, which may still read or write the KV cache; a backend
        that would not close; a loop thread held by a blocking call). An error of the backend's
        close is raised, once the loop thread has stopped. RuntimeError at once on the loop thread
        (nothing is closed then)."""
        return stop_pool(self._loop, self._pool, timeout_s)

    # -- the wait rule ---------------------------------------------------------------------------

    def _submit_store(
        self,
        call: Callable[[float, Callable[[], None] | None], Awaitable[T]],
        after: DeviceEvent | None,
        on_released: Callable[[], None] | None,
        timeout_s: float | None,
    ) -> CallFuture[T]:
        """:meth:`_submit` a store, ``call(timeout, released)``: ``on_released`` is called once,
        by the store on the loop, by the loop when it could not start it before its caller stopped
        waiting, or here, before the error is raised, when it is refused at submission."""
        released = _once(on_released)
        try:
            check_after(after)
            return self._submit(lambda t: call(t, released), timeout_s, on_unstarted=released)
        except BaseException:
            if released is not None:
                released()
            raise

    def _submit(
        self,
        call: Callable[[float], Awaitable[T]],
        timeout_s: float | None,
        on_unstarted: Callable[[], None] | None = None,
    ) -> CallFuture[T]:
        """Run ``call`` on the loop with what is left of ``timeout_s`` then (:func:`_by_deadline`);
        ``on_unstarted`` is called (on the loop) when the caller stopped waiting before the loop
        could start it."""
        check_timeout(timeout_s)
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        return self._loop.submit(
            _by_deadline, call, deadline, on_unstarted, answer_by=deadline + ANSWER_GRACE_S
        )


def start_pool(
    config: PoolConfig | None = None,
    *,
    layout: KVLayout | None = None,
    format: KVFormat | None = None,
    parallel: ParallelConfig | None = None,
    backend: Backend | None = None,
    device: Device | None = None,
) -> tuple[LoopThread, KVPool]:
    """Start a loop thread and create a :class:`KVPool` on it (arguments as :meth:`KVPool.create`)."""
    check_create_arguments(config, layout, format, parallel, backend)
    config = config or PoolConfig()
    loop = LoopThread().start()

    async def make() -> KVPool:
        return KVPool.create(
            config, layout=layout, format=format, parallel=parallel, backend=backend, device=device
        )

    try:
        pool = loop.call(make, timeout_s=config.timeout_s)
    except BaseException:
        loop.stop()
        raise
    return loop, pool


def stop_pool(loop: LoopThread, pool: KVPool, timeout_s: float | None) -> bool:
    """Close ``pool`` on ``loop`` and stop the loop, within ``timeout_s`` (default: the pool's).
    False when something had to be abandoned. The loop stops even when the pool's close raises
    (a backend's error), which then reaches the caller."""
    check_timeout(timeout_s)
    loop.check_off_loop("closing a SyncPool")
    limit = pool.config.timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit
    try:
        closed = _close(loop, pool, limit, deadline)
    finally:  # also when the close raised (a backend's error): no loop thread is left behind
        stopped = loop.stop(max(0.0, deadline - time.monotonic()) + ANSWER_GRACE_S)
    return closed and stopped


def _close(loop: LoopThread, pool: KVPool, limit: float, deadline: float) -> bool:
    """Close ``pool`` on ``loop`` by ``deadline``: whether it closed cleanly (by this close or another)."""
    try:
        closed = wait_answer(loop.submit(pool.aclose, limit, answer_by=deadline)) if loop.running else False
    except (TimeoutError, PoolClosedError, concurrent.futures.CancelledError):  # (another thread stopped it)
        closed = False
    # another thread's close, or a loop that ended under the pool: as that close left it
    return closed or pool.closed_cleanly


def _once(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """``fn`` made safe to call from two threads: only the first call runs it."""
    if fn is None:
        return None
    left = [fn]

    def once() -> None:
        try:
            first = left.pop()  # atomic: one caller gets it
        except IndexError:
            return
        first()

    return once


#: What a call is given when its timeout passed before the loop thread could start it: it runs at
#: once and answers with what it did by then (its backend calls cut at their first pause).
NO_TIME_LEFT_S = 1e-6


async def _by_deadline(
    call: Callable[[float], Awaitable[T]], deadline: float, on_unstarted: Callable[[], None] | None
) -> T:
    """Run ``call`` with what is left of its deadline, counted from when the caller made the call.
    A call whose timeout passed before the loop thread started it still answers (failed blocks, no
    hit), as the wait rule promises, while its caller waits for that answer (``ANSWER_GRACE_S``
    past the deadline); later than that it raises TimeoutError (``on_unstarted`` called first)."""
    now = time.monotonic()
    if now >= deadline + ANSWER_GRACE_S:
        if on_unstarted is not None:
            on_unstarted()
        raise TimeoutError(
            "the call's timeout and its grace passed before kvflow's loop thread could start it"
        )
    return await call(max(deadline - now, NO_TIME_LEFT_S))
