from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import attrs
import numpy as np
import pytest
import torch

from kvflow import (
    ConfigError,
    GetStatus,
    KVLayout,
    KVPool,
    KVRequest,
    LayoutError,
    MemoryBackend,
    ParallelConfig,
    PoolClosedError,
    PoolConfig,
    PutStatus,
    RequestError,
    SyncPool,
)
from kvflow.backends import ObjectRef
from kvflow.backends.arena import ArenaBackend
from kvflow.backends.base import BackendCapabilities
from kvflow.errors import BackendUnavailableError
from kvflow.events import CpuEvent, LayerEvents
from kvflow.keys import decode_key, hash_blocks
from kvflow.ownership import owner
from kvflow.profiles import is_book_key
from tests.helpers import (
    BLOCK,
    LAYOUTS,
    NUM_BLOCKS,
    FaultyBackend,
    block_bytes,
    bounded_shm,
    kv_keys,
    kv_puts,
    open_fds,
    zeros_like_caches,
)

TOKENS = list(range(1000, 1000 + BLOCK * 8 + 5))  # 8 full blocks and a partial one


def make_pool(caches: dict[str, object], backend: object = None, **parallel: object) -> KVPool:
    layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
    return KVPool.create(
        PoolConfig(timeout_s=2.0),
        layout=layout,
        backend=backend or MemoryBackend(),  # type: ignore[arg-type]
        parallel=ParallelConfig(**parallel),  # type: ignore[arg-type]
    )


async def test_round_trip_of_every_layout_is_bit_exact(layout_name: str) -> None:
    src = LAYOUTS[layout_name]()
    dst = zeros_like_caches(src)
    backend = MemoryBackend()
    a, b = make_pool(src, backend), make_pool(dst, backend)
    stored = await a.store(KVRequest(block_ids=[3, 1, 4, 0, 5, 9, 2, 6], tokens=TOKENS))
    assert stored.stored == 8 and stored.ok
    result = await b.retrieve(KVRequest(block_ids=[10, 11, 7, 8, 0, 1, 2, 3], tokens=TOKENS))
    assert result.hit_blocks == 8 and result.failed_block_ids == ()
    for s, d in zip([3, 1, 4, 0, 5, 9, 2, 6], [10, 11, 7, 8, 0, 1, 2, 3]):
        for name in src:
            assert block_bytes(dst[name], d) == block_bytes(src[name], s)


async def test_store_skips_present_keys_and_lookup_counts_leading_blocks() -> None:
    pool = make_pool(LAYOUTS["vllm_cpu"]())
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 0
    first = await pool.store(KVRequest(block_ids=[0, 1, 2], tokens=TOKENS))
    assert first.stored == 3
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 3 * BLOCK
    again = await pool.store(KVRequest(block_ids=list(range(8)), tokens=TOKENS))
    assert again.statuses[:3] == (PutStatus.PRESENT,) * 3 and again.stored == 5
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 8 * BLOCK
    assert await pool.lookup(KVRequest(tokens=TOKENS[: BLOCK - 1])) == 0
    # a different suffix shares only the prefix blocks
    other = TOKENS[: 2 * BLOCK] + [7] * (3 * BLOCK)
    assert await pool.lookup(KVRequest(tokens=other)) == 2 * BLOCK


async def test_block_offset_stores_the_tail_of_a_request() -> None:
    src = LAYOUTS["mla"]()
    backend = MemoryBackend()
    pool = make_pool(src, backend)
    await pool.store(KVRequest(block_ids=[0, 1], tokens=TOKENS))
    result = await pool.store(KVRequest(block_ids=[5, 6], tokens=TOKENS, block_offset=2))
    assert result.stored == 2
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 4 * BLOCK
    dst = zeros_like_caches(src)
    got = await make_pool(dst, backend).retrieve(KVRequest(block_ids=[0, 1], tokens=TOKENS, block_offset=2))
    assert got.hit_blocks == 2
    assert block_bytes(dst["l0"], 1) == block_bytes(src["l0"], 6)


async def test_mla_ranks_store_only_owned_blocks_and_load_everything() -> None:
    backend = MemoryBackend()
    srcs = [LAYOUTS["mla"]() for _ in range(2)]
    # identical KV on both ranks, as MLA guarantees
    srcs[1] = {k: v.clone() for k, v in srcs[0].items()}  # type: ignore[attr-defined]
    pools = [make_pool(srcs[r], backend, tp_rank=r, tp_size=2, use_mla=True) for r in range(2)]
    results = [await p.store(KVRequest(block_ids=list(range(8)), tokens=TOKENS)) for p in pools]
    for rank, result in enumerate(results):
        for i, status in enumerate(result.statuses):
            expect_mine = owner(i, pools[rank].parallel) == rank
            assert (status is PutStatus.STORED) == expect_mine
            assert (status is None) == (not expect_mine)
    assert kv_puts(backend) == 8
    assert len(kv_keys(backend)) == 8
    assert {decode_key(k).scope.heads for k in kv_keys(backend)} == {(0, 1)}
    for rank in range(2):
        dst = zeros_like_caches(srcs[0])
        got = await make_pool(dst, backend, tp_rank=rank, tp_size=2, use_mla=True).retrieve(
            KVRequest(block_ids=list(range(8)), tokens=TOKENS)
        )
        assert got.hit_blocks == 8
        assert all(block_bytes(dst["l1"], i) == block_bytes(srcs[0]["l1"], i) for i in range(8))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_mla_caches_split_over_ranks_need_use_mla(tp_size: int) -> None:
    """MLA caches over two ranks or more, without use_mla: refused, with the fix (every rank
    would otherwise store its own copy of the same KV)."""
    with pytest.raises(ConfigError, match="set use_mla=True"):
        make_pool(LAYOUTS["mla"](), tp_rank=0, tp_size=tp_size, num_kv_heads=1)


