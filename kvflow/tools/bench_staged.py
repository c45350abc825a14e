"""``kvflow bench --staged``: the staging path against the direct path and against a plain copy.

On the CPU (``--device cpu``) it times a store and a retrieve of the same blocks through the memory
backend twice in one run: directly (the backend copies the cache's memory) and staged (every block
through the pool's host staging chunks, as a GPU or NPU cache over a host store moves), and reports
staged/direct.

On a device (``--device cuda``) it isolates the staging copies: the backend answers at once without
copying, so a store times the device-to-host gather of the blocks and a retrieve the host-to-device
scatter; each is compared with a plain ``copy_`` of the same bytes between the cache and pinned host
memory (the target is at least 0.8x of it).
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import torch

from kvflow.backends.memory import MemoryBackend, MemoryConfig
from kvflow.config import PoolConfig
from kvflow.layout import KVLayout
from kvflow.pool import KVPool
from kvflow.request import KVRequest
from kvflow.tools.bench import NullBackend
from kvflow.tools.workload import Geometry, check_device, make_kv_caches

__all__ = ["run_staged_bench", "staged_main"]


def _request(blocks: int, block_size: int, salt: int) -> KVRequest:
    """Blocks ``0..blocks-1`` of a prompt of its own (``salt``): its keys are new to the store."""
    return KVRequest(block_ids=range(blocks), tokens=[salt, *range(1, blocks * block_size)])


async def _timed(repeat: int, pool: KVPool, blocks: int, block_size: int, op: str) -> float:
    """Best time of ``repeat`` stores of new prompts, or retrieves of the prompt stored first."""
    best = float("inf")
    for i in range(repeat):
        start = time.perf_counter()
        if op == "store":
            result = await pool.store(_request(blocks, block_size, 1 + i))
            ok = result.stored == blocks
        else:
            ok = (await pool.retrieve(_request(blocks, block_size, 0))).hit_blocks == blocks
        best = min(best, time.perf_counter() - start)
        if not ok:
            raise RuntimeError(f"bench: a {op} did not move every block")
    return best


async def _cpu(g: Geometry, blocks: int, repeat: int) -> dict[str, Any]:
    caches = make_kv_caches(g, blocks)
    for cache in caches.values():
        cache.view(torch.int16).random_()
    layout = KVLayout.from_kv_caches(caches)
    nbytes = layout.block_nbytes * blocks
    out: dict[str, Any] = {"device": "cpu", "bytes": nbytes}
    for mode in ("never", "always"):
        # Room for two batches: the backend recycles evicted buffers, as a store in service does.
        backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * nbytes))
        pool = KVPool.create(PoolConfig(staging=mode, model=f"bench-{mode}"), layout=layout, backend=backend)
        for salt in (100, 101, 0):  # warm: every buffer exists and is faulted in; prompt 0 stored last
            await pool.store(_request(blocks, g.block_size, salt))
        retrieve = await _timed(repeat, pool, blocks, g.block_size, "retrieve")
        store = await _timed(repeat, pool, blocks, g.block_size, "store")
        name = "direct" if mode == "never" else "staged"
        out[f"{name}_store_gbps"] = nbytes / store / 1e9
        out[f"{name}_retrieve_gbps"] = nbytes / retrieve / 1e9
    out["store_staged_vs_direct"] = out["staged_store_gbps"] / out["direct_store_gbps"]
    out["retrieve_staged_vs_direct"] = out["staged_retrieve_gbps"] / out["direct_retrieve_gbps"]
    return out


async def _device(g: Geometry, blocks: int, repeat: int, device: str) -> dict[str, Any]:
    caches = make_kv_caches(g, blocks, device)
    layout = KVLayout.from_kv_caches(caches)
    nbytes = layout.block_nbytes * blocks
    pool = KVPool.create(
        PoolConfig(staging_bytes=max(nbytes, 64 << 20)),
        layout=layout,
        backend=NullBackend(),  # copies nothing: what is timed is the pool's own copies
    )
    d2h = await _timed(repeat, pool, blocks, g.block_size, "store")
    h2d = await _timed(repeat, pool, blocks, g.block_size, "retrieve")
    whole = next(iter(caches.values())).untyped_storage()
    source = torch.empty(0, dtype=torch.uint8, device=device).set_(whole, 0, (nbytes,), (1,))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else torch.npu.synchronize  # type: ignore[attr-defined]
    plain_d2h = plain_h2d = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        host.copy_(source, non_blocking=True)
        sync()
        plain_d2h = min(plain_d2h, time.perf_counter() - start)
        start = time.perf_counter()
        source.copy_(host, non_blocking=True)
        sync()
        plain_h2d = min(plain_h2d, time.perf_counter() - start)
    return {
        "device": device,
        "bytes": nbytes,
        "staged_d2h_gbps": nbytes / d2h / 1e9,
        "staged_h2d_gbps": nbytes / h2d / 1e9,
        "copy_d2h_gbps": nbytes / plain_d2h / 1e9,
        "copy_h2d_gbps": nbytes / plain_h2d / 1e9,
        "d2h_vs_copy": plain_d2h / d2h,
        "h2d_vs_copy": plain_h2d / h2d,
    }


def run_staged_bench(*, device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    check_device(device)
    g = Geometry(num_layers=8 if quick else 32)
    blocks, repeat = (32, 2) if quick else (128, 5)
    if device == "cpu":
        return anyio.run(_cpu, g, blocks, repeat)
    return anyio.run(_device, g, blocks, repeat, device)


def staged_main(*, as_json: bool, quick: bool, device: str) -> int:
    result = run_staged_bench(device=device, quick=quick)
    if as_json:
        print(json.dumps(result))
        return 0
    r = result
    print(f"staging on {r['device']}: {r['bytes'] / 2**20:.0f} MiB per transfer")
    if r["device"] == "cpu":
        print(
            f"store:    direct {r['direct_store_gbps']:.2f} GB/s, staged {r['staged_store_gbps']:.2f} GB/s "
            f"({r['store_staged_vs_direct']:.2f}x)\n"
            f"retrieve: direct {r['direct_retrieve_gbps']:.2f} GB/s, "
            f"staged {r['staged_retrieve_gbps']:.2f} GB/s "
            f"({r['retrieve_staged_vs_direct']:.2f}x)"
        )
    else:
        print(
            f"device to host: staged {r['staged_d2h_gbps']:.2f} GB/s, copy_ {r['copy_d2h_gbps']:.2f} GB/s "
            f"({r['d2h_vs_copy']:.2f}x)\n"
            f"host to device: staged {r['staged_h2d_gbps']:.2f} GB/s, copy_ {r['copy_h2d_gbps']:.2f} GB/s "
            f"({r['h2d_vs_copy']:.2f}x)"
        )
    return 0
