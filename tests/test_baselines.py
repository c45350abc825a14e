"""The benchmarks' baselines do the work they stand for: a baseline that skipped part of it would
make kvflow look slower beside it than it is."""

from __future__ import annotations

import torch

from kvflow.layout import KVLayout
from kvflow.tools.baselines import bare_call_s, memcpy_call, region_copy_gbps, store_memcpy_gbps


def caches(blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    shape = (blocks, 2, 16, 64)  # vLLM's CPU layout: [blocks, heads, block_size, 2 * head_dim]
    make = (lambda: torch.randn(shape).half()) if fill else (lambda: torch.zeros(shape, dtype=torch.float16))
    return {f"l{i}": make() for i in range(3)}


def test_the_bare_call_moves_every_block_from_source_to_target() -> None:
    src, dst = caches(8, fill=True), caches(8, fill=False)
    ids = [6, 1, 4]
    store_s, retrieve_s = bare_call_s(
        KVLayout.from_kv_caches(src), KVLayout.from_kv_caches(dst), ids, list(range(16 * len(ids)))
    )
    assert store_s > 0 and retrieve_s > 0
    for name in src:
        assert torch.equal(dst[name][ids], src[name][ids])
        untouched = [b for b in range(8) if b not in ids]
        assert not dst[name][untouched].any()  # only the blocks asked for


def test_the_memcpy_baselines_copy_every_byte_plain_and_streamed() -> None:
    for stream in (False, True):
        call = memcpy_call((1 << 20) + 100, 64 << 10, stream=stream)  # whole chunks: 16 of 64 KiB
        assert call.src.numel() == 1 << 20 and not call.copied()
        call()
        assert call.copied()
    plain, streamed = store_memcpy_gbps(1 << 20, 64 << 10)
    assert plain > 0 and streamed > 0


def test_the_retrieve_region_baseline_scatters_into_the_target_regions() -> None:
    """A retrieve's region baseline writes the caches' regions (ordinary stores), as a get does;
    a store's reads them (gathered into a buffer, streamed), as a put does."""
    src, dst = caches(8, fill=True), caches(8, fill=False)
    before = {name: t.clone() for name, t in src.items()}
    assert region_copy_gbps(KVLayout.from_kv_caches(src), [0, 3]) > 0
    assert all(torch.equal(before[name], src[name]) for name in src)  # read only
    assert region_copy_gbps(KVLayout.from_kv_caches(dst), [0, 3], into_regions=True) > 0
    for name in dst:
        assert dst[name][[0, 3]].all() and not dst[name][[1, 2, 4, 5, 6, 7]].any()
