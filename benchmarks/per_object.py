"""Where a small object's time goes: each layer of a retrieve and a store timed alone, per object.

    python benchmarks/per_object.py [--backend URL] [--sizes 64KiB,256KiB] [--batch 64]
                                    [--regions 8] [--calls 200] [--repeat 5] [--hashes] [--json]

For a batch of engine blocks whose objects are ``--regions`` regions of one size each (one per
layer, in vLLM's CPU layout), it times, in microseconds per object, best of ``--repeat`` runs of
``--calls`` calls each:

- memcpy: the same bytes copied in object-sized chunks, one call of the compiled copy loop;
- copy: the objects' region copies alone, the call a backend makes (:mod:`kvflow.backends.copies`);
- backend get / put: the backend's own call with the batch (puts under new keys each call, into a
  store with room for about one batch, so every put evicts, as a cache in service does);
- pool retrieve / store / lookup: :class:`kvflow.KVPool` calls for the same blocks, named by
  their tokens (the pool hashes them), or with ``--hashes`` by block hashes made beforehand, as
  vLLM's connector names them (the pool's own work without the hash chain).

Each layer's figure minus the one below it is what that layer adds. What was retrieved is checked
against what was stored once, outside the timing. A store given by ``--backend`` (default
``memory://``) is left as it was found, but for the pools' profile announcements.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import torch

from kvflow import KVPool, KVRequest, PoolConfig
from kvflow.backends import ObjectBatch, open_backend
from kvflow.backends.copies import scatter_objects
from kvflow.config import parse_size
from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.tools.baselines import memcpy_gbps

BLOCK = 16  # tokens per block


def _caches(object_bytes: int, regions: int, blocks: int) -> dict[str, torch.Tensor]:
    """vLLM-CPU-layout caches of ``regions`` layers whose whole-block objects are ``object_bytes``."""
    per_layer = object_bytes // regions // 2  # float16 elements of one layer of a block
    return {f"l{i}": torch.randn(blocks, 1, BLOCK, per_layer // BLOCK).half() for i in range(regions)}


async def _per_object(calls: int, repeat: int, batch: int, call: Callable[[int], Awaitable[object]]) -> float:
    best = float("inf")
    for r in range(repeat):
        start = time.perf_counter()
        for i in range(calls):
            await call(r * calls + i)
        best = min(best, time.perf_counter() - start)
    return best / calls / batch * 1e6


async def measure(
    url: str, size: int, batch: int, regions: int, calls: int, repeat: int, by_hashes: bool = False
) -> dict[str, Any]:
    src = _caches(size, regions, batch)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    writer_layout, reader_layout = KVLayout.from_kv_caches(src), KVLayout.from_kv_caches(dst)
    nbytes = writer_layout.block_nbytes
    room = 2 * nbytes * batch + (2 << 20)
    backend = open_backend(f"memory://?capacity={room}" if url == "memory://" else url)
    model = f"per-object-{time.time_ns()}"
    writer = KVPool.create(PoolConfig(model=model), layout=writer_layout, backend=backend)
    reader = KVPool.create(PoolConfig(model=model), layout=reader_layout, backend=backend)
    ids = list(range(batch))
    kept = (
        KVRequest(block_ids=ids, block_hashes=hash_blocks(range(BLOCK * batch), BLOCK))
        if by_hashes
        else KVRequest(block_ids=ids, tokens=range(BLOCK * batch))
    )
    # with --hashes, each store's new prompt named by hashes made before the timing
    chains = (
        [hash_blocks([i + 1, *range(1, BLOCK * batch)], BLOCK) for i in range(calls * repeat)]
        if by_hashes
        else []
    )
    stored: list[KVRequest] = [kept]
    sizes = writer_layout.unit_sizes(None)
    writer_rows, reader_rows = writer_layout.addr_rows(ids), reader_layout.addr_rows(ids)
    held = [f"{model}-held-{j}" for j in range(batch)]

    def keys(i: int) -> list[str]:  # the backend's own puts: new keys each call
        return [f"{model}-{i}-{j}" for j in range(batch)]

    def objects(rows: np.ndarray, names: list[str]) -> ObjectBatch:
        return ObjectBatch(keys=names, addrs=rows, sizes=sizes, nbytes=nbytes)

    try:
        put_ok = await backend.put(objects(writer_rows, held))
        got_ok = await backend.get(objects(reader_rows, held))
        if (
            not all(torch.equal(src[k], dst[k]) for k in src)
            or len(set(put_ok)) != 1
            or len(set(got_ok)) != 1
        ):
            raise RuntimeError(
                f"the backend's put and get of one batch did not round-trip: {put_ok} {got_ok}"
            )
        for t in dst.values():
            t.zero_()
        if (await writer.store(kept)).stored != batch:
            raise RuntimeError("the store could not hold one batch: give it more room")
        got = await reader.retrieve(kept)
        if got.hit_blocks != batch or not all(torch.equal(src[k], dst[k]) for k in src):
            raise RuntimeError("the pool's retrieve returned other bytes than were stored")

        # written (ones): pages never written read as the kernel's one zero page, always in cache
        buffers = torch.ones(nbytes * batch, dtype=torch.uint8)
        starts = (buffers.data_ptr() + nbytes * np.arange(batch, dtype=np.int64)).tolist()
        copied = objects(reader_rows, held)

        async def copy(_: int) -> None:
            scatter_objects(starts, copied)

        async def put(i: int) -> None:
            await backend.put(objects(writer_rows, keys(i)))

        def fresh(i: int) -> KVRequest:
            request = (
                KVRequest(block_ids=ids, block_hashes=chains[i])
                if by_hashes
                else KVRequest(block_ids=ids, tokens=[i + 1, *range(1, BLOCK * batch)])
            )
            stored.append(request)
            return request

        gbps = memcpy_gbps(nbytes * batch, nbytes, repeat=calls * repeat)  # as warm as the copies below
        return {
            "object_kib": nbytes / 1024,
            "batch": batch,
            "regions": len(sizes),
            "memcpy_us": nbytes / gbps / 1e3,
            "copy_us": await _per_object(calls, repeat, batch, copy),
            "backend_get_us": await _per_object(calls, repeat, batch, lambda _: backend.get(copied)),
            "pool_retrieve_us": await _per_object(calls, repeat, batch, lambda _: reader.retrieve(kept)),
            "pool_lookup_us": await _per_object(calls, repeat, batch, lambda _: reader.lookup(kept)),
            "backend_put_us": await _per_object(calls, repeat, batch, put),
            "pool_store_us": await _per_object(calls, repeat, batch, lambda i: writer.store(fresh(i))),
        }
    finally:
        for request in stored:
            await writer.remove(request)
        await backend.remove(held)
        for i in range(calls * repeat):
            await backend.remove(keys(i))
        await backend.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="memory://")
    parser.add_argument("--sizes", default="64KiB,256KiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--regions", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hashes", action="store_true", help="name the pool's blocks by hashes, not tokens")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = [
        anyio.run(measure, args.backend, size, args.batch, args.regions, args.calls, args.repeat, args.hashes)
        for size in sizes
    ]
    if args.json:
        print(json.dumps(rows))
        return
    named = "hashes" if args.hashes else "tokens"
    columns = ["memcpy", "copy", "backend_get", "pool_retrieve", "pool_lookup", "backend_put", "pool_store"]
    print(
        f"backend {args.backend}: us per object, batches of {args.batch},"
        f" best of {args.repeat} x {args.calls} calls, blocks named by {named}"
    )
    print("  object regions " + " ".join(f"{c:>13}" for c in columns))
    for row in rows:
        cells = " ".join(f"{row[c + '_us']:>13.2f}" for c in columns)
        print(f"  {row['object_kib']:>5.0f}Ki {row['regions']:>7} {cells}")


if __name__ == "__main__":
    main()
