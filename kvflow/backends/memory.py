"""In-process memory backend: a byte budget and LRU eviction.

Objects live in uninitialised ``torch.uint8`` buffers owned by the backend (a ``bytearray`` would
zero its memory first, which costs as much as the copy itself). Copies run on the event loop, and a
call lets the loop run (a checkpoint) once it has held it for half a millisecond while other work
waits to run, or 2 ms when none does (:mod:`kvflow.backends.pacing`), so no call keeps waiting work
from the loop much longer than a millisecond. Objects of up to a run's bytes (4 MiB,
:func:`~kvflow.backends.pacing.whole_bytes`) are copied a run at a time (up to 4 MiB in all,
:data:`~kvflow.backends.pacing.RUN_BYTES`), each run by one native copy call, the loop let run
between runs (most KV objects are this size, and a coroutine, or a ``memmove`` call per region,
cost more than their copy); a larger object is copied alone, in pieces of that size, the loop let
run between pieces, as the arena backend's puts do. A batch by column
(:class:`~kvflow.backends.base.ObjectBatch`, what the transfer layer sends) of such objects and
distinct new keys is handled in one pass: a put copies its runs
(:func:`kvflow.backends.copies.copy_in_runs`), making room for each as it comes, and publishes them
together at its end; a get whose keys are all held pins their buffers and copies its runs. Every
other call (a list of objects, a key twice or held, a get with a miss) goes run by run:
each run looked up, reserved, copied and published between two checkpoints, so that it needs
neither a reservation held across a pause nor a pin. (The one pass saves each run's Python, which
from cold caches cost 0.6-0.9 us an object of 64 KiB: docs/benchmarks.md, sixteenth stop.)

What stays true across the checkpoints (in a larger object's copy, or between a batch's runs):

- A put copies into a buffer nobody else can see and publishes it only when the copy is complete:
  a reader never sees a torn object. Two puts of one key may both copy; the first to publish wins,
  the other reports ``PRESENT``. A put cancelled or failed while copying publishes nothing more
  and gives back the room it reserved.
- A get pins the buffer it reads; eviction never picks a pinned buffer, so a buffer is never
  recycled (or removed from the budget) while a get is still reading it. ``remove`` and ``aclose``
  drop a pinned buffer from the store at once; the get keeps its reference and finishes reading.
- ``used_bytes`` is the bytes of published objects plus those of puts still copying (reserved
  before their copy starts); every other counter moves once per object, when its result is known.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeGuard, TypeVar, cast

import anyio.lowlevel
import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvflow import regions
from kvflow.backends.base import (
    BackendCapabilities,
    BackendStats,
    GetStatus,
    ObjectBatch,
    ObjectRef,
    PutStatus,
    keys_of,
    nbytes_of,
    repeats_of,
    some_of,
    takes_config,
)
from kvflow.backends.copies import (
    SHORT_REGION_BYTES,
    at,
    check_object,
    checked_object,
    copy_in_pieces,
    copy_in_runs,
    gather_objects,
    regions_of,
    scatter_objects,
)
from kvflow.backends.inflight import Lifetime
from kvflow.backends.pacing import Pacer, run_end, whole_bytes
from kvflow.config import parse_size, parse_url_query, split_url
from kvflow.errors import ConfigError

__all__ = ["MemoryBackend", "MemoryConfig"]

R = TypeVar("R")

_DEFAULT_CAPACITY = 4 << 30


@attrs.frozen
class MemoryConfig:
    """``memory://?capacity=4GiB``: an in-process store for one process."""

    capacity_bytes: int = attrs.field(default=_DEFAULT_CAPACITY)

    @capacity_bytes.validator
    def _check(self, _: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"memory backend capacity must be an integer > 0 bytes, got {value!r}")

    @classmethod
    def from_url(cls, url: str) -> MemoryConfig:
        params = parse_url_query(url, scheme="memory", allowed={"capacity"})
        parts = split_url(url)
        if parts.netloc or parts.path or parts.fragment:
            raise ConfigError(
                f"{url!r}: the memory backend lives in this process and takes no host, path or "
                "fragment; write memory:// or memory://?capacity=4GiB"
            )
        if "capacity" in params:
            return cls(parse_size(params["capacity"]))
        return cls()


