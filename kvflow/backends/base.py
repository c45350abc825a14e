"""The backend protocol: batched, async moves of whole objects described by region lists.

A backend stores objects under string keys. An object is the concatenation of a list of memory
regions ``(address, nbytes)``: the pool hands the backend the addresses of the engine's KV memory and
the backend copies straight from (put) or into (get) them. Every batched call returns one result per
key, in input order. A miss is a result, not an exception.

Backends are used from one event loop (the pool's). They may run blocking calls that release the GIL
off the loop with ``anyio.to_thread.run_sync`` and a bounded ``CapacityLimiter``; no other threads.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol, overload, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from kvflow.errors import BackendUnavailableError

__all__ = [
    "Backend",
    "BackendCapabilities",
    "BackendStats",
    "GetStatus",
    "ObjectBatch",
    "ObjectRef",
    "PutStatus",
    "Touching",
    "keys_of",
    "nbytes_of",
    "repeats_of",
    "some_of",
    "takes_config",
]


class PutStatus(enum.Enum):
    """What happened to one object of a put batch."""

    STORED = "stored"
    PRESENT = "present"  # the key already held an object; nothing was written
    NO_SPACE = "no_space"  # the backend is full; nothing was written
    FAILED = "failed"  # an error; nothing readable was written

    def repeated(self) -> PutStatus:
        """The status of a later copy of a key put twice in one call, copied once, when this is
        the first copy's: PRESENT once that one is in the store, else its NO_SPACE or FAILED."""
        return PutStatus.PRESENT if self in (PutStatus.STORED, PutStatus.PRESENT) else self


def repeats_of(names: Sequence[Hashable]) -> dict[int, int]:
    """The positions whose name an earlier position has, each with the first of that name
    (``{repeat: first}``; empty, and cheap, when every name is new): a key put twice in one call
    is copied once, and its repeats take the first copy's outcome (:meth:`PutStatus.repeated`)."""
    if len(set(names)) == len(names):
        return {}
    first: dict[Hashable, int] = {}
    return {i: f for i, name in enumerate(names) if (f := first.setdefault(name, i)) != i}


class GetStatus(enum.Enum):
    """What happened to one object of a get batch."""

    HIT = "hit"  # every region was filled with the object's bytes
    MISS = "miss"  # no whole object for this key; the regions do not hold it (a backend may have
    # written them before detecting damage, so a MISS never promises they are untouched)
    FAILED = "failed"  # an error; the regions may hold partial data and must not be used


@attrs.frozen(slots=True)
class ObjectRef:
    """One object: a key and the memory regions whose concatenation is its value.

    ``addrs[i]`` and ``sizes[i]`` describe region ``i``; ``nbytes`` is their sum. The memory
    belongs to the caller and must stay valid until the backend call that received this reference
    returns. Build one with :meth:`of`, which checks it; the transfer layer builds many per call
    from a layout it checked once, and uses the plain constructor.
    """

    key: str
    addrs: Sequence[int]
    sizes: Sequence[int]
    nbytes: int

    @classmethod
    def of(cls, key: str, addrs: Sequence[int], sizes: Sequence[int]) -> ObjectRef:
        """A checked reference: as many addresses as sizes, no size below 0."""
        if len(addrs) != len(sizes):
            raise ValueError(f"{len(addrs)} addresses but {len(sizes)} sizes for key {key!r}")
        if any(s < 0 for s in sizes):
            raise ValueError(f"region sizes must be >= 0, got {list(sizes)} for key {key!r}")
        return cls(key, addrs, sizes, sum(sizes))


