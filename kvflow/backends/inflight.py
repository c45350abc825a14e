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
import os
from collections.abc import Callable, Iterator
from types import TracebackType

import anyio
import attrs

from kvflow.errors import BackendError, PoolClosedError

__all__ = ["InFlight", "Lifetime"]


@attrs.define
class InFlight:
    """How many calls are running; use from one event loop."""

    count: int = 0
    # made by the first :meth:`drained` that waits, set (and dropped) when count drops to 0: a call
    # makes no event (one costs tens of microseconds from cold caches, on every put and get)
    _ended: anyio.Event | None = None

    def enter(self) -> None:
        """A call starts; pair with :meth:`leave` (or use :meth:`running`)."""
        self.count += 1

    def leave(self) -> None:
        """The call counted by :meth:`enter` ended."""
        self.count -= 1
        if not self.count and self._ended is not None:
            self._ended.set()
            self._ended = None

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
        if self._ended is None:
            self._ended = anyio.Event()
        ended = self._ended  # (dropped once set: a later wait makes its own)
        with anyio.CancelScope(shield=True):
            await ended.wait()


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
    #: the process that opened the backend (None: any may call it). A call from another, a child
    #: forked with a copy of the backend, is refused: a shared store's backend writes under its
    #: opener's identity (its slots, its temporary files), which the child is not
    owner: int | None = None
    closed: bool = False
    copies: InFlight = attrs.field(factory=InFlight)  # puts and gets: close waits for them
    _users: int = 0  # every call running, copies or not
    _released: bool = False

    def check_open(self) -> None:
        """Raise :class:`PoolClosedError` once closed, and :class:`BackendError` in a child forked
        from the :attr:`owner` (:attr:`forked`)."""
        if self.closed:
            raise PoolClosedError(self.closed_error)
        if self.forked:
            raise BackendError(
                f"this backend was opened by process {self.owner} and is used by process {os.getpid()}, "
                "a child forked from it: a backend writes its store under the identity of the process "
                "that opened it; open a new backend in the child (kvflow.backends.open_backend)"
            )

    def call(self, *, copies: bool = False) -> _Call:
        """``with lifetime.call():`` counts the body as a call (``copies``: one that :meth:`close`
        waits for); refused once closed."""
        return _Call(self, copies)

    @property
    def forked(self) -> bool:
        """Whether this is a forked child's copy of an :attr:`owner`'s backend."""
        return self.owner is not None and os.getpid() != self.owner

    def _enter(self, copies: bool) -> None:
        self.check_open()
        self._users += 1
        if copies:
            self.copies.enter()

    def _leave(self, copies: bool) -> None:
        self._users -= 1
        if copies:
            self.copies.leave()
        self._release_if_idle()

    async def close(self) -> None:
        """No call starts any more; return once no copy runs (shielded: a cancelled close still
        waits). What the calls use is released now, or as the last other call returns. In a forked
        child (:attr:`forked`) it returns at once and releases nothing: the calls counted may be
        the parent's, whose tasks the child has not (forked from another thread), or may still
        run in it (forked from the loop); its copy of what they use goes when the child ends."""
        self.closed = True
        if self.forked:
            return
        await self.copies.drained()
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self.closed and not self._users and not self._released:
            self._released = True
            self.release()


class _Call:
    """:meth:`Lifetime.call`'s context (a class, not a generator: from cold caches ``contextlib``'s
    machinery costs tens of microseconds around every put and get). Made per call, not kept by the
    lifetime: a lifetime that referred to its contexts, which refer to it, would outlive a backend
    dropped unclosed until the garbage collector ran, and with it the mapping its release frees."""

    __slots__ = ("copies", "lifetime")

    def __init__(self, lifetime: Lifetime, copies: bool) -> None:
        self.lifetime, self.copies = lifetime, copies

    def __enter__(self) -> None:
        self.lifetime._enter(self.copies)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lifetime._leave(self.copies)
