"""The transfer layer's bookkeeping: results land on the right blocks, whatever the order or faults.

- A retrieve on any TP rank reads its blocks in a rotated order (``Transfer.load_order``); misses
  and failures must still be reported for the blocks they belong to, and only those.
- A request larger than the backend's batch runs several batches: one that fails or runs past the
  deadline fails its own objects, never the others'.
- A store asks which keys exist and does not put them: the pool skips them itself, even over a
  backend that would overwrite an object (never answering PRESENT).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
import anyio.lowlevel
import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import (
    GetStatus,
    KVLayout,
    KVPool,
    KVRequest,
    MemoryBackend,
    ParallelConfig,
    PoolConfig,
    PutStatus,
)
from kvflow.backends.base import ObjectRef, cancelled_as_fault
from kvflow.errors import BackendError, BackendUnavailableError, ConfigError, RequestError
from kvflow.keys import decode_key, hash_blocks
from kvflow.profiles import is_book_key
from kvflow.transfer import ByteBudget, run_batches
from kvflow.transfer.together import together, unwrapped
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, block_bytes, kv_keys, zeros_like_caches

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

R = TypeVar("R")
BLOCKS = 12
TOKENS = list(range(3000, 3000 + BLOCKS * BLOCK))


def pool(
    caches: dict[str, object],
    backend: object,
    *,
    staging: str = "never",
    layerwise: bool = False,
    timeout_s: float = 5.0,
    **parallel: object,
) -> KVPool:
    return KVPool.create(
        PoolConfig(model="m", staging=staging, layerwise=layerwise, timeout_s=timeout_s),  # type: ignore[arg-type]
        layout=KVLayout.from_kv_caches(caches),  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        parallel=ParallelConfig(**parallel),  # type: ignore[arg-type]
    )


def mla_caches(blocks: int = BLOCKS) -> dict[str, object]:
    return {f"l{i}": torch.randn(blocks, BLOCK, 12) for i in range(2)}


def gqa_caches(heads: int, blocks: int = BLOCKS) -> dict[str, object]:
    """vLLM's CPU layout: [blocks, heads, tokens, K|V of 4 columns each]."""
    return {f"l{i}": torch.randn(blocks, heads, BLOCK, 8) for i in range(2)}


def hash_of(key: str) -> bytes:
    return decode_key(key).block_hash


HASHES = hash_blocks(TOKENS, BLOCK)


def block_index(key: str) -> int:
    """Which block of TOKENS a key holds."""
    return HASHES.index(hash_of(key))


# -- misses on a rank other than 0 -------------------------------------------------------------------


async def _retrieve_with_holes(tp_rank: int, missing: set[int], staging: str, reshaped: bool) -> None:
    backend = MemoryBackend()
    if reshaped:  # a TP=1 writer of both KV heads; the reader's rank takes its head out of them
        src = gqa_caches(2)
        writer = pool(src, backend)
        reader_caches = {k: torch.zeros(BLOCKS, 1, BLOCK, 8) for k in src}
        reader_parallel: dict[str, object] = {"tp_rank": tp_rank, "tp_size": 2, "num_kv_heads": 2}
    else:  # MLA: every TP size uses the same keys; the reader is one rank of a TP=4 group
        src = mla_caches()
        writer = pool(src, backend)
        reader_caches = zeros_like_caches(src)
        reader_parallel = {"tp_rank": tp_rank, "tp_size": 4, "use_mla": True}
    src_ids = list(range(BLOCKS))
    assert (await writer.store(KVRequest(tokens=TOKENS, block_ids=src_ids))).stored == BLOCKS
    await backend.remove([k for k in kv_keys(backend) if block_index(k) in missing])
    dst_ids = [(5 * i + 3) % BLOCKS for i in range(BLOCKS)]  # a permutation: every block elsewhere
    reader = pool(reader_caches, backend, staging=staging, **reader_parallel)
    got = await reader.retrieve(KVRequest(tokens=TOKENS, block_ids=dst_ids))
    assert got.block_ids == tuple(dst_ids)
    assert [s is GetStatus.HIT for s in got.statuses] == [i not in missing for i in range(BLOCKS)]
    assert set(got.failed_block_ids) == {dst_ids[i] for i in missing}
    for i in range(BLOCKS):
        for name, entry in reader_caches.items():
            data = entry[dst_ids[i]]  # type: ignore[index]
            if i in missing:
                assert not data.any(), (i, name)  # never written
            elif reshaped:  # the rank's one head of the writer's two
                assert torch.equal(data[0], src[name][src_ids[i]][tp_rank]), (i, name)  # type: ignore[index]
            else:
                assert block_bytes(entry, dst_ids[i]) == block_bytes(src[name], src_ids[i]), (i, name)


