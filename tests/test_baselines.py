"""The benchmarks' baselines do the work they stand for: a baseline that skipped part of it would
make kvflow look slower beside it than it is."""

from __future__ import annotations

import torch

from kvflow.layout import KVLayout
from kvflow.tools.baselines import bare_call_s


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
