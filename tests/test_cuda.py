"""KV caches on a CUDA device: the staging path with real streams and events (skipped without CUDA).

The same matrix as tests/test_staging.py, on CUDA tensors: every layout bit-exact, whole-block and
layerwise; a store reads nothing before the engine's event (a kernel still writing the blocks on
the engine's stream); the synchronous layerwise face makes the compute stream wait for each layer's
copies. ``benchmarks/device_check.sh`` runs this file on a GPU machine.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from kvflow import KVLayout, KVPool, KVRequest, MemoryBackend, PoolConfig, SyncLayerwisePool
from kvflow.events import make_event
from tests.helpers import BLOCK, LAYOUTS, block_bytes, zeros_like_caches

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS = list(range(900, 900 + BLOCK * 8))
SRC_IDS = [3, 1, 4, 0, 5, 9, 2, 6]
DST_IDS = [10, 11, 7, 8, 0, 1, 2, 3]


def on_cuda(caches: dict[str, object]) -> dict[str, object]:
    return {
        name: entry.cuda() if isinstance(entry, torch.Tensor) else tuple(t.cuda() for t in entry)  # type: ignore[attr-defined]
        for name, entry in caches.items()
    }


def on_cpu(caches: dict[str, object]) -> dict[str, object]:
    return {
        name: entry.cpu() if isinstance(entry, torch.Tensor) else tuple(t.cpu() for t in entry)  # type: ignore[attr-defined]
        for name, entry in caches.items()
    }


def pool(caches: dict[str, object], backend: MemoryBackend, layerwise: bool = False) -> KVPool:
    config = PoolConfig(
        layerwise=layerwise, staging_bytes=4 * 4096
    )  # staging: auto (the backend is host-only)
    return KVPool.create(config, layout=KVLayout.from_kv_caches(caches), backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("layerwise", [False, True])
async def test_cuda_caches_round_trip_bit_exact_through_staging(layout_name: str, layerwise: bool) -> None:
    host = LAYOUTS[layout_name]()
    src, dst = on_cuda(host), on_cuda(zeros_like_caches(host))
    backend = MemoryBackend()
    writer = pool(src, backend, layerwise)
    assert writer.device is not None and not writer.device.is_cpu  # staged: the backend is host-only
    assert (await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))).stored == 8
    got = await pool(dst, backend, layerwise).retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.hit_blocks == 8
    back = on_cpu(dst)
    assert all(
        block_bytes(back[n], d) == block_bytes(host[n], s) for s, d in zip(SRC_IDS, DST_IDS) for n in host
    )


async def test_a_store_of_cuda_blocks_waits_for_the_engines_event() -> None:
    host = LAYOUTS["flash_attn"]()
    src = on_cuda(host)
    backend = MemoryBackend()
    writer = pool(src, backend)
    torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]  # the "forward" is still running...
    for entry in src.values():
        entry.add_(1)  # type: ignore[attr-defined]  # ...and writes the blocks' final KV after it
    forward = make_event("cuda")
    forward.record()
    assert (await writer.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS), after=forward)).stored == 8
    dst = on_cuda(zeros_like_caches(host))
    await pool(dst, backend).retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    final, back = on_cpu(src), on_cpu(dst)
    assert all(
        block_bytes(back[n], d) == block_bytes(final[n], s) for s, d in zip(SRC_IDS, DST_IDS) for n in host
    )


def test_the_layerwise_face_makes_the_compute_stream_wait_for_each_layer() -> None:
    host = LAYOUTS["vllm_cpu"]()
    backend = MemoryBackend()
    anyio.run(lambda: pool(on_cuda(host), backend, True).store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS)))
    dst = on_cuda(zeros_like_caches(host))
    with SyncLayerwisePool.open(
        PoolConfig(layerwise=True), layout=KVLayout.from_kv_caches(dst), backend=backend, depth=2
    ) as kv:
        kv.start_load([KVRequest(request_id="r", block_ids=DST_IDS, tokens=TOKENS)])
        sums = []
        for layer, name in enumerate(host):
            assert kv.wait_for_layer_load(layer) is True
            sums.append(dst[name].double().sum())  # type: ignore[attr-defined]  # queued after the wait
        assert kv.wait_for_save().loaded["r"].hit_blocks == 8
    torch.cuda.synchronize()
    expected = [sum(host[n][s].double().sum() for s in SRC_IDS) for n in host]  # type: ignore[index]
    assert [float(s) for s in sums] == pytest.approx([float(e) for e in expected])
