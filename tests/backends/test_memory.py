from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch

import kvflow.backends.memory as memory
from kvflow import GetStatus, MemoryBackend, PutStatus, open_backend, regions
from kvflow.backends import ObjectRef, pacing
from kvflow.backends.base import ObjectBatch
from kvflow.backends.memory import MemoryConfig

MiB = 1 << 20


def obj(key: str, *tensors: torch.Tensor) -> ObjectRef:
    """An object over ``tensors``: it holds their addresses only, so keep them alive while it is used."""
    return ObjectRef.of(key, [t.data_ptr() for t in tensors], [t.numel() * t.element_size() for t in tensors])


async def test_put_get_round_trip_of_scattered_regions() -> None:
    backend = MemoryBackend()
    a, b = torch.arange(100, dtype=torch.uint8), torch.arange(50, dtype=torch.int32)
    assert await backend.put([obj("k", a, b)]) == [PutStatus.STORED]
    x, y = torch.zeros_like(a), torch.zeros_like(b)
    assert await backend.get([obj("k", x, y), obj("missing", x)]) == [GetStatus.HIT, GetStatus.MISS]
    assert torch.equal(x, a) and torch.equal(y, b)
    assert await backend.exists(["k", "missing"]) == [True, False]


async def test_put_never_overwrites_and_size_mismatch_fails() -> None:
    backend = MemoryBackend()
    first, second = torch.ones(10, dtype=torch.uint8), torch.full((10,), 7, dtype=torch.uint8)
    await backend.put([obj("k", first)])
    assert await backend.put([obj("k", second)]) == [PutStatus.PRESENT]
    out = torch.zeros(10, dtype=torch.uint8)
    await backend.get([obj("k", out)])
    assert torch.equal(out, first)
    small = torch.zeros(4, dtype=torch.uint8)
    assert await backend.get([obj("k", small)]) == [GetStatus.FAILED]
    assert torch.equal(small, torch.zeros(4, dtype=torch.uint8))


async def test_one_key_twice_in_a_put_keeps_the_first_and_counts_it_once() -> None:
    backend = MemoryBackend()
    first, second = torch.ones(10, dtype=torch.uint8), torch.full((10,), 7, dtype=torch.uint8)
    assert await backend.put([obj("k", first), obj("k", second)]) == [PutStatus.STORED, PutStatus.PRESENT]
    out = torch.zeros(10, dtype=torch.uint8)
    assert await backend.get([obj("k", out)]) == [GetStatus.HIT] and torch.equal(out, first)
    stats = backend.stats()
    assert (stats.used_bytes, stats.puts, stats.present) == (10, 1, 1)


def batch(cache: torch.Tensor, keys: list[str], blocks: list[int]) -> ObjectBatch:
    """Objects by column: ``keys[i]`` is block ``blocks[i]`` of every layer of ``cache``
    (layers x blocks x bytes), one region per layer."""
    layers, _, size = cache.shape
    strides = [cache[layer].data_ptr() for layer in range(layers)]
    rows = [[base + block * size for base in strides] for block in blocks]
    return ObjectBatch(
        keys, np.asarray(rows, dtype=np.int64).reshape(len(keys), layers), [size] * layers, layers * size
    )


