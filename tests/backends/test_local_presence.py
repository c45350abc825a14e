"""The local backend remembers what it found present, and forgets what any process removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvflow.backends.local.backend as local
import kvflow.backends.local.presence as presence
from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend, LocalConfig
from kvflow.backends.local.format import name_hash, object_file_name
from kvflow.backends.local.presence import RING, PresenceMemory, append_removed, read_journal_count
from kvflow.errors import BackendError
from kvflow.regions import buffer_address

KiB = 1024
_alive: list[bytearray] = []


@pytest.fixture(autouse=True)
def _release_buffers() -> Iterator[None]:
    yield
    _alive.clear()


def obj(key: str, size: int = 4 * KiB, fill: int = 1) -> ObjectRef:
    buf = bytearray([fill]) * size
    _alive.append(buf)
    return ObjectRef.of(key, [buffer_address(buf)], [size])


def open_store(path: Path, capacity: int = 64 << 20) -> LocalBackend:
    return LocalBackend(LocalConfig(str(path), capacity_bytes=capacity))


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The object file names (paths relative to the objects directory) stat'ed from now on."""
    seen: list[str] = []
    real = os.stat

    def counting(path: str, *args: object, **kwargs: object) -> os.stat_result:
        if "dir_fd" in kwargs and "/" not in str(path):
            seen.append(path)
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(local.os, "stat", counting)
    return seen


async def test_a_second_lookup_is_answered_from_memory(tmp_path: Path, stats: list[str]) -> None:
    store = open_store(tmp_path)
    await store.put([obj("a"), obj("b")])
    stats.clear()
    assert await store.exists(["a", "b", "c"]) == [True, True, False]
    assert sorted(stats) == ["a", "b", "c"]
    stats.clear()
    assert await store.exists(["a", "b", "c"]) == [True, True, False]
    assert stats == ["c"]  # a miss is asked again: another process may have stored it since
    await store.aclose()


@pytest.mark.parametrize("how", ["remove", "evict", "corrupt"])
async def test_an_object_another_instance_removes_is_forgotten(tmp_path: Path, how: str) -> None:
    """Each way an object leaves the store, by another instance (its own lock file description,
    as another process has), is seen by the next lookup."""
    size, capacity = 64 * KiB, 3 * (64 + 4) * KiB  # room for three objects
    mine, other = open_store(tmp_path, capacity), open_store(tmp_path, capacity)
    assert await mine.put([obj("a", size), obj("b", size)]) == [PutStatus.STORED] * 2
    assert await mine.exists(["a", "b"]) == [True, True]
    if how == "remove":
        assert await other.remove(["a"]) == [True]
    elif how == "evict":  # "c" and "d" need the room of one of them
        assert await other.put([obj("c", size), obj("d", size)]) == [PutStatus.STORED] * 2
    else:
        with open(tmp_path / "objects" / "a", "r+b") as f:  # one payload byte flipped
            f.seek(-1, os.SEEK_END)
            f.write(b"\x07")
        assert await other.get([obj("a", size, fill=0)]) == [GetStatus.MISS]  # and removed
    on_disk = [(tmp_path / "objects" / k).exists() for k in "ab"]
    assert on_disk.count(False) == 1
    assert await mine.exists(["a", "b"]) == on_disk
    await mine.aclose()
    await other.aclose()


