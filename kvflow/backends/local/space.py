"""The local backend's byte budget, shared by every process that opens the same directory.

Directory layout::

    <root>/kvflow.lock   flock(2) target; holds the shared usage counter (16 bytes)
    <root>/objects/      published objects, immutable once linked here
    <root>/tmp/          writes in flight: ``TempName`` files, each reserving its bytes

Usage is "file sizes of every object + file sizes of every live writer's temp file", each inode
counted once (a published object keeps its temp name until its writer unlinks it): a writer sizes
its temp file to its reservation (``ftruncate``, which allocates nothing yet) as it makes it, so what
is counted is always what is on disk, never a number someone wrote into a name. Entries that are not
kvflow's (other names, not regular files, other owners) are ignored, logged once, and not counted.
Every change of usage
happens inside a *section*: the exclusive flock held, no ``await`` inside. Sections are short (a
few syscalls per object) except a *scan*, which lists the temp files and the objects, recounts usage
from them and rebuilds this process's eviction candidate list. The counter in the lock file is only
a cache of that truth: a process killed inside a section skews it by at most that section's bytes,
until the next scan; opening a directory that holds dead writers' temp files removes them and
recounts.

Eviction is LRU by file mtime: a hit or a repeated put sets the mtime to "now". A scan sorts the
objects oldest first; popping a candidate re-checks its inode and mtime, so an object touched since
the scan is skipped (it is no longer least recently used) and the order stays exact. An evicted
file is not freed but renamed into ``tmp/`` as the new writer's temp file: its pages are
reused, which on tmpfs saves allocating, zeroing and freeing them (the dominant cost of a put).

Each instance belongs to one event loop; the flock belongs to its own open file description, so
two instances in one process exclude each other like two processes do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Container, Iterator, Sequence

import anyio
import attrs

from kvflow.backends.base import PutStatus
from kvflow.backends.local.format import TempName, WriterId, is_object_file_name
from kvflow.backends.local.presence import JOURNAL_END, append_removed, read_journal_count
from kvflow.backends.local.safety import LOCK_NAME, Access, StoreDirs, unusable_message
from kvflow.errors import BackendUnavailableError, ConfigError

__all__ = ["Refusal", "Reservation", "SpaceLedger"]

logger = logging.getLogger(__name__)

_COUNTER = struct.Struct("<8sQ")
_COUNTER_MAGIC = b"KVFLUSE1"
_BACKOFF_MIN_S = 50e-6
_BACKOFF_MAX_S = 2e-3
_REPORT_LIMIT = 10_000  # foreign entries remembered as reported, per instance


@attrs.define
class Reservation:
    """Bytes reserved for one object being written, and the temp file that holds them.

    The temp file is already ``nbytes`` long (the reservation is its size). The writer owns ``fd``
    (open for writing) until it closes it and sets it to -1. ``settled`` turns true once the object
    is published or the reservation released: from then on the bytes belong to the object (or to
    nobody) and releasing it again does nothing.
    """

    name: str
    nbytes: int
    fd: int
    settled: bool = False


@attrs.frozen
class Refusal:
    """A put's section found no room for an object of ``nbytes`` with ``used`` bytes in use and
    ``removals`` objects removed from the store (its journal's count), while no other write was
    in flight (one would publish an object that could be evicted): while both stay as they are
    (no writer reserved, released or removed anything since: no room freed, nothing new to
    evict), its later sections need not look for objects of that size or larger. (Unseen until
    the put ends: a file removed by hand, or a reservation and a release of the same size, by
    others, between two sections.)"""

    nbytes: int
    used: int
    removals: int


@attrs.frozen(slots=True, order=True)
class _Candidate:
    mtime_ns: int
    name: str
    ino: int
    size: int


@attrs.define
class SpaceLedger:
    """The shared budget of one directory, seen from one backend instance.

    Call :meth:`locked` from the owning event loop; call the other public methods only inside it.
    Owns the store's descriptors (:class:`StoreDirs`) and closes them in :meth:`close`.
    """

    dirs: StoreDirs
    capacity: int
    writer: WriterId = attrs.field(factory=WriterId.current)
    used: int = 0
    evictions: int = 0
    _candidates: deque[_Candidate] = attrs.field(factory=deque)
    _rescanned: bool = False
    _pending: set[str] = attrs.field(factory=set)  # temp files made in this section, not yet in used
    _token: str = attrs.field(factory=lambda: secrets.token_hex(4))
    _seq: int = 0
    _reported: set[str] = attrs.field(factory=set)
    _gone: list[str] = attrs.field(factory=list)  # objects removed in this section, for the journal
    # candidates that the reservations of a put passed over, being its own (:meth:`reserve`)
    _passed: list[_Candidate] = attrs.field(factory=list)
    # the live writers' temp files a scan in this section saw: writes that may publish during it
    _writing: set[str] = attrs.field(factory=set)

    @property
    def root(self) -> str:
        return self.dirs.root

    @property
    def access(self) -> Access:
        return self.dirs.access

    @property
    def objects_fd(self) -> int:
        return self.dirs.objects_fd

    @property
    def tmp_fd(self) -> int:
        return self.dirs.tmp_fd

    @classmethod
    def open(cls, path: str, capacity: int, lock_timeout_s: float, access: Access) -> SpaceLedger:
        """Create or open the directory, prove it safe and usable, and clean up after dead writers.

        Raises ConfigError for a directory this process cannot use (or must not: see
        :mod:`kvflow.backends.local.safety`), BackendUnavailableError when the lock stays taken.
        """
        dirs = StoreDirs.open(path, access)
        ledger = cls(dirs, capacity)
        try:
            ledger._check_links()
            with ledger.locked_blocking(lock_timeout_s):
                ledger.recover()
                if os.fstat(dirs.lock_fd).st_size < JOURNAL_END:
                    os.posix_fallocate(dirs.lock_fd, 0, JOURNAL_END)
            vfs = os.statvfs(dirs.root_fd)
        except TimeoutError as exc:
            dirs.close()
            raise BackendUnavailableError(f"cannot open the local backend: {exc}") from exc
        except OSError as exc:
            dirs.close()
            raise ConfigError(unusable_message(dirs.root, exc)) from exc
        except BaseException:
            dirs.close()
            raise
        if capacity > vfs.f_blocks * vfs.f_frsize:
            logger.warning(
                "local backend capacity %d exceeds the size of the filesystem of %s (%d bytes); "
                "puts will report NO_SPACE when it fills",
                capacity,
                dirs.root,
                vfs.f_blocks * vfs.f_frsize,
            )
        logger.debug(
            "local backend opened %s (%s, capacity %d, used %d)",
            dirs.root,
            access.describe(),
            capacity,
            ledger.used,
        )
        return ledger

    def close(self) -> None:
        self.dirs.close()

    def _check_links(self) -> None:
        """Create, hard-link and remove a probe file: proves the directory is writable and links work."""
        probe, link = self._new_temp_name(0), self._new_temp_name(0)
        tmp = self.tmp_fd
        try:
            os.close(os.open(probe, _NEW_FILE, self.access.file_mode, dir_fd=tmp))
            try:
                os.link(probe, link, src_dir_fd=tmp, dst_dir_fd=tmp, follow_symlinks=False)
                os.unlink(link, dir_fd=tmp)
            finally:
                os.unlink(probe, dir_fd=tmp)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ConfigError(unusable_message(self.root, exc)) from exc
            raise ConfigError(
                f"the local backend cannot write objects in {self.root}: {exc.strerror or exc}. It needs "
                "a writable directory on a local filesystem with hard links (tmpfs, ext4, xfs), "
                "e.g. local:// (a private directory in /dev/shm)"
            ) from exc

    # --- the lock -------------------------------------------------------------------------------

    def _try_lock(self) -> bool:
        try:
            fcntl.flock(self.dirs.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _begin(self) -> None:
        """Load the counter (or recount it) once the lock is held; unlocks again if that fails."""
        try:
            data = os.pread(self.dirs.lock_fd, _COUNTER.size, 0)
            self._rescanned = False
            self._pending.clear()
            self._gone.clear()
            self._writing.clear()
            if len(data) == _COUNTER.size:
                magic, used = _COUNTER.unpack(data)
                if magic == _COUNTER_MAGIC:
                    self.used = used
                    return
            self.scan()
        except BaseException:
            fcntl.flock(self.dirs.lock_fd, fcntl.LOCK_UN)
            raise

    def _end(self) -> None:
        try:
            if self._gone:  # after the removals: whoever found one of them before it went sees its entry
                append_removed(self.dirs.lock_fd, read_journal_count(self.dirs.lock_fd), self._gone)
            os.pwrite(self.dirs.lock_fd, _COUNTER.pack(_COUNTER_MAGIC, max(self.used, 0)), 0)
        finally:
            fcntl.flock(self.dirs.lock_fd, fcntl.LOCK_UN)

    @contextlib.asynccontextmanager
    async def locked(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold the directory lock for one section; the body must not await.

        Waits by polling with backoff so the event loop keeps running; raises TimeoutError after
        ``timeout_s``.
        """
        delay = _BACKOFF_MIN_S
        deadline = time.monotonic() + timeout_s
        while not self._try_lock():
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout_s}s for the lock {self.root}/{LOCK_NAME}; "
                    "another process holds it: look for a stopped or stuck kvflow process "
                    "(`lslocks` shows its PID)"
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)
        self._begin()
        try:
            yield
        finally:
            self._end()

    @contextlib.contextmanager
    def locked_blocking(self, timeout_s: float) -> Iterator[None]:
        """:meth:`locked` for synchronous set-up code (the constructor); sleeps while waiting."""
        deadline = time.monotonic() + timeout_s
        while not self._try_lock():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout_s}s for the lock {self.root}/{LOCK_NAME}")
            time.sleep(_BACKOFF_MAX_S)
        self._begin()
        try:
            yield
        finally:
            self._end()

    # --- sections -------------------------------------------------------------------------------

    def reserve(
        self, sizes: Sequence[int], keep: Container[str] = (), refused: Refusal | None = None
    ) -> list[Reservation | PutStatus]:
        """Reserve ``sizes[i]`` bytes for each object, evicting LRU objects to make room, but none
        named in ``keep`` (the objects the put making room stored or found present: a put never
        evicts its own, which would give a prompt's head for its tail), and none for an object
        that cannot fit anyway. Once an object finds no room, larger ones and those of its size
        answer NO_SPACE without looking again, as do those that ``refused`` (from an earlier
        section of the put: :meth:`refusal`) still holds for: a put larger than the store would
        otherwise walk every candidate again for each of its objects.

        Each result is a reservation, or the status to report (``NO_SPACE``, ``FAILED``). The first
        victim evicted for an object becomes that object's temp file.
        """
        results: list[Reservation | PutStatus] = []
        limit = refused.nbytes if refused is not None and self._holds(refused) else self.capacity + 1
        try:
            for nbytes in sizes:
                if nbytes >= limit:
                    results.append(PutStatus.NO_SPACE)
                    continue
                try:
                    results.append(self._reserve_one(nbytes, keep))
                except OSError as exc:
                    logger.debug("cannot reserve %d bytes in %s: %s", nbytes, self.root, exc)
                    no_space = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    results.append(PutStatus.NO_SPACE if no_space else PutStatus.FAILED)
                finally:
                    for name in self._pending:  # a temp file that did not become a reservation
                        self._unlink(self.tmp_fd, name)
                    self._pending.clear()
                if results[-1] is PutStatus.NO_SPACE:
                    limit = nbytes
        finally:
            # Back in their places, for the next put: taken from the front of the list (sorted), they
            # are older than all it holds (those in it on failure: :meth:`_victims`).
            self._candidates.extendleft(reversed(self._passed))
            self._passed.clear()
        return results

    def refusal(
        self, sizes: Sequence[int], plan: Sequence[Reservation | PutStatus], earlier: Refusal | None
    ) -> Refusal | None:
        """What a put's next section may refuse without looking, after one that reserved ``plan``
        for ``sizes`` (``earlier``: what the section before it passed on): the smallest object
        found no room for, while the store stays as it is now. None also when the store cannot
        be read, or anything else fails (the section's reservations stand: this never raises)."""
        no_room = [n for n, res in zip(sizes, plan) if res is PutStatus.NO_SPACE]
        try:
            if earlier is not None and self._holds(earlier):
                no_room.append(earlier.nbytes)
            if not no_room:
                return None
            own = {res.name for res in plan if isinstance(res, Reservation)}
            if (self._writing | self._writing_now()) - own:  # another write in flight, or one then
                return None
            return Refusal(min(no_room), self.used, self._removals())
        except OSError as exc:
            logger.debug("%s: a put's sections look for room each: %s", self.root, exc)
            return None
        except Exception:  # a shortcut only: the put goes on, each section looking for room
            logger.warning("%s: a put's sections look for room each", self.root, exc_info=True)
            return None

    def _writing_now(self) -> set[str]:
        """The temp files of live writers in tmp/ now (those a scan counts; others are ignored)."""
        alive: dict[WriterId, bool] = {}
        found = set()
        for name in os.listdir(self.tmp_fd):
            temp = TempName.parse(name)
            if temp is None:
                continue
            if temp.writer not in alive:
                alive[temp.writer] = temp.writer.is_alive(self.writer)
            if alive[temp.writer]:
                found.add(name)
        return found

    def _holds(self, refused: Refusal) -> bool:
        """Whether ``refused`` still holds: the store as it was when it was made."""
        return self.used == refused.used and self._removals() == refused.removals

    def _removals(self) -> int:
        """The objects removed from the store, this section's among them (journaled as it ends)."""
        return read_journal_count(self.dirs.lock_fd) + len(self._gone)

    def _reserve_one(self, nbytes: int, keep: Container[str]) -> Reservation | PutStatus:
        if nbytes > self.capacity:
            return PutStatus.NO_SPACE
        recycled: _Candidate | None = None
        while self.used + nbytes > self.capacity:
            victims = self._victims(nbytes, keep)
            if not victims:
                break
            for victim in victims:
                # A victim removed outside kvflow since its stat is no eviction, but its bytes are free.
                if recycled is None:
                    name = self._new_temp_name(nbytes)
                    try:
                        os.rename(victim.name, name, src_dir_fd=self.objects_fd, dst_dir_fd=self.tmp_fd)
                    except FileNotFoundError:
                        evicted = False
                    else:
                        self._pending.add(name)
                        recycled = attrs.evolve(victim, name=name)
                        evicted = True
                else:
                    removed = self._unlink(self.objects_fd, victim.name)
                    if removed is None:  # it could not be removed: still there, its bytes still used
                        continue
                    evicted = removed
                self._gone.append(victim.name)
                self.evictions += evicted
                self.used -= victim.size
        if self.used + nbytes > self.capacity:
            return PutStatus.NO_SPACE  # a recycled victim is removed by the caller
        reservation = self._open_reservation(nbytes, recycled)
        self.used += nbytes
        return reservation

    def release(self, reservations: Sequence[Reservation]) -> None:
        """Give back reservations whose objects were not published, removing their temp files."""
        for res in reservations:
            if res.fd >= 0:
                os.close(res.fd)
                res.fd = -1
            if not res.settled:
                self._unlink(self.tmp_fd, res.name)
                self.used -= res.nbytes
                res.settled = True

    def remove_if(self, name: str, is_bad: Callable[[int, str], bool]) -> bool:
        """Remove object ``name`` if ``is_bad(objects_fd, name)`` still says so (checked under the lock).

        An entry that is not kvflow's is left alone (it was never counted).
        """
        try:
            st = os.stat(name, dir_fd=self.objects_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        problem = self.access.foreign(st)
        if problem:
            self.report_foreign("objects", name, problem)
            return False
        if not is_bad(self.objects_fd, name):
            return False
        if self._unlink(self.objects_fd, name) is None:  # still there (logged): nothing removed
            return False
        self._gone.append(name)
        self.used -= st.st_size
        return True

    def scan(self) -> None:
        """Recount usage from the files, drop dead writers' temp files, rebuild the candidates."""
        started = time.monotonic()
        self._rescanned = True
        self._passed.clear()  # (listed again)
        # Temp files first, so that a write published meanwhile is seen in one list or both, and by
        # inode, so that it is counted once: a published object keeps its temp name until its writer
        # unlinks that, outside the lock.
        used, _, counted = self._clean_temp_files()
        candidates: list[_Candidate] = []
        with os.scandir(self.objects_fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                problem = self.access.foreign(st)
                if not problem and not is_object_file_name(entry.name):
                    problem = "not an object file name"
                if problem:
                    self.report_foreign("objects", entry.name, problem)
                    continue
                if st.st_ino not in counted:
                    used += st.st_size
                candidates.append(_Candidate(st.st_mtime_ns, entry.name, st.st_ino, st.st_size))
        candidates.sort()
        self._candidates = deque(candidates)
        self.used = used
        logger.debug(
            "scanned %s: %d objects, %d bytes in use, %.1f ms",
            self.root,
            len(candidates),
            self.used,
            (time.monotonic() - started) * 1e3,
        )

    def recover(self) -> None:
        """Remove temp files of dead writers; if there were any, recount usage from the files."""
        if self._clean_temp_files()[1]:
            self.scan()

    def _clean_temp_files(self) -> tuple[int, int, set[int]]:
        """Remove temp files of dead writers; return the bytes of live writers' files, how many
        files were removed, and the inodes of the live files (one may also be linked as an object).
        """
        live = removed = 0
        inodes: set[int] = set()
        alive: dict[WriterId, bool] = {}
        with os.scandir(self.tmp_fd) as entries:
            for entry in entries:
                if entry.name in self._pending:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                temp = TempName.parse(entry.name)
                problem = "not a temp file name" if temp is None else self.access.foreign(st)
                if problem or temp is None:
                    self.report_foreign("tmp", entry.name, problem or "")
                    continue
                if temp.writer not in alive:
                    alive[temp.writer] = temp.writer.is_alive(self.writer)
                if alive[temp.writer]:
                    live += st.st_size
                    inodes.add(st.st_ino)
                    self._writing.add(entry.name)
                    continue
                self._unlink(self.tmp_fd, entry.name)
                removed += 1
                logger.debug(
                    "removed %s/tmp/%s, left by dead process %d", self.root, entry.name, temp.writer.pid
                )
        return live, removed, inodes

    # --- helpers --------------------------------------------------------------------------------

    def report_foreign(self, where: str, name: str, problem: str) -> None:
        """Log an entry that is not kvflow's, once per entry and instance."""
        path = f"{self.root}/{where}/{name}"
        if path in self._reported:
            return
        if len(self._reported) < _REPORT_LIMIT:
            self._reported.add(path)
        logger.warning(
            "local backend: ignoring %r, which is not kvflow's (%s); it is not counted or used. Remove "
            "it if you know where it came from; in a private store, find out who could write there",
            path,
            problem,
        )

    def _victims(self, nbytes: int, keep: Container[str]) -> list[_Candidate]:
        """The least recently used objects whose eviction makes room for ``nbytes``, none named in
        ``keep``; nothing evicted yet. Empty when none is needed (a scan recounted what is used
        and found the room) or when they cannot make it: then every one looked at stays a
        candidate, in its place."""
        found: list[_Candidate] = []
        freed = 0
        while self.used - freed + nbytes > self.capacity:
            victim = self._next_victim(keep)
            if victim is not None:
                found.append(victim)
                freed += victim.size
            elif not self._rescanned:
                # The list ran out: list every object again, in order (those found so far too,
                # still there), and recount what is used; then pick again from the start.
                self.scan()
                found, freed = [], 0
            else:  # every candidate was looked at: the list is empty, and holds them again
                self._candidates.extend(sorted([*found, *self._passed]))
                self._passed.clear()
                return []
        return found

    def _next_victim(self, keep: Container[str]) -> _Candidate | None:
        """The least recently used object of the list not in ``keep`` (set aside, to go back in its
        place once the reservations end: :meth:`reserve`), its size read again; None when the
        list is empty."""
        while self._candidates:
            candidate = self._candidates.popleft()
            if candidate.name in keep:
                self._passed.append(candidate)
                continue
            try:
                st = os.stat(candidate.name, dir_fd=self.objects_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_ino == candidate.ino and st.st_mtime_ns == candidate.mtime_ns:
                return attrs.evolve(candidate, size=st.st_size)
        return None

    def _open_reservation(self, nbytes: int, recycled: _Candidate | None) -> Reservation:
        """Open the temp file of a reservation, sized to it: a recycled victim, else a new file."""
        if recycled is not None:
            try:
                fd = os.open(recycled.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.tmp_fd)
            except OSError:  # e.g. another user's file: start afresh
                self._unlink(self.tmp_fd, recycled.name)
                self._pending.discard(recycled.name)
            else:
                return self._sized(Reservation(recycled.name, nbytes, fd), recycled.size)
        name = self._new_temp_name(nbytes)
        fd = os.open(name, _NEW_FILE, self.access.file_mode, dir_fd=self.tmp_fd)
        self._pending.add(name)
        try:
            os.fchmod(fd, self.access.file_mode)  # exactly, whatever the umask
        except BaseException:
            os.close(fd)
            raise
        return self._sized(Reservation(name, nbytes, fd), 0)

    def _sized(self, res: Reservation, size: int) -> Reservation:
        """Make the temp file ``res.nbytes`` long; a reservation from then on (closes it on failure)."""
        try:
            if size != res.nbytes:
                os.ftruncate(res.fd, res.nbytes)
        except BaseException:
            os.close(res.fd)
            raise
        self._pending.discard(res.name)
        return res

    def _new_temp_name(self, nbytes: int) -> str:
        self._seq += 1
        return TempName(self.writer, nbytes, f"{self._token}{self._seq:x}").format()

    def _unlink(self, dir_fd: int, name: str) -> bool | None:
        """Remove ``name``: True; False when it was not there; None when it could not be removed
        (logged: it is still there, and its bytes still count)."""
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning("could not remove %s from %s: %s", name, self.root, exc)
            return None
        return True


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