@attrs.frozen(eq=False)  # compared by identity: its address column is an array
class ObjectBatch(Sequence[ObjectRef]):
    """Objects of one shape, by column: ``keys[i]``'s regions start at the addresses ``addrs[i]``
    (one ``int64`` row per object) and have the sizes ``sizes``, ``nbytes`` in all.

    A put or get may receive one instead of a list (the transfer layer sends the objects of engine
    blocks this way). It is a sequence of :class:`ObjectRef` for code that takes objects one by
    one; a backend that copies in-process reads its columns instead, and copies the whole batch in
    one native call (:func:`kvflow.backends.copies.gather_objects`), with no Python per region.
    """

    keys: Sequence[str]
    addrs: npt.NDArray[np.int64]
    sizes: Sequence[int]
    nbytes: int
    #: :attr:`sizes` as an array (:meth:`sizes_array`), made at the first ask and kept by slices
    _sizes_array: npt.NDArray[np.int64] | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.addrs.shape != (len(self.keys), len(self.sizes)):
            raise ValueError(
                f"addresses of shape {self.addrs.shape} for {len(self.keys)} keys of "
                f"{len(self.sizes)} regions"
            )
        given = self._sizes_array
        if given is not None:  # (checked as the array, in microseconds: thousands of regions)
            if (
                given.shape != (len(self.sizes),)
                or given.min(initial=0) < 0
                or int(given.sum()) != self.nbytes
            ):
                raise ValueError(
                    f"region sizes {given.tolist()[:8]}... do not agree with {len(self.sizes)} regions "
                    f"of {self.nbytes} bytes"
                )
            return
        if min(self.sizes, default=0) < 0:
            raise ValueError(f"region sizes must be >= 0, got {list(self.sizes)}")
        if self.nbytes != sum(self.sizes):
            raise ValueError(f"nbytes {self.nbytes} is not the sum of the region sizes {list(self.sizes)}")

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, index: int) -> ObjectRef: ...

    @overload
    def __getitem__(self, index: slice) -> ObjectBatch: ...

    def __getitem__(self, index: int | slice) -> ObjectRef | ObjectBatch:
        if isinstance(index, slice):
            return self.with_rows(self.keys[index], self.addrs[index])
        return ObjectRef(self.keys[index], self.addrs[index].tolist(), self.sizes, self.nbytes)

    def with_rows(self, keys: Sequence[str], addrs: npt.NDArray[np.int64]) -> ObjectBatch:
        """A batch of these objects' shape (its region sizes) for ``keys`` at ``addrs``."""
        return ObjectBatch(keys, addrs, self.sizes, self.nbytes, sizes_array=self._sizes_array)

    def sizes_array(self) -> npt.NDArray[np.int64]:
        """The region sizes as an ``int64`` array, made once (an object of another layout may have
        thousands of regions: :mod:`kvflow.transfer.direct`). Do not modify it."""
        if self._sizes_array is None:
            object.__setattr__(self, "_sizes_array", np.asarray(self.sizes, dtype=np.int64))
        assert self._sizes_array is not None
        return self._sizes_array

    def __iter__(self) -> Iterator[ObjectRef]:
        sizes, nbytes = self.sizes, self.nbytes
        return (ObjectRef(k, row, sizes, nbytes) for k, row in zip(self.keys, self.addrs.tolist()))


def stray_cancellation() -> bool:
    """Whether a ``CancelledError`` caught now was raised with no cancellation pending on this task:
    by the awaited code itself (a backend's client cancelling its own future when a connection
    dropped), not by a cancel scope. Always False before Python 3.11 (the two cannot be told apart
    by the task). Any task may ask, a caller's own included: unlike the loop thread's rule
    (:mod:`kvflow.loop`), it needs to know nothing of who else may cancel the task."""
    if sys.version_info < (3, 11):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class _CancelledAsFault:
    """:func:`cancelled_as_fault`'s context: it holds nothing, so one serves every call at once (a
    class, not a generator: from cold caches ``contextlib``'s machinery costs tens of microseconds
    around every backend call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None and issubclass(kind, asyncio.CancelledError) and stray_cancellation():
            raise BackendUnavailableError(
                "the backend cancelled its own call (a dropped connection?); check the store's connection"
            ) from None


_CANCELLED_AS_FAULT = _CancelledAsFault()


def cancelled_as_fault() -> _CancelledAsFault:
    """Around a backend call (``with cancelled_as_fault():``): a :func:`stray_cancellation`
    becomes a :class:`~kvflow.errors.BackendUnavailableError`, a store fault like any other. A
    real cancellation passes as it is."""
    return _CANCELLED_AS_FAULT


def keys_of(objects: Sequence[ObjectRef]) -> Sequence[str]:
    """The objects' keys, in order (an :class:`ObjectBatch`'s column, without an ObjectRef each)."""
    if isinstance(objects, ObjectBatch):
        return objects.keys
    return [obj.key for obj in objects]


def nbytes_of(objects: Sequence[ObjectRef]) -> Sequence[int]:
    """The objects' sizes in bytes, in order (for an :class:`ObjectBatch`, one size repeated)."""
    if isinstance(objects, ObjectBatch):
        return [objects.nbytes] * len(objects)
    return [obj.nbytes for obj in objects]


