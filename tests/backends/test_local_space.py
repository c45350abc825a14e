"""The local store's byte budget (kvflow/backends/local/space.py), driven directly: the shared
counter, scans, reservations and their temp files, and what the ledger does when the filesystem
or something outside kvflow gets in the way. (tests/backends/test_local.py drives it through the
backend, with real processes.)"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvflow.backends.local.space as space
from kvflow.backends.base import PutStatus
from kvflow.backends.local import LocalBackend, LocalConfig
from kvflow.backends.local.format import TempName, WriterId, object_file_name
from kvflow.backends.local.safety import Access
from kvflow.backends.local.space import Reservation, SpaceLedger
from kvflow.errors import BackendUnavailableError, ConfigError
from tests.helpers import open_fds

_COUNTER = struct.Struct("<8sQ")


def open_ledger(root: Path, capacity: int = 1 << 20, lock_timeout_s: float = 1.0) -> SpaceLedger:
    return SpaceLedger.open(str(root), capacity, lock_timeout_s, Access.of(None))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


@contextlib.contextmanager
def ledger_at(root: Path, capacity: int = 1 << 20) -> Iterator[SpaceLedger]:
    ledger = open_ledger(root, capacity)
    try:
        yield ledger
    finally:
        ledger.close()


def plant(directory: Path, name: str, size: int) -> None:
    """A file as kvflow makes them (this user's, mode 0600), ``size`` bytes long."""
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)


def section(ledger: SpaceLedger) -> contextlib.AbstractContextManager[None]:
    return ledger.locked_blocking(1.0)


def write_counter(root: Path, magic: bytes, used: int) -> None:
    with open(root / "kvflow.lock", "r+b") as f:
        f.write(_COUNTER.pack(magic, used))


# --- the shared counter ---------------------------------------------------------------------------


def test_every_section_leaves_its_usage_in_the_shared_counter(root: Path) -> None:
    """The counter in the lock file, which every process reads, holds the usage after each section."""
    with ledger_at(root) as ledger:
        plant(root / "objects", object_file_name("a"), 3000)
        with section(ledger):
            ledger.scan()
        assert _COUNTER.unpack((root / "kvflow.lock").read_bytes()[: _COUNTER.size]) == (b"KVFLUSE1", 3000)


def test_a_section_trusts_the_counter_and_recounts_only_one_it_cannot_read(root: Path) -> None:
    """Every process keeps the counter exact, so a section starts from it instead of listing the
    store (which costs a directory scan); a counter that is not kvflow's, or cut short, is rebuilt
    from the files."""
    with ledger_at(root) as ledger:
        plant(root / "objects", object_file_name("a"), 3000)
        write_counter(root, b"KVFLUSE1", 12345)
        with section(ledger):
            assert ledger.used == 12345
        write_counter(root, b"KVFLUSE0", 12345)
        with section(ledger):
            assert ledger.used == 3000
        os.truncate(root / "kvflow.lock", 5)
        with section(ledger):
            assert ledger.used == 3000