@pytest.mark.parametrize("shape", ["batch", "list"])
async def test_objects_over_a_piece_go_whole_a_run_a_copy_call(
    monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """Objects larger than a piece (1 MiB) but within a run (pacing.whole_bytes) are copied whole,
    a run of them a call of the compiled copy loop each way, not one by one in 1 MiB pieces (from
    flushed caches each piece's call cost a fifth of a 2 MiB object's get); a batch by column of
    them goes the one-pass way (published together at the end of the put, the get's buffers
    pinned), a list run by run."""
    layers, blocks, size = 2, 8, pacing.PIECE  # objects of 2 MiB: 2 a run of 4 MiB
    assert pacing.PIECE < layers * size <= pacing.whole_bytes() == pacing.RUN_BYTES
    calls: list[tuple[int, bool]] = []  # (objects, into the regions) per call of the copy loop

    def counted(copy: Any) -> Any:
        def run(starts: np.ndarray, *args: Any, into_regions: bool, **kwargs: Any) -> None:
            calls.append((len(starts), into_regions))
            copy(starts, *args, into_regions=into_regions, **kwargs)

        return run

    one_pass: list[str] = []
    put_batch, get_batch = MemoryBackend._put_batch, MemoryBackend._get_batch

    async def spied_put(self: MemoryBackend, *args: Any) -> Any:
        one_pass.append("put")
        return await put_batch(self, *args)

    async def spied_get(self: MemoryBackend, *args: Any) -> Any:
        one_pass.append("get")
        return await get_batch(self, *args)

    monkeypatch.setattr(regions, "copy_rows", counted(regions.copy_rows))
    monkeypatch.setattr(regions, "copy_ragged", counted(regions.copy_ragged))
    monkeypatch.setattr(MemoryBackend, "_put_batch", spied_put)
    monkeypatch.setattr(MemoryBackend, "_get_batch", spied_get)
    source = torch.randint(0, 256, (layers, blocks, size), dtype=torch.uint8)
    target = torch.zeros_like(source)
    backend = MemoryBackend()
    keys = [f"b{i}" for i in range(blocks)]
    ids = list(range(blocks))

    def shaped(cache: torch.Tensor) -> Sequence[ObjectRef]:
        objects = batch(cache, keys, ids)
        return objects if shape == "batch" else list(objects)

    assert await backend.put(shaped(source)) == [PutStatus.STORED] * blocks
    assert await backend.get(shaped(target)) == [GetStatus.HIT] * blocks
    assert torch.equal(source, target)
    run = pacing.RUN_BYTES // (layers * size)
    assert calls == [(run, False)] * (blocks // run) + [(run, True)] * (blocks // run)
    assert one_pass == (["put", "get"] if shape == "batch" else [])
    await backend.aclose()


@pytest.mark.parametrize("size", [1000, MiB + 1], ids=["1000B", "1MiB+1"])  # (one run: all three)
async def test_a_held_key_after_new_ones_never_keeps_them_out(size: int) -> None:
    """A full store of o and x; a put of a, b (new) and x (held): x is a use only once the put
    reaches it, as in a put of each object alone, so the room a and b need evicts o and x, and x
    then finds none (NO_SPACE). The prompt's head is kept; x, marked used first, kept b out when
    the objects shared a run (a block that is no use without the ones before it)."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * size))
    tensors = {key: data(key, size) for key in "oxab"}
    for key in "ox":
        assert await backend.put([obj(key, tensors[key])]) == [PutStatus.STORED]
    results = await backend.put([obj(key, tensors[key]) for key in "abx"])
    assert results == [PutStatus.STORED, PutStatus.STORED, PutStatus.NO_SPACE]
    assert backend.stored_keys() == ["b", "a"]  # the put's first object the most recently used
    stats = backend.stats()
    assert (stats.used_bytes, stats.evictions, stats.no_space, stats.puts) == (2 * size, 2, 1, 4)
    for key in "ab":
        out = torch.zeros(size, dtype=torch.uint8)
        assert await backend.get([obj(key, out)]) == [GetStatus.HIT] and torch.equal(out, tensors[key])
    # a held head, a new object after it: the head is a use first, so the new one evicts b, not it
    assert await backend.put([obj(key, tensors[key]) for key in "ax"]) == [
        PutStatus.PRESENT,
        PutStatus.STORED,
    ]
    assert backend.stored_keys() == ["x", "a"]
    await backend.aclose()


async def test_a_batch_by_column_round_trips_in_runs_with_misses_between() -> None:
    """A batch larger than one run (pacing.RUN_BYTES) whose keys are partly missing: every present
    object's regions are filled, the missing ones' left alone, and the batch's sizes are counted."""
    layers, blocks, size = 4, 160, 16 << 10  # 64 KiB objects: 64 per run, three runs
    assert blocks * layers * size > 2 * pacing.RUN_BYTES
    source = torch.randint(0, 256, (layers, blocks, size), dtype=torch.uint8)
    backend = MemoryBackend()
    keys = [f"b{i}" for i in range(blocks)]
    stored = list(range(0, blocks, 3))
    assert await backend.put(batch(source, [keys[i] for i in stored], stored)) == [PutStatus.STORED] * len(
        stored
    )
    target = torch.zeros_like(source)
    got = await backend.get(batch(target, keys, list(range(blocks))))
    assert got == [GetStatus.HIT if i in stored else GetStatus.MISS for i in range(blocks)]
    assert torch.equal(target[:, stored], source[:, stored])
    missed = [i for i in range(blocks) if i not in stored]
    assert not target[:, missed].any()
    stats = backend.stats()
    assert (stats.hits, stats.hit_bytes, stats.misses) == (
        len(stored),
        len(stored) * layers * size,
        len(missed),
    )


async def test_lru_eviction_keeps_within_capacity() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=300))
    data = torch.zeros(100, dtype=torch.uint8)
    await backend.put([obj(k, data) for k in "abc"])  # a call's first key its newest: c, b, a
    await backend.get([obj("c", data)])  # c is now most recent
    assert await backend.put([obj("d", data)]) == [PutStatus.STORED]
    assert await backend.exists(list("abcd")) == [True, False, True, True]
    stats = backend.stats()
    assert stats.used_bytes == 300 and stats.evictions == 1
    too_big = torch.zeros(301, dtype=torch.uint8)
    assert await backend.put([obj("e", too_big)]) == [PutStatus.NO_SPACE]
    assert stats.no_space == 1 and stats.hits == 1
    assert await backend.remove(["a", "b", "zz"]) == [True, False, False]
    assert await backend.exists(list("acd")) == [False, True, True] and stats.used_bytes == 200


