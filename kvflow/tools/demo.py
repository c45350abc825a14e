"""``kvflow demo``: an engine-like run that stores a prefix-sharing workload, retrieves it into a
fresh, zeroed cache and verifies every retrieved block bit-exact."""

from __future__ import annotations

import time
from typing import Any

import anyio
import attrs
from tqdm import tqdm

from kvflow.backends import Backend, open_backend
from kvflow.config import PoolConfig
from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.pool import KVPool
from kvflow.tools.workload import (
    Geometry,
    block_matches,
    chat_workload,
    fill_block,
    make_kv_caches,
    memcpy_gbps,
)

__all__ = ["DemoSummary", "run_demo"]


@attrs.define
class DemoSummary:
    backend: str
    requests: int = 0
    blocks_requested: int = 0
    blocks_stored: int = 0
    blocks_retrieved: int = 0
    blocks_verified: int = 0
    blocks_mismatched: int = 0
    blocks_reused: int = 0  # engine A: blocks another request had already stored
    lookup_hit_blocks: int = 0
    store_bytes: int = 0
    retrieve_bytes: int = 0
    store_s: float = 0.0
    retrieve_s: float = 0.0
    memcpy_gbps: float = 0.0
    block_nbytes: int = 0

    @property
    def verified(self) -> bool:
        return (
            self.blocks_mismatched == 0
            and self.blocks_retrieved > 0
            and self.blocks_verified == self.blocks_retrieved
        )

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out.update(
            verified=self.verified,
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
) -> DemoSummary:
    """Store the workload from engine A, then retrieve and verify it in engine B.

    ``backend`` (optional) replaces the one ``backend_url`` names, e.g. to inject faults."""
    g = geometry or Geometry()
    requests = chat_workload(g.block_size)
    max_blocks = max(len(r) for r in requests) // g.block_size
    summary = DemoSummary(backend=backend_url, requests=len(requests), block_nbytes=g.block_nbytes)
    config = PoolConfig(backend=backend_url, model="demo-llama")
    backend = backend if backend is not None else open_backend(backend_url)

    # Engine A: computes each request's missing blocks and stores them.
    cache_a = make_kv_caches(g, max_blocks)
    pool_a = KVPool.create(config, layout=KVLayout.from_kv_caches(cache_a), backend=backend)
    for tokens in tqdm(requests, desc="store   ", unit="req", disable=not progress):
        hashes = hash_blocks(tokens, g.block_size)
        ids = list(range(len(hashes)))
        hit = await pool_a.lookup(block_hashes=hashes) // g.block_size
        summary.blocks_reused += hit
        for i in range(hit, len(hashes)):
            fill_block(cache_a, g, ids[i], hashes[i])
        start = time.perf_counter()
        result = await pool_a.store(block_ids=ids[hit:], block_hashes=hashes, block_offset=hit)
        summary.store_s += time.perf_counter() - start
        summary.blocks_stored += result.stored
        summary.store_bytes += result.stored * g.block_nbytes

    # Engine B: a fresh, zeroed cache; looks up, retrieves and verifies every hit block.
    cache_b = make_kv_caches(g, max_blocks)
    pool_b = KVPool.create(config, layout=KVLayout.from_kv_caches(cache_b), backend=backend)
    async with pool_b:
        for tokens in tqdm(requests, desc="retrieve", unit="req", disable=not progress):
            hashes = hash_blocks(tokens, g.block_size)
            summary.blocks_requested += len(hashes)
            hit = await pool_b.lookup(block_hashes=hashes) // g.block_size
            summary.lookup_hit_blocks += hit
            ids = list(range(hit))
            for block_id in ids:
                cache_b_zero(cache_b, block_id)
            start = time.perf_counter()
            loaded = await pool_b.retrieve(block_ids=ids, block_hashes=hashes[:hit])
            summary.retrieve_s += time.perf_counter() - start
            summary.blocks_retrieved += loaded.hit_blocks
            summary.retrieve_bytes += loaded.hit_blocks * g.block_nbytes
            for i in range(loaded.hit_blocks):
                if block_matches(cache_b, g, ids[i], hashes[i]):
                    summary.blocks_verified += 1
                else:
                    summary.blocks_mismatched += 1
            summary.blocks_mismatched += len(loaded.failed_block_ids)
    summary.memcpy_gbps = memcpy_gbps(max(summary.retrieve_bytes, g.block_nbytes), g.block_nbytes)
    return summary


def cache_b_zero(cache: dict[str, Any], block_id: int) -> None:
    """Zero a block before loading it, so that a block the pool failed to fill cannot verify."""
    for tensor in cache.values():
        tensor[block_id].zero_()


def demo_main(backend_url: str, as_json: bool) -> int:
    import functools
    import json

    summary = anyio.run(functools.partial(run_demo, backend_url, progress=not as_json))
    data = summary.as_dict()
    if as_json:
        print(json.dumps(data))
    else:
        print(
            f"backend {data['backend']}: {data['requests']} requests, "
            f"{data['blocks_stored']} blocks stored ({data['block_nbytes'] // 1024} KiB each), "
            f"{data['blocks_retrieved']} of {data['blocks_requested']} blocks retrieved "
            f"(hit rate {data['hit_rate']:.0%}), {data['blocks_verified']} verified bit-exact; "
            f"prefix reuse while storing {data['reuse_rate']:.0%}\n"
            f"store {data['store_gbps']:.2f} GB/s, retrieve {data['retrieve_gbps']:.2f} GB/s, "
            f"memcpy {data['memcpy_gbps']:.2f} GB/s "
            f"(retrieve/memcpy {data['retrieve_gbps'] / max(data['memcpy_gbps'], 1e-9):.2f}x)\n"
            + ("VERIFIED" if summary.verified else "NOT VERIFIED")
        )
    return 0 if summary.verified else 1
