"""Blocking Mooncake calls in worker threads, never more than ``n`` at once, abandoned ones included.

A call runs in a worker thread once it holds one of ``n`` tokens (a ``CapacityLimiter`` owned by
the backend), and inside the thread holds one of ``n`` *slots* (a ``threading.Semaphore``) until
the native call returns. A call with a timeout is abandoned when the timeout fires: its token goes
back at once, but its slot stays taken until Mooncake returns. So abandoned calls can never pile
up: once every slot is held, new calls raise :class:`SlotsBusy` at once instead of queueing behind
calls that may never return. A call with a timeout that finds every token taken by calls still
running (puts and gets, which are never abandoned) waits for one up to its timeout and then raises
:class:`ClientBusy`: the client is busy, not stuck.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

import anyio
import anyio.to_thread
import attrs

__all__ = ["Alone", "ClientBusy", "NativeCalls", "SlotsBusy"]

T = TypeVar("T")


class SlotsBusy(Exception):
    """Every slot is held by a Mooncake call that has not returned (some overran their timeout)."""


class ClientBusy(Exception):
    """Every token was held, up to the call's timeout, by calls still running (not abandoned)."""


class Alone(enum.Enum):
    """How :meth:`NativeCalls.run_alone` ended."""

    DONE = "done"  # the call ran and returned
    BUSY = "busy"  # other calls still ran at the deadline: the call did not run
    OVERRAN = "overran"  # the call ran and had not returned by the deadline


@attrs.define
class NativeCalls:
    """Runs blocking calls for one backend. Use from the backend's event loop."""

    n: int
    _limiter: anyio.CapacityLimiter = attrs.field(init=False)
    _threads: anyio.CapacityLimiter = attrs.field(init=False)  # (never waited for: tokens come first)
    _slots: threading.Semaphore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._limiter = anyio.CapacityLimiter(self.n)
        self._threads = anyio.CapacityLimiter(self.n)
        self._slots = threading.Semaphore(self.n)

    async def run(self, fn: Callable[[], T], *, timeout_s: float | None) -> T:
        """Run ``fn`` in a worker thread holding a slot.

        ``timeout_s=None``: wait until it returns, even when cancelled (for calls that read or
        write caller memory). Otherwise: ClientBusy when no token came free within ``timeout_s``
        (calls still running hold them all; ``fn`` never ran), else TimeoutError after
        ``timeout_s`` more, abandoning the thread, which keeps its slot until ``fn`` returns.
        Raises SlotsBusy when no slot is free (abandoned calls hold them), also when ``timeout_s``
        passed before the thread started (``fn`` never ran).
        """
        slots, started = self._slots, threading.Event()

        def work() -> T:
            started.set()
            if not slots.acquire(blocking=False):
                raise SlotsBusy
            try:
                return fn()
            finally:
                slots.release()

        if timeout_s is None:
            return await anyio.to_thread.run_sync(work, limiter=self._limiter)
        with anyio.move_on_after(timeout_s) as waiting:
            await self._limiter.acquire()
        if waiting.cancelled_caught:
            raise ClientBusy
        try:
            with anyio.fail_after(timeout_s):
                return await anyio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=self._threads)
        except TimeoutError:
            if not started.is_set():
                raise SlotsBusy from None
            raise
        finally:
            self._limiter.release()

    async def run_alone(self, fn: Callable[[], T], *, timeout_s: float) -> tuple[Alone, T | None]:
        """Wait (in a thread) until no other call runs, then run ``fn`` holding every slot.

        Returns ``(Alone.DONE, result)``; ``(Alone.BUSY, None)`` if the other calls did not all
        return within ``timeout_s`` (``fn`` did not run); ``(Alone.OVERRAN, None)`` if ``fn`` ran but
        had not returned about a second after that (it goes on in its thread). For ``close``:
        closing a client under a running call is unsafe.
        """
        slots, n = self._slots, self.n
        deadline = time.monotonic() + timeout_s
        state: dict[str, object] = {}  # "started", then "result": what the thread got to

        def work() -> None:
            held = 0
            try:
                for _ in range(n):
                    if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                        return
                    held += 1
                state["started"] = True
                state["result"] = fn()
            finally:
                for _ in range(held):
                    slots.release()

        with anyio.move_on_after(timeout_s + 1.0):
            await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        # (read after the wait: a call that holds the GIL past the deadline has returned by now)
        if "result" in state:
            return Alone.DONE, cast(T, state["result"])
        return (Alone.OVERRAN if "started" in state else Alone.BUSY), None