async def test_lookup_is_the_minimum_over_head_ranks_and_pp_ranks() -> None:
    backend = MemoryBackend()
    # GQA: 4 KV heads over tp=2 (no replication), pp=2: four namespaces
    pools = {
        (tp, pp): make_pool(
            LAYOUTS["kv_tuple"](), backend, tp_rank=tp, tp_size=2, num_kv_heads=4, pp_rank=pp, pp_size=2
        )
        for tp in range(2)
        for pp in range(2)
    }
    stored_blocks = {(0, 0): 8, (1, 0): 6, (0, 1): 5, (1, 1): 7}
    for who, n in stored_blocks.items():
        await pools[who].store(KVRequest(block_ids=list(range(n)), tokens=TOKENS))
    # any rank (and a scheduler-side pool without a layout) sees the minimum
    for pool in pools.values():
        assert await pool.lookup(KVRequest(tokens=TOKENS)) == 5 * BLOCK
    sched = KVPool.create(
        PoolConfig(), backend=backend, format=pools[0, 0].format, parallel=ParallelConfig(0, 2, 4, pp_size=2)
    )
    assert await sched.lookup(KVRequest(tokens=TOKENS)) == 5 * BLOCK
    with pytest.raises(Exception, match="no registered KV caches"):
        await sched.store(KVRequest(block_ids=[0], tokens=TOKENS))


async def test_retrieve_reports_missing_blocks_as_failed_ids() -> None:
    src = LAYOUTS["flash_attn"]()
    backend = MemoryBackend()
    await make_pool(src, backend).store(KVRequest(block_ids=[0, 1, 2], tokens=TOKENS))
    dst = zeros_like_caches(src)
    got = await make_pool(dst, backend).retrieve(KVRequest(block_ids=[5, 6, 7, 8], tokens=TOKENS))
    assert got.statuses == (GetStatus.HIT,) * 3 + (GetStatus.MISS,)
    assert got.failed_block_ids == (8,) and got.hit_tokens == 3 * BLOCK
    assert block_bytes(dst["l0"], 8) == bytes(len(block_bytes(dst["l0"], 8)))  # untouched


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_ids": [0, 1], "tokens": TOKENS[:BLOCK]}, "full blocks"),
        ({"block_ids": [NUM_BLOCKS], "tokens": TOKENS}, "out of range"),
        ({"block_ids": [0], "tokens": TOKENS, "block_hashes": [b"x"]}, "block hashes"),
        ({"block_ids": [0], "block_hashes": ["not-bytes"]}, "non-empty bytes"),
        ({"block_ids": [0]}, "tokens or block_hashes"),
        ({"block_ids": [0], "tokens": TOKENS, "block_offset": -1}, "block_offset must be >= 0"),
        ({"block_ids": [5, 5, 5], "tokens": TOKENS}, r"\[5\] appear more than once"),
        ({"block_ids": [0, True], "tokens": TOKENS}, "must be an integer"),
        ({"block_ids": [0.5], "tokens": TOKENS}, "must be an integer"),
    ],
)
async def test_bad_requests_fail_before_anything_is_written(kwargs: dict[str, object], message: str) -> None:
    backend = MemoryBackend()
    pool = make_pool(LAYOUTS["vllm_cpu"](), backend)
    with pytest.raises(RequestError, match=message):
        await pool.store(KVRequest(**kwargs))  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=message):
        await pool.retrieve(KVRequest(**kwargs))  # type: ignore[arg-type]
    assert kv_keys(backend) == []


async def test_numpy_integer_block_ids_are_accepted() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    stored = await make_pool(src, backend).store(KVRequest(block_ids=np.arange(3), tokens=TOKENS))
    assert stored.stored == 3
    dst = zeros_like_caches(src)
    ids = [np.int32(5), np.int64(6), np.int16(7)]
    got = await make_pool(dst, backend).retrieve(KVRequest(block_ids=ids, tokens=TOKENS))
    assert got.block_ids == (5, 6, 7) and got.hit_blocks == 3
    assert block_bytes(dst["l0"], 6) == block_bytes(src["l0"], 1)


async def test_engine_hashes_are_used_as_given() -> None:
    backend = MemoryBackend()
    pool = make_pool(LAYOUTS["vllm_cpu"](), backend)
    engine_hashes = [bytes([i]) * 32 for i in range(4)]
    await pool.store(KVRequest(block_ids=[0, 1, 2, 3], block_hashes=engine_hashes))
    assert {decode_key(k).block_hash for k in kv_keys(backend)} == set(engine_hashes)
    assert await pool.lookup(KVRequest(block_hashes=engine_hashes)) == 4 * BLOCK
    assert await pool.lookup(KVRequest(tokens=list(range(4 * BLOCK)))) == 0


@pytest.mark.parametrize("fault", ["raise", "hang"])
async def test_backend_faults_become_results_within_the_timeout(fault: str) -> None:
    src = LAYOUTS["vllm_cpu"]()
    inner = MemoryBackend()
    await make_pool(src, inner).store(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS))
    faulty = FaultyBackend(inner)
    ops = {"put", "get", "exists"}
    setattr(faulty, f"{fault}_on", ops)
    pool = KVPool.create(PoolConfig(timeout_s=0.3), layout=KVLayout.from_kv_caches(src), backend=faulty)  # type: ignore[arg-type]
    start = time.monotonic()
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 0
    stored = await pool.store(KVRequest(block_ids=[4, 5, 6, 7, 8], tokens=TOKENS))
    assert stored.failed_indices == (0, 1, 2, 3, 4)
    got = await pool.retrieve(KVRequest(block_ids=[0, 1, 2], tokens=TOKENS))
    assert got.failed_block_ids == (0, 1, 2)
    assert time.monotonic() - start < 3.0  # three bounded calls of 0.3 s (+ exists inside store)
    assert kv_puts(inner) == 4  # nothing was written by the faulty pool


async def test_aclose_waits_for_inflight_stores_and_then_refuses() -> None:
    src = LAYOUTS["vllm_cpu"]()
    release = anyio.Event()

    async def gated_put(objects: object) -> None:
        await release.wait()

    slow = FaultyBackend(put_hook=gated_put)
    pool = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(src), backend=slow)  # type: ignore[arg-type]
    results = []
    async with anyio.create_task_group() as tg:

        async def store() -> None:
            results.append(await pool.store(KVRequest(block_ids=[0, 1], tokens=TOKENS)))

        tg.start_soon(store)
        await anyio.sleep(0.05)

        async def close() -> None:
            assert await pool.aclose() is True  # every call ended, the backend closed
            results.append("closed")

        tg.start_soon(close)
        await anyio.sleep(0.05)
        assert results == []  # aclose is waiting for the store
        release.set()
    assert results[0].stored == 2 and results[1] == "closed"  # type: ignore[union-attr]
    with pytest.raises(PoolClosedError):
        await pool.lookup(KVRequest(tokens=TOKENS))


