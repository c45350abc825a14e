"""Whether a side's store is reachable: read from its backend, logged once per change, reported
with the stats.

A backend that can tell (the Mooncake backend's health gate, :meth:`MooncakeBackend.health`) is
asked every engine step; one that cannot (the local store: a directory) counts as reachable.
:class:`StoreWatch` logs a WARNING when the store goes down and one when it comes back, never
more, and hands the state to the stats (:meth:`report`) once at start and after every change, so
vLLM's ``vllm:kvflow_store_reachable`` gauge and its interval log line follow it.

Used from one thread (the side's: scheduler or model runner); reading the backend's state is safe
from there (an immutable snapshot the backend replaces on its own loop).
"""

from __future__ import annotations

import logging
import time

import attrs

from kvflow.backends.mooncake.health import StoreHealth

__all__ = ["StoreWatch", "backend_health"]

log = logging.getLogger(__name__)


def backend_health(backend: object) -> StoreHealth:
    """What ``backend`` says of its store (reachable when it has no ``health()``)."""
    probe = getattr(backend, "health", None)
    state = probe() if callable(probe) else None
    return state if isinstance(state, StoreHealth) else StoreHealth()


@attrs.define(eq=False)
class StoreWatch:
    """Follows one backend for one side; ``who`` names it in logs and in the gauge's ``client``
    label ("scheduler", "worker-tp0-pp0")."""

    backend: object
    who: str
    url: str
    _reachable: bool = attrs.field(default=True, init=False)
    _down_at: float = attrs.field(default=0.0, init=False)
    _unreported: bool = attrs.field(default=True, init=False)  # the first state is reported too

    @property
    def reachable(self) -> bool:
        return self._reachable

    def poll(self) -> bool:
        """Read the backend's state; log a change (once). Returns whether it is reachable."""
        state = backend_health(self.backend)
        if state.reachable == self._reachable:
            return self._reachable
        self._reachable = state.reachable
        self._unreported = True
        if not state.reachable:
            self._down_at = time.monotonic()
            log.warning(
                "kvflow (%s): the KV store %s is unreachable (%s); requests are computed without it "
                "and nothing is stored until it answers again",
                self.who,
                self.url,
                state.reason or "no reason given",
            )
        else:
            log.warning(
                "kvflow (%s): the KV store %s is reachable again after %.1f s",
                self.who,
                self.url,
                time.monotonic() - self._down_at,
            )
        return self._reachable

    def report(self) -> tuple[tuple[str, bool], ...]:
        """``((who, reachable),)`` for this interval's stats the first time and after a change,
        else ``()`` (the gauge keeps its last value)."""
        if not self._unreported:
            return ()
        self._unreported = False
        return ((self.who, self._reachable),)
