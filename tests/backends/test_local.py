"""The local backend: format, budget and eviction, faults, and real concurrent OS processes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import itertools
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvflow.backends.local.backend as local
import kvflow.backends.local.format as local_format
from kvflow.backends import lockfiles, open_backend, pacing
from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend, LocalConfig
from kvflow.backends.local.format import (
    HEADER_SIZE,
    Header,
    TempName,
    WriterId,
    is_object_file_name,
    object_file_is_bad,
    object_file_name,
    pieces,
)
from kvflow.backends.local.space import Reservation, SpaceLedger
from kvflow.errors import BackendError, BackendUnavailableError, ConfigError, PoolClosedError
from kvflow.regions import buffer_address
from tests.backends.store_worker import Workers, content, read_all
from tests.helpers import open_fds

KiB = 1024
_alive: list[bytearray] = []  # buffers behind ObjectRefs (which hold bare addresses) live to test end


@pytest.fixture(autouse=True)
def _release_buffers() -> Iterator[None]:
    yield
    _alive.clear()


def ref(key: str, buf: bytearray, splits: list[int] | None = None) -> ObjectRef:
    """An object over ``buf``, cut at ``splits`` (offsets) into consecutive regions; keeps ``buf`` alive."""
    _alive.append(buf)
    cuts = [0, *(splits or []), len(buf)]
    addr = buffer_address(buf) if buf else 0
    return ObjectRef.of(key, [addr + a for a in cuts[:-1]], [b - a for a, b in itertools.pairwise(cuts)])


def payload(key: str, size: int) -> bytearray:
    return bytearray(content(key, 0, size)) if size else bytearray()


def open_store(path: Path, capacity: int = 64 << 20) -> LocalBackend:
    return LocalBackend(LocalConfig(str(path), capacity_bytes=capacity))


def object_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (path / "objects").iterdir()}


# --- configuration and set-up ------------------------------------------------------------------


def test_url_parameters() -> None:
    assert LocalConfig.from_url("local://") == LocalConfig()
    assert LocalConfig().path == f"/dev/shm/kvflow-{os.geteuid()}"  # private to this user
    cfg = LocalConfig.from_url("local:///mnt/nvme/kv%20cache?capacity=8GiB&lock_timeout=2.5")
    assert cfg == LocalConfig("/mnt/nvme/kv cache", 8 << 30, 2.5)
    for bad in (
        "local://dev/shm/kvflow",  # a host, not a path
        "local:///x?size=1GiB",
        "local:///x?capacity=lots",
        "local:///x?capacity=0",
        "local:///x?lock_timeout=soon",
        "memory:///x",
    ):
        with pytest.raises(ConfigError):
            LocalConfig.from_url(bad)


async def test_open_backend_creates_missing_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "store"
    backend = open_backend(f"local://{path}?capacity=1MiB")
    assert isinstance(backend, LocalBackend)
    assert backend.root == str(path)
    assert (path / "objects").is_dir() and (path / "tmp").is_dir()
    assert backend.stats().capacity_bytes == 1 << 20
    await backend.aclose()


def test_unusable_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    for path in (tmp_path / "file" / "store", Path("/proc/kvflow-test/store")):
        with pytest.raises(ConfigError, match="cannot use") as info:
            open_store(path)
        message = str(info.value)
        assert str(path) in message
        assert "; give a directory this process can create and write, e.g. local:// (a private" in message
        assert re.search(r"store: [A-Z][a-z ]+; give", message), message  # the OS's reason, in words


def test_read_only_directory_is_a_config_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    open_store(store)
    tmp = store / "tmp"
    if os.geteuid() == 0:
        # root ignores permission bits: make the directory read-only with a read-only bind mount
        subprocess.run(["mount", "--bind", str(tmp), str(tmp)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(tmp)], check=True)
    else:
        tmp.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="cannot write"):
            open_store(store)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(tmp)], check=True)
        else:
            tmp.chmod(0o700)


# --- the format, pure ---------------------------------------------------------------------------


@given(st.text(max_size=300))
def test_file_names_are_safe_and_distinct(key: str) -> None:
    name = object_file_name(key)
    assert 0 < len(name.encode()) <= 200
    assert "/" not in name and "\0" not in name and not name.startswith(".")
    assert is_object_file_name(name)  # a scan takes it for an object
    other = key + "x"
    assert object_file_name(other) != name


def test_names_that_no_key_maps_to_are_not_object_names() -> None:
    for name in (".hidden", "..", ".", "", "a/b", "x" * 201, "~short", "~" + "A" * 40, "a b", "é"):
        assert not is_object_file_name(name), name


@given(st.lists(st.binary(max_size=50), max_size=8), st.integers(1, 64))
def test_pieces_cut_buffers_in_order_and_never_exceed_the_limit(chunks: list[bytes], limit: int) -> None:
    cut = list(pieces([memoryview(c) for c in chunks], limit))
    assert b"".join(bytes(v) for piece in cut for v in piece) == b"".join(chunks)
    assert all(0 < sum(v.nbytes for v in piece) <= limit for piece in cut)
    assert all(sum(v.nbytes for v in piece) == limit for piece in cut[:-1])  # only the last is short


def test_pieces_cut_typed_and_shaped_buffers_by_bytes() -> None:
    """A region may come as a typed or many-dimensional view (a tensor's memory): cut by bytes."""
    data = bytes(range(48))
    for buf in (memoryview(data).cast("I"), memoryview(data).cast("H"), memoryview(data).cast("B", (6, 8))):
        cut = list(pieces([buf], 10))
        assert [sum(v.nbytes for v in piece) for piece in cut] == [10, 10, 10, 10, 8]
        assert b"".join(bytes(v) for piece in cut for v in piece) == data


def test_a_keys_file_name_is_the_documented_one() -> None:
    """Other kvflow versions find an object by its name: plain keys as they are, others %-escaped
    (a leading dot too), and a digest only past 200 bytes, exactly."""
    assert object_file_name("a" * 200) == "a" * 200
    assert object_file_name("a/b.c") == "a%2Fb.c"
    assert object_file_name(".a") == "%2Ea"
    longest = "/" + "a" * 197  # escapes to exactly 200 bytes
    assert object_file_name(longest) == "%2F" + "a" * 197
    digest = hashlib.blake2b((longest + "a").encode(), digest_size=20).hexdigest()
    assert object_file_name(longest + "a") == "~" + digest


def test_file_names_are_injective_on_tricky_keys() -> None:
    keys = ["a", "%61", "~a", ".", "..", ".a", "a/b", "a%2Fb", "", "é", "x" * 200, "x" * 201, "x" * 300]
    assert len({object_file_name(k) for k in keys}) == len(keys)
    assert object_file_name("v1@model@fp@pcp0@dcp0@h0@pp0@ab12") == "v1@model@fp@pcp0@dcp0@h0@pp0@ab12"


@given(
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(min_size=16, max_size=16),
    st.integers(0, 2**32 - 1),
)
def test_header_round_trip(length: int, checksum: int, digest: bytes, key_len: int) -> None:
    header = Header(length, checksum, digest, key_len)
    packed = header.pack()
    assert len(packed) == HEADER_SIZE
    assert Header.unpack(packed) == header
    assert Header.unpack(b"X" + packed[1:]) is None
    flags = 1 if key_len else 0
    assert packed[10:12] == flags.to_bytes(2, "little")
    assert Header.unpack(packed[:10] + (1 - flags).to_bytes(2, "little") + packed[12:]) is None


@given(st.integers(0, 2**40), st.integers(1, 2**22), st.integers(0, 2**40), st.integers(0, 2**40))
def test_temp_names_round_trip(ns: int, pid: int, start: int, reserved: int) -> None:
    name = TempName(WriterId(ns, pid, start), reserved, "ab12cd")
    assert TempName.parse(name.format()) == name
    assert TempName.parse("probe.12.34") is None


def test_temp_names_that_are_not_a_writers_are_refused() -> None:
    assert TempName.parse("1.2.3.4.tok.tmp") == TempName(WriterId(1, 2, 3), 4, "tok")
    for name in (
        "1.2.x.4.tok.tmp",
        "1.2.3.4.tok.tmq",
        "1.2.3.tok.tmp",
        "1.2.3.4.5.tok.tmp",
        "-1.2.3.4.t.tmp",
        "1.\u00b2.3.4.tok.tmp",  # a digit to str.isdigit, not to int
    ):
        assert TempName.parse(name) is None, name


def test_a_writer_is_judged_dead_only_when_it_certainly_is(monkeypatch: pytest.MonkeyPatch) -> None:
    me = WriterId.current()
    assert me.namespace and me.start and me.is_alive(me)
    assert not WriterId(me.namespace, me.pid, me.start + 1).is_alive(me)  # this pid, an older process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = local_format._read_start_time(child.pid)
        assert started is not None
        assert WriterId(me.namespace, child.pid, started).is_alive(me)
        assert not WriterId(me.namespace, child.pid, started + 1).is_alive(me)  # the pid was reused
    finally:
        child.kill()
        child.wait()
    assert not WriterId(me.namespace, child.pid, started).is_alive(me)  # exited
    # Whoever cannot be seen from here may be running: another pid namespace, or no /proc.
    assert WriterId(me.namespace + 1, child.pid, started).is_alive(me)
    assert WriterId(0, child.pid, started).is_alive(me)
    # A /proc entry that cannot be read (hidepid, no descriptor left) is not a death: the pid
    # still names a process; one no process has is dead.
    monkeypatch.setattr(local_format, "_read_stat", lambda pid: None)
    assert WriterId(me.namespace, os.getppid(), 1).is_alive(me)
    assert not WriterId(me.namespace, child.pid, started).is_alive(me)


async def test_an_object_file_is_the_documented_format(tmp_path: Path) -> None:
    """Byte by byte, what format.py's docstring promises (other versions of kvflow read it)."""
    backend = open_store(tmp_path)
    data = payload("a key", 3000)
    assert await backend.put([ref("a key", data, [1000])]) == [PutStatus.STORED]
    raw = (tmp_path / "objects" / object_file_name("a key")).read_bytes()
    assert len(raw) == 64 + 3000 and raw[64:] == data
    assert raw[:8] == b"KVFLOBJ1" and raw[8:16] == struct.pack("<HHI", 1, 0, 64)
    assert raw[16:24] == struct.pack("<Q", 3000)
    assert raw[32:48] == hashlib.blake2b(b"a key", digest_size=16).digest() and raw[48:64] == bytes(16)
    zeroed = raw[:24] + bytes(8) + raw[32:64]
    assert raw[24:32] == struct.pack("<Q", xxhash.xxh3_64(bytes(data) + zeroed).intdigest())
    await backend.aclose()


async def test_a_file_is_a_whole_object_of_its_key_only_when_every_check_passes(tmp_path: Path) -> None:
    backend = open_store(tmp_path)
    data = payload("k", 2000)
    assert await backend.put([ref("k", data)]) == [PutStatus.STORED]
    objects = tmp_path / "objects"
    fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY)
    try:
        name = object_file_name("k")
        assert not object_file_is_bad(fd, name, "k")
        assert object_file_is_bad(fd, name, "another key")  # a whole object, of another key
        assert object_file_is_bad(fd, "missing", "k")
        (objects / "link").symlink_to(objects / name)
        assert object_file_is_bad(fd, "link", "k")  # never followed
        (objects / "dir").mkdir()
        assert object_file_is_bad(fd, "dir", "k")
        raw = (objects / name).read_bytes()
        (objects / "short").write_bytes(raw[:-1])
        (objects / "long").write_bytes(raw + b"\0")
        (objects / "flipped").write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
        for bad in ("short", "long", "flipped"):
            assert object_file_is_bad(fd, bad, "k"), bad
        os.mkfifo(objects / "fifo")
        opened_for_writing: list[bool] = []

        def unblock() -> None:  # only if the check blocked in open(): it must not
            opened_for_writing.append(True)
            os.close(os.open(objects / "fifo", os.O_WRONLY | os.O_NONBLOCK))

        timer = threading.Timer(5, unblock)
        timer.start()
        try:
            assert object_file_is_bad(fd, "fifo", "k")
        finally:
            timer.cancel()
        assert opened_for_writing == []
    finally:
        os.close(fd)
    await backend.aclose()