async def test_a_key_a_put_finds_present_is_used_before_the_put_evicts_for_the_rest() -> None:
    """A put of a present key and a new one into a full store: the present key counts as used
    before room is made for the new one, so the eviction takes the least recently used other key,
    never the one the put just answered PRESENT for (a prompt's head, kept by a longer prompt)."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=400))
    data = torch.zeros(100, dtype=torch.uint8)
    for key in "abcd":
        assert await backend.put([obj(key, data)]) == [PutStatus.STORED]
    assert await backend.put([obj("a", data), obj("e", data)]) == [PutStatus.PRESENT, PutStatus.STORED]
    assert await backend.exists(list("abcde")) == [True, False, True, True, True]


async def test_a_get_of_another_size_or_a_miss_is_not_a_use() -> None:
    """A get that finds a key stored at another size (FAILED) leaves it where it was in the LRU:
    the next eviction takes it, not an object the reader can use."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=300))
    data = torch.zeros(100, dtype=torch.uint8)
    for key in "abc":
        assert await backend.put([obj(key, data)]) == [PutStatus.STORED]
    wrong = torch.zeros(50, dtype=torch.uint8)
    assert await backend.get([obj("a", wrong), obj("zz", data)]) == [GetStatus.FAILED, GetStatus.MISS]
    assert await backend.put([obj("d", data)]) == [PutStatus.STORED]
    assert await backend.exists(list("abcd")) == [False, True, True, True]


@pytest.mark.parametrize("size", [100, 3 << 20], ids=["one run", "a run per object"])
async def test_eviction_takes_a_prompts_last_blocks_first(size: int) -> None:
    """A request's blocks are useful only with those before them: within a put or a get, the
    first object is the most recently used, so eviction leaves a prompt's head (the blocks a
    lookup reaches) and takes its tail, whether the call copies in one run or in several."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=6 * size))
    data = torch.zeros(size, dtype=torch.uint8)
    first, second = [f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)]
    assert await backend.put([obj(k, data) for k in first]) == [PutStatus.STORED] * 4
    assert backend.stored_keys() == first[::-1]  # least recently used first
    assert await backend.put([obj(k, data) for k in second]) == [PutStatus.STORED] * 4
    assert await backend.exists(first) == [True, True, False, False]
    assert await backend.get([obj(k, data) for k in first]) == [GetStatus.HIT] * 2 + [GetStatus.MISS] * 2
    assert backend.stored_keys()[-2:] == ["a1", "a0"]
    assert await backend.put([obj(k, data) for k in ("c0", "c1")]) == [PutStatus.STORED] * 2
    assert await backend.exists(first[:2] + second) == [True, True, True, True, False, False]


def test_url_parsing() -> None:
    backend = open_backend("memory://?capacity=1MiB")
    assert isinstance(backend, MemoryBackend) and backend.config.capacity_bytes == 1 << 20


async def test_a_recycled_buffer_holds_only_the_new_object() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=200))
    a, b, c = (torch.full((100,), v, dtype=torch.uint8) for v in (1, 2, 3))
    await backend.put([obj("a", a)])
    await backend.put([obj("b", b)])  # (in calls of their own: a is the older)
    assert await backend.put([obj("c", c)]) == [PutStatus.STORED]  # evicts a, reuses its buffer
    out_b, out_c = torch.zeros(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    assert await backend.get([obj("a", out_b), obj("b", out_b), obj("c", out_c)]) == [
        GetStatus.MISS,
        GetStatus.HIT,
        GetStatus.HIT,
    ]
    assert torch.equal(out_b, b) and torch.equal(out_c, c)


# --- the event loop runs during long copies; the guarantees hold across those awaits -------------


def data(key: str, size: int) -> torch.Tensor:
    """The bytes every put of ``key`` stores (distinct per key, so a mix-up shows)."""
    return torch.frombuffer(bytearray(random.Random(key).randbytes(size)), dtype=torch.uint8)


@pytest.fixture
def checkpoint_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call lets other tasks run after each run or piece (instead of after ~0.5 ms)."""
    monkeypatch.setattr(pacing, "YIELD_EVERY_S", 0.0)


