"""The local store on a multi-user host: private by default, shared only with a named group.

Tests that play another user run as root (CI does): a forked child drops to an unprivileged uid
(:func:`as_user`) and acts in a world-writable parent directory made for the test. Elsewhere they
are skipped with the reason.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvflow.backends.local.backend as local
from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend, LocalConfig
from kvflow.backends.local.format import HEADER_SIZE, Header, TempName, WriterId, key_digest
from kvflow.backends.local.safety import Access, StoreDirs, group_name, user_name
from kvflow.errors import ConfigError
from kvflow.regions import buffer_address

NOBODY = 65534  # the "other user" of these tests
MEMBER_A, MEMBER_B, OUTSIDER = 61001, 61002, 61003
SHARED_GID = 61000  # a numeric group without a name: no /etc/group change needed

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="playing another user needs root (CI runs the tests as root)"
)


# --- helpers ------------------------------------------------------------------------------------


def as_user(fn: Callable[..., Any], *args: Any, uid: int = NOBODY, groups: tuple[int, ...] = ()) -> Any:
    """Run ``fn(*args)`` in a forked child as ``uid`` (primary group = uid, plus ``groups``).

    Returns what it returns; an exception in the child is raised here as an AssertionError that
    carries its type and message.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            try:
                outcome: tuple[str, Any] = ("ok", fn(*args))
            except BaseException as exc:
                outcome = ("error", f"{type(exc).__name__}: {exc}")
            with os.fdopen(write_end, "wb") as out:
                pickle.dump(outcome, out)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"the child as uid {uid} died (status {status})"
    kind, value = pickle.loads(data)
    if kind == "error":
        raise AssertionError(f"as uid {uid}: {value}")
    return value


