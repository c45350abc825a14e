"""``kvflow bench --topology``: loading KV another engine split differently, beside the matched load.

One run, one in-process memory store, vLLM CPU layout (``[N, H, B, 2*D]`` per layer), bfloat16:

- ``matched``: a TP=1 engine retrieves what a TP=1 engine stored (one object per block, straight
  into the cache: the path every engine takes when writer and reader agree);
- ``heads``: a TP=1 engine retrieves what a TP=2 engine stored (two objects per block, one per
  head half, each written straight into its half of the cache block: :mod:`kvflow.transfer.direct`);
- ``stages``: a TP=1 engine retrieves what a PP=2 engine stored (two objects per block, one per
  half of the layers, each straight into its layers' planes);
- ``layout``: a TP=1 engine with a flash-attn cache (``[2, N, B, H, D]``) retrieves the TP=1 vLLM
  CPU objects (every element moves to another position: each object straight into the cache in
  regions of one head's token, 256 bytes, which the memory backend's copy loop streams);
- ``half``: rank 0 of a TP=2 engine retrieves the TP=1 objects, of which it needs the first half
  of the heads (fetched whole into host chunks, its heads copied into place: the bytes move
  twice; its GB/s count the half it lands).

Each is reported as GB/s of KV landed in the reader's cache and as a ratio to ``matched``, next to
a plain memcpy of the same bytes measured in the same run.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Callable
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
#: Each case but ``matched``, as the report names it.
_CASES = {
    "heads": "TP=2 -> TP=1 (heads)",
    "stages": "PP=2 -> PP=1 (layers)",
    "layout": "vllm_cpu -> flash_attn",
    "half": "TP=1 -> TP=2 (a chunk)",
}


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


async def _store(
    caches: dict[str, torch.Tensor], backend: MemoryBackend, tp: int, blocks: int, pp: int = 1
) -> None:
    """Store every block from each of ``tp`` x ``pp`` ranks (``pp`` stages of equal layers)."""
    names = list(caches)
    stage = len(names) // pp
    for rank, pp_rank in itertools.product(range(tp), range(pp)):
        parallel = ParallelConfig(
            tp_rank=rank,
            tp_size=tp,
            num_kv_heads=_HEADS,
            pp_rank=pp_rank,
            pp_size=pp,
            pp_layers=(stage,) * pp,
        )
        mine = {name: caches[name] for name in names[pp_rank * stage : (pp_rank + 1) * stage]}
        pool = KVPool.create(
            PoolConfig(model="bench"),
            layout=KVLayout.from_kv_caches(mine),
            parallel=parallel,
            backend=backend,
        )
        if (await pool.store(_request(blocks))).stored != blocks:
            raise RuntimeError("bench: a store did not store every block")


async def _retrieve_s(
    caches: dict[str, torch.Tensor],
    backend: MemoryBackend,
    blocks: int,
    repeat: int,
    expected: Callable[[str], torch.Tensor],
    parallel: ParallelConfig,
) -> float:
    """The best of ``repeat`` timed retrieves of every block into ``caches`` (emptied before each,
    untimed), each checked against ``expected(layer name)`` (untimed)."""
    pool = KVPool.create(
        PoolConfig(model="bench"),
        layout=KVLayout.from_kv_caches(caches),
        parallel=parallel,
        backend=backend,
    )
    best = float("inf")
    for _ in range(repeat + 1):  # the first one also reads the store's profile book: a warm-up
        for cache in caches.values():
            cache.zero_()
        start = time.perf_counter()
        if (await pool.retrieve(_request(blocks))).hit_blocks != blocks:
            raise RuntimeError("bench: a retrieve did not load every block")
        best = min(best, time.perf_counter() - start)
        for name, cache in caches.items():
            if not torch.equal(cache.view(torch.int16), expected(name).view(torch.int16)):
                raise RuntimeError(f"bench: a retrieve loaded other bytes than the writer's into {name}")
    return best


def _as_written(writer: dict[str, torch.Tensor], tp: int, kind: str) -> Callable[[str], torch.Tensor]:
    """What a reader's layer must hold after loading every block from ``writer``'s caches, stored by
    ``tp`` ranks that each held the same heads (``writer``'s), laid out as ``kind``."""

    def expected(name: str) -> torch.Tensor:
        whole = torch.cat([writer[name]] * tp, dim=1)  # [N, H, B, 2D]
        if kind == "vllm_cpu":
            return whole
        k, v = whole[..., :_DIM], whole[..., _DIM:]
        return torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)])  # [2, N, B, H, D]

    return expected


def _first_heads(expected: Callable[[str], torch.Tensor], heads: int, name: str) -> torch.Tensor:
    """What a vLLM CPU reader holding the first ``heads`` heads must hold of ``expected(name)``."""
    return expected(name)[:, :heads]


async def run_topology_bench(*, quick: bool) -> dict[str, Any]:
    layers, blocks, repeat = (8, 16, 2) if quick else (32, 64, 3)
    nbytes = layers * blocks * _HEADS * _BLOCK * 2 * _DIM * 2
    out: dict[str, Any] = {"layers": layers, "blocks": blocks, "bytes": nbytes}
    for name, writer_tp, writer_pp, kind in (
        ("matched", 1, 1, "vllm_cpu"),
        ("heads", 2, 1, "vllm_cpu"),
        ("stages", 1, 2, "vllm_cpu"),
        ("layout", 1, 1, "flash"),
        ("half", 1, 1, "vllm_cpu"),
    ):
        backend = MemoryBackend(MemoryConfig(capacity_bytes=2 * nbytes))
        writer = _vllm_cpu(layers, blocks, _HEADS // writer_tp)
        await _store(writer, backend, writer_tp, blocks, writer_pp)
        expected = _as_written(writer, writer_tp, kind)
        parallel, landed = ParallelConfig(num_kv_heads=_HEADS), nbytes
        if name == "half":  # rank 0 of TP=2: the first half of the heads
            parallel, landed = ParallelConfig(tp_rank=0, tp_size=2, num_kv_heads=_HEADS), nbytes // 2
            expected = functools.partial(_first_heads, expected, _HEADS // 2)
        heads = _HEADS * landed // nbytes
        reader = _vllm_cpu(layers, blocks, heads) if kind == "vllm_cpu" else _flash_attn(layers, blocks)
        seconds = await _retrieve_s(reader, backend, blocks, repeat, expected, parallel)
        out[f"{name}_retrieve_gbps"] = landed / seconds / 1e9
    out["memcpy_gbps"] = memcpy_gbps(nbytes, nbytes // blocks)  # one block object per copy
    for name in _CASES:
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
    for name, what in _CASES.items():
        gbps, ratio = result[f"{name}_retrieve_gbps"], result[f"{name}_vs_matched"]
        print(f"  {what:26s} {gbps:6.2f} GB/s  {ratio:.2f}x matched")
    return 0