def test_a_section_whose_recount_fails_unlocks_the_store(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A section that fails while it recounts lets go of the lock, so other processes are not stuck."""
    with ledger_at(root) as ledger, ledger_at(root) as other:
        write_counter(root, b"garbage!", 0)  # the next section recounts

        def broken(self: SpaceLedger) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(SpaceLedger, "scan", broken)
        with pytest.raises(OSError, match="Input/output error"), section(ledger):
            pass
        monkeypatch.undo()
        with other.locked_blocking(0.5):  # another instance gets the lock at once
            assert other.used == 0


# --- opening --------------------------------------------------------------------------------------


@pytest.mark.parametrize("excess", [0, 1])
def test_a_capacity_beyond_the_filesystem_is_warned_about(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, excess: int
) -> None:
    """A budget the filesystem cannot hold is allowed (puts then find it full), and said once."""
    size = 1000 * 4096

    class Fs:
        f_blocks, f_frsize = 1000, 4096

    monkeypatch.setattr(os, "statvfs", lambda fd: Fs())
    with caplog.at_level(logging.WARNING, logger=space.__name__), ledger_at(root, size + excess):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = (
        f"local backend capacity {size + excess} exceeds the size of the filesystem of {root} "
        f"({size} bytes); puts will report NO_SPACE when it fills"
    )
    assert warnings == ([expected] if excess else [])


def test_a_store_whose_lock_stays_taken_cannot_be_opened_and_says_why(root: Path) -> None:
    """Another process holds the lock past the timeout: the error names the lock, nothing stays open."""
    with ledger_at(root):
        pass
    fds = open_fds()
    holder = os.open(root / "kvflow.lock", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(BackendUnavailableError) as err:
            SpaceLedger.open(str(root), 1 << 20, 0.05, Access.of(None))
    finally:
        os.close(holder)
    assert str(err.value) == f"cannot open the local backend: waited 0.05s for the lock {root}/kvflow.lock"
    assert open_fds() == fds  # the store's descriptors were closed


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            errno.EPERM,
            "the local backend cannot write objects in {root}: Operation not permitted. It needs a "
            "writable directory on a local filesystem with hard links (tmpfs, ext4, xfs), e.g. local:// "
            "(a private directory in /dev/shm)",
        ),
        (
            errno.ENOSPC,
            "the local backend cannot use {root}: the filesystem holding it is full (No space left on "
            "device); free space (or inodes) there, or give a directory on another filesystem",
        ),
    ],
)
def test_a_directory_without_hard_links_or_space_is_refused_with_what_to_do(
    root: Path, monkeypatch: pytest.MonkeyPatch, error: int, message: str
) -> None:
    """Publishing needs hard links and room for a probe file: without either the store is refused
    with what to do, and the probe is gone."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(os, "link", refuse)
    fds = open_fds()
    with pytest.raises(ConfigError) as err:
        open_ledger(root)
    assert str(err.value) == message.format(root=root)
    assert list((root / "tmp").iterdir()) == []  # the probe file is gone
    assert open_fds() == fds


# --- reservations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recycled", [False, True], ids=["new", "recycled"])
def test_a_reservation_is_a_temp_file_of_its_writer_and_releases_once(root: Path, recycled: bool) -> None:
    """A reservation's temp file carries its writer in its name (so other processes count it, and
    remove it if the writer dies) and is sized to the reservation. Releasing gives the bytes back
    once, however often it is called."""
    with ledger_at(root, capacity=1000) as ledger:
        if recycled:
            plant(root / "objects", object_file_name("old"), 1000)
            with section(ledger):
                ledger.scan()
        with section(ledger):
            [res] = ledger.reserve([1000])
        assert isinstance(res, Reservation)
        assert ledger.evictions == int(recycled) and os.listdir(root / "objects") == []
        assert os.listdir(root / "tmp") == [res.name]
        temp = TempName.parse(res.name)
        assert temp is not None and (temp.writer, temp.reserved) == (ledger.writer, 1000)
        assert os.fstat(res.fd).st_size == 1000
        assert ledger.used == 1000
        with section(ledger):
            ledger.release([res])
        assert (res.fd, res.settled, ledger.used) == (-1, True, 0)
        with section(ledger):
            ledger.release([res])
        assert (res.fd, res.settled, ledger.used) == (-1, True, 0)
        assert os.listdir(root / "tmp") == []


@pytest.mark.parametrize("how", ["refused", "swapped for a link"])
def test_a_victim_that_cannot_be_reopened_safely_is_removed_and_a_new_file_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The evicted object's file, moved into tmp/ to be reused, cannot be opened (another user's
    file), or was replaced by a link meanwhile: it is removed, never written through, and the
    reservation gets a new file."""
    root = tmp_path / "store"
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 100)
    with ledger_at(root, capacity=1000) as ledger:
        plant(root / "objects", object_file_name("old"), 1000)
        with section(ledger):
            ledger.scan()
        real_open, real_rename = os.open, os.rename

        def refuse_reopen(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if not flags & os.O_CREAT:  # reopening the recycled victim
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            return real_open(path, flags, *args, **kwargs)

        def swap_for_link(src: str, dst: str, **kwargs: Any) -> None:
            real_rename(src, dst, **kwargs)
            os.unlink(dst, dir_fd=kwargs["dst_dir_fd"])
            os.symlink(target, dst, dir_fd=kwargs["dst_dir_fd"])

        if how == "refused":
            monkeypatch.setattr(os, "open", refuse_reopen)
        else:
            monkeypatch.setattr(os, "rename", swap_for_link)
        with section(ledger):
            [res] = ledger.reserve([1000])
        monkeypatch.undo()
        assert isinstance(res, Reservation)
        assert os.listdir(root / "tmp") == [res.name] and os.listdir(root / "objects") == []
        assert (os.fstat(res.fd).st_size, ledger.used) == (1000, 1000)
        assert target.read_bytes() == b"x" * 100
        with section(ledger):
            ledger.release([res])


def test_a_temp_file_whose_mode_cannot_be_set_fails_that_object_and_leaves_nothing(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fchmod refused on a new temp file: that object fails, no descriptor or file is left."""
    with ledger_at(root) as ledger:

        def refuse(fd: int, mode: int) -> None:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

        fds = open_fds()
        monkeypatch.setattr(os, "fchmod", refuse)
        with section(ledger):
            assert ledger.reserve([1000]) == [PutStatus.FAILED]
        monkeypatch.undo()
        assert open_fds() == fds
        assert os.listdir(root / "tmp") == [] and ledger.used == 0


