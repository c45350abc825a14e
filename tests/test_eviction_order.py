"""A prompt's head outlives its tail in every in-process store, however many backend calls a
request takes: the pool makes a request's calls in turn, its last objects first (the backends'
``calls_in_turn``), so the head is always the most recent use and a put that outgrows the store
keeps the head. A block is useful only with every block before it: a store left holding a tail
without its head holds nothing a lookup can reach.

The memory backend's order is exact. The arena evicts the least recently used row of an object's
set (a few rows each) and the local store from its last scan's list, so each holds a prompt's head
to within a few blocks: at least 80% of what they hold of the prompt is its reachable head here
(before the pool made its calls in turn, none to a third)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import attrs
import pytest
import torch

from kvflow import KVLayout, KVPool, KVRequest, MemoryBackend, ParallelConfig, PoolConfig, PutStatus
from kvflow.backends import Backend, ObjectRef, open_backend
from kvflow.errors import BackendUnavailableError
from kvflow.keys import decode_key, hash_blocks
from kvflow.profiles import is_book_key
from tests.helpers import BLOCK, FaultyBackend, bounded_shm

OBJECT = 4096  # bytes of one block: 16 tokens x 64 floats
KINDS = ["memory", "arena", "local", "memory, calls of 4", "memory, staged"]


@pytest.fixture
def root() -> Iterator[Path]:
    with bounded_shm("64m") as path:
        yield path


def _backend(kind: str, root: Path, room: int) -> Backend:
    """A store of ``kind`` with room for about ``room`` blocks (the local store's files also hold a
    header and the key: a few blocks fewer); "memory, calls of 4" takes 4 objects a call."""
    if kind == "arena":
        return open_backend(f"arena://{root}/arena?capacity={room * OBJECT}&slot={OBJECT}")
    if kind == "local":
        return open_backend(f"local://{root}/local?capacity={room * OBJECT}")
    memory = MemoryBackend.from_url(f"memory://?capacity={room * OBJECT}")
    if kind == "memory, calls of 4":
        return FaultyBackend(inner=memory, calls_in_turn=True)  # type: ignore[return-value]
    return memory


def _pool(backend: Backend, blocks: int, tp_rank: int = 0, tp_size: int = 1, kind: str = "") -> KVPool:
    """A pool of MLA caches: with ``tp_size`` 2 each block is stored by one rank and read by both.
    Kind "memory, staged": through a host staging chunk of 64 blocks, a backend call each."""
    caches = {"l0": torch.randn(blocks, BLOCK, 64)}
    parallel = ParallelConfig(tp_rank=tp_rank, tp_size=tp_size, use_mla=True)
    staging = "always" if kind.endswith("staged") else "auto"
    config = PoolConfig(model="eviction-order", staging=staging, staging_bytes=64 * OBJECT)
    return KVPool.create(config, layout=KVLayout.from_kv_caches(caches), backend=backend, parallel=parallel)


async def _held(pool: KVPool, hashes: list[bytes]) -> list[int]:
    """The blocks of the prompt of ``hashes`` that the store holds, each asked alone."""
    return [
        j
        for j in range(len(hashes))
        if await pool.lookup(KVRequest(block_hashes=hashes[: j + 1], block_offset=j)) > j * BLOCK
    ]


async def _check_head_held(kind: str, pool: KVPool, hashes: list[bytes], least: int, most: int) -> None:
    """The store holds ``least``..``most`` blocks of the prompt, and what a lookup reaches of them
    (its head) is all of them (the memory backend) or at least 80%."""
    held = await _held(pool, hashes)
    head = await pool.lookup(KVRequest(block_hashes=hashes)) // BLOCK
    assert least <= len(held) <= most
    if kind.startswith("memory"):
        assert held == list(range(head))
    else:
        assert head >= 0.8 * len(held), (head, len(held))


async def _then_evict_part(kind: str, pool: KVPool, first: list[bytes], backend: Backend) -> None:
    """Another prompt of 200 blocks stored by a pool of its own (evicting part of ``first``,
    stored by ``pool``): what is left of ``first`` is its head."""
    other = _pool(backend, 200, kind=kind)
    try:
        await other.store(KVRequest(block_ids=range(200), block_hashes=_prompt(200, 10**6)))
        await _check_head_held(kind, pool, first, 50, len(first) - 1)
    finally:
        await other.aclose()


def _prompt(blocks: int, first_token: int) -> list[bytes]:
    return hash_blocks(list(range(first_token, first_token + blocks * BLOCK)), BLOCK)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_put_larger_than_the_store_keeps_the_requests_head(kind: str, root: Path) -> None:
    backend = _backend(kind, root, room=200)
    pool = _pool(backend, 600, kind=kind)
    hashes = _prompt(600, 0)
    try:
        result = await pool.store(KVRequest(block_ids=range(600), block_hashes=hashes))
        assert (
            result.statuses[0] is PutStatus.STORED
        )  # (later calls' objects may be evicted again by the head's)
        await _check_head_held(kind, pool, hashes, 100, 200)
    finally:
        await pool.aclose()
        await backend.aclose()


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
async def test_eviction_takes_a_prompt_of_several_calls_from_its_tail(
    kind: str, tp_rank: int, root: Path
) -> None:
    """Stored by both ranks of an MLA engine (each its own blocks), then read whole by one rank
    (rank 1 read from block 1 first, where its calls ran at once: it left block 0 the oldest),
    then a second prompt evicts part of the first: what is left of the first is its head."""
    backend = _backend(kind, root, room=420)
    ranks = [_pool(backend, 300, tp_rank=r, tp_size=2, kind=kind) for r in range(2)]
    first = _prompt(300, 0)
    try:
        stored = [await p.store(KVRequest(block_ids=range(300), block_hashes=first)) for p in ranks]
        assert sum(s.stored for s in stored) == 300
        with anyio.fail_after(30):
            got = await ranks[tp_rank].retrieve(KVRequest(block_ids=range(300), block_hashes=first))
        assert got.hit_blocks == 300
        await _then_evict_part(kind, ranks[0], first, backend)
    finally:
        for p in ranks:
            await p.aclose()
        await backend.aclose()


async def test_a_load_from_an_engine_split_otherwise_reads_the_head_last() -> None:
    """A reader of one rank loads what a writer of two ranks (one KV head each) stored, through
    staging chunks of 8 blocks: the head's chunk goes last, so the store's least recently used
    objects are the prompt's last blocks (before, its first chunk's)."""
    blocks, dim = 40, 4

    def caches(heads: int) -> dict[str, object]:
        return {f"layers.{n}": (torch.randn(blocks, BLOCK, heads, dim),) * 2 for n in range(2)}

    backend = MemoryBackend()
    writers = [
        KVPool.create(
            PoolConfig(model="eviction-order"),
            layout=KVLayout.from_kv_caches(caches(1)),  # type: ignore[arg-type]
            backend=backend,
            parallel=ParallelConfig(tp_rank=r, tp_size=2, num_kv_heads=2),
        )
        for r in range(2)
    ]
    writer_object = 2 * 2 * BLOCK * dim * 4  # (k, v) x 2 layers x 16 tokens x one head of 4 floats
    reader = KVPool.create(
        PoolConfig(model="eviction-order", staging_bytes=8 * 2 * writer_object),
        layout=KVLayout.from_kv_caches(caches(2)),  # type: ignore[arg-type]
        backend=backend,
        parallel=ParallelConfig(num_kv_heads=2),
    )
    hashes = _prompt(blocks, 0)
    for writer in writers:
        await writer.store(KVRequest(block_ids=range(blocks), block_hashes=hashes))
    assert (
        await reader.retrieve(KVRequest(block_ids=range(blocks), block_hashes=hashes))
    ).hit_blocks == blocks
    index = {h: j for j, h in enumerate(hashes)}
    oldest_first = [index[decode_key(k).block_hash] for k in backend.stored_keys() if not is_book_key(k)]
    # the first evicted object of each block (a block needs both), block by block: the tail first
    assert len(oldest_first) == 2 * blocks
    assert list(dict.fromkeys(oldest_first)) == list(range(blocks - 1, -1, -1))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_prompt_stored_in_chunks_ages_from_its_tail(kind: str, root: Path) -> None:
    """Saved a chunk at a time (as an engine saves a long prompt step by step, or a conversation
    turn by turn): each later chunk's store touches the blocks before it, so the head stays the
    most recent use."""
    backend = _backend(kind, root, room=420)
    pool = _pool(backend, 300, kind=kind)
    first = _prompt(300, 0)
    try:
        for start in (0, 100, 200):
            request = KVRequest(
                block_ids=range(start, start + 100), block_hashes=first[: start + 100], block_offset=start
            )
            assert (await pool.store(request)).stored == 100
        await _then_evict_part(kind, pool, first, backend)
    finally:
        await pool.aclose()
        await backend.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_load_past_the_engines_own_hit_is_ordered_by_the_requests_next_save(
    kind: str, root: Path
) -> None:
    """The engine held the prompt's first 100 blocks itself and loads the next 200, which leaves
    them newer than the store's copies of those 100 (a load touches nothing: the engine waits for
    it); the request then computes 20 blocks more and saves them, which touches all 300."""
    backend = _backend(kind, root, room=420)
    pool = _pool(backend, 320, kind=kind)
    first = _prompt(320, 0)
    try:
        assert (await pool.store(KVRequest(block_ids=range(300), block_hashes=first[:300]))).stored == 300
        rest = KVRequest(block_ids=range(100, 300), block_hashes=first[:300], block_offset=100)
        assert (await pool.retrieve(rest)).hit_blocks == 200
        saved = await pool.store(KVRequest(block_ids=range(300, 320), block_hashes=first, block_offset=300))
        assert saved.stored == 20
        await _then_evict_part(kind, pool, first, backend)
    finally:
        await pool.aclose()
        await backend.aclose()


@attrs.define(eq=False)
class _Touches(MemoryBackend):
    """A memory backend that records each touch, and fails them on demand."""

    touched: list[list[str]] = attrs.field(factory=list)
    fault: Exception | None = None

    async def touch(self, keys: Sequence[str]) -> None:
        self.touched.append(list(keys))
        if self.fault is not None:
            raise self.fault
        await super().touch(keys)


async def test_earlier_blocks_are_touched_only_while_few_against_the_chunk() -> None:
    backend = _Touches()
    pool = _pool(backend, 300)  # type: ignore[arg-type]
    hashes = _prompt(300, 0)
    await pool.store(KVRequest(block_ids=range(16), block_hashes=hashes[:16]))
    assert backend.touched == []  # nothing before the request
    await pool.store(KVRequest(block_ids=[16], block_hashes=hashes[:17], block_offset=16))
    (keys,) = backend.touched  # 16 blocks before one: touched, head first
    assert [decode_key(k).block_hash for k in keys] == hashes[:16]
    await pool.store(KVRequest(block_ids=[17], block_hashes=hashes[:18], block_offset=17))
    assert len(backend.touched) == 1  # 17 blocks before one: more than 16 times it, not touched
    # a load touches nothing (the engine waits for it; the request's next save does)
    await pool.store(KVRequest(block_ids=range(18, 40), block_hashes=hashes[:40], block_offset=18))
    assert len(backend.touched) == 2
    await pool.retrieve(KVRequest(block_ids=range(20, 40), block_hashes=hashes[:40], block_offset=20))
    assert len(backend.touched) == 2


async def test_a_touch_that_fails_leaves_the_store_as_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = _Touches(fault=BackendUnavailableError("the store is gone"))
    pool = _pool(backend, 300)  # type: ignore[arg-type]
    hashes = _prompt(20, 0)
    await pool.store(KVRequest(block_ids=range(10), block_hashes=hashes[:10]))
    stored = await pool.store(KVRequest(block_ids=range(10, 20), block_hashes=hashes, block_offset=10))
    assert stored.stored == 10 and len(backend.touched) == 1
    assert "touch() of 10 keys failed" in caplog.text
    got = await pool.retrieve(KVRequest(block_ids=range(20), block_hashes=hashes))
    assert got.hit_blocks == 20
    backend.fault = TypeError("a touch that breaks the protocol")  # a programming error reaches the caller
    await pool.remove(KVRequest(block_hashes=hashes, block_offset=10))
    with pytest.raises(TypeError, match="breaks the protocol"):
        await pool.store(KVRequest(block_ids=range(10, 20), block_hashes=hashes, block_offset=10))


@pytest.mark.parametrize("kind", ["memory", "arena", "local"])
async def test_a_touch_passes_over_keys_the_store_does_not_hold(kind: str, root: Path) -> None:
    backend = _backend(kind, root, room=8)
    try:
        await backend.touch(["kvf2@absent", "kvf2@" + "x" * 300])  # type: ignore[attr-defined]
        assert await backend.exists(["kvf2@absent"]) == [False]
    finally:
        await backend.aclose()


@pytest.mark.parametrize("kind", ["memory", "arena", "local"])
async def test_a_key_touched_twice_keeps_its_first_place(kind: str, root: Path) -> None:
    """touch([a, b, a]): ``a`` is the most recent use (the arena's row and the local file took
    their last place's time, older than ``b``'s), so a put that needs room takes ``b``."""
    backend = _backend(kind, root, room=2)
    if kind == "local":  # room for two objects of OBJECT bytes and their headers
        backend = open_backend(f"local://{root}/local2?capacity={2 * OBJECT + 1024}")
    buffers = torch.zeros(3, OBJECT, dtype=torch.uint8)
    objects = [
        ObjectRef.of(f"kvf2@{name}", [buffers[i].data_ptr()], [OBJECT]) for i, name in enumerate("abc")
    ]
    try:
        assert await backend.put(objects[:2]) == [PutStatus.STORED] * 2
        await backend.touch(["kvf2@a", "kvf2@b", "kvf2@a"])  # type: ignore[attr-defined]
        assert await backend.put(objects[2:]) == [PutStatus.STORED]
        assert await backend.exists(["kvf2@a", "kvf2@b", "kvf2@c"]) == [True, False, True]
    finally:
        await backend.aclose()


async def test_a_layerwise_store_touches_each_layers_earlier_objects_after_its_put() -> None:
    backend = _Touches()
    caches = {f"l{n}": torch.randn(40, BLOCK, 64) for n in range(3)}
    config, parallel = PoolConfig(model="eviction-order", layerwise=True), ParallelConfig(use_mla=True)
    pool = KVPool.create(config, layout=KVLayout.from_kv_caches(caches), backend=backend, parallel=parallel)
    hashes = _prompt(40, 0)
    await pool.store(KVRequest(block_ids=range(20), block_hashes=hashes[:20]))
    before = set(backend.stored_keys())
    assert (
        await pool.store(KVRequest(block_ids=range(20, 40), block_hashes=hashes, block_offset=20))
    ).stored == 20
    assert [len(keys) for keys in backend.touched] == [20, 20, 20]  # each layer's, after its put
    assert all([decode_key(k).block_hash for k in keys] == hashes[:20] for keys in backend.touched)
    assert set().union(*backend.touched) <= before and len(set().union(*backend.touched)) == 60
    assert backend.stored_keys()[-20:] == backend.touched[-1][::-1]  # the last layer's head is the newest
