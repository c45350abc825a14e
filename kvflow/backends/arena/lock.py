"""The arena's lock: ``flock`` on the store's lock file, shared (gets, lookups) or exclusive (claims).

A section under the lock never awaits: ``flock`` locks belong to the open file, so two tasks of one
process would share one lock, and a task taking it exclusively while another of the same process
held it shared would silently convert it. Sections are synchronous code between two awaits, which
no other task of the loop can enter. Waiting for the lock polls with backoff, so the loop runs on.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from types import TracebackType

import anyio
import attrs

__all__ = ["EXCLUSIVE", "SHARED", "Held", "StoreLock"]

SHARED = fcntl.LOCK_SH
EXCLUSIVE = fcntl.LOCK_EX
_BACKOFF_MIN_S = 20e-6
_BACKOFF_MAX_S = 2e-3


@attrs.define
class StoreLock:
    """``flock`` on ``fd`` (the file at ``path``), held for one synchronous section at a time."""

    fd: int
    path: str

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
        """Take the lock, polling with backoff while another holds it."""
        delay = _BACKOFF_MIN_S
        deadline = time.monotonic() + timeout_s
        while not self._try(mode):
            if time.monotonic() >= deadline:
                raise self._timeout(mode, timeout_s)
            await anyio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

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