def a_then_b(root: Path, ledger: SpaceLedger) -> None:
    """Objects a and b of 1000 bytes, a the older, listed by a scan as the eviction candidates."""
    for key in ("a", "b"):
        plant(root / "objects", object_file_name(key), 1000)
    os.utime(root / "objects" / object_file_name("a"), ns=(1, 1))
    with section(ledger):
        ledger.scan()


def test_a_victim_removed_outside_kvflow_before_its_eviction_is_passed_over(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone deletes the least recently used object between the scan and the eviction: the
    ledger counts its bytes free (they are) and makes the reservation, evicting nothing else for
    it (it evicted the next candidate before, and kept counting the deleted bytes)."""
    with ledger_at(root, capacity=2000) as ledger:
        a_then_b(root, ledger)
        real_rename = os.rename

        def removed_first(src: str, dst: str, **kwargs: Any) -> None:
            if src == object_file_name("a"):
                os.unlink(src, dir_fd=kwargs["src_dir_fd"])
            real_rename(src, dst, **kwargs)

        monkeypatch.setattr(os, "rename", removed_first)
        with section(ledger):
            [res] = ledger.reserve([1000])
        monkeypatch.undo()
        assert isinstance(res, Reservation)
        assert os.listdir(root / "objects") == [object_file_name("b")] and ledger.evictions == 0
        assert ledger.used == 2000  # b and the reservation
        with section(ledger):
            ledger.release([res])


def test_a_second_victim_removed_outside_kvflow_is_freed_but_not_counted_as_evicted(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object needs two victims; the second is deleted by someone else just before kvflow
    removes it: its bytes count as freed (they are), and it is not counted as an eviction."""
    with ledger_at(root, capacity=2000) as ledger:
        a_then_b(root, ledger)
        real_unlink = os.unlink

        def removed_first(name: str, **kwargs: Any) -> None:
            if name == object_file_name("b"):
                real_unlink(name, **kwargs)  # someone else's
            real_unlink(name, **kwargs)

        monkeypatch.setattr(os, "unlink", removed_first)
        with section(ledger):
            [res] = ledger.reserve([2000])
        monkeypatch.undo()
        assert isinstance(res, Reservation)
        assert os.listdir(root / "objects") == [] and ledger.evictions == 1
        assert ledger.used == 2000
        with section(ledger):
            ledger.release([res])


def test_an_eviction_that_rescans_counts_live_writers_but_not_its_own_victim_twice(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put runs out of candidates mid-eviction and rescans: the victim it already recycled (its
    own temp file, listed first here) is skipped, and every live writer's temp file after it is
    still counted, so the put evicts enough."""
    with ledger_at(root, capacity=3000) as ledger:
        plant(root / "objects", object_file_name("a"), 1000)
        with section(ledger):
            ledger.scan()  # the candidates: a only
        plant(root / "objects", object_file_name("b"), 1000)  # then another process stores b ...
        live = TempName(ledger.writer, 1000, "other").format()
        plant(root / "tmp", live, 1000)  # ... and is writing another object
        write_counter(root, b"KVFLUSE1", 3000)
        real_scandir = os.scandir

        @contextlib.contextmanager
        def newest_first(fd: Any) -> Iterator[Any]:
            with real_scandir(fd) as entries:
                yield iter(sorted(entries, key=lambda e: e.name, reverse=True))

        monkeypatch.setattr(os, "scandir", newest_first)
        with section(ledger):
            [res] = ledger.reserve([1500])  # recycles a, then rescans and evicts b
        monkeypatch.undo()
        assert isinstance(res, Reservation)
        assert os.listdir(root / "objects") == [] and ledger.evictions == 2
        assert ledger.used == 2500
        with section(ledger):
            ledger.scan()
            assert ledger.used == 2500
            ledger.release([res])


# --- scans ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["objects", "tmp"])
def test_a_file_removed_while_a_scan_lists_it_is_skipped_and_the_rest_counted(
    root: Path, vanish_first_entry: Callable[[], None], where: str
) -> None:
    """Another process removes an object (or ends a write) while a scan lists the directory: that
    file is skipped, every file after it still counted."""
    with ledger_at(root) as ledger:
        names = (
            [object_file_name(k) for k in "abc"]
            if where == "objects"
            else [TempName(ledger.writer, 100, t).format() for t in ("aa", "bb", "cc")]
        )
        for name, size in zip(names, (100, 200, 400)):
            plant(root / where, name, size)
        vanish_first_entry()
        with section(ledger):
            ledger.scan()
        assert ledger.used == 600


def test_foreign_entries_are_reported_once_each_within_the_memory_limit(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each foreign entry is logged once; past the limit of remembered entries, again each scan
    (the memory stays bounded whatever a directory holds)."""
    monkeypatch.setattr(space, "_REPORT_LIMIT", 1)
    with ledger_at(root) as ledger:
        for name in (".junk1", ".junk2"):
            plant(root / "objects", name, 10)
        with caplog.at_level(logging.WARNING, logger=space.__name__), section(ledger):
            ledger.scan()
            ledger.scan()
    counts = [sum(f"objects/{n}'" in r.getMessage() for r in caplog.records) for n in (".junk1", ".junk2")]
    assert sorted(counts) == [1, 2]


def test_a_link_planted_as_a_dead_writers_temp_file_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link named like a dead writer's temp file is reported, not followed or removed (its target is
    a file this user could write: following it would count or delete it)."""
    root = tmp_path / "store"
    with ledger_at(root) as ledger:
        me = ledger.writer
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 100)
    target.chmod(0o600)
    dead = TempName(WriterId(me.namespace, me.pid, me.start + 1), 100, "aa").format()
    (root / "tmp" / dead).symlink_to(target)
    with caplog.at_level(logging.WARNING, logger=space.__name__), ledger_at(root) as ledger:
        assert ledger.used == 0
    assert (root / "tmp" / dead).is_symlink() and target.read_bytes() == b"x" * 100
    assert any("not a regular file" in r.getMessage() for r in caplog.records)


async def test_removing_a_key_whose_file_is_a_planted_link_leaves_the_link_and_its_target(
    tmp_path: Path,
) -> None:
    """remove() of a key whose object name holds a link: the link is not kvflow's, so it stays, and its
    target (a file this user owns) is untouched and not counted."""
    root = tmp_path / "store"
    backend = LocalBackend(LocalConfig(str(root)))
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 100)
    target.chmod(0o600)
    (root / "objects" / object_file_name("k")).symlink_to(target)
    assert await backend.remove(["k"]) == [False]
    assert (root / "objects" / object_file_name("k")).is_symlink() and target.exists()
    assert backend.stats().used_bytes == 0
    await backend.aclose()


# --- a put that found no room ----------------------------------------------------------------------


def test_a_refusal_is_made_only_with_no_other_write_in_flight_and_holds_while_the_store_stays(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A section that found no room passes on a refusal (later sections of the put answer
    NO_SPACE for objects that large without looking) only when no other write is in flight: such
    a write would publish an object the put could evict. The refusal lapses once another writer
    reserves, releases or removes something."""
    own = object_file_name("own")
    looked: list[int] = []
    real = SpaceLedger._reserve_one
    monkeypatch.setattr(
        SpaceLedger, "_reserve_one", lambda self, n, keep: looked.append(n) or real(self, n, keep)
    )
    with ledger_at(root, capacity=2000) as ledger, ledger_at(root, capacity=2000) as other:
        plant(root / "objects", own, 1500)  # the put's own object: never its victim
        plant(root / "tmp", "stray.txt", 10)  # not kvflow's: no write in flight
        with section(ledger):
            ledger.scan()
        with section(other):
            [writing] = other.reserve([100])  # another writer's object, not yet published
        with section(ledger):
            plan = ledger.reserve([1000], keep={own})
            assert plan == [PutStatus.NO_SPACE]
            assert ledger.refusal([1000], plan, None) is None
        with section(other):
            other.release([writing])
        with section(ledger):
            plan = ledger.reserve([1000], keep={own})
            refused = ledger.refusal([1000], plan, None)
        assert refused is not None and refused.nbytes == 1000
        looked.clear()
        with section(ledger):
            assert ledger.reserve([1000, 2000], keep={own}, refused=refused) == [PutStatus.NO_SPACE] * 2
        assert looked == []  # the store as it was: no look
        plant(root / "objects", object_file_name("other"), 100)
        with section(other):
            other.scan()
            assert other.remove_if(object_file_name("other"), lambda *_: True)
        with section(ledger):
            assert ledger.reserve([1000], keep={own}, refused=refused) == [PutStatus.NO_SPACE]
        assert looked == [1000]  # an object removed since: it looks again


def test_a_write_that_publishes_during_the_section_that_found_no_room_makes_no_refusal(root: Path) -> None:
    """Another writer's write, in flight when the section's scan listed the store, publishes
    before the section ends (a link and an unlink, without the lock): the scan did not list its
    object, which the put could evict, so the section passes on no refusal."""
    own = object_file_name("own")
    with ledger_at(root, capacity=2000) as ledger, ledger_at(root, capacity=2000) as other:
        plant(root / "objects", own, 1500)
        with section(other):
            [writing] = other.reserve([100])
        with section(ledger):
            ledger.scan()  # lists the other's temp file, not yet an object
            os.link(writing.name, object_file_name("w"), src_dir_fd=other.tmp_fd, dst_dir_fd=other.objects_fd)
            os.unlink(writing.name, dir_fd=other.tmp_fd)  # published
            plan = ledger.reserve([1000], keep={own})
            assert plan == [PutStatus.NO_SPACE]
            assert ledger.refusal([1000], plan, None) is None
        os.close(writing.fd)


def _unlink_refused(refused: str) -> Callable[..., None]:
    """``os.unlink`` that refuses to remove ``refused`` (as a directory the user may not write
    refuses, whatever the process's privileges)."""
    real_unlink = os.unlink

    def unlink(name: str, **kwargs: Any) -> None:
        if name == refused:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        real_unlink(name, **kwargs)

    return unlink


def test_an_object_that_cannot_be_removed_is_neither_reported_removed_nor_uncounted(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remove (``kvflow store clear``, a corrupt object's removal) whose unlink fails leaves the
    object there: it is not reported removed, and its bytes still count in the shared usage."""
    with ledger_at(root) as ledger:
        a_then_b(root, ledger)
        monkeypatch.setattr(os, "unlink", _unlink_refused(object_file_name("a")))
        with section(ledger):
            assert not ledger.remove_if(object_file_name("a"), lambda fd, name: True)
            assert ledger.remove_if(object_file_name("b"), lambda fd, name: True)
        assert sorted(os.listdir(root / "objects")) == [object_file_name("a")]
        assert ledger.used == 1000


def test_a_victim_that_cannot_be_removed_still_counts_and_is_no_eviction(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object needs two victims and the second cannot be removed: its bytes still count, so the
    object finds no room (its first victim given back as free room), and it is no eviction."""
    with ledger_at(root, capacity=2000) as ledger:
        a_then_b(root, ledger)
        monkeypatch.setattr(os, "unlink", _unlink_refused(object_file_name("b")))
        with section(ledger):
            assert ledger.reserve([2000]) == [PutStatus.NO_SPACE]
        monkeypatch.undo()
        assert os.listdir(root / "objects") == [object_file_name("b")]
        assert ledger.evictions == 1  # a, recycled for the put
        assert ledger.used == 1000
