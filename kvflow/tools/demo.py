"""``kvflow demo``: an engine-like run that stores a prefix-sharing workload, retrieves it into a
fresh, zeroed cache and verifies every retrieved block bit-exact.

On a store that outlives the run (``local://``, ``mooncake://``) the demo first reports blocks it
finds from an earlier run, and at the end removes the blocks it stored itself unless ``keep``. The
announcement of how its engines split the KV (one object of the model's profile book,
docs/topology.md) stays: other engines of the model may have found it or announced the same, and
``kvflow store clear --model demo-llama`` removes it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
from tqdm import tqdm

from kvflow.backends import Backend, PutStatus, open_backend
from kvflow.config import PoolConfig
from kvflow.events import make_event
from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.pool import KVPool
from kvflow.request import KVRequest
from kvflow.tools.baselines import plain_and_streamed_gbps
from kvflow.tools.workload import (
    Geometry,
    block_matches,
    chat_workload,
    check_device,
    fill_block,
    make_kv_caches,
)

__all__ = ["DemoSummary", "run_demo"]


@attrs.define
class DemoSummary:
    backend: str
    staged: bool = False
    device: str = "cpu"
    requests: int = 0
    blocks_requested: int = 0
    blocks_stored: int = 0
    blocks_retrieved: int = 0
    blocks_verified: int = 0
    blocks_mismatched: int = 0
    blocks_reused: int = 0  # engine A: blocks another request had already stored
    blocks_found: int = 0  # blocks of the workload the store held before this run
    blocks_removed: int = 0  # objects this run stored and removed at its end
    blocks_store_failed: int = 0  # engine A's stores that failed (not for want of room)
    blocks_no_space: int = 0  # engine A's stores the full store refused
    evictions: int = 0  # objects the store evicted during the run (its stats; 0 when it cannot tell)
    lookup_hit_blocks: int = 0
    store_bytes: int = 0
    retrieve_bytes: int = 0
    store_s: float = 0.0
    retrieve_s: float = 0.0
    memcpy_gbps: float = 0.0  # the faster of memmove and the streamed copy of the retrieved bytes
    block_nbytes: int = 0

    @property
    def verified(self) -> bool:
        """Every retrieved block is bit-exact, no store failed, and every block was retrieved
        unless the store ran out of room (it refused or evicted some: those are misses)."""
        return not self.problems

    @property
    def problems(self) -> list[str]:
        """Why the run did not verify (none when it did)."""
        found = []
        if self.blocks_mismatched:
            found.append(f"{self.blocks_mismatched} retrieved blocks did not hold their KV")
        if not self.blocks_retrieved:
            found.append("nothing was retrieved")
        if self.blocks_store_failed:
            found.append(f"{self.blocks_store_failed} stores failed")
        missed = self.blocks_requested - self.blocks_retrieved
        if missed and not (self.blocks_no_space or self.evictions):
            found.append(f"{missed} blocks were not retrieved, though the store refused and evicted none")
        return found

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out.update(
            verified=self.verified,
            problems=self.problems,
            hit_rate=self.lookup_hit_blocks / self.blocks_requested if self.blocks_requested else 0.0,
            reuse_rate=self.blocks_reused / self.blocks_requested if self.blocks_requested else 0.0,
            store_gbps=self.store_bytes / self.store_s / 1e9 if self.store_s else 0.0,
            retrieve_gbps=self.retrieve_bytes / self.retrieve_s / 1e9 if self.retrieve_s else 0.0,
        )
        return out


async def run_demo(
    backend_url: str = "memory://",
    geometry: Geometry | None = None,
    *,
    progress: bool = True,
    backend: Backend | None = None,
    keep: bool = False,
    staged: bool = False,
    device: str = "cpu",
) -> DemoSummary:
    """Store the workload from engine A, then retrieve and verify it in engine B.

    ``backend`` (optional) replaces the one ``backend_url`` names, e.g. to inject faults. Unless
    ``keep``, the blocks engine A stored are removed at the end (not its profile announcement).
    ``device``: where the KV caches live (``cuda``, ``npu``); ``staged``: move blocks through host
    staging even for host caches (how the device path runs on a CPU)."""
    check_device(device)  # before anything opens or runs
    g = geometry or Geometry()
    requests = chat_workload(g.block_size)
    max_blocks = max(len(r) for r in requests) // g.block_size
    summary = DemoSummary(backend_url, staged, device, requests=len(requests), block_nbytes=g.block_nbytes)
    config = PoolConfig(backend=backend_url, model="demo-llama", staging="always" if staged else "auto")
    backend = backend if backend is not None else open_backend(backend_url)
    evicted_before = backend.stats().evictions

    # Engine A: computes each request's missing blocks and stores them.
    cache_a = make_kv_caches(g, max_blocks, device)
    pool_a = KVPool.create(config, layout=KVLayout.from_kv_caches(cache_a), backend=backend)
    summary.blocks_found = await _blocks_present(pool_a, requests, g.block_size)
    created: list[KVRequest] = []  # runs of blocks this run stored, to remove at the end
    for tokens in tqdm(requests, desc="store   ", unit="req", disable=not progress):
        hashes = hash_blocks(tokens, g.block_size)
        ids = list(range(len(hashes)))
        hit = await pool_a.lookup(KVRequest(block_hashes=hashes)) // g.block_size
        summary.blocks_reused += hit
        for i in range(hit, len(hashes)):
            fill_block(cache_a, g, ids[i], hashes[i])
        written = make_event(device)  # "the forward" ends: its writes are queued before this event
        written.record()
        start = time.perf_counter()
        request = KVRequest(block_ids=ids[hit:], block_hashes=hashes, block_offset=hit)
        result = await pool_a.store(request, after=written)
        summary.store_s += time.perf_counter() - start
        summary.blocks_stored += result.stored
        summary.blocks_store_failed += result.statuses.count(PutStatus.FAILED)
        summary.blocks_no_space += result.statuses.count(PutStatus.NO_SPACE)
        summary.store_bytes += result.stored * g.block_nbytes
        created.extend(_stored_runs(hashes, hit, result.statuses))

    # Engine B: a fresh, zeroed cache; looks up, retrieves and verifies every hit block.
    cache_b = make_kv_caches(g, max_blocks, device)
    pool_b = KVPool.create(config, layout=KVLayout.from_kv_caches(cache_b), backend=backend)
    async with pool_b:
        for tokens in tqdm(requests, desc="retrieve", unit="req", disable=not progress):
            hashes = hash_blocks(tokens, g.block_size)
            summary.blocks_requested += len(hashes)
            hit = await pool_b.lookup(KVRequest(block_hashes=hashes)) // g.block_size
            summary.lookup_hit_blocks += hit
            ids = list(range(hit))
            for block_id in ids:
                cache_b_zero(cache_b, block_id)
            start = time.perf_counter()
            loaded = await pool_b.retrieve(KVRequest(block_ids=ids, block_hashes=hashes[:hit]))
            summary.retrieve_s += time.perf_counter() - start
            summary.blocks_retrieved += loaded.hit_blocks
            summary.retrieve_bytes += loaded.hit_blocks * g.block_nbytes
            for i in range(loaded.hit_blocks):
                if block_matches(cache_b, g, ids[i], hashes[i]):
                    summary.blocks_verified += 1
                else:
                    summary.blocks_mismatched += 1
            summary.blocks_mismatched += len(loaded.failed_block_ids)
        if not keep:
            for run in created:
                summary.blocks_removed += await pool_b.remove(run)
    summary.evictions = backend.stats().evictions - evicted_before
    # the faster of memmove and the streamed copy: a get streams, as kvflow bench compares it
    nbytes = max(summary.retrieve_bytes, g.block_nbytes)
    summary.memcpy_gbps = max(plain_and_streamed_gbps(nbytes, g.block_nbytes))
    return summary


async def _blocks_present(pool: KVPool, requests: list[list[int]], block_size: int) -> int:
    """Distinct blocks of the workload the store already holds (from an earlier run)."""
    present: set[bytes] = set()
    for tokens in requests:
        hashes = hash_blocks(tokens, block_size)
        present.update(hashes[: await pool.lookup(KVRequest(block_hashes=hashes)) // block_size])
    return len(present)


def _stored_runs(hashes: list[bytes], first: int, statuses: Sequence[PutStatus | None]) -> list[KVRequest]:
    """The runs of consecutive blocks a store wrote (``statuses[i]`` is block ``first + i``'s)."""
    runs: list[KVRequest] = []
    start: int | None = None
    for i, status in enumerate([*statuses, None]):
        if status is PutStatus.STORED and start is None:
            start = i
        elif status is not PutStatus.STORED and start is not None:
            runs.append(KVRequest(block_hashes=hashes[: first + i], block_offset=first + start))
            start = None
    return runs


def cache_b_zero(cache: dict[str, Any], block_id: int) -> None:
    """Zero a block before loading it, so that a block the pool failed to fill cannot verify."""
    for tensor in cache.values():
        tensor[block_id].zero_()


def demo_main(
    backend_url: str, as_json: bool, keep: bool = False, staged: bool = False, device: str = "cpu"
) -> int:
    import functools
    import json

    run = functools.partial(
        run_demo, backend_url, progress=not as_json, keep=keep, staged=staged, device=device
    )
    summary = anyio.run(run)
    data = summary.as_dict()
    if as_json:
        print(json.dumps(data))
    else:
        if summary.blocks_found:
            print(
                f"the store already held {summary.blocks_found} blocks of this workload from an earlier "
                "run; they were reused, not stored again"
            )
        print(
            f"backend {data['backend']}{' (staged through host buffers)' if staged else ''} on {device}: "
            f"{data['requests']} requests, "
            f"{data['blocks_stored']} blocks stored ({data['block_nbytes'] // 1024} KiB each), "
            f"{data['blocks_retrieved']} of {data['blocks_requested']} blocks retrieved "
            f"(hit rate {data['hit_rate']:.0%}), {data['blocks_verified']} verified bit-exact; "
            f"prefix reuse while storing {data['reuse_rate']:.0%}\n"
            f"store {data['store_gbps']:.2f} GB/s, retrieve {data['retrieve_gbps']:.2f} GB/s, "
            f"memcpy {data['memcpy_gbps']:.2f} GB/s, the faster of memmove and the streamed copy "
            f"(retrieve/memcpy {data['retrieve_gbps'] / max(data['memcpy_gbps'], 1e-9):.2f}x)\n"
            + (
                f"removed the {summary.blocks_removed} blocks this run stored (--keep keeps them)\n"
                if summary.blocks_removed
                else ""
            )
            + ("VERIFIED" if summary.verified else "NOT VERIFIED: " + "; ".join(summary.problems))
        )
    return 0 if summary.verified else 1
