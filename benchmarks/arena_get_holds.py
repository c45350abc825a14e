"""What an arena get's holds of the store's lock cost: the backend's get of a batch beside the bare
copy of the same slots, and the get while another process is seen waiting for the lock.

    python benchmarks/arena_get_holds.py [--sizes 64KiB,256KiB,1MiB] [--batch 64] [--repeat 30]
                                         [--json]

A private arena store (a new directory under /dev/shm, removed at the end) holds ``--batch``
objects of each size, 4 regions each, laid out as vLLM's CPU cache lays out a block's layers. In
turns, each call from flushed caches (:class:`kvflow.tools.baselines.CacheFlush`, untimed), it
times, median of ``--repeat`` each, in ms:

- bare: the objects' slots copied into their regions by one call of the copy loop, streamed, as a
  get copies them: the least a get can take;
- get: the backend's get of the batch, alone on the loop: it holds the lock across its runs and
  lets go only where it lets the loop run (every 2 ms, :mod:`kvflow.backends.pacing`);
- get, a put waiting: the same get with the waiters' mark of another process fresh in the store
  (:class:`kvflow.backends.arena.lock.WaitMark`, counted however old it grows here): it lets go
  of the lock and the loop every 0.5 ms, as every get did before the seventeenth stop.

Every get is checked against what was stored, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

import kvflow.backends.arena.lock as arena_lock
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.backends.base import GetStatus, ObjectBatch, PutStatus
from kvflow.backends.copies import scatter_objects
from kvflow.config import parse_size
from kvflow.regions import buffer_address
from kvflow.tools.baselines import CacheFlush

REGIONS = 4


def _batch(keys: list[str], cache: bytearray, size: int) -> ObjectBatch:
    """Objects of ``size`` bytes over ``cache``: region ``r`` of object ``j`` in layer ``r``'s part."""
    n, part = len(keys), size // REGIONS
    base = buffer_address(cache)
    rows = [[base + r * n * part + j * part for r in range(REGIONS)] for j in range(n)]
    return ObjectBatch(keys, np.array(rows, dtype=np.int64), [part] * REGIONS, size)


async def measure(
    root: str, size: int, batch: int, repeat: int, flush: Callable[[], object]
) -> dict[str, Any]:
    keys = [f"held-{size}-{i}" for i in range(batch)]
    source = bytearray(np.random.default_rng(size).bytes(batch * size))
    target = bytearray(batch * size)
    config = ArenaConfig(f"{root}/store-{size}", capacity_bytes=4 * (batch + 64) * size, slot_bytes=size)
    backend = ArenaBackend(config)
    try:
        if await backend.put(_batch(keys, source, size)) != [PutStatus.STORED] * batch:
            raise SystemExit(f"the arena did not store all {batch} objects of {size} bytes")
        arena, into = backend._arena, _batch(keys, target, size)
        waits = arena.lock.waits
        assert waits is not None
        rows = np.asarray(arena.find(backend._hashes(keys)), dtype=np.int64)
        slots = (arena.base + rows * arena.geometry.slot_bytes).tolist()
        times: dict[str, list[float]] = {"bare": [], "get": [], "get_waited": []}
        for turn in range(repeat + 1):  # (the first turn untimed)
            for name in ("bare", "get", "get_waited") if turn % 2 else ("get_waited", "get", "bare"):
                target[:] = bytes(len(target))
                stamp = waits.mark() if name == "get_waited" else None
                flush()
                start = time.perf_counter()
                if name == "bare":
                    scatter_objects(slots, into)
                elif await backend.get(into) != [GetStatus.HIT] * batch:
                    raise SystemExit(f"a get of {batch} objects of {size} bytes missed")
                took = time.perf_counter() - start
                if stamp is not None:
                    waits.clear(stamp)
                if target != source:
                    raise SystemExit(f"{name}: the objects of {size} bytes came back other than stored")
                if turn:
                    times[name].append(took)
    finally:
        await backend.aclose()
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {
        "object_kib": size >> 10,
        "batch": batch,
        **{f"{name}_ms": value for name, value in ms.items()},
        "get_vs_bare": ms["get"] / ms["bare"],
        "waited_vs_get": ms["get_waited"] / ms["get"],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,256KiB,1MiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arena_lock.MARK_FRESH_NS = 1 << 62  # a mark counts however long a get takes here
    root = tempfile.mkdtemp(prefix="kvflow-arena-holds-", dir="/dev/shm")
    flush = CacheFlush()
    try:
        sizes = [parse_size(size) for size in args.sizes.split(",")]
        rows = [await measure(root, size, args.batch, args.repeat, flush) for size in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"arena get, {args.batch} objects of {REGIONS} regions, median of {args.repeat}, caches flushed")
    print(f"{'object':>8} {'bare ms':>9} {'get ms':>9} {'waited ms':>10} {'get/bare':>9} {'waited/get':>11}")
    for row in rows:
        print(
            f"{row['object_kib']:>6}Ki {row['bare_ms']:9.3f} {row['get_ms']:9.3f}"
            f" {row['get_waited_ms']:10.3f} {row['get_vs_bare']:9.3f} {row['waited_vs_get']:11.3f}"
        )


if __name__ == "__main__":
    anyio.run(main)
