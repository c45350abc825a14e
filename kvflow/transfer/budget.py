"""Backpressure: a bound on the bytes a pool has in backend calls at once."""

from __future__ import annotations

import anyio
import attrs

__all__ = ["ByteBudget"]


@attrs.define
class ByteBudget:
    """At most ``limit`` bytes held at once; a request larger than the limit waits for all of it.

    Use from one event loop. Waiters are woken whenever bytes are released and re-check.
    """

    limit: int
    _held: int = 0
    _changed: anyio.Event = attrs.field(factory=anyio.Event)

    @property
    def held(self) -> int:
        return self._held

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (capped at the limit) fit; return what was taken, for :meth:`release`."""
        need = min(nbytes, self.limit)
        while self._held + need > self.limit:
            changed = self._changed
            await changed.wait()
        self._held += need
        return need

    def release(self, held: int) -> None:
        self._held -= held
        if self._changed.statistics().tasks_waiting:  # a new event only when one was waited on
            self._changed.set()
            self._changed = anyio.Event()
