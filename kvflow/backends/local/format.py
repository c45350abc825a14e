"""The on-disk format of the local backend: object files, their names, and raw region I/O.

An object file is a 64-byte header followed by the payload (the object's bytes)::

    offset  size  field
    0       8     magic b"KVFLOBJ1"
    8       2     format version (1)
    10      2     flags: 1 when the key follows the payload, else 0
    12      4     header size (64)
    16      8     payload length in bytes
    24      8     checksum: xxh3-64 of the payload, then of this header with the checksum zeroed
    32      16    blake2b-128 digest of the key (the file name may be a digest of a long key)
    48      4     length of the key after the payload (0 when flags is 0)
    52      12    reserved, zero

A key too long to be a file name is named by its digest (``~`` + hex); its object keeps the key
after the payload (flags 1), so that listing the store can give it back (:func:`kept_key_of`).

Copies go straight between the caller's regions and the file with ``preadv``/``pwritev``: one kernel
copy, no Python-level buffer in between; :func:`pieces` cuts a large object into pieces so that a
caller can let its event loop run between them. Everything here is synchronous and thread-agnostic.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import string
import struct
from collections.abc import Callable, Iterator, Sequence

import attrs

try:
    import xxhash
except ImportError as exc:  # pragma: no cover - depends on the environment
    from kvflow.errors import MissingDependencyError

    raise MissingDependencyError(
        "xxhash", "The local shared-memory backend", "pip install xxhash (a dependency of kvflow)"
    ) from exc

__all__ = [
    "HEADER_SIZE",
    "Header",
    "PayloadChecksum",
    "TempName",
    "WriterId",
    "is_object_file_name",
    "kept_key",
    "kept_key_of",
    "key_digest",
    "name_hash",
    "object_file_is_bad",
    "object_file_name",
    "payload_checksum",
    "pieces",
    "read_into",
    "region_views",
    "write_from",
]

HEADER_SIZE = 64
_MAGIC = b"KVFLOBJ1"
_VERSION = 1
_HEADER = struct.Struct("<8sHHIQQ16sI12s")
_RESERVED = bytes(12)
_KEY_KEPT = 1  # flags: the key follows the payload
assert _HEADER.size == HEADER_SIZE

_IOV_MAX = 512  # stay well under the kernel's IOV_MAX (1024)
_MAX_NAME = 200  # bytes; file names are limited to 255 on every Linux filesystem
_SAFE = frozenset(string.ascii_letters + string.digits + "-_.,=+@")
_PLAIN = re.compile(r"[A-Za-z0-9\-_,=+@][A-Za-z0-9\-_.,=+@]*")  # needs no escaping
# Every name object_file_name can return (plain, %-escaped, or ~digest), and nothing starting with "."
_OBJECT_NAME = re.compile(r"[A-Za-z0-9\-_,=+@%][A-Za-z0-9\-_.,=+@%]{0,199}|~[0-9a-f]{40}")


def key_digest(key: str) -> bytes:
    """The 16-byte digest of a key that every object file records."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def name_hash(name: str) -> int:
    """The 64-bit hash of an object file name that the store's removal journal records."""
    return xxhash.xxh3_64_intdigest(name.encode())


def object_file_name(key: str) -> str:
    """The file name of a key's object: the key with unsafe bytes %-escaped, or ``~`` + a digest.

    The mapping is injective: escaped names never start with ``~`` (it is escaped), and a digest
    name is used only when the escaped form is empty or longer than 200 bytes.
    """
    if len(key) <= _MAX_NAME and _PLAIN.fullmatch(key):
        return key
    raw = key.encode("utf-8", "surrogatepass")  # (a str from outside may hold lone surrogates)
    escaped = "".join(
        chr(b) if chr(b) in _SAFE and not (i == 0 and b == 0x2E) else f"%{b:02X}" for i, b in enumerate(raw)
    )
    if 0 < len(escaped) <= _MAX_NAME:
        return escaped
    return "~" + hashlib.blake2b(raw, digest_size=20).hexdigest()


def kept_key(key: str, name: str) -> bytes:
    """What the object file ``name`` of ``key`` keeps after its payload: the key where the name is
    a digest (it cannot give the key back), else nothing."""
    return key.encode("utf-8", "surrogatepass") if name.startswith("~") else b""


def kept_key_of(fd: int) -> tuple[str | None, int]:
    """The key an object file keeps after its payload (None when it keeps none, or one that does
    not match the header's digest) and the payload's length (-1 without a valid header)."""
    head = os.pread(fd, HEADER_SIZE, 0)
    header = Header.unpack(head)
    if header is None:
        return None, -1
    if not header.key_len:
        return None, header.payload_len
    raw = os.pread(fd, header.key_len, HEADER_SIZE + header.payload_len)
    try:
        key = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None, header.payload_len
    return (key if key_digest(key) == header.digest else None), header.payload_len


