"""The memory backend's calls on a batch by column (what the transfer layer sends): room made for
the whole batch at once, its objects copied in runs with the loop let run between them, a put's
objects published together at its end, a get's buffers pinned while it copies."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.lowlevel
import pytest
import torch

from kvflow import GetStatus, MemoryBackend, PutStatus, regions
from kvflow.backends import pacing
from kvflow.backends.memory import MemoryConfig
from tests.backends.test_memory import batch, data, obj

T = TypeVar("T")
LAYERS, SIZE = 4, 4096  # objects of 16 KiB, in runs of two (below)
OBJECT = LAYERS * SIZE


@pytest.fixture(autouse=True)
def runs_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of two objects, and a call that lets the loop run between any two of them whenever
    another task is ready."""
    monkeypatch.setattr(pacing, "RUN_BYTES", 2 * OBJECT)
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (LAYERS, n, SIZE), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def after_runs(monkeypatch: pytest.MonkeyPatch, runs: int) -> anyio.Event:
    """An event set once the backend has made ``runs`` copy calls (of the batch paths)."""
    done = anyio.Event()
    real, made = regions.copy_rows, 0

    def counted(*args: object, **kwargs: object) -> None:
        nonlocal made
        real(*args, **kwargs)  # type: ignore[arg-type]
        made += 1
        if made == runs:
            done.set()

    monkeypatch.setattr(regions, "copy_rows", counted)
    return done


@contextlib.asynccontextmanager
async def paused(monkeypatch: pytest.MonkeyPatch, call: Callable[[], Awaitable[T]]) -> AsyncIterator[list[T]]:
    """``call`` run in a task: the block runs once it has copied its first run and let the loop
    run; the list yielded holds its answer once the block has ended."""
    started = after_runs(monkeypatch, 1)
    answer: list[T] = []

    async def run() -> None:
        answer.append(await call())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await started.wait()
        yield answer


async def read_all(backend: MemoryBackend, names: list[str]) -> tuple[list[GetStatus], torch.Tensor]:
    target = torch.zeros(LAYERS, len(names), SIZE, dtype=torch.uint8)
    return await backend.get(batch(target, names, list(range(len(names))))), target


async def test_a_batch_is_put_in_runs_and_published_whole_at_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the put copies (the loop runs between its runs) none of its objects is in the store
    (none half-written, none published early), and the bytes of the runs it has reached are
    counted; once it returns, all of them are in it, every object reads back whole, and the first
    key is the most recently used."""
    source, names = blocks(7), keys(7)
    backend = MemoryBackend()
    seen: list[list[bool]] = []
    async with paused(monkeypatch, lambda: backend.put(batch(source, names, list(range(7))))) as put:
        while not put:
            seen.append(await backend.exists(names))
            assert backend.stats().used_bytes in (
                2 * OBJECT,
                4 * OBJECT,
                6 * OBJECT,
                7 * OBJECT,
            )  # runs reached
            await anyio.lowlevel.checkpoint()
    assert put == [[PutStatus.STORED] * 7]
    assert seen[0] == [False] * 7  # (looked while it copied)
    assert all(found in ([False] * 7, [True] * 7) for found in seen)
    got, target = await read_all(backend, names)
    assert got == [GetStatus.HIT] * 7 and torch.equal(target, source)
    assert backend.stored_keys() == names[::-1]
    stats = backend.stats()
    assert (stats.puts, stats.put_bytes, stats.hits, stats.hit_bytes) == (7, 7 * OBJECT, 7, 7 * OBJECT)


async def test_a_key_another_put_publishes_while_a_batch_copies_is_present(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first publisher wins: the batch's copy of that key is dropped, its room given back."""
    source, names = blocks(6), keys(6)
    other = data("other", OBJECT)
    backend = MemoryBackend()
    async with paused(monkeypatch, lambda: backend.put(batch(source, names, list(range(6))))) as put:
        assert not put
        assert await backend.put([obj("k4", other)]) == [PutStatus.STORED]
    assert put == [[PutStatus.STORED] * 4 + [PutStatus.PRESENT, PutStatus.STORED]]
    got, target = await read_all(backend, names)
    assert got == [GetStatus.HIT] * 6
    assert torch.equal(target[:, 4].reshape(-1), other) and torch.equal(target[:, :4], source[:, :4])
    stats = backend.stats()
    assert (stats.used_bytes, stats.puts, stats.present) == (6 * OBJECT, 6, 1)
    assert backend.stored_keys()[-1] == "k0"


