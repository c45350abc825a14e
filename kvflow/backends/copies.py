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
    "checked_object",
    "copy_in_pieces",
    "copy_in_runs",
    "copy_run",
    "gather_objects",
    "regions_of",
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
    pacer, paused = pacing.Pacer(), False
    for start in range(0, len(batch), step):
        if pacer.due():
            await pacer.pause()
            paused = True
        end = min(start + step, len(batch))
        starts = buffers(start, end)
        got = start + len(starts)
        copy_run(batch, start, starts, into_regions=into_regions)
        if after_run is not None:
            after_run(start, got)
        if got < end:
            break
    return paused


async def copy_in_pieces(
    buf: int,
    addrs: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
    pacer: pacing.Pacer,
    *,
    into_buffer: bool,
    piece_bytes: int = pacing.PIECE,
) -> None:
    """Copy between an object's regions (``addrs``, ``sizes``: :func:`regions_of`) and the buffer
    at ``buf``, streamed: into the buffer when ``into_buffer``, else out of it. For an object that
    one copy call would copy whole, holding the loop all that time: in pieces of at most
    ``piece_bytes`` of the buffer (one call each, the regions cut at the pieces' edges), the loop
    let run between two once it has been held long enough (``pacer``). Checks the clock after every
    piece but the last (the caller does after it). The caller has checked the object
    (:func:`check_object`)."""
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    for start in range(0, total, piece_bytes):
        if start:
            await pacer.tick()
        end = min(start + piece_bytes, total)
        first = int(np.searchsorted(ends, start, side="right"))  # the region holding byte ``start``
        last = int(np.searchsorted(ends - sizes, end, side="left"))  # past the last starting before ``end``
        at, lengths = addrs[first:last].copy(), sizes[first:last].copy()
        cut = start - int(ends[first] - sizes[first])  # of the first region, copied by the piece before
        at[0] += cut
        lengths[0] -= cut
        lengths[-1] -= int(ends[last - 1]) - end  # of the last region, left to the next piece
        regions.copy_ragged(
            np.asarray([buf + start], dtype=np.int64),
            np.asarray([len(at)], dtype=np.int64),
            at,
            lengths,
            into_regions=not into_buffer,
            stream=True,
        )


def checked_object(objects: Sequence[ObjectRef], index: int) -> tuple[str, int]:
    """The key and byte count of object ``index``, checked (:func:`check_object`) unless it is of
    an :class:`~kvflow.backends.base.ObjectBatch`, checked when made (no :class:`ObjectRef` made of
    it: an object of another layout may have thousands of regions)."""
    if isinstance(objects, ObjectBatch):
        return objects.keys[index], objects.nbytes
    obj = objects[index]
    check_object(obj)  # (as a run's copy checks each of its objects)
    return obj.key, obj.nbytes


def regions_of(
    objects: Sequence[ObjectRef], index: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The addresses and sizes of object ``index``'s regions, as arrays (of an
    :class:`~kvflow.backends.base.ObjectBatch`, its columns: no list made)."""
    if isinstance(objects, ObjectBatch):
        return objects.addrs[index], objects.sizes_array()
    obj = objects[index]
    return np.asarray(obj.addrs, dtype=np.int64), np.asarray(obj.sizes, dtype=np.int64)


def copy_run(batch: ObjectBatch, start: int, buffers: npt.NDArray[np.int64], *, into_regions: bool) -> None:
    """Copy between objects ``start`` to ``start + len(buffers)`` of ``batch`` and the buffers at
    ``buffers``, one each, streamed (as :func:`copy_in_runs`, for one run): one compiled call on
    the batch's columns, no slice of it made."""
    rows = batch.addrs[start : start + len(buffers)]
    regions.copy_rows(buffers, rows, batch.sizes_array(), into_regions=into_regions, stream=True)


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