async def test_aclose_waits_for_every_call_in_flight_not_just_the_first_to_end() -> None:
    """Two stores in flight: the first ends, the second still runs; the backend closes only after
    the second ended, and aclose returns then (not at its timeout)."""
    src = LAYOUTS["vllm_cpu"]()
    gates = [anyio.Event(), anyio.Event()]
    log: list[str] = []
    started: list[int] = []

    async def gated_put(objects: Sequence[ObjectRef]) -> None:
        which = len(started)  # the first put to start waits on the first gate
        started.append(which)
        await gates[which].wait()
        log.append(f"put {which} ends")

    @attrs.define
    class Recording(FaultyBackend):
        async def aclose(self) -> None:
            await anyio.sleep(0.01)  # a real close takes a moment: it must get it
            log.append("backend closed")
            await super().aclose()

    backend = Recording(put_hook=gated_put)
    pool = KVPool.create(PoolConfig(timeout_s=60.0), layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    requests = [
        KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]),
        KVRequest(block_ids=[1], tokens=[7, *TOKENS[1:BLOCK]]),
    ]
    with anyio.fail_after(10):  # only a hang trips this: aclose's own timeout is 60 s
        async with anyio.create_task_group() as tg:
            for r in requests:
                tg.start_soon(pool.store, r)
            while backend.calls.count("put") < 2:
                await anyio.sleep(0.001)
            tg.start_soon(pool.aclose)
            await anyio.sleep(0.02)
            gates[0].set()
            while "put 0 ends" not in log:
                await anyio.sleep(0.001)
            await anyio.sleep(0.02)
            assert "backend closed" not in log  # the second store is still running
            gates[1].set()
    assert log == ["put 0 ends", "put 1 ends", "backend closed"]


async def test_aclose_abandons_a_backend_that_does_not_close_within_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @attrs.define
    class Stuck(FaultyBackend):
        async def aclose(self) -> None:
            await anyio.sleep_forever()

    pool = KVPool.create(
        PoolConfig(timeout_s=60.0, model="mla"),
        layout=KVLayout.from_kv_caches(LAYOUTS["mla"]()),
        backend=Stuck(),
    )  # type: ignore[arg-type]
    with anyio.fail_after(10), caplog.at_level("WARNING", logger="kvflow"):
        assert await pool.aclose(timeout_s=0.1) is False  # its own timeout, not the pool's 60 s
    assert [r.getMessage() for r in caplog.records] == [
        "the backend did not close within 0.1 s; call KVPool.aclose again to retry once no call runs "
        "(SyncPool.close leaves it open)"
    ]
    with pytest.raises(PoolClosedError, match=r"^this pool was closed; create a new one$"):
        await pool.store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]))


async def test_a_lookup_whose_exists_fails_still_counts_the_blocks_before_the_offset() -> None:
    failing = FaultyBackend(raise_on={"exists"})
    pool = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(LAYOUTS["mla"]()), backend=failing)  # type: ignore[arg-type]
    assert await pool.lookup(KVRequest(tokens=TOKENS, block_offset=2)) == 2 * BLOCK  # as whole tokens


async def test_aclose_gives_up_on_a_call_that_never_ends() -> None:
    hung = FaultyBackend(hang_on={"put"})
    pool = KVPool.create(
        PoolConfig(timeout_s=60.0), layout=KVLayout.from_kv_caches(LAYOUTS["mla"]()), backend=hung
    )  # type: ignore[arg-type]
    ended: list[str] = []

    async def store() -> None:
        try:
            await pool.store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]))
        finally:
            ended.append("store")

    with anyio.fail_after(10):  # only a hang trips this
        async with anyio.create_task_group() as tg:
            tg.start_soon(store)
            while "put" not in hung.calls:
                await anyio.sleep(0.001)
            # the put never ends: aclose waits 0.1 s, not forever, and says a call may still run
            assert await pool.aclose(timeout_s=0.1) is False
            assert ended == []  # aclose gave up on the store; it did not wait for it to be cancelled
            assert await pool.aclose() is False  # a second close: the store still runs
            tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("tp_rank", "count", "order"),
    [(0, 5, [0, 1, 2, 3, 4]), (2, 5, [2, 3, 4, 0, 1]), (3, 2, [1, 0]), (1, 0, [])],
)
def test_each_rank_loads_in_its_own_rotation_of_the_blocks(
    tp_rank: int, count: int, order: list[int]
) -> None:
    # a store whose calls run at once (a network store): the ranks start at different blocks ...
    pool = make_pool(LAYOUTS["mla"](), FaultyBackend(), tp_rank=tp_rank, tp_size=4, use_mla=True)
    assert pool._transfer.load_order(count) == order
    # ... an in-process one, whose calls go in turn: every rank reads from the head, which its
    # get makes the most recent use (a rotated get would leave block 0 the oldest)
    pool = make_pool(LAYOUTS["mla"](), MemoryBackend(), tp_rank=tp_rank, tp_size=4, use_mla=True)
    assert pool._transfer.load_order(count) == list(range(count))


async def test_a_backend_that_pins_memory_gets_every_staging_chunk_registered() -> None:
    registered: list[tuple[int, int]] = []

    @attrs.define(eq=False)
    class Pinning(FaultyBackend):
        @property
        def capabilities(self) -> BackendCapabilities:
            return attrs.evolve(self.inner.capabilities, registers_memory=True)

        def register_memory(self, addr: int, nbytes: int) -> None:
            registered.append((addr, nbytes))

    src = LAYOUTS["vllm_cpu"]()
    pool = KVPool.create(
        PoolConfig(staging="always", staging_bytes=4 * 4096),
        layout=KVLayout.from_kv_caches(src),
        backend=Pinning(),
    )  # type: ignore[arg-type]
    staging = pool._transfer.staging
    assert staging is not None
    chunks = {(b.data_ptr(), b.numel()) for b in staging._free}
    assert chunks and chunks <= set(registered)
    assert (await pool.store(KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK]))).stored == 2