@pytest.mark.parametrize("staging", ["never", "always"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp_rank=st.integers(0, 3), missing=st.sets(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS - 1)
)
def test_misses_on_any_rank_are_reported_for_their_own_blocks(
    staging: str, tp_rank: int, missing: set[int]
) -> None:
    anyio.run(_retrieve_with_holes, tp_rank, missing, staging, False)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp_rank=st.integers(0, 1), missing=st.sets(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS - 1)
)
def test_misses_of_blocks_read_from_another_split_are_reported_for_their_own_blocks(
    tp_rank: int, missing: set[int]
) -> None:
    anyio.run(_retrieve_with_holes, tp_rank, missing, "never", True)


def test_rank_1_with_misses_reports_exactly_the_missing_blocks() -> None:
    """The plain case the rotation could break: rank 1 of 4 starts reading at block 1."""
    anyio.run(_retrieve_with_holes, 1, {0, 5}, "never", False)


# -- one batch among several fails ------------------------------------------------------------------


@attrs.define
class OneBadBatch(FaultyBackend):
    """A backend (batches of 4) whose calls fail, or hang, when a batch holds a poisoned key. The
    poisoned batch fails last, once ``good`` other batches of the request answered, so that its
    failure could not be overwritten by answers that come later."""

    poisoned: set[bytes] = attrs.field(factory=set)  # block hashes
    fault: str = "raise"
    good: int = 2
    batches: list[list[int]] = attrs.field(factory=list)  # the block indices of each KV call
    answered: int = 0

    async def _call(
        self, objects: Sequence[ObjectRef], call: Callable[[Sequence[ObjectRef]], Awaitable[R]]
    ) -> R:
        keys = [o.key for o in objects if not is_book_key(o.key)]
        if not keys:
            return await call(objects)
        self.batches.append([block_index(k) for k in keys])
        if any(hash_of(k) in self.poisoned for k in keys):
            while self.answered < self.good:
                await anyio.lowlevel.checkpoint()
            if self.fault == "hang":
                await anyio.sleep_forever()
            raise ConnectionError("injected failure of one batch")
        answer = await call(objects)
        self.answered += 1
        return answer

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        return await self._call(objects, self.inner.put)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        return await self._call(objects, self.inner.get)


def _bad_batch(backend: OneBadBatch, poisoned: int) -> list[int]:
    (batch,) = [b for b in backend.batches if poisoned in b]
    return batch


