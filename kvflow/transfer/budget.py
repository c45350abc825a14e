"""Backpressure: a bound on the bytes a pool has in backend calls at once."""

from __future__ import annotations

import collections

import anyio
import attrs

__all__ = ["ByteBudget"]


@attrs.define(eq=False)
class _Waiter:
    need: int
    granted: anyio.Event = attrs.field(factory=anyio.Event)


@attrs.define
class ByteBudget:
    """At most ``limit`` bytes held at once, handed out first come, first served: a request waits
    behind every request that came before it, so small ones cannot keep passing a large one (a
    request larger than the limit waits for all of it), and a release wakes only those it lets in.

    Use from one event loop.
    """

    limit: int
    _held: int = 0
    _queue: collections.deque[_Waiter] = attrs.field(factory=collections.deque)

    @property
    def held(self) -> int:
        return self._held

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (capped at the limit) fit after every earlier request; return
        what was taken, for :meth:`release`."""
        need = min(nbytes, self.limit)
        if not self._queue and self._held + need <= self.limit:
            self._held += need
            return need
        waiter = _Waiter(need)
        self._queue.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:  # cancelled: granted meanwhile (give it back) or still queued
            if waiter.granted.is_set():
                self.release(need)
            else:
                self._queue.remove(waiter)
                self._grant()  # those behind it may fit now
            raise
        return need

    def release(self, held: int) -> None:
        self._held -= held
        self._grant()

    def _grant(self) -> None:
        queue = self._queue
        while queue and self._held + queue[0].need <= self.limit:
            waiter = queue.popleft()
            self._held += waiter.need
            waiter.granted.set()
