"""Where an arena put's time goes: each stage of ``ArenaBackend.put`` timed on its own, medians.

    python benchmarks/arena_put_stages.py [--batch 64] [--size 64KiB] [--regions 8] [--puts 400]
                                          [--flush] [--json]

A private arena store (a new directory under /dev/shm, removed at the end) of 256 MiB in 256 KiB
slots, so that puts evict as a store in service does. ``--puts`` puts of ``--batch``
objects of ``--size`` bytes in ``--regions`` regions each, new keys every put, the first quarter
not counted; each put must store every object. With ``--flush``, each put starts with the CPU's
caches flushed, as ``kvflow bench`` times its calls (:class:`kvflow.tools.baselines.CacheFlush`).
Reported in microseconds per put (medians):

- claim: :meth:`ArenaFile.claim`, the compiled pass and its Python around it, under the lock;
- claim section: the put's whole claim (hashing the keys, the lock, the claim);
- copy: :func:`kvflow.regions.copy_rows`, the compiled copy of one run of objects (up to 4 MiB);
- write: every run of the put with its pacing;
- publish: :meth:`ArenaFile.publish`, under the lock;
- put: the backend's whole call.

The stages are timed by wrapping the backend's own methods, so the put runs its real code; the
wrappers cost about a microsecond each.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import torch

import kvflow.regions as copy_loops
from kvflow.backends import ObjectBatch, PutStatus
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.backends.arena.store import ArenaFile
from kvflow.config import parse_size
from kvflow.tools.baselines import CacheFlush

SLOT = 256 << 10
CAPACITY = 256 << 20  # 1,024 slots: the puts evict from the fifth batch of 256 on


def _timed(times: list[float], call: Callable[..., Any], *, awaited: bool) -> Callable[..., Any]:
    if awaited:

        @functools.wraps(call)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - start)

        return timed_async

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    return timed


async def measure(
    batch: int, size: int, regions: int, puts: int, before: Callable[[], object] = lambda: None
) -> dict[str, float]:
    """Medians per stage of ``puts`` puts, ``before`` called ahead of each (untimed)."""
    names = ("claim", "claim section", "copy", "write", "publish", "put")
    times: dict[str, list[float]] = {name: [] for name in names}
    patches = [
        (ArenaFile, "claim", times["claim"], False),
        (ArenaFile, "publish", times["publish"], False),
        (ArenaBackend, "_claim", times["claim section"], True),
        (ArenaBackend, "_write", times["write"], True),
        (ArenaBackend, "put", times["put"], True),
        (copy_loops, "copy_rows", times["copy"], False),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _, _ in patches]
    for owner, name, into, awaited in patches:
        setattr(owner, name, _timed(into, getattr(owner, name), awaited=awaited))
    root = tempfile.mkdtemp(prefix="kvflow-put-stages-", dir="/dev/shm")
    source = torch.randn(batch * size // 4)
    region = size // regions
    offsets = np.arange(batch, dtype=np.int64)[:, None] * size + np.arange(regions, dtype=np.int64) * region
    addrs = source.data_ptr() + offsets
    try:
        config = ArenaConfig(path=f"{root}/store", capacity_bytes=CAPACITY, slot_bytes=SLOT)
        backend = ArenaBackend(config)
        try:
            for i in range(puts):
                keys = [f"put-stages-{i}-{j}" for j in range(batch)]
                before()
                statuses = await backend.put(ObjectBatch(keys, addrs, [region] * regions, size))
                if set(statuses) != {PutStatus.STORED}:
                    raise RuntimeError(f"put {i} did not store every object: {statuses}")
        finally:
            await backend.aclose()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        shutil.rmtree(root, ignore_errors=True)
    skip = puts // 4
    return {name: statistics.median(values[skip:]) * 1e6 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", default="64KiB")
    parser.add_argument("--regions", type=int, default=8)
    parser.add_argument("--puts", type=int, default=400)
    parser.add_argument("--flush", action="store_true", help="flush the CPU's caches before each put")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    before = CacheFlush() if args.flush else (lambda: None)
    stages = anyio.run(measure, args.batch, parse_size(args.size), args.regions, args.puts, before)
    if args.json:
        print(json.dumps(stages))
        return
    state = ", caches flushed before each" if args.flush else ""
    what = f"{args.batch} objects of {args.size} in {args.regions} regions{state}"
    print(f"arena put of {what}: us per put, medians")
    print("  ".join(f"{name} {value:.1f}" for name, value in stages.items()))


if __name__ == "__main__":
    main()
