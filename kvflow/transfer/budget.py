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
    _waiting: int = 0  # tasks waiting in acquire (a release with none skips making a new event)

    @property
    def held(self) -> int:
        return self._held

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (capped at the limit) fit; return what was taken, for :meth:`release`."""
        need = min(nbytes, self.limit)
        while self._held + need > self.limit:
            changed = self._changed
            self._waiting += 1
            try:
                await changed.wait()
            finally:
                self._waiting -= 1
        self._held += need
        return need

    def release(self, held: int) -> None:
        self._held -= held
        if self._waiting:
            self._changed.set()
            self._changed = anyio.Event()