@pytest.mark.parametrize("in_turn", [False, True])
@pytest.mark.parametrize("fault", ["raise", "hang"])
@pytest.mark.parametrize("tp_rank", [0, 1])
async def test_a_failing_batch_fails_only_its_own_objects(fault: str, tp_rank: int, in_turn: bool) -> None:
    """Batches at once (a network store's): the poisoned one fails last, after two others
    answered. In turn (an in-process store's): the last batch first, then the poisoned one; one
    that hangs takes the deadline of the batch after it (the head), which then fails too."""
    src = mla_caches()
    poisoned = 5
    good = 1 if in_turn else 2
    backend = OneBadBatch(poisoned={HASHES[poisoned]}, fault=fault, good=good, calls_in_turn=in_turn)
    writer = pool(src, backend, timeout_s=0.5)
    stored = await writer.store(KVRequest(tokens=TOKENS, block_ids=list(range(BLOCKS))))
    bad = _bad_batch(backend, poisoned)
    assert len(bad) == 4  # 12 objects in batches of 4
    if in_turn:  # one after another, the last first
        assert backend.batches == [[8, 9, 10, 11], [4, 5, 6, 7]] + ([] if fault == "hang" else [[0, 1, 2, 3]])
    else:
        assert len(backend.batches) == 3
    failed = set(bad) | ({0, 1, 2, 3} if in_turn and fault == "hang" else set())
    assert [s is PutStatus.FAILED for s in stored.statuses] == [i in failed for i in range(BLOCKS)]
    assert all(s is PutStatus.STORED for i, s in enumerate(stored.statuses) if i not in failed)
    assert sorted(block_index(k) for k in kv_keys(backend.inner)) == [
        i for i in range(BLOCKS) if i not in failed
    ]

    # load: every block is in the store now, but the batch holding block 5 fails again
    await pool(src, backend.inner).store(KVRequest(tokens=TOKENS, block_ids=list(range(BLOCKS))))
    backend.batches.clear()
    backend.answered = 0
    dst = zeros_like_caches(src)
    dst_ids = list(reversed(range(BLOCKS)))
    reader = pool(dst, backend, timeout_s=0.5, tp_rank=tp_rank, tp_size=2, use_mla=True)
    got = await reader.retrieve(KVRequest(tokens=TOKENS, block_ids=dst_ids))
    bad = _bad_batch(backend, poisoned)
    assert len(bad) == 4
    if in_turn:  # every rank reads from the head (no rotation), the last batch first
        assert backend.batches[0] == [8, 9, 10, 11]
    failed = set(bad) | ({0, 1, 2, 3} if in_turn and fault == "hang" else set())
    assert [s is GetStatus.FAILED for s in got.statuses] == [i in failed for i in range(BLOCKS)]
    assert set(got.failed_block_ids) == {dst_ids[i] for i in failed}
    for i in range(BLOCKS):
        if i not in failed:
            assert all(block_bytes(dst[n], dst_ids[i]) == block_bytes(src[n], i) for n in src), i


# -- the pool's own exists-skip ---------------------------------------------------------------------


@attrs.define
class Overwriting(FaultyBackend):
    """A backend whose put replaces what a key held (it never answers PRESENT); it counts the KV
    objects put."""

    put_keys: list[str] = attrs.field(factory=list)

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        keys = [o.key for o in objects]
        self.put_keys += [k for k in keys if not is_book_key(k)]
        await self.inner.remove(keys)
        return await self.inner.put(objects)


async def assert_first_bytes_kept(
    src: dict[str, object], store: object, first: dict[tuple[str, int], bytes]
) -> None:
    """The prompt's blocks 0..2 load from ``store`` as ``first`` holds them (a put that overwrote
    them with later bytes would show)."""
    dst = zeros_like_caches(src)
    got = await pool(dst, store).retrieve(KVRequest(tokens=TOKENS[: 3 * BLOCK], block_ids=[5, 6, 7]))
    assert got.hit_blocks == 3
    for name, entry in dst.items():
        for b in range(3):
            assert block_bytes(entry, 5 + b) == first[name, b]


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("staging", ["never", "always"])
async def test_the_pool_skips_keys_that_exist_itself(layerwise: bool, staging: str) -> None:
    src = {k: v.clone() for k, v in LAYOUTS["vllm_cpu"]().items()}  # type: ignore[attr-defined]
    first = {(name, b): block_bytes(entry, b) for name, entry in src.items() for b in range(3)}
    backend = Overwriting()
    writer = pool(src, backend, staging=staging, layerwise=layerwise)
    units = len(src) if layerwise else 1
    assert (await writer.store(KVRequest(tokens=TOKENS[: 3 * BLOCK], block_ids=[0, 1, 2]))).stored == 3
    assert len(backend.put_keys) == 3 * units
    for entry in src.values():
        entry.add_(1.0)  # type: ignore[attr-defined]  # the blocks change: a second put would overwrite
    again = await writer.store(KVRequest(tokens=TOKENS[: 8 * BLOCK], block_ids=list(range(8))))
    assert again.statuses == (PutStatus.PRESENT,) * 3 + (PutStatus.STORED,) * 5
    assert len(backend.put_keys) == 8 * units  # only the 5 new blocks were put
    assert sorted({block_index(k) for k in backend.put_keys[3 * units :]}) == list(range(3, 8))
    await assert_first_bytes_kept(src, backend.inner, first)


