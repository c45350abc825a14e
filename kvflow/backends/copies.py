"""In-process copies of a backend call's objects: each object's regions to or from one buffer, the
whole batch in one compiled call (:mod:`kvflow.regions`).

Both directions write with streaming stores (:mod:`kvflow.copyloops`), which skip the read of
each destination line first. A gather writes the store's own buffers, which nobody reads again
soon. A scatter writes the engine's cache, whose kernels read the loaded KV next: on the second VM
of docs/benchmarks.md a streamed load of 1-32 MiB took 0.67-0.99x the time of the same load by
``memmove`` (0.67-0.84x from 16 MiB), and reading what it loaded took as long after either (tenth
stop). On the first VM, two noisy runs of ``benchmarks/vllm_ttft.py`` with streamed loads showed
no faster load (2026-12-04, afternoon); it could not be measured there again.

An :class:`~kvflow.backends.base.ObjectBatch` goes to the copy loop as the columns it already is;
a list of objects of any shapes is first laid out flat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvflow import regions
from kvflow.backends import pacing
from kvflow.backends.base import ObjectBatch, ObjectRef

__all__ = [
    "SHORT_REGION_BYTES",
    "at",
    "check_object",
    "copy_in_pieces",
    "copy_in_runs",
    "copy_run",
    "gather_objects",
    "scatter_objects",
]


#: The shortest region the compiled copy loop streams at about memcpy's speed (what the in-process
#: backends tell as :attr:`~kvflow.backends.base.BackendCapabilities.min_region_bytes`): objects of
#: 2 MiB scattered into regions of 256 bytes ran at 16.3 GB/s beside memcpy's 15.7 (AMD VM,
#: twenty-third stop), regions of 128 bytes at 14.2, of 64 bytes at 5.1 (below the streamed step,
#: they go by ``memmove``).
SHORT_REGION_BYTES = 256


def gather_objects(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
    """Copy each object's regions back to back into the buffer at ``buffers[i]`` (streamed)."""
    _copy(buffers, objects, into_regions=False)


