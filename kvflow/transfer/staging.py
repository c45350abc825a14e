"""Staging through host memory, for KV caches a backend cannot read or write directly.

A :class:`StagingPool` is a fixed number of host *chunks* (pinned when the cache is on a device),
allocated once when the pool is made and reused by every transfer: a transfer that needs more
waits for a chunk (backpressure), it never allocates. A chunk holds up to ``capacity`` objects of
one unit (a whole block, or one layer of a block), laid out plane by plane, so that moving a batch
takes one batched copy per plane (``index_select`` out of the cache, ``index_copy_`` into it), not
one copy per block; an object is then a scatter-gather list of its planes' rows in the chunk.

- store: the copy stream waits for the engine's event (on the device), gathers the batch's blocks
  into the chunk, records an event; once it completed the cache's blocks are no longer read and
  the backend puts the chunk's objects; the chunk is released after the put.
- retrieve: the backend gets the objects into the chunk; the rows that arrived whole (HIT) are
  scattered into the cache on the copy stream and an event is recorded; the chunk is released once
  that event completed. A row that missed or failed is never scattered.

All copies are issued from kvflow's loop thread; on a device they are queued and their events are
polled, so the loop never waits for the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import anyio
import attrs
import torch

from kvflow.backends.base import ObjectRef
from kvflow.device import Device
from kvflow.errors import ConfigError
from kvflow.events import DeviceEvent
from kvflow.layout import KVLayout

__all__ = ["Chunk", "StagingPool", "UnitShape", "copying"]

#: The largest chunk; a pool of more bytes has more chunks (more batches move at once).
MAX_CHUNK_BYTES = 32 << 20


@attrs.frozen
class UnitShape:
    """How one unit's objects lie in a chunk: ``planes`` (indices into the layout's plane views),
    each plane's bytes per block, and how many objects a chunk holds."""

    planes: tuple[int, ...]
    sizes: tuple[int, ...]
    capacity: int

    @classmethod
    def of(cls, layout: KVLayout, layer: int | None, chunk_bytes: int) -> UnitShape:
        planes = tuple(layout.unit_planes(layer))
        sizes = tuple(layout.plane_views[p].size(1) for p in planes)
        return cls(planes, sizes, max(1, chunk_bytes // sum(sizes)))

    @property
    def nbytes(self) -> int:
        """Bytes of one object."""
        return sum(self.sizes)

    def regions(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Each plane's rows in ``chunk``: ``uint8 [capacity, size]``."""
        out, offset = [], 0
        for size in self.sizes:
            out.append(chunk[offset : offset + self.capacity * size].view(self.capacity, size))
            offset += self.capacity * size
        return out

    def objects(self, chunk: torch.Tensor, keys: Sequence[str]) -> list[ObjectRef]:
        """``keys[i]`` is row ``i`` of every plane region of ``chunk``."""
        bases = [r.data_ptr() for r in self.regions(chunk)]
        sizes = list(self.sizes)
        nbytes = self.nbytes
        return [
            ObjectRef(key, [b + i * s for b, s in zip(bases, sizes)], sizes, nbytes)
            for i, key in enumerate(keys)
        ]


@attrs.define(eq=False)
class Chunk:
    """A chunk taken from the pool, and the copy event that must complete before it is reused."""

    buffer: torch.Tensor
    copied: DeviceEvent | None = None


@attrs.define(eq=False)
class StagingPool:
    """Host chunks allocated once; :meth:`take` waits for a free one. Use from one event loop."""

    device: Device
    chunk_bytes: int
    _free: list[torch.Tensor] = attrs.field(factory=list)
    _returned: anyio.Event = attrs.field(factory=anyio.Event)
    allocations: int = 0  # chunks ever allocated: fixed at creation
    in_use: int = 0
    peak_in_use: int = 0

    @classmethod
    def create(cls, device: Device, total_bytes: int, unit_nbytes: int) -> StagingPool:
        """``total_bytes`` split in chunks of whole objects of ``unit_nbytes`` (the largest object),
        each of at most :data:`MAX_CHUNK_BYTES` (or one object), all alike: as full as that
        allows, or the fewest chunks that hold all the objects the bytes do, evened out, where
        those hold more (fewer chunks on a tie). Either leaves out less than one chunk's worth of
        objects (not always the fewest possible: 1122 objects of at most 59 a chunk fit whole in
        22 chunks of 51, which this does not search for)."""
        if total_bytes < unit_nbytes:
            raise ConfigError(
                f"staging_bytes={total_bytes} cannot hold one object of {unit_nbytes} bytes; raise it to at "
                f"least {unit_nbytes}"
            )
        objects = total_bytes // unit_nbytes
        most = max(1, MAX_CHUNK_BYTES // unit_nbytes)  # objects a chunk holds at most
        evened = objects // -(-objects // most)  # the fewest chunks, evened out
        # Evening out can leave more objects over than full chunks do (1122 objects, 59 a chunk:
        # 20 of 56 hold 1120, 19 of 59 hold 1121): take whichever holds more, fewer chunks on a tie.
        per_chunk = max((evened, most), key=lambda per: (objects // per * per, per))
        count = objects // per_chunk
        chunk_bytes = per_chunk * unit_nbytes
        pool = cls(device, chunk_bytes)
        for _ in range(count):
            pool._free.append(device.host_buffer(chunk_bytes))
            pool.allocations += 1
        return pool

    def buffers(self) -> list[torch.Tensor]:
        """Every chunk's memory (all free when the pool was just made): to register with a backend."""
        return list(self._free)

    def try_take(self) -> Chunk | None:
        if not self._free:
            return None
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return Chunk(self._free.pop())

    async def take(self) -> Chunk:
        """A free chunk; waits (the caller bounds the wait) while every chunk is in use."""
        while True:
            chunk = self.try_take()
            if chunk is not None:
                return chunk
            returned = self._returned
            await returned.wait()

    def give_back(self, chunk: Chunk) -> None:
        self.in_use -= 1
        self._free.append(chunk.buffer)
        self._returned.set()
        self._returned = anyio.Event()


@contextlib.contextmanager
def copying(device: Device, chunk: Chunk) -> Iterator[None]:
    """Issue the enclosed copies to or from ``chunk`` on the copy stream; ``chunk.copied`` is
    recorded after them, also when one raises: the copies queued before the error still run, so
    the chunk must not be reused before that event completed."""
    with device.on_copy_stream():
        try:
            yield
        finally:
            chunk.copied = device.record()


def gather(
    device: Device, layout: KVLayout, shape: UnitShape, chunk: Chunk, block_ids: Sequence[int]
) -> None:
    """Copy ``block_ids``' unit into the chunk's first rows, one batched copy per plane, on the
    copy stream; ``chunk.copied`` completes when they are done (:func:`copying`)."""
    with copying(device, chunk):
        index = device.index(list(block_ids))
        for plane, region in zip(shape.planes, shape.regions(chunk.buffer)):
            device.gather_rows(layout.plane_views[plane], index, region[: len(block_ids)])


def scatter(
    device: Device,
    layout: KVLayout,
    shape: UnitShape,
    chunk: Chunk,
    block_ids: Sequence[int],
    rows: Sequence[int],
) -> None:
    """Copy the chunk's ``rows`` into the cache blocks ``block_ids`` (``block_ids[j]`` gets row
    ``rows[j]``), one batched copy per plane, on the copy stream; ``chunk.copied`` completes when
    they are done (:func:`copying`)."""
    with copying(device, chunk):
        if rows:
            index = device.index(list(block_ids))
            dense = list(rows) == list(range(len(rows)))
            pick = None if dense else device.index(list(rows))
            count = len(rows) if dense else max(rows) + 1
            for plane, region in zip(shape.planes, shape.regions(chunk.buffer)):
                device.scatter_rows(layout.plane_views[plane], index, region[:count], pick)