@pytest.mark.parametrize("layerwise, staging", [(False, "never"), (True, "never"), (False, "always")])
async def test_a_store_asks_exists_only_where_the_put_cannot_tell(layerwise: bool, staging: str) -> None:
    """A backend whose put answers PRESENT itself (put_checks_present) gets one call per store
    of whole blocks read from the cache, with the same answers and no overwrite; a layerwise or
    staged store still asks exists() first (it skips a layer's put or a staging copy)."""
    src = {k: v.clone() for k, v in LAYOUTS["vllm_cpu"]().items()}  # type: ignore[attr-defined]
    first = {(name, b): block_bytes(entry, b) for name, entry in src.items() for b in range(3)}
    backend = FaultyBackend(put_checks_present=True)
    writer = pool(src, backend, staging=staging, layerwise=layerwise)
    assert (await writer.store(KVRequest(tokens=TOKENS[: 3 * BLOCK], block_ids=[0, 1, 2]))).stored == 3
    for entry in src.values():
        entry.add_(1.0)  # type: ignore[attr-defined]  # a put that copied the present blocks would show
    again = await writer.store(KVRequest(tokens=TOKENS[: 8 * BLOCK], block_ids=list(range(8))))
    assert again.statuses == (PutStatus.PRESENT,) * 3 + (PutStatus.STORED,) * 5
    asked = layerwise or staging == "always"
    assert backend.calls.count("exists") == (2 if asked else 0)
    await assert_first_bytes_kept(src, backend.inner, first)


async def test_a_store_that_cannot_ask_what_exists_puts_everything() -> None:
    """The documented fallback: no answer from exists() means "none present"."""
    src = LAYOUTS["vllm_cpu"]()
    backend = Overwriting()
    writer = pool(src, backend)
    await writer.store(KVRequest(tokens=TOKENS[: 3 * BLOCK], block_ids=[0, 1, 2]))
    backend.raise_on = {"exists"}
    again = await writer.store(KVRequest(tokens=TOKENS[: 3 * BLOCK], block_ids=[0, 1, 2]))
    assert again.statuses == (PutStatus.STORED,) * 3 and len(backend.put_keys) == 6


# --- run_batches: faults by kind ------------------------------------------------------------------


async def batched(
    n: int, call: Callable[[Sequence[ObjectRef]], Awaitable[list[str]]], max_batch: int
) -> list[str]:
    """``run_batches`` over objects k0..k{n-1} (never read: ``call`` is a fake) with room to spare."""
    objects = [ObjectRef.of(f"k{i}", [0], [1]) for i in range(n)]
    budget, deadline = ByteBudget(1 << 20), time.monotonic() + 10
    return await run_batches(
        objects, call, failed="failed", max_batch=max_batch, budget=budget, deadline=deadline
    )


@pytest.mark.parametrize(
    "fault", [TypeError("a misconfigured backend"), BackendError("refused"), RequestError("malformed")]
)
async def test_a_programming_error_in_one_batch_is_raised_once_every_batch_ended(fault: Exception) -> None:
    """Retrying or recomputing cannot fix a programming error: it reaches the caller, the same
    error, and only after the other batches (which end later) finished."""
    ended: list[str] = []

    async def call(batch: Sequence[ObjectRef]) -> list[str]:
        if batch[0].key == "k2":
            raise fault
        await anyio.sleep(0.05)
        ended.append(batch[0].key)
        return ["ok"] * len(batch)

    with pytest.raises(type(fault)) as raised:
        await batched(6, call, max_batch=2)
    assert raised.value is fault and sorted(ended) == ["k0", "k4"]