def whole_up_to(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Objects larger than ``nbytes`` are copied in pieces of ``nbytes`` (and runs hold at most
    that much): :func:`kvflow.backends.pacing.whole_bytes` patched through what it reads."""
    monkeypatch.setattr(pacing, "RUN_BYTES", nbytes)
    monkeypatch.setattr(pacing, "PIECE", nbytes)
    assert pacing.whole_bytes() == nbytes


async def test_a_get_never_sees_an_object_whose_put_is_still_copying(checkpoint_often: None) -> None:
    backend = MemoryBackend()
    size = 4 * pacing.whole_bytes()  # copied in four pieces, the loop let run between them
    source = data("k", size)
    put_done = False
    seen: list[GetStatus] = []

    async def put() -> None:
        nonlocal put_done
        assert await backend.put([obj("k", source)]) == [PutStatus.STORED]
        put_done = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(put)
        while not put_done:
            target = torch.zeros(size, dtype=torch.uint8)
            status = (await backend.get([obj("k", target)]))[0]
            seen.append(status)
            if status is GetStatus.HIT:
                assert torch.equal(target, source)
            else:
                assert status is GetStatus.MISS
            assert backend.stats().used_bytes in (0, size)  # reserved before the copy, then kept
    assert seen.count(GetStatus.MISS) >= 2  # gets really ran while the put copied
    assert backend.stats().used_bytes == size


@contextlib.asynccontextmanager
async def reading(
    backend: MemoryBackend, key: str, stored: torch.Tensor
) -> AsyncIterator[tuple[torch.Tensor, list[list[GetStatus]]]]:
    """A get of ``key`` (whose object is ``stored``) running: entered once it has started copying,
    so the object is pinned; yields its target and its result, there once the get ended (after
    the block, at the latest)."""
    target = torch.zeros(stored.numel(), dtype=torch.uint8)
    results: list[list[GetStatus]] = []

    async def read() -> None:
        results.append(await backend.get([obj(key, target)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        while not torch.equal(target[:MiB], stored[:MiB]):  # the get has started copying
            await anyio.lowlevel.checkpoint()
        yield target, results


async def test_eviction_never_takes_a_buffer_that_a_get_is_reading(checkpoint_often: None) -> None:
    size = 4 * pacing.whole_bytes()  # four pieces: the get pauses between them
    backend = MemoryBackend(MemoryConfig(capacity_bytes=size))  # room for one object
    a, b = data("a", size), data("b", size)
    assert await backend.put([obj("a", a)]) == [PutStatus.STORED]
    async with reading(backend, "a", a) as (target, results):
        assert not results
        # "a" is pinned: it is neither evicted nor recycled for "b", so "b" finds no room.
        assert await backend.put([obj("b", b)]) == [PutStatus.NO_SPACE]
        assert await backend.exists(["a", "b"]) == [True, False]
    assert results == [[GetStatus.HIT]] and torch.equal(target, a)
    assert await backend.put([obj("b", b)]) == [PutStatus.STORED]  # unpinned now: evicted
    stats = backend.stats()
    assert (stats.evictions, stats.used_bytes, stats.no_space, stats.puts) == (1, size, 1, 2)
    out = torch.zeros(size, dtype=torch.uint8)
    assert await backend.get([obj("b", out)]) == [GetStatus.HIT] and torch.equal(out, b)


async def test_an_eviction_that_passes_a_pinned_object_leaves_it_where_it_was(checkpoint_often: None) -> None:
    """An object a get is reading stays in the store and keeps its place in the LRU order (first,
    here) when a put evicts the objects around it."""
    big, small = 64 * MiB, MiB
    backend = MemoryBackend(MemoryConfig(capacity_bytes=big + 2 * small))
    a = data("a", big)
    assert await backend.put([obj("a", a)]) == [PutStatus.STORED]
    async with reading(backend, "a", a) as (target, results):
        for key in "bcd":  # the third evicts the least recently used unpinned object, "b"
            source = data(key, small)  # (alive through the put: an object holds only its address)
            assert await backend.put([obj(key, source)]) == [PutStatus.STORED]
        assert not results  # (still reading "a": the eviction passed it)
        assert backend.stored_keys() == ["a", "c", "d"]
    assert results == [[GetStatus.HIT]] and torch.equal(target, a)
    assert backend.stats().evictions == 1


async def test_a_put_whose_copy_fails_gives_back_its_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects copied in one call (no checkpoint) whose copy fails: the error reaches the caller and
    nothing of them stays (no key, no bytes counted); the next put has the room."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=MiB))
    sources = [data("a", 64), data("b", 96)]

    def broken(_buffers: object, _objects: object) -> None:
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(memory, "gather_objects", broken)
    with pytest.raises(RuntimeError, match="the copy failed"):
        await backend.put([obj("a", sources[0]), obj("b", sources[1])])
    assert backend.stats().used_bytes == 0 and await backend.exists(["a", "b"]) == [False, False]
    monkeypatch.undo()
    assert await backend.put([obj("a", sources[0]), obj("b", sources[1])]) == [PutStatus.STORED] * 2
    assert backend.stats().used_bytes == 160


async def test_a_copy_failing_in_a_run_that_goes_in_turn_keeps_the_count_of_what_it_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run with a held key after a new one goes object by object: a copy that fails there reaches
    the caller, the objects stored before it stay (counted once), and the failed one's room is
    given back, so the store counts the bytes it holds."""
    size = 1000
    backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * size))
    tensors = {key: data(key, size) for key in "oxab"}
    for key in "ox":
        assert await backend.put([obj(key, tensors[key])]) == [PutStatus.STORED]
    copies = 0
    gather = memory.gather_objects

    def second_fails(buffers: list[int], objects: Sequence[ObjectRef]) -> None:
        nonlocal copies
        copies += 1
        if copies == 2:
            raise RuntimeError("the copy failed")
        gather(buffers, objects)

    monkeypatch.setattr(memory, "gather_objects", second_fails)
    with pytest.raises(RuntimeError, match="the copy failed"):
        await backend.put([obj(key, tensors[key]) for key in "abx"])
    monkeypatch.undo()
    assert copies == 2 and backend.stored_keys() == ["a"]
    stats = backend.stats()
    assert (stats.used_bytes, stats.puts, stats.put_bytes) == (size, 3, 3 * size)  # o, x, then a
    out = torch.zeros(size, dtype=torch.uint8)
    assert await backend.get([obj("a", out)]) == [GetStatus.HIT] and torch.equal(out, tensors["a"])


