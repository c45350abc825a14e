"""The arena's lock: ``flock`` on the store's lock file, shared (gets, lookups) or exclusive (claims).

A section under the lock never awaits: ``flock`` locks belong to the open file, so two tasks of one
process would share one lock, and a task taking it exclusively while another of the same process
held it shared would silently convert it. Sections are synchronous code between two awaits, which
no other task of the loop can enter. Waiting for the lock polls with backoff, so the loop runs on.

``flock`` cannot tell a holder that another process waits, nor is it fair: a put waiting for the
exclusive lock gets it only between two holds of a get. So a process waiting for the exclusive lock
says so in the store (:class:`WaitMark`, a word of the arena's header page that every process maps):
it writes the time at each try that fails, and clears it, if still its own, once it holds the lock
or gives up. A get holds the shared lock across its runs while no one waits (as a call alone on the
loop holds the loop, :mod:`kvflow.backends.pacing`), and lets go every half millisecond while one
does.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from types import TracebackType

import anyio
import attrs

__all__ = ["EXCLUSIVE", "SHARED", "Held", "StoreLock", "WaitMark"]

SHARED = fcntl.LOCK_SH
EXCLUSIVE = fcntl.LOCK_EX
_BACKOFF_MIN_S = 20e-6
_BACKOFF_MAX_S = 2e-3
#: How long a waiter's mark counts: a waiter writes it again at every try, at most
#: ``_BACKOFF_MAX_S`` apart, so an older mark is one a waiter killed (or stopped) left behind.
MARK_FRESH_NS = 20_000_000


@attrs.define
class WaitMark:
    """One word shared by every process of a store (``word``, a one-item ``Q`` view of it): 0, or the
    ``CLOCK_MONOTONIC`` time (ns) of the last try of a process waiting for the exclusive lock. A
    waiter that takes the lock (or gives up) clears the mark if it is still its own: with several
    waiters, a later try's mark stays (but for a race of a few instructions, after which the
    others mark it again at their next try). An aligned 8-byte store, so readers see one time or
    another, never a torn one."""

    word: memoryview

    def waiting(self) -> bool:
        """Whether a process tried for the exclusive lock within :data:`MARK_FRESH_NS`."""
        stamp = self.word[0]
        return stamp != 0 and abs(time.monotonic_ns() - stamp) < MARK_FRESH_NS

    def mark(self) -> int:
        """Mark a try now; return the mark, for :meth:`clear`."""
        self.word[0] = stamp = time.monotonic_ns()
        return stamp

    def clear(self, stamp: int) -> None:
        """Clear the mark if it is still ``stamp`` (no later try marked it since)."""
        if self.word[0] == stamp:
            self.word[0] = 0


@attrs.define
class StoreLock:
    """``flock`` on ``fd`` (the file at ``path``), held for one synchronous section at a time;
    ``waits``, once the store is mapped, the mark its exclusive waits write."""

    fd: int
    path: str
    waits: WaitMark | None = None

    def writer_waiting(self) -> bool:
        """Whether another process waits for the exclusive lock (:class:`WaitMark`)."""
        return self.waits is not None and self.waits.waiting()

    def _try(self, mode: int) -> bool:
        try:
            fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _timeout(self, mode: int, timeout_s: float) -> TimeoutError:
        kind = "shared" if mode == SHARED else "exclusive"
        return TimeoutError(
            f"waited {timeout_s}s for the {kind} lock on {self.path}; another process holds it: look "
            "for a stopped or stuck kvflow process"
        )

    def held(self, mode: int, timeout_s: float) -> Held:
        """``async with lock.held(mode, timeout_s):`` holds the lock (``SHARED`` or ``EXCLUSIVE``)
        for a body that does not await. Raises TimeoutError after ``timeout_s`` of waiting."""
        return Held(self, mode, timeout_s)

    async def _acquire(self, mode: int, timeout_s: float) -> None:
        """Take the lock, polling with backoff while another holds it (marking an exclusive wait)."""
        if self._try(mode):
            return
        waits = self.waits if mode == EXCLUSIVE else None
        delay, stamp = _BACKOFF_MIN_S, 0
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if waits is not None:
                    stamp = waits.mark()
                if time.monotonic() >= deadline:
                    raise self._timeout(mode, timeout_s)
                await anyio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                if self._try(mode):
                    return
        finally:
            if waits is not None:
                waits.clear(stamp)

    def _release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held_blocking(self, mode: int, timeout_s: float) -> Iterator[None]:
        """:meth:`held` for synchronous code (opening the store, a shielded clean-up); sleeps."""
        deadline = time.monotonic() + timeout_s
        while not self._try(mode):
            if time.monotonic() >= deadline:
                raise self._timeout(mode, timeout_s)
            time.sleep(_BACKOFF_MAX_S)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


@attrs.frozen(eq=False)
class Held:
    """:meth:`StoreLock.held`'s context (a class, not a generator: from cold caches
    ``contextlib``'s machinery costs tens of microseconds around every section)."""

    lock: StoreLock
    mode: int
    timeout_s: float

    async def __aenter__(self) -> None:
        await self.lock._acquire(self.mode, self.timeout_s)

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock._release()
