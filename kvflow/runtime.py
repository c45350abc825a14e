"""The loop thread and the synchronous facade for engines.

A synchronous engine cannot await. :class:`LoopThread` runs one event loop in one dedicated worker
thread (an anyio blocking portal); :class:`SyncPool` owns a :class:`~kvflow.pool.KVPool` living on
that loop. Engine threads call ``submit_*`` and get a ``concurrent.futures.Future`` back, or call the
blocking forms, which take a timeout. This is the only thread kvflow starts.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar

import attrs
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvflow.backends import Backend
from kvflow.config import PoolConfig
from kvflow.errors import PoolClosedError
from kvflow.layout import KVLayout
from kvflow.ownership import ParallelConfig
from kvflow.pool import KVPool
from kvflow.results import RetrieveResult, StoreResult

__all__ = ["LoopThread", "SyncPool"]

T = TypeVar("T")


@attrs.define(eq=False)
class LoopThread:
    """One event loop in one worker thread. Create and close it from the engine's thread."""

    name: str = "kvflow-loop"
    _cm: AbstractContextManager[BlockingPortal] | None = attrs.field(default=None, init=False)
    _portal: BlockingPortal | None = attrs.field(default=None, init=False)

    def start(self) -> LoopThread:
        if self._portal is None:
            self._cm = start_blocking_portal(backend="asyncio", name=self.name)
            self._portal = self._cm.__enter__()
        return self

    @property
    def portal(self) -> BlockingPortal:
        if self._portal is None:
            raise PoolClosedError("the kvflow loop thread is not running; call start() first")
        return self._portal

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the loop; the future resolves with its result or exception."""
        return self.portal.start_task_soon(fn, *args)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout_s: float | None = None) -> T:
        """Run ``fn(*args)`` on the loop and wait for it (cancelling it after ``timeout_s``)."""
        future = self.submit(fn, *args)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"kvflow call did not finish within {timeout_s} s") from None

    def stop(self) -> None:
        """Cancel the tasks still on the loop, stop it and join its thread.

        Owners close their work first (``SyncPool.close`` waits, bounded, for calls in flight);
        whatever is left was given up on and must not keep the engine from shutting down.
        """
        cm, portal = self._cm, self._portal
        self._cm = self._portal = None
        if cm is None or portal is None:
            return
        try:
            portal.call(portal.stop, True)
        finally:
            cm.__exit__(None, None, None)


@attrs.define(eq=False)
class SyncPool:
    """A :class:`KVPool` for synchronous callers. Every method may be called from any thread but the
    loop thread itself; futures resolve on the loop thread."""

    loop: LoopThread
    pool: KVPool

    @classmethod
    def open(
        cls,
        config: PoolConfig | None = None,
        *,
        layout: KVLayout | None = None,
        parallel: ParallelConfig | None = None,
        backend: Backend | None = None,
        fingerprint: str | None = None,
        block_size: int | None = None,
    ) -> SyncPool:
        """Start the loop thread and create the pool on it."""
        loop = LoopThread().start()

        async def make() -> KVPool:
            return KVPool.create(
                config,
                layout=layout,
                parallel=parallel,
                backend=backend,
                fingerprint=fingerprint,
                block_size=block_size,
            )

        try:
            pool = loop.call(make)
        except BaseException:
            loop.stop()
            raise
        return cls(loop, pool)

    def __enter__(self) -> SyncPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def submit_store(
        self,
        block_ids: Sequence[int],
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
    ) -> concurrent.futures.Future[StoreResult]:
        call = functools.partial(
            self.pool.store,
            block_ids=block_ids,
            tokens=tokens,
            block_hashes=block_hashes,
            block_offset=block_offset,
        )
        return self.loop.submit(call)

    def submit_retrieve(
        self,
        block_ids: Sequence[int],
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
    ) -> concurrent.futures.Future[RetrieveResult]:
        call = functools.partial(
            self.pool.retrieve,
            block_ids=block_ids,
            tokens=tokens,
            block_hashes=block_hashes,
            block_offset=block_offset,
        )
        return self.loop.submit(call)

    def submit_lookup(
        self, *, tokens: Sequence[int] | None = None, block_hashes: Sequence[bytes] | None = None
    ) -> concurrent.futures.Future[int]:
        return self.loop.submit(functools.partial(self.pool.lookup, tokens=tokens, block_hashes=block_hashes))

    def store(
        self,
        block_ids: Sequence[int],
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
        timeout_s: float | None = None,
    ) -> StoreResult:
        """Blocking store; raises TimeoutError after ``timeout_s`` (default: the pool's timeout)."""
        future = self.submit_store(
            block_ids, tokens=tokens, block_hashes=block_hashes, block_offset=block_offset
        )
        return self._wait(future, timeout_s)

    def retrieve(
        self,
        block_ids: Sequence[int],
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
        timeout_s: float | None = None,
    ) -> RetrieveResult:
        """Blocking retrieve; raises TimeoutError after ``timeout_s``."""
        future = self.submit_retrieve(
            block_ids, tokens=tokens, block_hashes=block_hashes, block_offset=block_offset
        )
        return self._wait(future, timeout_s)

    def lookup(
        self,
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Blocking lookup; raises TimeoutError after ``timeout_s``."""
        return self._wait(self.submit_lookup(tokens=tokens, block_hashes=block_hashes), timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Close the pool (waiting for calls in flight) and stop the loop thread."""
        try:
            self.loop.call(self.pool.aclose, timeout_s)
        finally:
            self.loop.stop()

    def _wait(self, future: concurrent.futures.Future[T], timeout_s: float | None) -> T:
        # a store is an exists() and then puts, each bounded by the pool's timeout
        limit = timeout_s if timeout_s is not None else 2 * self.pool.config.timeout_s + 1.0
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"kvflow call did not finish within {limit} s") from None
