"""A backend's calls that read or write the caller's memory, so that ``aclose`` can wait for them.

A put reads the engine's blocks and a get writes them until the call returns. A backend's
``aclose`` returns only once none of its calls still does (the caller may free that memory then,
or reuse the blocks): it marks itself closed, so that no call starts, then waits for
:meth:`InFlight.drained`. The in-process backends' calls copy a few milliseconds at most between
two checkpoints; a Mooncake call ends when Mooncake returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anyio
import attrs

__all__ = ["InFlight"]


@attrs.define
class InFlight:
    """How many calls are running; use from one event loop."""

    count: int = 0
    _ended: anyio.Event = attrs.field(factory=anyio.Event)  # set when count drops to 0

    def enter(self) -> None:
        """A call starts; pair with :meth:`leave` (or use :meth:`running`)."""
        if not self.count:
            self._ended = anyio.Event()
        self.count += 1

    def leave(self) -> None:
        """The call counted by :meth:`enter` ended."""
        self.count -= 1
        if not self.count:
            self._ended.set()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count the body as a call running."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def drained(self) -> None:
        """Return once no call runs (shielded: a cancelled close still waits)."""
        with anyio.CancelScope(shield=True):
            if self.count:
                await self._ended.wait()
