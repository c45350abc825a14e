"""Sharing the event loop while a backend copies in-process: a checkpoint every half millisecond
while other work waits to run, every :data:`HOLD_ALONE_S` when none does.

The in-process backends (memory, local, arena) copy bytes on the pool's loop. They copy objects in
runs of at most :data:`RUN_BYTES` and a larger object in pieces (:func:`whole_bytes`; the local
backend's kernel copies in pieces of at most :data:`PIECE`), and call :meth:`Pacer.tick` between
runs and pieces, which yields to other tasks once the loop has been held :data:`YIELD_EVERY_S` and
other work waits to run on it (a task woken, a call handed over from another thread, as vLLM's
scheduler hands over a lookup, a timer due), so one large batch never stalls the engine's other
transfers for more than about a millisecond. A call alone on the loop goes on: a checkpoint costs
45-55 us from the caches a copy leaves, seven of them in a load of 32 MiB (measured,
docs/benchmarks.md, eleventh stop). Sockets are seen only when the loop polls, so a call yields at
least every :data:`HOLD_ALONE_S` all the same.

The arena backend's gets hold the store's lock across their runs and let it go at each checkpoint
(a section under the lock never awaits). They count a put waiting for the lock in another process
as other work waiting (:meth:`Pacer.due`'s ``others``): such a put can take the lock only between
two holds (``flock`` is not fair), and says it waits in the store
(:class:`kvflow.backends.arena.lock.WaitMark`).

Every put and get of the three backends also ends with a checkpoint, so that many small calls in a
row from one task, each under the thresholds, do not hold the loop across them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import anyio.lowlevel
import attrs

__all__ = [
    "CALM_S",
    "HOLD_ALONE_S",
    "MIN_PIECE",
    "PIECE",
    "PIECE_BUDGET_S",
    "RUN_BYTES",
    "RUN_OBJECTS",
    "YIELD_EVERY_S",
    "Pacer",
    "PieceSize",
    "others_ready",
    "run_end",
    "run_length",
    "whole_bytes",
]

#: The longest a call holds the event loop between checkpoints (plus one piece) while other work
#: is ready to run on it.
YIELD_EVERY_S = 0.0005
#: The longest a call holds the event loop between checkpoints (plus one piece) when no other work
#: is seen waiting (:func:`others_ready`): what a socket that became readable may wait.
HOLD_ALONE_S = 0.002
#: The most bytes copied (or hashed) between two looks at the clock, within one object.
PIECE = 1 << 20
#: The smallest piece :class:`PieceSize` cuts a copy into, however slow the kernel is.
MIN_PIECE = 64 << 10
#: What one piece of a kernel copy may hold the loop (:class:`PieceSize`).
PIECE_BUDGET_S = 0.0005
#: How long no piece must have been slow before :class:`PieceSize` lets pieces grow again.
CALM_S = 1.0
#: The most bytes of a run of objects that one copy call takes between two looks at the clock
#: (about 0.4 ms of copying at this project's machines' 10 GB/s): each run costs some Python
#: before and after its copy, which in runs of one piece took 5-10% of a 256 KiB-1 MiB batch.
RUN_BYTES = 4 << 20
#: The most objects copied by one call between two looks at the clock (each costs some Python
#: before and after the copy, however small it is).
RUN_OBJECTS = 256


def others_ready() -> bool:
    """Whether other work waits to run on this thread's asyncio loop: a callback ready (a task woken,
    a call handed over from another thread with ``call_soon_threadsafe``) or a timer due (a task's
    sleep or deadline). True where that cannot be told (an event loop without asyncio's queues), so
    such a loop is shared every half millisecond. Sockets are seen only when the loop polls."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # on another kind of event loop (trio)
        return True
    ready = getattr(loop, "_ready", None)
    timers = getattr(loop, "_scheduled", None)
    if ready is None or timers is None or ready:
        return True
    return bool(timers) and timers[0].when() <= loop.time()


@attrs.define
class Pacer:
    """Checkpoints when the loop has been held longer than :data:`YIELD_EVERY_S` and other work is
    ready to run (:func:`others_ready`), or longer than :data:`HOLD_ALONE_S`."""

    last: float = attrs.field(factory=time.monotonic)

    def due(self, others: Callable[[], bool] | None = None) -> bool:
        """Whether the loop has been held long enough that the caller should :meth:`pause`;
        ``others``: whether work elsewhere waits for the caller too (asked after the loop's own)."""
        held = time.monotonic() - self.last
        if held < YIELD_EVERY_S:
            return False
        return held >= HOLD_ALONE_S or others_ready() or (others is not None and others())

    async def pause(self) -> None:
        """Let the loop run other tasks now, and start counting again."""
        await anyio.lowlevel.checkpoint()
        self.last = time.monotonic()

    async def tick(self) -> None:
        """:meth:`pause` if it is :meth:`due`."""
        if self.due():
            await self.pause()


@attrs.define
class PieceSize:
    """How many bytes the next piece of one kind of copy the kernel makes (writes into files, or
    reads from them) may hold: :data:`PIECE`, or less where the kernel is slow.

    A 1 MiB write into tmpfs takes 0.1-0.5 ms, but not everywhere: on this project's virtual
    machine, for a minute or two after a large install, it took 10-13 ms of the thread's CPU time
    (in the kernel, filling the file's new pages; the other backends' copies were not slowed), and
    a copy of one piece held the loop that long.

    A piece that held the loop more than twice :data:`PIECE_BUDGET_S` shrinks the next ones to what
    would have taken :data:`PIECE_BUDGET_S`, page-aligned and at least :data:`MIN_PIECE`. Once no
    piece has been slow for :data:`CALM_S`, each whole piece that took under half of it doubles
    them again, up to :data:`PIECE`: a kernel slow only at times (new pages slow, recycled ones
    quick) keeps them small. Time is the thread's CPU time, so another process taking the CPU does
    not count (nor does a kernel that sleeps inside the copy, waiting to reclaim memory). A backend
    keeps one per kind for all its calls, so that each call does not learn it again with a slow
    first piece.
    """

    nbytes: int = PIECE
    _slow_at: float = float("-inf")  # time.monotonic() of the last slow piece

    def took(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """A piece of ``nbytes`` took ``seconds`` of the loop's thread, ending at ``now``
        (``time.monotonic()``, the default)."""
        now = time.monotonic() if now is None else now
        if seconds > 2 * PIECE_BUDGET_S:
            fits = int(nbytes * PIECE_BUDGET_S / seconds) & ~(_PAGE - 1)
            self.nbytes = max(MIN_PIECE, min(self.nbytes, fits))
            self._slow_at = now
        elif 2 * seconds < PIECE_BUDGET_S and nbytes >= self.nbytes < PIECE and now - self._slow_at >= CALM_S:
            self.nbytes = min(PIECE, 2 * self.nbytes)


_PAGE = 4096


def run_end(sizes: Sequence[int], start: int, *, uniform: bool = False) -> int:
    """Where the run of objects from ``start`` that one copy call takes ends: as many as fit in
    :data:`RUN_BYTES` together, at most :data:`RUN_OBJECTS` of them, and at least one (an object
    larger than that runs alone). ``uniform``: every size is the same (an
    :class:`~kvflow.backends.base.ObjectBatch`'s), so the run's length is one division."""
    if uniform:
        return min(len(sizes), start + run_length(sizes[start]))
    end, total = start + 1, sizes[start]
    last = min(len(sizes), start + RUN_OBJECTS)
    while end < last and total + sizes[end] <= RUN_BYTES:
        total += sizes[end]
        end += 1
    return end


def whole_bytes() -> int:
    """The largest object an in-process backend copies whole, a run of such objects a copy call
    (:func:`run_end`): a run's bytes (:data:`RUN_BYTES`), or a piece's where that is larger. A
    larger object is copied alone, in pieces of this size with a look at the clock between them
    (:func:`kvflow.backends.copies.copy_in_pieces`), so no copy call holds the loop longer than a
    run's does. (The memory backend cut objects over 1 MiB in 1 MiB pieces: from flushed caches
    each piece's call cost 10-15 us, a fifth of a get of a 2 MiB object; docs/benchmarks.md,
    twenty-first stop.)"""
    return max(RUN_BYTES, PIECE)


def run_length(nbytes: int) -> int:
    """How many objects of ``nbytes`` each one copy call takes: as many as fit in
    :data:`RUN_BYTES`, at most :data:`RUN_OBJECTS`, at least one."""
    return max(1, min(RUN_OBJECTS, RUN_BYTES // max(1, nbytes)))
