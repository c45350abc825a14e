"""In-process memory backend: a byte budget and LRU eviction.

Objects live in uninitialised ``torch.uint8`` buffers owned by the backend (a ``bytearray`` would
zero its memory first, which costs as much as the copy itself). Every method runs to completion on the
event loop without awaiting in the middle of its bookkeeping, so a reader never sees a torn object
and an eviction never races a copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import anyio.lowlevel
import attrs
import torch

from kvflow.backends.base import BackendCapabilities, BackendStats, GetStatus, ObjectRef, PutStatus
from kvflow.config import parse_size, parse_url_query
from kvflow.errors import ConfigError
from kvflow.regions import gather, scatter

__all__ = ["MemoryBackend", "MemoryConfig"]

_DEFAULT_CAPACITY = 4 << 30


@attrs.frozen
class MemoryConfig:
    """``memory://?capacity=4GiB``: an in-process store for one process."""

    capacity_bytes: int = attrs.field(default=_DEFAULT_CAPACITY)

    @capacity_bytes.validator
    def _check(self, _: attrs.Attribute[int], value: int) -> None:
        if value <= 0:
            raise ConfigError(f"memory backend capacity must be > 0 bytes, got {value}")

    @classmethod
    def from_url(cls, url: str) -> MemoryConfig:
        params = parse_url_query(url, scheme="memory", allowed={"capacity"})
        if "capacity" in params:
            return cls(parse_size(params["capacity"]))
        return cls()


@attrs.define
class MemoryBackend:
    """An in-process object store. Use it from one event loop only."""

    config: MemoryConfig = attrs.field(factory=MemoryConfig)
    _objects: OrderedDict[str, torch.Tensor] = attrs.field(factory=OrderedDict, init=False)
    _stats: BackendStats = attrs.field(init=False)
    _closed: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self._stats = BackendStats(capacity_bytes=self.config.capacity_bytes)

    @classmethod
    def from_url(cls, url: str) -> MemoryBackend:
        return cls(MemoryConfig.from_url(url))

    @property
    def max_batch(self) -> int:
        return 64

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities()

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Nothing to register: copies go straight through ``memmove``."""

    def stats(self) -> BackendStats:
        return self._stats

    def stored_keys(self) -> list[str]:
        """Every stored key, least recently used first (for tests and tools)."""
        return list(self._objects)

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        self._check_open()
        results = [self._put_one(obj) for obj in objects]
        self._stats.count_puts(objects, results)
        await anyio.lowlevel.checkpoint()
        return results

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        self._check_open()
        results = [self._get_one(obj) for obj in objects]
        self._stats.count_gets(objects, results)
        await anyio.lowlevel.checkpoint()
        return results

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        objects = self._objects
        return [key in objects for key in keys]

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        removed = []
        for key in keys:
            buf = self._objects.pop(key, None)
            if buf is not None:
                self._stats.used_bytes -= buf.numel()
            removed.append(buf is not None)
        return removed

    async def aclose(self) -> None:
        self._closed = True
        self._objects.clear()
        self._stats.used_bytes = 0

    def _check_open(self) -> None:
        if self._closed:
            from kvflow.errors import PoolClosedError

            raise PoolClosedError("the memory backend was closed; open a new one")

    def _put_one(self, obj: ObjectRef) -> PutStatus:
        objects = self._objects
        if obj.key in objects:
            objects.move_to_end(obj.key)
            return PutStatus.PRESENT
        if obj.nbytes > self.config.capacity_bytes:
            return PutStatus.NO_SPACE
        recycled: torch.Tensor | None = None
        while self._stats.used_bytes + obj.nbytes > self.config.capacity_bytes:
            _, evicted = objects.popitem(last=False)
            self._stats.used_bytes -= evicted.numel()
            self._stats.evictions += 1
            if evicted.numel() == obj.nbytes:
                recycled = evicted  # reuse its pages: a fresh buffer costs a page fault per 4 KiB
        buf = recycled if recycled is not None else torch.empty(obj.nbytes, dtype=torch.uint8)
        if obj.nbytes:
            gather(buf.data_ptr(), obj.addrs, obj.sizes)
        objects[obj.key] = buf
        self._stats.used_bytes += obj.nbytes
        return PutStatus.STORED

    def _get_one(self, obj: ObjectRef) -> GetStatus:
        buf = self._objects.get(obj.key)
        if buf is None:
            return GetStatus.MISS
        if buf.numel() != obj.nbytes:
            return GetStatus.FAILED
        self._objects.move_to_end(obj.key)
        if obj.nbytes:
            scatter(buf.data_ptr(), obj.addrs, obj.sizes)
        return GetStatus.HIT