async def test_an_unavailable_backend_fails_only_its_batch_and_batches_keep_their_size() -> None:
    """A store that is down is a fault like any other (its objects fail, the rest succeed); a
    backend that takes one object per call gets one per call."""
    sizes: list[int] = []

    async def call(batch: Sequence[ObjectRef]) -> list[str]:
        sizes.append(len(batch))
        if batch[0].key == "k1":
            raise BackendUnavailableError("the store is down")
        return ["ok"] * len(batch)

    results = await batched(3, call, max_batch=1)
    assert results == ["ok", "failed", "ok"] and sizes == [1, 1, 1]


async def test_each_batch_answers_land_on_its_own_objects_whatever_order_batches_end() -> None:
    """Later batches end first: the answers still come back one per object, in input order."""

    async def call(batch: Sequence[ObjectRef]) -> list[str]:
        await anyio.sleep(0.01 * (7 - int(batch[0].key[1:])))
        return [f"answer-{o.key}" for o in batch]

    with anyio.fail_after(5):
        results = await batched(7, call, max_batch=2)
    assert results == [f"answer-k{i}" for i in range(7)]


async def test_the_byte_budget_counts_every_holder() -> None:
    """Two calls hold 40 of 100 bytes each: a third that needs 40 waits until one gives its bytes
    back (the budget adds holders up; it does not keep only the last)."""
    budget = ByteBudget(100)
    first = await budget.acquire(40)
    await budget.acquire(40)
    got: list[int] = []

    async def third() -> None:
        got.append(await budget.acquire(40))

    async with anyio.create_task_group() as tg:
        tg.start_soon(third)
        await anyio.wait_all_tasks_blocked()
        assert got == [] and budget.held == 80
        budget.release(first)
    assert got == [40] and budget.held == 80


async def test_a_cancelled_waiter_leaves_the_others_waiting_for_the_next_release() -> None:
    """A release wakes waiters only while some wait; one that gives up must not make the budget
    forget the others, or they would wait forever."""
    budget = ByteBudget(100)
    held = await budget.acquire(100)
    got: list[int] = []
    gives_up = anyio.CancelScope()

    async def waiter() -> None:
        got.append(await budget.acquire(60))

    async def impatient() -> None:
        with gives_up:
            await budget.acquire(60)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(impatient)
            await anyio.wait_all_tasks_blocked()
            gives_up.cancel()
            await anyio.wait_all_tasks_blocked()
            budget.release(held)
    assert got == [60] and budget.held == 60


async def test_small_requests_cannot_keep_passing_one_that_needs_the_whole_budget() -> None:
    """First come, first served: while small holders come and go without a pause, one request
    for all of the budget is let in once those before it gave their bytes back (it waited until
    its deadline before, and its blocks failed, on every call while other traffic flowed)."""
    budget = ByteBudget(100)
    got: list[int] = []
    stop = anyio.Event()

    async def traffic() -> None:
        while not stop.is_set():
            held = await budget.acquire(10)
            await anyio.sleep(0.001)
            budget.release(held)

    async def big() -> None:
        got.append(await budget.acquire(100))
        budget.release(100)
        stop.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(big)
    assert got == [100] and budget.held == 0


async def test_a_waiter_cancelled_at_the_head_lets_those_behind_it_in_and_a_granted_one_gives_back() -> None:
    """The head of the queue gives up: the one behind it, which fits, is let in at once. One
    cancelled after its bytes were handed to it gives them back."""
    budget = ByteBudget(100)
    held = await budget.acquire(50)
    order: list[str] = []
    head = anyio.CancelScope()

    async def wants(name: str, nbytes: int, scope: anyio.CancelScope | None = None) -> None:
        with scope or anyio.CancelScope():
            await budget.acquire(nbytes)
            order.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wants, "head", 100, head)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(wants, "small", 50)
            await anyio.wait_all_tasks_blocked()
            assert order == []  # behind the head, though it fits
            head.cancel()
            await anyio.wait_all_tasks_blocked()
            assert order == ["small"] and budget.held == 100
    budget.release(50)
    budget.release(held)

    granted = anyio.CancelScope()

    async def cancelled_once_granted() -> None:
        with granted:
            await budget.acquire(100)
            order.append("never")

    held = await budget.acquire(100)
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled_once_granted)
        await anyio.wait_all_tasks_blocked()
        granted.cancel()  # the waiter is cancelled, and has not run since ...
        budget.release(held)  # ... when the release hands it the 100 bytes
    assert order == ["small"] and budget.held == 0