async def test_inflight_bytes_stay_within_the_budget() -> None:
    src = {"l0": torch.randn(64, 2, BLOCK, 8)}
    layout = KVLayout.from_kv_caches(src)
    peak = 0
    current = 0

    async def tracking_put(objects: Sequence[ObjectRef]) -> None:
        nonlocal peak, current
        current += sum(o.nbytes for o in objects)
        peak = max(peak, current)
        await anyio.sleep(0.01)
        current -= sum(o.nbytes for o in objects)

    budget = 4 * layout.block_nbytes
    pool = KVPool.create(
        PoolConfig(max_inflight_bytes=budget), layout=layout, backend=FaultyBackend(put_hook=tracking_put)
    )  # type: ignore[arg-type]
    tokens = list(range(BLOCK * 40))
    result = await pool.store(KVRequest(block_ids=list(range(40)), tokens=tokens))
    assert result.stored == 40
    assert 0 < peak <= budget


async def test_lookup_from_a_block_offset_counts_engine_held_blocks_as_present() -> None:
    pool = make_pool(LAYOUTS["vllm_cpu"]())
    await pool.store(KVRequest(block_ids=[2, 3, 4], tokens=TOKENS, block_offset=2))  # blocks 0, 1 not stored
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 0
    assert await pool.lookup(KVRequest(tokens=TOKENS, block_offset=2)) == 5 * BLOCK
    assert await pool.lookup(KVRequest(tokens=TOKENS, block_offset=8)) == 8 * BLOCK
    with pytest.raises(RequestError, match="block_offset"):
        await pool.lookup(KVRequest(tokens=TOKENS, block_offset=9))


async def test_programming_errors_of_a_backend_are_raised_not_taken_for_misses() -> None:
    from kvflow.errors import BackendError

    class Misconfigured(FaultyBackend):
        async def exists(self, keys: Sequence[str]) -> list[bool]:
            raise BackendError("the backend was set up with a wrong segment size")

    pool = make_pool(LAYOUTS["vllm_cpu"](), Misconfigured())
    with pytest.raises(BackendError, match="segment size"):
        await pool.lookup(KVRequest(tokens=TOKENS))


def test_pools_are_made_only_through_their_named_constructors() -> None:
    from kvflow import SyncPool

    pool = make_pool(LAYOUTS["vllm_cpu"]())
    with pytest.raises(TypeError, match=r"KVPool\.create"):
        KVPool(_transfer=pool._transfer, _token=object())  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"SyncPool\.open"):
        SyncPool(_loop=None, _pool=pool, _token=object())  # type: ignore[call-arg, arg-type]


async def test_remove_deletes_this_ranks_objects_from_the_offset_on() -> None:
    backend = MemoryBackend()
    pool = make_pool(LAYOUTS["vllm_cpu"](), backend)
    await pool.store(KVRequest(block_ids=range(8), tokens=TOKENS))
    assert await pool.remove(KVRequest(tokens=TOKENS, block_offset=5)) == 3
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 5 * BLOCK
    assert await pool.remove(KVRequest(tokens=TOKENS, block_offset=5)) == 0  # nothing left there
    assert await pool.remove(KVRequest(tokens=TOKENS)) == 5 and kv_keys(backend) == []
    assert await pool.remove(KVRequest(tokens=TOKENS, block_offset=8)) == 0  # past the prompt: no call


async def test_remove_of_a_layerwise_pool_deletes_every_layers_objects() -> None:
    backend = MemoryBackend()
    caches = LAYOUTS["vllm_cpu"]()
    pool = KVPool.create(
        PoolConfig(timeout_s=2.0, layerwise=True), layout=KVLayout.from_kv_caches(caches), backend=backend
    )
    await pool.store(KVRequest(block_ids=range(8), tokens=TOKENS))
    per_block = len(caches)  # one object per layer
    assert len(kv_keys(backend)) == 8 * per_block
    assert await pool.remove(KVRequest(tokens=TOKENS, block_offset=6)) == 2 * per_block
    assert len(kv_keys(backend)) == 6 * per_block


async def test_remove_past_its_deadline_raises_rather_than_waiting() -> None:
    class Slow(MemoryBackend):
        async def remove(self, keys: Sequence[str]) -> list[bool]:
            await anyio.sleep(30)
            return await super().remove(keys)

    pool = make_pool(LAYOUTS["vllm_cpu"](), Slow())
    await pool.store(KVRequest(block_ids=range(8), tokens=TOKENS))
    with anyio.fail_after(10), pytest.raises(TimeoutError, match="did not end by the call's deadline"):
        await pool.remove(KVRequest(tokens=TOKENS), timeout_s=0.2)


async def test_a_remove_that_fails_in_the_store_raises_a_backend_error_that_says_so() -> None:
    faulty = FaultyBackend(raise_on={"remove"})  # (a fault that is not a BackendError)
    pool = make_pool(LAYOUTS["vllm_cpu"](), faulty)
    await pool.store(KVRequest(block_ids=range(8), tokens=TOKENS))
    with pytest.raises(BackendUnavailableError, match=r"removing 8 objects failed.*injected remove"):
        await pool.remove(KVRequest(tokens=TOKENS))
    assert len(kv_keys(faulty.inner)) == 8  # nothing removed, and the pool still answers
    assert await pool.lookup(KVRequest(tokens=TOKENS)) == 8 * BLOCK


async def test_an_exists_answer_that_is_no_sequence_is_a_type_error_that_says_what_to_return() -> None:
    class NoAnswer(MemoryBackend):
        async def exists(self, keys: Sequence[str]) -> list[bool]:
            return None  # type: ignore[return-value]

    pool = make_pool(LAYOUTS["vllm_cpu"](), NoAnswer())
    with pytest.raises(TypeError, match="exists answered None: it must return a list of bools"):
        await pool.lookup(KVRequest(tokens=TOKENS))