async def test_a_batch_put_cancelled_or_failed_while_copying_publishes_nothing_and_gives_its_room_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, names = blocks(6), keys(6)
    backend = MemoryBackend(MemoryConfig(capacity_bytes=6 * OBJECT))
    started = after_runs(monkeypatch, 1)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.put, batch(source, names, list(range(6))))
            await started.wait()
            assert backend.stats().used_bytes == 2 * OBJECT  # its first run's room
            scope.cancel()
    stats = backend.stats()
    assert (stats.used_bytes, stats.puts, stats.put_failures) == (0, 0, 0)
    assert await backend.exists(names) == [False] * 6

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(regions, "copy_rows", broken)
    with pytest.raises(RuntimeError, match="the copy failed"):
        await backend.put(batch(source, names, list(range(6))))
    assert backend.stats().used_bytes == 0 and await backend.exists(names) == [False] * 6
    monkeypatch.undo()
    assert await backend.put(batch(source, names, list(range(6)))) == [PutStatus.STORED] * 6


async def test_a_batch_put_closed_while_copying_stores_nothing_and_counts_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, names = blocks(6), keys(6)
    backend = MemoryBackend()
    async with paused(monkeypatch, lambda: backend.put(batch(source, names, list(range(6))))) as put:
        await backend.aclose()  # (returns once the put's copies are over)
    assert put == [[PutStatus.FAILED] * 6]
    stats = backend.stats()
    assert (stats.used_bytes, stats.puts, stats.put_failures) == (0, 0, 6)


async def test_a_batch_put_of_held_keys_and_more_than_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for five: two older keys, one of which the batch holds; of the batch's six objects the
    held one is PRESENT (a use, never evicted for the rest), the other older key goes, four new
    ones fit and the last answers NO_SPACE. The batch's first key is the most recently used."""
    source, names = blocks(6), keys(6)
    backend = MemoryBackend(MemoryConfig(capacity_bytes=5 * OBJECT))
    assert await backend.put(batch(source, ["old", "k1"], [0, 1])) == [PutStatus.STORED] * 2
    results = await backend.put(batch(source, names, list(range(6))))
    assert results == [PutStatus.STORED, PutStatus.PRESENT] + [PutStatus.STORED] * 3 + [PutStatus.NO_SPACE]
    assert backend.stored_keys() == ["k4", "k3", "k2", "k1", "k0"]
    got, target = await read_all(backend, names[:5])
    assert got == [GetStatus.HIT] * 5 and torch.equal(target, source[:, :5])
    stats = backend.stats()
    assert (stats.used_bytes, stats.evictions, stats.puts, stats.present, stats.no_space) == (
        5 * OBJECT,
        1,
        2 + 4,
        1,
        1,
    )