async def test_a_put_whose_allocation_fails_gives_back_every_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second object's buffer cannot be allocated: the error reaches the caller, and neither
    object keeps bytes counted (the first had reserved its buffer already)."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=MiB))
    sources = [data("a", 64), data("b", 96)]
    allocate = torch.empty
    calls = 0

    def second_fails(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise MemoryError("out of host memory")
        return allocate(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(memory.torch, "empty", second_fails)
    with pytest.raises(MemoryError, match="out of host memory"):
        await backend.put([obj("a", sources[0]), obj("b", sources[1])])
    monkeypatch.undo()
    assert calls == 2
    assert backend.stats().used_bytes == 0 and await backend.exists(["a", "b"]) == [False, False]
    assert await backend.put([obj("a", sources[0]), obj("b", sources[1])]) == [PutStatus.STORED] * 2
    assert backend.stats().used_bytes == 160


async def test_a_cancelled_put_gives_back_its_reservation(checkpoint_often: None) -> None:
    size = 16 * MiB
    backend = MemoryBackend(MemoryConfig(capacity_bytes=size))
    source = data("k", size)  # (alive through the puts: an object holds only its address)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.put, [obj("k", source)])
            while backend.stats().used_bytes == 0:  # reserved: the copy is under way
                await anyio.lowlevel.checkpoint()
            scope.cancel()
    stats = backend.stats()
    assert (stats.used_bytes, stats.puts, stats.put_failures) == (0, 0, 0)
    assert await backend.exists(["k"]) == [False]
    assert await backend.put([obj("k", source)]) == [PutStatus.STORED]  # the room is there


async def test_an_object_too_large_to_copy_whole_is_copied_a_piece_a_call_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The largest object the memory backend copies whole (:func:`pacing.whole_bytes`, cut to
    4 KiB here, as the test below cuts it to interleave its calls) is what its copies of a larger
    object are cut by, on the way in and out."""
    whole_up_to(monkeypatch, 4096)
    calls: list[int] = []
    copy = regions.copy_ragged

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(int(sum(args[3])))
        copy(*args, **kwargs)

    monkeypatch.setattr(regions, "copy_ragged", counted)
    backend = MemoryBackend()
    source, target = data("k", 40_000), torch.zeros(40_000, dtype=torch.uint8)
    assert await backend.put([obj("k", source)]) == [PutStatus.STORED]
    assert await backend.get([obj("k", target)]) == [GetStatus.HIT]
    assert torch.equal(target, source)
    assert calls == 2 * ([4096] * 9 + [40_000 - 9 * 4096])
    await backend.aclose()


async def test_concurrent_calls_keep_objects_whole_and_stats_exact(
    checkpoint_often: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole_up_to(monkeypatch, 4096)  # a checkpoint every 4 KiB: many interleavings
    keys = [f"k{i}" for i in range(10)]
    sizes = {k: 20_000 + 3_000 * i for i, k in enumerate(keys)}
    sources = {k: data(k, sizes[k]) for k in keys}
    capacity = 4 * 40_000
    backend = MemoryBackend(MemoryConfig(capacity_bytes=capacity))
    tally: dict[str, int] = {}
    removed = 0

    async def worker(seed: int) -> None:
        nonlocal removed
        rng = random.Random(seed)
        for _ in range(40):
            batch = rng.sample(keys, rng.randint(1, 3))
            action = rng.random()
            if action < 0.45:
                for stored in await backend.put([obj(k, sources[k]) for k in batch]):
                    tally[stored.value] = tally.get(stored.value, 0) + 1
            elif action < 0.9:
                targets = {k: torch.zeros(sizes[k], dtype=torch.uint8) for k in batch}
                got = await backend.get([obj(k, targets[k]) for k in batch])
                for k, status in zip(batch, got):
                    tally[status.value] = tally.get(status.value, 0) + 1
                    if status is GetStatus.HIT:
                        assert torch.equal(targets[k], sources[k]), f"{k} came back torn or mixed"
            else:
                removed += sum(await backend.remove(batch))
            assert backend.stats().used_bytes <= capacity

    async with anyio.create_task_group() as tg:
        for seed in range(6):
            tg.start_soon(worker, seed)
    stats = backend.stats()
    kept = backend.stored_keys()
    assert tally.get("stored", 0) > 0 and tally.get("hit", 0) > 0 and stats.evictions > 0
    assert stats.used_bytes == sum(sizes[k] for k in kept)
    assert stats.puts - removed - stats.evictions == len(kept)
    counted = (stats.puts, stats.present, stats.no_space, stats.hits, stats.misses)
    assert counted == tuple(tally.get(s, 0) for s in ("stored", "present", "no_space", "hit", "miss"))
    assert stats.put_failures == stats.get_failures == 0


async def test_an_evicted_buffer_holds_the_next_object_of_its_size_whole() -> None:
    """A put into a full store takes the least recently used object's buffer for an object of
    the same size (no fresh allocation); what is read back is the new object, and the object that
    stayed keeps its bytes."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * 4096))
    a, b, c = data("a", 4096), data("b", 4096), data("c", 4096)
    assert await backend.put([obj("a", a)]) == [PutStatus.STORED]
    assert await backend.put([obj("b", b)]) == [PutStatus.STORED]  # (a call of its own: a is the older)
    allocations = 0
    allocate = torch.empty

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal allocations
        allocations += 1
        return allocate(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory.torch, "empty", counted)
        assert await backend.put([obj("c", c)]) == [PutStatus.STORED]
    assert allocations == 0  # a's buffer, recycled
    out_a, out_b, out_c = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(c)
    got = await backend.get([obj("a", out_a), obj("b", out_b), obj("c", out_c)])
    assert got == [GetStatus.MISS, GetStatus.HIT, GetStatus.HIT]
    assert torch.equal(out_b, b) and torch.equal(out_c, c)
    assert backend.stats().evictions == 1 and backend.stats().used_bytes == 2 * 4096


async def test_a_put_of_a_present_key_into_a_full_store_is_a_use_and_evicts_nothing() -> None:
    """The store is full: putting a key it holds reports PRESENT, makes room for nothing (no
    object is evicted for it) and counts as a use, so the next put evicts the other object."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * 4096))
    a, b, c = data("a", 4096), data("b", 4096), data("c", 4096)
    assert await backend.put([obj("a", a), obj("b", b)]) == [PutStatus.STORED] * 2
    assert await backend.put([obj("a", a)]) == [PutStatus.PRESENT]
    assert backend.stats().evictions == 0 and backend.stored_keys() == ["b", "a"]
    assert await backend.put([obj("c", c)]) == [PutStatus.STORED]
    assert backend.stored_keys() == ["a", "c"]  # b was the least recently used


@pytest.mark.parametrize("size", [100, 1 << 20, 3 << 20], ids=["one run", "runs of four", "a run per object"])
async def test_a_put_larger_than_the_store_keeps_its_first_objects(size: int) -> None:
    """A put of six objects into a store with room for four, two of them held by older keys: the
    older keys go, the put's first four objects are stored whole and its last two answer NO_SPACE.
    A put never evicts what it stored itself: its first objects are a prompt's head, the blocks a
    lookup reaches, and evicting them for its tail would leave nothing of the prompt usable."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=4 * size))
    old = {key: data(key, size) for key in "xy"}
    assert await backend.put([obj(k, t) for k, t in old.items()]) == [PutStatus.STORED] * 2
    new = {f"p{i}": data(f"p{i}", size) for i in range(6)}
    results = await backend.put([obj(k, t) for k, t in new.items()])
    assert results == [PutStatus.STORED] * 4 + [PutStatus.NO_SPACE] * 2
    assert await backend.exists([*old, *new]) == [False, False] + [True] * 4 + [False] * 2
    outs = {key: torch.zeros(size, dtype=torch.uint8) for key in list(new)[:4]}
    assert await backend.get([obj(k, out) for k, out in outs.items()]) == [GetStatus.HIT] * 4
    assert all(torch.equal(out, new[k]) for k, out in outs.items())
    stats = backend.stats()
    assert (stats.used_bytes, stats.evictions, stats.no_space) == (4 * size, 2, 2)


async def test_a_put_never_evicts_a_key_it_found_present() -> None:
    """A full store, and a put of a key it holds and four new ones: room is made from the other
    key only; the key found present stays (a prompt's head, which a longer prompt shares), and
    the new object that no longer fits answers NO_SPACE."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=4 * 100))
    one = torch.zeros(100, dtype=torch.uint8)
    for key in "xy":
        assert await backend.put([obj(key, one)]) == [PutStatus.STORED]
    results = await backend.put([obj(key, one) for key in ("y", "a", "b", "c", "d")])
    assert results == [PutStatus.PRESENT] + [PutStatus.STORED] * 3 + [PutStatus.NO_SPACE]
    assert await backend.exists(["x", "y", "a", "b", "c", "d"]) == [False] + [True] * 4 + [False]


async def test_a_put_evicts_nothing_for_an_object_that_would_not_fit_anyway() -> None:
    """Room for four units, one held by another key; a put of three units and then one of two:
    the three fit beside the other key and the last cannot fit even if it went, so it answers
    NO_SPACE and the other key stays (it is not evicted for nothing)."""
    unit = 100
    backend = MemoryBackend(MemoryConfig(capacity_bytes=4 * unit))
    one, two = torch.zeros(unit, dtype=torch.uint8), torch.zeros(2 * unit, dtype=torch.uint8)
    assert await backend.put([obj("o", one)]) == [PutStatus.STORED]
    results = await backend.put([obj("a", one), obj("b", one), obj("c", one), obj("d", two)])
    assert results == [PutStatus.STORED] * 3 + [PutStatus.NO_SPACE]
    assert await backend.exists(list("oabcd")) == [True] * 4 + [False]
    stats = backend.stats()
    assert (stats.used_bytes, stats.evictions) == (4 * unit, 0)


async def test_a_put_makes_room_from_keys_a_get_used_after_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full store of x and o; a put of x (present) and z, objects too large to copy whole,
    between which the loop runs: a get that reads o there makes o newer than x (done here as the
    get does it, :meth:`MemoryBackend._found`, at the moment the put turns to z). The put still
    makes room from o, not from x, which it found present, and does not refuse z while o can go."""
    size = pacing.whole_bytes() + 4096
    backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * size))
    tensors = {key: data(key, size) for key in "xoz"}
    for key in "xo":
        assert await backend.put([obj(key, tensors[key])]) == [PutStatus.STORED]
    room = MemoryBackend._room

    read: list[str] = []

    def o_read_first(self: MemoryBackend, key: str, nbytes: int, call: int) -> object:
        if key == "z":
            assert self.stored_keys() == ["o", "x"]  # x found present: the newest
            assert not isinstance(self._found("o", size), GetStatus)  # a get of o, here
            read.append("o")
        return room(self, key, nbytes, call)

    monkeypatch.setattr(MemoryBackend, "_room", o_read_first)
    assert await backend.put([obj(k, tensors[k]) for k in "xz"]) == [PutStatus.PRESENT, PutStatus.STORED]
    assert read == ["o"]  # (the put did turn to z through _room, the get between them ran)
    assert await backend.exists(list("xoz")) == [True, False, True]
    out = torch.zeros(size, dtype=torch.uint8)
    assert await backend.get([obj("x", out)]) == [GetStatus.HIT] and torch.equal(out, tensors["x"])


