"""Arena backend: objects in the slots of one pre-allocated shared-memory region (``arena://``).

Every process on the host that opens the same directory maps the same arena
(:mod:`kvflow.backends.arena.store`) and shares its objects; there is no server. A put claims one
slot per object under the exclusive lock, copies the object's regions into it without the lock,
and publishes it under the lock again; a get finds and copies objects under the shared lock, so no
claim can take a slot while it is read. Copies are streamed (:mod:`kvflow.backends.copies`) into
and out of memory that every process has mapped already: no system call per object, and no
checksum (a slot is only ever read while its row says it holds that key, whole).

No lock is held across an await (:mod:`kvflow.backends.arena.lock`). A get releases the lock and
lets the loop run once it has held them for half a millisecond; a put, which copies without the
lock, once it has held the loop that long while other work waits to run on it (2 ms when none
does: :mod:`kvflow.backends.pacing`). So a call holds the loop for at most that plus one run's
copy: a put copies an object larger than a run in pieces, a get copies each object whole (under
the lock). See docs/arena-backend.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

import anyio
import anyio.lowlevel
import attrs
import numpy as np

from kvflow import regions
from kvflow.backends import pacing
from kvflow.backends.arena.config import ArenaConfig
from kvflow.backends.arena.lock import EXCLUSIVE, SHARED
from kvflow.backends.arena.store import (
    KEPT_KEY_BYTES,
    ArenaFile,
    KeyHashes,
    Query,
    encode_keys,
    hashes_of,
    outcomes,
    stored_geometry,
)
from kvflow.backends.arena.table import passes
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
    checked_object,
    copy_in_pieces,
    copy_in_runs,
    copy_run,
    gather_objects,
    regions_of,
    scatter_objects,
)
from kvflow.backends.inflight import Lifetime
from kvflow.errors import BackendError, ConfigError

__all__ = ["ArenaBackend", "ArenaConfig"]

logger = logging.getLogger(__name__)

# Tests only: called with the first slot's row once a put has copied a run of objects (its first
# run: up to 4 MiB of them, or one larger object, whole), before it publishes them (a test process
# exits there, as a writer killed mid-put would).
_mid_write_hook: Callable[[int], None] | None = None


def _hook(rows: Sequence[int]) -> Callable[[int, int], None]:
    """:data:`_mid_write_hook` (as it is then) after the run of a put's copy from object ``start``,
    given the row of that object's slot."""

    def after_run(start: int, _: int) -> None:
        if _mid_write_hook is not None:
            _mid_write_hook(rows[start])

    return after_run


