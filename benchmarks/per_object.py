"""Where a small object's time goes: each layer of a retrieve and a store timed alone, per object.

    python benchmarks/per_object.py [--backend URL] [--sizes 64KiB,256KiB] [--batch 64]
                                    [--regions 8] [--calls 200] [--repeat 5] [--hashes] [--flush]
                                    [--json]

For a batch of engine blocks whose objects are ``--regions`` regions of one size each (one per
layer, in vLLM's CPU layout), it times, in microseconds per object, best of ``--repeat`` runs of
``--calls`` calls each (every column alike, the memcpy baselines too):

- memcpy: the same bytes copied in object-sized chunks, one call of the compiled copy loop
  (memmove); memcpy streamed: the same with streaming stores, the kind of copy puts and gets
  make (their baseline is the faster of the two);
- copy: the objects' region copies alone, the call a backend's get makes, from one buffer per
  object into the cache, streamed (:mod:`kvflow.backends.copies`); gather: the call a put makes,
  from the cache into one buffer per object, streamed;
- backend get / put: the backend's own call with the batch (puts under new keys each call, into a
  store with room for about one batch, so every put evicts, as a cache in service does);
- pool retrieve / store / lookup: :class:`kvflow.KVPool` calls for the same blocks, named by
  their tokens (the pool hashes them), or with ``--hashes`` by block hashes made beforehand, as
  vLLM's connector names them (the pool's own work without the hash chain).

With ``--flush`` each timed call starts with the CPU's caches flushed
(:class:`kvflow.tools.baselines.CacheFlush`, untimed), as ``kvflow bench`` times its calls and as
an engine's store or load after a forward finds them; a run's time is then the sum of its calls'
(give fewer ``--calls``: each flush reads 256 MiB or more).

Each layer's figure minus the one below it is what that layer adds. Every timed call's statuses
or hit counts are counted inside the timing (a run that moved fewer than every object fails), and
after each run, outside the timing, what the last call wrote is compared with what was stored
(the caches zeroed before a run of loads; a run of puts or stores ends with its last one read
back). A store given by ``--backend`` (default ``memory://``) is left as it was found, but for the
pools' profile announcements; a store directory it names that did not exist is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import attrs
import numpy as np
import torch

from kvflow import KVPool, KVRequest, PoolConfig
from kvflow.backends import GetStatus, ObjectBatch, PutStatus, open_backend
from kvflow.backends.arena import ArenaConfig
from kvflow.backends.copies import gather_objects, scatter_objects
from kvflow.backends.local import LocalConfig
from kvflow.config import parse_size
from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.tools.baselines import Before, CacheFlush, MemcpyCall, memcpy_call

BLOCK = 16  # tokens per block


def _caches(object_bytes: int, regions: int, blocks: int) -> dict[str, torch.Tensor]:
    """vLLM-CPU-layout caches of ``regions`` layers whose whole-block objects are ``object_bytes``."""
    per_layer = object_bytes // regions // 2  # float16 elements of one layer of a block
    return {f"l{i}": torch.randn(blocks, 1, BLOCK, per_layer // BLOCK).half() for i in range(regions)}


@attrs.define
class Timed:
    """One column: ``call(i)`` is timed and returns how many objects its ``i``-th call moved (a
    status or hit count, summed inside the timed loop: one addition a call); ``prepare(r)`` and
    ``check(r)`` run before and after repetition ``r``, outside the timing (zeroing the caches a
    load writes, comparing what it wrote with what was stored)."""

    what: str
    call: Callable[[int], Awaitable[int]]
    prepare: Callable[[int], None] = lambda _: None
    check: Callable[[int], Awaitable[None]] | None = None


async def _per_object(calls: int, repeat: int, batch: int, timed: Timed, before: Before = None) -> float:
    """Microseconds per object: the best of ``repeat`` runs of ``calls`` calls, averaged per call
    and object; each call is timed alone (right after ``before``, untimed) and a run's time is the
    sum of its calls'. Raises unless every call moved all ``batch`` objects and each run's check
    passed: a call that moved nothing must fail the benchmark, not report a speed."""
    best = float("inf")
    for r in range(repeat):
        timed.prepare(r)
        moved = 0
        elapsed = 0.0
        for i in range(calls):
            if before is not None:
                before()
            start = time.perf_counter()
            moved += await timed.call(r * calls + i)
            elapsed += time.perf_counter() - start
        best = min(best, elapsed)
        if moved != calls * batch:
            raise RuntimeError(
                f"{timed.what}: {moved} of {calls * batch} objects moved in {calls} timed calls; "
                "give the store room for two batches (--backend) or look at the backend"
            )
        if timed.check is not None:
            await timed.check(r)
    return best / calls / batch * 1e6


def _store_dir(url: str) -> str | None:
    """The directory of a store in one (``arena://``, ``local://``), else None."""
    if url.startswith("arena:"):
        return ArenaConfig.from_url(url).path
    if url.startswith("local:"):
        return LocalConfig.from_url(url).path
    return None


@contextlib.contextmanager
def _removed_if_new(url: str) -> Iterator[None]:
    """A store directory the URL names that did not exist before is removed at the end (one that
    did keeps only the pools' profile announcements)."""
    directory = _store_dir(url)
    created = directory is not None and not os.path.exists(directory)
    try:
        yield
    finally:
        if created and directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


async def measure(
    url: str,
    size: int,
    batch: int,
    regions: int,
    calls: int,
    repeat: int,
    by_hashes: bool = False,
    before: Before = None,
) -> dict[str, Any]:
    """Time every column for one object size (``before``: called ahead of each timed call,
    untimed). The objects it stores are removed at the end."""
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

    def zero(_: int = 0) -> None:
        for t in dst.values():
            t.zero_()

    def same(what: str) -> None:
        if not all(torch.equal(src[k], dst[k]) for k in src):
            raise RuntimeError(f"{what} left other bytes in the caches than were stored")

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
        zero()
        if (await writer.store(kept)).stored != batch:
            raise RuntimeError("the store could not hold one batch: give it more room")
        got = await reader.retrieve(kept)
        if got.hit_blocks != batch or not all(torch.equal(src[k], dst[k]) for k in src):
            raise RuntimeError("the pool's retrieve returned other bytes than were stored")

        # written (ones): pages never written read as the kernel's one zero page, always in cache;
        # then the blocks' bytes, so that the copy into the caches can be checked
        buffers = torch.ones(nbytes * batch, dtype=torch.uint8)
        starts = (buffers.data_ptr() + nbytes * np.arange(batch, dtype=np.int64)).tolist()
        gather_objects(starts, objects(writer_rows, held))
        copied, gathered = objects(reader_rows, held), objects(writer_rows, held)
        plain, streamed = (
            memcpy_call(nbytes * batch, nbytes),
            memcpy_call(nbytes * batch, nbytes, stream=True),
        )

        def memcpy(call: MemcpyCall) -> Timed:
            async def run(_: int) -> int:
                call()
                return batch

            async def check(_: int) -> None:
                if not call.copied():
                    raise RuntimeError("the memcpy baseline did not copy its bytes")

            def clear(_: int) -> None:
                call.dst.zero_()

            return Timed("memcpy", run, clear, check)

        async def copy(_: int) -> int:
            scatter_objects(starts, copied)
            return batch

        async def gather(_: int) -> int:
            gather_objects(starts, gathered)
            return batch

        def clear_buffers(_: int) -> None:
            buffers.zero_()

        async def gathered_whole(_: int) -> None:  # the buffers, copied into zeroed caches, are the blocks
            zero()
            scatter_objects(starts, copied)
            same("the gather")

        async def get(_: int) -> int:
            return (await backend.get(copied)).count(GetStatus.HIT)

        async def retrieve(_: int) -> int:
            return (await reader.retrieve(kept)).hit_blocks

        async def lookup(_: int) -> int:
            return await reader.lookup(kept) // BLOCK

        async def put(i: int) -> int:
            return (await backend.put(objects(writer_rows, keys(i)))).count(PutStatus.STORED)

        async def store(i: int) -> int:
            return (await writer.store(fresh(i))).stored

        def fresh(i: int) -> KVRequest:
            request = (
                KVRequest(block_ids=ids, block_hashes=chains[i])
                if by_hashes
                else KVRequest(block_ids=ids, tokens=[i + 1, *range(1, BLOCK * batch)])
            )
            stored.append(request)
            return request

        async def loaded(what: str) -> None:
            same(what)

        async def last_put(r: int) -> None:  # the run's last put read back: it held the bytes
            zero()
            if (await backend.get(objects(reader_rows, keys(r * calls + calls - 1)))).count(
                GetStatus.HIT
            ) != batch:
                raise RuntimeError("the backend lost the objects of its last timed put: give it more room")
            same("a get of the last timed put")

        async def last_store(_: int) -> None:  # the run's last store read back
            zero()
            if (await reader.retrieve(stored[-1])).hit_blocks != batch:
                raise RuntimeError("the pool lost the blocks of its last timed store: give it more room")
            same("a retrieve of the last timed store")

        columns = {
            "memcpy": memcpy(plain),
            "memcpy_streamed": memcpy(streamed),
            "gather": Timed("gather", gather, clear_buffers, gathered_whole),
            "copy": Timed("copy", copy, zero, lambda _: loaded("the copy")),
            "backend_get": Timed("backend get", get, zero, lambda _: loaded("the backend's get")),
            "pool_retrieve": Timed("pool retrieve", retrieve, zero, lambda _: loaded("the pool's retrieve")),
            "pool_lookup": Timed("pool lookup", lookup),
            "backend_put": Timed("backend put", put, check=last_put),
            "pool_store": Timed("pool store", store, check=last_store),
        }
        row: dict[str, Any] = {"object_kib": nbytes / 1024, "batch": batch, "regions": len(sizes)}
        for name, timed in columns.items():
            row[f"{name}_us"] = await _per_object(calls, repeat, batch, timed, before)
        return row
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
    parser.add_argument(
        "--flush", action="store_true", help="flush the CPU's caches before each timed call (untimed)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    before = CacheFlush() if args.flush else None
    shape = (args.batch, args.regions, args.calls, args.repeat, args.hashes, before)
    with _removed_if_new(args.backend):
        rows = [anyio.run(measure, args.backend, size, *shape) for size in sizes]
    if args.json:
        print(json.dumps(rows))
        return
    named = "hashes" if args.hashes else "tokens"
    columns = [
        "memcpy",
        "memcpy_streamed",
        "gather",
        "copy",
        "backend_get",
        "pool_retrieve",
        "pool_lookup",
        "backend_put",
        "pool_store",
    ]
    print(
        f"backend {args.backend}: us per object, batches of {args.batch},"
        f" best of {args.repeat} x {args.calls} calls, blocks named by {named}"
        + (", caches flushed before each call" if args.flush else "")
    )
    print("  object regions " + " ".join(f"{c:>13}" for c in columns))
    for row in rows:
        cells = " ".join(f"{row[c + '_us']:>13.2f}" for c in columns)
        print(f"  {row['object_kib']:>5.0f}Ki {row['regions']:>7} {cells}")


if __name__ == "__main__":
    main()
