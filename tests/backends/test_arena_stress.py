"""The arena under concurrent puts, gets, removes and clears from several instances in this
process (each its own lock descriptor) and from worker processes, with a tiny capacity (one set of
4 or 8 slots: every put evicts) and gets paced a few objects per call (they release the lock
between runs). Every HIT must be one writer's whole version of that very key."""

from __future__ import annotations

import random

import anyio
import pytest

from kvflow.backends import pacing
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.backends.base import GetStatus, ObjectRef
from kvflow.regions import buffer_address
from tests.backends.store_worker import Workers, _flatten, _unflatten, check, content, regions
from tests.helpers import bounded_shm

SLOT = 4096
WRITERS = 16


async def hammer(
    backend: ArenaBackend, writer: int, keys: list[str], seed: int, rounds: int, torn: list[str]
) -> int:
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        op = rng.random()
        batch = [rng.choice(keys) for _ in range(rng.randrange(1, 7))]
        size = rng.choice([SLOT, SLOT, SLOT // 2])  # a size other than the stored one: FAILED, never a hit
        if op < 0.45:
            sources = [_unflatten(content(k, writer, size)) for k in batch]
            refs = [ObjectRef.of(k, *regions(buffer_address(s), size)) for k, s in zip(batch, sources)]
            await backend.put(refs)
        elif op < 0.9:
            targets = [bytearray(size) for _ in batch]
            refs = [ObjectRef.of(k, *regions(buffer_address(t), size)) for k, t in zip(batch, targets)]
            for key, target, status in zip(batch, targets, await backend.get(refs)):
                if status is GetStatus.HIT:
                    hits += 1
                    problem = check(key, _flatten(target), WRITERS)
                    if problem:
                        torn.append(problem)
                elif any(target):
                    torn.append(f"{key}: a {status} wrote into its target")
        elif op < 0.98:
            await backend.remove(batch)
        else:
            await backend.clear()
        if rng.random() < 0.3:
            await anyio.sleep(0)
    return hits


@pytest.mark.parametrize("slots", [4, 8])
def test_concurrent_instances_and_processes_never_return_another_keys_bytes(
    slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pacing, "RUN_OBJECTS", 2)
    keys = [f"k{i}" for i in range(12)]
    with bounded_shm("16m") as path:
        store = path / "store"
        url = f"arena://{store}?capacity={slots * SLOT}&slot={SLOT}"
        backends = [
            ArenaBackend(ArenaConfig(str(store), capacity_bytes=slots * SLOT, slot_bytes=SLOT))
            for _ in range(3)
        ]
        workers = Workers(
            [
                {
                    "url": url,
                    "writer": 10 + w,
                    "writers": WRITERS,
                    "keys": keys,
                    "size": SLOT,
                    "rounds": 40,
                    "batch": 5,
                    "seed": w,
                }
                for w in range(2)
            ]
        )
        torn: list[str] = []
        hits = [0]

        async def main() -> None:
            workers.go()

            async def one(i: int) -> None:
                backend = backends[i % len(backends)]
                hits[0] += await hammer(backend, i % WRITERS, keys, 1000 + i, 300, torn)

            async with anyio.create_task_group() as tg:
                for i in range(9):
                    tg.start_soon(one, i)
            for backend in backends:
                await backend.aclose()

        try:
            anyio.run(main)
            reports = []
            for proc in workers.procs:
                out, _ = proc.communicate(timeout=60)
                assert proc.returncode == 0
                import json

                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            workers.kill_all()
        assert torn == [], torn[:5]
        assert all(r["torn"] == [] for r in reports), [r["torn"][:3] for r in reports]
        assert hits[0] > 0
