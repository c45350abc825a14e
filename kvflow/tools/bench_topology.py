"""``kvflow bench --topology``: loading KV another engine split differently, beside the matched load.

One run, one in-process memory store, vLLM CPU layout (``[N, H, B, 2*D]`` per layer), bfloat16:

- ``matched``: a TP=1 engine retrieves what a TP=1 engine stored (one object per block, straight
  into the cache: the path every engine takes when writer and reader agree);
- ``heads``: a TP=1 engine retrieves what a TP=2 engine stored (two objects per block, one per
  head half, fetched into host chunks and copied into place);
- ``layout``: a TP=1 engine with a flash-attn cache (``[2, N, B, H, D]``) retrieves the TP=1 vLLM
  CPU objects (every element moves to another position).

Each is reported as GB/s of KV landed in the reader's cache and as a ratio to ``matched``, next to
a plain memcpy of the same bytes measured in the same run.
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
from kvflow.ownership import ParallelConfig
from kvflow.pool import KVPool
from kvflow.request import KVRequest
from kvflow.tools.baselines import memcpy_gbps

__all__ = ["run_topology_bench", "topology_main"]

_HEADS, _DIM, _BLOCK = 8, 128, 16


def _vllm_cpu(layers: int, blocks: int, heads: int) -> dict[str, torch.Tensor]:
    whole = torch.empty(layers, blocks, heads, _BLOCK, 2 * _DIM, dtype=torch.bfloat16)
    whole.view(torch.int16).random_()
    return {f"model.layers.{i}.attn": whole[i] for i in range(layers)}


def _flash_attn(layers: int, blocks: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.attn": torch.zeros(2, blocks, _BLOCK, _HEADS, _DIM, dtype=torch.bfloat16)
        for i in range(layers)
    }


def _request(blocks: int) -> KVRequest:
    return KVRequest(block_ids=range(blocks), tokens=range(blocks * _BLOCK))


async def _store(caches: dict[str, torch.Tensor], backend: MemoryBackend, tp: int, blocks: int) -> None:
    for rank in range(tp):
        parallel = ParallelConfig(tp_rank=rank, tp_size=tp, num_kv_heads=_HEADS)
        pool = KVPool.create(
            PoolConfig(model="bench"),
            layout=KVLayout.from_kv_caches(caches),
            parallel=parallel,
            backend=backend,
        )
        if (await pool.store(_request(blocks))).stored != blocks:
            raise RuntimeError("bench: a store did not store every block")


async def _retrieve_s(
    caches: dict[str, torch.Tensor], backend: MemoryBackend, blocks: int, repeat: int
) -> float:
    pool = KVPool.create(
        PoolConfig(model="bench"),
        layout=KVLayout.from_kv_caches(caches),
        parallel=ParallelConfig(num_kv_heads=_HEADS),
        backend=backend,
    )
    best = float("inf")
    for _ in range(repeat + 1):  # the first one also reads the store's profile book: a warm-up
        start = time.perf_counter()
        if (await pool.retrieve(_request(blocks))).hit_blocks != blocks:
            raise RuntimeError("bench: a retrieve did not load every block")
        best = min(best, time.perf_counter() - start)
    return best


async def run_topology_bench(*, quick: bool) -> dict[str, Any]:
    layers, blocks, repeat = (8, 16, 2) if quick else (32, 64, 3)
    nbytes = layers * blocks * _HEADS * _BLOCK * 2 * _DIM * 2
    out: dict[str, Any] = {"layers": layers, "blocks": blocks, "bytes": nbytes}
    for name, writer_tp, kind in (
        ("matched", 1, "vllm_cpu"),
        ("heads", 2, "vllm_cpu"),
        ("layout", 1, "flash"),
    ):
        backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * nbytes))
        await _store(_vllm_cpu(layers, blocks, _HEADS // writer_tp), backend, writer_tp, blocks)
        reader = _vllm_cpu(layers, blocks, _HEADS) if kind == "vllm_cpu" else _flash_attn(layers, blocks)
        seconds = await _retrieve_s(reader, backend, blocks, repeat)
        out[f"{name}_retrieve_gbps"] = nbytes / seconds / 1e9
    out["memcpy_gbps"] = memcpy_gbps(nbytes, nbytes // blocks)  # one block object per copy
    for name in ("heads", "layout"):
        out[f"{name}_vs_matched"] = out[f"{name}_retrieve_gbps"] / out["matched_retrieve_gbps"]
    return out


def topology_main(*, as_json: bool, quick: bool) -> int:
    result = anyio.run(lambda: run_topology_bench(quick=quick))
    if as_json:
        print(json.dumps(result))
        return 0
    print(f"{result['layers']} layers x {result['blocks']} blocks, {result['bytes'] / 1e6:.0f} MB, memory://")
    print(f"  memcpy                     {result['memcpy_gbps']:6.2f} GB/s")
    print(f"  matched (same split)       {result['matched_retrieve_gbps']:6.2f} GB/s")
    for name, what in (("heads", "TP=2 -> TP=1 (heads)"), ("layout", "vllm_cpu -> flash_attn")):
        gbps, ratio = result[f"{name}_retrieve_gbps"], result[f"{name}_vs_matched"]
        print(f"  {what:26s} {gbps:6.2f} GB/s  {ratio:.2f}x matched")
    return 0
