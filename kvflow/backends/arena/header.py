"""The arena file's header and its making: how a store's capacity is cut into sets of slots
(:class:`Geometry`, and where the table, tags, keys and slots lie in the file), the header page that
records it, creating the file (allocated and zeroed, then renamed into place) and checking one that
exists: an arena of this format, cut as the URL asks (or as an earlier kvflow cut it), undamaged.

Header (little-endian, at offset 0): magic ``KVFARENA``, version (u32), ways (u32), slot bytes,
sets, offset of the slots, and the rule that cut it (u64 each; 0 in a header an earlier kvflow
wrote, which recorded none). At :data:`WAIT_MARK`, the one word of the header page that changes: the
time a process waiting for the store's exclusive lock last tried for it, or 0
(:class:`kvflow.backends.arena.lock.WaitMark`; 0 in a store an earlier kvflow made, which never
writes it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct

import attrs

from kvflow.backends.arena.config import MAX_SLOT, ArenaConfig
from kvflow.backends.local.safety import Access, open_root, open_store_file, opening
from kvflow.errors import ConfigError

__all__ = [
    "ARENA_NAME",
    "COLUMNS",
    "KEY_BYTES",
    "PAGE",
    "WAIT_MARK",
    "WAYS",
    "Geometry",
    "check_room",
    "exists",
    "open_made",
    "open_or_create",
    "stored_geometry",
]

logger = logging.getLogger(__name__)

ARENA_NAME = "arena"
_NEW_NAME = "arena.new"
_MAGIC = b"KVFARENA"
_VERSION = 1
# magic, version, ways, slot bytes, sets, offset of the slots, cut (the rule that chose ways and sets)
_HEADER = struct.Struct("<8sIIQQQQ")
_EARLIER_CUT = 0  # sets of at most WAYS slots (Geometry.earlier_of); kvflows that wrote no cut
_WIDE_CUT = 1  # sets of WAYS slots or a few more (Geometry.of): every store made since it is recorded
PAGE = 4096
WAYS = 64
COLUMNS = 8  # the table's: one u64 array each (kvflow.backends.arena.store)
WAIT_MARK = 64  # the header page's byte of the waiters' mark (u64), a cache line after the header
KEY_BYTES = 256  # per slot: the key's length (u16), then the key (utf-8), for listing the store


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@attrs.frozen
class Geometry:
    """How a store of ``capacity`` bytes is cut: ``sets`` x ``ways`` slots of ``slot_bytes``."""

    ways: int
    slot_bytes: int
    sets: int

    @classmethod
    def of(cls, config: ArenaConfig) -> Geometry:
        """Sets of ``WAYS`` slots or a few more, so that fewer than ``sets`` of the capacity's whole
        slots are left out (a store of fewer than ``2 * WAYS`` slots is one set of all of them)."""
        slots = config.capacity_bytes // config.slot_bytes
        sets = max(1, slots // WAYS)
        return cls(slots // sets, config.slot_bytes, sets)

    @classmethod
    def earlier_of(cls, config: ArenaConfig) -> Geometry:
        """How a kvflow that made sets of at most ``WAYS`` slots cut the same capacity (its stores
        keep working as they were made)."""
        slots = config.capacity_bytes // config.slot_bytes
        ways = min(WAYS, slots)
        return cls(ways, config.slot_bytes, slots // ways)

    @property
    def rows(self) -> int:
        return self.sets * self.ways

    @property
    def tags_offset(self) -> int:
        return PAGE + _pages(self.rows * COLUMNS * 8)

    @property
    def keys_offset(self) -> int:
        return self.tags_offset + _pages(self.rows)

    @property
    def data_offset(self) -> int:
        return self.keys_offset + _pages(self.rows * KEY_BYTES)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.rows * self.slot_bytes

    def describe(self) -> str:
        return f"{self.rows} slots of {self.slot_bytes} bytes ({self.sets} sets of {self.ways})"


def stored_geometry(config: ArenaConfig) -> Geometry | None:
    """How the arena of the store ``config`` names is cut, read from its header; None when there is
    no store there. Creates nothing (for tools that look at a store).

    The directory is checked first, as opening the store checks it (another user's, a symlink, open
    to writes by others: a ConfigError that says what to do), and the header is read through a
    descriptor of the arena verified to be a regular file of the store: a FIFO or a symlink there
    is refused, never waited on or followed. A header that is not an arena's, or is damaged, is a
    ConfigError too.
    """
    root = os.path.normpath(config.path)
    access = Access.of(config.group)
    path = f"{root}/{ARENA_NAME}"
    with opening(root, backend="arena") as fds:
        try:
            fds.append(open_root(root, access, create=False))
            fds.append(open_store_file(fds[0], ARENA_NAME, path, access, create=False))
            return _read_header(fds[1], path)[0]
        except FileNotFoundError:
            return None
        finally:
            while fds:
                os.close(fds.pop())


def exists(root_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def check_room(root_fd: int | str, root: str, geometry: Geometry) -> None:
    """ConfigError when an arena of ``geometry`` is larger than the whole filesystem holding the
    store ``root_fd`` (or the path given: the store's nearest existing parent, before anything is
    made) (free space is not checked: another process may be allocating the arena)."""
    fs = os.fstatvfs(root_fd) if isinstance(root_fd, int) else os.statvfs(root_fd)
    total = fs.f_blocks * fs.f_frsize  # 0 where a filesystem does not say: not checked
    if 0 < total < geometry.file_bytes:
        raise ConfigError(
            f"the arena backend cannot take {geometry.file_bytes} bytes in {root}: the filesystem has "
            f"no room, it holds {total} bytes in all. Give a smaller capacity, or a directory on a "
            f"larger filesystem (df -h {root})"
        )


def open_made(
    root_fd: int, root: str, access: Access, geometry: Geometry, earlier: Geometry
) -> tuple[int, Geometry] | None:
    """The arena file's descriptor and how it is cut (``geometry``, or ``earlier`` for a store an
    earlier kvflow made), or None where no arena is made. Under the lock, shared or exclusive: an
    arena appears whole (:func:`open_or_create`), and nothing changes the header it reads."""
    try:
        fd = open_store_file(root_fd, ARENA_NAME, f"{root}/{ARENA_NAME}", access, create=False)
    except FileNotFoundError:
        return None
    return fd, _checked(fd, f"{root}/{ARENA_NAME}", geometry, earlier)


def open_or_create(
    root_fd: int, root: str, access: Access, geometry: Geometry, earlier: Geometry
) -> tuple[int, Geometry]:
    """:func:`open_made`, after creating the arena (allocated and zeroed, then renamed into place)
    if missing. Under the exclusive lock."""
    made = open_made(root_fd, root, access, geometry, earlier)
    if made is not None:
        return made
    fd = _create(root_fd, root, access, geometry)
    return fd, _checked(fd, f"{root}/{ARENA_NAME}", geometry, earlier)


def _checked(fd: int, path: str, geometry: Geometry, earlier: Geometry) -> Geometry:
    """:func:`_check_header`, closing ``fd`` when it raises."""
    try:
        return _check_header(fd, path, geometry, earlier)
    except BaseException:
        os.close(fd)
        raise


def _create(root_fd: int, root: str, access: Access, geometry: Geometry) -> int:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_NEW_NAME, dir_fd=root_fd)  # left by a creator that died: we hold the lock
    fd = open_store_file(root_fd, _NEW_NAME, f"{root}/{_NEW_NAME}", access)
    try:
        try:
            os.posix_fallocate(fd, 0, geometry.file_bytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise
            raise ConfigError(
                f"the arena backend cannot take {geometry.file_bytes} bytes in {root}: the filesystem "
                f"has no room ({exc.strerror}). Give a smaller capacity, or free memory there "
                "(df -h /dev/shm)"
            ) from exc
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            geometry.ways,
            geometry.slot_bytes,
            geometry.sets,
            geometry.data_offset,
            _WIDE_CUT,
        )
        os.pwrite(fd, header, 0)
        os.rename(_NEW_NAME, ARENA_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(_NEW_NAME, dir_fd=root_fd)
        raise
    logger.info("arena backend: created %s/%s, %s", root, ARENA_NAME, geometry.describe())
    return fd


def _check_header(fd: int, path: str, geometry: Geometry, earlier: Geometry) -> Geometry:
    """How the arena is cut: ``geometry``, or ``earlier`` for a store an earlier kvflow made (one
    whose header records no cut: a store made since records it, and opens only as ``geometry``)."""
    found, cut = _read_header(fd, path)
    if found != geometry and (cut != _EARLIER_CUT or found != earlier):
        raise ConfigError(
            f"{path} holds {found.describe()}, but this URL asks for {geometry.describe()}: give every "
            "process the same capacity and slot, or remove the store to make it anew"
        )
    return found


def _read_header(fd: int, path: str) -> tuple[Geometry, int]:
    """How the arena file ``fd`` (at ``path``) is cut, and the rule that cut it (``_EARLIER_CUT``
    for a header that records none). ConfigError when it is not an arena, is of another format
    version, or is damaged (a header no kvflow writes, or a file of another size than it says)."""
    data = os.pread(fd, _HEADER.size, 0)
    if len(data) < _HEADER.size or data[:8] != _MAGIC:
        raise ConfigError(f"{path} is not a kvflow arena; remove it or give another directory")
    _, version, ways, slot_bytes, sets, offset, cut = _HEADER.unpack(data)
    if version != _VERSION:
        raise ConfigError(
            f"{path} is an arena of format version {version}, this kvflow reads version {_VERSION}; "
            "remove it (its KV is only a cache) or use another directory"
        )
    found = Geometry(ways, slot_bytes, sets)
    problem = _damage(found, offset, cut, os.fstat(fd).st_size)
    if problem:
        raise ConfigError(
            f"the arena at {path} is damaged: {problem}. Remove it (rm {path}; its KV is only a "
            "cache) and the next process to open the store makes it anew"
        )
    return found, cut


def _damage(found: Geometry, offset: int, cut: int, size: int) -> str:
    """What is wrong with a header that says ``found``, ``offset`` and ``cut`` of a file of
    ``size`` bytes; "" when nothing is."""
    if found.ways < 1 or found.sets < 1:
        return f"its header gives {found.sets} sets of {found.ways} slots"
    if not PAGE <= found.slot_bytes <= MAX_SLOT or found.slot_bytes % PAGE:
        largest = MAX_SLOT >> 20
        return (
            f"its header gives slots of {found.slot_bytes} bytes, not a multiple of 4KiB up to {largest}MiB"
        )
    if cut not in (_EARLIER_CUT, _WIDE_CUT):
        return f"its header names an unknown cut ({cut})"
    if offset != found.data_offset:
        return f"its header puts the slots at byte {offset}; {found.describe()} start at {found.data_offset}"
    if size != found.file_bytes:
        whole = found.file_bytes
        return f"its header says it holds {found.describe()}, {whole} bytes, but it is {size} bytes long"
    return ""