def scatter_objects(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
    """Copy the buffer at ``buffers[i]`` into object ``i``'s regions, in order (streamed)."""
    _copy(buffers, objects, into_regions=True)


async def copy_in_runs(
    batch: ObjectBatch,
    buffers: Callable[[int, int], npt.NDArray[np.int64]],
    *,
    into_regions: bool,
    after_run: Callable[[int, int], None] | None = None,
) -> bool:
    """Copy between ``batch``'s objects' regions and one buffer each, streamed: into the regions
    when ``into_regions``, else out of them. A run of objects
    (:func:`~kvflow.backends.pacing.run_length`) is one compiled call, on the columns as they are
    (no Python per run beyond the call); the loop runs between two runs once it has been held long
    enough (:class:`~kvflow.backends.pacing.Pacer`).

    ``buffers(start, end)`` gives the addresses of the buffers of objects ``start`` to ``end``,
    asked as each run comes (after the loop ran, so a caller may reserve them then); fewer than
    asked copies those and ends the copy. ``after_run(start, end)`` is called after the copy of
    each run. Returns whether the loop ran (other tasks may have changed what the caller looked at
    before)."""
    step = pacing.run_length(batch.nbytes)
    sizes = np.asarray(batch.sizes, dtype=np.int64)  # (once: an object may have thousands of regions)
    pacer, paused = pacing.Pacer(), False
    for start in range(0, len(batch), step):
        if pacer.due():
            await pacer.pause()
            paused = True
        end = min(start + step, len(batch))
        starts = buffers(start, end)
        got = start + len(starts)
        copy_run(batch, start, starts, into_regions=into_regions, sizes=sizes)
        if after_run is not None:
            after_run(start, got)
        if got < end:
            break
    return paused


async def copy_in_pieces(
    buf: int, obj: ObjectRef, pacer: pacing.Pacer, *, into_buffer: bool, piece_bytes: int = pacing.PIECE
) -> None:
    """Copy between ``obj``'s regions and the buffer at ``buf``, streamed: into the buffer when
    ``into_buffer``, else out of it. For an object that one copy call would copy whole, holding the
    loop all that time: in pieces of at most ``piece_bytes`` (one call each), the loop let run
    between two once it has been held long enough (``pacer``). Checks the clock after every piece
    but the last (the caller does after it). The caller has checked ``obj`` (:func:`check_object`)."""
    offset = 0
    since_tick = 0
    addrs: list[int] = []  # the regions' parts of the piece that starts in the buffer at ``piece``
    lengths: list[int] = []
    piece = buf
    for addr, size in zip(obj.addrs, obj.sizes):
        done = 0
        while done < size:
            if since_tick >= piece_bytes:
                _copy_piece(piece, addrs, lengths, into_buffer=into_buffer)
                piece, addrs, lengths = buf + offset, [], []
                await pacer.tick()
                since_tick = 0
            n = min(size - done, piece_bytes - since_tick)
            addrs.append(addr + done)
            lengths.append(n)
            done += n
            offset += n
            since_tick += n
    if addrs:
        _copy_piece(piece, addrs, lengths, into_buffer=into_buffer)


def _copy_piece(at: int, addrs: list[int], lengths: list[int], *, into_buffer: bool) -> None:
    """Copy between the regions ``(addrs[i], lengths[i])`` and the buffer at ``at``, back to back
    there, streamed: into the buffer when ``into_buffer``, else out of it."""
    regions.copy_ragged(
        np.asarray([at], dtype=np.int64),
        np.asarray([len(addrs)], dtype=np.int64),
        np.asarray(addrs, dtype=np.int64),
        np.asarray(lengths, dtype=np.int64),
        into_regions=not into_buffer,
        stream=True,
    )


def copy_run(
    batch: ObjectBatch,
    start: int,
    buffers: npt.NDArray[np.int64],
    *,
    into_regions: bool,
    sizes: npt.NDArray[np.int64] | None = None,
) -> None:
    """Copy between objects ``start`` to ``start + len(buffers)`` of ``batch`` and the buffers at
    ``buffers``, one each, streamed (as :func:`copy_in_runs`, for one run): one compiled call on
    the batch's columns, no slice of it made. ``sizes``: the batch's region sizes as an array,
    where the caller made it already."""
    rows = batch.addrs[start : start + len(buffers)]
    if sizes is None:
        sizes = np.asarray(batch.sizes, dtype=np.int64)
    regions.copy_rows(buffers, rows, sizes, into_regions=into_regions, stream=True)


def at(addresses: npt.NDArray[np.int64]) -> Callable[[int, int], npt.NDArray[np.int64]]:
    """:func:`copy_in_runs`'s ``buffers`` when every buffer is known before the copy: object ``i``'s
    at ``addresses[i]``."""
    return lambda start, end: addresses[start:end]


def check_object(obj: ObjectRef) -> None:
    """Raise ValueError unless ``obj``'s addresses, sizes and byte count agree (a copy of it would
    leave part of its buffer unwritten, or write past it)."""
    if len(obj.addrs) != len(obj.sizes) or sum(obj.sizes) != obj.nbytes or min(obj.sizes, default=0) < 0:
        raise ValueError(
            f"object {obj.key!r}: {len(obj.addrs)} addresses, sizes {list(obj.sizes)} and "
            f"nbytes {obj.nbytes} do not agree (build it with ObjectRef.of)"
        )


def _copy(buffers: Sequence[int], objects: Sequence[ObjectRef], *, into_regions: bool) -> None:
    if len(buffers) != len(objects):
        raise ValueError(f"{len(buffers)} buffers for {len(objects)} objects")
    starts = np.asarray(buffers, dtype=np.int64)
    if isinstance(objects, ObjectBatch):  # one run of all of it
        copy_run(objects, 0, starts, into_regions=into_regions)
        return
    addrs: list[int] = []
    sizes_of: list[int] = []
    for obj in objects:
        check_object(obj)
        addrs.extend(obj.addrs)
        sizes_of.extend(obj.sizes)
    counts = np.fromiter((len(obj.sizes) for obj in objects), dtype=np.int64, count=len(objects))
    regions.copy_ragged(
        starts, counts, np.asarray(addrs), np.asarray(sizes_of), into_regions=into_regions, stream=True
    )