async def test_a_block_of_several_hash_chunks_is_named_by_the_hash_at_its_last_token() -> None:
    """hash_tokens=4 in blocks of 8 tokens: block i's key carries the chain's hash after token
    8i+7, so an engine with blocks of 4 tokens (and the same hash_tokens) names the same KV alike."""
    caches = LAYOUTS["vllm_cpu"]()
    layout = KVLayout.from_kv_caches(caches)
    backend = MemoryBackend()
    pool = KVPool.create(PoolConfig(hash_tokens=layout.block_size // 2), layout=layout, backend=backend)
    tokens = list(range(3 * layout.block_size))
    await pool.store(KVRequest(block_ids=[0, 1, 2], tokens=tokens))
    fine = hash_blocks(tokens, layout.block_size // 2)
    assert {decode_key(k).block_hash for k in kv_keys(backend)} == {fine[1], fine[3], fine[5]}


# --- deadlines that have nearly passed ----------------------------------------------------------


class SlowBackend(MemoryBackend):
    """A memory backend whose exists, remove and close each take ``delay_s`` (the profile book's
    own small calls are not slowed)."""

    delay_s = 0.6
    closed_fully = False

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not all(is_book_key(k) for k in keys):
            await anyio.sleep(self.delay_s)
        return await super().exists(keys)

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        await anyio.sleep(self.delay_s)
        return await super().remove(keys)

    async def aclose(self) -> None:
        await anyio.sleep(self.delay_s)
        self.closed_fully = True
        await super().aclose()


@pytest.mark.parametrize("call", ["lookup", "remove", "aclose"])
async def test_a_store_call_slower_than_the_deadline_is_given_up_at_the_deadline(call: str) -> None:
    """The store answers 0.6 s after a call whose deadline is 0.1 s away: the call gives up at its
    deadline (a lookup then reports no hit, a remove raises TimeoutError, a close abandons the
    backend), not a moment of slack later (the answer would have come in time for that)."""
    src = LAYOUTS["vllm_cpu"]()
    backend = SlowBackend()
    pool = make_pool(src, backend)
    request = KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK])
    assert (await pool.store(request, timeout_s=5.0)).stored == 2  # (its exists-skip waits 0.6 s)
    with anyio.fail_after(10):  # a guard against a hang
        if call == "lookup":
            assert await pool.lookup(request, timeout_s=0.1) == 0
        elif call == "remove":
            with pytest.raises(TimeoutError):
                await pool.remove(request, timeout_s=0.1)
        else:
            await pool.aclose(timeout_s=0.1)
            assert not backend.closed_fully


async def test_a_second_close_begun_while_the_first_waits_answers_as_things_stand_then() -> None:
    """True promises that every call ended and the backend closed: a second close begun while
    the first waits for a call that never ends waits for the first, and says False."""
    hung = FaultyBackend(hang_on={"put"})
    pool = KVPool.create(
        PoolConfig(timeout_s=60.0), layout=KVLayout.from_kv_caches(LAYOUTS["mla"]()), backend=hung
    )  # type: ignore[arg-type]
    answers: list[tuple[str, bool]] = []

    async def close(name: str, timeout_s: float | None) -> None:
        answers.append((name, await pool.aclose(timeout_s=timeout_s)))

    with anyio.fail_after(10):  # only a hang trips this
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.store, KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]))
            while "put" not in hung.calls:
                await anyio.sleep(0.001)
            tg.start_soon(close, "first", 0.3)
            await anyio.sleep(0.05)
            await close("second", None)  # returns with the first, not at once
            tg.cancel_scope.cancel()
    assert answers == [("first", False), ("second", False)]


async def test_a_later_close_closes_the_backend_the_first_left_open_once_no_call_runs() -> None:
    """The first close spends its bound waiting for a put, and the backend's own close (a network
    client's goodbye: one wait) is cut short: False. Once the put ended, a later close closes the
    backend and says True (it answered False and left the backend open for good before)."""

    @attrs.define
    class Polite(FaultyBackend):
        said_goodbye: bool = False

        async def aclose(self) -> None:
            await anyio.sleep(0.01)
            await self.inner.aclose()
            self.said_goodbye = True

    backend, go = Polite(), anyio.Event()

    async def held(_: Sequence[ObjectRef]) -> None:
        await go.wait()

    backend.put_hook = held
    pool = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(LAYOUTS["mla"]()), backend=backend)  # type: ignore[arg-type]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.store, KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]))
            while "put" not in backend.calls:
                await anyio.sleep(0.001)
            assert await pool.aclose(timeout_s=0.1) is False
            assert not backend.said_goodbye
            go.set()
        assert await pool.aclose() is True
    assert backend.said_goodbye and pool.closed_cleanly


async def test_a_close_cancelled_from_outside_still_closes_the_backend() -> None:
    """The task closing the pool is cancelled (its engine shuts down): the close is shielded, so
    the backend is still closed, within the close's own bound."""
    backend = SlowBackend()
    backend.delay_s = 0.05
    pool = make_pool(LAYOUTS["vllm_cpu"](), backend)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pool.aclose(timeout_s=5.0)
    assert backend.closed_fully


def test_a_kvformat_given_with_the_layout_must_be_the_layouts() -> None:
    """A pool may be given its caches' KVFormat too (a scheduler's pool and a worker's built from
    one config): the same one is accepted, another refused, since the keys would not match."""
    layout = KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]())
    own = layout.format(layout.heads)
    assert KVPool.create(PoolConfig(), layout=layout, format=own, backend=MemoryBackend()) is not None
    other = KVLayout.from_kv_caches(LAYOUTS["flash_attn"]()).format(layout.heads)
    with pytest.raises(ConfigError, match="disagrees with the layout"):
        KVPool.create(PoolConfig(), layout=layout, format=other, backend=MemoryBackend())