@attrs.define
class ArenaBackend:
    """A store in one shared region of fixed-size slots, for the processes of one host.

    Use an instance from one event loop. A child forked with a copy of it has its calls refused
    (it would write the store as its parent): open one there. Construction is
    synchronous: it creates the directory (private to this user unless the URL names a group) and,
    the first time, the arena, allocating all of its memory at once.
    """

    config: ArenaConfig = attrs.field(
        factory=ArenaConfig,
        validator=takes_config(ArenaConfig, "arena:///dev/shm/kvflow-arena?capacity=1GiB"),
    )
    _arena: ArenaFile = attrs.field(init=False)
    _stats: BackendStats = attrs.field(init=False)
    _too_large_logged: bool = attrs.field(default=False, init=False)
    _long_key_logged: bool = attrs.field(default=False, init=False)
    _hashes: KeyHashes = attrs.field(factory=KeyHashes, init=False)
    _life: Lifetime = attrs.field(init=False)  # the calls running: the arena stays mapped for them
    # Rows claimed by puts that failed and could not give them back (the lock timed out): still
    # WRITING by this live process, so their keys read PRESENT to puts and MISS to gets until
    # :meth:`_free_stranded` frees them, in this instance's next exclusive section or its close.
    _stranded: set[int] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        # The copy loops and the claim, loaded now rather than at the first put on the loop; before
        # the arena is opened, so that nothing is left open (or locked) when loading them fails.
        regions.warm()
        passes()
        self._arena = ArenaFile.open(self.config)
        self._life = Lifetime("the arena backend is closed", release=self._arena.close, owner=os.getpid())
        geometry = self._arena.geometry
        self._stats = BackendStats(capacity_bytes=geometry.rows * geometry.slot_bytes)

    @classmethod
    def from_url(cls, url: str) -> ArenaBackend:
        return cls(ArenaConfig.from_url(url))

    @classmethod
    def attach(cls, url: str) -> ArenaBackend:
        """The store ``url`` names, cut as it was made whatever capacity and slot the URL gives; a
        ConfigError when there is none (for tools that look at a store: nothing is created)."""
        config = ArenaConfig.from_url(url)
        geometry = stored_geometry(config)  # the directory checked first; the arena read, never waited on
        if geometry is None:
            raise ConfigError(
                f"there is no arena store at {config.path} (nothing to show or clear); check the URL"
            )
        cut = attrs.evolve(
            config, capacity_bytes=geometry.rows * geometry.slot_bytes, slot_bytes=geometry.slot_bytes
        )
        return cls(cut)

    @property
    def max_batch(self) -> int:
        """Objects per call: a request of up to 256 blocks is one claim, one copy pass and one
        publish (calls of 64 ran in a task group, each paying the lock sections and the claim's
        fixed cost); a claim of 256 holds the lock about 0.25 ms, and a call paces its copies."""
        return 256

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            max_object_bytes=self._arena.geometry.slot_bytes,
            put_checks_present=True,
            calls_in_turn=True,
            min_region_bytes=SHORT_REGION_BYTES,
        )

    @property
    def root(self) -> str:
        """The absolute path of the store's directory."""
        return self._arena.root

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Nothing to register: copies go straight between mapped memory and the caller's."""

    def stats(self) -> BackendStats:
        """Counters of this instance; ``used_bytes`` is the arena's, read from its table now (once
        closed: as last read)."""
        if self._life.closed:
            return self._stats
        self._stats.used_bytes = self._arena.used_bytes()
        self._stats.evictions = self._arena.evictions
        return self._stats

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        """Store each object unless its key exists (``PRESENT``, which counts as a use for LRU)."""
        with self._life.call(copies=True):
            results = [PutStatus.FAILED] * len(objects)
            claimed: dict[int, int] = {}  # object index -> row, until published or given back
            repeats: dict[int, int] = {}  # object index -> the first of the call with its key
            timed_out: TimeoutError | None = None
            try:
                keys = encode_keys(keys_of(objects))  # once: hashed for the claim, kept by the publish
                if keys and len(keys[0]) > KEPT_KEY_BYTES:  # (a model's keys are alike: the first says)
                    self._log_long_key(keys[0])
                await self._claim(objects, keys, results, claimed, repeats)
                if claimed:  # (none: every key present, or no room; nothing to copy or publish)
                    await self._write(objects, claimed)
                    await self._publish(objects, keys, results, claimed)
            except TimeoutError as exc:
                timed_out = exc
            finally:
                if claimed:
                    await self._give_back(claimed.values())
                for i, first in repeats.items():  # copied once: each repeat as its first went
                    results[i] = results[first].repeated()
                self._stats.count_puts(objects, results)
            if timed_out is not None:  # (counted once every repeat took its first's result)
                failed, asked = results.count(PutStatus.FAILED), len(objects)
                logger.error("arena backend: %d of a put's %d objects failed: %s", failed, asked, timed_out)
            await anyio.lowlevel.checkpoint()  # calls in a row from one task let the loop run between them
            return results

    async def _publish(
        self,
        objects: Sequence[ObjectRef],
        keys: Sequence[bytes],
        results: list[PutStatus],
        claimed: dict[int, int],
    ) -> None:
        """Publish the claimed objects, copied into their slots, under the exclusive lock: STORED,
        and ``claimed`` emptied (nothing left to give back)."""
        sizes = nbytes_of(objects)
        order = list(claimed)
        if len(order) < len(objects):  # (else every object, in order)
            keys, sizes = [keys[i] for i in order], [sizes[i] for i in order]
        async with self._arena.lock.held(EXCLUSIVE, self.config.lock_timeout_s):
            self._free_stranded()
            self._arena.publish(list(claimed.values()), sizes, keys)
            if len(order) == len(objects):
                results[:] = [PutStatus.STORED] * len(objects)
            else:
                for i in order:
                    results[i] = PutStatus.STORED
            claimed.clear()

    async def _write(self, objects: Sequence[ObjectRef], claimed: dict[int, int]) -> None:
        """Copy the claimed objects into their slots (without the lock: the slots are this put's),
        a run of them (:func:`kvflow.backends.pacing.run_end`) per copy call; an object larger than
        :func:`~kvflow.backends.pacing.whole_bytes` alone, in pieces of that size
        (:func:`~kvflow.backends.copies.copy_in_pieces`), so that no copy call holds the loop longer
        than a run's does (a 16 MiB object copied whole held it 4.5 ms on a slow host)."""
        order, rows = list(claimed), list(claimed.values())
        arena = self._arena
        slots_of = arena.base + np.asarray(rows, dtype=np.int64) * arena.geometry.slot_bytes
        piece = pacing.whole_bytes()
        if isinstance(objects, ObjectBatch) and len(order) == len(objects) and objects.nbytes <= piece:
            # the usual put
            await copy_in_runs(objects, at(slots_of), into_regions=False, after_run=_hook(rows))
            return
        sizes = nbytes_of(objects)
        if len(order) < len(objects):  # (else every object, in order)
            sizes = [sizes[i] for i in order]
        uniform = isinstance(objects, ObjectBatch)
        pacer, start, slots = pacing.Pacer(), 0, slots_of.tolist()
        while start < len(order):
            if sizes[start] > piece:
                end = start + 1
                checked_object(objects, order[start])
                addrs, lengths = regions_of(objects, order[start])
                await copy_in_pieces(slots[start], addrs, lengths, pacer, into_buffer=True, piece_bytes=piece)
            else:
                end = pacing.run_end(sizes, start, uniform=uniform)
                gather_objects(slots[start:end], some_of(objects, order[start:end]))
            if _mid_write_hook is not None:
                _mid_write_hook(rows[start])
            await pacer.tick()
            start = end

    async def _claim(
        self,
        objects: Sequence[ObjectRef],
        keys: Sequence[bytes],
        results: list[PutStatus],
        claimed: dict[int, int],
        repeats: dict[int, int],
    ) -> None:
        """Claim a slot for each object that fits one (``keys``: the objects' keys, encoded)."""
        slot_bytes = self._arena.geometry.slot_bytes
        sizes = nbytes_of(objects)
        fits: Sequence[int] = range(len(sizes))
        if max(sizes, default=0) > slot_bytes:
            fits = [i for i, nbytes in enumerate(sizes) if nbytes <= slot_bytes]
            self._log_too_large(next(obj for obj in objects if obj.nbytes > slot_bytes))
            keys = [keys[i] for i in fits]
        hashes = hashes_of(keys)  # new keys, mostly: not remembered
        async with self._arena.lock.held(EXCLUSIVE, self.config.lock_timeout_s):
            self._free_stranded()  # first: a key of this put may be one of theirs
            # (the time read once the lock is held: a put that waited for it uses its keys now)
            rows = self._arena.claim(hashes, time.monotonic_ns())
            if len(rows) == len(objects) and (rows >= 0).all():  # the usual put: a slot for each
                claimed.update(enumerate(rows.tolist()))
                return
            claims = outcomes(rows)
            for i, got in zip(fits, claims):
                if isinstance(got, PutStatus):
                    results[i] = got
                elif got is not None:  # (None: a repeat of a key earlier in the call)
                    claimed[i] = got
        if None in claims:  # each repeat and the first copy of its key that fits a slot
            repeats.update((fits[k], fits[f]) for k, f in repeats_of(keys).items())

    async def _give_back(self, rows: Iterable[int]) -> None:
        """Free claimed slots after a failure or a cancellation, with any that earlier puts could
        not give back (shielded: it runs even when cancelled). When the lock times out they are
        kept (``_stranded``) for the next exclusive section of this instance, or its close."""
        self._stranded.update(rows)
        if not self._stranded:
            return
        with anyio.CancelScope(shield=True):
            try:
                async with self._arena.lock.held(EXCLUSIVE, self.config.lock_timeout_s):
                    self._free_stranded()
            except TimeoutError as exc:
                logger.error(
                    "arena backend: %d claimed slots could not be given back yet (%s); their keys read "
                    "PRESENT to puts and MISS to gets until this backend's next put, remove, clear or "
                    "close frees them (or this process ends)",
                    len(self._stranded),
                    exc,
                )

    def _free_stranded(self) -> None:
        """Free the slots that failed puts could not give back (under the exclusive lock)."""
        if self._stranded:
            self._arena.release(sorted(self._stranded))
            self._stranded.clear()

    def _log_long_key(self, key: bytes) -> None:
        if not self._long_key_logged:
            self._long_key_logged = True
            logger.warning(
                "arena backend: keys of %d bytes (as %s...) are longer than the %d a slot keeps for "
                "listing: their objects are stored and found, but `kvflow store ls/clear --model` "
                "cannot tell whose they are (only `kvflow store clear` of every object removes them); "
                "give the model a shorter name (PoolConfig.model, the connector's model_id)",
                len(key),
                key[:80].decode("utf-8", "replace"),
                KEPT_KEY_BYTES,
            )

    def _log_too_large(self, obj: ObjectRef) -> None:
        if not self._too_large_logged:
            self._too_large_logged = True
            logger.error(
                "arena backend: an object of %d bytes (key %r) is larger than the store's slots (%d bytes) "
                "and cannot be stored; open the store with slot= at least that size (a new directory, "
                "or remove the old one)",
                obj.nbytes,
                obj.key,
                self._arena.geometry.slot_bytes,
            )

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        """Fill each object's regions from its slot; a size other than the stored one is FAILED."""
        with self._life.call(copies=True):
            results = [GetStatus.FAILED] * len(objects)
            arena, now = self._arena, 0
            sizes = nbytes_of(objects)
            done = 0
            try:
                query = arena.query(self._hashes(keys_of(objects)), sizes)
                while done < len(objects):
                    # let go at each checkpoint; a put waiting in another process counts as work
                    # waiting, as a task does: it takes the lock only between two holds
                    async with arena.lock.held(SHARED, self.config.lock_timeout_s):
                        # its objects' use: once the lock is first held (a get that waited for it
                        # uses them now), the same for every hold (the first object the most recent)
                        now = now or time.monotonic_ns()
                        pacer = pacing.Pacer()
                        while True:
                            done = self._read(objects, sizes, query, done, results, now)
                            if done == len(objects) or pacer.due(arena.lock.writer_waiting):
                                break
                    if done < len(objects):
                        await anyio.lowlevel.checkpoint()
            except TimeoutError as exc:
                logger.error("arena backend: get of %d objects failed: %s", len(objects), exc)
            finally:
                self._stats.count_gets(objects, results)
            await anyio.lowlevel.checkpoint()  # (after the last hold too, as after a put)
            return results

    def _read(
        self,
        objects: Sequence[ObjectRef],
        sizes: Sequence[int],
        query: Query,
        done: int,
        results: list[GetStatus],
        now: int,
    ) -> int:
        """Copy out the run of objects from ``done`` on (:func:`kvflow.backends.pacing.run_end`) in
        one call, under the shared lock; return where the run ended. Slots found under an earlier
        hold of the lock are checked again (:meth:`ArenaFile.locate`, for the run alone: the
        whole rest of a large batch takes milliseconds); a key found absent is a MISS: it was
        absent when the get looked."""
        arena, end = self._arena, pacing.run_end(sizes, done, uniform=isinstance(objects, ObjectBatch))
        arena.locate(query, done, end, now)
        rows, found = query.rows[done:end], query.found[done:end]
        if found.all():  # the usual case: one copy call, no Python per object
            slots = arena.base + rows * arena.geometry.slot_bytes
            if isinstance(objects, ObjectBatch):  # (on its columns: no slice of it made)
                copy_run(objects, done, slots, into_regions=True)
            else:
                scatter_objects(slots.tolist(), objects[done:end])
            results[done:end] = [GetStatus.HIT] * (end - done)
            return end
        run = objects if end - done == len(objects) else objects[done:end]
        hits = np.flatnonzero(found)
        for i, row in enumerate(rows.tolist(), done):
            if row < 0:
                results[i] = GetStatus.MISS
        addresses = arena.base + rows[hits] * arena.geometry.slot_bytes
        scatter_objects(addresses.tolist(), some_of(run, hits.tolist()))
        for i in hits.tolist():
            results[done + i] = GetStatus.HIT
        return end

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        hashes = self._hashes(keys)
        async with self._locked(SHARED) as arena:
            return arena.present(hashes)

    async def touch(self, keys: Sequence[str]) -> None:
        """Mark the objects of ``keys`` used now, the first the most recently (as a get stamps
        them); keys not held are passed over (:class:`~kvflow.backends.base.Touching`)."""
        hashes = self._hashes(keys)
        async with self._locked(SHARED) as arena:
            arena.use(hashes, time.monotonic_ns())

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        hashes = self._hashes(keys)
        async with self._locked(EXCLUSIVE) as arena:
            return arena.remove(hashes)

    async def list_objects(self) -> list[tuple[str | None, int]]:
        """Every object in the store: ``(key, bytes)``, the key None where it was too long to keep
        (over 254 bytes)."""
        async with self._locked(SHARED) as arena:
            return arena.listing()

    async def usage(self) -> int:
        """Bytes of the objects in the store (their sizes, not their slots)."""
        async with self._locked(SHARED) as arena:
            return arena.used_bytes()

    async def clear(self) -> int:
        """Remove every object (of every model, and the profile book's); return how many. Slots
        being written are left to their writers."""
        async with self._locked(EXCLUSIVE) as arena:
            return arena.clear()

    def _locked(self, mode: int) -> _Section:
        """``async with self._locked(mode) as arena:`` the arena under the lock, for a body that
        does not await; BackendError after the lock timeout (as the protocol asks of ``exists``
        and ``remove``)."""
        return _Section(self, mode)

    async def aclose(self) -> None:
        """Close: no call starts any more; return once no put or get runs (they copy the caller's
        memory until they return) and the slots failed puts could not give back are freed (or the
        lock timed out again: they stay taken until this process ends). The arena is unmapped once
        the last call has returned (a lookup still waiting for the lock answers from it first)."""
        if self._life.closed or self._life.forked:  # another close runs: wait as it does; or a
            await self._life.close()  # forked child's copy: the stranded slots are its parent's
            return
        with self._life.call():  # the arena stays mapped while the stranded slots are given back
            await self._life.close()
            await self._give_back(())


class _Section:
    """:meth:`ArenaBackend._locked`'s context: a call of the backend's lifetime holding the lock
    (a class, not a generator: from cold caches ``contextlib``'s machinery costs tens of
    microseconds around every lookup)."""

    __slots__ = ("backend", "call", "mode")

    def __init__(self, backend: ArenaBackend, mode: int) -> None:
        self.backend, self.mode = backend, mode
        self.call = backend._life.call()

    async def __aenter__(self) -> ArenaFile:
        backend, call = self.backend, self.call
        call.__enter__()  # refused once closed
        try:
            await backend._arena.lock._acquire(self.mode, backend.config.lock_timeout_s)
        except BaseException as exc:
            call.__exit__(None, None, None)
            if isinstance(exc, TimeoutError):
                raise BackendError(f"the arena store {backend.root} cannot answer: {exc}") from exc
            raise
        if self.mode == EXCLUSIVE:
            try:
                backend._free_stranded()
            except BaseException:
                await self.__aexit__(None, None, None)
                raise
        return backend._arena

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.backend._arena.lock._release()
        finally:
            self.call.__exit__(kind, exc, tb)