async def test_a_removal_by_another_process_is_forgotten(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    await store.put([obj("a"), obj("b")])
    assert await store.exists(["a", "b"]) == [True, True]
    script = textwrap.dedent(
        f"""
        import anyio
        from kvflow.backends.local import LocalBackend, LocalConfig
        async def main():
            store = LocalBackend(LocalConfig({str(tmp_path)!r}))
            assert await store.remove(["b"]) == [True]
            await store.aclose()
        anyio.run(main)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    assert await store.exists(["a", "b"]) == [True, False]
    await store.aclose()


async def test_a_get_that_misses_forgets(tmp_path: Path, stats: list[str]) -> None:
    """An object deleted by hand leaves no journal entry: the lookup says present (a hint), the
    get misses, and from then on the lookup asks the directory again."""
    store = open_store(tmp_path)
    await store.put([obj("a")])
    assert await store.exists(["a"]) == [True]
    os.unlink(tmp_path / "objects" / "a")
    assert await store.exists(["a"]) == [True]
    assert await store.get([obj("a", fill=0)]) == [GetStatus.MISS]
    stats.clear()
    assert await store.exists(["a"]) == [False]
    assert stats == ["a"]
    await store.aclose()


async def test_a_reader_left_behind_by_a_whole_ring_forgets_everything(
    tmp_path: Path, stats: list[str]
) -> None:
    store = open_store(tmp_path)
    await store.put([obj("a")])
    assert await store.exists(["a"]) == [True]
    fd = os.open(tmp_path / "kvflow.lock", os.O_RDWR)
    try:  # more removals than the ring holds, none of them "a": "a" cannot be known to be there
        append_removed(fd, read_journal_count(fd), [f"gone-{i}" for i in range(RING + 1)])
    finally:
        os.close(fd)
    stats.clear()
    assert await store.exists(["a"]) == [True]
    assert stats == ["a"]
    await store.aclose()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[int]:
    """A descriptor of an empty journal, as long as the store makes it."""
    fd = os.open(tmp_path / "journal", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, presence.JOURNAL_END)
    yield fd
    os.close(fd)


def remembering(journal: int, *names: str, limit: int = 1 << 17) -> PresenceMemory:
    """A memory of ``journal`` that found objects ``names`` (each key its own file name)."""
    memory = PresenceMemory(journal, limit=limit)
    memory.refresh()
    memory.add([(n, n) for n in names])
    return memory


def test_entries_that_wrap_round_the_ring_are_all_read(journal: int) -> None:
    count = append_removed(journal, 0, [f"x{i}" for i in range(RING - 2)])
    memory = PresenceMemory(journal)
    memory.refresh()
    names = [f"k{i}" for i in range(6)]
    memory.add([(n, n) for n in names])
    count = append_removed(journal, count, names[:5])  # slots RING-2 .. 2: round the end of the ring
    assert count == RING + 3
    memory.refresh()
    assert list(memory.keys) == ["k5"]


def test_the_ring_going_round_while_it_is_read_forgets_everything(
    journal: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = remembering(journal, "a", "b")
    count = append_removed(journal, 0, ["b"])
    real = PresenceMemory._read

    def overtaken(self: PresenceMemory, start: int, end: int) -> list[int]:
        got = real(self, start, end)
        append_removed(journal, count, [f"y{i}" for i in range(RING)])  # a writer laps the reader
        return got

    monkeypatch.setattr(PresenceMemory, "_read", overtaken)
    memory.refresh()
    assert not memory.keys


def test_a_reader_overtaken_by_a_writer_yet_to_publish_its_count_forgets_everything(
    journal: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer writes its entries, then its count. A reader 4000 entries behind that reads the
    ring between the two reads slots the writer just overwrote (the victim's removal, entry 0,
    among them) while the count still says nothing went round. The writer publishes where it will
    end before its entries, so the reader sees it was overtaken and forgets everything (before, it
    kept remembering the removed victim as present)."""
    memory = remembering(journal, "victim")
    count = append_removed(journal, 0, ["victim", *(f"other-{i}" for i in range(3999))])
    refreshed: list[int] = []

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if offset == presence._COUNT_AT:  # the count: this writer's entries are in the ring already
            memory.refresh()
            refreshed.append(offset)
        return os.pwrite(fd, data, offset)

    monkeypatch.setattr(presence, "os", types.SimpleNamespace(pwrite=pwrite, pread=os.pread))
    late = [f"late-{i}" for i in range(200)]  # slots 4000 .. 4095, then 0 .. 103
    assert append_removed(journal, count, late) == count + 200
    monkeypatch.setattr(presence, "os", os)
    assert refreshed and name_hash("victim") not in {name_hash(n) for n in late}
    assert "victim" not in memory.keys


def test_names_with_one_hash_are_remembered_once(journal: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two names, one hash: only the first is remembered, so the entry of either forgets it."""
    monkeypatch.setattr(presence, "name_hash", lambda name: 7)
    memory = remembering(journal, "a", "b")
    assert list(memory.keys) == ["a"]
    append_removed(journal, 0, ["b"])  # "b" removed, hash 7: "a" may be the one that went
    memory.refresh()
    assert not memory.keys


def test_a_full_memory_starts_afresh(journal: int) -> None:
    memory = remembering(journal, "a", "b", limit=3)
    memory.add([("c", "c")])
    assert list(memory.keys) == ["a", "b", "c"]
    memory.add([("d", "d")])
    assert list(memory.keys) == ["d"]
    memory.add([(f"e{i}", f"e{i}") for i in range(5)])  # more than fit: the first ones
    assert list(memory.keys) == ["e0", "e1", "e2"]


def test_the_journal_records_file_names(journal: int) -> None:
    """A key whose file name is escaped is forgotten by its file name's entry."""
    key = "a/b"
    name = object_file_name(key)
    assert name != key
    memory = PresenceMemory(journal)
    memory.refresh()
    memory.add([(key, name)])
    assert memory.keys[key] == name_hash(name)
    append_removed(journal, 0, [name])
    memory.refresh()
    assert key not in memory.keys


async def test_a_store_made_before_the_journal_gets_one(tmp_path: Path) -> None:
    """A lock file of 16 bytes (the usage counter alone) is extended; its count starts at 0."""
    store = open_store(tmp_path)
    await store.aclose()
    os.truncate(tmp_path / "kvflow.lock", 16)
    store = open_store(tmp_path)
    assert os.path.getsize(tmp_path / "kvflow.lock") == presence.JOURNAL_END
    fd = os.open(tmp_path / "kvflow.lock", os.O_RDONLY)
    try:
        assert read_journal_count(fd) == 0
        await store.put([obj("a")])
        assert await store.exists(["a"]) == [True]
        assert await store.remove(["a"]) == [True]
        assert read_journal_count(fd) == 1
        assert await store.exists(["a"]) == [False]
        assert await store.put([obj("b")]) == [PutStatus.STORED]  # a section that removes nothing
        assert read_journal_count(fd) == 1
    finally:
        os.close(fd)
        await store.aclose()


async def test_a_removal_of_another_object_forgets_only_that_one(tmp_path: Path, stats: list[str]) -> None:
    store, other = open_store(tmp_path), open_store(tmp_path)
    await store.put([obj("a"), obj("b")])
    await other.put([obj("elsewhere")])
    assert await store.exists(["a", "b"]) == [True, True]
    assert await other.remove(["elsewhere"]) == [True]  # a name this instance never saw
    assert await other.remove(["b"]) == [True]
    stats.clear()
    assert await store.exists(["a", "b"]) == [True, False]
    assert stats == ["b"]
    await store.aclose()
    await other.aclose()


def test_a_reader_exactly_one_ring_behind_keeps_what_was_not_removed(journal: int) -> None:
    memory = remembering(journal, "a")
    append_removed(journal, 0, [f"x{i}" for i in range(RING)])
    memory.refresh()
    assert list(memory.keys) == ["a"]


def test_a_count_that_went_back_forgets_everything(journal: int) -> None:
    """The journal's count never decreases; if it reads lower (the file was rewritten), nothing
    remembered can be trusted."""
    append_removed(journal, 0, ["x", "y", "z"])
    memory = remembering(journal, "a")
    os.pwrite(journal, (1).to_bytes(8, "little"), 16)
    memory.refresh()
    assert not memory.keys


def test_entries_past_the_count_are_not_read(journal: int) -> None:
    """Slots past the count hold the previous lap's entries (or nothing): never applied."""
    count = append_removed(journal, 0, ["p", "q"])
    memory = remembering(journal, "a")
    os.pwrite(journal, name_hash("a").to_bytes(8, "little"), 64 + 8 * 10)  # an old entry, slot 10
    assert append_removed(journal, count, [f"z{i}" for i in range(8)]) == 10  # slots 2..9
    memory.refresh()
    assert list(memory.keys) == ["a"]


def test_a_journal_shorter_than_its_count_forgets_everything(journal: int) -> None:
    memory = remembering(journal, "a")
    os.pwrite(journal, (5).to_bytes(8, "little"), 16)
    os.ftruncate(journal, 64 + 8 * 2 + 3)  # two whole entries and three bytes of a third
    memory.refresh()
    assert not memory.keys


def test_a_lock_file_too_short_for_a_count_reads_zero(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"K" * 20)  # the counter and half a journal count
        assert read_journal_count(fd) == 0
    finally:
        os.close(fd)


async def test_a_lock_file_that_cannot_be_read_is_an_error_that_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path)

    def broken(fd: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(presence, "read_journal_count", broken)
    with pytest.raises(BackendError, match=r"cannot read .*kvflow\.lock: Input/output error"):
        await store.exists(["a"])
    await store.aclose()