@overload
def some_of(objects: ObjectBatch, indices: Sequence[int]) -> ObjectBatch: ...


@overload
def some_of(objects: Sequence[ObjectRef], indices: Sequence[int]) -> Sequence[ObjectRef]: ...


def some_of(objects: Sequence[ObjectRef], indices: Sequence[int]) -> Sequence[ObjectRef]:
    """The objects at ``indices`` (increasing), in order; of an :class:`ObjectBatch`, a batch again."""
    if len(indices) == len(objects):  # every one, in order: indices only grow
        return objects
    if len(indices) > 0 and indices[-1] - indices[0] == len(indices) - 1:  # a run of them
        return objects[indices[0] : indices[-1] + 1]
    if isinstance(objects, ObjectBatch):
        keys = objects.keys
        return objects.with_rows([keys[i] for i in indices], objects.addrs[indices])
    return [objects[i] for i in indices]


@attrs.frozen
class BackendCapabilities:
    """What a backend can do beyond the protocol's minimum, so the transfer layer can choose a path.

    ``device_memory``: puts and gets read and write accelerator (CUDA/NPU) memory directly; without
    it, KV caches on a device go through pinned host staging buffers.
    ``ranged_reads``: a get may read part of an object (a byte range) instead of all of it.
    ``registers_memory``: :meth:`Backend.register_memory` really registers (pins, maps) the memory,
    so it must stay allocated until the backend closes; the pool keeps its own buffers (staging
    chunks) alive for as long as such a backend lives.
    ``max_object_bytes``: the largest object a put can store (None: no limit of its own); a pool
    whose objects are larger is refused when it is made.
    ``put_checks_present``: a put of a key the store holds answers ``PRESENT`` without copying the
    object, as cheaply as :meth:`Backend.exists` would have answered (an in-process table); a pool
    then stores whole blocks with one backend call instead of an ``exists`` call and a put. A store
    whose put moves the bytes before it can tell (a network store) leaves it False.
    ``calls_in_turn``: the backend's calls run on the pool's own thread (an in-process store) and
    gain nothing from running at once; the pool then makes the calls of one request one after
    another, its last objects first. So a request's first blocks are always its most recent use
    (least recently used eviction takes a prompt from its tail, whatever the number of calls), and
    a put of more than the store has room for keeps the request's head (each call keeps only what
    it stored itself). A store whose calls run in parallel elsewhere (a network store) leaves it
    False: the pool runs them at once, first objects first.
    ``min_region_bytes``: the shortest run of an object's bytes worth a region of its own, where
    the pool writes another split's or layout's objects straight into the cache
    (:mod:`kvflow.transfer.direct`; shorter runs go through a staging chunk and a second copy).
    None: kvflow's default, :data:`kvflow.transfer.direct.MIN_RUN_BYTES` (4 KiB), for a backend that
    pays for each region (an entry of a transport's request, a buffer of a system call). The
    in-process stores' compiled copy loop streams regions of 256 bytes at memcpy's speed.
    """

    device_memory: bool = False
    ranged_reads: bool = False
    registers_memory: bool = False
    max_object_bytes: int | None = None
    put_checks_present: bool = False
    calls_in_turn: bool = False
    min_region_bytes: int | None = None


