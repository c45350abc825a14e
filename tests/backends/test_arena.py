"""The arena backend: one pre-allocated shared region of fixed-size slots (``arena://``).

Stores live in private temp directories under /dev/shm (tmpfs, as in production), removed after
each test. Several OS processes share a store through :mod:`tests.backends.store_worker`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvflow.backends.arena.backend as arena
import kvflow.backends.arena.lock as lock
import kvflow.backends.arena.store as store
import kvflow.backends.local.format as local_format
from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends import lockfiles, open_backend, pacing
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.backends.arena.lock import StoreLock
from kvflow.backends.arena.store import WAYS, ArenaFile, KeyHashes, key_hashes
from kvflow.backends.base import GetStatus, ObjectBatch, ObjectRef, PutStatus
from kvflow.errors import BackendError, BackendUnavailableError, ConfigError, PoolClosedError
from kvflow.regions import buffer_address
from tests.backends.store_worker import Workers, content, read_all, regions
from tests.helpers import bounded_shm, open_fds

KiB = 1 << 10
SLOT = 16 * KiB


@pytest.fixture
def store_dir() -> Iterator[Path]:
    with bounded_shm() as path:
        yield path / "store"


def open_arena(path: Path, slots: int = 16, slot: int = SLOT, **kwargs: object) -> ArenaBackend:
    return ArenaBackend(ArenaConfig(str(path), capacity_bytes=slots * slot, slot_bytes=slot, **kwargs))  # type: ignore[arg-type]


def obj(key: str, buf: bytearray | torch.Tensor) -> ObjectRef:
    """An object over ``buf``, in three regions listed out of memory order."""
    if isinstance(buf, torch.Tensor):
        return ObjectRef.of(key, *regions(buf.data_ptr(), buf.numel()))
    return ObjectRef.of(key, *regions(buffer_address(buf), len(buf)))


def filled(key: str, size: int = SLOT) -> bytearray:
    return bytearray(content(key, 0, size))


async def put_all(backend: ArenaBackend, keys: list[str], size: int = SLOT) -> list[PutStatus]:
    sources = [filled(k, size) for k in keys]  # alive until the put returns
    return await backend.put([obj(k, source) for k, source in zip(keys, sources)])


async def get_one(backend: ArenaBackend, key: str, size: int = SLOT) -> tuple[GetStatus, bytes]:
    out = bytearray(size)
    status = (await backend.get([obj(key, out)]))[0]
    return status, bytes(out)


async def test_round_trip_of_scattered_regions_and_a_miss(store_dir: Path) -> None:
    backend = open_arena(store_dir)
    keys = [f"k{i}" for i in range(5)]
    assert await put_all(backend, keys, 5000) == [PutStatus.STORED] * 5
    for key in keys:
        assert await get_one(backend, key, 5000) == (GetStatus.HIT, bytes(filled(key, 5000)))
    assert (await get_one(backend, "absent", 5000))[0] is GetStatus.MISS
    found = await backend.exists(["k3", "absent", "k0"])
    assert found == [True, False, True] and {type(f) for f in found} == {bool}
    stats = backend.stats()
    assert (stats.puts, stats.put_bytes, stats.hits, stats.misses) == (5, 25000, 5, 1)
    assert (stats.used_bytes, stats.capacity_bytes) == (25000, 16 * SLOT)
    await backend.aclose()


async def test_a_batch_whose_keys_are_an_array_is_stored_as_a_list_of_them_would_be(store_dir: Path) -> None:
    backend = open_arena(store_dir)
    data, out = bytearray(content("array", 0, 300)), bytearray(100)
    for names in (["a", "b", "c"], [""]):  # (an array of one empty key reads as false)
        keys = np.array(names, dtype=object)
        addrs = (buffer_address(data) + 100 * np.arange(len(names), dtype=np.int64))[:, None]
        assert await backend.put(ObjectBatch(keys, addrs, [100], 100)) == [PutStatus.STORED] * len(names)
    for key, at in [("a", 0), ("b", 100), ("c", 200), ("", 0)]:
        assert await backend.get([ObjectRef.of(key, [buffer_address(out)], [100])]) == [GetStatus.HIT]
        assert out == data[at : at + 100]
    await backend.aclose()


async def test_every_run_of_a_get_lands_on_its_own_objects_around_misses(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get copies a run of objects per call (here three); in the runs after the first, the hits
    beside a miss or a size mismatch still get their own bytes, and the others stay untouched."""
    monkeypatch.setattr(pacing, "RUN_OBJECTS", 3)
    backend = open_arena(store_dir)
    keys = [f"k{i}" for i in range(10)]
    assert await put_all(backend, [k for k in keys if k != "k7"]) == [PutStatus.STORED] * 9
    outs = [bytearray(SLOT - 1 if k == "k4" else SLOT) for k in keys]
    expected = [GetStatus.HIT] * 10
    expected[4], expected[7] = GetStatus.FAILED, GetStatus.MISS
    assert await backend.get([obj(k, out) for k, out in zip(keys, outs)]) == expected
    for key, out, status in zip(keys, outs, expected):
        assert out == (filled(key) if status is GetStatus.HIT else bytearray(len(out))), key
    await backend.aclose()


async def test_put_never_overwrites_and_a_size_mismatch_fails(store_dir: Path) -> None:
    backend = open_arena(store_dir)
    assert await put_all(backend, ["k"]) == [PutStatus.STORED]
    other = bytearray(b"x" * SLOT)
    assert await backend.put([obj("k", other), obj("k2", other), obj("k2", other), obj("k3", other)]) == [
        PutStatus.PRESENT,
        PutStatus.STORED,
        PutStatus.PRESENT,  # the same key twice in one batch: stored once, and the batch goes on
        PutStatus.STORED,
    ]
    assert await get_one(backend, "k") == (GetStatus.HIT, bytes(filled("k")))
    small = bytearray(100)
    assert await backend.get([obj("k", small)]) == [GetStatus.FAILED]
    assert small == bytearray(100)
    await backend.aclose()


async def test_an_object_larger_than_a_slot_fails_and_says_what_to_do(
    store_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = open_arena(store_dir)
    big, fits = filled("big", SLOT + 1), filled("fits")
    with caplog.at_level(logging.ERROR):
        results = await backend.put([obj("big", big), obj("fits", fits), obj("big2", big)])
        assert await backend.put([obj("big3", big)]) == [PutStatus.FAILED]
    assert results == [PutStatus.FAILED, PutStatus.STORED, PutStatus.FAILED]
    assert [r.getMessage() for r in caplog.records if "slot=" in r.getMessage()] != []
    assert len(caplog.records) == 1  # once per instance
    assert backend.capabilities.max_object_bytes == SLOT
    assert await backend.exists(["big", "fits"]) == [False, True]
    await backend.aclose()


async def test_a_pool_whose_objects_do_not_fit_a_slot_is_refused(store_dir: Path) -> None:
    caches = {"l0": torch.zeros(4, 1, 16, 512)}  # one block: 16 x 512 x 4 bytes = 32 KiB
    backend = open_arena(store_dir)
    with pytest.raises(ConfigError, match=r"32768 bytes.*at most 16384.*slot=32KiB"):
        KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(caches), backend=backend)
    await backend.aclose()
    roomy = open_arena(store_dir.with_name("roomy"), slot=32 * KiB)
    pool = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(caches), backend=roomy)
    caches["l0"].normal_()
    request = KVRequest(block_ids=[0, 1], tokens=range(32))
    assert (await pool.store(request)).stored == 2
    saved = caches["l0"][:2].clone()
    caches["l0"].zero_()
    assert (await pool.retrieve(request)).hit_blocks == 2
    assert torch.equal(caches["l0"][:2], saved)
    await pool.aclose()
    await roomy.aclose()


