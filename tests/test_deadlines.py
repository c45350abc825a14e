"""Calls keep their deadline while they wait: for the byte budget (a backend call never starts
after it), and for the profile book another call is reading from a stalled store."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
import attrs
import pytest
import torch

from kvflow import KVLayout, KVPool, KVRequest, PoolConfig, PutStatus
from kvflow.backends.base import ObjectRef
from kvflow.profiles import is_book_key
from kvflow.transfer import ByteBudget, run_batches
from tests.helpers import BLOCK, FaultyBackend, kv_keys

# --- the byte budget ------------------------------------------------------------------------------


async def _held_up_while_waiting(
    first: Callable[[], Awaitable[None]],
    second: Callable[[], Awaitable[None]],
    go: anyio.Event,
    blocker_go: anyio.Event,
) -> None:
    """``first`` takes the whole byte budget and ``second`` waits for it; ``go`` lets ``first``
    end, and once ``blocker_go`` is set another task holds the loop up for 0.3 s (a long step), past
    ``second``'s deadline, before ``second`` runs again."""

    async def blocker() -> None:
        await blocker_go.wait()
        time.sleep(0.3)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(second)
            tg.start_soon(blocker)
            await anyio.wait_all_tasks_blocked()
            go.set()


async def test_no_backend_call_starts_after_its_deadline_once_the_budget_came_free() -> None:
    """docs/api.md: "No backend call starts once its call's deadline has passed"; run_batches:
    "no call starts once the deadline has passed". A batch that waited for the byte budget past
    its deadline (the loop held up meanwhile) must not start its backend call when the budget
    finally comes free."""
    budget = ByteBudget(1)
    go, blocker_go = anyio.Event(), anyio.Event()
    late: list[float] = []
    b_deadline = 0.0

    async def call_a(batch: Sequence[ObjectRef]) -> list[str]:
        await go.wait()
        blocker_go.set()  # the blocker's wake-up is queued before the budget waiter's
        return ["ok"] * len(batch)

    async def call_b(batch: Sequence[ObjectRef]) -> list[str]:
        late.append(time.monotonic() - b_deadline)
        return ["ok"] * len(batch)

    async def first() -> None:
        await run_batches(
            [ObjectRef.of("a", [0], [1])],
            call_a,
            failed="failed",
            max_batch=1,
            budget=budget,
            deadline=time.monotonic() + 10,
        )

    async def second() -> None:
        nonlocal b_deadline
        b_deadline = time.monotonic() + 0.1
        await run_batches(
            [ObjectRef.of("b", [0], [1])],
            call_b,
            failed="failed",
            max_batch=1,
            budget=budget,
            deadline=b_deadline,
        )

    await _held_up_while_waiting(first, second, go, blocker_go)
    assert all(t < 0 for t in late), f"a backend call started {max(late):.3f} s after its deadline"


async def test_a_store_reported_failed_after_its_deadline_published_nothing() -> None:
    """docs/api.md: "No backend call starts once its call's deadline has passed, so a store given
    up on never publishes what the engine writes into its blocks afterwards". A store that waited
    for the byte budget past its timeout reports FAILED; the store must not hold its block."""
    caches = {f"l{i}": torch.randn(12, 2, BLOCK, 16) for i in range(2)}
    layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
    go, blocker_go = anyio.Event(), anyio.Event()
    backend = FaultyBackend()
    tokens_a = list(range(1000, 1000 + BLOCK))
    tokens_b = list(range(5000, 5000 + BLOCK))

    async def hook(objects: Sequence[ObjectRef]) -> None:
        if blocker_go.is_set():
            return
        await go.wait()
        blocker_go.set()

    backend.put_hook = hook
    pool = KVPool.create(
        PoolConfig(model="m", staging="never", timeout_s=10, max_inflight_bytes=layout.block_nbytes),
        layout=layout,
        backend=backend,  # type: ignore[arg-type]
    )
    # the profile book's announcement first, so it is out of the way
    await pool.lookup(KVRequest(tokens=tokens_a))
    results: dict[str, object] = {}

    async def store_a() -> None:
        results["a"] = await pool.store(KVRequest(tokens=tokens_a, block_ids=[0]))

    async def store_b() -> None:
        results["b"] = await pool.store(KVRequest(tokens=tokens_b, block_ids=[1]), timeout_s=0.1)

    await _held_up_while_waiting(store_a, store_b, go, blocker_go)
    b = results["b"]
    stored = len(kv_keys(backend.inner))
    assert not (b.statuses == (PutStatus.FAILED,) and stored == 2), (  # type: ignore[attr-defined]
        "store b reported FAILED (its deadline passed while it waited for the budget), "
        "yet its block was put after the deadline and is in the store"
    )
    assert b.statuses == (PutStatus.FAILED,) or stored == 2  # type: ignore[attr-defined]
    await pool.aclose()


# --- the profile book ----------------------------------------------------------------------------


@attrs.define(eq=False)
class SlowBook(FaultyBackend):
    """Reading the profile book hangs while ``slow`` is set (a store that stalls)."""

    slow: bool = False

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if self.slow and keys and all(is_book_key(k) for k in keys):
            await anyio.sleep_forever()
        return await super().exists(keys)


def _pool(backend: SlowBook) -> KVPool:
    caches = {f"l{i}": torch.randn(4, 2, BLOCK, 16) for i in range(2)}
    return KVPool.create(
        PoolConfig(model="m", staging="never", timeout_s=30),
        layout=KVLayout.from_kv_caches(caches),  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("call", ["lookup", "retrieve", "store"])
async def test_a_call_answers_within_its_timeout_while_another_reads_the_book(call: str) -> None:
    """docs/api.md: "Timeouts count from the call and bound all of it". A lookup or retrieve of a
    missing block reads the profile book, and a store announces the pool's profile; while another
    call (with a longer timeout) reads the book from a stalled store, a call with timeout_s=0.2
    answers within about that."""
    backend = SlowBook()
    pool = _pool(backend)
    backend.slow = True
    tokens = list(range(100, 100 + 2 * BLOCK))
    took: list[float] = []

    async def patient() -> None:
        await pool.lookup(KVRequest(tokens=tokens), timeout_s=3)

    async def hurried() -> None:
        start = time.monotonic()
        if call == "lookup":
            await pool.lookup(KVRequest(tokens=tokens), timeout_s=0.2)
        elif call == "retrieve":
            await pool.retrieve(KVRequest(tokens=tokens, block_ids=[0, 1]), timeout_s=0.2)
        else:
            await pool.store(KVRequest(tokens=tokens, block_ids=[0, 1]), timeout_s=0.2)
        took.append(time.monotonic() - start)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(patient)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(hurried)
    assert took and took[0] < 1.0, f"a {call} with timeout_s=0.2 took {took[0]:.2f} s"