@attrs.define
class BackendStats:
    """Counters a backend keeps; read them from the pool's loop."""

    puts: int = 0
    put_bytes: int = 0
    present: int = 0
    no_space: int = 0
    put_failures: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    get_failures: int = 0
    evictions: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0

    def count_puts(self, objects: Sequence[ObjectRef], results: Sequence[PutStatus]) -> None:
        stored, present = results.count(PutStatus.STORED), results.count(PutStatus.PRESENT)
        no_space = results.count(PutStatus.NO_SPACE)
        self.puts += stored
        self.put_bytes += _bytes_where(objects, results, PutStatus.STORED, stored)
        self.present += present
        self.no_space += no_space
        self.put_failures += len(results) - stored - present - no_space

    def count_gets(self, objects: Sequence[ObjectRef], results: Sequence[GetStatus]) -> None:
        hits, misses = results.count(GetStatus.HIT), results.count(GetStatus.MISS)
        self.hits += hits
        self.hit_bytes += _bytes_where(objects, results, GetStatus.HIT, hits)
        self.misses += misses
        self.get_failures += len(results) - hits - misses


def _bytes_where(
    objects: Sequence[ObjectRef], results: Sequence[PutStatus | GetStatus], status: object, count: int
) -> int:
    """The bytes of the objects whose result is ``status`` (``count`` of them), without a step per
    object where every object counts or all are one size."""
    if count == 0:
        return 0
    if isinstance(objects, ObjectBatch):
        return objects.nbytes * count
    if count == len(results):
        return sum(obj.nbytes for obj in objects)
    return sum(obj.nbytes for obj, result in zip(objects, results) if result is status)


@runtime_checkable
class Backend(Protocol):
    """What the pool needs from a store. Call every method from the pool's event loop.

    ``put`` never overwrites: a key that exists is reported ``PRESENT``; a key a call names twice
    is stored once, and the later copy reads ``PRESENT`` only once the first is in the store
    (:meth:`PutStatus.repeated`). ``get`` never returns a torn
    or partial object as a ``HIT``, and fills every object it reports ``HIT``, also when a call
    names a key more than once (a load of several requests sharing a prefix). ``exists`` raises
    :class:`kvflow.errors.BackendError` (usually :class:`~kvflow.errors.BackendUnavailableError`)
    when it cannot answer; ``put`` and ``get`` report per-key ``FAILED`` results instead of raising
    for failures of the store itself. ``aclose`` starts no further call and returns only once no
    put or get still reads or writes the caller's memory (:mod:`kvflow.backends.inflight`).
    """

    @property
    def max_batch(self) -> int:
        """Largest number of objects the pool passes to one ``put`` or ``get`` (a positive
        integer). ``exists`` and ``remove`` get a request's keys in one call, whatever their count."""
        ...

    @property
    def capabilities(self) -> BackendCapabilities:
        """What this backend can do (device memory, ranged reads)."""
        ...

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]: ...

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]: ...

    async def exists(self, keys: Sequence[str]) -> list[bool]: ...

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete objects; True where one was removed (False: there was none). Raises
        :class:`~kvflow.errors.BackendError` when the store cannot be reached."""
        ...

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Announce engine memory that later puts and gets will use (zero-copy registration)."""
        ...

    def stats(self) -> BackendStats: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Touching(Protocol):
    """A backend that can mark objects used without reading them (optional: memory, local and
    arena have it). After storing a later chunk of a prompt, the pool touches the blocks before
    it, so that they stay newer than it and eviction takes the prompt from its tail
    (docs/architecture.md)."""

    async def touch(self, keys: Sequence[str]) -> None:
        """Mark the objects of ``keys`` used now, the first the most recently (as a get's order
        does; a key named twice at its first place); keys the store does not hold are passed over. Raises
        :class:`~kvflow.errors.BackendError` when the store cannot be reached."""
        ...


def takes_config(kind: type[Any], url: str) -> Callable[[Any, Any, Any], None]:
    """An attrs validator of a backend's ``config`` field: TypeError, saying what to give, for
    anything but a ``kind`` (``url``: an example of the backend's URL)."""

    def check(backend: Any, _: Any, value: Any) -> None:
        if not isinstance(value, kind):
            name = type(backend).__name__
            raise TypeError(
                f"{name} is made from its config, {name}({kind.__name__}(...)), or opened by URL, "
                f"kvflow.backends.open_backend({url!r}); got {type(value).__name__}"
            )

    return check
