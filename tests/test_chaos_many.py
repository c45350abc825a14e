"""store_many / retrieve_many of several requests per call, over the chaos store (tests/test_chaos.py),
direct and staged (LateDevice: copies run only when their event is polled, out of order), with:

- an ``after`` event that fills the source blocks only when it fires (the "forward");
- ``on_released`` scribbling the source blocks the moment it is called (the engine reusing them);
- random cancellation of both calls (a SyncPool timeout, a cancelled task).

Checks: every block a retrieve_many reports HIT holds its prompt's KV; nothing writes a retrieve's
blocks after it returned (cancelled ones included); on_released is called exactly once by the time
store_many exits (cancelled or not); and at the end every object the store holds is the prompt's KV
(read back through clean pools): nothing published bytes read before the forward or after release.
"""

from __future__ import annotations

import random
import time

import anyio
import attrs
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import GetStatus, KVRequest
from tests.helpers import bounded_shm
from tests.test_chaos import (
    PROMPTS,
    Engine,
    chaos_backends,
    chaos_engines,
    check,
    fill,
    make_engine,
    take_blocks,
    token_kv,
)

JUNK = 0x7B7B  # int16 view of the scribble


@attrs.define(eq=False)
class FillingEvent:
    """The engine's "forward" event: the blocks are written only when it fires."""

    at: float
    write: object
    fired: bool = False

    def query(self) -> bool:
        if not self.fired and time.monotonic() >= self.at:
            self.write()  # type: ignore[operator]
            self.fired = True
        return self.fired

    def record(self) -> None:
        pass


def scribble(engine: Engine, ids: list[int]) -> None:
    for kc, vc in engine.caches.values():
        kc.view(torch.int16)[ids] = JUNK
        vc.view(torch.int16)[ids] = JUNK


Op = tuple[int, int, list[tuple[int, int, int]], int]  # kind, engine, [(prompt, first, count)], cancel


async def scenario(seed: int, ops: list[Op], arena: str | None = None) -> tuple[int, int]:
    rng = random.Random(seed)
    kv = [token_kv(p) for p in PROMPTS]
    backends = chaos_backends(rng, arena)
    engines = chaos_engines(backends, rng, layerwise=False)
    late: list[tuple[Engine, list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = []
    asked = hit = 0

    async def one(kind: int, e: int, reqs: list[tuple[int, int, int]], cancel: int) -> None:
        nonlocal asked, hit
        engine = engines[e % len(engines)]
        plans = []
        for p, first, count in reqs:
            taken = take_blocks(engine, PROMPTS[p], first, count, rng)
            if taken is None:
                break
            plans.append((p, *taken))
        if not plans:
            return
        requests = [
            KVRequest(tokens=PROMPTS[p], block_ids=ids, block_offset=first, request_id=f"r{i}")
            for i, (p, first, ids) in enumerate(plans)
        ]
        every = [n for _, _, ids in plans for n in ids]
        limit = [None, 0.0, 0.0005, 0.002, 0.01][cancel % 5] if cancel % 3 == 0 else None
        if kind % 2 == 0:  # store_many
            scribble(engine, every)  # the forward has not written them yet

            def write() -> None:
                for p, first, ids in plans:
                    fill(engine, ids, *kv[p], first)

            after = None
            if rng.random() < 0.6:
                after = FillingEvent(time.monotonic() + rng.choice([0, 0.001, 0.004]), write)
            else:
                write()
            released: list[int] = []

            def on_released() -> None:
                released.append(1)
                scribble(engine, every)  # the engine reuses the blocks at once

            if limit is None:
                await engine.pool.store_many(requests, after=after, on_released=on_released)  # type: ignore[arg-type]
            else:
                with anyio.move_on_after(limit):
                    await engine.pool.store_many(requests, after=after, on_released=on_released)  # type: ignore[arg-type]
            assert released == [1], f"{engine.name}: on_released called {len(released)} times"
            engine.free.extend(every)
        else:  # retrieve_many
            for kc, vc in engine.caches.values():
                kc[every] = float("nan")
                vc[every] = float("nan")
            results = None
            if limit is None:
                results = await engine.pool.retrieve_many(requests)
            else:
                with anyio.move_on_after(limit):
                    results = await engine.pool.retrieve_many(requests)
            if results is not None:
                assert len(results) == len(plans)
                for (p, first, ids), result in zip(plans, results):
                    assert list(result.block_ids) == ids
                    check(engine, ids, result.statuses, *kv[p], first, f"retrieve_many p{p}")
                    asked += len(ids)
                    hit += result.statuses.count(GetStatus.HIT)
            snap = [(kc[every].clone(), vc[every].clone()) for kc, vc in engine.caches.values()]
            late.append((engine, every, snap))

    try:
        for wave in range(3):
            async with anyio.create_task_group() as tg:
                for op in ops[wave::3]:
                    tg.start_soon(one, *op)
                    if rng.random() < 0.5:
                        await anyio.sleep(rng.choice([0, 0.001, 0.003]))
        await anyio.sleep(0.05)
        for engine, ids, snap in late:
            for (kc, vc), (k0, v0) in zip(engine.caches.values(), snap):
                assert torch.equal(kc[ids].view(torch.int16), k0.view(torch.int16)) and torch.equal(
                    vc[ids].view(torch.int16), v0.view(torch.int16)
                ), f"{engine.name}: blocks {ids} written after their retrieve_many returned"
        # What the store holds: read it back with clean pools (no faults) of both block sizes.
        for backend in backends:
            backend.faults = False
        for block in (4, 8):
            reader = make_engine(
                f"reader{block}", backends[0], rng, block=block, layerwise=False, staged=False
            )
            for p, prompt in enumerate(PROMPTS):
                full = len(prompt) // block
                ids = list(range(full))
                for kc, vc in reader.caches.values():
                    kc[ids] = float("nan")
                    vc[ids] = float("nan")
                result = await reader.pool.retrieve(KVRequest(tokens=prompt, block_ids=ids))
                check(
                    reader, ids, result.statuses, *kv[p], 0, f"store holds wrong KV, prompt {p} block{block}"
                )
    finally:
        for backend in backends:
            await backend.inner.aclose()
    return asked, hit


req = st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, 10), st.integers(1, 8))
op = st.tuples(
    st.integers(0, 1), st.integers(0, 5), st.lists(req, min_size=1, max_size=3), st.integers(0, 14)
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), ops=st.lists(op, min_size=6, max_size=24))
def test_many_calls_publish_and_load_only_their_prompts_kv(seed: int, ops: list[Op]) -> None:
    anyio.run(scenario, seed, ops)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), ops=st.lists(op, min_size=6, max_size=24))
def test_many_calls_over_a_small_shared_arena(seed: int, ops: list[Op]) -> None:
    with bounded_shm("16m") as path:
        anyio.run(scenario, seed, ops, str(path / "store"))


def test_many_calls_hit_at_all() -> None:
    """Without cancellation: stores of every prompt then loads of them by other engines hit."""
    ops: list[Op] = []
    for e in range(6):
        ops.append((0, e, [(0, 0, 12), (1, 0, 12)], 1))
        ops.append((1, (e + 2) % 6, [(0, 0, 6), (1, 1, 5)], 1))
        ops.append((1, (e + 3) % 6, [(0, 0, 4), (0, 2, 4)], 1))
    asked = hit = 0
    for seed in range(3):
        a, h = anyio.run(scenario, seed, ops)
        asked, hit = asked + a, hit + h
    assert hit > 0, (hit, asked)
