"""The arena file: one pre-allocated region of fixed-size slots and the table that says what each holds.

``<dir>/arena`` is a header page (how the store is cut, and the file's making and checks:
:mod:`kvflow.backends.arena.header`), a table with one row per slot, the keys (for listing the store:
the table names a key by its hash), and the slots. Every process maps
the whole file (``MAP_SHARED | MAP_POPULATE``): its pages are allocated once, when the store is
created, so a put copies into memory that is already there, at memcpy speed, instead of asking the
kernel for new pages as a file per object does.

The slots form a set-associative cache: a key's 128-bit xxh3 hash picks one set of ``ways`` slots
(64 or a few more, or every slot of a store of fewer than 128), and the object lives in one of them
or nowhere. A lookup reads one set, so it needs no index beyond the table, and eviction takes the
least recently used slot of the set. Sets are wide so that, as in one LRU list, the newest objects
stay: what a prefix lookup needs.

The table is columnar, eight arrays of little-endian u64 with one item per slot: state (FREE,
WRITING, READY), the writer (pid namespace, pid, start time: who holds a WRITING slot), the key's
hash (two words), the object's size and its last use (``CLOCK_MONOTONIC`` ns, one clock for every
process of the host). Rows change only under the exclusive lock and are read under the shared lock
(:mod:`kvflow.backends.arena.lock`), so a reader never sees a slot change under it. A put claims a
slot (WRITING, under the lock), copies without the lock, and publishes it (READY, under the lock); a
writer that dies in between leaves a WRITING slot that is never read and that a later claim in its
set takes back. Beside the table, one byte per slot holds the low byte of its key's second word: a lookup
compares those tags across its sets and reads the words of the matching rows only. A claim writes
the owner, then the state, then the key: a process killed between
any two of those writes leaves either the old object, whole, or a slot of a dead writer.

Everything here is synchronous; the caller holds the right lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import xxhash

from kvflow.backends import lockfiles
from kvflow.backends.arena.config import ArenaConfig
from kvflow.backends.arena.header import (
    ARENA_NAME,
    COLUMNS,
    KEY_BYTES,
    PAGE,
    WAIT_MARK,
    WAYS,
    Geometry,
    check_room,
    exists,
    open_made,
    open_or_create,
    stored_geometry,
)
from kvflow.backends.arena.lock import EXCLUSIVE, SHARED, StoreLock, WaitMark
from kvflow.backends.arena.table import NO_SPACE, PRESENT, REPEAT, UNKNOWN, passes
from kvflow.backends.base import PutStatus
from kvflow.backends.filesystems import warn_unless_in_memory
from kvflow.backends.local.format import WriterId
from kvflow.backends.local.safety import (
    LOCK_NAME,
    Access,
    open_root,
    open_store_file,
    opening,
)
from kvflow.errors import BackendUnavailableError

__all__ = [
    "ARENA_NAME",
    "FREE",
    "KEPT_KEY_BYTES",
    "KEY_BYTES",
    "READY",
    "WAYS",
    "WRITING",
    "ArenaFile",
    "Claims",
    "Geometry",
    "KeyHashes",
    "Query",
    "encode_keys",
    "hashes_of",
    "key_hashes",
    "outcomes",
    "stored_geometry",
]

_ALLOCATE_BYTES_PER_S = 1 << 30  # posix_fallocate on tmpfs, a slow host's (12 GB/s measured here)
#: The most bytes of a key a slot keeps, for listing the store (a longer key is stored, unnamed).
KEPT_KEY_BYTES = KEY_BYTES - 2
_KEY_TOO_LONG = KEY_BYTES - 1  # a length no key is given: the key was not kept

FREE, WRITING, READY = 0, 1, 2
# The table's columns.
_STATE, _NS, _PID, _START, _K0, _K1, _NBYTES, _USED = range(8)
_STATUS: dict[int, int | PutStatus | None] = {
    PRESENT: PutStatus.PRESENT,
    NO_SPACE: PutStatus.NO_SPACE,
    REPEAT: None,
}

Hashes = npt.NDArray[np.uint64]  # n x 2: the words that name each key
Words = npt.NDArray[np.uint64]  # one word of each key
Claims = npt.NDArray[np.int64]  # per key: the row it claimed, or PRESENT, NO_SPACE or REPEAT


def key_hashes(keys: Sequence[str]) -> Hashes:
    """The two words that name each key in the table (its xxh3-128 hash)."""
    return hashes_of(encode_keys(keys))


def hashes_of(keys: Sequence[bytes]) -> Hashes:
    """:func:`key_hashes` of keys encoded already (:func:`encode_keys`)."""
    return _words(list(map(xxhash.xxh3_128_digest, keys)))


def _digests(keys: Sequence[str]) -> list[bytes]:
    return list(map(xxhash.xxh3_128_digest, encode_keys(keys)))


def encode_keys(keys: Sequence[str]) -> list[bytes]:
    """Each key's UTF-8 bytes (a lone surrogate kept, as ``surrogatepass`` writes it): the keys
    joined, encoded and split again in three calls, or one by one where a key holds the NUL that
    joins them."""
    if len(keys) == 0:  # (not ``not keys``: a batch's keys may be an array)
        return []
    data = "\0".join(keys).encode("utf-8", "surrogatepass").split(b"\0")
    if len(data) == len(keys):
        return data
    return [k.encode("utf-8", "surrogatepass") for k in keys]


def _words(digests: list[bytes]) -> Hashes:
    return np.frombuffer(b"".join(digests), dtype="<u8").reshape(-1, 2)


@attrs.define
class KeyHashes:
    """:func:`key_hashes` remembering the digests of the last keys it was given (up to ``limit``;
    then it starts afresh): a prefix is looked up many times (each scheduler step, then loaded).
    A put's keys are mostly new: it calls :func:`hashes_of` itself, which costs a third as much as
    remembering them (8 against 27 us for 64 new keys)."""

    limit: int = 1 << 17
    _known: dict[str, bytes] = attrs.field(factory=dict)

    def __call__(self, keys: Sequence[str]) -> Hashes:
        known = self._known
        if len(known) + len(keys) > self.limit:
            known.clear()
        new = [k for k in keys if k not in known]
        known.update(zip(new, _digests(new)))
        return _words([known[k] for k in keys])


@attrs.define
class ArenaFile:
    """The mapped arena of one store directory, and its lock. Close it with :meth:`close`."""

    root: str
    geometry: Geometry
    lock: StoreLock
    _root_fd: int
    _map: mmap.mmap
    me: WriterId = attrs.field(factory=WriterId.current)
    evictions: int = 0  # published objects whose slots this instance's claims took
    _table: npt.NDArray[np.uint64] = attrs.field(init=False)  # columns x rows
    _words: memoryview = attrs.field(init=False)  # the same, flat: column * rows + row
    _tags: npt.NDArray[np.uint8] = attrs.field(init=False)  # per row: the low byte of its k1
    _key_rows: npt.NDArray[np.uint8] = attrs.field(init=False)  # per row: its key's length and bytes
    _anchor: ctypes.c_char = attrs.field(init=False)
    base: int = attrs.field(init=False)  # address of the first slot
    _rows: int = attrs.field(init=False)  # the geometry's, kept: a property costs a call per object
    _columns: tuple[npt.NDArray[np.uint64], ...] = attrs.field(init=False)  # the table's, one view each
    _me_words: npt.NDArray[np.uint64] = attrs.field(init=False)  # ``me`` as the table writes it

    def __attrs_post_init__(self) -> None:
        rows = self._rows = self.geometry.rows
        self._table = np.frombuffer(self._map, dtype="<u8", count=rows * COLUMNS, offset=PAGE).reshape(
            COLUMNS, rows
        )
        self._words = memoryview(self._map)[PAGE : PAGE + rows * COLUMNS * 8].cast("Q")
        tags = self.geometry.tags_offset
        self._tags = np.frombuffer(self._map, dtype=np.uint8, count=rows, offset=tags)
        self._key_rows = np.frombuffer(
            self._map, dtype=np.uint8, count=rows * KEY_BYTES, offset=self.geometry.keys_offset
        ).reshape(rows, KEY_BYTES)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(self._anchor) + self.geometry.data_offset
        self._columns = tuple(self._table[column] for column in range(COLUMNS))
        self._me_words = np.array([self.me.namespace, self.me.pid, self.me.start], dtype=np.uint64)
        self.lock.waits = WaitMark(memoryview(self._map)[WAIT_MARK : WAIT_MARK + 8].cast("Q"))

    @classmethod
    def open(cls, config: ArenaConfig) -> ArenaFile:
        """Open the store at ``config.path``, creating the directory and the arena if missing.

        Raises ConfigError naming the path and what to do when it cannot be used.
        """
        root = os.path.normpath(config.path)
        access = Access.of(config.group)
        geometry = Geometry.of(config)
        with opening(root, backend="arena") as fds:
            if not os.path.lexists(root):  # a capacity no filesystem there holds: refused before it is made
                check_room(_nearest_existing(root), root, geometry)
            fds.append(open_root(root, access))
            fds.append(open_store_file(fds[0], LOCK_NAME, f"{root}/{LOCK_NAME}", access))
            # a forked child gets its own (kvflow.backends.lockfiles), even while the store is made
            lockfiles.opened(fds[1])
            try:
                lock = StoreLock(fds[1], f"{root}/{LOCK_NAME}")
                wait = config.lock_timeout_s
                warn_unless_in_memory(fds[0], root, "arena")
                earlier = Geometry.earlier_of(config)
                try:
                    opened = None
                    if exists(fds[0], ARENA_NAME):  # only its header is read: shared, not waiting for gets
                        with lock.held_blocking(SHARED, wait):
                            opened = open_made(fds[0], root, access, geometry, earlier)
                    if opened is None:
                        # none (or removed meanwhile): it may be being made, so wait as long as that
                        # takes, but not for one its filesystem cannot hold
                        check_room(fds[0], root, geometry)
                        wait += geometry.file_bytes / _ALLOCATE_BYTES_PER_S
                        with lock.held_blocking(EXCLUSIVE, wait):
                            opened = open_or_create(fds[0], root, access, geometry, earlier)
                    fds.append(opened[0])
                    geometry = opened[1]
                except TimeoutError as exc:
                    raise BackendUnavailableError(f"cannot open the arena at {root}: {exc}") from None
                mapped = mmap.mmap(
                    fds[2],
                    geometry.file_bytes,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                )
            except BaseException:
                lockfiles.closing(fds[1])  # (``opening`` closes the descriptors)
                raise
        os.close(fds.pop())  # the map keeps the file
        return cls(root, geometry, lock, fds[0], mapped)

    def close(self) -> None:
        """Unmap the arena and close the descriptors (call once no copy is running)."""
        self._words.release()
        if self.lock.waits is not None:
            self.lock.waits.word.release()
            self.lock.waits = None
        del self._table, self._tags, self._key_rows, self._anchor, self._columns
        self._map.close()
        lockfiles.closing(self.lock.fd)
        for fd in (self.lock.fd, self._root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- under the shared lock ------------------------------------------------------------------

    def present(self, hashes: Hashes) -> list[bool]:
        """For each hash, whether its object is published."""
        result: list[bool] = (self._find(hashes) >= 0).tolist()
        return result

    def use(self, hashes: Hashes, now: int) -> None:
        """Mark the published objects of ``hashes`` used, the ``i``-th at ``now - i`` (as
        :meth:`locate` stamps a get's; a hash named twice at its first place): a benign race under
        the shared lock, as there."""
        rows = self._find(hashes)
        found = rows >= 0
        ages = np.arange(len(rows), dtype=np.uint64)[found]
        # last first: a row named twice keeps its first place's time (the later write wins)
        self._columns[_USED][rows[found][::-1]] = (np.uint64(now) - ages)[::-1]

    def find(self, hashes: Hashes) -> list[int]:
        """For each hash, the row of its published object, or -1."""
        result: list[int] = self._find(hashes).tolist()
        return result

    def _find(self, hashes: Hashes) -> npt.NDArray[np.int64]:
        k0, k1, sets = self._hash_words(hashes)
        rows = np.empty(len(k0), dtype=np.int64)
        c = self._columns
        passes().find(c[_STATE], c[_K0], c[_K1], self._tags, k0, k1, sets, self.geometry.ways, rows)
        return rows

    def query(self, hashes: Hashes, sizes: Sequence[int]) -> Query:
        """A get of the objects of these hashes and sizes, none looked for yet (:meth:`locate`).
        A size larger than a slot is never found: a table row claiming one (damaged, or written by
        a hostile member of the store's group) must not make a get copy past its slot."""
        k0, k1, sets = self._hash_words(hashes)
        wanted = np.asarray(sizes, dtype=np.int64)
        wanted[wanted > self.geometry.slot_bytes] = -1
        return Query(
            k0,
            k1,
            sets,
            wanted,
            np.full(len(k0), UNKNOWN, dtype=np.int64),
            np.zeros(len(k0), dtype=np.bool_),
        )

    def locate(self, query: Query, start: int, end: int, now: int) -> None:
        """Fill ``query.rows`` and ``query.found`` for its objects in ``[start, end)``: each one's
        published slot (-1: none), looked for again where a slot found under an earlier hold of the
        lock no longer holds its key; found where the slot holds an object of the size asked for
        (a use, for LRU, at ``now - i`` for the get's ``i``-th object, as :meth:`claim` stamps them:
        a benign race under the shared lock, every writer writes a recent time)."""
        c = self._columns
        passes().locate(
            c[_STATE], c[_K0], c[_K1], c[_NBYTES], c[_USED], self._tags,
            query.k0, query.k1, query.sets, self.geometry.ways, query.sizes, start, end, np.uint64(now),
            query.rows, query.found,
        )  # fmt: skip

    def used_bytes(self) -> int:
        """Bytes of the published objects (their sizes, not their slots)."""
        table = self._table
        return int(table[_NBYTES][table[_STATE] == READY].sum())

    # --- under the exclusive lock ---------------------------------------------------------------

    def claim(self, hashes: Hashes, now: int) -> Claims:
        """For each hash, a slot for its new object, now WRITING and this process's (a row >= 0);
        or PRESENT, or NO_SPACE (every slot of its set is being written); or REPEAT for a hash
        earlier in ``hashes``, which shares the outcome of that one's put (:func:`outcomes` reads
        them).

        A key already published, or being written by a live process, is PRESENT; a published one
        counts as used. The ``i``-th hash's slot is used at ``now - i``: a request's first blocks
        are its newest, so its last go first when its set is full. A slot that held the key before
        (freed, or its writer died) takes it again. Otherwise a claim takes, in order: a free slot
        of the set, one whose writer died, the least recently used published one (counted in
        :attr:`evictions`); never a slot this call claimed, nor one that holds (or held) another key
        of the call.
        Decided in one pass of compiled code (:mod:`kvflow.backends.arena.table`).
        """
        if not len(hashes):
            return np.empty(0, dtype=np.int64)
        compiled, columns = passes(), self._columns
        state, ns, pid, start = columns[_STATE], columns[_NS], columns[_PID], columns[_START]
        k0, k1, sets = self._hash_words(hashes)
        ways, me = self.geometry.ways, self._me_words
        others = compiled.foreign(state, ns, pid, start, sets, ways, me).tolist()
        verdicts: dict[WriterId, bool] = {}  # one look at /proc per writer, not per slot it writes
        dead = np.array([row for row in others if not self._alive(row, verdicts)], dtype=np.int64)
        rows = np.empty(len(hashes), dtype=np.int64)
        self.evictions += compiled.claim(
            state, ns, pid, start, columns[_K0], columns[_K1], columns[_USED], self._tags,
            k0, k1, sets, ways, np.uint64(now), me, dead, rows,
        )  # fmt: skip
        given = rows >= 0
        # No decision read a row it gave out (a row given once is never given again, nor one that
        # holds a key of the call), so the claims are written together, column by column.
        self._write_claims(rows[given], hashes[given], _uses(now, np.flatnonzero(given)))
        return rows

    def _hash_words(self, hashes: Hashes) -> tuple[Words, Words, npt.NDArray[np.int64]]:
        """Each key's two hash words (contiguous, writable copies, as the compiled passes take them)
        and the set it lives in."""
        k0, k1 = hashes[:, 0].copy(), hashes[:, 1].copy()
        return k0, k1, (k0 % np.uint64(self.geometry.sets)).astype(np.int64)

    def _alive(self, row: int, verdicts: dict[WriterId, bool]) -> bool:
        """Whether the writer of ``row`` may still be running (``verdicts``: those judged already)."""
        words, n = self._words, self._rows
        writer = WriterId(words[_NS * n + row], words[_PID * n + row], words[_START * n + row])
        if writer not in verdicts:
            verdicts[writer] = writer.is_alive(self.me)
        return verdicts[writer]

    def _write_claims(self, at: npt.NDArray[np.int64], hashes: Hashes, used: Words) -> None:
        """Make rows ``at`` this process's, WRITING, for the keys of ``hashes`` (one row each), last
        used at ``used``: the owner of every row first, then their state, then their keys, so a
        process killed between two of those writes leaves each row holding its old object whole, or
        a dead writer's slot."""
        if not len(at):
            return
        table = self._table
        table[_NS : _START + 1, at] = self._me_words[:, None]  # the owner's three words
        table[_STATE, at] = WRITING
        table[_K0 : _K1 + 1, at] = hashes.T
        table[_USED, at] = used
        self._tags[at] = (hashes[:, 1] & np.uint64(0xFF)).astype(np.uint8)

    def publish(self, rows: Sequence[int], sizes: Sequence[int], keys: Sequence[bytes]) -> None:
        """Make slots this process claimed readable, ``rows[i]`` holding ``sizes[i]`` bytes of
        ``keys[i]``'s object (the key encoded: :func:`encode_keys`): every size and key is written
        before any row turns READY."""
        if not rows:
            return
        at = np.asarray(rows, dtype=np.intp)
        self._table[_NBYTES, at] = sizes
        lengths = np.array(list(map(len, keys)), dtype=np.int64)
        width = min(int(lengths.max()), KEPT_KEY_BYTES)
        if width:  # each key's bytes, padded with NULs (a key too long to keep: cut, and not kept)
            text = np.array(keys, dtype=f"S{width}").view(np.uint8).reshape(len(keys), width)
            self._key_rows[at, 2 : 2 + width] = text
        lengths[lengths > KEPT_KEY_BYTES] = _KEY_TOO_LONG
        self._key_rows[at, :2] = lengths.astype("<u2").view(np.uint8).reshape(len(keys), 2)
        self._table[_STATE, at] = READY

    def listing(self) -> list[tuple[str | None, int]]:
        """Every published object: its key (None when too long to keep) and its size."""
        table, found = self._table, []
        for row in np.flatnonzero(table[_STATE] == READY).tolist():
            record = self._key_rows[row].tobytes()
            length = int.from_bytes(record[:2], "little")
            key = None if length > KEPT_KEY_BYTES else record[2 : 2 + length].decode("utf-8", "surrogatepass")
            found.append((key, int(table[_NBYTES, row])))
        return found

    def clear(self) -> int:
        """Free every published object; how many there were."""
        ready = self._table[_STATE] == READY
        self._table[_STATE][ready] = FREE
        return int(ready.sum())

    def release(self, rows: Sequence[int]) -> None:
        """Give back slots this process claimed and will not publish: each row still being
        written by this process is freed (any other is left alone: it is not this process's)."""
        if not rows:
            return
        at = np.asarray(rows, dtype=np.intp)
        table = self._table
        mine = (table[_STATE, at] == WRITING) & (table[_NS : _START + 1, at] == self._me_words[:, None]).all(
            axis=0
        )
        table[_STATE, at[mine]] = FREE

    def remove(self, hashes: Hashes) -> list[bool]:
        """Free the published objects of these hashes; False where there is none."""
        removed = []
        for row in self.find(hashes):
            removed.append(row >= 0 and self._words[row] == READY)  # a key twice: removed once
            if removed[-1]:
                self._words[row] = FREE
        return removed


def outcomes(claims: Claims) -> list[int | PutStatus | None]:
    """What :meth:`ArenaFile.claim` decided for each key: its slot's row, PRESENT, NO_SPACE, or
    None for a repeat of a key earlier in the call."""
    return [_STATUS.get(row, row) for row in claims.tolist()]


def _uses(now: int, order: npt.NDArray[np.int64]) -> Words:
    """The last uses of the objects at ``order`` in a call made at ``now``: ``now - i`` for the
    ``i``-th, so that a request's first blocks are its newest and a full set evicts its last ones
    first (a prefix lookup stops at its first miss: blocks kept after a lost one never hit)."""
    return np.uint64(now) - order.astype(np.uint64)


@attrs.define
class Query:
    """The objects of one get, and what :meth:`ArenaFile.locate` found of them so far."""

    k0: npt.NDArray[np.uint64]  # each key's hash words
    k1: npt.NDArray[np.uint64]
    sets: npt.NDArray[np.int64]  # the set each key lives in
    sizes: npt.NDArray[np.int64]  # the bytes each object must have
    rows: npt.NDArray[np.int64]  # each key's slot; -1: none; UNKNOWN: not looked for yet
    found: npt.NDArray[np.bool_]  # the slot holds an object of that size


def _nearest_existing(path: str) -> str:
    """``path``'s nearest ancestor that exists (``/`` at worst)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path