# --- together: one call inline, several at once ---------------------------------------------------


async def test_together_awaits_a_single_call_in_the_callers_own_task() -> None:
    """Most pool calls move one unit: no task (and no task group) is made for it."""
    ran_in: list[int] = []

    async def call() -> None:
        ran_in.append(anyio.get_current_task().id)

    await together([call])
    assert ran_in == [anyio.get_current_task().id]


async def test_together_runs_several_calls_at_once() -> None:
    """Each call waits for the other: run one after another they would never end."""
    first, second = anyio.Event(), anyio.Event()

    async def a() -> None:
        first.set()
        await second.wait()

    async def b() -> None:
        await first.wait()
        second.set()

    with anyio.fail_after(5):
        await together([a, b])
    assert first.is_set() and second.is_set()


async def test_together_raises_a_failing_calls_own_error_and_cancels_the_rest() -> None:
    """Callers catch the same error whether the call ran inline or beside others, or beside
    another call that failed the same way (one fault met twice); failures of two classes at once
    stay a group."""
    cancelled: list[bool] = []

    async def fails() -> None:
        await anyio.lowlevel.checkpoint()
        raise BackendError("the store refused")

    async def waits() -> None:
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise

    async def also_fails() -> None:
        raise RequestError("malformed")

    async def fails_alike() -> None:
        raise BackendError("the store refused too")

    with anyio.fail_after(5):
        with pytest.raises(BackendError, match="refused"):
            await together([fails, waits])
        assert cancelled == [True]
        with pytest.raises(BackendError, match="refused"):
            await together([fails])
        with pytest.raises(BackendError, match="refused") as one:
            await together([fails, fails_alike])
        assert not isinstance(one.value, ExceptionGroup)
        with pytest.raises(ExceptionGroup) as group:
            await together([fails, also_fails])
    assert sorted(type(e).__name__ for e in group.value.exceptions) == ["BackendError", "RequestError"]


def test_an_error_raised_out_of_a_group_keeps_its_own_cause() -> None:
    """An error raised ``from`` another in a task (or in an engine's body inside a layerwise
    ``async with``) is raised as it is by ``unwrapped``, and keeps the cause its raiser gave it."""
    cause = OSError("the socket closed")
    error = BackendError("the store refused")
    error.__cause__ = cause  # as `raise error from cause` leaves it
    with pytest.raises(BackendError) as caught, unwrapped():
        raise ExceptionGroup("tasks", [error])
    assert caught.value is error and caught.value.__cause__ is cause


def test_groups_in_a_group_are_all_kept() -> None:
    """``unwrapped`` raises errors all of one class as the first; groups in a group are not one
    fault met twice: every one is kept, so no error vanishes."""
    inner = [ExceptionGroup("a", [BackendError("1"), TypeError("bug")]), ExceptionGroup("b", [KeyError("k")])]
    with pytest.raises(ExceptionGroup) as caught, unwrapped():
        raise ExceptionGroup("outer", inner)
    assert list(caught.value.exceptions) == inner


# --- a custom backend that answers outside the protocol ---------------------------------------------