@pytest.mark.parametrize("op", ["write", "read"])
def test_short_writes_and_reads_are_continued_where_they_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """The kernel may move fewer bytes than asked (a signal, a full pipe): every call goes on from
    the exact byte where the last stopped, across buffer boundaries."""
    parts = [b"abc", b"defgh", b"", b"ij", b"klmnopq"]
    whole = b"".join(parts)
    path = tmp_path / "file"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    calls = 0
    real = os.pwritev if op == "write" else os.preadv

    def at_most_4(fd_: int, bufs: list[memoryview], offset: int) -> int:
        nonlocal calls
        calls += 1
        cut, room = [], 4
        for b in bufs:
            if room == 0:
                break
            cut.append(b[:room])
            room -= min(room, b.nbytes)
        return real(fd_, cut, offset)

    try:
        if op == "write":
            monkeypatch.setattr(os, "pwritev", at_most_4)
            local_format.write_from(fd, parts, 5)
            assert path.read_bytes() == bytes(5) + whole
        else:
            os.pwrite(fd, bytes(5) + whole, 0)
            monkeypatch.setattr(os, "preadv", at_most_4)
            bufs = [bytearray(len(p)) for p in parts]
            assert local_format.read_into(fd, bufs, 5) == len(whole)
            assert b"".join(bufs) == whole
        assert calls == -(-len(whole) // 4)
    finally:
        os.close(fd)


def test_a_write_that_stops_moving_bytes_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    monkeypatch.setattr(os, "pwritev", lambda fd_, bufs, offset: 0)
    try:
        with pytest.raises(OSError, match="short write"):
            local_format.write_from(fd, [b"abc"], 0)
    finally:
        os.close(fd)


# --- one process ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), size=st.integers(0, 300 * KiB))
def test_round_trip_through_any_region_split(tmp_path: Path, data: st.DataObject, size: int) -> None:
    cut = st.lists(st.integers(0, size), max_size=5).map(sorted)
    put_cuts, get_cuts = data.draw(cut), data.draw(cut)
    key = f"k{size}-{put_cuts}-{get_cuts}"
    source, target = payload(key, size), bytearray(size)

    async def scenario() -> None:
        backend = open_store(Path(tempfile.mkdtemp(dir=tmp_path)))
        assert await backend.put([ref(key, source, put_cuts)]) == [PutStatus.STORED]
        assert await backend.get([ref(key, target, get_cuts)]) == [GetStatus.HIT]
        await backend.aclose()

    anyio.run(scenario)
    assert target == source


async def test_put_never_overwrites_and_get_checks_size(tmp_path: Path) -> None:
    backend = open_store(tmp_path)
    first, second = payload("a", 1000), payload("b", 1000)
    assert await backend.put([ref("k", first), ref("k", second)]) == [PutStatus.STORED, PutStatus.PRESENT]
    assert await backend.put([ref("k", second)]) == [PutStatus.PRESENT]
    target = bytearray(1000)
    assert await backend.get([ref("k", target), ref("nope", bytearray(10))]) == [
        GetStatus.HIT,
        GetStatus.MISS,
    ]
    assert target == first
    assert await backend.get([ref("k", bytearray(999)), ref("k", bytearray(1001))]) == [
        GetStatus.FAILED,
        GetStatus.FAILED,
    ]
    assert await backend.exists(["k", "nope"]) == [True, False]
    stats = backend.stats()
    assert (stats.puts, stats.present, stats.hits, stats.misses, stats.get_failures) == (1, 2, 1, 1, 2)
    assert stats.used_bytes == HEADER_SIZE + 1000 == await backend.usage()
    # remove gives the bytes back to the shared budget at once
    assert await backend.remove(["k", "nope"]) == [True, False]
    assert await backend.exists(["k"]) == [False] and object_files(tmp_path) == {}
    assert backend.stats().used_bytes == 0 == await backend.usage()
    await backend.aclose()
    with pytest.raises(PoolClosedError, match=r"^the local backend was closed; open a new one$"):
        await backend.get([ref("k", target)])


async def test_object_larger_than_capacity_is_no_space(tmp_path: Path) -> None:
    backend = open_store(tmp_path, capacity=4 * KiB)
    big, small = payload("big", 4 * KiB), payload("small", 100)
    assert await backend.put([ref("big", big), ref("small", small)]) == [PutStatus.NO_SPACE, PutStatus.STORED]
    assert await backend.exists(["big", "small"]) == [False, True]
    await backend.aclose()


@pytest.mark.parametrize(
    ("error", "status"), [(errno.ENOSPC, PutStatus.NO_SPACE), (errno.EIO, PutStatus.FAILED)]
)
async def test_a_write_the_filesystem_cuts_off_is_reported_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, status: PutStatus
) -> None:
    """A full filesystem (NO_SPACE) or an I/O error (FAILED) in the middle of a write."""
    backend = open_store(tmp_path)
    real_pwritev = os.pwritev

    def full(fd: int, buffers: Any, offset: int) -> int:
        real_pwritev(fd, [memoryview(buffers[0])[:10]], offset)  # a partial write, then the error
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(os, "pwritev", full)
    assert await backend.put([ref("k", payload("k", 5000))]) == [status]
    monkeypatch.undo()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert await backend.exists(["k"]) == [False]
    assert backend.stats().used_bytes == 0 == await backend.usage()
    assert await backend.put([ref("k", payload("k", 5000))]) == [PutStatus.STORED]
    await backend.aclose()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root; skipped elsewhere)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_real_full_tmpfs_is_no_space(small_tmpfs: Path) -> None:
    backend = open_store(small_tmpfs / "store", capacity=64 << 20)  # the budget exceeds the tmpfs
    data = payload("big", 700 * KiB)
    assert await backend.put([ref("a", data)]) == [PutStatus.STORED]
    assert await backend.put([ref("b", data)]) == [PutStatus.NO_SPACE]
    assert list((small_tmpfs / "store" / "tmp").iterdir()) == []
    target = bytearray(len(data))
    assert await backend.get([ref("a", target), ref("b", bytearray(len(data)))]) == [
        GetStatus.HIT,
        GetStatus.MISS,
    ]
    assert target == data
    await backend.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, HEADER_SIZE + 3000 - 1), flip=st.integers(1, 255))
def test_any_corrupted_byte_is_a_miss_and_removes_the_file(tmp_path: Path, position: int, flip: int) -> None:
    async def scenario() -> None:
        backend = open_store(Path(tempfile.mkdtemp(dir=tmp_path)))
        source = payload("k", 3000)
        assert await backend.put([ref("k", source, [1000])]) == [PutStatus.STORED]
        path = Path(backend.root) / "objects" / "k"
        data = bytearray(path.read_bytes())
        data[position] ^= flip
        path.write_bytes(data)
        target = bytearray(3000)
        assert await backend.get([ref("k", target, [7, 2000])]) == [GetStatus.MISS]
        assert not path.exists()
        assert backend.stats().used_bytes == 0 == await backend.usage()
        assert await backend.put([ref("k", source)]) == [PutStatus.STORED]  # the key is usable again
        assert await backend.get([ref("k", target)]) == [GetStatus.HIT]
        assert target == source
        await backend.aclose()

    anyio.run(scenario)


@pytest.mark.parametrize("keep", [0, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 2999])
async def test_an_object_file_cut_short_is_a_miss_and_removed(tmp_path: Path, keep: int) -> None:
    """An object file cut short after it was published (a full disk under another tool, a crash
    of the filesystem): whatever is left (nothing, part of the header, the header alone, all but
    the last byte), a get is a miss, never a hit, and the file is removed."""
    backend = open_store(tmp_path)
    assert await backend.put([ref("k", payload("k", 3000))]) == [PutStatus.STORED]
    path = tmp_path / "objects" / object_file_name("k")
    os.truncate(path, keep)
    assert await backend.get([ref("k", bytearray(3000), [1000])]) == [GetStatus.MISS]
    assert not path.exists() and await backend.usage() == 0
    await backend.aclose()


async def test_a_large_object_file_cut_short_in_its_second_piece_is_a_miss_and_removed(
    tmp_path: Path,
) -> None:
    """The same for an object read in 1 MiB pieces: the read stops at the file's end."""
    size = 3 * 1024 * KiB + 5
    backend = open_store(tmp_path)
    assert await backend.put([ref("big", payload("big", size))]) == [PutStatus.STORED]
    path = tmp_path / "objects" / "big"
    os.truncate(path, 1536 * KiB)
    assert await backend.get([ref("big", bytearray(size), [7])]) == [GetStatus.MISS]
    assert not path.exists() and await backend.usage() == 0
    await backend.aclose()


