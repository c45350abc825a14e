"""Sharing the event loop while a backend copies in-process: a checkpoint every half millisecond.

The in-process backends (memory, local) copy bytes on the pool's loop. They copy in pieces of at
most :data:`PIECE` bytes and call :meth:`Pacer.tick` between pieces, which yields to other tasks
once the loop has been held :data:`YIELD_EVERY_S`, so one large batch never stalls the engine's
other transfers (or vLLM's scheduler waiting on a lookup) for more than about a millisecond.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio.lowlevel
import attrs

__all__ = ["PIECE", "RUN_BYTES", "RUN_OBJECTS", "YIELD_EVERY_S", "Pacer", "run_end"]

#: The longest a call holds the event loop between checkpoints (plus one piece).
YIELD_EVERY_S = 0.0005
#: The most bytes copied (or hashed) between two looks at the clock, within one object.
PIECE = 1 << 20
#: The most bytes of a run of objects that one copy call takes between two looks at the clock
#: (about 0.4 ms of copying at this project's machines' 10 GB/s): each run costs some Python
#: before and after its copy, which in runs of one piece took 5-10% of a 256 KiB-1 MiB batch.
RUN_BYTES = 4 << 20
#: The most objects copied by one call between two looks at the clock (each costs some Python
#: before and after the copy, however small it is).
RUN_OBJECTS = 256


@attrs.define
class Pacer:
    """Checkpoints when the loop has been held longer than :data:`YIELD_EVERY_S`."""

    last: float = attrs.field(factory=time.monotonic)

    def due(self) -> bool:
        """Whether the loop has been held long enough that the caller should :meth:`pause`."""
        return time.monotonic() - self.last >= YIELD_EVERY_S

    async def pause(self) -> None:
        """Let the loop run other tasks now, and start counting again."""
        await anyio.lowlevel.checkpoint()
        self.last = time.monotonic()

    async def tick(self) -> None:
        """:meth:`pause` if it is :meth:`due`."""
        if self.due():
            await self.pause()


def run_end(sizes: Sequence[int], start: int, *, uniform: bool = False) -> int:
    """Where the run of objects from ``start`` that one copy call takes ends: as many as fit in
    :data:`RUN_BYTES` together, at most :data:`RUN_OBJECTS` of them, and at least one (an object
    larger than that runs alone). ``uniform``: every size is the same (an
    :class:`~kvflow.backends.base.ObjectBatch`'s), so the run's length is one division."""
    if uniform:
        return min(len(sizes), start + max(1, min(RUN_OBJECTS, RUN_BYTES // max(1, sizes[start]))))
    end, total = start + 1, sizes[start]
    last = min(len(sizes), start + RUN_OBJECTS)
    while end < last and total + sizes[end] <= RUN_BYTES:
        total += sizes[end]
        end += 1
    return end
