"""``kvflow bench``: store / retrieve / lookup throughput as ratios to memcpy of the same bytes,
measured in the same run, and the pipeline's own per-block overhead."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import attrs
import torch
from tqdm import tqdm

from kvflow.backends import BackendCapabilities, BackendStats, GetStatus, ObjectRef, PutStatus, open_backend
from kvflow.config import PoolConfig
from kvflow.keys import KeyScope, block_keys, hash_blocks
from kvflow.layout import KVLayout
from kvflow.pool import KVPool
from kvflow.profiles import SLOT_BYTES
from kvflow.request import KVRequest
from kvflow.tools.baselines import (
    CacheFlush,
    bare_call_s,
    hash_chain_s,
    plain_and_streamed_gbps,
    region_copy_gbps,
    shared_call_s,
)
from kvflow.tools.machine import Machine, this_machine

__all__ = ["bench_main", "run_bench"]

LAYERS = 4


@attrs.define
class NullBackend:
    """Answers every call at once without copying: isolates the pipeline's own cost."""

    @property
    def max_batch(self) -> int:
        return 256

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities()

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        return [PutStatus.STORED] * len(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        return [GetStatus.HIT] * len(objects)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    def register_memory(self, addr: int, nbytes: int) -> None:
        pass

    def stats(self) -> BackendStats:
        return BackendStats()

    async def aclose(self) -> None:
        pass


def _caches(object_bytes: int, blocks: int) -> dict[str, torch.Tensor]:
    """vLLM-CPU-layout caches whose whole-block objects are ``object_bytes`` (LAYERS regions)."""
    per_layer = object_bytes // LAYERS // 2  # float16 elements per layer block
    return {f"l{i}": torch.randn(blocks, 1, 16, per_layer // 16).half() for i in range(LAYERS)}


async def _best(repeat: int, run: Callable[[int], Awaitable[float]]) -> float:
    return min([await run(i) for i in range(repeat)])


async def _store_retrieve(
    url: str, object_bytes: int, batch: int, repeat: int, flush: Callable[[], object] | None = None
) -> dict[str, float]:
    """A row: kvflow's best store and retrieve of ``batch`` objects beside their baselines, every
    timed call (kvflow's and each baseline's) made right after ``flush`` (a new one by default)."""
    flush = CacheFlush() if flush is None else flush
    src = _caches(object_bytes, batch)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    layout_src, layout_dst = KVLayout.from_kv_caches(src), KVLayout.from_kv_caches(dst)
    ids = list(range(batch))
    nbytes = layout_src.block_nbytes * batch
    # A cache in service runs full: the memory backend then recycles evicted buffers instead of
    # faulting in fresh pages, so give it room for exactly one batch (and the pool's announcement).
    room = nbytes + SLOT_BYTES
    backend = open_backend(f"memory://?capacity={room}" if url == "memory://" else url)
    # One pool writes every batch, as an engine's does (only its first store announces its profile);
    # another, over the destination caches, reads.
    model = f"bench-{time.time_ns()}"
    writer = KVPool.create(PoolConfig(model=model), layout=layout_src, backend=backend)
    reader = KVPool.create(PoolConfig(model=model), layout=layout_dst, backend=backend)

    def request(i: int) -> KVRequest:
        return KVRequest(block_ids=ids, tokens=range(i, i + 16 * batch))

    async def load(i: int, what: str = "bench retrieve") -> float:
        """Retrieve request ``i`` into zeroed destination caches; raise unless every byte came back."""
        for tensor in dst.values():  # (outside any timing) each retrieve must bring every byte
            tensor.zero_()
        flush()
        start = time.perf_counter()
        result = await reader.retrieve(request(i))
        elapsed = time.perf_counter() - start
        if result.hit_blocks != batch:
            raise RuntimeError(f"{what} loaded {result.hit_blocks} of {batch} blocks")
        if not all(torch.equal(src[k], dst[k]) for k in src):
            raise RuntimeError(f"{what} returned different bytes than were stored")
        return elapsed

    async def store(i: int) -> float:
        flush()
        start = time.perf_counter()
        result = await writer.store(request(i))
        elapsed = time.perf_counter() - start
        if result.stored != batch:
            raise RuntimeError(f"bench store stored {result.stored} of {batch} blocks: {result}")
        await stored(i)  # outside the timing: a store that kept other bytes fails the run
        return elapsed

    async def stored(i: int) -> None:
        """Every block of store ``i`` is found and read back whole (the flush before each timed call
        leaves the next store's caches as cold as its baselines', whatever this read touched)."""
        if await reader.lookup(request(i)) != 16 * batch:
            raise RuntimeError(f"bench store {i} left some of its {batch} blocks out of the store")
        await load(i, f"bench store {i}'s read-back")

    async def retrieve(i: int) -> float:
        return await load(repeat - 1)  # the batch the last store wrote (earlier ones were evicted)

    try:
        store_s = await _best(repeat, store)
        retrieve_s = await _best(repeat, retrieve)
    finally:  # leave nothing in the store (it may be the user's own), also when a run failed
        with anyio.CancelScope(shield=True):
            for i in range(repeat):
                await writer.remove(request(i))
            await backend.aclose()
    base = await _baselines(layout_src, layout_dst, ids, request(0).tokens or (), object_bytes, repeat, flush)
    return _row(object_bytes, batch, nbytes / store_s / 1e9, nbytes / retrieve_s / 1e9, base)


async def _baselines(
    source: KVLayout,
    target: KVLayout,
    ids: list[int],
    tokens: Sequence[int],
    object_bytes: int,
    repeat: int,
    flush: Callable[[], object],
) -> dict[str, float]:
    """The baselines of a store and a retrieve of ``ids`` from ``source``'s caches into ``target``'s,
    each in the backends' kind of copy: puts and gets write with streaming stores
    (:mod:`kvflow.copyloops`)."""
    nbytes = source.block_nbytes * len(ids)
    # Each baseline is timed at least as often as kvflow's calls, memcpy twice as often: a best of
    # three moved by 20-30% from run to run on a shared VM, and a baseline caught low flatters kvflow.
    plain, streamed = plain_and_streamed_gbps(nbytes, object_bytes, repeat=2 * repeat, before=flush)
    hashes_s = hash_chain_s(tokens, 16, repeat=repeat, before=flush)
    regions = region_copy_gbps(source, ids, repeat=repeat, before=flush)
    retrieve_regions = region_copy_gbps(target, ids, repeat=repeat, into_regions=True, before=flush)
    bare_store_s, bare_retrieve_s = bare_call_s(source, target, ids, tokens, repeat=repeat, before=flush)
    shared_store_s, shared_retrieve_s = await shared_call_s(
        source, target, ids, tokens, repeat=repeat, before=flush
    )
    return {
        "memcpy_gbps": plain,  # memmove
        "streamed_memcpy_gbps": streamed,  # the same copy with streaming stores, as puts and gets copy
        "best_memcpy_gbps": max(plain, streamed),  # either direction's baseline: the faster of the two
        "regions_gbps": regions,  # a store's region copies: gathered, streamed
        "retrieve_regions_gbps": retrieve_regions,  # a retrieve's: scattered, streamed
        # the floors: those copies and the hash chain of the request's tokens, nothing else
        "floor_gbps": nbytes / (nbytes / regions / 1e9 + hashes_s) / 1e9,
        "retrieve_floor_gbps": nbytes / (nbytes / retrieve_regions / 1e9 + hashes_s) / 1e9,
        # a bare Python store and retrieve of the same blocks (kvflow.tools.baselines.bare_call_s)
        "bare_store_gbps": nbytes / bare_store_s / 1e9,
        "bare_retrieve_gbps": nbytes / bare_retrieve_s / 1e9,
        # the bare call sharing the loop as kvflow's in-process backends do (shared_call_s)
        "shared_store_gbps": nbytes / shared_store_s / 1e9,
        "shared_retrieve_gbps": nbytes / shared_retrieve_s / 1e9,
    }


def _row(
    object_bytes: int, batch: int, store_gbps: float, retrieve_gbps: float, base: dict[str, float]
) -> dict[str, float]:
    """One row: kvflow's throughputs, the baselines, and each direction's ratios to its own baseline
    (memcpy is the faster of the plain and the streamed copy, for either direction)."""
    memcpy = base["best_memcpy_gbps"]
    floor, retrieve_floor = base["floor_gbps"], base["retrieve_floor_gbps"]
    bare_store, bare_retrieve = base["bare_store_gbps"], base["bare_retrieve_gbps"]
    return {
        "object_kib": object_bytes / 1024,
        "batch": batch,
        "store_gbps": store_gbps,
        "retrieve_gbps": retrieve_gbps,
        **base,
        "store_vs_memcpy": store_gbps / memcpy,
        "retrieve_vs_memcpy": retrieve_gbps / memcpy,
        # the same blocks' region copies in one bare call of the copy loop: what the layout alone costs
        "store_vs_regions": store_gbps / base["regions_gbps"],
        "retrieve_vs_regions": retrieve_gbps / base["retrieve_regions_gbps"],
        # a floor's ratio to memcpy is the most any call of its direction by tokens can reach
        "floor_vs_memcpy": floor / memcpy,
        "retrieve_floor_vs_memcpy": retrieve_floor / memcpy,
        "store_vs_floor": store_gbps / floor,
        "retrieve_vs_floor": retrieve_gbps / retrieve_floor,
        # a bare call's ratio to memcpy is the most a Python call keyed per object reaches here
        "bare_store_vs_memcpy": bare_store / memcpy,
        "bare_retrieve_vs_memcpy": bare_retrieve / memcpy,
        "store_vs_bare": store_gbps / bare_store,
        "retrieve_vs_bare": retrieve_gbps / bare_retrieve,
        # ... and sharing the loop, as a call on kvflow's loop must: the most it reaches here
        "shared_store_vs_memcpy": base["shared_store_gbps"] / memcpy,
        "shared_retrieve_vs_memcpy": base["shared_retrieve_gbps"] / memcpy,
        "store_vs_shared": store_gbps / base["shared_store_gbps"],
        "retrieve_vs_shared": retrieve_gbps / base["shared_retrieve_gbps"],
    }


async def _limits(url: str) -> tuple[int | None, int | None]:
    """The largest object the backend stores, and how many it holds (None: no such limit)."""
    backend = open_backend(url)
    largest = backend.capabilities.max_object_bytes
    holds = None if largest is None else backend.stats().capacity_bytes // largest
    await backend.aclose()
    return largest, holds


async def _lookup_ms(url: str, blocks: int) -> tuple[float, float]:
    """Milliseconds of the first lookup of ``blocks`` stored blocks, and the best of three more (a
    backend may remember what it found: the local one does, until something is removed)."""
    caches = {"l0": torch.zeros(blocks, 1, 16, 8, dtype=torch.float16)}
    backend = open_backend(url)
    pool = KVPool.create(
        PoolConfig(model=f"bench-lookup-{time.time_ns()}"),
        layout=KVLayout.from_kv_caches(caches),
        backend=backend,
    )
    tokens = list(range(16 * blocks))
    hashes = hash_blocks(tokens, 16)
    times: list[float] = []
    try:
        await pool.store(KVRequest(block_ids=range(blocks), block_hashes=hashes))
        for _ in range(4):
            start = time.perf_counter()
            hit = await pool.lookup(KVRequest(block_hashes=hashes))
            times.append(time.perf_counter() - start)
            if hit != 16 * blocks:
                raise RuntimeError(f"bench lookup found {hit} of {16 * blocks} tokens")
    finally:  # leave nothing in the store, also when a run failed
        with anyio.CancelScope(shield=True):
            await pool.remove(KVRequest(block_hashes=hashes))
            await backend.aclose()
    return times[0] * 1e3, min(times[1:]) * 1e3


async def _pipeline_us(blocks: int) -> dict[str, float]:
    caches = _caches(256, blocks)  # the null backend copies nothing: the size does not matter
    config = PoolConfig(model="kvflow-bench-pipeline")
    pool = KVPool.create(config, layout=KVLayout.from_kv_caches(caches), backend=NullBackend())
    hashes = hash_blocks(list(range(16 * blocks)), 16)
    ids = range(blocks)
    out: dict[str, float] = {}
    request = KVRequest(block_ids=ids, block_hashes=hashes)
    for name, op in (("store", pool.store), ("retrieve", pool.retrieve)):
        start = time.perf_counter()
        await op(request)
        out[f"{name}_us_per_block"] = (time.perf_counter() - start) / blocks * 1e6
    scope = KeyScope("bench-model", "bfloat16.kv8x128", "flash_attn.123.123", 16, (0, 32), (0, 8))
    start = time.perf_counter()
    block_keys(scope, hashes)
    out["keys_ms_per_100k"] = (time.perf_counter() - start) / blocks * 1e5 * 1e3
    return out


async def run_bench(url: str, *, quick: bool, progress: bool) -> dict[str, Any]:
    sizes = [64 << 10, 1 << 20] if quick else [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
    batches = [64] if quick else [16, 64, 256]
    largest, holds = await _limits(url)
    skipped = [s for s in sizes if largest is not None and s > largest]
    cases = [(s, b) for s in sizes for b in batches if s * b <= (512 << 20) and s not in skipped]
    rows, flush = [], CacheFlush()
    for size, batch in tqdm(cases, desc="bench", disable=not progress):
        rows.append(await _store_retrieve(url, size, batch, repeat=2 if quick else 5, flush=flush))
    first_ms = lookup_ms = None
    if holds is None or holds >= 10_000:
        first_ms, lookup_ms = await _lookup_ms(url, 10_000)
    return {
        "backend": url,
        "store_retrieve": rows,
        "skipped_sizes": skipped,  # larger than the backend's largest object
        "objects_held": holds,  # None: no fixed number
        "lookup_10k_first_ms": first_ms,
        "lookup_10k_ms": lookup_ms,
        "pipeline": await _pipeline_us(20_000 if quick else 100_000),
        "machine": attrs.asdict(this_machine()),
    }


def bench_main(url: str, *, as_json: bool, quick: bool, layerwise: bool, plot: str | None = None) -> int:
    if layerwise:
        from kvflow.tools.bench_layerwise import layerwise_main

        return int(layerwise_main(as_json=as_json, quick=quick))
    if plot is not None:
        from kvflow.tools.bench_plot import check_plot_path

        check_plot_path(plot)  # before the run: say at once when matplotlib or the file cannot be had
    result = anyio.run(functools.partial(run_bench, url, quick=quick, progress=not as_json))
    if as_json:
        print(json.dumps(result))
    else:
        _print_table(url, result)
    if plot is not None:  # after the results: a file that fails to write loses none of them
        from kvflow.tools.bench_plot import plot_throughput

        plot_throughput(result, plot)
    return 0


_LEGEND = (
    "(puts and gets write with streaming stores: store/memcpy and retrieve/memcpy are against the",
    " faster of memcpy (memmove) and the streamed copy of the same bytes (streamed GB/s: out of the",
    " CPU's caches often 1.2-1.7x memmove, in them slower). regions: the same blocks' region copies,",
    " one per layer, by one bare call of the copy loop, streamed (a store's gathered, a retrieve's",
    " scattered into the regions); floor: those copies plus the sha256 hash chain of the request's",
    " tokens, the least any call does; bare: the floor plus a key text, a dict operation per object",
    " and nothing else, the least a Python call keyed per object does; shared: the bare call copying in",
    " runs of 4 MiB and letting the loop run between them as kvflow's in-process backends must, the",
    " least such a call does while it shares its loop: kvflow.tools.baselines. Every",
    " timed call, kvflow's and each baseline's, starts with the CPU's caches flushed (a read of eight",
    " times the largest cache, from 256 MiB to 1 GiB), as a store or a load finds KV in memory.",
    " Outside the timing, every timed store was looked up and read back whole, and every retrieve",
    " compared whole)",
)


def _print_table(url: str, result: dict[str, Any]) -> None:
    print(f"backend {url} on {Machine(**result['machine']).describe()}")
    columns = (
        ("store GB/s", "store_gbps"),
        ("retrieve GB/s", "retrieve_gbps"),
        ("memcpy GB/s", "memcpy_gbps"),
        ("streamed GB/s", "streamed_memcpy_gbps"),
        ("store/memcpy", "store_vs_memcpy"),
        ("retrieve/memcpy", "retrieve_vs_memcpy"),
        ("regions GB/s", "regions_gbps"),
        ("store/regions", "store_vs_regions"),
        ("retrieve/regions", "retrieve_vs_regions"),
        ("floor/memcpy", "floor_vs_memcpy"),
        ("retrieve floor/memcpy", "retrieve_floor_vs_memcpy"),
        ("store/floor", "store_vs_floor"),
        ("retrieve/floor", "retrieve_vs_floor"),
        ("bare store/memcpy", "bare_store_vs_memcpy"),
        ("bare retrieve/memcpy", "bare_retrieve_vs_memcpy"),
        ("store/bare", "store_vs_bare"),
        ("retrieve/bare", "retrieve_vs_bare"),
        ("shared store/memcpy", "shared_store_vs_memcpy"),
        ("shared retrieve/memcpy", "shared_retrieve_vs_memcpy"),
        ("store/shared", "store_vs_shared"),
        ("retrieve/shared", "retrieve_vs_shared"),
    )
    print(f"{'object':>8} {'batch':>5} " + " ".join(title for title, _ in columns))
    for r in result["store_retrieve"]:
        cells = " ".join(f"{r[key]:>{len(title)}.2f}" for title, key in columns)
        print(f"{r['object_kib']:>6.0f}Ki {r['batch']:>5} {cells}")
    for line in _LEGEND:
        print(line)
    p = result["pipeline"]
    if result["skipped_sizes"]:
        sizes = ", ".join(f"{s >> 10} KiB" for s in result["skipped_sizes"])
        print(f"objects of {sizes}: skipped, larger than the backend's largest object")
    if result["lookup_10k_ms"] is None:
        print(
            f"lookup of 10k blocks: skipped, the store holds {result['objects_held']} objects "
            "(measure it on a store of smaller slots)"
        )
    else:
        print(
            f"lookup of 10k blocks: {result['lookup_10k_ms']:.2f} ms "
            f"(the first: {result['lookup_10k_first_ms']:.2f} ms)"
        )
    print(
        f"pipeline overhead: store {p['store_us_per_block']:.2f} us/block, retrieve "
        f"{p['retrieve_us_per_block']:.2f} us/block; 100k keys in {p['keys_ms_per_100k']:.1f} ms"
    )