async def test_a_rank_stores_its_owned_blocks_beside_present_ones_from_the_right_engine_blocks() -> None:
    """MLA over two ranks, engine blocks in shuffled order, some of rank 0's blocks already in
    the store: rank 0 puts only its owned blocks that are missing, each from the engine block that
    holds it (a mix-up of positions would store another block's KV under a key)."""
    backend = MemoryBackend()
    src = LAYOUTS["mla"]()
    ids = [7, 3, 5, 1, 6, 0, 2, 4]
    pool = make_pool(src, backend, tp_rank=0, tp_size=2, use_mla=True)
    first = await pool.store(KVRequest(block_ids=ids[:3], tokens=TOKENS))  # blocks 0 and 2 are rank 0's
    assert first.statuses == (PutStatus.STORED, None, PutStatus.STORED)
    again = await pool.store(KVRequest(block_ids=ids, tokens=TOKENS))
    mine = [owner(i, pool.parallel) == 0 for i in range(8)]
    assert again.statuses == tuple(
        None if not m else PutStatus.PRESENT if i < 3 else PutStatus.STORED for i, m in enumerate(mine)
    )
    dst = zeros_like_caches(src)
    reader = make_pool(dst, backend, tp_rank=0, tp_size=2, use_mla=True)
    for i in (i for i in range(8) if mine[i]):  # each owned block, read back alone into block 0
        got = await reader.retrieve(KVRequest(block_ids=[0], tokens=TOKENS, block_offset=i))
        assert got.hit_blocks == 1
        assert block_bytes(dst["l1"], 0) == block_bytes(src["l1"], ids[i]), i


@pytest.mark.parametrize(
    "config",
    [PoolConfig(), PoolConfig(layerwise=True), PoolConfig(staging="always", staging_bytes=3 * 4096)],
    ids=["whole blocks", "layerwise", "staged"],
)
async def test_many_requests_in_one_call_move_as_they_would_one_by_one(config: PoolConfig) -> None:
    """Three requests in one store call and one retrieve call (an engine step's): one already held
    in part, two sharing their first blocks (put once: the later reads PRESENT), one from a block
    offset; and a fourth, never stored, in the retrieve. Each gets its own result and its own
    bytes, and the objects go to the backend in batches across the requests."""
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend(put_checks_present=True)  # batches of at most 4 objects
    writer = KVPool.create(config, layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    shared = [5, *TOKENS[1:]]
    held = KVRequest(block_ids=[0, 1, 2], tokens=TOKENS[: 3 * BLOCK])
    assert (await writer.store(KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]))).stored == 1
    backend.calls.clear()
    requests = [
        held,
        KVRequest(block_ids=[3, 4], tokens=shared[: 2 * BLOCK]),
        KVRequest(block_ids=[5, 6, 7], tokens=shared[: 3 * BLOCK]),
        KVRequest(block_ids=[8], tokens=[9, *TOKENS[1 : 3 * BLOCK]], block_offset=2),
    ]
    stored = await writer.store_many(requests)
    P, S = PutStatus.PRESENT, PutStatus.STORED
    assert [r.statuses for r in stored] == [(P, S, S), (S, S), (P, P, S), (S,)]
    units = len(src) if config.layerwise else 1
    # 7-9 objects of each unit in batches of up to 4: fewer puts than one call per request needs
    assert backend.calls.count("put") < 4 * units
    assert await writer.store_many([]) == []

    dst = zeros_like_caches(src)
    reader = KVPool.create(config, layout=KVLayout.from_kv_caches(dst), backend=backend)  # type: ignore[arg-type]
    wanted = [
        KVRequest(block_ids=[0, 1, 2], tokens=TOKENS[: 3 * BLOCK]),
        KVRequest(block_ids=[3, 4, 5], tokens=shared[: 3 * BLOCK]),
        KVRequest(block_ids=[6], tokens=[9, *TOKENS[1 : 3 * BLOCK]], block_offset=2),
        KVRequest(block_ids=[7, 8], tokens=[8, *TOKENS[1 : 2 * BLOCK]]),  # never stored
    ]
    loaded = await reader.retrieve_many(wanted)
    assert [r.hit_blocks for r in loaded] == [3, 3, 1, 0]
    assert loaded[3].failed_block_ids == (7, 8)
    pairs = [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (7, 5), (8, 6)]
    assert all(block_bytes(dst[n], d) == block_bytes(src[n], s) for s, d in pairs for n in src)
    assert all(not dst[n][7:9].any() for n in dst)  # a miss writes nothing


@pytest.mark.parametrize("fault", ["none", "put raises", "no room"])
async def test_a_block_requests_of_one_store_share_is_put_once_and_each_reads_how_that_went(
    fault: str, tmp_path: Path
) -> None:
    """Two requests of one store name the same four blocks: each block goes to the backend once,
    and the second request's copy reads PRESENT only where the first stored it, else the first's
    failure (an arena that cannot hold them all: its NO_SPACE, not PRESENT)."""
    src = LAYOUTS["vllm_cpu"]()  # 3 KiB objects
    put_keys: list[str] = []

    async def record(objects: Sequence[ObjectRef]) -> None:
        put_keys.extend(o.key for o in objects)

    backend: object = FaultyBackend(put_hook=record, raise_on={"put"} if fault == "put raises" else set())
    if fault == "no room":  # two 4 KiB slots: two of the four blocks fit
        backend = ArenaBackend.from_url(f"arena://{tmp_path}/store?capacity=8KiB&slot=4KiB")
    pool = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    tokens = TOKENS[: 4 * BLOCK]
    first, second = await pool.store_many(
        [KVRequest(block_ids=[0, 1, 2, 3], tokens=tokens), KVRequest(block_ids=[4, 5, 6, 7], tokens=tokens)]
    )
    if fault == "none":
        assert first.statuses == (PutStatus.STORED,) * 4
    elif fault == "put raises":
        assert first.statuses == (PutStatus.FAILED,) * 4
    else:  # the profile book's announcement may take a slot too
        assert PutStatus.STORED in first.statuses and first.statuses[-1] is PutStatus.NO_SPACE
    assert second.statuses == tuple(status.repeated() for status in first.statuses)
    if fault == "none":
        assert sorted(put_keys) == sorted(set(put_keys)) and len(put_keys) == 4  # each put once
    if fault != "no room":  # (there the announcement may evict a block once the store is done)
        held = await pool.lookup(KVRequest(block_ids=[0, 1, 2, 3], tokens=tokens))
        assert held == BLOCK * first.statuses.count(PutStatus.STORED)
    await pool.aclose()