@attrs.define(eq=False)
class _Entry:
    """An object's buffer (its address and size kept as ints: a copy reads them without a call
    into torch), how many gets are reading it (pinned while > 0), and the last put that stored it
    or found it present (``put``, a number per put call: a put never evicts its own). An entry
    evicted to make room for a put is given, whole, to an object of its size in that put."""

    buf: torch.Tensor
    addr: int
    nbytes: int
    readers: int = 0
    put: int = 0

    @classmethod
    def new(cls, nbytes: int) -> _Entry:
        """A fresh, uninitialised buffer of ``nbytes``."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return cls(buf, buf.data_ptr(), nbytes)


@attrs.define
class MemoryBackend:
    """An in-process object store. Use it from one event loop only."""

    config: MemoryConfig = attrs.field(
        factory=MemoryConfig, validator=takes_config(MemoryConfig, "memory://?capacity=4GiB")
    )
    _objects: OrderedDict[str, _Entry] = attrs.field(factory=OrderedDict, init=False)
    _stats: BackendStats = attrs.field(init=False)
    _life: Lifetime = attrs.field(init=False)  # the puts and gets running
    _puts: int = attrs.field(default=0, init=False)  # put calls made: each stamps what it stores

    def __attrs_post_init__(self) -> None:
        self._stats = BackendStats(capacity_bytes=self.config.capacity_bytes)
        self._life = Lifetime("the memory backend was closed; open a new one")
        regions.warm()  # the copy loops, loaded now rather than at the first put on the event loop

    @classmethod
    def from_url(cls, url: str) -> MemoryBackend:
        return cls(MemoryConfig.from_url(url))

    @property
    def max_batch(self) -> int:
        """Objects per call: a request of up to 256 blocks is one call, run inline (calls of 64
        ran concurrently in a task group, 12-13% of a 256-block call of 64 KiB objects); the call
        paces itself, so a larger one holds the loop no longer."""
        return 256

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            put_checks_present=True, calls_in_turn=True, min_region_bytes=SHORT_REGION_BYTES
        )

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Nothing to register: copies go straight between the caller's memory and the buffers."""

    def stats(self) -> BackendStats:
        return self._stats

    def stored_keys(self) -> list[str]:
        """Every stored key, least recently used first (for tests and tools)."""
        return list(self._objects)

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        self._puts += 1
        call = self._puts
        if _whole_runs(objects) and self._all_new(objects.keys):
            return await self._put_batch(objects, call)
        return await self._each(
            objects,
            functools.partial(self._put_section, call=call),
            functools.partial(self._put_one, call=call),
            self._stats.count_puts,
        )

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if _whole_runs(objects):
            results = await self._get_batch(objects)
            if results is not None:
                return results
        return await self._each(objects, self._get_section, self._get_one, self._stats.count_gets)

    def _all_new(self, keys: Sequence[str]) -> bool:
        """Whether ``keys`` are distinct and none is held. (A put that finds a key present goes run
        by run, each run's present keys a use as it comes to them: a key found present later in a
        put larger than the room left must not keep out a new object before it, nor be evicted by
        another put while this one pauses.)"""
        return len(set(keys)) == len(keys) and self._objects.keys().isdisjoint(keys)

    async def _put_batch(self, batch: ObjectBatch, call: int) -> list[PutStatus]:
        """A put (of put ``call``) of a batch of distinct new keys whose objects are each copied
        whole: their objects are copied in runs, the loop let run between them, room made for
        each run as it comes (so that no run's evictions and allocations hold the loop longer than
        the general path's; the first object that does not fit ends the copy, it and the rest
        ``NO_SPACE``), then published together (:meth:`_publish`). A call that fails or is
        cancelled while copying publishes nothing and gives back the room it reserved."""
        keys, nbytes = batch.keys, batch.nbytes
        entries: list[_Entry] = []

        def room(start: int, end: int) -> npt.NDArray[np.int64]:
            if self._life.closed:  # closed while the loop ran: nothing more is reserved
                return np.empty(0, dtype=np.int64)
            reserved = self._reserve_same(nbytes, end - start, call)
            run = cast("list[_Entry]", reserved[: len(reserved) - reserved.count(None)])
            entries.extend(run)
            return np.fromiter((entry.addr for entry in run), dtype=np.int64, count=len(run))

        with self._life.call(copies=True):
            try:
                paused = await copy_in_runs(batch, room, into_regions=False)
            except BaseException:
                if not self._life.closed:
                    self._stats.used_bytes -= len(entries) * nbytes
                raise
            raced = paused and not self._objects.keys().isdisjoint(keys)  # (distinct: known already)
            results = self._publish(keys, entries, call, raced=raced)
            self._stats.count_puts(batch, results)
        await anyio.lowlevel.checkpoint()
        return results

    def _publish(
        self, keys: Sequence[str], entries: Sequence[_Entry], call: int, *, raced: bool
    ) -> list[PutStatus]:
        """Publish the copied ``entries`` of the first objects of a put (of put ``call``; the rest:
        no room), the first key the most recently used. ``raced``: another put published some of
        the keys while this one copied (a use: ``PRESENT``, and this copy dropped). Once closed,
        nothing is stored: every object ``FAILED``."""
        stored = self._objects
        if self._life.closed:  # (the close clears the store and its count once this call ends)
            return [PutStatus.FAILED] * len(keys)
        if not raced and len(entries) == len(keys):  # the usual call
            stored.update(zip(reversed(keys), reversed(entries)))
            return [PutStatus.STORED] * len(keys)
        results = [PutStatus.NO_SPACE] * len(keys)
        for i, (key, entry) in enumerate(zip(keys, entries)):
            if key in stored:
                results[i] = PutStatus.PRESENT
                stored[key].put = call
                self._stats.used_bytes -= entry.nbytes
            else:
                results[i] = PutStatus.STORED
                stored[key] = entry
        self._newest_first(keys, results)
        return results

    async def _get_batch(self, batch: ObjectBatch) -> list[GetStatus] | None:
        """A get of a batch of objects each copied whole, when every key is held at its
        size (else None, and nothing done: :meth:`_each` sorts the misses out). Each is a use now,
        the first key the most recently used, and again at the end if another task used a key
        while this one paused; their buffers are pinned while they are copied in runs, the loop let
        run between them. A call cancelled part-way counts the objects it copied."""
        keys, nbytes = batch.keys, batch.nbytes
        with self._life.call(copies=True):
            stored = self._objects
            entries = [stored.get(key) for key in keys]
            starts = [0 if e is None or e.nbytes != nbytes else e.addr for e in entries]
            if 0 in starts:  # (a buffer's address is never 0)
                return None
            pinned = cast("list[_Entry]", entries)
            use = stored.move_to_end
            for key in reversed(keys):
                use(key)
            for entry in pinned:
                entry.readers += 1
            copied = 0

            def done(_: int, end: int) -> None:
                nonlocal copied
                copied = end

            try:
                paused = await copy_in_runs(
                    batch, at(np.asarray(starts, dtype=np.int64)), into_regions=True, after_run=done
                )
            finally:
                for entry in pinned:
                    entry.readers -= 1
                self._stats.count_gets(
                    batch if copied == len(keys) else batch[:copied], [GetStatus.HIT] * copied
                )
            if paused and next(reversed(stored), None) != keys[0]:  # another use came after it
                self._newest_first(keys, [GetStatus.HIT] * len(keys))
            results = [GetStatus.HIT] * len(keys)
        await anyio.lowlevel.checkpoint()
        return results

    async def _each(
        self,
        objects: Sequence[ObjectRef],
        section: Callable[[Sequence[ObjectRef], Sequence[str], Sequence[int]], list[R]],
        paced: Callable[[Sequence[ObjectRef], int, Pacer], Awaitable[R]],
        count: Callable[[Sequence[ObjectRef], Sequence[R]], None],
    ) -> list[R]:
        """The objects in turn: a run from an object copied whole (at most
        :func:`~kvflow.backends.pacing.whole_bytes`), of at most
        :data:`~kvflow.backends.pacing.RUN_BYTES` in all, by ``section`` (one copy call, no
        checkpoint inside, so nothing can change under it), an object starting larger by ``paced``;
        the loop runs between them once it has been held long enough. ``count`` the results of
        those that ran (even when the call is cancelled part-way)."""
        with self._life.call(copies=True):
            keys, sizes = keys_of(objects), nbytes_of(objects)
            uniform = isinstance(objects, ObjectBatch)
            results: list[R] = []
            pacer, whole = Pacer(), whole_bytes()
            try:
                start = 0
                while start < len(sizes):
                    if pacer.due():
                        await pacer.pause()
                    if sizes[start] > whole:
                        results.append(await paced(objects, start, pacer))
                        start += 1
                    else:
                        end = run_end(sizes, start, uniform=uniform)
                        results += section(objects[start:end], keys[start:end], sizes[start:end])
                        start = end
            finally:
                count(objects[: len(results)], results)
                self._newest_first(keys, results)
            await anyio.lowlevel.checkpoint()
            return results

    def _newest_first(self, keys: Sequence[str], results: Sequence[object]) -> None:
        """Make the call's first keys that it stored, found present or read its most recently used
        (a request's blocks come in order, and a block is useful only with those before it: a
        later eviction takes the last blocks of a prompt first, not its head, which would leave the
        rest unreachable), as the local and arena backends stamp them; ``results``: those of the
        objects that ran, first. (Each run also uses its keys as it goes, in order, so that a later
        run's evictions, or a put beside a paused call, take neither a key it found present nor one
        it read. A put never evicts what it stored or found present itself: one larger than the
        store keeps its first objects and answers ``NO_SPACE`` for the rest.)"""
        stored = self._objects
        use = stored.move_to_end
        for i in range(len(results) - 1, -1, -1):
            if results[i] in _USED and keys[i] in stored:
                use(keys[i])

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self._life.check_open()
        objects = self._objects
        return [key in objects for key in keys]

    async def touch(self, keys: Sequence[str]) -> None:
        """Mark the objects of ``keys`` used now, the first the most recently; keys not held are
        passed over (:class:`~kvflow.backends.base.Touching`)."""
        self._life.check_open()
        stored = self._objects
        use = stored.move_to_end
        for key in reversed(keys):
            if key in stored:
                use(key)

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        self._life.check_open()
        removed = []
        for key in keys:
            entry = self._objects.pop(key, None)
            if entry is not None:
                self._stats.used_bytes -= entry.nbytes
            removed.append(entry is not None)
        return removed

    async def aclose(self) -> None:
        """Drop every object; return once no put or get still copies (nothing more is published)."""
        await self._life.close()
        self._objects.clear()
        self._stats.used_bytes = 0

    def _room(self, key: str, nbytes: int, call: int) -> _Entry | PutStatus:
        """A reserved entry for put ``call`` of ``nbytes`` under ``key``; PRESENT (a use, for LRU)
        or NO_SPACE instead."""
        present = self._objects.get(key)
        if present is not None:
            self._objects.move_to_end(key)
            present.put = call
            return PutStatus.PRESENT
        entry = self._reserve([nbytes], call)[0]
        return PutStatus.NO_SPACE if entry is None else entry

    def _put_section(
        self, objects: Sequence[ObjectRef], keys: Sequence[str], sizes: Sequence[int], *, call: int
    ) -> list[PutStatus]:
        """Puts (of put ``call``) of objects copied in one call, without a checkpoint: those not
        yet stored reserved together (a key twice: its first copy only), all copied, each
        published (the second copy of a key is PRESENT, or the first's NO_SPACE). Each step runs
        over the whole run at once, not as a call per object, and the usual run (every key new
        and distinct, every object fitting) is published with one update of the index. A run in
        which a held key comes after a new one goes object by object (:meth:`_put_in_turn`).
        Once closed: nothing."""
        if self._life.closed:  # a put that was running when aclose began: nothing more is stored
            return [PutStatus.FAILED] * len(keys)
        stored = self._objects
        repeats = repeats_of(keys)  # a key twice in the run: copied once (cheap when none is)
        new = [i for i, key in enumerate(keys) if key not in stored and i not in repeats]
        every = len(new) == len(keys)
        if new and not every:  # a held key after the first new one? (the new ones all at the end: no)
            tail = len(keys) - new[0]
            if (repeats or len(new) != tail) and any(key in stored for key in keys[new[0] + 1 :]):
                return self._put_in_turn(objects, keys, sizes, call=call)
        if not every:
            for key in keys:
                present = stored.get(key)
                if present is not None:
                    stored.move_to_end(key)  # a use, for LRU, before anything is evicted for the rest
                    present.put = call  # (and this put's: it evicts others first)
        reserved = self._reserve(sizes if every else [sizes[i] for i in new], call)
        entries = [entry for entry in reserved if entry is not None]
        fits = len(entries) == len(new)
        room = new if fits else [i for i, entry in zip(new, reserved) if entry is not None]
        try:
            gather_objects([entry.addr for entry in entries], some_of(objects, room))
        except BaseException:
            self._stats.used_bytes -= sum(sizes[i] for i in room)
            raise
        if every and fits:  # the usual run: one update of the index
            stored.update(zip(keys, entries))
            return [PutStatus.STORED] * len(keys)
        results = [PutStatus.PRESENT] * len(keys)
        for i, entry in zip(new, reserved):
            results[i] = PutStatus.NO_SPACE if entry is None else PutStatus.STORED
        for i, entry in zip(room, entries):
            stored[keys[i]] = entry
        for i, first in repeats.items():  # after its first copy: PRESENT, or the first's failure
            results[i] = results[first].repeated()
        return results

    def _put_in_turn(
        self, objects: Sequence[ObjectRef], keys: Sequence[str], sizes: Sequence[int], *, call: int
    ) -> list[PutStatus]:
        """:meth:`_put_section` of a run in which a held key comes after a new one: each object in
        turn, as a put of it alone would go but that it never evicts what this put stored or found
        present (:meth:`_newest_first`). A held key is a use only once reached, so the room
        the new objects before it need may evict it (it then answers ``NO_SPACE`` if none is left):
        a put keeps its first objects. (Marked used before them, as :meth:`_put_section` marks
        the held keys of a run, it kept them out in a full store: a prompt's head refused for a
        block that is no use without it.)"""
        for obj in objects:  # (first: a refused object stops the run before anything changed)
            check_object(obj)
        stored, results = self._objects, []
        try:
            for obj, key, nbytes in zip(objects, keys, sizes):
                entry = self._room(key, nbytes, call)
                if isinstance(entry, PutStatus):
                    results.append(entry)
                    continue
                try:
                    gather_objects([entry.addr], [obj])
                except BaseException:  # nothing of it published: its room given back
                    self._stats.used_bytes -= nbytes
                    raise
                stored[key] = entry
                results.append(PutStatus.STORED)
        except BaseException:  # (a copy or an allocation failed) those done are stored: counted
            self._stats.count_puts(objects[: len(results)], results)  # here, the caller counts none
            raise
        return results

    async def _put_one(self, batch: Sequence[ObjectRef], index: int, pacer: Pacer, *, call: int) -> PutStatus:
        """A put (of put ``call``) of object ``index`` of ``batch``, too large to copy whole:
        reserved, copied with checkpoints, published."""
        key, nbytes = checked_object(batch, index)
        objects = self._objects
        entry = self._room(key, nbytes, call)
        if isinstance(entry, PutStatus):
            return entry
        published = False
        try:
            addrs, sizes = regions_of(batch, index)
            await copy_in_pieces(entry.addr, addrs, sizes, pacer, into_buffer=True, piece_bytes=whole_bytes())
            if self._life.closed:
                return PutStatus.FAILED
            present = objects.get(key)
            if present is not None:  # another put published it while this one copied: a use
                objects.move_to_end(key)
                present.put = call
                return PutStatus.PRESENT
            objects[key] = entry
            published = True
            return PutStatus.STORED
        finally:
            if not published and not self._life.closed:
                self._stats.used_bytes -= nbytes

    def _reserve(self, sizes: Sequence[int], call: int) -> list[_Entry | None]:
        """Make room for objects of ``sizes`` that put ``call`` stores and count those that fit
        as used: each object in turn fits if the room left, counting what can be evicted, holds
        it; only as many objects are evicted as those that fit need (:meth:`_evictable`).

        Returns an entry per size, in order, stamped with ``call``: a recycled victim where one of
        that size was evicted for this call, the oldest first (its pages are faulted in already: a
        fresh buffer costs a page fault per 4 KiB), else a fresh buffer; None for an object that
        cannot fit (too large, or the rest of the budget is pinned, being written, or this put's).
        """
        capacity, stats = self.config.capacity_bytes, self._stats
        if not sizes:
            return []
        if sizes.count(sizes[0]) == len(sizes):  # one size (a batch's): counted, not walked
            return self._reserve_same(sizes[0], len(sizes), call)
        candidates = self._evictable(
            stats.used_bytes + sum(n for n in sizes if n <= capacity) - capacity, call
        )
        room = capacity - stats.used_bytes + sum(entry.nbytes for _, entry in candidates)
        fits, taken = [], 0
        for nbytes in sizes:
            fits.append(taken + nbytes <= room)
            taken += nbytes if fits[-1] else 0
        victims = self._evict(candidates, stats.used_bytes + taken - capacity)
        spare: dict[int, list[_Entry]] = {}
        for victim in reversed(victims):  # popped from the end: the oldest first, as they were stored
            spare.setdefault(victim.nbytes, []).append(victim)
        entries: list[_Entry | None] = []
        try:
            for nbytes, fit in zip(sizes, fits):
                if not fit:
                    entries.append(None)
                    continue
                recycled = spare.get(nbytes)
                entry = recycled.pop() if recycled else _Entry.new(nbytes)
                entry.put = call
                entries.append(entry)
                stats.used_bytes += nbytes  # counted once allocated: a failed allocation reserves nothing
        except BaseException:
            stats.used_bytes -= sum(entry.nbytes for entry in entries if entry is not None)
            raise
        return entries

    def _reserve_same(self, nbytes: int, count: int, call: int) -> list[_Entry | None]:
        """:meth:`_reserve` of ``count`` objects of ``nbytes`` each: the first that fit get
        entries, the rest None."""
        capacity, stats = self.config.capacity_bytes, self._stats
        if nbytes > capacity:
            return [None] * count
        candidates = self._evictable(stats.used_bytes + count * nbytes - capacity, call)
        room = capacity - stats.used_bytes + sum(entry.nbytes for _, entry in candidates)
        fit = min(count, room // nbytes) if nbytes else count
        victims = self._evict(candidates, stats.used_bytes + fit * nbytes - capacity)
        recycled = [victim for victim in victims if victim.nbytes == nbytes][:fit]
        entries = [*recycled, *(_Entry.new(nbytes) for _ in range(fit - len(recycled)))]
        for entry in entries:
            entry.put = call
        stats.used_bytes += fit * nbytes  # counted once allocated: a failed allocation reserves nothing
        return [*entries, *([None] * (count - fit))]

    def _evictable(self, excess: int, call: int) -> list[tuple[str, _Entry]]:
        """The objects that may be evicted to free ``excess`` bytes, least recently used first,
        until they free that much or none is left: neither pinned (a get reads them) nor stored or
        found present by put ``call`` (the one making room: a put never evicts its own, which
        would give a prompt's head for its tail). Nothing is evicted yet."""
        found: list[tuple[str, _Entry]] = []
        freed = 0
        if excess <= 0:
            return found
        for key, entry in self._objects.items():
            if entry.readers or entry.put == call:
                continue
            found.append((key, entry))
            freed += entry.nbytes
            if freed >= excess:
                break
        return found

    def _evict(self, candidates: Sequence[tuple[str, _Entry]], excess: int) -> list[_Entry]:
        """Evict the first of ``candidates`` (from :meth:`_evictable`, nothing changed since)
        until ``excess`` bytes are freed; the evicted entries, in that order."""
        objects, evicted, freed = self._objects, [], 0
        for key, entry in candidates:
            if freed >= excess:
                break
            del objects[key]
            evicted.append(entry)
            freed += entry.nbytes
        stats = self._stats
        stats.used_bytes -= freed
        stats.evictions += len(evicted)
        return evicted

    def _found(self, key: str, nbytes: int) -> _Entry | GetStatus:
        """The entry a get of ``nbytes`` under ``key`` reads (a use, for LRU); MISS, or FAILED for
        another size."""
        entry = self._objects.get(key)
        if entry is None:
            return GetStatus.MISS
        if entry.nbytes != nbytes:
            return GetStatus.FAILED
        self._objects.move_to_end(key)
        return entry

    def _get_section(
        self, objects: Sequence[ObjectRef], keys: Sequence[str], sizes: Sequence[int]
    ) -> list[GetStatus]:
        """Gets of objects copied in one call, without a checkpoint (so they need no pin): each
        step over the whole run at once (a comprehension), not a call per object; the usual run
        (every object found, of its size) in one comprehension before its copy."""
        stored = self._objects
        entries = [stored.get(key) for key in keys]
        use = stored.move_to_end  # a use, for LRU, now: a put beside this get evicts others first
        found = [0 if e is None or e.nbytes != n else e.addr for e, n in zip(entries, sizes)]
        if 0 not in found:  # (a buffer's address is never 0)
            for key in keys:
                use(key)
            scatter_objects(found, objects)
            return [GetStatus.HIT] * len(keys)
        results = [
            GetStatus.MISS if entry is None else GetStatus.HIT if entry.nbytes == n else GetStatus.FAILED
            for entry, n in zip(entries, sizes)
        ]
        hits = [i for i, result in enumerate(results) if result is GetStatus.HIT]
        for i in hits:
            use(keys[i])
        addrs = [e.addr for e, result in zip(entries, results) if e is not None and result is GetStatus.HIT]
        scatter_objects(addrs, some_of(objects, hits))
        return results

    async def _get_one(self, batch: Sequence[ObjectRef], index: int, pacer: Pacer) -> GetStatus:
        """A get of object ``index`` of ``batch``, too large to copy whole: its buffer pinned while
        copied with checkpoints."""
        key, nbytes = checked_object(batch, index)
        entry = self._found(key, nbytes)
        if isinstance(entry, GetStatus):
            return entry
        entry.readers += 1
        try:
            addrs, sizes = regions_of(batch, index)
            await copy_in_pieces(
                entry.addr, addrs, sizes, pacer, into_buffer=False, piece_bytes=whole_bytes()
            )
        finally:
            entry.readers -= 1
        return GetStatus.HIT


#: The results :meth:`MemoryBackend._newest_first` counts as a use (not a miss, nor a get of
#: another size, nor a put that found no room).
_USED = frozenset({PutStatus.STORED, PutStatus.PRESENT, GetStatus.HIT})


def _whole_runs(objects: Sequence[ObjectRef]) -> TypeGuard[ObjectBatch]:
    """Whether ``objects`` is a batch of objects that are each copied whole (a run of them a call:
    :meth:`MemoryBackend._put_batch`, :meth:`MemoryBackend._get_batch`)."""
    return isinstance(objects, ObjectBatch) and len(objects) > 0 and 0 < objects.nbytes <= whole_bytes()