@attrs.define(eq=False)
class OffProtocol(FaultyBackend):
    """Answers as a hand-written backend might: ``put`` with truth values, ``exists`` with None for
    an absent key (in a tuple), or a ``max_batch`` that is not a positive integer."""

    batch: object = 4
    exists_answers: str = "list"

    @property
    def max_batch(self) -> int:
        return self.batch  # type: ignore[return-value]

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        statuses = await super().put(objects)
        if any(is_book_key(o.key) for o in objects):
            return statuses
        return [s is PutStatus.STORED for s in statuses]  # type: ignore[misc]

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        found = await super().exists(keys)
        return tuple(True if f else None for f in found)  # type: ignore[return-value]


async def test_statuses_that_are_not_the_protocols_are_a_type_error_that_names_it() -> None:
    """``put`` answering True/False was taken for "stored nothing, failed nothing" (ok=True)."""
    pool_ = pool(LAYOUTS["vllm_cpu"](), OffProtocol())
    with pytest.raises(TypeError, match=r"answered True for an object: its calls must return PutStatus"):
        await pool_.store(KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK]))


async def test_exists_answering_none_for_absent_keys_in_a_tuple_is_read_as_truth_values() -> None:
    """A lookup counted a None (absent) as held, and promised blocks the store did not have."""
    backend = OffProtocol()
    writer = pool(LAYOUTS["vllm_cpu"](), backend.inner)
    assert (await writer.store(KVRequest(block_ids=[0, 1], tokens=TOKENS[: 2 * BLOCK]))).stored == 2
    reader = pool(LAYOUTS["vllm_cpu"](), backend)
    assert await reader.lookup(KVRequest(tokens=TOKENS[: 4 * BLOCK])) == 2 * BLOCK


@pytest.mark.parametrize("batch", [0, -1, 2.5, float("inf"), None, True])
def test_a_backend_whose_max_batch_is_not_a_positive_integer_is_refused(batch: object) -> None:
    """It raised ZeroDivisionError or TypeError from the first store or retrieve."""
    with pytest.raises(ConfigError, match=r"max_batch is .*: it must be a positive integer"):
        pool(LAYOUTS["vllm_cpu"](), OffProtocol(batch=batch))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() tells a stray cancellation")
@pytest.mark.parametrize("max_batch", [8, 2])
async def test_a_cancellation_the_backend_raises_itself_fails_its_objects(max_batch: int) -> None:
    """A hand-written asyncio client cancels its reply futures when the connection drops: the
    CancelledError reached the caller with one batch (inline) and was a failure with several (a
    task group). Either way it is a fault of the store now: its blocks fail, nothing raises, and
    a cancellation of the caller still cancels."""

    @attrs.define(eq=False)
    class Dropped(FaultyBackend):
        @property
        def max_batch(self) -> int:
            return max_batch

        async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
            if "get" in self.hang_on:
                await anyio.sleep_forever()
            reply = asyncio.get_running_loop().create_future()
            reply.cancel()  # the connection dropped
            return await reply  # type: ignore[no-any-return]

    backend = Dropped()
    writer = pool(LAYOUTS["vllm_cpu"](), backend.inner)
    request = KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS[: 4 * BLOCK])
    assert (await writer.store(request)).stored == 4
    reader = pool(zeros_like_caches(LAYOUTS["vllm_cpu"]()), backend)
    got = await reader.retrieve(request)
    assert got.hit_blocks == 0 and len(got.failed_block_ids) == 4
    with anyio.move_on_after(0.05) as scope:  # a real cancellation is not swallowed
        backend.hang_on.add("get")
        await reader.retrieve(request)
    assert scope.cancelled_caught


async def test_a_real_cancellation_passes_cancelled_as_fault_as_it_is() -> None:
    """Only a cancellation nobody asked for becomes a store fault: inside a cancelled scope (an
    anyio deadline, a caller giving up) the CancelledError leaves as it came, and the scope catches
    it; a plain asyncio cancel of the task passes too."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        with cancelled_as_fault():
            await anyio.sleep(1)
        raise AssertionError("not reached: the cancellation passes")
    assert scope.cancelled_caught

    async def cancelled_by_asyncio() -> None:
        with cancelled_as_fault():
            await anyio.sleep(1)

    task = asyncio.ensure_future(cancelled_by_asyncio())
    await anyio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