async def test_a_key_repeated_in_a_put_takes_the_room_of_one_copy() -> None:
    """A key three times in one put reserves room for its first copy only: into a store with
    room for three, the key after it fits (it was refused for room the repeats held); into a
    full store, one object is evicted for each object stored, not one per copy."""
    one = torch.zeros(100, dtype=torch.uint8)
    backend = MemoryBackend(MemoryConfig(capacity_bytes=3 * 100))
    results = await backend.put([obj(key, one) for key in "aaab"])
    assert results == [PutStatus.STORED] + [PutStatus.PRESENT] * 2 + [PutStatus.STORED]
    assert await backend.exists(["a", "b"]) == [True, True] and backend.stats().used_bytes == 200

    full = MemoryBackend(MemoryConfig(capacity_bytes=4 * 100))
    assert await full.put([obj(key, one) for key in ("o1", "o2", "o3", "o4")]) == [PutStatus.STORED] * 4
    assert await full.put([obj(key, one) for key in "aaab"]) == [PutStatus.STORED] + [
        PutStatus.PRESENT
    ] * 2 + [PutStatus.STORED]
    assert full.stats().evictions == 2 and full.stats().used_bytes == 400
    # a call's first object its newest: o4 and o3 were the least recently used
    assert await full.exists(["o1", "o2", "o3", "o4", "a", "b"]) == [True, True, False, False, True, True]


