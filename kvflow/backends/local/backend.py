"""Local backend: objects in files under one directory (``/dev/shm/kvflow-<uid>`` by default).

Every process on the host that opens the same directory shares the objects and one byte budget;
there is no server. The directory is private to its user unless the URL shares it with a group
(:mod:`kvflow.backends.local.safety`, ``docs/security.md``). A put writes the object to a temp
file, then publishes it with ``link(2)``, which is atomic and never replaces an existing name, so
readers see whole objects only and the first of two writers of a key wins. A get reads header and
payload straight into the caller's regions with ``preadv`` and verifies the xxh3 checksum before
answering ``HIT``. See ``docs/local-backend.md`` for the format, the eviction policy and measured
speed; :mod:`kvflow.backends.local.space` keeps the budget, :mod:`kvflow.backends.local.format` the
format.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes

import anyio
import anyio.lowlevel
import attrs

from kvflow.backends.base import (
    BackendCapabilities,
    BackendStats,
    GetStatus,
    ObjectRef,
    PutStatus,
    repeats_of,
    takes_config,
)
from kvflow.backends.inflight import Lifetime
from kvflow.backends.local.config import LocalConfig, default_path
from kvflow.backends.local.format import (
    HEADER_SIZE,
    Header,
    PayloadChecksum,
    is_object_file_name,
    kept_key,
    kept_key_of,
    key_digest,
    object_file_is_bad,
    object_file_name,
    pieces,
    read_into,
    region_views,
    write_from,
)
from kvflow.backends.local.presence import PresenceMemory
from kvflow.backends.local.safety import LOCK_NAME, Access
from kvflow.backends.local.space import Refusal, Reservation, SpaceLedger
from kvflow.backends.pacing import MIN_PIECE, PIECE, Pacer, PieceSize
from kvflow.errors import BackendError, BackendUnavailableError, ClearStoppedError

__all__ = ["ClearStoppedError", "LocalBackend", "LocalConfig", "default_path", "key_of_file_name"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RESERVE_GROUP = 16  # objects reserved per lock section (a section never awaits)
#: What a put's object ends as when the store holds it for that put (stored, or another writer's
#: copy found in its place): later reservations of the put evict none of those.
_OURS = frozenset({PutStatus.STORED, PutStatus.PRESENT})
_LIST_GROUP = 256  # directory entries listed (or removed, under the lock) between checkpoints
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never hangs us

# Tests only: called with the temp file's path after the header and the first region are written.
_mid_write_hook: Callable[[str], None] | None = None
# Tests only: awaited with an object's file name once a get has read its first piece (so that
# another writer can evict and recycle the file under the reader).
_mid_read_hook: Callable[[str], Awaitable[None]] | None = None
# Tests only: awaited with an object's file name once it is published, before its temp name is
# removed (so that another process can scan the directory in between).
_published_hook: Callable[[str], Awaitable[None]] | None = None
# Tests only: awaited with the file names of the objects that failed verification in a get, before
# they are checked again under the lock (so that another writer can republish one meanwhile).
_before_remove_corrupt_hook: Callable[[list[str]], Awaitable[None]] | None = None


@attrs.define
class LocalBackend:
    """A store in a directory shared by the processes of one host (of one user, or of one group).

    Use an instance from one event loop. A child forked with a copy of it has its calls refused
    (it would write the store as its parent): open one there. Construction is
    synchronous: it creates the directory if needed (no access for others), refuses one that is
    not safe to use, checks it is writable and supports hard links, and removes temp files that
    dead processes left behind. No call keeps waiting work from the event loop for more than about
    a millisecond (2 ms when none waits): copies and checksums of large objects go in 1 MiB pieces
    with checkpoints between them (:mod:`kvflow.backends.pacing`).
    """

    config: LocalConfig = attrs.field(
        factory=LocalConfig, validator=takes_config(LocalConfig, "local:///dev/shm/kvflow?capacity=4GiB")
    )
    _ledger: SpaceLedger = attrs.field(init=False)
    _stats: BackendStats = attrs.field(init=False)
    _presence: PresenceMemory = attrs.field(init=False)
    _life: Lifetime = attrs.field(init=False)  # the calls running: the store's descriptors stay open for them
    # What the kernel's speed allows a piece of a write, and of a read (learnt apart: filling new
    # pages may be slow when reading is not).
    _write_piece: PieceSize = attrs.field(init=False, factory=PieceSize)
    _read_piece: PieceSize = attrs.field(init=False, factory=PieceSize)

    def __attrs_post_init__(self) -> None:
        self._ledger = SpaceLedger.open(
            self.config.path,
            self.config.capacity_bytes,
            self.config.lock_timeout_s,
            Access.of(self.config.group),
        )
        self._stats = BackendStats(capacity_bytes=self.config.capacity_bytes, used_bytes=self._ledger.used)
        self._presence = PresenceMemory(self._ledger.dirs.lock_fd)
        self._life = Lifetime(
            "the local backend was closed; open a new one", release=self._ledger.close, owner=os.getpid()
        )

    @classmethod
    def from_url(cls, url: str) -> LocalBackend:
        return cls(LocalConfig.from_url(url))

    @property
    def max_batch(self) -> int:
        return 64

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(calls_in_turn=True)

    @property
    def root(self) -> str:
        """The absolute path of the store's directory."""
        return self._ledger.root

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Nothing to register: the kernel copies straight from and to any address."""

    def stats(self) -> BackendStats:
        """Counters of this instance; ``used_bytes`` is the directory's usage as last seen."""
        self._stats.used_bytes = self._ledger.used
        self._stats.evictions = self._ledger.evictions
        return self._stats

    async def usage(self, *, recount: bool = True) -> int:
        """The directory's usage in bytes.

        ``recount``: recounted from its files, which also corrects the shared counter; a full scan
        in one lock section, which every other process's puts wait for (about 1 us per object).
        ``recount=False``: the shared counter, read in a section of a few syscalls: what every
        process's budget goes by, off only after a process was killed inside a section (by that
        section's bytes, until the next scan). Raises BackendUnavailableError when the lock stays
        taken.
        """
        with self._life.call():
            async with self._section("count its usage"):
                if recount:
                    self._ledger.scan()
            return self._ledger.used

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        """Store each object unless its key exists (``PRESENT``, which counts as a use for LRU)."""
        with self._life.call(copies=True):
            return await self._put(objects)

    async def _put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        results = [PutStatus.FAILED] * len(objects)
        stamp = time.time_ns()
        pacer = Pacer()
        names = [object_file_name(obj.key) for obj in objects]
        repeats = repeats_of(names)  # a key twice: written once, its repeats answer as the first
        mine: set[str] = set()  # what this put stored or found present: it never evicts those
        todo: list[int] = []
        for i, (obj, name) in enumerate(zip(objects, names)):
            if i in repeats:
                continue
            # Earlier objects of a batch (a prefix's head) get newer stamps, so LRU evicts tails first.
            found = self._touch(obj.key, name, stamp - i)
            if found is None:
                todo.append(i)
            else:
                results[i] = found
                if found is PutStatus.PRESENT:
                    mine.add(name)
        if todo:
            await self._put_new(objects, names, todo, results, stamp, pacer, mine)
        for i, first in repeats.items():
            results[i] = results[first].repeated()
        self._stats.count_puts(objects, results)
        await anyio.lowlevel.checkpoint()
        return results

    async def touch(self, keys: Sequence[str]) -> None:
        """Mark the objects of ``keys`` used now, the first the most recently (their files' times,
        as a get sets them); keys not held are passed over (:class:`~kvflow.backends.base.Touching`)."""
        with self._life.call():
            stamp = time.time_ns()
            seen: set[str] = set()
            # Head first, so that a touch cut short (cancelled) has touched the head; a key twice
            # keeps its first place.
            for i, key in enumerate(keys):
                if key not in seen:
                    seen.add(key)
                    self._touch(key, object_file_name(key), stamp - i)
                if i % 256 == 255:  # (two system calls an object: let the loop run now and then)
                    await anyio.lowlevel.checkpoint()

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        """Fill each object's regions. A corrupt object is a ``MISS`` and is removed."""
        with self._life.call(copies=True):
            return await self._get(objects)

    async def _get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        results: list[GetStatus] = []
        corrupt: list[tuple[str, str, str]] = []
        stamp = time.time_ns()
        pacer = Pacer()
        for i, obj in enumerate(objects):
            results.append(await self._get_one(obj, stamp - i, corrupt, pacer))
            await pacer.tick()
        if corrupt:
            await self._remove_corrupt(corrupt)
        for obj, status in zip(objects, results):
            if status is not GetStatus.HIT:  # perhaps removed by hand, or by a process that died
                self._presence.discard(obj.key)
        self._stats.count_gets(objects, results)
        await anyio.lowlevel.checkpoint()
        return results

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has an object; those this instance found before, and that no process
        removed since (the store's journal says), are answered from memory (:mod:`.presence`)."""
        self._life.check_open()
        memory, dir_fd = self._presence, self._ledger.objects_fd
        try:
            memory.refresh()
        except OSError as exc:
            raise BackendError(
                f"cannot read {self.root}/{LOCK_NAME}: {exc.strerror}; is {self.root} still there?"
            ) from exc
        known = memory.keys
        found = [key in known for key in keys]
        learned: list[tuple[str, str]] = []
        for i, key in enumerate(keys):
            if found[i]:
                continue
            name = object_file_name(key)
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise BackendError(
                    f"cannot check {self.root}/objects/{name}: {exc.strerror}; is {self.root} still "
                    "there and readable?"
                ) from exc
            if self._ledger.access.foreign(st) is None:
                learned.append((key, name))
                found[i] = True
        memory.add(learned)
        return found

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete objects (under the directory lock, so the shared budget stays exact).

        All of them in one lock section, which every other process's puts wait for: give a few
        hundred keys per call at most (``kvflow store clear --model`` gives 256). Raises
        BackendUnavailableError when the lock stays taken (nothing is removed then).
        """
        with self._life.call():
            async with self._section("remove objects"):
                return [self._ledger.remove_if(object_file_name(key), _always) for key in keys]

    # --- listing, for tools (kvflow store) -------------------------------------------------------

    async def list_objects(self) -> list[tuple[str | None, int]]:
        """Every object in the store: ``(key, payload bytes)``. A key too long for a file name is
        read from the object (the key None when an object written before objects kept it). Entries
        that are not kvflow's objects are skipped. Reads the directory without the lock, yielding
        to the loop every 256 entries: a concurrent put or eviction may or may not be seen."""
        found: list[tuple[str | None, int]] = []
        with self._life.call(), os.scandir(self._ledger.objects_fd) as entries:
            for n, entry in enumerate(entries, 1):
                if n % _LIST_GROUP == 0:
                    await anyio.lowlevel.checkpoint()
                if not is_object_file_name(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if self._ledger.access.foreign(st) is not None or st.st_size < HEADER_SIZE:
                    continue
                if entry.name.startswith("~"):
                    found.append(self._kept_key(entry.name))
                else:
                    found.append((key_of_file_name(entry.name), st.st_size - HEADER_SIZE))
        return [(key, nbytes) for key, nbytes in found if nbytes >= 0]

    def _kept_key(self, name: str) -> tuple[str | None, int]:
        """The key and payload bytes of object ``name`` read from its file (-1: gone or unreadable)."""
        try:
            fd = os.open(
                name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=self._ledger.objects_fd,
            )
        except OSError:
            return None, -1
        try:
            return kept_key_of(fd)
        except OSError:
            return None, -1
        finally:
            os.close(fd)

    async def clear(self) -> int:
        """Remove every object (those of every model, and the profile book's), 256 per lock
        section; return how many were removed. Temp files of writes in flight are left alone.

        Raises :class:`ClearStoppedError`, which says how many it had removed, when the lock
        stays taken before a section.
        """
        with self._life.call():
            with os.scandir(self._ledger.objects_fd) as entries:
                names = [e.name for e in entries if is_object_file_name(e.name)]
            removed = 0
            for start in range(0, len(names), _LIST_GROUP):
                try:
                    async with self._section("clear"):
                        for name in names[start : start + _LIST_GROUP]:
                            removed += self._ledger.remove_if(name, _always)
                except BackendUnavailableError as exc:
                    raise ClearStoppedError(str(exc), removed, len(names)) from exc
                await anyio.lowlevel.checkpoint()
            return removed

    async def aclose(self) -> None:
        """Close this instance once no put or get runs (they copy the caller's memory until they
        return; none starts once this has begun); the objects stay in the directory for other
        processes. The store's descriptors are closed once the last call using them has returned
        (a remove still waiting for the lock, say): another store opened meanwhile may be given
        the same numbers."""
        await self._life.close()

    # --- internals ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _section(self, what: str) -> AsyncIterator[None]:
        """A lock section (the body must not await) for a call that reports a lock held past
        ``lock_timeout_s`` as BackendUnavailableError, as the protocol asks of ``remove``; ``what``
        the call does, for the message."""
        try:
            async with self._ledger.locked(self.config.lock_timeout_s):
                yield
        except TimeoutError as exc:
            raise BackendUnavailableError(
                f"the local store {self.root} cannot {what} now: {exc}; then try again"
            ) from exc

    def _touch(self, key: str, name: str, stamp: int) -> PutStatus | None:
        """Mark the object of ``key`` (file ``name``) used: PRESENT; None when there is none (the
        put writes it).

        An entry at its name that is not kvflow's (:meth:`_foreign`) is not an object: FAILED,
        and it is neither touched, replaced nor removed (lookups and gets miss it too).
        """
        fd = self._ledger.objects_fd
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.debug("local backend: could not look at %r: %s", key, exc)
            return PutStatus.FAILED
        if self._foreign(name, st):
            return PutStatus.FAILED
        try:
            os.utime(name, ns=(stamp, stamp), dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # evicted since: written anew
        except PermissionError:
            # Another group member's object: only its owner may set a time, anyone may set "now".
            with contextlib.suppress(OSError):
                os.utime(name, dir_fd=fd, follow_symlinks=False)
        except OSError as exc:  # it is there (a read-only filesystem, an I/O error): its LRU time stays
            logger.debug("local backend: could not mark %r used: %s", key, exc)
        return PutStatus.PRESENT

    def _foreign(self, name: str, st: os.stat_result) -> bool:
        """Whether ``st``, of entry ``name`` in objects/, is not one of kvflow's objects (a symlink,
        a FIFO, another user's file, one open to writes by others); reported once if so. kvflow
        leaves such an entry alone: whoever knows where it came from removes it."""
        problem = self._ledger.access.foreign(st)
        if problem:
            self._ledger.report_foreign("objects", name, problem)
        return problem is not None

    def _taken_by(self, name: str) -> PutStatus:
        """What a put whose publish found ``name`` taken answers: PRESENT, or FAILED when what took
        it is not kvflow's."""
        try:
            st = os.stat(name, dir_fd=self._ledger.objects_fd, follow_symlinks=False)
        except OSError:
            return PutStatus.PRESENT  # (gone already: it was there, another writer's, a moment ago)
        return PutStatus.FAILED if self._foreign(name, st) else PutStatus.PRESENT

    async def _put_new(
        self,
        objects: Sequence[ObjectRef],
        names: Sequence[str],
        todo: list[int],
        results: list[PutStatus],
        stamp: int,
        pacer: Pacer,
        mine: set[str],
    ) -> None:
        """Reserve and write ``todo`` (the objects' file ``names``) in groups, so that no lock
        section holds the loop long; ``mine``: the names this put stored or found present, which
        its reservations never evict (it adds those it stores or finds taken)."""
        refused: Refusal | None = None  # what later sections may refuse without looking
        for start in range(0, len(todo), _RESERVE_GROUP):
            group = todo[start : start + _RESERVE_GROUP]
            kept = [kept_key(objects[i].key, names[i]) for i in group]
            sizes = [HEADER_SIZE + objects[i].nbytes + len(k) for i, k in zip(group, kept)]
            try:
                async with self._ledger.locked(self.config.lock_timeout_s):
                    plan = self._ledger.reserve(sizes, keep=mine, refused=refused)
                    refused = self._ledger.refusal(sizes, plan, refused)
            except (TimeoutError, OSError) as exc:
                logger.warning("local backend: a put of %d objects failed: %s", len(todo) - start, exc)
                return  # the rest stay FAILED
            try:
                for i, key, res in zip(group, kept, plan):
                    await pacer.tick()
                    if isinstance(res, PutStatus):
                        results[i] = res
                        continue
                    results[i] = await self._write_one(objects[i], names[i], key, res, stamp - i, pacer)
                    if results[i] in _OURS:
                        mine.add(names[i])
            finally:
                leftovers = [r for r in plan if isinstance(r, Reservation) and not r.settled]
                if leftovers:
                    with anyio.CancelScope(shield=True):
                        await self._release(leftovers)

    async def _write_one(
        self, obj: ObjectRef, name: str, kept: bytes, res: Reservation, stamp: int, pacer: Pacer
    ) -> PutStatus:
        """Write an object (and the key ``kept`` after it) into its reservation's temp file and
        publish it as ``name``.

        Awaits between 1 MiB pieces of a large object; a cancellation there leaves the reservation
        unsettled, and the caller releases it.
        """
        try:
            views = region_views(obj.addrs, obj.sizes)
            checksum = PayloadChecksum()
            for n, piece in enumerate(pieces(views, PIECE)):
                if n:
                    await pacer.tick()
                checksum.update(piece)
            header = Header(obj.nbytes, 0, key_digest(obj.key), len(kept))
            parts = [memoryview(attrs.evolve(header, checksum=checksum.value(header)).pack()), *views]
            if kept:
                parts.append(memoryview(kept))
            hook = _mid_write_hook
            if hook is None or len(views) < 2:
                await _write_pieces(res.fd, parts, 0, pacer, self._write_piece)
            else:
                offset = await _write_pieces(res.fd, parts[:2], 0, pacer, self._write_piece)
                hook(f"{self.root}/tmp/{res.name}")
                await _write_pieces(res.fd, parts[2:], offset, pacer, self._write_piece)
            os.utime(res.fd, ns=(stamp, stamp))
        except OSError as exc:
            logger.debug("local backend: writing %r failed: %s", obj.key, exc)
            return PutStatus.NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else PutStatus.FAILED
        finally:
            os.close(res.fd)
            res.fd = -1
        tmp_fd, objects_fd = self._ledger.tmp_fd, self._ledger.objects_fd
        try:
            os.link(
                res.name,
                name,
                src_dir_fd=tmp_fd,
                dst_dir_fd=objects_fd,
                follow_symlinks=False,
            )
        except FileExistsError:
            return self._taken_by(name)
        except OSError as exc:
            logger.debug("local backend: publishing %r failed: %s", obj.key, exc)
            return PutStatus.FAILED
        res.settled = True  # the bytes now belong to the published object
        if _published_hook is not None:
            await _published_hook(name)
        try:
            os.unlink(res.name, dir_fd=tmp_fd)
        except OSError as exc:
            logger.debug("local backend: could not remove %s/tmp/%s: %s", self.root, res.name, exc)
        return PutStatus.STORED

    async def _release(self, reservations: list[Reservation]) -> None:
        try:
            async with self._ledger.locked(self.config.lock_timeout_s):
                self._ledger.release(reservations)
        except TimeoutError as exc:
            # Free the files anyway; the shared counter stays high until the next scan.
            logger.warning("local backend: %s; removing %d temp files unlocked", exc, len(reservations))
            for res in reservations:
                if res.fd >= 0:
                    os.close(res.fd)
                    res.fd = -1
                with contextlib.suppress(OSError):
                    os.unlink(res.name, dir_fd=self._ledger.tmp_fd)

    async def _get_one(
        self, obj: ObjectRef, stamp: int, corrupt: list[tuple[str, str, str]], pacer: Pacer
    ) -> GetStatus:
        name = object_file_name(obj.key)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self._ledger.objects_fd)
        except FileNotFoundError:
            return GetStatus.MISS
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._ledger.report_foreign("objects", name, "a symbolic link")
                return GetStatus.MISS
            logger.debug("local backend: opening %r failed: %s", obj.key, exc)
            return GetStatus.FAILED
        try:
            foreign = self._ledger.access.foreign(os.fstat(fd))
            if foreign:
                self._ledger.report_foreign("objects", name, foreign)
                return GetStatus.MISS
            views = region_views(obj.addrs, obj.sizes)
            header_buf = bytearray(HEADER_SIZE)
            # One read and one checksum pass (nothing to pace) if the object fits in a piece.
            whole = HEADER_SIZE + obj.nbytes <= self._read_piece.nbytes
            if whole:
                got = _timed(
                    self._read_piece, HEADER_SIZE + obj.nbytes, read_into, fd, [header_buf, *views], 0
                )
            else:
                hook = _mid_read_hook
                after_first = None if hook is None else partial(hook, name)
                bufs = [memoryview(header_buf), *views]
                got = await _read_pieces(fd, bufs, pacer, self._read_piece, after_first)
            header = Header.unpack(header_buf) if got >= HEADER_SIZE else None
            problem = ""
            if header is None:
                problem = "no valid header"
            elif header.digest != key_digest(obj.key):
                problem = "a header for another key"
            elif header.payload_len != obj.nbytes:
                if os.fstat(fd).st_size == header.file_size:
                    logger.debug(
                        "local backend: %r holds %d bytes, %d requested",
                        obj.key,
                        header.payload_len,
                        obj.nbytes,
                    )
                    return GetStatus.FAILED
                problem = "a length that does not match the file"
            elif got < HEADER_SIZE + obj.nbytes:
                problem = "a truncated payload"
            else:
                checksum = PayloadChecksum()
                if whole:
                    checksum.update(views)
                else:
                    for n, piece in enumerate(pieces(views, PIECE)):
                        if n:
                            await pacer.tick()
                        checksum.update(piece)
                if checksum.value(header) != header.checksum:
                    problem = "a checksum mismatch"
            if problem:
                corrupt.append((name, obj.key, problem))
                return GetStatus.MISS
            _touch_fd(fd, stamp)
            return GetStatus.HIT
        except OSError as exc:
            logger.debug("local backend: reading %r failed: %s", obj.key, exc)
            return GetStatus.FAILED
        finally:
            os.close(fd)

    async def _remove_corrupt(self, corrupt: list[tuple[str, str, str]]) -> None:
        """Remove objects that failed verification, unless a re-check under the lock passes.

        A failed read can also be an object evicted and recycled while it was read; the re-check
        reads the file under the lock (no recycling then) and leaves a good object alone.
        """
        hook = _before_remove_corrupt_hook
        if hook is not None:
            await hook([name for name, _, _ in corrupt])
        removed = 0
        try:
            async with self._ledger.locked(self.config.lock_timeout_s):
                for name, key, _ in corrupt:
                    if self._ledger.remove_if(name, partial(object_file_is_bad, key=key)):
                        removed += 1
        except (TimeoutError, OSError) as exc:
            logger.warning("local backend: could not remove corrupt objects: %s", exc)
            return
        if removed:
            name, key, problem = corrupt[0]
            logger.warning(
                "local backend: removed %d corrupt object(s) from %s; first: %r (%s)",
                removed,
                self.root,
                key,
                problem,
            )


def _always(*_: Any) -> bool:
    return True


def key_of_file_name(name: str) -> str | None:
    """The key an object file's name stands for (the inverse of ``object_file_name``), or None for
    a digest name (``~`` + hex): the object keeps that key (:func:`kept_key_of`)."""
    if name.startswith("~"):
        return None
    try:
        return unquote_to_bytes(name).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def _touch_fd(fd: int, stamp: int) -> None:
    """Mark an open object used (best effort: a hit stays a hit when its time cannot be set)."""
    try:
        os.utime(fd, ns=(stamp, stamp))
    except PermissionError:
        with contextlib.suppress(OSError):
            os.utime(fd)  # another group member's object: "now" needs write access only
    except OSError as exc:
        logger.debug("local backend: could not mark an object used: %s", exc)


def _timed(size: PieceSize, nbytes: int, copy: Callable[..., T], *args: object) -> T:
    """``copy(*args)``, a kernel copy of ``nbytes``, its CPU time told to ``size``; not timed for a
    piece of at most :data:`MIN_PIECE`, which can teach ``size`` nothing smaller (and the clock of
    the thread's CPU time costs a system call, about 0.5 us, on every small object)."""
    if nbytes <= MIN_PIECE:
        return copy(*args)
    started = time.thread_time()
    result = copy(*args)
    size.took(nbytes, time.thread_time() - started)
    return result


async def _write_pieces(
    fd: int, bufs: Sequence[memoryview], offset: int, pacer: Pacer, size: PieceSize
) -> int:
    """Write ``bufs`` at ``offset`` in pieces of ``size``, letting the loop run between; the end offset."""
    for n, piece in enumerate(pieces(bufs, lambda: size.nbytes)):
        if n:
            await pacer.tick()
        nbytes = sum(v.nbytes for v in piece)
        _timed(size, nbytes, write_from, fd, piece, offset)
        offset += nbytes
    return offset


async def _read_pieces(
    fd: int,
    bufs: Sequence[memoryview],
    pacer: Pacer,
    size: PieceSize,
    after_first: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Fill ``bufs`` from the start of the file in pieces of ``size``; the bytes read (fewer at its
    end). ``after_first``: a test hook, awaited after the first piece."""
    got = 0
    for n, piece in enumerate(pieces(bufs, lambda: size.nbytes)):
        if n:
            await pacer.tick()
            if n == 1 and after_first is not None:
                await after_first()
        want = sum(v.nbytes for v in piece)
        done = _timed(size, want, read_into, fd, piece, got)
        got += done
        if done < want:
            break
    return got