@pytest.mark.parametrize("claimed", [4 * SLOT, 2**64 - 1], ids=["four slots", "all ones"])
async def test_a_table_row_claiming_more_than_a_slot_is_never_read_past_its_slot(
    store_dir: Path, claimed: int
) -> None:
    """A row whose size says more than a slot (a damaged table, or one a hostile member of the
    store's group wrote) matched a get asking for that size, which copied past the slot: the next
    slots' bytes, or past the mapping. It is a FAILED get now, and nothing is written; also for a
    size whose 64 bits, read as a signed number, are the -1 a get larger than a slot asks for."""
    backend = open_arena(store_dir)
    try:
        assert await put_all(backend, ["k"]) == [PutStatus.STORED]
        arena_file = backend._arena
        query = arena_file.query(backend._hashes(["k"]), [SLOT])
        arena_file.locate(query, 0, 1, time.monotonic_ns())
        row = int(query.rows[0])
        arena_file._columns[6][row] = claimed  # (_NBYTES) the row now claims more than its slot
        del query  # (no view of the map may outlive the close)
        out = bytearray(b"\x55" * (4 * SLOT))
        assert await backend.get([obj("k", out)]) == [GetStatus.FAILED]
        assert out == bytearray(b"\x55" * (4 * SLOT))
    finally:
        await backend.aclose()


async def test_eviction_takes_the_least_recently_used_slot(store_dir: Path) -> None:
    backend = open_arena(store_dir, slots=4)  # one set of four
    assert await put_all(backend, ["a", "b", "c", "d"]) == [PutStatus.STORED] * 4
    assert (await get_one(backend, "a"))[0] is GetStatus.HIT  # a is now newer than b
    assert await put_all(backend, ["b"]) == [PutStatus.PRESENT]  # a put of a present key is a use too
    assert await put_all(backend, ["e", "f"]) == [PutStatus.STORED] * 2
    assert await backend.exists(["a", "b", "c", "d", "e", "f"]) == [True, True, False, False, True, True]
    assert backend.stats().evictions == 2
    for key in ("a", "b", "e", "f"):
        assert await get_one(backend, key) == (GetStatus.HIT, bytes(filled(key)))
    await backend.aclose()


@pytest.mark.parametrize("call", ["get", "put"])
async def test_a_call_that_waited_for_the_lock_stamps_its_use_once_it_holds_it(
    store_dir: Path, call: str
) -> None:
    """A get or a put marks its objects used when it holds the store's lock, not when it began to
    wait for it: another process's section meanwhile (here, held by another open of the lock file)
    uses objects later, and the waiting call's must not look older than those for LRU."""
    backend = open_arena(store_dir)
    assert await put_all(backend, ["a"]) == [PutStatus.STORED]
    fd = os.open(store_dir / "kvflow.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released: list[int] = []

    def release_later() -> None:
        time.sleep(0.3)
        released.append(time.monotonic_ns())
        fcntl.flock(fd, fcntl.LOCK_UN)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, release_later)
            if call == "get":
                assert (await get_one(backend, "a"))[0] is GetStatus.HIT
            else:
                assert await put_all(backend, ["b"]) == [PutStatus.STORED]
        table = backend._arena
        (row,) = table.find(backend._hashes(["a" if call == "get" else "b"]))
        assert int(table._columns[store._USED][row]) >= released[0]
    finally:
        os.close(fd)
        await backend.aclose()


async def test_wide_sets_keep_the_newest_objects_like_one_lru_list(store_dir: Path) -> None:
    """A prefix lookup stops at the first miss: the newest request's blocks must all stay."""
    backend = open_arena(store_dir, slots=4 * WAYS, slot=4 * KiB)
    for request in range(6):  # each request fills half the store
        keys = [f"r{request}-{i}" for i in range(2 * WAYS)]
        assert await put_all(backend, keys, 4 * KiB) == [PutStatus.STORED] * len(keys)
        assert all(await backend.exists(keys))
    await backend.aclose()


def leading_run(found: list[bool]) -> int:
    """How many blocks a prefix lookup finds: it stops at the first miss."""
    return found.index(False) if False in found else len(found)


async def test_a_full_set_evicts_a_requests_last_blocks_first(store_dir: Path) -> None:
    """Every block of a put was used at the same time, and ties went to the higher way: a full set
    evicted a request's first blocks, and the blocks it kept never hit (a prefix lookup stops at
    the first miss). The i-th block is used at ``now - i``, as in the local backend."""
    backend = open_arena(store_dir, slots=12, slot=4 * KiB)  # one set of 12
    first = [f"r1-{i}" for i in range(10)]
    assert await put_all(backend, first, 4 * KiB) == [PutStatus.STORED] * 10
    assert await put_all(backend, [f"r2-{i}" for i in range(5)], 4 * KiB) == [PutStatus.STORED] * 5
    assert await backend.exists(first) == [True] * 7 + [False] * 3
    assert leading_run(await backend.exists(first)) == 7
    await backend.aclose()


async def test_a_get_uses_a_requests_first_blocks_last(store_dir: Path) -> None:
    """The same for the uses a get records: the blocks of a request just read are newer than any
    block of an earlier put, its first blocks newest."""
    backend = open_arena(store_dir, slots=12, slot=4 * KiB)  # one set of 12
    first = [f"r1-{i}" for i in range(10)]
    assert await put_all(backend, first, 4 * KiB) == [PutStatus.STORED] * 10
    assert await put_all(backend, ["x0", "x1"], 4 * KiB) == [PutStatus.STORED] * 2  # the set is full
    outs = [bytearray(4 * KiB) for _ in first]
    assert await backend.get([obj(k, out) for k, out in zip(first, outs)]) == [GetStatus.HIT] * 10
    assert await put_all(backend, ["r2-0", "r2-1", "r2-2"], 4 * KiB) == [PutStatus.STORED] * 3
    assert await backend.exists(["x0", "x1"]) == [False, False]
    assert leading_run(await backend.exists(first)) == 9
    await backend.aclose()


async def test_every_slot_being_written_is_no_space(store_dir: Path) -> None:
    writer, other = open_arena(store_dir, slots=4), open_arena(store_dir, slots=4)
    async with writer._arena.lock.held(arena.EXCLUSIVE, 1):
        claims = writer._arena.claim(key_hashes(["w0", "w1", "w2", "w3"]), time.monotonic_ns())
    assert (claims >= 0).all()
    # a live writer is writing w2; every answer lets the batch go on
    assert await put_all(other, ["x", "w2"]) == [PutStatus.NO_SPACE, PutStatus.PRESENT]
    assert await put_all(other, ["w2", "x"]) == [PutStatus.PRESENT, PutStatus.NO_SPACE]
    assert await other.exists(["w2"]) == [False]  # not readable until published
    await writer.aclose()
    await other.aclose()


async def test_a_key_put_twice_whose_first_copy_finds_no_slot_is_not_reported_present(
    store_dir: Path,
) -> None:
    """A put of more keys than the store has slots, each key named twice (requests sharing a
    prefix): the second copy of a key shares the first's outcome, so it reads PRESENT only where
    the first is in the store, NO_SPACE where the first found no slot."""
    backend = open_arena(store_dir, slots=16)
    keys = [f"k{i}" for i in range(40)]
    results = await put_all(backend, keys + keys)
    first, second = results[: len(keys)], results[len(keys) :]
    assert first.count(PutStatus.STORED) == 16 and first.count(PutStatus.NO_SPACE) == 24
    assert second == [status.repeated() for status in first]
    assert await backend.exists(keys) == [status is PutStatus.STORED for status in first]
    await backend.aclose()


async def test_a_repeat_after_a_first_copy_too_large_for_a_slot_follows_the_copy_that_fits(
    store_dir: Path,
) -> None:
    backend = open_arena(store_dir)
    sources = [filled("k", size) for size in (SLOT + 1, SLOT, 10)]
    results = await backend.put([obj("k", source) for source in sources])
    assert results == [PutStatus.FAILED, PutStatus.STORED, PutStatus.PRESENT]
    assert await get_one(backend, "k") == (GetStatus.HIT, bytes(sources[1]))
    await backend.aclose()