@pytest.fixture
def shared_parent() -> Iterator[Path]:
    """A world-writable, sticky directory in /dev/shm (like /dev/shm itself), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvflow-test-", dir="/dev/shm"))
    try:
        path.chmod(0o1777)
        yield path
    finally:
        shutil.rmtree(path)


def object_file(key: str, payload: bytes) -> bytes:
    """A valid object file of ``key`` holding ``payload`` (what a forger can write)."""
    header = Header.sealed(len(payload), key_digest(key), [memoryview(payload)])
    return header.pack() + payload


_alive: list[bytearray] = []


@pytest.fixture(autouse=True)
def _release_buffers() -> Iterator[None]:
    yield
    _alive.clear()


def ref(key: str, buf: bytearray) -> ObjectRef:
    _alive.append(buf)
    return ObjectRef.of(key, [buffer_address(buf)], [len(buf)])


def open_store(path: Path | str, capacity: int = 1 << 20, group: str | None = None) -> LocalBackend:
    return LocalBackend(LocalConfig(str(path), capacity_bytes=capacity, group=group))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# --- another user's directory, symlinks ----------------------------------------------------------


def _squat(store: str, key: str, payload: bytes) -> None:
    """The other user makes the store directory first, open to all, with a forged object in it."""
    old = os.umask(0)
    try:
        for sub in ("", "/objects", "/tmp"):
            os.mkdir(store + sub, 0o777)
        with open(f"{store}/objects/{key}", "wb") as f:
            f.write(object_file(key, payload))
    finally:
        os.umask(old)


@needs_root
def test_a_directory_another_user_made_first_is_refused(shared_parent: Path) -> None:
    store = shared_parent / "kvflow"
    forged = b"forged KV" * 100
    as_user(_squat, str(store), "k", forged)
    with pytest.raises(ConfigError) as info:
        open_store(store)
    message = str(info.value)
    assert str(store) in message and "another user" in message
    assert f"uid {NOBODY}" in message and "mode 0777" in message
    assert "group=" in message  # says how to share on purpose
    assert sorted(p.name for p in store.iterdir()) == ["objects", "tmp"]  # nothing created inside


@needs_root
def test_another_user_can_neither_list_nor_read_a_private_store(shared_parent: Path) -> None:
    store = shared_parent / "mine"

    async def put() -> None:
        backend = open_store(store)
        assert await backend.put([ref("secret", bytearray(b"s" * 4096))]) == [PutStatus.STORED]
        await backend.aclose()

    anyio.run(put)

    def snoop(path: str) -> list[str]:
        found = []
        for attempt in (
            lambda: os.listdir(path),
            lambda: os.listdir(f"{path}/objects"),
            lambda: os.close(os.open(f"{path}/objects/secret", os.O_RDONLY)),
            lambda: os.close(os.open(f"{path}/kvflow.lock", os.O_RDWR)),
            lambda: os.close(os.open(f"{path}/objects/planted", os.O_WRONLY | os.O_CREAT, 0o644)),
        ):
            try:
                attempt()
                found.append("allowed")
            except PermissionError:
                found.append("denied")
        return found

    assert as_user(snoop, str(store)) == ["denied"] * 5


def test_a_store_writable_by_everyone_is_refused_even_when_mine(tmp_path: Path) -> None:
    store = tmp_path / "store"
    open_store(store)
    store.chmod(0o777)
    with pytest.raises(ConfigError, match="every user of the host can write it") as info:
        open_store(store)
    assert str(store) in str(info.value) and "mode 0777" in str(info.value)
    store.chmod(0o770)  # group-writable: refused while the store is private
    with pytest.raises(ConfigError, match=r"its group .* can write it.*\?group="):
        open_store(store)


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"my own data, not a lock file")
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / "kvflow.lock").symlink_to(precious)
    with pytest.raises(ConfigError, match="symbolic link") as info:
        open_store(store)
    assert str(store / "kvflow.lock") in str(info.value) and str(precious) in str(info.value)
    assert precious.read_bytes() == b"my own data, not a lock file"


@pytest.mark.parametrize("link", ["objects", "tmp", "."])
def test_symlinked_store_directories_are_refused_and_nothing_is_deleted(tmp_path: Path, link: str) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    for name in ("a", "b", "c"):
        (precious / name).write_bytes(object_file(name, b"x" * 1000))  # even valid-looking files
    before = {p.name: p.read_bytes() for p in precious.iterdir()}
    store = tmp_path / "store"
    if link == ".":
        store.symlink_to(precious)  # the store path itself
    else:
        store.mkdir(mode=0o700)
        (store / link).symlink_to(precious)
    with pytest.raises(ConfigError, match="symbolic link"):
        open_store(store, capacity=3000)  # a full budget would evict through the link
    assert {p.name: p.read_bytes() for p in precious.iterdir()} == before


async def test_a_symlink_planted_as_an_object_is_never_a_hit_nor_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(object_file("k", b"not from this store" * 10))
    backend = open_store(tmp_path / "store", capacity=2 * (HEADER_SIZE + 1000))
    (tmp_path / "store" / "objects" / "k").symlink_to(elsewhere)
    target = bytearray(190)
    assert await backend.get([ref("k", target)]) == [GetStatus.MISS]
    assert await backend.exists(["k"]) == [False]
    assert await backend.usage() == 0  # not counted
    for i in range(3):  # overfill the budget: eviction must not touch the link or its target
        assert await backend.put([ref(f"o{i}", bytearray(1000))]) == [PutStatus.STORED]
    assert backend.stats().evictions == 1 and (tmp_path / "store" / "objects" / "k").is_symlink()
    assert elsewhere.read_bytes() == object_file("k", b"not from this store" * 10)
    await backend.aclose()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "another user's file"])
async def test_an_entry_that_is_not_kvflows_at_a_keys_name_fails_its_puts_and_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """An entry in objects/ that is not kvflow's is no object to any call: lookups and gets miss
    it, a put of its key answers FAILED (before, the put set its time and answered PRESENT, so the
    key could never be stored), remove and clear leave it, and a warning names it once. Removed by
    hand, the key stores again."""
    if kind == "another user's file" and os.geteuid() != 0:
        pytest.skip("needs root to make a file another user owns")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(object_file("k", b"e" * 100))
    backend = open_store(tmp_path / "store")
    entry = tmp_path / "store" / "objects" / "k"
    if kind == "symlink":
        entry.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(entry, 0o600)
    else:
        entry.write_bytes(object_file("k", b"p" * 100))
        os.chown(entry, NOBODY, NOBODY)
    before = entry.lstat()
    with caplog.at_level(logging.WARNING, logger="kvflow.backends.local.space"):
        for _ in range(2):
            assert await backend.put([ref("k", bytearray(b"v" * 100))]) == [PutStatus.FAILED]
        assert await backend.exists(["k"]) == [False]
        assert await backend.get([ref("k", bytearray(100))]) == [GetStatus.MISS]
        assert await backend.remove(["k"]) == [False]
        assert await backend.clear() == 0
    after = entry.lstat()
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (
        before.st_ino,
        before.st_mode,
        before.st_mtime_ns,
    )
    assert elsewhere.read_bytes() == object_file("k", b"e" * 100)
    reported = [r.getMessage() for r in caplog.records if "not kvflow's" in r.getMessage()]
    assert len(reported) == 1 and str(entry) in reported[0], reported
    entry.unlink()
    assert await backend.put([ref("k", bytearray(b"v" * 100))]) == [PutStatus.STORED]
    target = bytearray(100)
    assert await backend.get([ref("k", target)]) == [GetStatus.HIT] and target == b"v" * 100
    await backend.aclose()


# --- modes -----------------------------------------------------------------------------------------


async def test_everything_is_private_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "a" / "store"
    temp_modes: list[int] = []
    monkeypatch.setattr(local, "_mid_write_hook", lambda temp: temp_modes.append(mode(Path(temp))))
    old = os.umask(0)
    try:
        backend = open_store(store)
        assert await backend.put([ObjectRef.of("k", *_two_regions(bytearray(5000)))]) == [PutStatus.STORED]
    finally:
        os.umask(old)
    dirs = [store.parent, store, store / "objects", store / "tmp"]
    assert [mode(p) for p in dirs] == [0o700] * 4
    assert mode(store / "kvflow.lock") == 0o600 and mode(store / "objects" / "k") == 0o600
    assert temp_modes == [0o600]
    await backend.aclose()


def _two_regions(buf: bytearray) -> tuple[list[int], list[int]]:
    _alive.append(buf)
    addr, half = buffer_address(buf), len(buf) // 2
    return [addr, addr + half], [half, len(buf) - half]


async def test_an_old_store_of_mine_open_to_reading_is_made_private(tmp_path: Path) -> None:
    """A store an older kvflow made (0755 directories, 0644 files) is tightened, not refused."""
    store = tmp_path / "store"
    backend = open_store(store)
    await backend.aclose()
    for path in (store, store / "objects", store / "tmp"):
        path.chmod(0o755)
    (store / "kvflow.lock").chmod(0o644)
    backend = open_store(store)
    assert [mode(p) for p in (store, store / "objects", store / "tmp", store / "kvflow.lock")] == [
        0o700,
        0o700,
        0o700,
        0o600,
    ]
    await backend.aclose()


def test_a_readable_directory_that_is_not_a_store_is_refused_not_changed(tmp_path: Path) -> None:
    somewhere = tmp_path / "somewhere"
    somewhere.mkdir()
    somewhere.chmod(0o755)
    with pytest.raises(ConfigError, match="chmod 700") as info:
        open_store(somewhere)
    assert str(somewhere) in str(info.value) and "mode 0755" in str(info.value)
    assert mode(somewhere) == 0o755 and list(somewhere.iterdir()) == []


# --- sharing with a group ------------------------------------------------------------------------


def _share(path: str, key: str, fill: int, read: list[str]) -> dict[str, str]:
    """As a group member: open the shared store, put ``key``, get every key of ``read``."""

    async def run() -> dict[str, str]:
        backend = LocalBackend.from_url(f"local://{path}?group={SHARED_GID}&capacity=1MiB")
        report = {key: (await backend.put([ref(key, bytearray([fill]) * 3000)]))[0].value}
        for other in read:
            target = bytearray(3000)
            status = (await backend.get([ref(other, target)]))[0]
            report[other] = status.value if status is not GetStatus.HIT else f"hit:{target[0]}:{target[-1]}"
        await backend.aclose()
        return report

    return anyio.run(run)


def _open_fails(url: str) -> str:
    try:
        LocalBackend.from_url(url)
    except ConfigError as exc:
        return str(exc)
    return "opened"


def _read_raw(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read()
    except PermissionError:
        return "denied"
    return "read"


@needs_root
def test_a_store_shared_with_a_group_serves_its_members_and_nobody_else(shared_parent: Path) -> None:
    store = shared_parent / "team" / "shared-kv"  # A makes "team" too: the group may only pass through it
    group = (SHARED_GID,)
    assert as_user(_share, str(store), "from-a", 1, [], uid=MEMBER_A, groups=group) == {"from-a": "stored"}
    st = store.parent.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (MEMBER_A, SHARED_GID, 0o710)
    st = store.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (MEMBER_A, SHARED_GID, 0o2770)
    for path in (store / "objects", store / "tmp"):
        assert (path.stat().st_gid, mode(path)) == (SHARED_GID, 0o2770)
    for path in (store / "kvflow.lock", store / "objects" / "from-a"):
        assert (path.stat().st_gid, mode(path)) == (SHARED_GID, 0o660)
    # Another member reads A's object and adds one; A then reads it. B cannot set the time of A's
    # object, only "now": reading it, or putting it again, still marks it used.
    used = (store / "objects" / "from-a").stat().st_mtime_ns
    assert as_user(_share, str(store), "from-b", 2, ["from-a"], uid=MEMBER_B, groups=group) == {
        "from-b": "stored",
        "from-a": "hit:1:1",
    }
    assert (store / "objects" / "from-a").stat().st_mtime_ns > used
    used = (store / "objects" / "from-a").stat().st_mtime_ns
    assert as_user(_share, str(store), "from-a", 3, [], uid=MEMBER_B, groups=group) == {"from-a": "present"}
    assert (store / "objects" / "from-a").stat().st_mtime_ns > used
    assert as_user(_share, str(store), "from-a", 1, ["from-b"], uid=MEMBER_A, groups=group) == {
        "from-a": "present",
        "from-b": "hit:2:2",
    }
    # Someone outside the group can neither open it (either way) nor read a file.
    url = f"local://{store}?group={SHARED_GID}"
    assert "not a member" in as_user(_open_fails, url, uid=OUTSIDER)
    assert "cannot use" in as_user(_open_fails, f"local://{store}", uid=OUTSIDER)
    assert as_user(_read_raw, str(store / "objects" / "from-a"), uid=OUTSIDER) == "denied"


def test_a_group_i_am_not_in_is_refused(tmp_path: Path) -> None:
    not_mine = next(g for g in range(60000, 61000) if g != os.getegid() and g not in os.getgroups())
    with pytest.raises(ConfigError, match="not a member"):
        open_store(tmp_path / "store", group=str(not_mine))
    with pytest.raises(ConfigError, match="no such group"):
        open_store(tmp_path / "store", group="no-such-group-kvflow")
    assert not (tmp_path / "store").exists()


@needs_root
def test_a_private_store_refuses_a_directory_of_another_group_member(shared_parent: Path) -> None:
    store = shared_parent / "shared-kv"
    as_user(_share, str(store), "k", 1, [], uid=MEMBER_A, groups=(SHARED_GID,))
    with pytest.raises(ConfigError, match="another user"):
        open_store(store)  # private: even root does not take another user's store as its own


@needs_root
def test_a_link_another_member_planted_at_an_objects_name_is_never_followed_to_mark_it_used(
    shared_parent: Path,
) -> None:
    """Member B plants a symbolic link at key "k"'s name, pointing at A's object "o". A's put of
    "k" cannot set the link's time (the link is B's) and falls back to "now", on the link itself:
    "o" keeps its time (its LRU position) and its bytes."""
    store = shared_parent / "shared-kv"
    group = (SHARED_GID,)
    assert as_user(_share, str(store), "o", 1, [], uid=MEMBER_A, groups=group) == {"o": "stored"}
    target = store / "objects" / "o"
    link = store / "objects" / "k"
    link.symlink_to(target)
    os.lchown(link, MEMBER_B, SHARED_GID)  # as B would have made it
    before = target.stat()
    as_user(_share, str(store), "k", 2, [], uid=MEMBER_A, groups=group)
    after = target.stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert link.is_symlink() and target.read_bytes()[-3000:] == bytes([1]) * 3000


# --- what is counted: never a name, never what is not kvflow's ----------------------------------


async def test_temp_file_names_cannot_claim_space(tmp_path: Path) -> None:
    """Zero-byte files whose names claim huge reservations are counted at their real size."""
    size = 1000
    capacity = 4 * (HEADER_SIZE + size)
    backend = open_store(tmp_path, capacity=capacity)
    keys = ["a", "b", "c"]
    assert await backend.put([ref(k, bytearray(size)) for k in keys]) == [PutStatus.STORED] * 3
    me = WriterId.current()
    for writer in (me, WriterId(me.namespace + 1, 1, 1)):  # alive: this process; another namespace
        (tmp_path / "tmp" / TempName(writer, 10**15, f"fake{writer.pid}").format()).touch()
    assert await backend.usage() == 3 * (HEADER_SIZE + size)
    assert await backend.put([ref("d", bytearray(size))]) == [PutStatus.STORED]
    assert await backend.exists([*keys, "d"]) == [True] * 4
    assert backend.stats().evictions == 0
    await backend.aclose()


async def test_entries_that_are_not_kvflows_are_ignored_and_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = open_store(tmp_path, capacity=1 << 20)
    objects, tmp = tmp_path / "objects", tmp_path / "tmp"
    (objects / ".hidden").write_bytes(b"x" * 5000)  # not an object file name
    (objects / "subdir").mkdir()
    os.mkfifo(objects / "fifo")
    (objects / "link").symlink_to(tmp_path / "kvflow.lock")
    (tmp / "junk.txt").write_bytes(b"y" * 7000)  # not a temp file name
    with caplog.at_level(logging.WARNING, logger="kvflow.backends.local.space"):
        assert await backend.usage() == 0
        assert await backend.usage() == 0
    reported = [r.getMessage() for r in caplog.records if "not kvflow's" in r.getMessage()]
    assert len(reported) == 5, reported  # each once, though scanned twice
    assert all(str(tmp_path) in line for line in reported)
    assert {p.name for p in objects.iterdir()} == {".hidden", "subdir", "fifo", "link"}  # left alone
    assert (tmp / "junk.txt").exists()
    await backend.aclose()


@needs_root
async def test_an_object_owned_by_another_user_is_a_miss_and_not_counted(tmp_path: Path) -> None:
    backend = open_store(tmp_path)
    planted = tmp_path / "objects" / "k"
    planted.write_bytes(object_file("k", b"p" * 2000))
    os.chown(planted, NOBODY, NOBODY)
    assert await backend.get([ref("k", bytearray(2000))]) == [GetStatus.MISS]
    assert await backend.exists(["k"]) == [False]
    assert await backend.usage() == 0
    assert await backend.remove(["k", "missing"]) == [False, False]  # neither removed nor counted
    assert await backend.clear() == 0
    assert planted.exists()  # not ours to delete
    await backend.aclose()


# --- a full filesystem ---------------------------------------------------------------------------


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs filled to the last byte (needs root; skipped elsewhere)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_opening_a_store_on_a_full_filesystem_says_so(full_tmpfs: Path) -> None:
    store = full_tmpfs / "store"
    with pytest.raises(ConfigError, match="full") as info:
        open_store(store)
    assert str(store) in str(info.value)
    assert "free space (or inodes) there, or give a directory on another filesystem" in str(info.value)


# --- the access rules, one by one -----------------------------------------------------------------


def _stat(mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


def test_what_makes_a_file_foreign_in_a_private_store_and_in_a_shared_one() -> None:
    private, shared = Access(1000), Access(1000, SHARED_GID)
    regular, directory = stat.S_IFREG, stat.S_IFDIR
    cases = [
        (private, _stat(directory | 0o700, 1000, 1000), "not a regular file"),
        (private, _stat(regular | 0o600, 1001, 1000), "owned by uid 1001"),
        (private, _stat(regular | 0o640, 1000, 5), None),  # readable by its group: a reader's problem only
        (private, _stat(regular | 0o620, 1000, 1000), "writable by others (mode 0620)"),
        (private, _stat(regular | 0o602, 1000, 1000), "writable by others (mode 0602)"),
        (private, _stat(regular | 0o645, 1000, 1000), None),  # readable and executable: not writable
        (shared, _stat(regular | 0o660, 1002, SHARED_GID), None),  # another member's object
        (shared, _stat(regular | 0o660, 1000, SHARED_GID + 1), f"of group gid {SHARED_GID + 1}"),
        (shared, _stat(regular | 0o662, 1000, SHARED_GID), "writable by others (mode 0662)"),
        (shared, _stat(regular | 0o665, 1000, SHARED_GID), None),
    ]
    for access, st, why in cases:
        assert access.foreign(st) == why, (access, oct(st.st_mode), why)


@needs_root
def test_opening_fixes_my_stores_modes_and_refuses_what_it_must_not_change(tmp_path: Path) -> None:
    private, shared = Access(os.geteuid()), Access(os.geteuid(), SHARED_GID)
    path = tmp_path / "d"
    path.mkdir()
    file = tmp_path / "f"
    file.write_bytes(b"")
    cases = [  # (access, what, mode before, directory, mode after)
        (private, file, 0o644, False, 0o600),
        (shared, file, 0o600, False, 0o660),  # the group's bits are added
        (private, path, 0o755, True, 0o700),
        (shared, path, 0o700, True, 0o2770),  # and setgid, so new files are the group's
        (shared, path, 0o770, True, 0o2770),  # setgid alone missing
    ]
    for access, what, before, directory, after in cases:
        os.chown(what, os.geteuid(), SHARED_GID if access.gid else os.getegid())
        what.chmod(before)
        fd = os.open(what, os.O_RDONLY)
        try:
            access.verify(fd, str(what), directory=directory, created=False, may_fix=True)
        finally:
            os.close(fd)
        assert stat.S_IMODE(what.stat().st_mode) == after, (access, what, oct(before))
    file.chmod(0o644)
    fd = os.open(file, os.O_RDONLY)
    try:
        with pytest.raises(ConfigError, match=r"run chmod 600 .*; if not, ask its owner to"):
            private.verify(fd, str(file), directory=False, created=False, may_fix=False)
        assert stat.S_IMODE(file.stat().st_mode) == 0o644  # refused, not changed
        with pytest.raises(ConfigError, match=rf"{file} is not a directory \(owner "):
            private.verify(fd, str(file), directory=True, created=False, may_fix=True)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ConfigError, match=rf"{path} is not a file \(owner "):
            private.verify(fd, str(path), directory=False, created=False, may_fix=True)
    finally:
        os.close(fd)


@needs_root
def test_a_lock_file_of_another_user_is_refused_with_what_to_do(tmp_path: Path) -> None:
    store = tmp_path / "store"
    anyio.run(open_store(store).aclose)
    os.chown(store / "kvflow.lock", NOBODY, NOBODY)
    with pytest.raises(
        ConfigError, match=r"belongs to another user.*add \?group=NAME for a group you are both in"
    ):
        open_store(store)


@needs_root
async def test_a_recount_removes_only_my_dead_writers_temp_files_and_counts_only_the_live(
    tmp_path: Path,
) -> None:
    """Temp files in tmp/: a dead writer's (removed), the same name owned by another user or
    writable by others (not kvflow's: left alone, not counted), a name that is no writer's (left),
    and three files of two live writers (counted at their sizes on disk, all of them)."""
    backend = open_store(tmp_path)
    tmp = tmp_path / "tmp"
    me = WriterId.current()
    dead = WriterId(me.namespace, me.pid, me.start + 1)
    elsewhere = WriterId(me.namespace + 1, 1, 1)  # another pid namespace: alive as far as we know

    def temp(writer: WriterId, token: str, size: int, *, owner: int | None = None, mode: int = 0o600) -> str:
        name = TempName(writer, 10**12, token).format()
        (tmp / name).write_bytes(b"t" * size)
        (tmp / name).chmod(mode)
        if owner is not None:
            os.chown(tmp / name, owner, owner)
        return name

    temp(dead, "mine", 1000)
    kept = {
        temp(dead, "theirs", 1000, owner=NOBODY),
        temp(dead, "writable", 1000, mode=0o622),
        temp(me, "live1", 100),
        temp(me, "live2", 50),
        temp(elsewhere, "live3", 200),
    }
    (tmp / "junk.tmp").write_bytes(b"j" * 1000)
    assert await backend.usage() == 350
    assert {p.name for p in tmp.iterdir()} == kept | {"junk.tmp"}
    await backend.aclose()


# --- what each refusal says, word for word; modes set once, fixes logged -------------------------


def _described(path: Path) -> str:
    st = path.lstat()
    return f"owner {user_name(st.st_uid)}, group {group_name(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def _verify_dir(access: Access, path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        access.verify(fd, str(path), directory=True, created=False, may_fix=False)
    finally:
        os.close(fd)


@needs_root
@pytest.mark.parametrize("case", ["another user's", "another group's", "writable by all", "group-writable"])
def test_each_refusal_of_a_directory_says_exactly_what_is_wrong_and_what_to_do(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / "store"
    path.mkdir()
    me, private, shared = os.geteuid(), Access(os.geteuid()), Access(os.geteuid(), SHARED_GID)
    access = shared if case == "another group's" else private
    owner, mode_bits = {
        "another user's": (NOBODY, 0o700),
        "another group's": (me, 0o2770),
        "writable by all": (me, 0o777),
        "group-writable": (me, 0o770),
    }[case]
    os.chown(path, owner, os.getegid())
    path.chmod(mode_bits)
    p, d = str(path), _described(path)
    expected = {
        "another user's": f"refusing the local store {p}: it belongs to another user ({d}), so that user "
        "could read your KV objects or plant false ones. Give a path that does not exist yet (kvflow "
        "creates it, private to you), or ask an administrator to remove this one; to share a store on "
        "purpose, add ?group=NAME for a group you are both in (see docs/security.md)",
        "another group's": f"refusing the local store {p}: it is not of group gid {SHARED_GID} that the URL "
        f"shares the store with ({d}). Use a new directory, which kvflow creates for the group, or have its "
        f"owner run chgrp {SHARED_GID} {p} and chmod 2770 {p}",
        "writable by all": f"refusing the local store {p}: every user of the host can write it ({d}), so "
        "anyone could plant objects or swap its files. Remove it (if it is yours) and let kvflow create it, "
        "or use a directory of your own",
        "group-writable": f"refusing the local store {p}: its group {group_name(os.getegid())} can write it "
        f"({d}), and the store is private. To share it with that group on purpose add "
        f"?group={os.getegid()} to the URL; otherwise run chmod g-w,o-rwx {p}",
    }[case]
    with pytest.raises(ConfigError) as info:
        _verify_dir(access, path)
    assert str(info.value) == expected


def test_a_group_i_am_not_in_is_refused_word_for_word() -> None:
    """The refusal says how to join the group, or how to keep the store private."""
    not_mine = next(g for g in range(60000, 61000) if g != os.getegid() and g not in os.getgroups())
    with pytest.raises(ConfigError) as info:
        Access.of(str(not_mine))
    assert str(info.value) == (
        f"group={not_mine} names {group_name(not_mine)}, but {user_name(os.geteuid())} is not a member "
        "of it; a store can only be shared with a group you belong to (add yourself with usermod -aG "
        "GROUP USER and log in again), or leave group= out for a private store"
    )


def test_the_root_directory_is_not_a_store() -> None:
    with pytest.raises(ConfigError) as info:
        StoreDirs.open("/", Access.of(None))
    assert str(info.value) == "the local backend needs a directory of its own, not '/'"


def test_a_symlinked_store_is_refused_word_for_word(tmp_path: Path) -> None:
    """The refusal names the link, its target and owner, and what to give instead."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    store = tmp_path / "store"
    store.symlink_to(real)
    with pytest.raises(ConfigError) as info:
        StoreDirs.open(str(store), Access.of(None))
    assert str(info.value) == (
        f"refusing the local store path {store}: it is a symbolic link (to {str(real)!r}, owner "
        f"{user_name(os.geteuid())}); kvflow opens nothing through a symlink, which could point it at files "
        "it must not touch. Give the real directory's path, or remove the link"
    )
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("lock", ["a link to a file of mine", "a directory"])
def test_a_directory_whose_lock_is_not_a_kvflow_lock_file_is_not_taken_for_my_store(
    tmp_path: Path, lock: str
) -> None:
    """Only a directory holding this user's regular lock file is a store of this user's whose
    modes kvflow may fix; anything else readable by others is refused and left as it was."""
    somewhere = tmp_path / "somewhere"
    somewhere.mkdir()
    if lock == "a directory":
        (somewhere / "kvflow.lock").mkdir()
    else:
        (tmp_path / "mine").write_bytes(b"")
        (somewhere / "kvflow.lock").symlink_to(tmp_path / "mine")
    somewhere.chmod(0o750)
    with pytest.raises(ConfigError, match="chmod 700"):
        StoreDirs.open(str(somewhere), Access.of(None))
    assert mode(somewhere) == 0o750 and sorted(p.name for p in somewhere.iterdir()) == ["kvflow.lock"]


@pytest.mark.parametrize("umask", [0o077, 0o022])
@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_new_store_gets_its_modes_as_it_is_made_and_an_old_one_is_fixed_aloud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, shared: bool, umask: int
) -> None:
    """Whatever the umask, a new store's files and directories are made with the access's modes
    (nothing to fix, nothing logged); a file of an existing store with other modes is fixed and
    the change logged."""
    access = Access.of(str(os.getegid()) if shared else None)
    store = tmp_path / "store"
    old = os.umask(umask)
    try:
        with caplog.at_level(logging.INFO, logger="kvflow.backends.local.safety"):
            StoreDirs.open(str(store), access).close()
    finally:
        os.umask(old)
    assert [r.getMessage() for r in caplog.records if "changed the mode" in r.getMessage()] == []
    assert mode(store / "kvflow.lock") == access.file_mode
    assert [mode(store / d) for d in ("", "objects", "tmp")] == [access.dir_mode] * 3
    (store / "kvflow.lock").chmod(0o644)
    with caplog.at_level(logging.INFO, logger="kvflow.backends.local.safety"):
        StoreDirs.open(str(store), access).close()
    want = access.file_mode
    assert [r.getMessage() for r in caplog.records if "changed the mode" in r.getMessage()] == [
        f"local backend: changed the mode of {store}/kvflow.lock from 0644 to {want:04o}"
    ]
    assert mode(store / "kvflow.lock") == want


def test_a_parent_another_process_creates_meanwhile_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "a" / "b" / "store"
    real_mkdir = os.mkdir

    def raced(path: Any, mode: int = 0o777, **kwargs: Any) -> None:
        if str(path) == str(tmp_path / "a"):
            real_mkdir(path, 0o700)  # another process made it first
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        real_mkdir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", raced)
    StoreDirs.open(str(store), Access.of(None)).close()
    assert (store / "objects").is_dir() and mode(tmp_path / "a" / "b") == 0o700


def test_closing_a_store_closes_every_descriptor_even_when_one_close_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close that reports an error (EIO on a network filesystem) does not keep the rest open."""
    dirs = StoreDirs.open(str(tmp_path / "store"), Access.of(None))
    fds = [dirs.lock_fd, dirs.tmp_fd, dirs.objects_fd, dirs.root_fd]
    real_close = os.close

    def first_fails(fd: int) -> None:
        real_close(fd)
        if fd == fds[0]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    closed: list[int] = []
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), first_fails(fd)))
    dirs.close()
    monkeypatch.undo()
    assert sorted(closed) == sorted(fds)
