"""Whether the Mooncake master is believed reachable, and when a call may check again.

When the master dies, Mooncake fails the first calls at once and then makes every call wait about
4.5 s before it reports ``RPC_FAIL``. The gate turns that into fast failures: after a failure it is
*down*; calls fail without touching Mooncake, except that at most one call per ``interval_s`` is
allowed to probe the master (a bounded, cheap check). A successful probe opens the gate again.
No thread and no background task: probes happen lazily, inside the calls that need an answer.

Use a gate from one event loop; its methods never await. Its :attr:`HealthGate.state`, an
immutable :class:`StoreHealth` replaced on every change, may be read from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

__all__ = ["HealthGate", "StoreHealth"]


@attrs.frozen
class StoreHealth:
    """Whether a backend believes its store reachable: since when (``time.monotonic()`` seconds,
    0.0 when it never changed) and, while it is not, why."""

    reachable: bool = True
    since: float = 0.0
    reason: str | None = None


@attrs.define
class HealthGate:
    """Up or down, with the reason and a rate limit for probes. ``clock`` is monotonic seconds."""

    interval_s: float
    clock: Callable[[], float] = time.monotonic
    _reason: str | None = attrs.field(default=None, init=False)
    _down_since: float = attrs.field(default=0.0, init=False)
    _next_probe: float = attrs.field(default=0.0, init=False)
    _probing: bool = attrs.field(default=False, init=False)
    failures: int = attrs.field(default=0, init=False)
    #: The current state, for readers on any thread (a new object on every change).
    state: StoreHealth = attrs.field(factory=StoreHealth, init=False)

    @property
    def healthy(self) -> bool:
        return self._reason is None

    def mark_down(self, reason: str) -> None:
        """Record a failure that means "the master cannot be reached"; keeps the first reason."""
        self.failures += 1
        if self._reason is None:
            now = self.clock()
            self._reason = reason
            self._down_since = now
            self._next_probe = now + self.interval_s
            self.state = StoreHealth(False, now, reason)

    def mark_up(self) -> None:
        if self._reason is not None:
            self.state = StoreHealth(True, self.clock())
        self._reason = None

    def claim_probe(self) -> bool:
        """True for the one caller that should probe now; it must call :meth:`end_probe`."""
        if self._reason is None or self._probing:
            return False
        now = self.clock()
        if now < self._next_probe:
            return False
        self._probing = True
        self._next_probe = now + self.interval_s
        return True

    def defer_probe(self, delay_s: float) -> None:
        """Let no probe start within ``delay_s`` from now (a backoff; never earlier than planned)."""
        self._next_probe = max(self._next_probe, self.clock() + delay_s)

    def end_probe(self, ok: bool, reason: str = "") -> None:
        self._probing = False
        if ok:
            self.mark_up()
        elif reason:
            self._reason = reason
            self.state = StoreHealth(False, self._down_since, reason)

    def describe(self) -> str:
        """Why the gate is down and when the next probe may run, for error messages."""
        if self._reason is None:
            return "the Mooncake master is reachable"
        now = self.clock()
        return (
            f"the Mooncake master has been unreachable for {now - self._down_since:.1f} s "
            f"({self._reason}); the next check runs in {max(0.0, self._next_probe - now):.1f} s. "
            "Check that mooncake_master is running and reachable from this host"
        )