async def test_a_key_put_twice_whose_first_copy_fails_is_not_reported_present(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish of a put gives up (the lock stays taken past its timeout): the claimed copies
    fail, and so do their repeats."""
    backend, holder = open_arena(store_dir, lock_timeout_s=0.2), open_arena(store_dir)

    def mid_write(row: int) -> None:
        monkeypatch.setattr(arena, "_mid_write_hook", None)
        fcntl.flock(holder._arena.lock.fd, fcntl.LOCK_EX)

    monkeypatch.setattr(arena, "_mid_write_hook", mid_write)
    try:
        results = await put_all(backend, ["a", "b", "a"])
    finally:
        fcntl.flock(holder._arena.lock.fd, fcntl.LOCK_UN)
    assert results == [PutStatus.FAILED] * 3
    assert await backend.exists(["a", "b"]) == [False, False]
    await backend.aclose()
    await holder.aclose()


async def fill_in_order(backend: ArenaBackend, keys: list[str]) -> None:
    """Each key in its own put, so that each is used later than the one before."""
    for key in keys:
        assert await put_all(backend, [key]) == [PutStatus.STORED]


async def test_a_batch_never_evicts_a_key_it_finds_present(store_dir: Path) -> None:
    backend = open_arena(store_dir, slots=4)
    await fill_in_order(backend, ["a", "b", "c", "d"])  # a is the least recently used
    assert await put_all(backend, ["x", "a"]) == [PutStatus.STORED, PutStatus.PRESENT]
    assert await backend.exists(["a", "b", "c", "d", "x"]) == [True, False, True, True, True]
    assert await get_one(backend, "a") == (GetStatus.HIT, bytes(filled("a")))
    await backend.aclose()


async def test_every_slot_answers_for_its_key_and_a_freed_one_takes_it_again(store_dir: Path) -> None:
    backend = open_arena(store_dir, slots=4)
    keys = ["a", "b", "c", "d"]
    await fill_in_order(backend, keys)  # every slot, the first one included
    assert await put_all(backend, keys) == [PutStatus.PRESENT] * 4
    assert await backend.remove(["d"]) == [True]
    assert await put_all(backend, ["d"]) == [PutStatus.STORED]  # into its old slot: nothing evicted
    assert backend.stats().evictions == 0
    for key in keys:
        assert await get_one(backend, key) == (GetStatus.HIT, bytes(filled(key)))
    assert await backend.remove(keys) == [True] * 4
    await backend.aclose()


async def test_remove(store_dir: Path) -> None:
    backend = open_arena(store_dir)
    await put_all(backend, ["a", "b"])
    assert await backend.remove(["a", "zz", "a"]) == [True, False, False]
    assert await backend.exists(["a", "b"]) == [False, True]
    assert (await get_one(backend, "a"))[0] is GetStatus.MISS
    assert backend.stats().used_bytes == SLOT
    await backend.aclose()


async def test_a_store_is_shared_by_instances_and_outlives_them(store_dir: Path) -> None:
    first = open_backend(f"arena://{store_dir}?capacity={16 * SLOT}&slot={SLOT}")
    assert isinstance(first, ArenaBackend)
    await put_all(first, ["kept"])
    await first.aclose()
    second = open_arena(store_dir)
    assert await get_one(second, "kept") == (GetStatus.HIT, bytes(filled("kept")))
    await second.aclose()


def test_every_process_must_cut_the_store_alike(store_dir: Path) -> None:
    made = open_arena(store_dir)
    with pytest.raises(ConfigError, match=r"holds 16 slots of 16384 bytes.*asks for 8 slots of 32768"):
        open_arena(store_dir, slots=8, slot=32 * KiB)
    anyio.run(made.aclose)


def test_a_store_made_now_refuses_a_capacity_whose_earlier_cut_would_match_it(store_dir: Path) -> None:
    """docs/arena-backend.md: a store opened with another capacity is a ConfigError. A store of 128
    slots (2 sets of 64) opened with a URL asking 191 slots (2 sets of 95) is refused, though an
    earlier kvflow cut 191 slots into 2 sets of 64 too: the store records the rule that cut it, so
    only a store with no record (an earlier kvflow's) is taken as the earlier cut of a URL (before,
    the second URL silently got the smaller store)."""
    made = open_arena(store_dir, slots=128)
    try:
        with pytest.raises(ConfigError, match=r"holds 128 slots .*asks for 190 slots .*same capacity"):
            open_arena(store_dir, slots=191)
    finally:
        anyio.run(made.aclose)


def test_a_file_that_is_not_an_arena_is_refused(store_dir: Path) -> None:
    store_dir.mkdir(mode=0o700)
    (store_dir / "arena").write_bytes(b"not an arena" * 100)
    os.chmod(store_dir / "arena", 0o600)
    with pytest.raises(ConfigError, match="is not a kvflow arena"):
        open_arena(store_dir)


def test_a_creator_that_died_leaves_nothing_in_the_way(store_dir: Path) -> None:
    store_dir.mkdir(mode=0o700)
    (store_dir / "arena.new").write_bytes(b"half made" * 100_000)  # larger than the arena to make
    backend = open_arena(store_dir)
    assert sorted(p.name for p in store_dir.iterdir()) == ["arena", "kvflow.lock"]
    anyio.run(backend.aclose)


def test_a_truncated_arena_is_refused(store_dir: Path) -> None:
    anyio.run(open_arena(store_dir).aclose)
    arena_file = store_dir / "arena"
    os.truncate(arena_file, arena_file.stat().st_size // 2)  # its header is whole
    with pytest.raises(ConfigError, match="holds 16 slots of 16384 bytes"):
        open_arena(store_dir)


def test_a_store_larger_than_its_filesystem_is_a_config_error(store_dir: Path) -> None:
    total = shutil.disk_usage(store_dir.parent).total  # beyond the size of the tmpfs: refused at once
    with pytest.raises(ConfigError, match="no room"):
        open_arena(store_dir, slots=total // SLOT + 1024)
    assert not store_dir.exists()  # refused before anything was made: nothing left behind
    dangling = store_dir.with_name("dangling")
    dangling.symlink_to(store_dir.with_name("nowhere"))
    with pytest.raises(ConfigError, match="cannot use"):  # (a path it cannot make, said as one)
        open_arena(dangling / "store", slots=total // SLOT + 1024)
    store_dir.mkdir(mode=0o700)  # and where the directory is there already, before the arena is made
    with pytest.raises(ConfigError, match="no room"):
        open_arena(store_dir, slots=total // SLOT + 1024)
    assert list(store_dir.iterdir()) == [store_dir / "kvflow.lock"]


def test_the_store_is_private_and_never_opened_through_a_symlink(store_dir: Path) -> None:
    backend = open_arena(store_dir)
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((store_dir / "arena").stat().st_mode) == 0o600
    anyio.run(backend.aclose)
    elsewhere = store_dir.with_name("elsewhere")
    elsewhere.mkdir(mode=0o700)
    (store_dir / "arena").rename(elsewhere / "arena")
    (store_dir / "arena").symlink_to(elsewhere / "arena")
    with pytest.raises(ConfigError, match="symbolic link"):
        open_arena(store_dir)


def test_a_store_shared_with_a_group_gets_the_groups_modes(store_dir: Path) -> None:
    group = str(os.getegid())  # a group this user is in
    backend = ArenaBackend.from_url(f"arena://{store_dir}?capacity=64KiB&slot=16KiB&group={group}")
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o2770
    assert stat.S_IMODE((store_dir / "arena").stat().st_mode) == 0o660
    assert (store_dir / "arena").stat().st_gid == os.getegid()
    anyio.run(backend.aclose)


def test_opening_and_closing_leaves_no_descriptor_open(store_dir: Path) -> None:
    anyio.run(open_arena(store_dir).aclose)  # made once
    before = open_fds()
    for _ in range(3):
        anyio.run(open_arena(store_dir).aclose)
    assert open_fds() == before


def arena_maps(store_dir: Path) -> int:
    """How many mappings of the store's files this process has."""
    with open("/proc/self/maps") as maps:
        return sum(str(store_dir) in line for line in maps)


def test_a_backend_that_fails_to_open_leaves_nothing_open(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the compiled functions failed after the arena was opened: its lock file and
    directory stayed open, the lock file registered for forked children."""
    anyio.run(open_arena(store_dir).aclose)  # made once
    before, registered = open_fds(), dict(lockfiles._OPEN)

    def broken() -> None:
        raise RuntimeError("compiling failed")

    monkeypatch.setattr(arena, "passes", broken)
    with pytest.raises(RuntimeError, match="compiling failed"):
        open_arena(store_dir)
    assert (open_fds(), lockfiles._OPEN, arena_maps(store_dir)) == (before, registered, 0)


def test_an_arena_that_cannot_be_mapped_names_the_address_space_limit(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mmap's ENOMEM (the address space limit, ``ulimit -v``) said "the local backend cannot use
    ...; give a directory this process can create and write, e.g. local://"."""
    anyio.run(open_arena(store_dir).aclose)  # made once
    before, registered = open_fds(), dict(lockfiles._OPEN)

    def no_address_space(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", no_address_space)
    with pytest.raises(ConfigError) as raised:
        open_arena(store_dir)
    said = str(raised.value)
    assert said.startswith(f"the arena backend cannot use {store_dir}"), said
    assert "ulimit -v" in said and "smaller capacity" in said and "local" not in said, said
    assert (open_fds(), lockfiles._OPEN) == (before, registered)


def test_a_store_path_that_cannot_be_made_is_reported_for_the_arena_backend(store_dir: Path) -> None:
    """An arena:// URL was told of "the local backend" and given local:// as an example."""
    store_dir.parent.joinpath("file").write_bytes(b"")
    path = store_dir.parent / "file" / "store"  # its parent is a file: ENOTDIR, even for root
    with pytest.raises(ConfigError) as raised:
        ArenaBackend.from_url(f"arena://{path}?capacity=64KiB&slot=16KiB")
    said = str(raised.value)
    assert said.startswith(f"the arena backend cannot use {path}: {os.strerror(errno.ENOTDIR)}"), said
    assert "e.g. arena://" in said and "local" not in said, said


def test_urls() -> None:
    config = ArenaConfig.from_url("arena:///dev/shm/x?capacity=1GiB&slot=256KiB&lock_timeout=2")
    assert config == ArenaConfig("/dev/shm/x", 1 << 30, 256 * KiB, 2.0)
    assert ArenaConfig.from_url("arena://").path == f"/dev/shm/kvflow-arena-{os.geteuid()}"
    assert ArenaConfig("/dev/shm/x", 1 << 30, 64 << 20).slot_bytes == 64 << 20  # the largest slot
    with pytest.raises(ConfigError, match="multiple of 4KiB"):
        ArenaConfig("/dev/shm/x", 1 << 30, "1MiB")  # type: ignore[arg-type]
    for url, problem in [
        ("arena:///dev/shm/x?slot=1000", "multiple of 4KiB"),
        ("arena:///dev/shm/x?slot=128MiB", "multiple of 4KiB from 4KiB to 64MiB"),
        ("arena:///dev/shm/x?capacity=4KiB&slot=8KiB", "at least one slot"),
        ("arena:///dev/shm/x?size=1", "size"),
        ("arena://host/x", "names a host"),
        ("arena:relative", "relative path"),
        ("arena://?group=kv", "names no directory"),
    ]:
        with pytest.raises(ConfigError, match=problem):
            ArenaConfig.from_url(url)


# --- across tasks and processes -----------------------------------------------------------------


@pytest.fixture
def checkpoint_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call lets the other tasks run after each object (a run of copies is one object)."""
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)
    monkeypatch.setattr(pacing, "RUN_BYTES", 1)


async def test_a_get_never_reads_a_slot_that_a_put_takes_meanwhile(
    store_dir: Path, checkpoint_often: None
) -> None:
    """Two instances in one process (two lock descriptors): gets and evicting puts interleave."""
    reader, writer = open_arena(store_dir, slots=8), open_arena(store_dir, slots=8)
    torn: list[str] = []

    async def read() -> None:
        for round_ in range(30):
            keys = [f"k{(round_ + i) % 24}" for i in range(8)]
            outs = [bytearray(SLOT) for _ in keys]
            for key, out, status in zip(
                keys, outs, await reader.get([obj(k, o) for k, o in zip(keys, outs)])
            ):
                if status is GetStatus.HIT and out != filled(key):
                    torn.append(key)

    async def write() -> None:
        for round_ in range(30):
            await put_all(writer, [f"k{(round_ * 3 + i) % 24}" for i in range(4)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        tg.start_soon(write)
    assert torn == []
    assert reader.stats().hits > 0 and writer.stats().evictions > 0
    await reader.aclose()
    await writer.aclose()


async def test_a_get_holds_the_lock_across_its_runs_unless_a_put_waits_for_it(
    store_dir: Path, checkpoint_often: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone on the loop a get holds the store's lock across its runs (each run one object here,
    past YIELD_EVERY_S at once); while a put of another process waits for the lock (its mark in
    the store) it lets go after every run, as it does for a task waiting beside it."""
    monkeypatch.setattr(pacing, "HOLD_ALONE_S", 60.0)
    monkeypatch.setattr(lock, "MARK_FRESH_NS", 60 * 10**9)  # (fresh however slow the machine)
    reader, other = open_arena(store_dir), open_arena(store_dir)
    keys = [f"k{i}" for i in range(8)]
    assert await put_all(reader, keys) == [PutStatus.STORED] * len(keys)
    holds, take = 0, StoreLock._try

    def counted(self: StoreLock, mode: int) -> bool:
        nonlocal holds
        taken = take(self, mode)
        holds += taken
        return taken

    monkeypatch.setattr(StoreLock, "_try", counted)

    async def holds_of_a_get() -> int:
        nonlocal holds
        holds, outs = 0, [bytearray(SLOT) for _ in keys]
        assert await reader.get([obj(k, out) for k, out in zip(keys, outs)]) == [GetStatus.HIT] * len(keys)
        assert outs == [filled(k) for k in keys]
        return holds

    assert await holds_of_a_get() == 1
    assert other._arena.lock.waits is not None
    stamp = other._arena.lock.waits.mark()  # in the store both map, as a waiting put in another process
    assert await holds_of_a_get() == len(keys)
    other._arena.lock.waits.clear(stamp)
    assert await holds_of_a_get() == 1
    await reader.aclose()
    await other.aclose()


async def test_a_get_looks_for_one_run_of_its_objects_at_a_time(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However large the batch, each look in the table (under the lock) covers one run: a look
    at all the rest at once took 8-11 ms for 65,536 objects, a hold far past the half millisecond
    a put waiting in another process may wait (a review's find)."""
    count, size = 4 * pacing.RUN_OBJECTS, 4 * KiB
    backend = open_arena(store_dir, slots=2 * count, slot=size)
    keys = [f"k{i}" for i in range(count)]
    assert await put_all(backend, keys, size) == [PutStatus.STORED] * count
    spans: list[int] = []
    locate = ArenaFile.locate

    def watched(self: ArenaFile, query: Any, start: int, end: int, now: int) -> None:
        spans.append(end - start)
        locate(self, query, start, end, now)

    monkeypatch.setattr(ArenaFile, "locate", watched)
    outs = [bytearray(size) for _ in keys]
    assert await backend.get([obj(k, out) for k, out in zip(keys, outs)]) == [GetStatus.HIT] * count
    assert outs == [filled(k, size) for k in keys]
    assert sum(spans) == count and max(spans) <= pacing.RUN_OBJECTS, spans
    await backend.aclose()


async def test_a_put_waiting_for_the_lock_in_another_process_marks_the_store_until_it_holds_it(
    store_dir: Path,
) -> None:
    """A worker process's put finds the lock held shared (as by a get here): it marks the store
    while it waits, and the mark is gone once the put took the lock."""
    reader = open_arena(store_dir)
    url = f"arena://{store_dir}?capacity={16 * SLOT}&slot={SLOT}"
    workers = Workers([{"url": url, "writer": 0, "keys": ["w0", "w1"], "size": SLOT, "batch": 2}])
    try:
        workers.ready()  # (a worker opens the store under the exclusive lock)
        assert not reader._arena.lock.writer_waiting()
        fcntl.flock(reader._arena.lock.fd, fcntl.LOCK_SH)
        try:
            workers.start()
            deadline = time.monotonic() + 30
            while not reader._arena.lock.writer_waiting():
                assert time.monotonic() < deadline, "the worker's put never marked the store"
                await anyio.sleep(0.001)
            assert workers.procs[0].poll() is None  # still waiting
        finally:
            fcntl.flock(reader._arena.lock.fd, fcntl.LOCK_UN)
        [report] = workers.reports()
    finally:
        workers.kill_all()
    assert report["put"] == {"stored": 2} and report["torn"] == []
    assert not reader._arena.lock.writer_waiting()
    assert await reader.exists(["w0", "w1"]) == [True, True]
    await reader.aclose()


async def test_a_waiters_mark_counts_only_while_fresh(store_dir: Path) -> None:
    """A store made anew has no mark; one left by a waiter killed (older than MARK_FRESH_NS) is
    not counted; a fresh one is, by every process's mapping."""
    backend, other = open_arena(store_dir), open_arena(store_dir)
    waits = backend._arena.lock.waits
    assert waits is not None and not other._arena.lock.writer_waiting()
    waits.word[0] = time.monotonic_ns() - lock.MARK_FRESH_NS - 1_000_000
    assert not other._arena.lock.writer_waiting()
    waits.mark()
    assert other._arena.lock.writer_waiting()
    await backend.aclose()
    assert other._arena.lock.writer_waiting()  # (in the store, not in the instance that wrote it)
    await other.aclose()


async def test_a_waiter_leaving_clears_only_its_own_mark(store_dir: Path) -> None:
    """Two processes wait for the exclusive lock; the one that marked first takes it (or gives
    up): the other's later mark stays, so gets go on letting go of the lock for it."""
    first, second = open_arena(store_dir), open_arena(store_dir)
    assert first._arena.lock.waits is not None and second._arena.lock.waits is not None
    early = first._arena.lock.waits.mark()
    while (late := second._arena.lock.waits.mark()) == early:  # (a coarse clock)
        await anyio.sleep(0)
    first._arena.lock.waits.clear(early)
    assert first._arena.lock.writer_waiting()
    second._arena.lock.waits.clear(late)
    assert not first._arena.lock.writer_waiting()
    await first.aclose()
    await second.aclose()


def test_opening_a_made_store_does_not_wait_for_other_processes_gets(store_dir: Path) -> None:
    """A process opening a store already made only reads its header: it takes the lock shared, so
    a get holding it in another process (held here on another descriptor) does not keep it out."""
    reader = open_arena(store_dir)
    fcntl.flock(reader._arena.lock.fd, fcntl.LOCK_SH)
    try:
        opened = open_arena(store_dir, lock_timeout_s=0.2)
    finally:
        fcntl.flock(reader._arena.lock.fd, fcntl.LOCK_UN)
    anyio.run(opened.aclose)
    anyio.run(reader.aclose)


async def test_a_cancelled_put_gives_its_slots_back(store_dir: Path, checkpoint_often: None) -> None:
    backend = open_arena(store_dir, slots=4)
    with anyio.CancelScope() as scope:

        async def cancel_soon() -> None:
            await anyio.lowlevel.checkpoint()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            await put_all(backend, ["a", "b", "c", "d"])
    assert scope.cancelled_caught
    assert await backend.exists(["a", "b", "c", "d"]) == [False] * 4
    assert await put_all(backend, ["e", "f", "g", "h"]) == [PutStatus.STORED] * 4
    assert backend.stats().evictions == 0  # the cancelled put's slots were free again
    await backend.aclose()


async def test_closing_waits_for_a_put_still_copying(store_dir: Path, checkpoint_often: None) -> None:
    backend = open_arena(store_dir)
    results: list[PutStatus] = []

    async def put() -> None:
        results.extend(await put_all(backend, [f"k{i}" for i in range(6)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(put)
        await anyio.lowlevel.checkpoint()
        assert results == []  # the put is between two copies
        await backend.aclose()  # returns once the put returned, the arena unmapped then
        assert results == [PutStatus.STORED] * 6
        assert backend._arena._map.closed
    out = bytearray(SLOT)
    with pytest.raises(PoolClosedError):
        await backend.get([obj("k0", out)])
    again = open_arena(store_dir)
    assert await again.exists([f"k{i}" for i in range(6)]) == [True] * 6
    await again.aclose()


async def test_processes_share_whole_objects_and_the_first_writer_wins(store_dir: Path) -> None:
    keys = [f"shared-{i}" for i in range(40)]
    size, writers = 12 * KiB + 3, 3
    url = f"arena://{store_dir}?capacity={64 * SLOT}&slot={SLOT}"
    open_arena(store_dir, slots=64)  # made once, before the workers race to open it
    specs = [
        {"url": url, "writer": w, "writers": writers, "keys": keys, "size": size, "rounds": 3, "batch": 8,
         "seed": w}
        for w in range(writers)
    ]  # fmt: skip
    reports = Workers.run_all(specs)
    assert [r["torn"] for r in reports] == [[]] * writers
    assert sum(r["put"].get("stored", 0) for r in reports) == len(keys)  # each key stored once
    seen: dict[str, set[int]] = {}
    for report in reports:
        for key, versions in report["seen"].items():
            seen.setdefault(key, set()).update(versions)
    assert all(len(v) == 1 for v in seen.values()), seen
    backend = open_arena(store_dir, slots=64)
    final = await read_all(backend, keys, size, writers)
    assert {k: {w} for k, w in final.items()} == seen and len(final) == len(keys)
    await backend.aclose()


async def test_processes_evicting_each_other_never_see_a_torn_object(store_dir: Path) -> None:
    """Writer 1 puts and gets batches by column (the arena's usual put), the others lists."""
    size, writers = SLOT, 3
    url = f"arena://{store_dir}?capacity={12 * SLOT}&slot={SLOT}"
    specs = [
        {"url": url, "writer": w, "writers": writers, "keys": [f"s{i}" for i in range(10)]
         + [f"w{w}-{i}" for i in range(30)], "size": size, "rounds": 3, "batch": 6, "by_column": w == 1}
        for w in range(writers)
    ]  # fmt: skip
    open_arena(store_dir, slots=12)
    reports = Workers.run_all(specs)
    assert [r["torn"] for r in reports] == [[]] * writers
    assert sum(r["evictions"] for r in reports) > 0
    assert sum(r["get"].get("hit", 0) for r in reports) > 0


@pytest.mark.parametrize(("proc", "by_column"), [("readable", False), ("hidden", False), ("readable", True)])
async def test_a_writer_killed_mid_put_leaves_no_object_and_its_slot_is_taken_back(
    store_dir: Path, proc: str, by_column: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hidden``: this process cannot read the writer's /proc entry (``/proc`` mounted with
    ``hidepid``, or no descriptor left to open it): the live writer's slots are still not taken.
    ``by_column``: its put is a batch by column, as the transfer layer sends (copied in runs by
    :func:`kvflow.backends.copies.copy_in_runs`)."""
    if proc == "hidden":
        real_open = open

        def hiding_open(path: object, *args: Any, **kwargs: Any) -> Any:
            if str(path).startswith("/proc/") and not str(path).startswith(
                ("/proc/self", f"/proc/{os.getpid()}")
            ):
                raise FileNotFoundError(2, "hidden", str(path))
            return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

        monkeypatch.setattr(local_format, "open", hiding_open, raising=False)
    url = f"arena://{store_dir}?capacity={4 * SLOT}&slot={SLOT}"
    spec = {
        "url": url,
        "writer": 1,
        "keys": ["dying", "dying-2"],
        "size": SLOT,
        "pause": True,
        "by_column": by_column,
    }
    workers = Workers([spec])
    try:
        proc = workers.procs[0]
        workers.go()
        workers.wait_for(proc, "PAUSED")  # it claimed two slots and copied into one
        backend = open_arena(store_dir, slots=4)
        assert await backend.exists(["dying", "dying-2"]) == [False, False]
        assert await put_all(backend, ["dying"]) == [PutStatus.PRESENT]  # its writer still lives
        assert await put_all(backend, ["a", "b", "c"]) == [
            PutStatus.STORED,
            PutStatus.STORED,
            PutStatus.NO_SPACE,
        ]
    finally:
        workers.kill_all()
    assert (await get_one(backend, "dying"))[0] is GetStatus.MISS
    assert await put_all(backend, ["dying", "c"]) == [PutStatus.STORED] * 2  # the dead writer's slots
    assert backend.stats().evictions == 0
    assert await get_one(backend, "dying") == (GetStatus.HIT, bytes(filled("dying")))
    await backend.aclose()


async def test_a_stuck_lock_holder_fails_calls_within_the_lock_timeout(store_dir: Path) -> None:
    stuck = open_arena(store_dir)
    backend = open_arena(store_dir, lock_timeout_s=0.05)
    await put_all(backend, ["k"])
    with stuck._arena.lock.held_blocking(arena.EXCLUSIVE, 1):  # another process, stopped in a section
        started = time.monotonic()
        assert await put_all(backend, ["new"]) == [PutStatus.FAILED]
        assert (await get_one(backend, "k"))[0] is GetStatus.FAILED
        with pytest.raises(BackendError, match="stopped or stuck kvflow process"):
            await backend.exists(["k"])
        with pytest.raises(BackendError):
            await backend.remove(["k"])
        assert time.monotonic() - started < 2
        assert not stuck._arena.lock.writer_waiting()  # the waits that gave up left no mark
    assert await backend.exists(["k", "new"]) == [True, False]
    stats = backend.stats()
    assert (stats.put_failures, stats.get_failures) == (1, 1)
    await backend.aclose()
    assert backend.stats() == stats  # still readable once closed
    await stuck.aclose()


async def test_a_lookup_that_timed_out_on_the_lock_leaves_nothing_held(store_dir: Path) -> None:
    """An ``exists`` and a ``remove`` that gave up waiting for the lock ended their calls: the
    lock is free for others, and a close then unmaps the arena and closes its files."""
    stuck = open_arena(store_dir)
    mapped = arena_maps(store_dir)
    backend = open_arena(store_dir, lock_timeout_s=0.05)
    await put_all(backend, ["k"])
    with stuck._arena.lock.held_blocking(arena.EXCLUSIVE, 1):
        for call in (backend.exists, backend.remove):
            with pytest.raises(BackendError, match="cannot answer"):
                await call(["k"])
    with stuck._arena.lock.held_blocking(arena.EXCLUSIVE, 0.2):  # neither left the lock taken
        pass
    before = open_fds()
    await backend.aclose()
    assert arena_maps(store_dir) == mapped
    assert open_fds() < before
    await stuck.aclose()


async def test_a_put_that_claims_nothing_publishes_nothing_and_leaves_the_lock_alone(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A put whose every key is stored claims no slot: it copies nothing and takes no second
    exclusive section. Before, it took the lock again to publish nothing, shutting out every
    reader, and when another process held the lock then it waited out ``lock_timeout`` and logged
    the put as failed, though it answered PRESENT (found by review)."""
    backend = open_arena(store_dir, lock_timeout_s=0.05)
    other = open_arena(store_dir)  # another process's lock: its own open file
    claim = ArenaBackend._claim

    async def claim_then_lock(self: ArenaBackend, *args: Any) -> None:
        await claim(self, *args)
        fcntl.flock(other._arena.lock.fd, fcntl.LOCK_EX)  # the other takes the lock right after

    try:
        assert await put_all(backend, ["a", "b"]) == [PutStatus.STORED] * 2
        monkeypatch.setattr(ArenaBackend, "_claim", claim_then_lock)
        with caplog.at_level(logging.ERROR):
            assert await put_all(backend, ["a", "b"]) == [PutStatus.PRESENT] * 2
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert backend.stats().put_failures == 0
    finally:
        fcntl.flock(other._arena.lock.fd, fcntl.LOCK_UN)
        await backend.aclose()
        await other.aclose()


async def test_a_put_whose_publish_times_out_logs_every_object_that_failed(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The log counts the failures the put answers: a repeat of a key whose publish timed out
    fails with it, a key already stored does not (found by review: it counted the claimed slots)."""
    backend = open_arena(store_dir, lock_timeout_s=0.05)
    other = open_arena(store_dir)  # another process's lock: its own open file
    try:
        assert await put_all(backend, ["stored"]) == [PutStatus.STORED]

        def stall(row: int) -> None:  # the other takes the lock while the put copies
            fcntl.flock(other._arena.lock.fd, fcntl.LOCK_EX)

        monkeypatch.setattr(arena, "_mid_write_hook", stall)
        with caplog.at_level(logging.ERROR):
            statuses = await put_all(backend, ["k", "k", "stored"])
        assert statuses == [PutStatus.FAILED, PutStatus.FAILED, PutStatus.PRESENT]
        assert "2 of a put's 3 objects failed" in caplog.text
    finally:
        fcntl.flock(other._arena.lock.fd, fcntl.LOCK_UN)
        await backend.aclose()
        await other.aclose()


async def test_closing_waits_for_a_lookup_that_waits_for_the_lock(store_dir: Path) -> None:
    stuck, backend = open_arena(store_dir), open_arena(store_dir)
    await put_all(backend, ["k"])
    found: list[bool] = []

    async def look() -> None:
        found.extend(await backend.exists(["k"]))

    fcntl.flock(stuck._arena.lock.fd, fcntl.LOCK_EX)
    async with anyio.create_task_group() as tg:
        tg.start_soon(look)
        await anyio.sleep(0.01)  # the lookup is waiting for the lock
        await backend.aclose()
        fcntl.flock(stuck._arena.lock.fd, fcntl.LOCK_UN)
    assert found == [True]  # answered from the arena, still mapped
    await stuck.aclose()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(codec=None, min_codepoint=0)), max_size=6))
def test_a_key_hash_is_xxh3_of_the_key_as_utf8_nuls_and_lone_surrogates_included(keys: list[str]) -> None:
    words = [xxhash.xxh3_128_digest(k.encode("utf-8", "surrogatepass")) for k in keys]
    expected = np.frombuffer(b"".join(words), dtype="<u8").reshape(-1, 2)
    assert (key_hashes(keys) == expected).all() and key_hashes(keys).shape == (len(keys), 2)


def test_remembered_key_hashes_are_the_computed_ones_and_stay_bounded() -> None:
    hashes = KeyHashes(limit=4)
    keys = ["a", "b", "a", "ключ"]
    assert (hashes(keys) == key_hashes(keys)).all()
    assert (hashes(keys) == key_hashes(keys)).all()  # from memory
    assert (hashes(["d", "e"]) == key_hashes(["d", "e"])).all()  # 3 + 2 > 4: starts afresh
    assert sorted(hashes._known) == ["d", "e"]


async def test_closing_during_two_calls_unmaps_after_the_last(
    store_dir: Path, checkpoint_often: None
) -> None:
    backend = open_arena(store_dir)
    await put_all(backend, ["k0", "k1", "k2"])
    outcomes: list[object] = []

    async def put() -> None:
        outcomes.append(await put_all(backend, [f"p{i}" for i in range(4)]))

    async def get() -> None:
        outs = [bytearray(SLOT) for _ in range(3)]
        outcomes.append(await backend.get([obj(f"k{i}", out) for i, out in enumerate(outs)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(put)
        tg.start_soon(get)
        await anyio.lowlevel.checkpoint()
        assert outcomes == []  # both calls are running
        await backend.aclose()  # returns once both returned, the arena unmapped then
        assert [PutStatus.STORED] * 4 in outcomes and [GetStatus.HIT] * 3 in outcomes
        assert backend._arena._map.closed


async def test_a_cancelled_put_gives_its_slots_back_even_while_the_lock_is_busy(
    store_dir: Path, checkpoint_often: None
) -> None:
    backend, stuck = open_arena(store_dir, slots=4), open_arena(store_dir, slots=4)
    with anyio.CancelScope() as scope:

        async def cancel_while_locked() -> None:
            await anyio.lowlevel.checkpoint()  # the put has claimed its slots and copies
            fcntl.flock(stuck._arena.lock.fd, fcntl.LOCK_EX)
            scope.cancel()
            with anyio.CancelScope(shield=True):  # (this task is in the cancelled scope too)
                await anyio.sleep(0.02)  # the cancelled put waits to give its slots back
            fcntl.flock(stuck._arena.lock.fd, fcntl.LOCK_UN)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_while_locked)
            await put_all(backend, ["a", "b", "c", "d"])
    assert await put_all(backend, ["e", "f", "g", "h"]) == [PutStatus.STORED] * 4
    assert backend.stats().evictions == 0
    await backend.aclose()
    await stuck.aclose()


@pytest.mark.parametrize("then", ["put", "remove", "clear", "close"])
async def test_slots_a_failed_put_could_not_give_back_are_freed_at_the_next_exclusive_section(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A put whose publish and give-back both time out (another process held the lock a little
    longer than ``lock_timeout``) leaves its slots being written by this live process. The backend
    frees them at its next exclusive section (a put's claim, a remove, a clear) or its close, so
    the key stores and reads again, from any instance (before, it read PRESENT to every put and
    MISS to every get until the process ended)."""
    backend = open_arena(store_dir, lock_timeout_s=0.05)
    other = open_arena(store_dir)  # another process's lock: its own open file
    try:

        def stall(row: int) -> None:  # the other takes the lock while the put copies
            fcntl.flock(other._arena.lock.fd, fcntl.LOCK_EX)

        monkeypatch.setattr(arena, "_mid_write_hook", stall)
        assert await put_all(backend, ["k"]) == [PutStatus.FAILED]
        monkeypatch.setattr(arena, "_mid_write_hook", None)
        fcntl.flock(other._arena.lock.fd, fcntl.LOCK_UN)
        if then == "put":
            assert await put_all(backend, ["another"]) == [PutStatus.STORED]
        elif then == "remove":
            assert await backend.remove(["another"]) == [False]
        elif then == "clear":
            assert await backend.clear() == 0
        else:
            await backend.aclose()
        assert await put_all(other, ["k"]) == [PutStatus.STORED]
        assert await get_one(other, "k") == (GetStatus.HIT, bytes(filled("k")))
    finally:
        await backend.aclose()
        await other.aclose()


async def test_a_get_never_copies_a_slot_written_again_while_it_paused(
    store_dir: Path, checkpoint_often: None
) -> None:
    """The get finds both slots, copies "a" and lets the loop run; meanwhile "k" is removed and a
    writer in another process claims its slot for "k" again and stops before publishing it."""
    backend = open_arena(store_dir, slots=4)
    await fill_in_order(backend, ["a", "k", "b", "c"])
    url = f"arena://{store_dir}?capacity={4 * SLOT}&slot={SLOT}"
    workers = Workers([{"url": url, "writer": 1, "keys": ["k"], "size": SLOT, "pause": True}])
    try:

        async def rewrite_k() -> None:  # runs while the get is paused after its first object
            assert await backend.remove(["k"]) == [True]
            proc = workers.procs[0]
            workers.wait_for(proc, "READY")
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            workers.wait_for(proc, "PAUSED")  # "k" claimed (its old slot) and copied, not published

        outs = [bytearray(SLOT), bytearray(SLOT)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(rewrite_k)
            results = await backend.get([obj("a", outs[0]), obj("k", outs[1])])
    finally:
        workers.kill_all()
    assert results == [GetStatus.HIT, GetStatus.MISS]
    assert outs[0] == filled("a")
    await backend.aclose()


def test_looking_at_a_short_file_that_is_not_an_arena_is_refused(store_dir: Path) -> None:
    store_dir.mkdir(mode=0o700)
    (store_dir / "arena").write_bytes(b"KVFARENA\x01")  # the magic, but not a whole header
    with pytest.raises(ConfigError, match="is not a kvflow arena"):
        ArenaBackend.attach(f"arena://{store_dir}")


def test_looking_at_no_store_creates_nothing(store_dir: Path) -> None:
    """A look (``kvflow store``) at a store that is not there is a ConfigError that makes nothing:
    no directory, no parents, and in an empty directory no lock file or arena."""
    for missing in (store_dir / "a" / "b", store_dir):
        with pytest.raises(ConfigError, match="there is no arena store"):
            ArenaBackend.attach(f"arena://{missing}")
        assert not store_dir.exists()
    store_dir.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="there is no arena store"):
        ArenaBackend.attach(f"arena://{store_dir}")
    assert list(store_dir.iterdir()) == []


_ATTACH = """
import sys
from kvflow.backends.arena import ArenaBackend
from kvflow.errors import ConfigError
try:
    ArenaBackend.attach(sys.argv[1])
except ConfigError as exc:
    print("ConfigError:", exc)
else:
    print("attached")
"""


def attach_in_a_child(store_dir: Path) -> str:
    """What ``ArenaBackend.attach`` (``kvflow store stats|ls|clear``) says of the store at
    ``store_dir``, asked in a child process: a look that hangs fails the test instead of hanging it."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _ATTACH, f"arena://{store_dir}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"looking at the store {store_dir} hung")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_looking_at_a_store_whose_arena_is_a_fifo_is_refused_not_waited_on(store_dir: Path) -> None:
    """``kvflow store stats arena://DIR`` opens the arena without blocking and checks what it is
    before reading it: a FIFO there is refused with what to do (before, opening it waited forever
    for a writer)."""
    store_dir.mkdir(mode=0o700)
    os.mkfifo(store_dir / "arena", 0o600)
    said = attach_in_a_child(store_dir)
    assert said.startswith("ConfigError:") and "is not a file" in said and "remove it" in said, said


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user owns")
def test_looking_at_another_users_store_is_refused_before_anything_in_it_is_read(store_dir: Path) -> None:
    """Another user made the store's directory first (the default one is in sticky /dev/shm) and
    put a FIFO where the arena goes: the look refuses the directory, as opening the store does,
    before it opens anything in it (before, it read, here hung on, another user's file)."""
    store_dir.mkdir(mode=0o755)
    os.mkfifo(store_dir / "arena", 0o644)
    os.chown(store_dir, 12345, 12345)
    os.chown(store_dir / "arena", 12345, 12345)
    said = attach_in_a_child(store_dir)
    assert said.startswith("ConfigError:") and "belongs to another user" in said, said


_HEADER_FIELDS = {
    "ways": (12, "<I"),
    "slot": (16, "<Q"),
    "sets": (24, "<Q"),
    "offset": (32, "<Q"),
    "cut": (40, "<Q"),
}


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("ways", 0, "1 sets of 0 slots"),
        ("sets", 0, "0 sets of 16 slots"),
        ("slot", 1000, "slots of 1000 bytes"),
        ("offset", 4096, "puts the slots at byte 4096"),
        ("cut", 7, "unknown cut"),
        ("size", 4096, "is 4096 bytes long"),
    ],
)
def test_a_damaged_header_is_reported_as_damage_with_what_to_do(
    store_dir: Path, field: str, value: int, problem: str
) -> None:
    """A store whose arena header no kvflow writes (or whose file is not as long as it says) is
    damaged, whether a tool looks at it or an engine opens it: the error says so and how to make
    it anew (before, a look said "capacity must be at least one slot", as if the URL were wrong)."""
    anyio.run(open_arena(store_dir).aclose)
    arena_file = store_dir / "arena"
    if field == "size":
        os.truncate(arena_file, value)
    else:
        at, form = _HEADER_FIELDS[field]
        with open(arena_file, "r+b") as f:
            f.seek(at)
            f.write(struct.pack(form, value))
    looks: list[Callable[[], ArenaBackend]] = [
        lambda: ArenaBackend.attach(f"arena://{store_dir}"),  # kvflow store stats|ls|clear
        lambda: open_arena(store_dir),  # an engine
    ]
    for look in looks:
        with pytest.raises(ConfigError) as info:
            look()
        said = str(info.value)
        assert f"the arena at {arena_file} is damaged" in said and problem in said, said
        assert f"rm {arena_file}" in said and "capacity must" not in said, said


# --- geometry, writers' verdicts, opening beside a creator -----------------------------------------


@pytest.mark.parametrize("slots", [1, 63, 100, 127, 200, 4096 + 100])
def test_capacity_keeps_all_but_a_few_whole_slots(store_dir: Path, slots: int) -> None:
    """docs/arena-backend.md: capacity is rounded down to whole slots. Sets of 64 slots or a few
    more leave fewer than ``sets`` slots out (they lost up to 63: 100 slots gave 64)."""
    backend = open_arena(store_dir, slots=slots)
    try:
        kept = backend.stats().capacity_bytes // SLOT
        assert slots - max(1, slots // WAYS) < kept <= slots
    finally:
        anyio.run(backend.aclose)


def test_a_capacity_beyond_any_filesystem_is_a_config_error(store_dir: Path) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        ArenaConfig(str(store_dir), capacity_bytes=1 << 63, slot_bytes=64 << 20)


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited, every thread of it, and waits for its parent to reap it."""
    stat = local_format._read_stat(pid)
    return stat is not None and stat[0] == b"Z" and local_format._exited(pid)


async def test_a_killed_writer_not_yet_reaped_gives_its_slots_back(store_dir: Path) -> None:
    """A writer killed mid-put whose parent has not reaped it yet (a zombie: its /proc entry and
    start time remain, as for an orphan under a PID 1 that never reaps) is dead: its slots are
    taken back."""
    url = f"arena://{store_dir}?capacity={4 * SLOT}&slot={SLOT}"
    workers = Workers([{"url": url, "writer": 1, "keys": ["dying"], "size": SLOT, "pause": True}])
    proc = workers.procs[0]
    try:
        workers.go()
        workers.wait_for(proc, "PAUSED")
        os.kill(proc.pid, 9)  # killed, and not waited for
        deadline = time.monotonic() + 10
        while not is_zombie(proc.pid):  # (its threads may take a moment to end)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend = open_arena(store_dir, slots=4)
        try:
            assert await put_all(backend, ["dying"]) == [PutStatus.STORED]
        finally:
            await backend.aclose()
    finally:
        workers.kill_all()


def test_a_writer_that_could_not_read_its_own_start_time_is_never_judged_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without its start time (no descriptor left to read /proc/self/stat) a writer names itself
    unknown, so no other process takes its slots for a mismatched start."""
    real = local_format._read_stat
    monkeypatch.setattr(local_format, "_read_stat", lambda pid: None if pid == "self" else real(pid))
    writer = local_format.WriterId.current()  # this live process
    monkeypatch.setattr(local_format, "_read_stat", real)
    judge = local_format.WriterId(local_format._pid_namespace(), writer.pid + 1, 1)  # another process
    assert writer.namespace == 0 and writer.is_alive(judge)


def test_a_claim_asks_proc_once_per_writer_not_once_per_slot(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim judges the writers of slots being written in its sets under the exclusive lock:
    once per writer (eight ranks writing 256 slots each cost 1792 reads of /proc, 13 ms of lock)."""
    backend = open_arena(store_dir, slots=4096)
    try:
        table = backend._arena._table
        rows = list(range(0, 4096, 2))
        me = local_format.WriterId.current()
        table[1, rows], table[2, rows], table[3, rows] = me.namespace, 1, 12345  # one other writer
        table[0, rows] = 1  # WRITING
        del table
        asked: list[int] = []
        real = local_format._read_stat

        def counted(pid: int | str) -> tuple[bytes, int] | None:
            asked.append(int(pid) if pid != "self" else -1)
            return real(pid)

        monkeypatch.setattr(local_format, "_read_stat", counted)
        backend._arena.claim(key_hashes([f"k{i}" for i in range(256)]), time.monotonic_ns())
        assert asked.count(1) == 1
    finally:
        anyio.run(backend.aclose)


def test_opening_waits_for_another_process_creating_the_arena(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process opening the store while another creates it waits for the creation (allocating a
    large arena outlasts the lock timeout: about 10 s per 120 GiB here), bounded by its size."""
    import threading

    import kvflow.backends.arena.store as arena_store

    real = os.posix_fallocate
    creating = threading.Event()

    def slow(fd: int, offset: int, length: int) -> None:
        creating.set()
        time.sleep(1.0)
        real(fd, offset, length)

    monkeypatch.setattr(arena_store.os, "posix_fallocate", slow)
    monkeypatch.setattr(arena_store, "_ALLOCATE_BYTES_PER_S", 1 << 20)  # a slow host: ~1 s a MiB
    made: list[ArenaBackend] = []
    creator = threading.Thread(target=lambda: made.append(open_arena(store_dir, slots=64)))
    creator.start()
    try:
        assert creating.wait(10)
        second = open_arena(store_dir, slots=64, lock_timeout_s=0.2)
        anyio.run(second.aclose)
    finally:
        creator.join()
        for backend in made:
            anyio.run(backend.aclose)


def test_a_store_locked_for_good_is_unavailable_not_misconfigured(store_dir: Path) -> None:
    anyio.run(open_arena(store_dir, slots=16).aclose)  # the arena exists
    fd = os.open(store_dir / "kvflow.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a stuck process
        with pytest.raises(BackendUnavailableError, match="lock"):
            open_arena(store_dir, slots=16, lock_timeout_s=0.2)
    finally:
        os.close(fd)


# Open the store of argv[1] once kvflow's compiled functions are loaded: how long the open took.
_OPEN = """
import sys, time
import anyio
from kvflow import regions
from kvflow.backends.arena import ArenaBackend
from kvflow.backends.arena.table import passes
from kvflow.errors import ConfigError
regions.warm(), passes()
started = time.monotonic()
try:
    anyio.run(ArenaBackend.from_url(sys.argv[1]).aclose)
    print(f"{time.monotonic() - started:.3f} opened")
except ConfigError as exc:
    print(f"{time.monotonic() - started:.3f} ConfigError: {exc}")
"""


def test_a_capacity_larger_than_the_filesystem_is_refused_without_waiting_for_the_lock(
    store_dir: Path,
) -> None:
    """A process opening a store whose arena is missing waits for the lock as long as making the
    arena takes (1 s per GiB): a typo (capacity=64TiB) while a stopped process held the lock waited
    about 18 hours before the capacity was found larger than the filesystem."""
    store_dir.mkdir(mode=0o700)
    fd = os.open(store_dir / "kvflow.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    url = f"arena://{store_dir}?capacity=64TiB&slot=64MiB&lock_timeout=10"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a stopped process
        done = subprocess.run([sys.executable, "-c", _OPEN, url], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("opening a store larger than its filesystem waited for the lock")
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    seconds, said = done.stdout.split(" ", 1)
    assert float(seconds) < 5, done.stdout  # not the lock timeout: no wait at all
    assert said.startswith("ConfigError: the arena backend cannot take") and "no room" in said, said
    assert "smaller capacity" in said, said
    assert sorted(p.name for p in store_dir.iterdir()) == ["kvflow.lock"]


def test_an_arena_an_earlier_kvflow_cut_opens_with_the_same_url(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store of 100 slots an earlier kvflow cut into one set of 64 opens as it was made, with
    the URL that made it (sets of more than 64 slots came later)."""
    import kvflow.backends.arena.store as arena_store

    config = ArenaConfig(str(store_dir), capacity_bytes=100 * SLOT, slot_bytes=SLOT)
    with monkeypatch.context() as patch:
        patch.setattr(arena_store.Geometry, "of", arena_store.Geometry.earlier_of)
        arena_store.ArenaFile.open(config).close()
    with open(store_dir / "arena", "r+b") as f:  # an earlier kvflow's header ends before the cut
        f.seek(40)
        f.write(bytes(8))
    arena = arena_store.ArenaFile.open(config)
    try:
        assert (arena.geometry.ways, arena.geometry.sets) == (64, 1)
    finally:
        arena.close()


def test_the_lock_file_is_a_forked_childs_own_while_the_store_is_being_made(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making a large arena is the longest section there is (it allocates the whole file under the
    exclusive lock): the lock file was registered for forked children only after it, so a process
    killed while making the store, with a helper it had forked alive, left the store locked."""
    from kvflow.backends import lockfiles
    from kvflow.backends.arena import lock as arena_lock

    seen: list[bool] = []
    held_blocking = arena_lock.StoreLock.held_blocking

    def watched(self: arena_lock.StoreLock, mode: int, timeout_s: float) -> Any:
        seen.append(self.fd in lockfiles._OPEN)
        return held_blocking(self, mode, timeout_s)

    monkeypatch.setattr(arena_lock.StoreLock, "held_blocking", watched)
    backend = open_arena(store_dir)
    try:
        assert seen and seen[0]
    finally:
        anyio.run(backend.aclose)
