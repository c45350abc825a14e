"""A store or a load of a batch of requests, unit by unit.

A :class:`StoreJob` knows which blocks this rank owns and their keys; :meth:`StoreJob.skip_present`
asks the store once which of them exist (over every unit), and :meth:`StoreJob.put` puts one unit
of the rest. A :class:`LoadJob` gets one unit at a time into the cache; a block that any unit fails
to load stays failed. Both report per request at the end (:meth:`results`). The face decides when
each unit moves: all at once (``KVPool``), or each layer once its device event fired (the layerwise
storer) or one layer ahead of the engine (the layerwise retriever).

With staging (:mod:`kvflow.transfer.staging`) a unit moves in chunks: a store gathers a chunk of
blocks into host memory (after the engine's event), then puts it; a load gets a chunk, then scatters
the rows that arrived into the cache. A load's chunk is given back once its copy into the cache
completed (:meth:`LoadJob.settle`); until then the copy's events are the unit's ``ready`` events,
which an engine's stream may wait on instead. A load given ``after`` (the engine's event after
the work already queued on its stream, such as a step still writing a block's previous owner's
KV) writes nothing into the cache before that event: on a device its copy stream waits for it, on
the host the loop polls it, once per job, before the first write.

Jobs are used from the transfer's event loop; a unit's call never runs twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import attrs
import numpy as np
import numpy.typing as npt

from kvflow.backends.base import GetStatus, ObjectBatch, ObjectRef, PutStatus, repeats_of
from kvflow.device import Device
from kvflow.events import DeviceEvent, poll_until
from kvflow.keys import KeyScope
from kvflow.ownership import owned
from kvflow.profiles import LOAD_READ_EVERY_S, Profile
from kvflow.results import RetrieveResult, StoreResult
from kvflow.transfer.core import Transfer, Unit
from kvflow.transfer.direct import ObjectRegions
from kvflow.transfer.plan import BlockPlan
from kvflow.transfer.reshape import Source, copy_into, copy_rows, distinct_bytes, needed_bytes, sources
from kvflow.transfer.staging import Chunk, StagingPool, copying, gather, scatter

__all__ = ["LoadJob", "StoreJob"]

log = logging.getLogger(__name__)

# Folding a block's per-unit put statuses: the worst one wins.
_SEVERITY = {PutStatus.PRESENT: 0, PutStatus.STORED: 1, PutStatus.NO_SPACE: 2, PutStatus.FAILED: 3}
#: How often a copy still running on the device past its deadline is logged while it is waited for.
_STUCK_LOG_S = 30.0
#: How often a load waiting for a staging chunk looks again (chunks come back from other units'
#: copies as well as from other jobs).
_CHUNK_POLL_S = 0.001


async def _copied(chunk: Chunk, deadline: float) -> bool:
    """Wait until the chunk's copy completed; False when the device reported it failed (its
    bytes must not be used; the chunk may go back). Shielded: a copy is never abandoned, because
    the chunk (and the cache's blocks) stay in use until it is done."""
    event = chunk.copied
    if event is None:
        return True
    timeout, whole = max(0.0, deadline - time.monotonic()), True
    with anyio.CancelScope(shield=True):
        while True:
            try:
                await poll_until(event.query, timeout, "a staging copy")
                break
            except TimeoutError:
                log.error("a staging copy is still running on the device; waiting for it (check the device)")
                timeout = _STUCK_LOG_S
            except Exception as exc:  # an asynchronous device error, reported by the copy's event
                log.error("a staging copy failed on the device: %r", exc)
                whole = False
                break
    return whole


@attrs.define(eq=False)
class StoreJob:
    """Puts the blocks of ``plan`` that this rank owns, unit by unit, skipping present keys.

    ``on_released`` (optional) is called once, on the loop, when the job no longer reads the cache:
    every unit copied out (staged) or put (direct), skipped, or abandoned.
    """

    transfer: Transfer
    plan: BlockPlan
    on_released: Callable[[], None] | None = None
    owned: list[int] = attrs.field(init=False)  # flat indices of the blocks this rank puts
    _keys: dict[Unit, list[str]] = attrs.field(init=False, factory=dict)
    _present: dict[Unit, list[bool]] = attrs.field(init=False, factory=dict)
    _statuses: dict[Unit, list[PutStatus]] = attrs.field(init=False, factory=dict)
    _every: bool = attrs.field(init=False)
    _reading: set[Unit] = attrs.field(init=False)
    _repeats: dict[int, int] = attrs.field(init=False)  # owned block -> the first owned one of its hash

    def __attrs_post_init__(self) -> None:
        self.owned = owned(self.plan.indices, self.transfer.parallel)
        self._every = len(self.owned) == len(self.plan)  # owned is 0, 1, 2, ...: the plan's lists serve
        self._reading = set(self.transfer.units)
        self._repeats = repeats_of(
            self.plan.hashes if self._every else [self.plan.hashes[j] for j in self.owned]
        )

    def keys(self, unit: Unit) -> list[str]:
        """The keys of this rank's owned blocks for ``unit``."""
        keys = self._keys.get(unit)
        if keys is None:
            hashes = self.plan.hashes if self._every else [self.plan.hashes[j] for j in self.owned]
            keys = self._keys[unit] = self.transfer.keys(hashes, unit)
        return keys

    async def skip_present(self, deadline: float) -> None:
        """Ask once which owned keys exist, over every unit; those are not put. Reads no KV, so it
        may run before the blocks are written. A store that cannot answer means "none present".

        Not asked where the put itself tells present keys as cheaply and copies nothing for them
        (``put_checks_present``, whole blocks read straight from the cache): the put's answers are
        the same, with one backend call instead of two."""
        units = self.transfer.units
        n = len(self.owned)
        if not n or self.transfer.put_checks_present:
            return
        found = await self.transfer.exists([k for u in units for k in self.keys(u)], deadline)
        for i, unit in enumerate(units):
            self._present[unit] = found[i * n : (i + 1) * n] if found is not None else [False] * n

    async def put(self, unit: Unit, deadline: float, after: DeviceEvent | None = None) -> int:
        """Put ``unit`` of every owned block not present; return how many failed to store.

        ``after``: the engine's event after the work that writes the blocks; no block is read
        before it completed (a device event: the copy stream waits for it on the device).
        """
        n = len(self.owned)
        present = self._present.get(unit)
        if present is None or True not in present:  # (asked, or not, none is present: the usual case)
            statuses, todo = [PutStatus.FAILED] * n, list(range(n))
        else:
            statuses = [PutStatus.PRESENT if p else PutStatus.FAILED for p in present]
            todo = [k for k, p in enumerate(present) if not p]
        if self._repeats:  # blocks several requests share: put once, each repeat told how that went
            todo = [k for k in todo if k not in self._repeats]
        try:
            if not todo:
                return 0
            if self.transfer.staging is None:
                if after is not None:
                    await poll_until(after.query, max(0.0, deadline - time.monotonic()), "the engine's event")
                keys, block_ids = self.keys(unit), self.plan.block_ids
                if len(todo) < n:
                    keys = [keys[k] for k in todo]
                if len(todo) < n or not self._every:
                    block_ids = [block_ids[self.owned[k]] for k in todo]
                results = await self.transfer.put(self.transfer.objects(keys, block_ids, unit), deadline)
            else:
                results = await self._put_staged(unit, todo, deadline, after)
            if len(todo) == n:
                statuses[:] = results
            else:
                for k, status in zip(todo, results):
                    statuses[k] = status
        except TimeoutError as exc:  # the engine's event never came: nothing was read
            log.warning("a store gives up: %s", exc)
        finally:
            for k, first in self._repeats.items():
                if statuses[k] is not PutStatus.PRESENT:
                    statuses[k] = statuses[first].repeated()
            self._statuses[unit] = statuses
            self._released(unit)
        if todo:  # (after the release: the engine need not wait for it)
            await touch_heads(self.transfer, self.plan, unit, deadline)
        return _failures(statuses)

    async def _put_staged(
        self, unit: Unit, todo: list[int], deadline: float, after: DeviceEvent | None
    ) -> list[PutStatus]:
        """Copy ``todo``'s blocks out of the cache a chunk at a time and put each chunk, one chunk
        behind: chunk ``k`` is put while chunk ``k + 1`` is copied out (on a device the copy stream
        runs beside the put, which reads host memory), unless staging has no chunk to spare."""
        transfer = self.transfer
        staging = transfer.staging
        assert staging is not None
        shape, layout, keys = transfer.shape(unit), transfer.require_layout(), self.keys(unit)
        capacity = shape.capacity
        results = [PutStatus.FAILED] * len(todo)
        copied = 0
        pending: list[tuple[int, Chunk]] = []  # chunks copying out, oldest first, with their start

        async def put_oldest() -> None:
            nonlocal copied
            start, chunk = pending.pop(0)
            try:
                whole = await _copied(chunk, deadline)
                part = todo[start : start + capacity]
                copied += len(part)
                if copied == len(todo):
                    self._released(unit)  # the cache's blocks are no longer read
                if whole:  # (else these objects fail: the chunk does not hold them)
                    objects = shape.objects(chunk.buffer, [keys[k] for k in part])
                    results[start : start + len(part)] = await transfer.put(objects, deadline)
            finally:
                staging.give_back(chunk)

        if after is not None:  # on a device the copy stream waits (once: later copies queue behind)
            await staging.device.copies_wait_for(after, max(0.0, deadline - time.monotonic()))
        starts, begun = range(0, len(todo), capacity), 0
        try:
            for start in transfer.in_call_order(starts):
                part = todo[start : start + capacity]
                chunk = staging.try_take()
                if chunk is None and pending:  # none to spare: put the one copied out first
                    await put_oldest()
                    chunk = staging.try_take()
                if chunk is None:
                    with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                        chunk = await staging.take()
                if chunk is None:  # staging stayed full until the deadline: these objects fail
                    left = len(todo) - begun
                    log.warning("no staging chunk came free in time; %d objects not stored", left)
                    break
                begun += len(part)
                try:
                    gather(
                        staging.device,
                        layout,
                        shape,
                        chunk,
                        [self.plan.block_ids[self.owned[k]] for k in part],
                    )
                except Exception as exc:  # a device error: these objects fail, nothing was written
                    log.warning("copying %d blocks out of the KV cache failed: %r", len(part), exc)
                    try:
                        await _copied(chunk, deadline)  # copies queued before the error still write it
                    finally:
                        staging.give_back(chunk)
                    continue
                pending.append((start, chunk))
                if len(pending) > 1:
                    await put_oldest()
            while pending:
                await put_oldest()
        finally:
            for _, chunk in pending:  # a put raised, or the store was cancelled
                await _copied(chunk, deadline)
                staging.give_back(chunk)
        return results

    def abandon(self, unit: Unit) -> int:
        """``unit`` will never be written (its event never fired): it fails where not present."""
        present = self._present.get(unit) or [False] * len(self.owned)
        statuses = [PutStatus.PRESENT if p else PutStatus.FAILED for p in present]
        self._statuses[unit] = statuses
        self._released(unit)
        return sum(1 for s in statuses if s is PutStatus.FAILED)

    def release_all(self) -> None:
        """The job ended (or was cancelled): nothing of it reads the cache any more."""
        for unit in list(self._reading):
            self._released(unit)

    def _released(self, unit: Unit) -> None:
        if unit in self._reading:
            self._reading.discard(unit)
            if not self._reading and self.on_released is not None:
                self.on_released()

    def results(self) -> list[StoreResult]:
        """One :class:`StoreResult` per request: a block's status is the worst over its units
        (``None`` where another rank owns it; FAILED where a unit never finished)."""
        units = self.transfer.units
        done = [self._statuses[u] for u in units if u in self._statuses]
        if len(done) < len(units):  # cancelled: some unit never finished
            worst = [PutStatus.FAILED] * len(self.owned)
        elif len(done) == 1:  # whole blocks: one unit
            worst = list(done[0])
        else:
            worst = [max(column, key=_SEVERITY.__getitem__) for column in zip(*done)]
        flat: list[PutStatus | None]
        if self._every:
            flat = list(worst)
        else:
            flat = [None] * len(self.plan)
            for j, status in zip(self.owned, worst):
                flat[j] = status
        return [StoreResult(tuple(flat[a:b])) for a, b in self.plan.spans]


@attrs.define(eq=False)
class LoadJob:
    """Gets every block of ``plan`` into the cache, unit by unit; every rank loads every block of its
    namespace, starting at a rank-dependent block. A block missing under this engine's keys is
    looked for under the other profiles in the store (:mod:`kvflow.transfer.reshape`)."""

    transfer: Transfer
    plan: BlockPlan
    after: DeviceEvent | None = None  # the engine's event before which nothing is written
    _order: list[int] = attrs.field(init=False)  # flat indices, rotated by rank
    _unrotated: bool = attrs.field(init=False)  # _order is 0, 1, 2, ... (the first rank's)
    _status: list[GetStatus] = attrs.field(init=False)  # per flat block: HIT until a unit is not
    _done: set[Unit] = attrs.field(init=False, factory=set)
    # chunks whose copies into the cache may still run, oldest first, with the pool they go back to
    # and the flat blocks they fill
    _copying: list[tuple[Unit, Chunk, StagingPool, list[int]]] = attrs.field(init=False, factory=list)
    # copies taken out of ``_copying`` by another unit short of chunks (:meth:`_take`), by the unit
    # they fill, until :meth:`settle` of that unit has seen them end
    _taken: dict[Unit, list[_Finishing]] = attrs.field(init=False, factory=dict)
    # the events after each unit's copies into the cache, kept apart from the chunks: another unit
    # short of chunks may finish and reuse one before this unit is handed out
    _events: dict[Unit, list[DeviceEvent]] = attrs.field(init=False, factory=dict)
    # the first wait for ``after`` (made only for a job with one: a lock costs tens of microseconds
    # from cold caches, on every load)
    _waiting: anyio.Lock | None = attrs.field(init=False, default=None)
    _streams_wait: set[int] = attrs.field(init=False, factory=set)  # ids of devices whose copy stream waits
    _after_failed: bool = attrs.field(default=False, init=False)  # it did not complete in time

    def __attrs_post_init__(self) -> None:
        self._order = self.transfer.load_order(len(self.plan))
        self._unrotated = self._order == list(range(len(self.plan)))
        self._status = [GetStatus.HIT] * len(self.plan)
        if self.after is not None:
            self._waiting = anyio.Lock()

    async def get(self, unit: Unit, deadline: float) -> int:
        """Get ``unit`` of every block not failed yet; return how many blocks of it did not arrive.

        Staged, the unit's copies into the cache may still run when this returns: :meth:`ready`
        has their events, and :meth:`settle` waits for them (and must be called).
        """
        status, plan, order = self._status, self.plan, self._order
        every = status.count(GetStatus.HIT) == len(status)
        todo = order if every else [j for j in order if status[j] is GetStatus.HIT]  # failed stays failed
        in_order = todo is order and self._unrotated  # flat order: the plan's own lists serve as they are
        keys = self.transfer.keys(plan.hashes if in_order else [plan.hashes[j] for j in todo], unit)
        if self.transfer.staging is None:
            block_ids = plan.block_ids if in_order else [plan.block_ids[j] for j in todo]
            if await self._writable(None, deadline):  # the backend writes the cache itself
                results = await self.transfer.get(self.transfer.objects(keys, block_ids, unit), deadline)
            else:
                results = [GetStatus.FAILED] * len(todo)
        else:
            results = await self._get_staged(unit, todo, keys, deadline)
        if results.count(GetStatus.HIT) != len(results):
            # A block is marked failed only once no profile had it: other units run meanwhile (a
            # layerwise load keeps several layers in flight), and one that read a block as failed
            # would skip it, never to load that unit of it.
            missed = [j for j, result in zip(todo, results) if result is not GetStatus.HIT]
            filled = await self._get_reshaped(unit, missed, deadline)
            for j, result in zip(todo, results):
                if result is not GetStatus.HIT and j not in filled:
                    status[j] = result
        self._done.add(unit)
        return len(status) - status.count(GetStatus.HIT)

    async def _writable(self, device: Device | None, deadline: float) -> bool:
        """Whether the cache may be written now, after ``after``. ``device``: the copies into the
        cache go through its copy stream, which waits for ``after`` on the device (once per
        device); None: the host writes (a backend's get, a host copy), so the loop polls it. Once
        the host saw it complete, every later call returns at once. False when it did not complete
        by the deadline or the device reported an error, then and for the rest of the job: write
        nothing, the blocks fail."""
        if self.after is None or (device is not None and id(device) in self._streams_wait):
            return True
        assert self._waiting is not None  # (made with the job, which has an ``after``)
        async with self._waiting:
            after = self.after
            if after is None or (device is not None and id(device) in self._streams_wait):
                return True
            if self._after_failed:
                return False
            try:
                timeout_s = max(0.0, deadline - time.monotonic())
                if device is None:
                    await poll_until(after.query, timeout_s, "the engine's event before a load")
                else:
                    await device.copies_wait_for(after, timeout_s)
                    self._streams_wait.add(id(device))
                if device is None or after.query():  # seen complete: nothing waits for it any more
                    self.after = None
            except Exception as exc:  # a timeout, or the device's error: load nothing
                self._after_failed = True
                log.warning("a load writes nothing into the cache: %s", exc)
                return False
            return True

    async def _take(self, pool: StagingPool, deadline: float) -> Chunk | None:
        """A free chunk of ``pool``, finishing this job's oldest copies while every chunk is in use;
        None at the deadline."""
        chunk = pool.try_take()
        while chunk is None and time.monotonic() < deadline:
            if self._copying:  # every chunk in use: finish this job's oldest copy instead
                entry = self._copying.pop(0)  # (perhaps another unit's: its settle waits for this)
                finishing = _Finishing()
                self._taken.setdefault(entry[0], []).append(finishing)
                try:
                    finishing.whole = await self._finish_copy(*entry, deadline)
                finally:
                    finishing.ended.set()
            else:  # another unit of this job, or another job, gives one back soon
                await anyio.sleep(_CHUNK_POLL_S)
            chunk = pool.try_take()
        return chunk

    async def _get_staged(
        self, unit: Unit, todo: list[int], keys: list[str], deadline: float
    ) -> list[GetStatus]:
        transfer = self.transfer
        staging = transfer.staging
        assert staging is not None
        shape, layout = transfer.shape(unit), transfer.require_layout()
        results = [GetStatus.FAILED] * len(todo)
        asked = 0
        starts = range(0, len(todo), shape.capacity)
        for start in transfer.in_call_order(starts):
            part = todo[start : start + shape.capacity]
            chunk = await self._take(staging, deadline)
            if chunk is None:  # staging stayed full until the deadline: these blocks fail
                log.warning("no staging chunk came free in time; %d blocks not loaded", len(todo) - asked)
                break
            asked += len(part)
            try:
                got = await transfer.get(
                    shape.objects(chunk.buffer, keys[start : start + len(part)]), deadline
                )
                rows = [i for i, r in enumerate(got) if r is GetStatus.HIT]
                if rows and not await self._writable(staging.device, deadline):
                    rows, got = [], [GetStatus.FAILED] * len(part)
            except BaseException:
                staging.give_back(chunk)  # nothing was copied into the cache from it
                raise
            try:
                scatter(
                    staging.device, layout, shape, chunk, [self.plan.block_ids[part[i]] for i in rows], rows
                )
            except Exception as exc:  # a device error: the blocks may be half-written; never report them
                log.warning("copying %d blocks into the KV cache failed: %r", len(rows), exc)
                got = [GetStatus.FAILED] * len(part)
            self._issued(unit, chunk, staging, [part[i] for i in rows])
            results[start : start + len(part)] = got
        return results

    async def _get_reshaped(self, unit: Unit, blocks: list[int], deadline: float) -> set[int]:
        """Fill ``unit`` of the flat ``blocks`` from objects of other profiles in the store; return
        the blocks filled whole."""
        transfer = self.transfer
        others = await transfer.book.others(deadline, LOAD_READ_EVERY_S)
        if not others:
            return set()
        layers = transfer.unit_layers(unit)
        p = transfer.parallel
        filled: set[int] = set()
        for profile in others:
            left = [j for j in blocks if j not in filled]
            if not left:
                break
            block = transfer.format.block_size
            wanted: dict[int, list[Source]] = {}
            for j in left:
                index = self.plan.indices[j]
                found = sources(
                    profile,
                    self.plan.fine[self.plan.origins[j]],
                    (index * block, (index + 1) * block),
                    layers=layers,
                    heads=transfer.heads,
                    dcp_rank=p.dcp_rank,
                    pcp_rank=p.pcp_rank,
                )
                if found:
                    wanted[j] = found
            if not wanted:
                continue
            if transfer.staging is None and (placed := self._in_place(profile, wanted, layers)) is not None:
                filled |= await self._get_in_place(wanted, placed, deadline)
                continue
            largest = max(needed_bytes(found) for found in wanted.values())  # one block per chunk
            pool = await transfer.scratch(largest)
            if pool is None:
                log.warning(
                    "a block's objects of another split (%d bytes) are more than a load holds at once "
                    "(%d bytes: staging_bytes, or 64 MiB if larger); raise staging_bytes",
                    largest,
                    transfer.scratch_limit,
                )
                continue
            filled |= await self._fetch_and_copy(unit, profile, pool, wanted, layers, deadline)
        return filled

    def _in_place(
        self, profile: Profile, wanted: dict[int, list[Source]], layers: tuple[int, int]
    ) -> dict[KeyScope, ObjectRegions] | None:
        """Where in a cache block each scope's objects go, when every object ``wanted`` can be
        written straight into the cache (:mod:`kvflow.transfer.direct`); else None."""
        transfer = self.transfer
        placed: dict[KeyScope, ObjectRegions] = {}
        for found in wanted.values():
            for source in found:
                scope = source.scope
                if scope in placed:
                    continue
                regions = transfer.object_regions(profile, scope, layers)
                if regions is None:
                    return None
                placed[scope] = regions
        return placed

    async def _get_in_place(
        self, wanted: dict[int, list[Source]], placed: dict[KeyScope, ObjectRegions], deadline: float
    ) -> set[int]:
        """Get the objects ``wanted`` per block straight into the cache blocks, each scope's into
        the regions ``placed`` names; return the blocks whose objects all arrived. Scopes whose
        objects lie alike (the same regions' sizes: every head group of a TP split, the stages of
        an even pipeline split) go in one batch, each other shape in one of its own, one after
        another. (Two requests of a call may load one prompt into other blocks: an object's key
        then comes twice, each time with its own block, and each answer counts for its own.)"""
        if not await self._writable(None, deadline):
            return set()
        transfer, block_ids = self.transfer, self.plan.block_ids
        blocks = list(wanted)
        rows = transfer.require_layout().addr_rows([block_ids[j] for j in blocks])
        shapes: list[tuple[ObjectRegions, list[str], list[npt.NDArray[np.int64]], list[int]]] = []
        for scope, regions in placed.items():  # per shape of objects: their keys, addresses, blocks
            at = [(i, s.key) for i, j in enumerate(blocks) for s in wanted[j] if s.scope == scope]
            shape = next((s for s in shapes if s[0].sizes == regions.sizes), None)
            if shape is None:
                shape = (regions, [], [], [])
                shapes.append(shape)
            shape[1].extend(key for _, key in at)
            shape[2].append(regions.addrs(rows[[i for i, _ in at]]))
            shape[3].extend(blocks[i] for i, _ in at)
        missed: set[int] = set()
        for regions, keys, addrs, owners in shapes:
            batch = ObjectBatch(
                keys, np.concatenate(addrs), regions.sizes, regions.nbytes, sizes_array=regions.size_array
            )
            results = await transfer.get(batch, deadline)
            missed.update(j for j, result in zip(owners, results) if result is not GetStatus.HIT)
        return set(blocks) - missed

    async def _fetch_and_copy(
        self,
        unit: Unit,
        profile: Profile,
        pool: StagingPool,
        wanted: dict[int, list[Source]],
        layers: tuple[int, int],
        deadline: float,
    ) -> set[int]:
        """Fetch the objects ``wanted`` per block a chunk at a time, and copy the blocks whose
        objects all arrived."""
        if profile.block_size == self.transfer.format.block_size:
            return await self._fetch_rows(unit, profile, pool, wanted, layers, deadline)
        filled: set[int] = set()
        batches: list[list[int]] = [[]]
        used, placed = 0, set[str]()
        for j, found in wanted.items():
            sizes = distinct_bytes(found)
            assert sum(sizes.values()) <= pool.chunk_bytes, (
                "checked by the caller: a chunk holds any one block"
            )
            need = sum(n for key, n in sizes.items() if key not in placed)  # shared objects placed once
            if used + need > pool.chunk_bytes and batches[-1]:
                batches.append([])
                used, placed = 0, set()
                need = sum(sizes.values())  # a new chunk holds none of them yet
            batches[-1].append(j)
            used += need
            placed |= {s.key for s in found}
        left = len(wanted)
        for batch in self.transfer.in_call_order(batches):
            chunk = await self._take(pool, deadline)
            if chunk is None:
                log.warning("no staging chunk came free in time; %d blocks not loaded", left)
                break
            left -= len(batch)
            offsets: dict[str, int] = {}
            refs: list[ObjectRef] = []
            base, at = chunk.buffer.data_ptr(), 0
            for j in batch:
                for s in wanted[j]:
                    if s.key not in offsets:
                        offsets[s.key] = at
                        refs.append(ObjectRef(s.key, [base + at], [s.nbytes], s.nbytes))
                        at += s.nbytes
            if at > pool.chunk_bytes:  # the packing above is wrong: never let a get write past the chunk
                pool.give_back(chunk)
                raise AssertionError(f"a batch of {at} bytes was packed for a chunk of {pool.chunk_bytes}")
            try:
                got = dict(zip(offsets, await self.transfer.get(refs, deadline)))
                complete = [j for j in batch if all(got[s.key] is GetStatus.HIT for s in wanted[j])]
                if complete and not await self._writable(pool.device, deadline):
                    complete = []
            except BaseException:
                pool.give_back(chunk)
                raise
            try:
                self._copy(profile, pool, chunk, complete, wanted, offsets, layers)
                filled.update(complete)
            except Exception as exc:  # a device error: the blocks may be half-written; never report them
                log.warning("copying %d blocks into the KV cache failed: %r", len(complete), exc)
            self._issued(unit, chunk, pool, complete)
        return filled

    async def _fetch_rows(
        self,
        unit: Unit,
        profile: Profile,
        pool: StagingPool,
        wanted: dict[int, list[Source]],
        layers: tuple[int, int],
        deadline: float,
    ) -> set[int]:
        """:meth:`_fetch_and_copy` when each block is one object per scope of the profile: a chunk
        holds rows of objects per scope, moved with one copy per scope, layer and part."""
        transfer, plan = self.transfer, self.plan
        blocks = list(wanted)
        scopes = [s.scope for s in wanted[blocks[0]]]
        sizes = [s.nbytes for s in wanted[blocks[0]]]
        capacity = pool.chunk_bytes // sum(sizes)
        assert capacity >= 1, "checked by the caller: a chunk holds any one block"
        filled: set[int] = set()
        starts, left = range(0, len(blocks), capacity), len(blocks)
        for start in transfer.in_call_order(starts):
            batch = blocks[start : start + capacity]
            chunk = await self._take(pool, deadline)
            if chunk is None:
                log.warning("no staging chunk came free in time; %d blocks not loaded", left)
                break
            left -= len(batch)
            base, offsets, refs = chunk.buffer.data_ptr(), [], []
            at = 0
            for nbytes in sizes:
                offsets.append(at)
                at += len(batch) * nbytes
            for k, nbytes in enumerate(sizes):
                for r, j in enumerate(batch):
                    key = wanted[j][k].key
                    refs.append(ObjectRef(key, [base + offsets[k] + r * nbytes], [nbytes], nbytes))
            try:
                got = await transfer.get(refs, deadline)
                rows = [
                    r
                    for r in range(len(batch))
                    if all(got[k * len(batch) + r] is GetStatus.HIT for k in range(len(sizes)))
                ]
                if rows and not await self._writable(pool.device, deadline):
                    rows = []
            except BaseException:
                pool.give_back(chunk)
                raise
            try:
                with copying(pool.device, chunk):
                    if rows:
                        copy_rows(
                            pool.device,
                            transfer.require_layout(),
                            [plan.block_ids[batch[r]] for r in rows],
                            rows,
                            first_layer=transfer.stage_layers[0],
                            layers=layers,
                            heads=transfer.heads,
                            profile=profile,
                            buffer=chunk.buffer,
                            regions=list(zip(offsets, scopes, sizes)),
                        )
                filled.update(batch[r] for r in rows)
            except Exception as exc:  # a device error: the blocks may be half-written; never report them
                log.warning("copying %d blocks into the KV cache failed: %r", len(rows), exc)
            self._issued(unit, chunk, pool, [batch[r] for r in rows])
        return filled

    def _copy(
        self,
        profile: Profile,
        pool: StagingPool,
        chunk: Chunk,
        blocks: list[int],
        wanted: dict[int, list[Source]],
        offsets: dict[str, int],
        layers: tuple[int, int],
    ) -> None:
        transfer = self.transfer
        layout = transfer.require_layout()
        block = transfer.format.block_size
        with copying(pool.device, chunk):
            for j in blocks:
                copy_into(
                    layout,
                    self.plan.block_ids[j],
                    first_token=self.plan.indices[j] * block,
                    first_layer=transfer.stage_layers[0],
                    layers=layers,
                    heads=transfer.heads,
                    profile=profile,
                    buffer=chunk.buffer,
                    placed=[(offsets[s.key], s) for s in wanted[j]],
                )

    def _issued(self, unit: Unit, chunk: Chunk, home: StagingPool, blocks: list[int]) -> None:
        """``unit``'s copies into the cache from ``chunk`` (of the flat ``blocks``) were issued:
        keep the chunk until they complete, and their event for :meth:`ready`."""
        self._copying.append((unit, chunk, home, blocks))
        if chunk.copied is not None:
            self._events.setdefault(unit, []).append(chunk.copied)

    def ready(self, unit: Unit) -> tuple[DeviceEvent, ...]:
        """Events after which ``unit``'s copies into the cache are done (none when unstaged)."""
        return tuple(self._events.get(unit, ()))

    async def settle(self, unit: Unit, deadline: float) -> bool:
        """Wait until ``unit``'s copies into the cache completed, and give their chunks back; False
        when the device reported one failed (its blocks are failed), including a copy another
        unit short of chunks took to finish (waited for here: until it ended, the layer's bytes
        may still be wrong)."""
        mine = [entry for entry in self._copying if entry[0] == unit]
        self._copying = [entry for entry in self._copying if entry[0] != unit]
        whole = True
        for entry in mine:
            whole = await self._finish_copy(*entry, deadline) and whole
        for finishing in self._taken.pop(unit, ()):
            with anyio.CancelScope(shield=True):  # (its copy's own wait is shielded: it ends)
                await finishing.ended.wait()
            whole = finishing.whole and whole
        return whole

    async def settle_all(self, deadline: float) -> None:
        """:meth:`settle` every unit with copies left: a face's cleanup, safe in a cancelled scope
        (every wait for a copy is shielded)."""
        for unit in {entry[0] for entry in self._copying} | set(self._taken):
            await self.settle(unit, deadline)

    async def _finish_copy(
        self, unit: Unit, chunk: Chunk, home: StagingPool, blocks: list[int], deadline: float
    ) -> bool:
        """Wait for a chunk's copies into the cache, then give it back; the blocks it filled fail
        (and False) if the device says the copy did."""
        try:
            whole = await _copied(chunk, deadline)
            if not whole:
                for j in blocks:
                    self._status[j] = GetStatus.FAILED
            return whole
        finally:
            home.give_back(chunk)

    def results(self) -> list[RetrieveResult]:
        """One :class:`RetrieveResult` per request: a block is a HIT only if every unit of it was
        loaded; otherwise the engine must recompute it."""
        status = self._status
        if len(self._done) < len(self.transfer.units):  # cancelled: unfinished units hold junk
            status = [GetStatus.FAILED if s is GetStatus.HIT else s for s in status]
        block_size = self.transfer.format.block_size
        return [
            RetrieveResult(tuple(self.plan.block_ids[a:b]), tuple(status[a:b]), block_size)
            for a, b in self.plan.spans
        ]


@attrs.define(eq=False)
class _Finishing:
    """A unit's copy into the cache that another unit's task finishes (:meth:`LoadJob._take`)."""

    ended: anyio.Event = attrs.field(factory=anyio.Event)
    whole: bool = False  # the device reported it complete (False until then, and if it raised)


#: a store touches a request's earlier blocks when they are at most this many times its own: a
#: chunked prompt's saves then cost at most this many touches a block stored, and a decode block's
#: save on a long prompt none. A load touches nothing: the engine waits for it, and the request's
#: next save (the blocks it computes after the loaded ones) touches the loaded blocks too.
TOUCH_RATIO = 16


async def touch_heads(transfer: Transfer, plan: BlockPlan, unit: Unit, deadline: float) -> None:
    """Touch ``unit`` of the blocks before each request's own (its ``block_offset``), head first,
    where they are at most :data:`TOUCH_RATIO` times the request's own: a later chunk of a prompt,
    stored after them, must not stay newer than they are, or eviction would take the end of the
    earlier ones first and leave the rest unreachable. Every rank touches them all, after its own
    put, so the last use of the prompt is a touch."""
    keys: list[str] = []
    for request, fine, (first, end) in zip(plan.requests, plan.fine, plan.spans):
        offset = request.block_offset
        if 0 < offset <= TOUCH_RATIO * (end - first):
            keys += transfer.keys(transfer.hashing.blocks(fine)[:offset], unit)
    await transfer.touch(keys, deadline)  # (a key twice, two requests of one prompt: its first place counts)


def _failures(statuses: list[PutStatus]) -> int:
    """How many of ``statuses`` did not store (no space or a failure)."""
    return statuses.count(PutStatus.NO_SPACE) + statuses.count(PutStatus.FAILED)
