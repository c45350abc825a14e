"""How long a transfer took, measured from the thread that submitted it."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import attrs

__all__ = ["Stopwatch"]


@attrs.define(eq=False)
class Stopwatch:
    """When a transfer started and when it ended.

    :meth:`watch` sets ``ended`` from the future's done callback (on the thread that completes it,
    kvflow's loop thread); read :attr:`seconds` once the future is done, or before to count up to
    now (a transfer that overran its answer).
    """

    started: float = attrs.field(factory=time.monotonic)
    ended: float | None = None

    def watch(self, future: concurrent.futures.Future[Any]) -> Stopwatch:
        future.add_done_callback(self._end)
        return self

    def _end(self, _: object) -> None:
        self.ended = time.monotonic()

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started
