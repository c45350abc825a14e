"""Which memory Mooncake may use zero-copy, and the bounce buffer for memory it may not.

Mooncake moves bytes straight from and into memory registered with ``register_buffer`` (RDMA needs
it; TCP merely tolerates unregistered memory). kvflow registers what the pool announces through
``register_memory``. An object with any region outside registered memory is copied through a
registered staging buffer instead: gathered into it before a put, scattered out of it after a get.
Registering such memory on the fly was rejected: the caller may free it right after the call, and a
registration that outlives its memory is unsafe with RDMA.

Plans are computed on the event loop; the copies run in the worker thread of the Mooncake call.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import operator
from collections.abc import Sequence

import attrs

from kvflow.backends.base import ObjectRef
from kvflow.errors import BackendError
from kvflow.regions import gather, scatter

__all__ = ["Chunk", "RegisteredMemory", "StagingBuffer", "plan_chunks"]


_ADDRS = operator.attrgetter("addrs")
_SIZES = operator.attrgetter("sizes")


@attrs.define
class RegisteredMemory:
    """Address ranges registered with Mooncake. A region is zero-copy iff one range contains it."""

    _starts: list[int] = attrs.field(factory=list, init=False)
    _ends: list[int] = attrs.field(factory=list, init=False)
    _max_end: list[int] = attrs.field(factory=list, init=False)  # max end of ranges[0..i]

    def add(self, addr: int, nbytes: int) -> list[tuple[int, int]]:
        """Record a range; return ``(addr, nbytes)`` of each piece of it no range covered yet,
        which is what to register (Mooncake refuses a range that overlaps a registered one).
        Ranges stay disjoint; a region across two of them is not zero-copy."""
        pieces, at, end = [], addr, addr + nbytes
        for start, stop in zip(self._starts, self._ends):
            if stop <= at or start >= end:
                continue
            if start > at:
                pieces.append((at, start - at))
            at = max(at, stop)
        if at < end:
            pieces.append((at, end - at))
        for start, size in pieces:
            i = bisect.bisect_right(self._starts, start)
            self._starts.insert(i, start)
            self._ends.insert(i, start + size)
        best = 0
        self._max_end = []
        for stop in self._ends:
            best = max(best, stop)
            self._max_end.append(best)
        return pieces

    def ranges(self) -> list[tuple[int, int]]:
        return [(s, e - s) for s, e in zip(self._starts, self._ends)]

    def contains(self, addr: int, nbytes: int) -> bool:
        # The range with the largest end among those starting at or before addr contains the
        # region iff any does.
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and self._max_end[i] >= addr + nbytes

    def covers_each(self, objects: Sequence[ObjectRef]) -> list[bool]:
        """:meth:`covers` of every object; one check for a batch inside one registered range."""
        starts, max_end = self._starts, self._max_end
        if starts and objects and all(map(len, map(_ADDRS, objects))):
            # Fast path (C loops only): the lowest region start and a bound on the highest end
            # (highest start + largest size) lie in one range, as when the KV caches are one
            # registered allocation.
            lo = min(map(min, map(_ADDRS, objects)))
            hi = max(map(max, map(_ADDRS, objects))) + max(map(max, map(_SIZES, objects)))
            i = bisect.bisect_right(starts, lo) - 1
            if i >= 0 and max_end[i] >= hi:
                return [True] * len(objects)
        return [self.covers(obj) for obj in objects]

    def covers(self, obj: ObjectRef) -> bool:
        """Whether every non-empty region of ``obj`` lies inside one registered range."""
        starts, max_end = self._starts, self._max_end
        addrs, sizes = obj.addrs, obj.sizes
        if not starts or not addrs:
            return not addrs
        # Fast path (C loops only): one range holds the object's whole span, as when every layer
        # of a KV cache is a view of one allocation.
        i = bisect.bisect_right(starts, min(addrs)) - 1
        if i >= 0 and max_end[i] >= max(map(operator.add, addrs, sizes)):
            return True
        for addr, size in zip(addrs, sizes):
            i = bisect.bisect_right(starts, addr) - 1
            if size and (i < 0 or max_end[i] < addr + size):
                return False
        return True


@attrs.define
class StagingBuffer:
    """Page-aligned anonymous memory that the backend registers once and reuses for every chunk."""

    nbytes: int
    _map: mmap.mmap = attrs.field(init=False)
    addr: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._map = mmap.mmap(-1, self.nbytes)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def close(self) -> None:
        """Release the memory; call only after Mooncake forgot it (after ``close``)."""
        with contextlib.suppress(BufferError):  # a view is still alive: it goes with the process
            self._map.close()


@attrs.frozen
class Chunk:
    """One Mooncake call: objects ``indices`` of the batch, with the regions to pass for each.

    ``staged`` lists ``(position in chunk, staging address)`` of the objects that go through the
    staging buffer; their entry in ``addrs``/``sizes`` is the staging slot.
    """

    indices: list[int]
    keys: list[str]
    addrs: list[list[int]]
    sizes: list[list[int]]
    staged: list[tuple[int, int]]

    def gather_staged(self, objects: Sequence[ObjectRef], only: Sequence[bool] | None = None) -> None:
        """Copy staged objects into their slots (worker thread); ``only[pos]`` picks a subset."""
        for pos, slot in self.staged:
            if only is None or only[pos]:
                obj = objects[self.indices[pos]]
                gather(slot, obj.addrs, obj.sizes)

    def scatter_staged(self, objects: Sequence[ObjectRef], done: Sequence[bool]) -> None:
        """Copy the staged objects whose get succeeded (``done[pos]``) to their regions."""
        for pos, slot in self.staged:
            if done[pos]:
                obj = objects[self.indices[pos]]
                scatter(slot, obj.addrs, obj.sizes)


def plan_chunks(
    objects: Sequence[ObjectRef],
    indices: Sequence[int],
    zero_copy: Sequence[bool],
    *,
    max_batch: int,
    staging: StagingBuffer | None,
) -> list[Chunk]:
    """Split ``objects[i] for i in indices`` into chunks of at most ``max_batch`` objects whose
    staged bytes fit the staging buffer. ``zero_copy[i]`` says whether object ``i`` is registered.
    """
    if all(zero_copy[i] for i in indices):  # the common case: everything registered, no copies
        return [
            _direct_chunk(objects, list(indices[k : k + max_batch]))
            for k in range(0, len(indices), max_batch)
        ]
    capacity = staging.nbytes if staging is not None else 0
    chunks: list[Chunk] = []
    current = Chunk([], [], [], [], [])
    used = 0
    for i in indices:
        obj = objects[i]
        staged = not zero_copy[i]
        if staged and obj.nbytes > capacity:
            raise BackendError(
                f"object {obj.key!r} ({obj.nbytes} bytes in {len(obj.sizes)} regions) is not in memory "
                f"registered with register_memory(), and the staging buffer holds {capacity} bytes: "
                "register the memory (KVPool does this for its layout) or raise staging= in the URL"
            )
        if len(current.indices) >= max_batch or (staged and used + obj.nbytes > capacity):
            chunks.append(current)
            current = Chunk([], [], [], [], [])
            used = 0
        current.indices.append(i)
        current.keys.append(obj.key)
        if staged:
            assert staging is not None
            slot = staging.addr + used
            current.staged.append((len(current.indices) - 1, slot))
            current.addrs.append([slot])
            current.sizes.append([obj.nbytes])
            used += obj.nbytes
        else:
            addrs, sizes = _regions(obj)
            current.addrs.append(addrs)
            current.sizes.append(sizes)
    if current.indices:
        chunks.append(current)
    return chunks


def _regions(obj: ObjectRef) -> tuple[list[int], list[int]]:
    """The object's regions as lists, without empty ones (Mooncake rejects them; they hold nothing)."""
    if 0 in obj.sizes:
        return [a for a, n in zip(obj.addrs, obj.sizes) if n], [n for n in obj.sizes if n]
    return list(obj.addrs), list(obj.sizes)


def _direct_chunk(objects: Sequence[ObjectRef], indices: list[int]) -> Chunk:
    picked = [objects[i] for i in indices]
    regions = [_regions(obj) for obj in picked]
    return Chunk(indices, [obj.key for obj in picked], [r[0] for r in regions], [r[1] for r in regions], [])
