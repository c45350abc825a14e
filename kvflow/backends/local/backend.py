"""Local backend: objects in files under one directory (``/dev/shm/kvflow`` by default).

Every process on the host that opens the same directory shares the objects and one byte budget;
there is no server. A put writes the object to a temp file, then publishes it with ``link(2)``,
which is atomic and never replaces an existing name, so readers see whole objects only and the
first of two writers of a key wins. A get reads header and payload straight into the caller's
regions with one ``preadv`` and verifies the xxh3 checksum before answering ``HIT``. See
``docs/local-backend.md`` for the format, the eviction policy and measured speed;
:mod:`kvflow.backends.local.space` keeps the budget, :mod:`kvflow.backends.local.format` the format.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from urllib.parse import unquote, urlsplit

import anyio
import anyio.lowlevel
import attrs

from kvflow.backends.base import BackendCapabilities, BackendStats, GetStatus, ObjectRef, PutStatus
from kvflow.backends.local.format import (
    HEADER_SIZE,
    Header,
    key_digest,
    object_file_is_bad,
    object_file_name,
    payload_checksum,
    read_into,
    region_views,
    write_from,
)
from kvflow.backends.local.space import Reservation, SpaceLedger
from kvflow.config import parse_seconds, parse_size, parse_url_query, positive_int, positive_seconds
from kvflow.errors import BackendError, ConfigError, PoolClosedError

__all__ = ["LocalBackend", "LocalConfig"]

logger = logging.getLogger(__name__)

_DEFAULT_PATH = "/dev/shm/kvflow"
_DEFAULT_CAPACITY = 4 << 30
_YIELD_EVERY_S = 0.0005  # the longest a batch holds the event loop between checkpoints (plus one object)
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# Tests only: called with the temp file's path after the header and the first region are written.
_mid_write_hook: Callable[[str], None] | None = None


@attrs.frozen
class LocalConfig:
    """``local:///dev/shm/kvflow?capacity=8GiB&lock_timeout=10``.

    ``capacity_bytes`` is the budget of the whole directory, shared by every process using it (give
    them all the same value). ``lock_timeout_s`` bounds each wait for the directory lock.
    """

    path: str = _DEFAULT_PATH
    capacity_bytes: int = attrs.field(default=_DEFAULT_CAPACITY, validator=positive_int)
    lock_timeout_s: float = attrs.field(default=10.0, validator=positive_seconds)

    @classmethod
    def from_url(cls, url: str) -> LocalConfig:
        params = parse_url_query(url, scheme="local", allowed={"capacity", "lock_timeout"})
        parts = urlsplit(url)
        if parts.netloc:
            raise ConfigError(
                f"{url!r} names a host ({parts.netloc!r}); the local backend takes a directory: "
                "write local:///absolute/path (three slashes)"
            )
        path = unquote(parts.path) or _DEFAULT_PATH
        capacity = parse_size(params["capacity"]) if "capacity" in params else _DEFAULT_CAPACITY
        timeout = parse_seconds(params.get("lock_timeout", "10"), f"lock_timeout in {url!r}")
        return cls(path, capacity, timeout)


@attrs.define
class _Pacer:
    """Checkpoints when the loop has been held longer than ``_YIELD_EVERY_S``."""

    last: float = attrs.field(factory=time.monotonic)

    async def tick(self) -> None:
        if time.monotonic() - self.last >= _YIELD_EVERY_S:
            await anyio.lowlevel.checkpoint()
            self.last = time.monotonic()


@attrs.define
class LocalBackend:
    """A store in a directory shared by the processes of one host.

    Use an instance from one event loop; do not share it across ``fork``. Construction is
    synchronous: it creates the directory if needed, checks it is writable and supports hard
    links, and removes temp files that dead processes left behind.
    """

    config: LocalConfig = attrs.field(factory=LocalConfig)
    _ledger: SpaceLedger = attrs.field(init=False)
    _stats: BackendStats = attrs.field(init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _header_buf: bytearray = attrs.field(factory=lambda: bytearray(HEADER_SIZE), init=False)

    def __attrs_post_init__(self) -> None:
        self._ledger = SpaceLedger.open(
            self.config.path, self.config.capacity_bytes, self.config.lock_timeout_s
        )
        self._stats = BackendStats(capacity_bytes=self.config.capacity_bytes, used_bytes=self._ledger.used)

    @classmethod
    def from_url(cls, url: str) -> LocalBackend:
        return cls(LocalConfig.from_url(url))

    @property
    def max_batch(self) -> int:
        return 64

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities()

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

    async def usage(self) -> int:
        """Recount the directory's usage from its files (a full scan under the lock) and return it."""
        self._check_open()
        async with self._ledger.locked(self.config.lock_timeout_s):
            self._ledger.scan()
        return self._ledger.used

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        """Store each object unless its key exists (``PRESENT``, which counts as a use for LRU)."""
        self._check_open()
        results = [PutStatus.FAILED] * len(objects)
        stamp = time.time_ns()
        todo: list[int] = []
        for i, obj in enumerate(objects):
            # Earlier objects of a batch (a prefix's head) get newer stamps, so LRU evicts tails first.
            if self._touch(obj.key, stamp - i):
                results[i] = PutStatus.PRESENT
            else:
                todo.append(i)
        if todo:
            await self._put_new(objects, todo, results, stamp)
        self._stats.count_puts(objects, results)
        await anyio.lowlevel.checkpoint()
        return results

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        """Fill each object's regions. A corrupt object is a ``MISS`` and is removed."""
        self._check_open()
        results: list[GetStatus] = []
        corrupt: list[tuple[str, str, str]] = []
        stamp = time.time_ns()
        pacer = _Pacer()
        for i, obj in enumerate(objects):
            results.append(self._get_one(obj, stamp - i, corrupt))
            await pacer.tick()
        if corrupt:
            await self._remove_corrupt(corrupt)
        self._stats.count_gets(objects, results)
        await anyio.lowlevel.checkpoint()
        return results

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        found: list[bool] = []
        for key in keys:
            path = self._object_path(key)
            try:
                os.stat(path)
            except FileNotFoundError:
                found.append(False)
            except OSError as exc:
                raise BackendError(
                    f"cannot check {path}: {exc.strerror}; is {self.root} still there and readable?"
                ) from exc
            else:
                found.append(True)
        return found

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete objects (under the directory lock, so the shared budget stays exact)."""
        self._check_open()
        async with self._ledger.locked(self.config.lock_timeout_s):
            return [self._ledger.remove_if(object_file_name(key), lambda _: True) for key in keys]

    async def aclose(self) -> None:
        """Close this instance; the objects stay in the directory for other processes."""
        if not self._closed:
            self._closed = True
            os.close(self._ledger.lock_fd)

    # --- internals ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the local backend was closed; open a new one")

    def _object_path(self, key: str) -> str:
        return f"{self._ledger.objects_dir}/{object_file_name(key)}"

    def _touch(self, key: str, stamp: int) -> bool:
        """Mark an object used; False when it does not exist."""
        try:
            os.utime(self._object_path(key), ns=(stamp, stamp))
        except FileNotFoundError:
            return False
        except PermissionError:
            return True  # it exists, owned by another user
        except OSError:
            return False
        return True

    async def _put_new(
        self, objects: Sequence[ObjectRef], todo: list[int], results: list[PutStatus], stamp: int
    ) -> None:
        sizes = [HEADER_SIZE + objects[i].nbytes for i in todo]
        try:
            async with self._ledger.locked(self.config.lock_timeout_s):
                plan = self._ledger.reserve(sizes)
        except (TimeoutError, OSError) as exc:
            logger.warning("local backend: a put of %d objects failed: %s", len(todo), exc)
            return
        pacer = _Pacer()
        try:
            for i, res in zip(todo, plan):
                if isinstance(res, PutStatus):
                    results[i] = res
                    continue
                results[i] = self._write_one(objects[i], res, stamp - i)
                await pacer.tick()
        finally:
            leftovers = [r for r in plan if isinstance(r, Reservation) and not r.settled]
            if leftovers:
                with anyio.CancelScope(shield=True):
                    await self._release(leftovers)

    def _write_one(self, obj: ObjectRef, res: Reservation, stamp: int) -> PutStatus:
        temp = f"{self._ledger.tmp_dir}/{res.name}"
        try:
            views = region_views(obj.addrs, obj.sizes)
            header = Header.sealed(obj.nbytes, key_digest(obj.key), views)
            if res.reused_size > res.nbytes:
                os.ftruncate(res.fd, res.nbytes)
            hook = _mid_write_hook
            if hook is None or len(views) < 2:
                write_from(res.fd, [header.pack(), *views], 0)
            else:
                write_from(res.fd, [header.pack(), views[0]], 0)
                hook(temp)
                write_from(res.fd, views[1:], HEADER_SIZE + views[0].nbytes)
            os.utime(res.fd, ns=(stamp, stamp))
        except OSError as exc:
            logger.debug("local backend: writing %r failed: %s", obj.key, exc)
            return PutStatus.NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else PutStatus.FAILED
        finally:
            os.close(res.fd)
            res.fd = -1
        try:
            os.link(temp, self._object_path(obj.key))
        except FileExistsError:
            return PutStatus.PRESENT
        except OSError as exc:
            logger.debug("local backend: publishing %r failed: %s", obj.key, exc)
            return PutStatus.FAILED
        res.settled = True  # the bytes now belong to the published object
        try:
            os.unlink(temp)
        except OSError as exc:
            logger.debug("local backend: could not remove %s: %s", temp, exc)
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
                    os.unlink(os.path.join(self._ledger.tmp_dir, res.name))

    def _get_one(self, obj: ObjectRef, stamp: int, corrupt: list[tuple[str, str, str]]) -> GetStatus:
        name = object_file_name(obj.key)
        try:
            fd = os.open(f"{self._ledger.objects_dir}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return GetStatus.MISS
        except OSError as exc:
            logger.debug("local backend: opening %r failed: %s", obj.key, exc)
            return GetStatus.FAILED
        try:
            views = region_views(obj.addrs, obj.sizes)
            got = read_into(fd, [self._header_buf, *views], 0)
            header = Header.unpack(self._header_buf) if got >= HEADER_SIZE else None
            problem = ""
            if header is None:
                problem = "no valid header"
            elif header.digest != key_digest(obj.key):
                problem = "a header for another key"
            elif header.payload_len != obj.nbytes:
                if os.fstat(fd).st_size == HEADER_SIZE + header.payload_len:
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
            elif payload_checksum(views, header) != header.checksum:
                problem = "a checksum mismatch"
            if problem:
                corrupt.append((name, obj.key, problem))
                return GetStatus.MISS
            os.utime(fd, ns=(stamp, stamp))
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
        removed = 0
        try:
            async with self._ledger.locked(self.config.lock_timeout_s):
                for name, key, _ in corrupt:
                    if self._ledger.remove_if(name, partial(object_file_is_bad, key=key)):
                        removed += 1
        except TimeoutError as exc:
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
