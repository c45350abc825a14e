"""A backend's calls that read or write the caller's memory, so that ``aclose`` can wait for them.

A put reads the engine's blocks and a get writes them until the call returns. A backend's
``aclose`` returns only once none of its calls still does (the caller may free that memory then,
or reuse the blocks): it marks itself closed, so that no call starts, then waits for
:meth:`InFlight.drained`. The in-process backends' calls copy a few milliseconds at most between
two checkpoints; a Mooncake call ends when Mooncake returns. :class:`Lifetime` keeps this for the
embedded backends, with the release of what their calls use once the last has ended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import anyio
import attrs

from kvflow.errors import PoolClosedError

__all__ = ["InFlight", "Lifetime"]


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
        """Return once no call runs (shielded: a cancelled close still waits). With none running
        it returns at once, without a checkpoint (a backend never used closes without a task)."""
        if not self.count:
            return
        with anyio.CancelScope(shield=True):
            await self._ended.wait()


@attrs.define
class Lifetime:
    """A backend's open or closed state, the calls running on it, and the release of what they
    use (a mapping, descriptors) once it is closed and the last of them has ended.

    Every call runs inside :meth:`call`; a put or get with ``copies=True``, which :meth:`close`
    waits for. A call that is not a copy (a remove still waiting for a lock, say) may outlive the
    close: what it uses is released only when it returns, so it never acts on a mapping or a
    descriptor number that was given to something else meanwhile.
    """

    closed_error: str  # what a call after the close raises, as :class:`PoolClosedError`
    release: Callable[[], None] = lambda: None  # run once, after the close, when no call runs
    closed: bool = False
    copies: InFlight = attrs.field(factory=InFlight)  # puts and gets: close waits for them
    _users: int = 0  # every call running, copies or not
    _released: bool = False

    def check_open(self) -> None:
        """Raise :class:`PoolClosedError` once closed."""
        if self.closed:
            raise PoolClosedError(self.closed_error)

    @contextlib.contextmanager
    def call(self, *, copies: bool = False) -> Iterator[None]:
        """Count the body as a call (``copies``: one that :meth:`close` waits for); refused once closed."""
        self.check_open()
        self._users += 1
        if copies:
            self.copies.enter()
        try:
            yield
        finally:
            self._users -= 1
            if copies:
                self.copies.leave()
            self._release_if_idle()

    async def close(self) -> None:
        """No call starts any more; return once no copy runs (shielded: a cancelled close still
        waits). What the calls use is released now, or as the last other call returns."""
        self.closed = True
        await self.copies.drained()
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self.closed and not self._users and not self._released:
            self._released = True
            self.release()