def is_object_file_name(name: str) -> bool:
    """Whether ``name`` can be an object file's name (see :func:`object_file_name`)."""
    return _OBJECT_NAME.fullmatch(name) is not None


@attrs.frozen(slots=True)
class Header:
    """The fixed header of an object file."""

    payload_len: int
    checksum: int
    digest: bytes
    key_len: int = 0  # bytes of the key kept after the payload

    @property
    def file_size(self) -> int:
        """The size of the whole object file: header, payload and kept key."""
        return HEADER_SIZE + self.payload_len + self.key_len

    @classmethod
    def sealed(cls, payload_len: int, digest: bytes, views: Sequence[memoryview]) -> Header:
        """The header of a payload held in ``views``, with its checksum computed."""
        return cls(payload_len, payload_checksum(views, cls(payload_len, 0, digest)), digest)

    def pack(self) -> bytes:
        return self._pack(self.checksum)

    def checked_part(self) -> bytes:
        """The header bytes the checksum covers (the checksum field zeroed)."""
        return self._pack(0)

    def _pack(self, checksum: int) -> bytes:
        flags = _KEY_KEPT if self.key_len else 0
        return _HEADER.pack(
            _MAGIC,
            _VERSION,
            flags,
            HEADER_SIZE,
            self.payload_len,
            checksum,
            self.digest,
            self.key_len,
            _RESERVED,
        )

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> Header | None:
        """The header at the start of ``buf``, or None when it is not a valid version-1 header."""
        if len(buf) < HEADER_SIZE:
            return None
        magic, version, flags, size, payload_len, checksum, digest, key_len, reserved = _HEADER.unpack_from(
            buf
        )
        if (magic, version, size, reserved) != (_MAGIC, _VERSION, HEADER_SIZE, _RESERVED):
            return None
        if flags != (_KEY_KEPT if key_len else 0):
            return None
        return cls(payload_len, checksum, digest, key_len)


def payload_checksum(views: Sequence[memoryview], header: Header) -> int:
    """xxh3-64 over the payload regions in order, then over the header's checked part."""
    checksum = PayloadChecksum()
    checksum.update(views)
    return checksum.value(header)


@attrs.define
class PayloadChecksum:
    """:func:`payload_checksum` of a payload fed in pieces, in order."""

    _hasher: xxhash.xxh3_64 = attrs.field(factory=xxhash.xxh3_64)

    def update(self, views: Sequence[memoryview]) -> None:
        for view in views:
            self._hasher.update(view)

    def value(self, header: Header) -> int:
        """The checksum of what was fed, with ``header`` (whose checksum field is ignored)."""
        hasher = self._hasher.copy()
        hasher.update(header.checked_part())
        return hasher.intdigest()


