"""What a call's fixed steps cost from cold caches, beside a pool retrieve of 256 objects of 64 KiB.

    python benchmarks/cold_costs.py [--repeat 40] [--json]

An engine's store or load finds the CPU's caches full of what its forward touched, so every step of
kvflow's call, however short, runs from memory: its Python code, its objects, the event loop's own.
Each step below is timed alone right after a cache flush (:class:`kvflow.tools.baselines.CacheFlush`,
untimed), median of ``--repeat``, in microseconds, and given as a share of a whole pool retrieve of
256 objects of 64 KiB (4 regions each, by block hashes, from the memory backend) timed the same way
in the same run (checked against what was stored). Its region copies alone, by one call of the copy
loop, are the ``copy`` row.

- ``retrieve``: that pool retrieve; ``copy``: its copies alone (streamed, as the backend's get makes
  them);
- ``retrieve_one``, ``store_one``: a pool retrieve and a store of one block of 64 KiB (the store's
  new each time): a pool call's fixed work, which a call of any size pays once, beside one small
  copy. A call of ``n`` bytes copied at memcpy's speed reaches at most ``copy / (copy + fixed)``
  of memcpy;
- ``coroutine``: calling and awaiting a coroutine that returns at once;
- ``loop_iteration``: ``asyncio.sleep(0)``, one turn of the event loop; ``anyio_checkpoint``:
  ``anyio.lowlevel.checkpoint()``, the same turn behind anyio's look-up of the running library
  (every backend call ends with one, so that calls in a row share the loop);
- ``deadline_scope``: entering and leaving ``anyio.move_on_after`` (each batch of backend calls
  runs under one, for the request's deadline);
- ``int_array``: ``numpy.asarray`` of 256 Python ints (a batch's block ids or buffer addresses);
- ``compiled_copy``: one call of the compiled copy loop (:func:`kvflow.regions.copy_rows`) that
  copies 64 bytes (a run's fixed cost, made once per 4 MiB);
- ``handover_callback``, ``handover_coroutine``, ``handover_kvflow``: from an engine thread, the
  round trip of a call answered on an event loop in another thread: a bare callback
  (``call_soon_threadsafe`` setting a future), ``asyncio.run_coroutine_threadsafe`` of a coroutine
  returning at once, and :meth:`kvflow.loop.LoopThread.call` of the same (what every call of a
  synchronous engine's :class:`kvflow.SyncPool` and the vLLM connector pays).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import itertools
import json
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

from kvflow import KVPool, KVRequest, PoolConfig, regions
from kvflow.backends import open_backend
from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.loop import LoopThread
from kvflow.tools.baselines import CacheFlush

BLOCK = 16  # tokens per block
OBJECT = 64 << 10
BATCH = 256
REGIONS = 4


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


async def _timed(
    step: Callable[[], Awaitable[object]],
    repeat: int,
    flush: Callable[[], object],
    *,
    prepare: Callable[[], object] = lambda: None,
    check: Callable[[object], None] = lambda _: None,
) -> float:
    """The median microseconds of ``repeat`` awaits of ``step()``, each right after ``prepare``
    and ``flush`` (untimed) and followed by ``check`` of what it returned (untimed)."""
    samples = []
    for i in range(repeat + 1):  # (the first untimed: the first call pays for imports, compiles)
        prepare()
        flush()
        start = time.perf_counter_ns()
        result = await step()
        if i:
            samples.append(time.perf_counter_ns() - start)
        check(result)
    return _median_us(samples)


def _handovers(repeat: int, flush: Callable[[], object]) -> dict[str, float]:
    """Round trips from this thread to an event loop in another and back, from flushed caches."""

    async def nothing() -> int:
        return 1

    def answered(future: concurrent.futures.Future[int]) -> None:
        future.set_result(1)

    out: dict[str, float] = {}
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cold-costs-loop", daemon=True)
    thread.start()
    kvflow_loop = LoopThread(name="cold-costs-kvflow").start()
    try:

        def callback() -> object:
            future: concurrent.futures.Future[int] = concurrent.futures.Future()
            loop.call_soon_threadsafe(answered, future)
            return future.result(timeout=10)

        trips: dict[str, Callable[[], object]] = {
            "handover_callback": callback,
            "handover_coroutine": lambda: asyncio.run_coroutine_threadsafe(nothing(), loop).result(10),
            "handover_kvflow": lambda: kvflow_loop.call(nothing, timeout_s=10),
        }
        for name, trip in trips.items():
            trip()
            samples = []
            for _ in range(repeat):
                flush()
                start = time.perf_counter_ns()
                if trip() != 1:
                    raise RuntimeError(f"{name}: the call did not answer 1")
                samples.append(time.perf_counter_ns() - start)
            out[name] = _median_us(samples)
    finally:
        kvflow_loop.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    return out


async def _in_loop(repeat: int, flush: Callable[[], object]) -> dict[str, float]:
    per_layer = OBJECT // REGIONS // 2  # float16 elements of one layer of a block
    src = {f"l{i}": torch.randn(BATCH, 1, BLOCK, per_layer // BLOCK).half() for i in range(REGIONS)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    backend = open_backend(f"memory://?capacity={2 * OBJECT * BATCH + (2 << 20)}")
    model = f"cold-costs-{time.time_ns()}"
    target = KVLayout.from_kv_caches(dst)
    writer = KVPool.create(PoolConfig(model=model), layout=KVLayout.from_kv_caches(src), backend=backend)
    reader = KVPool.create(PoolConfig(model=model), layout=target, backend=backend)
    ids = list(range(BATCH))
    request = KVRequest(block_ids=ids, block_hashes=hash_blocks(range(BLOCK * BATCH), BLOCK))
    rows = target.addr_rows(ids)
    sizes = np.asarray(target.unit_sizes(None), dtype=np.int64)
    staged = torch.empty(OBJECT * BATCH, dtype=torch.uint8)
    staged.fill_(7)
    starts = staged.data_ptr() + OBJECT * np.arange(BATCH, dtype=np.int64)
    tiny_src, tiny_dst = np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    tiny = (
        np.asarray([tiny_dst.ctypes.data], dtype=np.int64),
        np.asarray([[tiny_src.ctypes.data]], dtype=np.int64),
        np.asarray([64], dtype=np.int64),
    )
    numbers = [1000 + i for i in range(BATCH)]  # (beyond the small ints Python keeps once)
    one = KVRequest(block_ids=[0], block_hashes=request.block_hashes[:1])
    salts = itertools.count(1)
    fresh: list[KVRequest] = []  # each timed store's block, under a prompt never stored before

    def zero() -> None:  # each retrieve must bring every byte again
        for t in dst.values():
            t.zero_()

    def retrieved(got: object) -> None:
        if getattr(got, "hit_blocks", None) != BATCH or not all(torch.equal(src[k], dst[k]) for k in src):
            raise RuntimeError("the pool retrieve did not bring back every byte stored")

    def retrieved_one(got: object) -> None:
        if getattr(got, "hit_blocks", None) != 1 or not all(torch.equal(src[k][0], dst[k][0]) for k in src):
            raise RuntimeError("the pool retrieve of one block did not bring back its bytes")

    def new_block() -> None:
        fresh.append(
            KVRequest(block_ids=[0], block_hashes=hash_blocks([next(salts), *range(1, BLOCK)], BLOCK))
        )

    def stored_one(got: object) -> None:
        if getattr(got, "stored", None) != 1:
            raise RuntimeError("the pool store of one new block did not store it")

    async def nothing() -> None:
        return None

    async def scope() -> None:
        with anyio.move_on_after(60):
            await nothing()

    async def copy() -> None:
        regions.copy_rows(starts, rows, sizes, into_regions=True, stream=True)

    async def int_array() -> None:
        np.asarray(numbers, dtype=np.int64)

    async def compiled_copy() -> None:
        regions.copy_rows(*tiny, into_regions=True, stream=True)

    try:
        if (await writer.store(request)).stored != BATCH:
            raise RuntimeError("the memory backend could not hold one batch")
        retrieve = functools.partial(reader.retrieve, request)
        out = {"retrieve": await _timed(retrieve, repeat, flush, prepare=zero, check=retrieved)}
        one_retrieve = functools.partial(reader.retrieve, one)
        out["retrieve_one"] = await _timed(one_retrieve, repeat, flush, prepare=zero, check=retrieved_one)
        out["store_one"] = await _timed(
            lambda: writer.store(fresh[-1]), repeat, flush, prepare=new_block, check=stored_one
        )
        for block in fresh:  # (untimed) every store held the block's bytes
            zero()
            retrieved_one(await reader.retrieve(block))
        steps: dict[str, Callable[[], Awaitable[object]]] = {
            "copy": copy,
            "coroutine": nothing,
            "loop_iteration": lambda: asyncio.sleep(0),
            "anyio_checkpoint": anyio.lowlevel.checkpoint,
            "deadline_scope": scope,
            "int_array": int_array,
            "compiled_copy": compiled_copy,
        }
        for name, step in steps.items():
            out[name] = await _timed(step, repeat, flush)
        return out
    finally:
        await writer.aclose()
        await reader.aclose()


def measure(repeat: int, flush: Callable[[], object] | None = None) -> dict[str, Any]:
    """Every step's median microseconds from flushed caches, and its share of the retrieve's."""
    flush = CacheFlush() if flush is None else flush
    us = asyncio.run(_in_loop(repeat, flush))
    us.update(_handovers(repeat, flush))
    return {"us": us, "share_of_retrieve": {name: value / us["retrieve"] for name, value in us.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=40, help="timed calls of each step (median)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    result = measure(args.repeat)
    if args.json:
        print(json.dumps(result))
        return
    print(f"from flushed caches, median of {args.repeat}; share: of the pool retrieve of {BATCH} x 64 KiB")
    for name, value in result["us"].items():
        print(f"  {name:20s} {value:9.1f} us  {result['share_of_retrieve'][name]:6.3f}")


if __name__ == "__main__":
    main()