async def test_eviction_is_least_recently_used(tmp_path: Path) -> None:
    size = 10 * KiB
    backend = open_store(tmp_path, capacity=4 * (HEADER_SIZE + size))
    data = {k: payload(k, size) for k in "abcdef"}
    for key in "abcd":  # one by one: a is the oldest
        assert await backend.put([ref(key, data[key])]) == [PutStatus.STORED]
    assert await backend.get([ref("a", bytearray(size))]) == [GetStatus.HIT]  # a is now the newest
    assert await backend.put([ref("b", data["b"])]) == [PutStatus.PRESENT]  # so is b, after a
    assert await backend.put([ref("e", data["e"]), ref("f", data["f"])]) == [PutStatus.STORED] * 2
    assert await backend.exists(list("abcdef")) == [True, True, False, False, True, True]
    assert backend.stats().evictions == 2
    assert sum(object_files(tmp_path).values()) == 4 * (HEADER_SIZE + size) == await backend.usage()
    for key in "abef":  # the recycled files hold the new objects whole
        target = bytearray(size)
        assert await backend.get([ref(key, target)]) == [GetStatus.HIT]
        assert target == data[key]
    await backend.aclose()


async def test_a_batch_keeps_its_head_longest(tmp_path: Path) -> None:
    """Within one batch (a prefix, head first), the tail is evicted first: the head stays useful."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=4 * (HEADER_SIZE + size))
    prefix = [f"p{i}" for i in range(4)]
    assert await backend.put([ref(k, payload(k, size)) for k in prefix]) == [PutStatus.STORED] * 4
    assert await backend.put([ref("x", payload("x", size))]) == [PutStatus.STORED]
    assert await backend.exists(prefix) == [True, True, True, False]
    await backend.aclose()


async def test_puts_and_gets_let_the_event_loop_run(tmp_path: Path) -> None:
    """Copies run on the loop, but a batch checkpoints every 0.5 ms, so other tasks keep running."""
    backend = open_store(tmp_path, capacity=256 << 20)
    size, count = 1 << 20, 48
    sources = [payload(f"k{i}", size) for i in range(count)]
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        before = ticks
        assert (
            await backend.put([ref(f"k{i}", s) for i, s in enumerate(sources)]) == [PutStatus.STORED] * count
        )
        during_put = ticks - before
        targets = [bytearray(size) for _ in range(count)]
        before = ticks
        assert await backend.get([ref(f"k{i}", t) for i, t in enumerate(targets)]) == [GetStatus.HIT] * count
        during_get = ticks - before
        done = True
    assert targets == sources
    # Without pacing each call would checkpoint once at its end (1-2 ticks).
    assert during_put >= 4 and during_get >= 4, (during_put, during_get)
    await backend.aclose()


async def test_a_cancelled_put_releases_what_it_did_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = open_store(tmp_path)
    size, count, stop_at = 64 * KiB, 20, 5
    sources = [payload(f"k{i}", size) for i in range(count)]
    writes = 0
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)  # checkpoint after every object

    with anyio.CancelScope() as scope:

        def cancel_at_fifth(temp: str) -> None:
            nonlocal writes
            writes += 1
            if writes == stop_at:
                scope.cancel()  # lands at the checkpoint after this object

        monkeypatch.setattr(local, "_mid_write_hook", cancel_at_fifth)
        await backend.put([ref(f"k{i}", s, [1000]) for i, s in enumerate(sources)])
    assert scope.cancelled_caught
    assert len(object_files(tmp_path)) == stop_at
    assert list((tmp_path / "tmp").iterdir()) == []  # the 15 unwritten reservations were released
    assert backend.stats().used_bytes == stop_at * (HEADER_SIZE + size) == await backend.usage()
    await backend.aclose()


async def test_large_objects_are_copied_in_pieces_and_calls_interleave_safely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Puts and gets of one instance run at once, each yielding between 1 MiB pieces."""
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)  # a checkpoint after every piece
    backend = open_store(tmp_path, capacity=256 << 20)
    size = 5 * (1 << 20) + 123
    sources = {k: payload(k, size) for k in ("a", "b", "c", "d")}
    assert await backend.put([ref(k, sources[k], [7, size // 2]) for k in "ab"]) == [PutStatus.STORED] * 2
    targets = {k: bytearray(size) for k in "ab"}
    results: dict[str, list[Any]] = {}
    checkpoints = 0
    done = False

    async def ticker() -> None:
        nonlocal checkpoints
        while not done:
            checkpoints += 1
            await anyio.lowlevel.checkpoint()

    async def get(key: str) -> None:
        results[key] = await backend.get([ref(key, targets[key], [size // 3])])

    async def put(key: str) -> None:
        results[key] = await backend.put([ref(key, sources[key], [1 << 20])])

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with anyio.create_task_group() as calls:
            for key in "ab":
                calls.start_soon(get, key)
            for key in "cd":
                calls.start_soon(put, key)
        done = True
    assert results == {
        "a": [GetStatus.HIT],
        "b": [GetStatus.HIT],
        "c": [PutStatus.STORED],
        "d": [PutStatus.STORED],
    }
    assert targets == {k: sources[k] for k in "ab"}
    assert checkpoints >= 8  # the calls yielded between pieces (whole-object copies: 2 or 3)
    for key in "cd":
        target = bytearray(size)
        assert await backend.get([ref(key, target)]) == [GetStatus.HIT] and target == sources[key]
    await backend.aclose()


async def test_a_put_cancelled_inside_a_large_object_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)
    backend = open_store(tmp_path, capacity=64 << 20)
    size = 8 << 20
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.put, [ref("big", payload("big", size))])
            while not list((tmp_path / "tmp").iterdir()):  # the reservation exists: writing
                await anyio.lowlevel.checkpoint()
            for _ in range(3):  # a few pieces in
                await anyio.lowlevel.checkpoint()
            scope.cancel()
    assert await backend.exists(["big"]) == [False]
    assert list((tmp_path / "tmp").iterdir()) == [] and object_files(tmp_path) == {}
    assert backend.stats().used_bytes == 0 == await backend.usage()
    await backend.aclose()


async def test_dead_writers_temp_files_are_removed_at_open(tmp_path: Path) -> None:
    backend = open_store(tmp_path)
    me = WriterId.current()
    dead = WriterId(me.namespace, me.pid, me.start + 1)  # this pid, but another (earlier) process
    foreign = WriterId(me.namespace + 1, 1, 1)  # another pid namespace: cannot judge, keep
    tmp = tmp_path / "tmp"
    (tmp / TempName(dead, 5000, "aa").format()).write_bytes(b"x" * 3000)
    (tmp / TempName(foreign, 7000, "bb").format()).write_bytes(b"y")
    await backend.aclose()
    backend = open_store(tmp_path)
    assert [p.name for p in tmp.iterdir()] == [TempName(foreign, 7000, "bb").format()]
    # The foreign writer's file still counts, at its size on disk, not at the 7000 its name claims.
    assert await backend.usage() == 1
    await backend.aclose()


# --- several OS processes ---------------------------------------------------------------------


async def test_concurrent_processes_see_whole_objects_and_first_writer_wins(tmp_path: Path) -> None:
    keys = [f"shared-{i}" for i in range(40)]
    size, writers = 48 * KiB + 3, 3
    specs = [
        {"dir": str(tmp_path), "capacity": 64 << 20, "writer": w, "writers": writers, "keys": keys,
         "size": size, "rounds": 3, "batch": 8, "seed": w}
        for w in range(writers)
    ]  # fmt: skip
    reports = Workers.run_all(specs)
    assert [r["torn"] for r in reports] == [[]] * writers
    assert all(r["get"].get("hit", 0) > 0 for r in reports)
    assert sum(r["put"].get("stored", 0) for r in reports) == len(keys)  # each key stored exactly once
    # Nothing is evicted (the budget is large), so every read of a key, by anyone, saw one version.
    seen: dict[str, set[int]] = {}
    for report in reports:
        for key, versions in report["seen"].items():
            seen.setdefault(key, set()).update(versions)
    assert all(len(v) == 1 for v in seen.values()), seen
    backend = open_store(tmp_path)
    final = await read_all(backend, keys, size, writers)
    assert {k: {w} for k, w in final.items()} == seen and len(final) == len(keys)
    assert list((tmp_path / "tmp").iterdir()) == []
    await backend.aclose()


async def test_eviction_under_a_small_budget_with_concurrent_writers(tmp_path: Path) -> None:
    size, writers = 32 * KiB, 3
    capacity = 20 * (HEADER_SIZE + size) + 100
    shared = [f"s{i}" for i in range(20)]
    specs = [
        {"dir": str(tmp_path), "capacity": capacity, "writer": w, "writers": writers,
         "keys": shared + [f"w{w}-{i}" for i in range(40)], "size": size, "rounds": 2, "batch": 6}
        for w in range(writers)
    ]  # fmt: skip
    reports = Workers.run_all(specs)
    assert [r["torn"] for r in reports] == [[]] * writers
    assert sum(r["evictions"] for r in reports) > 0
    assert all(r["get"].get("hit", 0) > 0 for r in reports)
    files = object_files(tmp_path)
    assert sum(files.values()) <= capacity
    assert all(s == HEADER_SIZE + size for s in files.values())
    assert list((tmp_path / "tmp").iterdir()) == []
    backend = open_store(tmp_path, capacity)
    assert backend.stats().used_bytes == sum(files.values())  # the shared counter matches the files
    keys = shared + [f"w{w}-{i}" for w in range(writers) for i in range(40)]
    found = await read_all(backend, keys, size, writers)
    assert len(found) == len(files)  # every object on disk is readable and whole
    await backend.aclose()


async def test_writer_killed_mid_write_leaves_nothing_readable(tmp_path: Path) -> None:
    size = 40 * KiB
    spec = {
        "dir": str(tmp_path),
        "capacity": 1 << 20,
        "writer": 1,
        "keys": ["k"],
        "size": size,
        "pause": True,
    }
    workers = Workers([spec])
    proc = workers.procs[0]
    try:
        workers.go()
        temp = Path(workers.wait_for(proc, "PAUSED").split(" ", 1)[1])
        assert temp.parent == tmp_path / "tmp"
        # Really mid-write: the file is sized to its reservation up front; header and first region
        # (the last half of the buffer, see store_worker.regions) are written, the rest is not yet.
        data = temp.read_bytes()
        first = size - size // 2
        assert len(data) == HEADER_SIZE + size and Header.unpack(data) is not None
        assert data[HEADER_SIZE : HEADER_SIZE + first] == content("k", 1, size)[:first]
        assert data[HEADER_SIZE + first :] == bytes(size - first)
        reader = open_store(tmp_path, 1 << 20)
        assert await reader.get([ref("k", bytearray(size))]) == [GetStatus.MISS]  # while paused
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
    finally:
        workers.kill_all()
    assert await reader.get([ref("k", bytearray(size))]) == [GetStatus.MISS]
    assert await reader.exists(["k"]) == [False]
    assert temp.exists()  # the dead writer's leftover, until someone cleans up
    await reader.aclose()

    backend = open_store(tmp_path, 1 << 20)  # opening cleans up after dead processes
    assert not temp.exists()
    assert backend.stats().used_bytes == 0 == await backend.usage()
    source = payload("k", size)
    assert await backend.put([ref("k", source, [100, 30000])]) == [PutStatus.STORED]
    target = bytearray(size)
    assert await backend.get([ref("k", target)]) == [GetStatus.HIT]
    assert target == source
    await backend.aclose()


# --- races with other writers, made deterministic with the backend's test hooks --------------------


async def test_an_object_republished_before_its_corrupt_copy_is_removed_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A get finds a corrupt copy; before it removes it, another writer replaces it with a good one.
    The removal checks again under the lock and leaves the good object alone."""
    reader, writer = open_store(tmp_path), open_store(tmp_path)
    good = payload("k", 3000)
    assert await writer.put([ref("k", good)]) == [PutStatus.STORED]
    path = tmp_path / "objects" / "k"
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 10] ^= 0xFF
    path.write_bytes(data)
    seen: list[list[str]] = []

    async def republish(names: list[str]) -> None:
        seen.append(names)
        assert await writer.remove(["k"]) == [True]  # another process evicted the corrupt copy ...
        assert await writer.put([ref("k", good)]) == [PutStatus.STORED]  # ... and stored it anew

    monkeypatch.setattr(local, "_before_remove_corrupt_hook", republish)
    with caplog.at_level(logging.WARNING, logger=local.__name__):
        assert await reader.get([ref("k", bytearray(3000))]) == [GetStatus.MISS]
    assert seen == [["k"]]
    assert path.exists()  # the good object survived the removal
    assert not [r for r in caplog.records if r.getMessage().startswith("local backend: removed")]
    monkeypatch.setattr(local, "_before_remove_corrupt_hook", None)
    target = bytearray(3000)
    assert await reader.get([ref("k", target)]) == [GetStatus.HIT] and target == good
    assert reader.stats().used_bytes == HEADER_SIZE + 3000 == await reader.usage()
    await reader.aclose()
    await writer.aclose()


@pytest.mark.parametrize("how", ["read", "republished"])
async def test_eviction_skips_an_object_used_since_the_scan_that_listed_it(tmp_path: Path, how: str) -> None:
    """The evictor's candidates come from a scan; the oldest one is then read by another process
    (or evicted and stored again). It is no longer the least recently used: the next one goes."""
    size = 10 * KiB
    capacity = 3 * (HEADER_SIZE + size)
    evictor, other = open_store(tmp_path, capacity), open_store(tmp_path, capacity)
    data = {k: payload(k, size) for k in "abcd"}
    for key in "abc":  # one by one: a is the oldest
        assert await evictor.put([ref(key, data[key])]) == [PutStatus.STORED]
    assert await evictor.usage() == capacity  # a scan: the candidates are a, b, c, oldest first
    if how == "read":
        assert await other.get([ref("a", bytearray(size))]) == [GetStatus.HIT]  # a is the newest now
    else:
        assert await other.remove(["a"]) == [True]
        assert await other.put([ref("a", data["a"])]) == [PutStatus.STORED]  # a new file, a new time
    assert await evictor.put([ref("d", data["d"])]) == [PutStatus.STORED]
    assert await evictor.exists(list("abcd")) == [True, False, True, True]
    assert evictor.stats().evictions == 1
    target = bytearray(size)
    assert await evictor.get([ref("a", target)]) == [GetStatus.HIT] and target == data["a"]
    assert await evictor.usage() == capacity
    await evictor.aclose()
    await other.aclose()


async def test_an_object_evicted_while_a_get_reads_it_is_a_miss_and_its_successor_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get has read the first piece of x when another writer evicts x, recycling its file for y
    (the bytes under the reader change). The reader reports a miss, never a hit of mixed bytes,
    and does not remove y."""
    size = 2 * (1 << 20) + 123  # three pieces
    reader = open_store(tmp_path)
    evictor = open_store(tmp_path, capacity=HEADER_SIZE + size)  # room for one object
    x, y = payload("x", size), payload("y", size)
    assert await reader.put([ref("x", x)]) == [PutStatus.STORED]
    evicted: list[str] = []

    async def evict(name: str) -> None:
        evicted.append(name)
        assert await evictor.put([ref("y", y)]) == [PutStatus.STORED]

    monkeypatch.setattr(local, "_mid_read_hook", evict)
    target = bytearray(size)
    assert await reader.get([ref("x", target)]) == [GetStatus.MISS]
    monkeypatch.setattr(local, "_mid_read_hook", None)
    assert evicted == ["x"] and evictor.stats().evictions == 1
    assert await reader.exists(["x", "y"]) == [False, True]
    got = bytearray(size)
    assert await reader.get([ref("y", got)]) == [GetStatus.HIT] and got == y
    assert await reader.usage() == HEADER_SIZE + size
    await reader.aclose()
    await evictor.aclose()


async def test_a_scan_between_a_publish_and_its_temp_removal_counts_the_object_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer has linked its object but not yet removed its temp name (two names, one file) when
    another process recounts the directory. The file counts once, so the shared budget does not
    stay high (which would evict objects for room that is free)."""
    size = 10 * KiB
    capacity = 2 * (HEADER_SIZE + size)
    writer, other = open_store(tmp_path, capacity), open_store(tmp_path, capacity)
    counts: list[int] = []

    async def recount(name: str) -> None:
        assert len(list((tmp_path / "tmp").iterdir())) == 1 and (tmp_path / "objects" / name).exists()
        counts.append(await other.usage())

    monkeypatch.setattr(local, "_published_hook", recount)
    assert await writer.put([ref("a", payload("a", size))]) == [PutStatus.STORED]
    monkeypatch.setattr(local, "_published_hook", None)
    assert counts == [HEADER_SIZE + size]
    assert list((tmp_path / "tmp").iterdir()) == []
    # The counter the scan left is exact: a second object fits without evicting the first.
    assert await writer.put([ref("b", payload("b", size))]) == [PutStatus.STORED]
    assert writer.stats().evictions == 0 and await other.exists(["a", "b"]) == [True, True]
    assert writer.stats().used_bytes == capacity == await other.usage()
    await writer.aclose()
    await other.aclose()


async def test_eviction_skips_a_candidate_removed_since_the_scan(tmp_path: Path) -> None:
    """The evictor's oldest candidate is gone (another process removed it): the next one goes."""
    size = 10 * KiB
    capacity = 3 * (HEADER_SIZE + size)
    evictor, other = open_store(tmp_path, capacity), open_store(tmp_path, capacity)
    data = {k: payload(k, size) for k in "abcde"}
    for key in "abc":
        assert await evictor.put([ref(key, data[key])]) == [PutStatus.STORED]
    assert await evictor.usage() == capacity  # a scan: the candidates are a, b, c
    assert await other.remove(["a"]) == [True]
    assert await evictor.put([ref("d", data["d"])]) == [PutStatus.STORED]  # fits where a was
    assert await evictor.put([ref("e", data["e"])]) == [PutStatus.STORED]  # a is gone: b goes
    assert await evictor.exists(list("abcde")) == [False, False, True, True, True]
    assert evictor.stats().evictions == 1 and await evictor.usage() == capacity
    await evictor.aclose()
    await other.aclose()


async def test_an_eviction_candidate_swapped_for_a_link_to_it_is_passed_over(tmp_path: Path) -> None:
    """After a scan listed object a, another member of the store moves a's file out and leaves a
    symbolic link to it in its place (the same file, inode and time behind the link). Eviction
    passes the link over and takes the next candidate: it never renames, recycles or removes an
    entry that is not kvflow's."""
    size = 10 * KiB
    capacity = 2 * (HEADER_SIZE + size)
    backend = open_store(tmp_path, capacity)
    for key in "ab":
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    assert await backend.usage() == capacity  # a scan: the candidates are a, b
    planted, moved = tmp_path / "objects" / object_file_name("a"), tmp_path / "moved"
    planted.rename(moved)
    planted.symlink_to(moved)
    assert await backend.put([ref("c", payload("c", size))]) == [PutStatus.STORED]
    assert planted.is_symlink() and moved.stat().st_nlink == 1
    assert await backend.exists(["b", "c"]) == [False, True] and backend.stats().evictions == 1
    await backend.aclose()


async def test_a_batch_that_outgrows_the_budget_gets_no_space_for_the_rest(tmp_path: Path) -> None:
    """Reservations in flight are not evictable: with room for one of two objects and nothing to
    evict, the first is stored and the second reports NO_SPACE; the budget is never exceeded."""
    size = 10 * KiB
    backend = open_store(tmp_path, capacity=3 * (HEADER_SIZE + size) // 2)
    got = await backend.put([ref("a", payload("a", size)), ref("b", payload("b", size))])
    assert got == [PutStatus.STORED, PutStatus.NO_SPACE]
    assert object_files(tmp_path) == {"a": HEADER_SIZE + size} and await backend.usage() == HEADER_SIZE + size
    await backend.aclose()


async def test_an_object_that_needs_several_victims_evicts_them_all(tmp_path: Path) -> None:
    """The first victim's file becomes the new object's; the others are removed, not just uncounted."""
    small, big = 4 * KiB, 8 * KiB + HEADER_SIZE  # the big object takes exactly two small ones' room
    backend = open_store(tmp_path, capacity=3 * (HEADER_SIZE + small))
    for key in "xyz":  # one by one: x is the oldest
        assert await backend.put([ref(key, payload(key, small))]) == [PutStatus.STORED]
    assert await backend.put([ref("big", payload("big", big))]) == [PutStatus.STORED]
    assert object_files(tmp_path) == {"z": HEADER_SIZE + small, "big": HEADER_SIZE + big}
    assert backend.stats().evictions == 2 and await backend.usage() == sum(object_files(tmp_path).values())
    target = bytearray(big)
    assert await backend.get([ref("big", target)]) == [GetStatus.HIT] and target == payload("big", big)
    await backend.aclose()


async def test_a_put_waits_for_the_directory_lock_and_gives_up_at_its_timeout(tmp_path: Path) -> None:
    """Another process holds the store's lock (a stuck writer): a put that needs a section waits
    for it only ``lock_timeout_s`` and fails; once the lock is free, puts work again."""
    backend = LocalBackend(LocalConfig(str(tmp_path), capacity_bytes=1 << 20, lock_timeout_s=0.2))
    holder = os.open(tmp_path / "kvflow.lock", os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert await backend.put([ref("a", payload("a", 1000))]) == [PutStatus.FAILED]
        assert object_files(tmp_path) == {} and list((tmp_path / "tmp").iterdir()) == []
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert await backend.put([ref("a", payload("a", 1000))]) == [PutStatus.STORED]
    finally:
        os.close(holder)
    await backend.aclose()


async def test_removes_counts_and_clears_report_a_lock_held_past_its_timeout_as_unavailable(
    tmp_path: Path,
) -> None:
    """Another process holds the store's lock (a stopped engine): ``remove``, ``usage`` and
    ``clear`` raised a bare TimeoutError, which callers (`kvflow store`, a pool's remove) do not
    expect of a backend; now BackendUnavailableError saying which lock and what to do, and nothing
    is removed. A clear says how many objects it had removed (none here)."""
    backend = LocalBackend(LocalConfig(str(tmp_path), capacity_bytes=1 << 20, lock_timeout_s=0.05))
    assert await backend.put([ref(k, payload(k, 100)) for k in "abc"]) == [PutStatus.STORED] * 3
    stored = object_files(tmp_path)
    holder = os.open(tmp_path / "kvflow.lock", os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        advice = f"waited 0.05s for the lock {tmp_path}/kvflow.lock; another process holds it: .*lslocks"
        with pytest.raises(BackendUnavailableError, match=f"cannot remove objects now: {advice}"):
            await backend.remove(["a"])
        for recount in (True, False):
            with pytest.raises(BackendUnavailableError, match=f"cannot count its usage now: {advice}"):
                await backend.usage(recount=recount)
        with pytest.raises(local.ClearStoppedError, match=f"cannot clear now: {advice}") as stopped:
            await backend.clear()
        assert (stopped.value.removed, stopped.value.listed) == (0, 3)
        assert object_files(tmp_path) == stored
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert await backend.remove(["a"]) == [True]
        assert (
            await backend.usage(recount=False)
            == await backend.usage()
            == sum(object_files(tmp_path).values())
        )
    finally:
        os.close(holder)
        await backend.aclose()


@pytest.mark.parametrize("head", ["newest", "oldest"])
@pytest.mark.parametrize("how", ["get", "put again"])
async def test_a_batch_of_present_objects_is_used_head_first(tmp_path: Path, how: str, head: str) -> None:
    """Objects stored one by one (p0 oldest), then read or put again as one batch whose head is
    the newest object (p3) or the oldest (p0): the batch's head becomes the newest and its tail
    the oldest, so the tail goes first. Each object's time is the batch's own (not the clock's,
    which may not tick between two objects: then the file names would decide)."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=4 * (HEADER_SIZE + size))
    keys = [f"p{i}" for i in range(4)]
    for key in keys:
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    batch = keys[::-1] if head == "newest" else keys
    if how == "get":
        assert await backend.get([ref(k, bytearray(size)) for k in batch]) == [GetStatus.HIT] * 4
    else:
        assert await backend.put([ref(k, payload(k, size)) for k in batch]) == [PutStatus.PRESENT] * 4
    assert await backend.put([ref("x", payload("x", size))]) == [PutStatus.STORED]
    assert await backend.exists(batch) == [True, True, True, False]
    await backend.aclose()


@pytest.mark.parametrize("old", [0, 3])
async def test_a_put_larger_than_the_store_keeps_its_first_objects(tmp_path: Path, old: int) -> None:
    """A put of more objects than the store holds, over several lock sections: it evicts what
    others stored, never its own objects, so it keeps its first ones (a prompt's head, which
    lookups reach) and answers NO_SPACE for the rest (it evicted its head for its tail before)."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=6 * (HEADER_SIZE + size))
    for i in range(old):
        assert await backend.put([ref(f"old{i}", payload(f"old{i}", size))]) == [PutStatus.STORED]
    keys = [f"k{i}" for i in range(3 * local._RESERVE_GROUP)]
    results = await backend.put([ref(k, payload(k, size)) for k in keys])
    assert results == [PutStatus.STORED] * 6 + [PutStatus.NO_SPACE] * (len(keys) - 6)
    assert await backend.exists(keys) == [True] * 6 + [False] * (len(keys) - 6)
    assert backend.stats().evictions == old
    for key in keys[:6]:
        buf = bytearray(size)
        assert await backend.get([ref(key, buf)]) == [GetStatus.HIT] and buf == payload(key, size)
    await backend.aclose()


async def test_a_put_never_evicts_an_object_it_found_present(tmp_path: Path) -> None:
    """A put whose first key is present in a full store: that key is used, and the put's new
    objects evict the others, never it, though it would be next once they are gone."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=4 * (HEADER_SIZE + size))
    olds = [f"old{i}" for i in range(4)]
    for key in olds:  # old0 the least recently used
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    news = [f"new{i}" for i in range(5)]
    results = await backend.put([ref(k, payload(k, size)) for k in ["old0", *news]])
    assert results == [PutStatus.PRESENT] + [PutStatus.STORED] * 3 + [PutStatus.NO_SPACE] * 2
    assert await backend.exists(["old0", *news]) == [True] * 4 + [False] * 2
    assert await backend.exists(olds[1:]) == [False] * 3
    await backend.aclose()


async def test_a_put_evicts_nothing_for_an_object_that_cannot_fit(tmp_path: Path) -> None:
    """An object that would fit only if the put's own objects went: nothing is evicted for it (the
    others would be lost for nothing), and the next object of the same lock section still finds
    the least recently used one to evict."""
    size = 4 * KiB
    unit = HEADER_SIZE + size
    backend = open_store(tmp_path, capacity=4 * unit)
    for key in ("o1", "o2"):  # o1 the least recently used
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    big = 3 * unit + unit // 2 - HEADER_SIZE  # its file takes 3.5 units: it fits only without "a"
    sizes = {"a": size, "big": big, "d": 2 * size}  # d needs one unit evicted, a has none to spare
    results = await backend.put([ref(k, payload(k, n)) for k, n in sizes.items()])
    assert results == [PutStatus.STORED, PutStatus.NO_SPACE, PutStatus.STORED]
    assert await backend.exists(["a", "big", "d", "o1", "o2"]) == [True, False, True, False, True]
    assert backend.stats().evictions == 1
    await backend.aclose()


async def test_a_put_larger_than_the_store_looks_for_room_once_per_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the store has no room for an object of a put that keeps its own, larger objects and
    those of its size answer NO_SPACE without walking the candidates again, in that lock section
    and the put's later ones (a put larger than a store of 20,000 objects rescanned it every 16
    objects); a smaller one still looks."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=6 * (HEADER_SIZE + size))
    tried: list[int] = []
    real = SpaceLedger._reserve_one
    monkeypatch.setattr(
        SpaceLedger, "_reserve_one", lambda self, n, keep: tried.append(n) or real(self, n, keep)
    )
    keys = [f"k{i}" for i in range(4 * local._RESERVE_GROUP)]
    sizes = [size] * (len(keys) - 1) + [size // 2]  # the last one smaller
    results = await backend.put([ref(k, payload(k, n)) for k, n in zip(keys, sizes)])
    assert results == [PutStatus.STORED] * 6 + [PutStatus.NO_SPACE] * (len(keys) - 6)
    assert tried == [HEADER_SIZE + size] * 7 + [HEADER_SIZE + size // 2]
    await backend.aclose()


async def test_a_later_section_looks_again_once_another_writer_freed_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put's first lock section finds no room for x (the store holds the put's own present
    object); while it writes, another instance removes that object: the put's next section looks
    for room for y, of x's size, again and stores it."""
    size = 4 * KiB
    unit = HEADER_SIZE + size
    backend = open_store(tmp_path, capacity=6 * unit)
    other = open_store(tmp_path, capacity=6 * unit)
    big = ref("big", payload("big", 4 * unit - HEADER_SIZE))
    assert await backend.put([big]) == [PutStatus.STORED]
    removed: list[list[bool]] = []

    async def remove_big(_: str) -> None:
        if not removed:
            removed.append(await other.remove(["big"]))

    monkeypatch.setattr(local, "_published_hook", remove_big)
    three = 3 * unit - HEADER_SIZE
    smalls = [ref(f"s{i:02d}", payload(f"s{i:02d}", 1)) for i in range(local._RESERVE_GROUP - 1)]
    objects = [big, ref("x", payload("x", three)), *smalls, ref("y", payload("y", three))]
    results = await backend.put(objects)
    monkeypatch.setattr(local, "_published_hook", None)
    assert removed == [[True]]
    assert results == [PutStatus.PRESENT, PutStatus.NO_SPACE] + [PutStatus.STORED] * len(smalls) + [
        PutStatus.STORED
    ]
    assert await backend.exists(["y"]) == [True]
    await backend.aclose()
    await other.aclose()


async def test_a_put_whose_own_objects_are_all_its_candidates_left_recounts_and_looks_again(
    tmp_path: Path,
) -> None:
    """The counter is too high (objects removed outside kvflow) and the only candidates left in
    the list besides the least recently used one are the put's own present objects: the put lists
    the store again, finds the recount's room, and evicts that one object only (before, it gave up
    with the list: NO_SPACE)."""
    size = 4 * KiB
    unit = HEADER_SIZE + size
    backend = open_store(tmp_path, capacity=8 * unit)
    keys = ["a", "k1", "k2", "k3", "d1", "d2", "d3", "d4"]
    for key in keys:  # a the least recently used
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    await backend.usage()  # a scan: every object is a candidate, in that order
    for key in keys[4:]:
        (tmp_path / "objects" / object_file_name(key)).unlink()
    objects = [ref(k, payload(k, size)) for k in keys[1:4]] + [ref("x", payload("x", 5 * unit - HEADER_SIZE))]
    assert await backend.put(objects) == [PutStatus.PRESENT] * 3 + [PutStatus.STORED]
    assert await backend.exists(["a", "k1", "k2", "k3", "x"]) == [False, True, True, True, True]
    assert backend.stats().evictions == 1
    assert await backend.usage(recount=False) == await backend.usage() == 8 * unit
    await backend.aclose()


async def test_a_put_whose_look_at_writes_in_flight_fails_keeps_its_reservations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing tmp/ for writes in flight fails after a section found no room for an object: the
    section's reservations stand (written and published, nothing leaked), and later sections
    look for room themselves."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=6 * (HEADER_SIZE + size))
    real = os.listdir

    def failing(path: Any = ".") -> list[str]:
        if isinstance(path, int):
            raise OSError(errno.EIO, "listing failed")
        return real(path)

    monkeypatch.setattr(os, "listdir", failing)
    keys = [f"k{i}" for i in range(2 * local._RESERVE_GROUP)]
    results = await backend.put([ref(k, payload(k, size)) for k in keys])
    monkeypatch.undo()
    assert results == [PutStatus.STORED] * 6 + [PutStatus.NO_SPACE] * (len(keys) - 6)
    assert await backend.exists(keys[:6]) == [True] * 6
    assert os.listdir(tmp_path / "tmp") == []
    assert await backend.usage(recount=False) == await backend.usage() == 6 * (HEADER_SIZE + size)
    await backend.aclose()


async def test_a_temp_name_with_a_digit_int_refuses_is_left_alone(tmp_path: Path) -> None:
    """A file in tmp/ whose name has a digit that is not ASCII ("²") is not a writer's temp
    file: the store opens, and a put that looks at the writes in flight ignores it (it raised
    there, and leaked the section's reservations)."""
    odd = "0.\u00b2.0.0.x.tmp"
    (tmp_path / "tmp").mkdir(parents=True)
    (tmp_path / "tmp" / odd).write_bytes(b"")
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=6 * (HEADER_SIZE + size))
    keys = [f"k{i}" for i in range(2 * local._RESERVE_GROUP)]
    results = await backend.put([ref(k, payload(k, size)) for k in keys])
    assert results == [PutStatus.STORED] * 6 + [PutStatus.NO_SPACE] * (len(keys) - 6)
    assert os.listdir(tmp_path / "tmp") == [odd]
    await backend.aclose()


async def test_a_scan_that_finds_the_counter_too_high_evicts_only_what_is_needed(tmp_path: Path) -> None:
    """The shared counter still counts objects removed outside kvflow (or a killed writer's
    reservation): the scan an eviction starts with recounts it, and no object is evicted where
    the recount shows room (before, victims were picked to free what the old count lacked)."""
    size = 4 * KiB
    unit = HEADER_SIZE + size
    backend = open_store(tmp_path, capacity=8 * unit)
    keys = [f"o{i}" for i in range(8)]
    for key in keys:
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    for key in keys[4:]:
        (tmp_path / "objects" / object_file_name(key)).unlink()
    assert await backend.usage(recount=False) == 8 * unit
    assert await backend.put([ref("x", payload("x", 3 * unit - HEADER_SIZE))]) == [PutStatus.STORED]
    assert await backend.exists(keys[:4]) == [True] * 4
    assert backend.stats().evictions == 0
    assert await backend.usage(recount=False) == await backend.usage() == 7 * unit
    await backend.aclose()


async def test_objects_a_put_passes_over_as_its_own_keep_their_place_in_the_lru_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scan inside a put lists the put's own objects (stamped older than those others used
    meanwhile); its reservations pass over them, and they stay candidates in their places, so
    the next put evicts the oldest of them, not the object used most recently (before, they were
    dropped from the list and the next put took the newest object left in it)."""
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=19 * (HEADER_SIZE + size))
    for key in ("q0", "q1", "q2"):
        assert await backend.put([ref(key, payload(key, size))]) == [PutStatus.STORED]
    used: list[list[GetStatus]] = []

    async def use_q1_and_q2(_: str) -> None:  # another task reads them while the put writes
        if not used:
            used.append(await backend.get([ref("q1", bytearray(size)), ref("q2", bytearray(size))]))

    monkeypatch.setattr(local, "_published_hook", use_q1_and_q2)
    own = [f"p{i:02d}" for i in range(local._RESERVE_GROUP)]  # fit: the second section scans
    objects = [ref(k, payload(k, size)) for k in own] + [ref("p16", payload("p16", 2 * size + HEADER_SIZE))]
    assert await backend.put(objects) == [PutStatus.STORED] * (len(own) + 1)
    monkeypatch.setattr(local, "_published_hook", None)
    assert used == [[GetStatus.HIT, GetStatus.HIT]]
    assert await backend.exists(["q0", "q1", "q2"]) == [False, True, False]  # q1 used last, kept
    assert await backend.put([ref("r", payload("r", size))]) == [PutStatus.STORED]
    assert await backend.exists(["q1", own[-1], own[0]]) == [True, False, True]  # the put's tail went
    await backend.aclose()


async def test_a_key_repeated_in_a_put_is_written_once_and_takes_the_room_of_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 4 * KiB
    backend = open_store(tmp_path, capacity=2 * (HEADER_SIZE + size))
    writes: list[int] = []
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset: writes.append(fd) or real(fd, bufs, offset))
    results = await backend.put([ref(k, payload(k, size)) for k in ["a", "a", "b", "a"]])
    assert results == [PutStatus.STORED, PutStatus.PRESENT, PutStatus.STORED, PutStatus.PRESENT]
    assert await backend.exists(["a", "b"]) == [True, True]
    assert len(writes) == 2
    assert backend.stats().evictions == 0
    await backend.aclose()


async def test_a_present_object_is_not_written_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = open_store(tmp_path)
    assert await backend.put([ref("k", payload("k", 100 * KiB))]) == [PutStatus.STORED]
    writes: list[int] = []
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset: writes.append(fd) or real(fd, bufs, offset))
    assert await backend.put([ref("k", payload("k", 100 * KiB))]) == [PutStatus.PRESENT]
    assert writes == [] and list((tmp_path / "tmp").iterdir()) == []
    await backend.aclose()


async def test_marking_objects_used_never_follows_a_planted_link(tmp_path: Path) -> None:
    """A symbolic link where an object file should be (planted by this user by mistake, or left by
    a tool): putting or reading its key never sets the time of the file it points at."""
    backend = open_store(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(b"not kvflow's")
    os.utime(outside, ns=(10**9, 10**9))
    (tmp_path / "objects" / object_file_name("k")).symlink_to(outside)
    await backend.put([ref("k", payload("k", 100))])
    assert await backend.get([ref("k", bytearray(100))]) == [GetStatus.MISS]
    assert outside.stat().st_mtime_ns == 10**9 and outside.read_bytes() == b"not kvflow's"
    await backend.aclose()


async def test_a_link_swapped_in_for_a_temp_file_is_never_published_as_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a put writes its temp file, another member of the store swaps a symbolic link in for
    it. Publishing links the name, never the file it points at: the target gets no second name
    under ``objects/`` (through which later puts' evictions would recycle it), and a get of the
    key is a miss, not the target's bytes."""
    backend = open_store(tmp_path)
    target = tmp_path / "target"
    target.write_bytes(b"x" * 100)

    def swap(temp: str) -> None:
        os.unlink(temp)
        os.symlink(target, temp)

    monkeypatch.setattr(local, "_mid_write_hook", swap)
    await backend.put([ref("k", payload("k", 4 * KiB), [1000])])
    monkeypatch.setattr(local, "_mid_write_hook", None)
    assert target.stat().st_nlink == 1 and target.read_bytes() == b"x" * 100
    assert (tmp_path / "objects" / object_file_name("k")).is_symlink()
    assert await backend.get([ref("k", bytearray(4 * KiB))]) == [GetStatus.MISS]
    assert list((tmp_path / "tmp").iterdir()) == []
    await backend.aclose()


@pytest.mark.parametrize("lock", ["taken", "held past lock_timeout"])
async def test_a_reservation_on_descriptor_0_is_closed_once_when_given_back(
    tmp_path: Path, lock: str
) -> None:
    """A process that closed its stdin gets descriptor 0 for the next file it opens. A reservation
    there is closed when given back, like any other, with the lock or (held elsewhere past
    ``lock_timeout_s``) without it; giving it back again closes nothing (not the descriptor 0
    that a later file got, nor any other)."""
    backend = LocalBackend(LocalConfig(str(tmp_path), capacity_bytes=1 << 20, lock_timeout_s=0.2))
    stdin = os.dup(0)
    holder = os.open(tmp_path / "kvflow.lock", os.O_RDWR)
    try:
        os.close(0)
        async with backend._ledger.locked(1.0):
            [res] = backend._ledger.reserve([100])
        assert isinstance(res, Reservation) and res.fd == 0
        if lock != "taken":
            fcntl.flock(holder, fcntl.LOCK_EX)
        await backend._release([res])
        fcntl.flock(holder, fcntl.LOCK_UN)
        with pytest.raises(OSError):
            os.fstat(0)
        later = os.open(os.devnull, os.O_RDONLY)
        assert later == 0
        await backend._release([res])
        os.fstat(later)
        os.fstat(1)
    finally:
        os.dup2(stdin, 0)
        os.close(stdin)
        os.close(holder)
    assert list((tmp_path / "tmp").iterdir()) == []
    await backend.aclose()


async def test_a_temp_file_someone_removed_meanwhile_is_given_back_without_the_lock_quietly(
    tmp_path: Path,
) -> None:
    """The lock is held elsewhere past ``lock_timeout_s``, and the reservation's temp file is gone
    already (removed by hand, or by another process): giving it back closes its descriptor and
    goes on; the missing file is not an error."""
    backend = LocalBackend(LocalConfig(str(tmp_path), capacity_bytes=1 << 20, lock_timeout_s=0.2))
    fds = open_fds()
    holder = os.open(tmp_path / "kvflow.lock", os.O_RDWR)
    try:
        async with backend._ledger.locked(1.0):
            reservations = backend._ledger.reserve([100, 200])
        assert all(isinstance(r, Reservation) for r in reservations)
        (tmp_path / "tmp" / reservations[0].name).unlink()  # type: ignore[union-attr]
        fcntl.flock(holder, fcntl.LOCK_EX)
        await backend._release(reservations)  # type: ignore[arg-type]
    finally:
        os.close(holder)
    assert list((tmp_path / "tmp").iterdir()) == [] and open_fds() == fds
    await backend.aclose()


def _utime_fails(monkeypatch: pytest.MonkeyPatch, error: OSError) -> list[dict[str, Any]]:
    """``os.utime`` raises ``error`` on every file there is (another member's file, a read-only
    filesystem), FileNotFoundError on a name that is not; the calls' keyword arguments are returned."""
    calls: list[dict[str, Any]] = []

    def utime(path: int | str, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> None:
        calls.append(kwargs)
        if isinstance(path, str):
            os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        raise error

    monkeypatch.setattr(local.os, "utime", utime)
    return calls


async def test_an_object_whose_time_nobody_may_set_is_still_present_and_a_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another group member's object that is not writable by the group: neither its time nor "now"
    can be set. It is still there: a put of its key is PRESENT (not written again) and a get is a
    hit; only its LRU position stays old."""
    backend = open_store(tmp_path)
    data = payload("k", 3000)
    assert await backend.put([ref("k", data)]) == [PutStatus.STORED]
    before = object_files(tmp_path)
    calls = _utime_fails(monkeypatch, PermissionError(errno.EPERM, "Operation not permitted"))
    assert await backend.put([ref("k", payload("k", 3000))]) == [PutStatus.PRESENT]
    target = bytearray(3000)
    assert await backend.get([ref("k", target)]) == [GetStatus.HIT] and target == data
    assert len(calls) == 4  # a stamp, then "now", for the put and for the get
    monkeypatch.undo()
    assert object_files(tmp_path) == before
    await backend.aclose()


async def test_an_object_whose_time_cannot_be_set_on_a_read_only_filesystem_is_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting times fails for a reason other than ownership (the store's filesystem went
    read-only, an I/O error): an object found by its name is there, so a put of its key is PRESENT
    (not a write that would fail) and a get is a hit; only its LRU time stays old."""
    backend = open_store(tmp_path)
    data = payload("k", 3000)
    assert await backend.put([ref("k", data)]) == [PutStatus.STORED]
    before = object_files(tmp_path)
    _utime_fails(monkeypatch, OSError(errno.EROFS, "Read-only file system"))
    assert await backend.put([ref("k", payload("k", 3000))]) == [PutStatus.PRESENT]
    target = bytearray(3000)
    assert await backend.get([ref("k", target)]) == [GetStatus.HIT] and target == data
    assert await backend.put([ref("new", payload("new", 3000))]) == [PutStatus.FAILED]  # cannot be written
    monkeypatch.undo()
    assert object_files(tmp_path) == before and list((tmp_path / "tmp").iterdir()) == []
    await backend.aclose()


@pytest.mark.parametrize("lock", ["freed soon", "held past lock_timeout"])
async def test_a_cancelled_put_releases_its_reservations_while_another_process_holds_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, lock: str
) -> None:
    """The cancellation lands while another process holds the directory lock: giving the unwritten
    reservations back waits for the lock (shielded) instead of leaving their temp files behind, and
    if the lock stays held past ``lock_timeout_s``, removes them without it (the shared counter is
    then high until the next recount)."""
    timeout = 10.0 if lock == "freed soon" else 0.3
    backend = LocalBackend(LocalConfig(str(tmp_path), capacity_bytes=64 << 20, lock_timeout_s=timeout))
    size, count, stop_at = 16 * KiB, 10, 3
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)
    fds = open_fds()
    holder = os.open(tmp_path / "kvflow.lock", os.O_RDWR)
    locked, put_ended = anyio.Event(), anyio.Event()

    async def unlock() -> None:
        await locked.wait()
        if lock == "freed soon":
            await anyio.sleep(0.1)
        else:
            await put_ended.wait()
        fcntl.flock(holder, fcntl.LOCK_UN)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(unlock)
            with anyio.CancelScope() as scope:
                writes = 0

                def cancel_with_the_lock_taken(temp: str) -> None:
                    nonlocal writes
                    writes += 1
                    if writes == stop_at:
                        fcntl.flock(holder, fcntl.LOCK_EX)
                        locked.set()
                        scope.cancel()

                monkeypatch.setattr(local, "_mid_write_hook", cancel_with_the_lock_taken)
                with caplog.at_level(logging.WARNING, logger="kvflow"):
                    try:
                        await backend.put(
                            [ref(f"k{i}", payload(f"k{i}", size), [1000]) for i in range(count)]
                        )
                    finally:
                        put_ended.set()
            assert scope.cancelled_caught
    finally:
        os.close(holder)
    assert open_fds() == fds  # every reservation's descriptor closed, with the lock or without
    assert list((tmp_path / "tmp").iterdir()) == []
    stored = len(object_files(tmp_path))
    assert 0 < stored < count
    unlocked = [r.getMessage() for r in caplog.records if "temp files unlocked" in r.getMessage()]
    if lock == "freed soon":
        assert unlocked == [] and backend.stats().used_bytes == stored * (HEADER_SIZE + size)
    else:
        assert len(unlocked) == 1 and f"removing {count - stored} temp files unlocked" in unlocked[0]
    assert await backend.usage() == stored * (HEADER_SIZE + size) == backend.stats().used_bytes
    await backend.aclose()


def test_a_store_whose_subdirectory_is_a_file_is_refused(tmp_path: Path) -> None:
    anyio.run(open_store(tmp_path / "store").aclose)
    shutil.rmtree(tmp_path / "store" / "objects")
    (tmp_path / "store" / "objects").write_text("in the way")
    with pytest.raises(ConfigError, match="objects is not a directory"):
        open_store(tmp_path / "store")


async def test_listing_shows_every_object_and_nothing_else(tmp_path: Path) -> None:
    """`kvflow store ls` lists objects whole, the empty one too, and skips what only looks like one:
    a link planted under an object's name, a file too short for a header, a file others can write."""
    backend = open_store(tmp_path)
    assert (
        await backend.put([ref("empty", bytearray()), ref("full", payload("full", 100))])
        == [PutStatus.STORED] * 2
    )
    objects = tmp_path / "objects"
    (objects / "link").symlink_to(objects / "full")
    (objects / "short").write_bytes(bytes(HEADER_SIZE - 1))
    writable = objects / "writable"
    writable.write_bytes((objects / "full").read_bytes())
    writable.chmod(0o620)
    assert sorted(await backend.list_objects(), key=str) == [("empty", 0), ("full", 100)]
    await backend.aclose()


async def test_an_object_removed_while_the_store_is_listed_is_left_out_and_the_rest_listed(
    tmp_path: Path, vanish_first_entry: Callable[[], None]
) -> None:
    """`kvflow store ls` on a store in use: an object evicted between the listing and its stat is
    left out, and the listing goes on."""
    backend = open_store(tmp_path)
    assert await backend.put([ref(k, payload(k, 10)) for k in "abc"]) == [PutStatus.STORED] * 3
    vanish_first_entry()
    assert sorted(await backend.list_objects(), key=str) == [("b", 10), ("c", 10)]
    await backend.aclose()


async def test_clearing_removes_every_object_in_lock_sections_of_a_bounded_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvflow store clear` removes a store of any size in lock sections of a bounded size (256
    objects; 4 here), and says how many it removed."""
    monkeypatch.setattr(local, "_LIST_GROUP", 4)
    backend = open_store(tmp_path)
    keys = [f"k{i}" for i in range(10)]
    assert await backend.put([ref(k, payload(k, 10)) for k in keys]) == [PutStatus.STORED] * 10
    removals: list[str] = []
    real_remove_if = SpaceLedger.remove_if

    def counted(self: SpaceLedger, name: str, is_bad: Any) -> bool:
        removals.append(name)
        return real_remove_if(self, name, is_bad)

    monkeypatch.setattr(SpaceLedger, "remove_if", counted)
    locked = SpaceLedger.locked
    entered: list[int] = []

    def counting_locked(self: SpaceLedger, timeout_s: float) -> Any:
        entered.append(len(removals))
        return locked(self, timeout_s)

    monkeypatch.setattr(SpaceLedger, "locked", counting_locked)
    assert await backend.clear() == 10
    assert object_files(tmp_path) == {} and backend.stats().used_bytes == 0
    assert len(removals) == 10 and entered == [0, 4, 8]  # three sections: 4, 4 and 2 objects
    await backend.aclose()


def test_a_process_start_time_is_read_whatever_its_name() -> None:
    """/proc/PID/stat puts the process name in parentheses, and a name may hold ") " itself."""
    rename = (
        "import ctypes, sys; sys.stdin.readline(); "
        "ctypes.CDLL(None).prctl(15, b'a) R 1 2 3', 0, 0, 0); "  # PR_SET_NAME
        "print('renamed', flush=True); sys.stdin.readline()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", rename], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        started = local_format._read_start_time(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "renamed\n"
        assert Path(f"/proc/{child.pid}/comm").read_text() == "a) R 1 2 3\n"
        assert local_format._read_start_time(child.pid) == started
    finally:
        child.kill()
        child.wait()
    mine = local_format._read_start_time("self")
    with open("/proc/uptime") as f:
        now = float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")
    assert started is not None and mine is not None and mine <= started <= now + 1


@pytest.mark.parametrize(("fields", "start"), [(20, 19), (19, None), (0, None)])
def test_a_stat_line_too_short_for_a_start_time_gives_none(
    monkeypatch: pytest.MonkeyPatch, fields: int, start: int | None
) -> None:
    """The start time is field 22 of /proc/PID/stat (the 20th after the name); a line cut short
    (a process exiting as it is read) has none, rather than failing the caller."""
    line = b"42 (name) " + b" ".join(str(i).encode() for i in range(fields))

    def fake_open(path: str, mode: str = "r") -> Any:
        assert path == "/proc/42/stat" and mode == "rb"
        return contextlib.nullcontext(io.BytesIO(line))

    monkeypatch.setattr(local_format, "open", fake_open, raising=False)
    assert local_format._read_start_time(42) == start


def test_without_proc_nobody_is_judged_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without /proc (no pid namespace to read) a writer is never judged dead: its temp file may
    belong to a process this one cannot see."""
    real_stat = os.stat

    def no_proc(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", no_proc)
    me = WriterId.current()
    assert me.namespace == 0
    gone = WriterId(0, 2**22 + 1, 5)  # a pid above any pid_max: no such process here
    assert gone.is_alive(me)


@pytest.mark.parametrize(
    ("error", "status"), [(errno.ENOSPC, PutStatus.NO_SPACE), (errno.EIO, PutStatus.FAILED)]
)
async def test_a_reservation_the_filesystem_refuses_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, status: PutStatus
) -> None:
    """Sizing the temp file fails (a full filesystem or quota, or an I/O error): the put reports
    it for that object (NO_SPACE only when space is what is missing), leaves no temp file and no
    open descriptor, and counts nothing."""
    backend = open_store(tmp_path)
    real = os.ftruncate

    def refuse(fd: int, length: int) -> None:
        raise OSError(error, os.strerror(error))

    fds_before = open_fds()
    monkeypatch.setattr(os, "ftruncate", refuse)
    assert await backend.put([ref("a", payload("a", 1000))]) == [status]
    monkeypatch.setattr(os, "ftruncate", real)
    assert open_fds() == fds_before
    assert list((tmp_path / "tmp").iterdir()) == [] and object_files(tmp_path) == {}
    assert backend.stats().used_bytes == 0 == await backend.usage()
    assert await backend.put([ref("a", payload("a", 1000))]) == [PutStatus.STORED]
    await backend.aclose()


async def test_a_store_that_cannot_be_checked_is_an_error_that_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object the OS will not stat (the store was unmounted, or its modes changed under the
    engine) is not a miss: the error names the file and what to look at."""
    backend = open_store(tmp_path)
    real = os.stat

    def unreadable(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if name == "k":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(os, "stat", unreadable)
    with pytest.raises(
        BackendError, match=rf"cannot check {tmp_path}/objects/k: Permission denied; is .* still there"
    ):
        await backend.exists(["nope", "k"])
    monkeypatch.setattr(os, "stat", real)
    await backend.aclose()


@contextlib.contextmanager
def descriptors_handed_out_in_order() -> Iterator[None]:
    """Fill every free descriptor number below the highest open one, so that the next files this
    process opens take the numbers just closed (as they would in a process with no holes)."""
    opened = {int(n) for n in os.listdir("/proc/self/fd")}
    plugs = [os.open("/dev/null", os.O_RDONLY) for n in range(max(opened)) if n not in opened]
    try:
        yield
    finally:
        for fd in plugs:
            os.close(fd)


async def test_a_remove_waiting_for_the_lock_at_close_runs_on_its_own_store(tmp_path: Path) -> None:
    """A close returns while a remove waits for the store's lock (it touches no caller memory),
    but the store's descriptors stay open until that remove returned: closed at once, their numbers
    went to the next store this process opened, and the remove deleted that store's object."""
    with descriptors_handed_out_in_order():
        a = LocalBackend(LocalConfig.from_url(f"local://{tmp_path}/a?lock_timeout=20"))
        blocker = os.open(tmp_path / "a" / local.LOCK_NAME, os.O_RDWR)
        fcntl.flock(blocker, fcntl.LOCK_EX)  # another process holds store a's lock
        answers: list[list[bool]] = []

        async def remove() -> None:
            answers.append(await a.remove(["k"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(remove)
            await anyio.sleep(0.05)  # the remove polls for the lock
            await a.aclose()
            b = open_store(tmp_path / "b")  # another store, opened while the remove still waits
            assert await b.put([ref("k", payload("k", 4 * KiB))]) == [PutStatus.STORED]
            os.close(blocker)
        assert answers == [[False]]  # it ran on store a, which has no "k"
        out = bytearray(4 * KiB)
        assert await b.get([ref("k", out)]) == [GetStatus.HIT] and out == payload("k", 4 * KiB)
        await b.aclose()


def _lock_fd(backend: object) -> int:
    if isinstance(backend, LocalBackend):
        return backend._ledger.dirs.lock_fd
    return backend._arena.lock.fd  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("scheme", ["local", "arena"])
async def test_a_process_dead_inside_a_section_frees_the_store_though_a_child_it_forked_lives(
    tmp_path: Path, scheme: str
) -> None:
    """``flock`` belongs to an open file, which ``fork`` shares: a process killed holding the store's
    lock left it locked for as long as a child it had forked lived (a helper that never touches
    kvflow), and every other process's opens and puts timed out. A forked child now holds a lock
    file of its own. The process's death is played by closing its lock file while locked."""
    url = f"{scheme}://{tmp_path}/store?capacity=16MiB&lock_timeout=1" + (
        "&slot=64KiB" if scheme == "arena" else ""
    )
    dying = open_backend(url)
    fd = _lock_fd(dying)
    fcntl.flock(fd, fcntl.LOCK_EX)  # inside a section
    child = os.fork()
    if child == 0:  # a helper process: it only lives on
        time.sleep(30)
        os._exit(0)
    try:
        os.close(fd)  # the parent dies: the kernel closes its descriptors
        other = open_backend(url)
        key, buf = "k", payload("k", 4096)
        assert await other.put([ref(key, buf)]) == [PutStatus.STORED]
        await other.aclose()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.dup2(os.open(os.devnull, os.O_RDONLY), fd)  # (so that the close below closes something)
        await dying.aclose()


@pytest.mark.parametrize("scheme", ["local", "arena"])
def test_a_forked_childs_copy_of_a_backend_refuses_every_call_and_closes(tmp_path: Path, scheme: str) -> None:
    """A child forked with a copy of a shared store's backend would write the store under its
    parent's identity: an arena's slots, a local store's temporary files, both taken back as a dead
    writer's once the parent ends, while the child still copies into them (a HIT with another
    key's bytes). Its calls are refused, it closes, and the parent's store is untouched."""
    url = f"{scheme}://{tmp_path}/store?capacity=16MiB" + ("&slot=64KiB" if scheme == "arena" else "")
    backend = open_backend(url)
    key, buf = "k", payload("k", 4096)
    assert anyio.run(backend.put, [ref(key, buf)]) == [PutStatus.STORED]
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: reports each call's outcome, never returns into pytest
        outcomes = []
        try:
            os.close(read_end)
            calls = [
                lambda: backend.put([ref("new", payload("new", 4096))]),
                lambda: backend.get([ref(key, bytearray(4096))]),
                lambda: backend.exists([key]),
                lambda: backend.remove([key]),
                lambda: backend.clear(),
            ]
            for call in calls:
                try:
                    anyio.run(call)
                    outcomes.append("answered")
                except BackendError as exc:
                    outcomes.append("refused" if "forked" in str(exc) else f"other: {exc}")
                except BaseException as exc:
                    outcomes.append(f"raised {type(exc).__name__}: {exc}")
            anyio.run(backend.aclose)
            outcomes.append("closed")
        finally:
            with os.fdopen(write_end, "w") as out:
                out.write(",".join(outcomes))
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as inp:
        outcomes = inp.read().split(",")
    os.waitpid(child, 0)
    try:
        assert outcomes == ["refused"] * 5 + ["closed"], outcomes
        out = bytearray(4096)
        assert anyio.run(backend.get, [ref(key, out)]) == [GetStatus.HIT] and out == buf
        assert anyio.run(backend.exists, ["new"]) == [False]
    finally:
        anyio.run(backend.aclose)


async def test_a_key_holding_a_lone_surrogate_round_trips(tmp_path: Path) -> None:
    """A key is any str; one holding a lone surrogate (text decoded with surrogateescape, say)
    raised UnicodeEncodeError from every call of the local store (the arena took it)."""
    backend = open_store(tmp_path / "store")
    key, long_key = "bad\ud800key", "long\udcff" + "x" * 300  # (the long one gets a digest name)
    try:
        sources = [payload("one", 4096), payload("two", 4096)]
        assert await backend.put([ref(key, sources[0]), ref(long_key, sources[1])]) == [PutStatus.STORED] * 2
        assert await backend.exists([key, long_key, "bad\ud801key"]) == [True, True, False]
        out = [bytearray(4096), bytearray(4096)]
        assert await backend.get([ref(key, out[0]), ref(long_key, out[1])]) == [GetStatus.HIT] * 2
        assert out == sources
        assert sorted(k for k, _ in await backend.list_objects() if k) == sorted([key, long_key])
        assert await backend.remove([key, long_key]) == [True, True]
    finally:
        await backend.aclose()


def test_a_forked_childs_lock_file_is_its_own_only_while_it_is_the_lock_file(tmp_path: Path) -> None:
    """The at-fork hook (run here as a child would run it): a registered lock file becomes a new
    open file with the same status flags, so a lock held through the old one excludes it; a number
    that now names another file (a child that closed what it inherited and opened a log) is left
    alone: reopening it would have rewound it and dropped O_APPEND."""
    lock = os.open(tmp_path / "kvflow.lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC)
    log = -1
    held = os.dup(lock)  # the parent's open file, locked
    try:
        lockfiles.opened(lock)
        fcntl.flock(held, fcntl.LOCK_EX)
        lockfiles._after_fork_in_child()
        with pytest.raises(BlockingIOError):  # its own open file now: the parent's lock excludes it
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert fcntl.fcntl(lock, fcntl.F_GETFL) & os.O_NONBLOCK
        os.close(lock)  # closed without a word to the registry, as a daemonising child does
        log = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, lock)  # the same number names the log now
        os.write(lock, b"line 1\n")
        lockfiles._after_fork_in_child()
        os.write(lock, b"line 2\n")
        assert fcntl.fcntl(lock, fcntl.F_GETFL) & os.O_APPEND
        assert (tmp_path / "log").read_bytes() == b"line 1\nline 2\n"
        assert lock not in lockfiles._OPEN
    finally:
        lockfiles.closing(lock)
        for fd in (lock, held, log):
            with contextlib.suppress(OSError):
                os.close(fd)