def object_file_is_bad(dir_fd: int, name: str, key: str) -> bool:
    """Whether object file ``name`` in ``dir_fd`` is not a whole object of ``key`` (reads it all).

    A rare path (re-checking a failed read). A symlink or any other non-regular file is bad.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return True
    try:
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError:
        return True
    finally:
        os.close(fd)
    header = Header.unpack(data)
    if header is None or header.digest != key_digest(key) or len(data) != header.file_size:
        return True
    payload = memoryview(data)[HEADER_SIZE : HEADER_SIZE + header.payload_len]
    return payload_checksum([payload], header) != header.checksum


def region_views(addrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """Writable views of raw memory regions (skipping empty ones); valid while the memory is."""
    return [memoryview((ctypes.c_char * size).from_address(addr)) for addr, size in zip(addrs, sizes) if size]


def pieces(bufs: Sequence[memoryview], limit: int | Callable[[], int]) -> Iterator[list[memoryview]]:
    """``bufs`` in order, as lists of at most ``limit`` bytes each (a large buffer is cut up). A
    callable ``limit`` is asked before each piece, so that the pieces may shrink or grow as they go.

    Empty buffers are dropped; concatenating every piece gives back the bytes of ``bufs``.
    """
    next_limit = limit if callable(limit) else lambda: limit
    batch: list[memoryview] = []
    room = next_limit()
    for buf in bufs:
        view = buf.cast("B") if buf.ndim != 1 or buf.itemsize != 1 else buf
        while view.nbytes:
            part = view[:room]
            batch.append(part)
            room -= part.nbytes
            view = view[part.nbytes :]
            if room == 0:
                yield batch
                batch, room = [], next_limit()
    if batch:
        yield batch


def _advance(bufs: list[memoryview], done: int) -> list[memoryview]:
    """The buffers left after the first ``done`` bytes of ``bufs``."""
    for i, buf in enumerate(bufs):
        if done < buf.nbytes:
            return [buf[done:], *bufs[i + 1 :]]
        done -= buf.nbytes
    return []


def _transfer(
    call: Callable[[int, list[memoryview], int], int], fd: int, bufs: list[memoryview], offset: int
) -> int:
    total = 0
    while bufs:
        batch = bufs[:_IOV_MAX]
        want = sum(b.nbytes for b in batch)
        done = call(fd, batch, offset + total)
        total += done
        if done == 0:
            break  # end of file (reads only; a write of 0 bytes cannot happen for want > 0)
        bufs = bufs[len(batch) :] if done == want else _advance(bufs, done)
    return total


def write_from(fd: int, bufs: Sequence[memoryview | bytes], offset: int) -> None:
    """Write ``bufs`` back to back at ``offset``; raises OSError (e.g. ENOSPC) on failure."""
    views = [memoryview(b) for b in bufs]
    want = sum(v.nbytes for v in views)
    if _transfer(os.pwritev, fd, views, offset) != want:
        raise OSError(f"short write to file descriptor {fd}")


def read_into(fd: int, bufs: Sequence[memoryview | bytearray], offset: int) -> int:
    """Fill ``bufs`` from ``offset``; returns the bytes read (fewer at end of file)."""
    return _transfer(os.preadv, fd, [memoryview(b) for b in bufs], offset)


# --- temp files and the writers that own them ---------------------------------------------------


def _read_start_time(pid: int | str) -> int | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    stat = _read_stat(pid)
    return None if stat is None else stat[1]


def _read_stat(pid: int | str) -> tuple[bytes, int] | None:
    """A process's state (field 3 of /proc/PID/stat: ``R``, ``S``, ``Z``...) and start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return (fields[0], int(fields[19])) if len(fields) > 19 else None


def _exited(pid: int) -> bool:
    """Whether a zombie ``pid`` has no thread left running (a leader that ended before its threads
    is a zombie too, while they run)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        stat = _read_stat(f"{pid}/task/{task}")
        if stat is not None and stat[0] not in (b"Z", b"X"):
            return False
    return True


def _pid_exists(pid: int) -> bool:
    """Whether a process of this pid namespace has ``pid`` (signal 0 checks without sending;
    another user's process answers EPERM, which still says it exists)."""
    if pid <= 0:
        return False  # no process has it (and kill would name a process group)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@attrs.frozen(slots=True)
class WriterId:
    """A process, named so that a reused pid or a foreign pid namespace is never taken for it.

    ``namespace`` 0 means unknown (no /proc): such writers are never judged dead.
    """

    namespace: int
    pid: int
    start: int

    @classmethod
    def current(cls) -> WriterId:
        start = _read_start_time("self")
        if start is None:  # (no descriptor left, say) others must not judge this writer by it
            return cls(0, os.getpid(), 0)
        return cls(_pid_namespace(), os.getpid(), start)

    def is_alive(self, me: WriterId) -> bool:
        """Whether this writer may still be running, as seen from process ``me`` (conservative:
        dead only when no process has its pid, the one that has it started at another time, or it
        has exited and waits for its parent to reap it)."""
        if self.namespace == 0 or self.namespace != me.namespace:
            return True  # cannot tell from here
        if self.pid == me.pid:
            return self.start == me.start
        stat = _read_stat(self.pid)
        if stat is not None:
            state, start = stat
            return start == self.start and not (state in (b"Z", b"X") and _exited(self.pid))
        # /proc would not say (mounted with hidepid, or no descriptor left): ask the kernel
        return _pid_exists(self.pid)


@attrs.frozen(slots=True)
class TempName:
    """``<ns>.<pid>.<start>.<reserved>.<token>.tmp``: a write in flight, and who writes it.

    ``reserved`` is for people reading a listing; usage is never taken from it (anyone who can
    create a file could claim any number), but from the file's size: a writer sizes its temp
    file to its reservation (``ftruncate``) as it makes it.
    """

    writer: WriterId
    reserved: int
    token: str

    def format(self) -> str:
        w = self.writer
        return f"{w.namespace}.{w.pid}.{w.start}.{self.reserved}.{self.token}.tmp"

    @classmethod
    def parse(cls, name: str) -> TempName | None:
        parts = name.split(".")
        if len(parts) != 6 or parts[5] != "tmp" or not all(p.isascii() and p.isdigit() for p in parts[:4]):
            return None
        ns, pid, start, reserved = (int(p) for p in parts[:4])
        return cls(WriterId(ns, pid, start), reserved, parts[4])