async def test_the_same_key_twice_in_one_put_is_stored_once_and_counted_once() -> None:
    """Both copies are reserved and copied in one run; the second to publish finds the first and
    reports PRESENT, and its reservation is given back: the store counts one object's bytes."""
    backend = MemoryBackend(MemoryConfig(capacity_bytes=MiB))
    a, b = data("a", 4096), data("b", 1024)
    assert await backend.put([obj("a", a), obj("b", b), obj("a", a)]) == [
        PutStatus.STORED,
        PutStatus.STORED,
        PutStatus.PRESENT,
    ]
    assert backend.stats().used_bytes == 4096 + 1024
    assert backend.stats().puts == 2 and backend.stats().present == 1


async def test_objects_of_mixed_sizes_round_trip_whatever_runs_they_fall_in() -> None:
    """Objects go in runs of up to RUN_BYTES, an object starting too large to copy whole
    (:func:`pacing.whole_bytes`) alone with checkpoints: every object of a mixed batch is put and
    got, none skipped."""
    whole = pacing.whole_bytes()
    sizes = [4096, whole + 3, 4096, whole // 2 + 1, whole, 8, whole // 2, 2 * whole + 1, 4096]
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    backend = MemoryBackend()
    stored = await backend.put([obj(f"m{i}", t) for i, t in enumerate(sources)])
    got = await backend.get([obj(f"m{i}", t) for i, t in enumerate(targets)])
    assert stored == [PutStatus.STORED] * len(sizes) and got == [GetStatus.HIT] * len(sizes)
    assert all(torch.equal(s, t) for s, t in zip(sources, targets))
    assert backend.stats().put_bytes == backend.stats().hit_bytes == sum(sizes)


async def test_an_object_too_large_to_copy_whole_is_put_and_got_streamed_a_piece_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An object too large to copy whole is copied a piece at a time (the loop runs between pieces),
    each piece, in and out, by one call of the compiled copy loop with streaming stores, as a run
    of smaller objects is (before: a `memmove` per region piece, at about 0.6x the streamed copy's
    speed out of the caches for a put, 0.7-0.8x for a get). Regions of odd sizes cross the pieces'
    borders; the object round-trips."""
    calls: list[tuple[int, bool, bool]] = []  # (bytes, into the regions, streamed)
    real = memory.regions.copy_ragged

    def recorded(starts, counts, addrs, sizes, *, into_regions, stream=False):  # type: ignore[no-untyped-def]
        calls.append((int(np.asarray(sizes).sum()), into_regions, stream))
        real(starts, counts, addrs, sizes, into_regions=into_regions, stream=stream)

    monkeypatch.setattr(memory.regions, "copy_ragged", recorded)
    piece = pacing.whole_bytes()
    sizes = [piece // 3 + 5, piece + 17, 7, piece - 1]  # 2 pieces and a bit
    pieces = [piece, piece, sum(sizes) - 2 * piece]
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    backend = MemoryBackend()
    assert await backend.put([obj("big", *sources)]) == [PutStatus.STORED]
    assert calls == [(n, False, True) for n in pieces]
    calls.clear()
    assert await backend.get([obj("big", *targets)]) == [GetStatus.HIT]
    assert calls == [(n, True, True) for n in pieces]
    assert all(torch.equal(s, t) for s, t in zip(sources, targets))


@pytest.mark.parametrize("nbytes", [3 * pacing.whole_bytes() - 1, 3 * pacing.whole_bytes() + 1])
async def test_an_object_too_large_to_copy_whole_whose_sizes_disagree_with_its_bytes_is_refused(
    nbytes: int,
) -> None:
    """As a run of smaller objects is: a put would publish part of a buffer unwritten (an evicted
    object's bytes) or write past it, a get read into memory the caller did not give."""
    source = torch.randint(0, 255, (3 * pacing.whole_bytes(),), dtype=torch.uint8)
    bad = ObjectRef("big", [source.data_ptr()], [source.numel()], nbytes)
    backend = MemoryBackend()
    with pytest.raises(ValueError, match="do not agree"):
        await backend.put([bad])
    assert backend.stats().used_bytes == 0 and await backend.exists(["big"]) == [False]
    assert await backend.put([obj("big", source)]) == [PutStatus.STORED]
    with pytest.raises(ValueError, match="do not agree"):
        await backend.get([bad])