@pytest.mark.parametrize("change", ["evicted", "removed"])
async def test_a_batch_get_keeps_reading_what_it_found(monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """A get's buffers are pinned while it copies: a put that needs the room finds none (evicting
    them would hand a buffer being read to a writer), and a key removed meanwhile is still read
    whole from the buffer the get holds."""
    source, names = blocks(6), keys(6)
    backend = MemoryBackend(MemoryConfig(capacity_bytes=6 * OBJECT))
    assert await backend.put(batch(source, names, list(range(6)))) == [PutStatus.STORED] * 6
    async with paused(monkeypatch, lambda: read_all(backend, names)) as reads:
        if change == "evicted":
            assert await backend.put([obj("new", data("new", OBJECT))]) == [PutStatus.NO_SPACE]
        else:
            assert await backend.remove(names) == [True] * 6
        assert not reads
    got, target = reads[0]
    assert got == [GetStatus.HIT] * 6 and torch.equal(target, source)
    assert await backend.exists(names) == [change == "evicted"] * 6
    assert all(entry.readers == 0 for entry in backend._objects.values())  # unpinned


async def test_a_batch_get_makes_its_first_key_the_most_recently_used() -> None:
    source, names = blocks(6), keys(6)
    backend = MemoryBackend()
    assert await backend.put(batch(source, names, list(range(6)))) == [PutStatus.STORED] * 6
    assert await backend.put([obj("x", data("x", 8))]) == [PutStatus.STORED]
    assert backend.stored_keys() == [*names[::-1], "x"]
    assert (await read_all(backend, names))[0] == [GetStatus.HIT] * 6
    assert backend.stored_keys() == ["x", *names[::-1]]


async def test_a_put_that_finds_its_last_key_present_keeps_its_first_objects() -> None:
    """Room for four, the store holding the put's last key: its first four objects are stored and
    the held key, needed only after them, makes room for them and is refused (as the general
    path comes to it run by run), not kept at the cost of an object before it."""
    source, names = blocks(5), ["a", "b", "c", "d", "x"]
    backend = MemoryBackend(MemoryConfig(capacity_bytes=4 * OBJECT))
    assert await backend.put(batch(source, ["x"], [4])) == [PutStatus.STORED]
    results = await backend.put(batch(source, names, list(range(5))))
    assert results == [PutStatus.STORED] * 4 + [PutStatus.NO_SPACE]
    assert backend.stored_keys() == ["d", "c", "b", "a"]


async def test_a_key_a_put_finds_present_is_not_evicted_by_another_put_while_it_pauses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P, the least recently used, is the put's first key: a use, made before the put pauses, so
    another put that needs room meanwhile evicts others, and P, the put's head, stays."""
    source = blocks(12)
    backend = MemoryBackend(MemoryConfig(capacity_bytes=8 * OBJECT))
    assert await backend.put(batch(source, ["P"], [0])) == [PutStatus.STORED]
    assert await backend.put(batch(source, ["q1", "q2", "q3"], [1, 2, 3])) == [PutStatus.STORED] * 3
    head = batch(source, ["P", "n1", "n2", "n3", "n4"], [0, 4, 5, 6, 7])
    async with paused(monkeypatch, lambda: backend.put(head)) as put:
        other = await backend.put(batch(source, ["z1", "z2", "z3", "z4"], [8, 9, 10, 11]))
    assert put[0][0] is PutStatus.PRESENT and PutStatus.STORED in other
    assert await backend.exists(["P", "q1"]) == [True, False]  # the other put evicted q1, not P


async def test_a_batch_get_that_paused_ends_with_its_first_key_the_most_recently_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another task uses x while the get pauses between runs: the get's keys are used again at its
    end, so that x, not the get's tail, is evicted first."""
    source, names = blocks(7), keys(6)
    backend = MemoryBackend()
    assert await backend.put(batch(source, names, list(range(6)))) == [PutStatus.STORED] * 6
    assert await backend.put(batch(source, ["x"], [6])) == [PutStatus.STORED]
    async with paused(monkeypatch, lambda: read_all(backend, names)) as reads:
        await backend.touch(["x"])
    got, target = reads[0]
    assert got == [GetStatus.HIT] * 6 and torch.equal(target, source[:, :6])
    assert backend.stored_keys() == ["x", *names[::-1]]


async def test_a_batch_get_cancelled_part_way_counts_what_it_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    source, names = blocks(6), keys(6)
    backend = MemoryBackend()
    assert await backend.put(batch(source, names, list(range(6)))) == [PutStatus.STORED] * 6
    started = after_runs(monkeypatch, 1)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, backend, names)
            await started.wait()
            scope.cancel()
    stats = backend.stats()
    assert (stats.hits, stats.hit_bytes, stats.get_failures) == (2, 2 * OBJECT, 0)  # its first run
    assert all(entry.readers == 0 for entry in backend._objects.values())  # unpinned


async def test_a_batch_put_makes_room_a_run_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store full of objects a quarter the size: before the put first lets the loop run, it has
    evicted (and freed) room for its first run only, so no one hold of the loop frees and
    allocates the whole batch's room; cancelled there, it gives that room back and nothing more
    was evicted."""
    small = SIZE // 4
    backend = MemoryBackend(MemoryConfig(capacity_bytes=6 * OBJECT))
    cache = torch.randint(0, 256, (LAYERS, 24, small), dtype=torch.uint8)
    assert await backend.put(batch(cache, keys(24, "old"), list(range(24)))) == [PutStatus.STORED] * 24
    source, names = blocks(6), keys(6)
    with anyio.CancelScope() as scope:
        async with paused(monkeypatch, lambda: backend.put(batch(source, names, list(range(6))))):
            stats = backend.stats()
            assert (stats.evictions, stats.used_bytes) == (8, 6 * OBJECT)  # the first run's room
            scope.cancel()
    stats = backend.stats()
    assert (stats.evictions, stats.used_bytes, stats.puts) == (8, 4 * OBJECT, 24)  # (the 24: the old)
    assert await backend.exists(names) == [False] * 6
    assert len(backend.stored_keys()) == 16