async def test_a_store_refused_before_it_starts_still_says_it_released_the_blocks() -> None:
    """``on_released`` is called once for a store refused before anything is read (a bad
    request, a bad timeout, a closed pool), as for one that ran."""
    src = LAYOUTS["vllm_cpu"]()
    pool = make_pool(src)
    released: list[str] = []
    refused = [
        ([KVRequest(block_ids=[99], tokens=TOKENS[:BLOCK])], None, RequestError),  # no such block
        ([KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK])], -1.0, ConfigError),
    ]
    for requests, timeout_s, error in refused:
        with pytest.raises(error):
            await pool.store_many(requests, on_released=lambda: released.append("x"), timeout_s=timeout_s)
    await pool.aclose()
    with pytest.raises(PoolClosedError):
        await pool.store(
            KVRequest(block_ids=[0], tokens=TOKENS[:BLOCK]), on_released=lambda: released.append("x")
        )
    assert released == ["x"] * 3


async def test_a_calls_deadline_counts_from_the_call_so_the_plans_hashing_is_inside_it() -> None:
    """A step of long prompts: hashing them takes a good part of a tenth of a second on the loop.
    A store's timeout counts from the call, that hashing included: no put starts after it."""
    backend = FaultyBackend()
    starts: list[float] = []

    async def record(objects: Sequence[ObjectRef]) -> None:
        starts.append(time.monotonic())

    backend.put_hook = record
    pool = make_pool({"l0": torch.zeros(32, 2, BLOCK, 16)}, backend)
    prompts = [list(range(k * 10**6, k * 10**6 + 60_000)) for k in range(32)]
    requests = [
        KVRequest(block_ids=[k], tokens=p, block_offset=len(p) // BLOCK - 1, request_id=str(k))
        for k, p in enumerate(prompts)
    ]
    timeout_s = 0.05
    called = time.monotonic()
    await pool.store_many(requests, timeout_s=timeout_s)
    assert [s - called for s in starts if s - called > timeout_s + 0.01] == []
    await pool.aclose()


async def test_a_load_of_several_requests_refuses_two_that_name_one_destination_block() -> None:
    """One get would write the block twice, and a failed second copy would spoil what the first
    reported loaded: a retrieve of several requests, and the layerwise retriever, refuse them
    before anything moves. A store may read one block for two requests."""
    src = LAYOUTS["vllm_cpu"]()
    pool = make_pool(src)
    first = KVRequest(block_ids=[3], tokens=TOKENS[:BLOCK])
    second = KVRequest(block_ids=[3, 6], tokens=TOKENS[: 2 * BLOCK])
    stored = await pool.store_many([first, second])
    assert [r.statuses for r in stored] == [(PutStatus.STORED,), (PutStatus.PRESENT, PutStatus.STORED)]
    dst = zeros_like_caches(src)
    reader = make_pool(dst, pool.backend)
    refused = "block id 3 is the destination of two requests of one load"
    with pytest.raises(RequestError, match=refused):
        await reader.retrieve_many([first, second])
    layerwise = KVPool.create(
        PoolConfig(layerwise=True), layout=KVLayout.from_kv_caches(dst), backend=MemoryBackend()
    )
    with pytest.raises(RequestError, match=refused):
        layerwise.layerwise_retrieve([first, second])
    assert all(not t.any() for t in dst.values())  # nothing moved
    assert [
        r.hit_blocks
        for r in await reader.retrieve_many([first, KVRequest(block_ids=[4, 6], tokens=TOKENS[: 2 * BLOCK])])
    ] == [1, 2]


async def test_a_pool_that_names_no_model_over_a_shared_store_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]())
    url = f"local://{tmp_path}/store"
    warned = []
    for config in (PoolConfig(backend=url, model="llama-3-8b"), PoolConfig(), PoolConfig(backend=url)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvflow.pool"):
            pool = KVPool.create(config, layout=layout)  # (PoolConfig(): in-process, nobody else reads it)
        await pool.aclose()
        warned.append(any("names no model" in r.getMessage() for r in caplog.records))
    assert warned == [False, False, True]


async def test_a_store_refuses_one_engine_block_named_as_two_different_prompt_blocks() -> None:
    """Two requests of one store name engine block 1 as block 1 of prompt A and as block 0 of
    prompt B. Accepted, block 1's bytes would be published under B's key too, and a reader of
    prompt B would get a HIT with A's KV. ``store_many`` and the layerwise storer refuse it with
    RequestError before anything is read (``on_released`` still called); nothing is stored."""
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend()
    puts: list[str] = []

    async def record(objects: Sequence[ObjectRef]) -> None:
        puts.extend(o.key for o in objects)

    backend.put_hook = record
    pool = make_pool(src, backend)
    prompt_b = list(range(9000, 9000 + BLOCK * 3))
    requests = [
        KVRequest(block_ids=[0, 1], tokens=TOKENS, request_id="a"),
        KVRequest(block_ids=[1], tokens=prompt_b, request_id="b"),  # engine block 1 again
    ]
    released: list[str] = []
    with pytest.raises(RequestError, match="block id 1 is named as block 1 of request 'a' and as block 0"):
        await pool.store_many(requests, on_released=lambda: released.append("x"))
    assert released == ["x"]
    layerwise = KVPool.create(
        PoolConfig(layerwise=True), layout=KVLayout.from_kv_caches(src), backend=backend
    )  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="block id 1 is named as block 1"):
        layerwise.layerwise_store(requests, LayerEvents.completed(3))
    assert puts == []
    assert await pool.lookup(KVRequest(tokens=prompt_b)) == 0
    await layerwise.aclose()
    await pool.aclose()


@pytest.mark.parametrize("face", ["KVPool", "SyncPool"])
def test_a_pool_its_config_refuses_opens_no_backend(face: str) -> None:
    """A pool that opens its backend from its config's URL checks the config against the KV
    caches first (here ``hash_tokens`` that does not divide the block size): refused, it has
    opened nothing (no store directory made, no descriptor left), however often it is retried."""
    layout = KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]())  # type: ignore[arg-type]
    with bounded_shm() as root:
        config = PoolConfig(backend=f"local://{root}/store", hash_tokens=5, timeout_s=2.0)
        _refused_without_a_trace(face, config, layout, "hash_tokens=5 must divide the block size 16")
        assert not (root / "store").exists()


