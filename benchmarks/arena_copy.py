"""The arena's limit: the copies a put or get must make, at the places the arena makes them,
beside kvflow's stores and retrieves of the same blocks.

    python benchmarks/arena_copy.py [--sizes 64KiB,256KiB,1MiB] [--batch 64] [--capacity 2GiB]
                                    [--slot 2MiB] [--repeat 20] [--json]

A private arena store (a new directory under /dev/shm, removed at the end) of ``--capacity`` cut
into ``--slot`` slots. For a batch of ``--batch`` engine blocks of each size (4 regions each, in
vLLM's CPU layout) it times, best of ``--repeat``, in GB/s:

- memcpy: the batch's bytes copied in object-sized chunks between two buffers
  (:func:`kvflow.tools.baselines.memcpy_gbps`, the baseline of ``kvflow bench``), by memmove and
  by streaming stores; the copies into and out of slots, the store and the retrieve are compared
  with the faster of the two (puts and gets stream, and out of the CPU's caches the streamed copy
  is often 1.2-1.7x memmove), the copy into slots by memmove with memmove;
- slots in / slots out: the blocks' regions copied by the copy loop into (out of) ``--batch``
  slots of the arena drawn at random, other ones each repetition. A claim takes a slot of the
  set the key hashes to, so a store's objects land spread over the whole region, in memory that
  is cold in the CPU caches and in the TLB (a 2 GiB region of 4 KiB pages): this is the copy a put
  or get must make, where it must make it, with nothing else. Each is made as the backend makes
  it, with streaming stores (:mod:`kvflow.backends.copies`);
- slots in, memmove: the copy into slots with ordinary stores instead, what the streaming
  stores gain over it;
- store / retrieve: ``KVPool`` calls over that store for the same blocks, a new prompt each
  repetition (a store that is full evicts at every put), then the last one read back repeatedly,
  as ``kvflow bench`` does.

``slots in/memcpy`` and ``slots out/memcpy`` are the most an arena put or get can reach on this
machine; ``store/slots`` and ``retrieve/slots`` are what kvflow's own work leaves of it. Every
retrieve is made into zeroed caches and checked against what was stored, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

import anyio
import numpy as np
import torch

from kvflow import KVPool, KVRequest, PoolConfig
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.config import parse_size
from kvflow.layout import KVLayout
from kvflow.regions import copy_rows
from kvflow.tools.baselines import best_s, plain_and_streamed_gbps

BLOCK = 16  # tokens per block
REGIONS = 4  # layers: one region per layer and block in vLLM's CPU layout


def _caches(object_bytes: int, blocks: int) -> dict[str, torch.Tensor]:
    per_layer = object_bytes // REGIONS // 2  # float16 elements of one layer of a block
    return {f"l{i}": torch.randn(blocks, 1, BLOCK, per_layer // BLOCK).half() for i in range(REGIONS)}


async def measure(root: str, size: int, batch: int, capacity: int, slot: int, repeat: int) -> dict[str, Any]:
    src = _caches(size, batch)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    writer_layout, reader_layout = KVLayout.from_kv_caches(src), KVLayout.from_kv_caches(dst)
    nbytes = writer_layout.block_nbytes * batch
    ids = list(range(batch))
    sizes = np.asarray(writer_layout.unit_sizes(None), dtype=np.int64)
    backend = ArenaBackend(ArenaConfig(path=f"{root}/store-{size}", capacity_bytes=capacity, slot_bytes=slot))
    try:
        # The raw copies first: they write into slots no object holds yet (nothing is stored).
        arena = backend._arena  # the mapped region: only its slot addresses are used
        rng = np.random.default_rng(0)

        def slots() -> np.ndarray:
            rows = rng.choice(arena.geometry.rows, size=batch, replace=False)
            return arena.base + rows.astype(np.int64) * arena.geometry.slot_bytes

        into = iter([slots() for _ in range(repeat + 1)])  # other slots each time (one warm-up call)
        out_of = iter([slots() for _ in range(repeat + 1)])
        writer_rows, reader_rows = writer_layout.addr_rows(ids), reader_layout.addr_rows(ids)
        into_plain = iter([slots() for _ in range(repeat + 1)])
        slots_in_s = best_s(
            lambda: copy_rows(next(into), writer_rows, sizes, into_regions=False, stream=True), repeat
        )
        slots_out_s = best_s(
            lambda: copy_rows(next(out_of), reader_rows, sizes, into_regions=True, stream=True), repeat
        )
        memmove_s = best_s(
            lambda: copy_rows(next(into_plain), writer_rows, sizes, into_regions=False), repeat
        )

        model = f"arena-copy-{time.time_ns()}"
        writer = KVPool.create(PoolConfig(model=model), layout=writer_layout, backend=backend)
        reader = KVPool.create(PoolConfig(model=model), layout=reader_layout, backend=backend)
        requests = [KVRequest(block_ids=ids, tokens=[i + 1, *range(1, BLOCK * batch)]) for i in range(repeat)]
        store_s = retrieve_s = float("inf")
        for request in requests:  # back to back, as the copies above
            start = time.perf_counter()
            result = await writer.store(request)
            store_s = min(store_s, time.perf_counter() - start)
            if result.stored != batch:
                raise RuntimeError(f"the arena stored {result.stored} of {batch} blocks: give it more room")
        for _ in range(repeat):  # the last prompt stored, as kvflow bench reads
            for t in dst.values():  # (outside the timing) each retrieve must bring every byte
                t.zero_()
            start = time.perf_counter()
            got = await reader.retrieve(requests[-1])
            retrieve_s = min(retrieve_s, time.perf_counter() - start)
            if got.hit_blocks != batch:
                raise RuntimeError(f"the retrieve loaded {got.hit_blocks} of {batch} blocks")
            if not all(torch.equal(src[k], dst[k]) for k in src):
                raise RuntimeError("the retrieve returned other bytes than were stored")
        # as often as the rest (a best of fewer catches the baseline low and flatters what is beside it)
        memcpy, streamed = plain_and_streamed_gbps(nbytes, writer_layout.block_nbytes, repeat=repeat)
        best_memcpy = max(memcpy, streamed)
        row = {
            "object_kib": writer_layout.block_nbytes / 1024,
            "batch": batch,
            "memcpy_gbps": memcpy,
            "streamed_memcpy_gbps": streamed,
            "best_memcpy_gbps": best_memcpy,
            "slots_in_gbps": nbytes / slots_in_s / 1e9,
            "slots_out_gbps": nbytes / slots_out_s / 1e9,
            "slots_in_memmove_gbps": nbytes / memmove_s / 1e9,
            "store_gbps": nbytes / store_s / 1e9,
            "retrieve_gbps": nbytes / retrieve_s / 1e9,
        }
        # what is copied streamed against the faster memcpy; the copy by memmove against memmove
        row["slots_in_vs_memcpy"] = row["slots_in_gbps"] / best_memcpy
        row["slots_out_vs_memcpy"] = row["slots_out_gbps"] / best_memcpy
        row["slots_in_memmove_vs_memcpy"] = row["slots_in_memmove_gbps"] / memcpy
        row["store_vs_memcpy"] = row["store_gbps"] / best_memcpy
        row["retrieve_vs_memcpy"] = row["retrieve_gbps"] / best_memcpy
        row["store_vs_slots"] = row["store_gbps"] / row["slots_in_gbps"]
        row["retrieve_vs_slots"] = row["retrieve_gbps"] / row["slots_out_gbps"]
        return row
    finally:
        await backend.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64KiB,256KiB,1MiB")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--capacity", default="2GiB")
    parser.add_argument("--slot", default="2MiB")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    capacity, slot = parse_size(args.capacity), parse_size(args.slot)
    root = tempfile.mkdtemp(prefix="kvflow-arena-copy-", dir="/dev/shm")
    try:
        rows = [
            anyio.run(measure, root, parse_size(size), args.batch, capacity, slot, args.repeat)
            for size in args.sizes.split(",")
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows))
        return
    columns = [
        "memcpy_gbps",
        "best_memcpy_gbps",
        "slots_in_gbps",
        "slots_out_gbps",
        "store_gbps",
        "retrieve_gbps",
        "slots_in_vs_memcpy",
        "slots_out_vs_memcpy",
        "slots_in_memmove_vs_memcpy",
        "store_vs_slots",
        "retrieve_vs_slots",
    ]
    print(f"arena of {args.capacity} in {args.slot} slots; batches of {args.batch}, best of {args.repeat}")
    print("  object " + " ".join(f"{c.replace('_gbps', ' GB/s').replace('_vs_', '/'):>19}" for c in columns))
    for row in rows:
        print(f"  {row['object_kib']:>5.0f}Ki " + " ".join(f"{row[c]:>19.2f}" for c in columns))


if __name__ == "__main__":
    main()