def test_arguments_of_another_type_are_refused_with_what_to_give() -> None:
    """A URL where a backend or a config goes, the caches where their layout goes, a bare number
    where a backend's config goes: a TypeError that says what to give, not an AttributeError from
    deep inside."""
    caches = LAYOUTS["vllm_cpu"]()
    layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
    for call, match in [
        (
            lambda: KVPool.create(PoolConfig(), layout=layout, backend="memory://"),
            r"PoolConfig\(backend=url\)",
        ),
        (lambda: KVPool.create("memory://", layout=layout), r"PoolConfig\(backend=url\)"),
        (lambda: SyncPool.open(layout=layout, backend="memory://"), r"PoolConfig\(backend=url\)"),
        (lambda: SyncPool.open("memory://", layout=layout), r"PoolConfig\(backend=url\)"),
        (lambda: KVPool.create(PoolConfig(), layout=caches), r"layout must be a KVLayout \(make it with"),
        (
            lambda: MemoryBackend(1024),
            r"MemoryBackend is made from its config, MemoryBackend\(MemoryConfig\(...\)\), or opened by URL, kvflow.backends.open_backend\('memory://",
        ),
        (
            lambda: ArenaBackend("arena:///dev/shm/x"),
            r"ArenaBackend is made from its config, ArenaBackend\(ArenaConfig",
        ),
    ]:
        with pytest.raises(TypeError, match=match):
            call()  # type: ignore[no-untyped-call]


def _refused_without_a_trace(face: str, config: PoolConfig, layout: KVLayout, match: str) -> None:
    """Create the pool three times through ``face``: refused each time (ConfigError matching
    ``match``), leaving no descriptor open."""

    async def on_a_loop() -> None:
        KVPool.create(config, layout=layout)

    gc.collect()
    before = open_fds()
    for _ in range(3):
        with pytest.raises(ConfigError, match=match):
            if face == "KVPool":
                KVPool.create(config, layout=layout)
            elif face == "SyncPool":
                SyncPool.open(config, layout=layout)
            else:
                anyio.run(on_a_loop)
    gc.collect()
    assert open_fds() == before


@pytest.mark.parametrize("face", ["KVPool", "KVPool on a loop", "SyncPool"])
def test_a_pool_its_backend_refuses_closes_the_backend_it_opened(
    face: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What only the backend can refuse (objects larger than an arena's slots) is checked once the
    pool has opened it from its URL; refused, the pool closes that backend again (nobody else holds
    it): called outside an event loop, inside one (as from an async engine), or through SyncPool
    (on its loop thread), no descriptor is left behind."""
    layout = KVLayout.from_kv_caches({"l0": torch.zeros(4, 2, BLOCK, 256)})  # 32 KiB blocks
    with bounded_shm() as root:
        config = PoolConfig(backend=f"arena://{root}/store?capacity=64KiB&slot=4KiB", timeout_s=2.0)
        _refused_without_a_trace(face, config, layout, "objects of at most 4096 bytes")
    assert not [r for r in caplog.records if "refused pool" in r.getMessage()]  # closed, not abandoned


def test_a_pool_refused_in_a_loop_callback_closes_the_backend_it_opened() -> None:
    """The same, called from a plain callback of a running loop (no task): the backend's close,
    with no call ever run on it, needs no task either, and leaves no descriptor behind."""
    layout = KVLayout.from_kv_caches({"l0": torch.zeros(4, 2, BLOCK, 256, device="meta")})
    with bounded_shm() as root:
        config = PoolConfig(backend=f"local://{root}/store", staging="never")  # a device it cannot reach

        async def main() -> BaseException | None:
            loop = asyncio.get_running_loop()
            refused: asyncio.Future[BaseException | None] = loop.create_future()

            def callback() -> None:
                try:
                    KVPool.create(config, layout=layout)
                    refused.set_result(None)
                except Exception as exc:
                    refused.set_result(exc)

            loop.call_soon(callback)
            return await refused

        gc.collect()
        before = open_fds()
        assert isinstance(asyncio.run(main()), LayoutError)
        gc.collect()
        assert open_fds() == before


@pytest.mark.parametrize("staging", ["never", "always"])
async def test_an_after_that_is_not_a_device_event_is_refused_before_anything_moves(staging: str) -> None:
    """``after`` must be a DeviceEvent (``record()`` and ``query()``). Something else (a
    threading.Event, say) is a programming error that every call refuses at once with a TypeError
    saying what to pass: before, a retrieve took it for an event that never completed and failed
    every block (it looked like an empty store), and a store raised an AttributeError from deep
    inside its put. Nothing is read or written; a refused store still calls ``on_released``."""
    src = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    config = PoolConfig(timeout_s=2.0, staging=staging)  # type: ignore[arg-type]
    writer = KVPool.create(config, layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    request = KVRequest(block_ids=[0, 1, 2], tokens=TOKENS)
    assert (await writer.store(request)).stored == 3
    dst = zeros_like_caches(src)
    reader = KVPool.create(config, layout=KVLayout.from_kv_caches(dst), backend=backend)  # type: ignore[arg-type]
    wrong = threading.Event()
    expected = r"after= must be a kvflow DeviceEvent .* got threading.Event"
    with pytest.raises(TypeError, match=expected):
        await reader.retrieve(request, after=wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=expected):
        await reader.retrieve_many([request], after=wrong)  # type: ignore[arg-type]
    assert all(not t.any() for t in dst.values())  # nothing written
    other = KVRequest(block_ids=[3], tokens=list(range(7000, 7000 + BLOCK)))
    released: list[str] = []
    with pytest.raises(TypeError, match=expected):
        await writer.store(other, after=wrong, on_released=lambda: released.append("x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=expected):
        await writer.store_many([other], after=wrong, on_released=lambda: released.append("x"))  # type: ignore[arg-type]
    assert released == ["x", "x"]
    assert await writer.lookup(other) == 0  # nothing stored
    layerwise = KVPool.create(
        PoolConfig(layerwise=True, staging=staging),  # type: ignore[arg-type]
        layout=KVLayout.from_kv_caches(dst),
        backend=MemoryBackend(),
    )
    with pytest.raises(TypeError, match=expected):
        layerwise.layerwise_retrieve([request], after=wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"events must be a kvflow.events.LayerEvents .* got Event"):
        layerwise.layerwise_store([request], wrong)  # type: ignore[arg-type]
    done = CpuEvent()
    done.record()
    assert (await reader.retrieve(request, after=done)).hit_blocks == 3  # an event is taken as before
    for pool in (writer, reader, layerwise):
        await pool.aclose()
