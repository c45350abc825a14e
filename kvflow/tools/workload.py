"""A synthetic engine for the demo and the benchmark: KV caches of a model geometry, requests that
share prefixes, and KV contents derived from block hashes (identical prefixes give identical KV,
as a real model's would)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.regions import copy_rows

__all__ = [
    "Geometry",
    "chat_workload",
    "expected_block",
    "fill_block",
    "hash_chain_s",
    "make_kv_caches",
    "memcpy_gbps",
    "region_copy_gbps",
]


@attrs.frozen
class Geometry:
    """A model's KV geometry as vLLM's CPU backend lays it out: ``[N, H, block_size, 2*D]`` per layer."""

    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def block_nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.block_size * 2 * self.head_dim * itemsize


def make_kv_caches(geometry: Geometry, num_blocks: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed KV caches, one view per layer into one allocation (as vLLM CPU allocates them)."""
    g = geometry
    shape = (g.num_layers, num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)
    whole = torch.zeros(shape, dtype=g.dtype, device=device)
    return {f"model.layers.{i}.self_attn": whole[i] for i in range(g.num_layers)}


def expected_block(geometry: Geometry, block_hash: bytes, layer: int) -> torch.Tensor:
    """The KV a block of ``block_hash`` holds in ``layer``: random bits seeded by the hash."""
    g = geometry
    gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:6], "little") * 1024 + layer)
    shape = (g.num_kv_heads, g.block_size, 2 * g.head_dim)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    return bits.view(g.dtype) if g.dtype.itemsize == 2 else bits.to(g.dtype)


def fill_block(
    kv_caches: dict[str, torch.Tensor], geometry: Geometry, block_id: int, block_hash: bytes
) -> None:
    """ "Compute" a block: write its expected KV into every layer."""
    for layer, cache in enumerate(kv_caches.values()):
        cache[block_id].copy_(expected_block(geometry, block_hash, layer).to(cache.device))


def block_matches(
    kv_caches: dict[str, torch.Tensor], geometry: Geometry, block_id: int, block_hash: bytes
) -> bool:
    """Bit-exact comparison (random bits include NaN patterns, so compare the raw bytes)."""
    return all(
        torch.equal(
            cache[block_id].cpu().contiguous().view(torch.uint8),
            expected_block(geometry, block_hash, layer).contiguous().view(torch.uint8),
        )
        for layer, cache in enumerate(kv_caches.values())
    )


def chat_workload(
    block_size: int, *, sessions: int = 6, turns: int = 4, documents: int = 3, seed: int = 0
) -> list[list[int]]:
    """Requests that share prefixes: a system prompt shared by all, multi-turn chats whose every turn
    extends the previous one, and questions about a few shared documents."""
    rng = random.Random(seed)

    def text(blocks: float) -> list[int]:
        return [rng.randrange(32000) for _ in range(int(blocks * block_size))]

    system = text(4)
    requests: list[list[int]] = []
    for _ in range(sessions):
        history = system + text(2.5)
        for _ in range(turns):
            history = history + text(3.25)
            requests.append(list(history))
    docs = [system + text(24) for _ in range(documents)]
    for i in range(documents * 3):
        requests.append(docs[i % documents] + text(1.5))
    return requests


def request_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    return hash_blocks(tokens, block_size)


def memcpy_gbps(nbytes: int, chunk: int, *, repeat: int = 3) -> float:
    """Best-of-``repeat`` memcpy throughput copying ``nbytes`` in ``chunk``-byte copies between two
    buffers of ``nbytes`` each (pre-faulted, so the figure is the copy alone, not page faults). The
    copies are made by one call of the compiled copy loop (:func:`kvflow.regions.copy_rows`, one
    region per chunk), so no Python call per chunk weighs on the figure at small chunks."""
    chunk = max(1, min(chunk, nbytes))
    count = max(1, nbytes // chunk)
    src = torch.randint(0, 255, (chunk * count,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    offsets = chunk * np.arange(count, dtype=np.int64)
    starts, addrs = dst.data_ptr() + offsets, (src.data_ptr() + offsets).reshape(-1, 1)
    sizes = np.asarray([chunk], dtype=np.int64)
    return count * chunk / _best_copy_s(starts, addrs, sizes, repeat) / 1e9


def region_copy_gbps(layout: KVLayout, block_ids: Sequence[int], *, repeat: int = 3) -> float:
    """Best-of-``repeat`` throughput of the copies a store of these blocks must make and nothing
    else: each block's regions (one per layer and plane) gathered back to back into a pre-faulted
    buffer, every block in one call of the compiled copy loop the backends use
    (:func:`kvflow.regions.copy_rows`). Beside :func:`memcpy_gbps` of whole objects it shows what
    the cache's layout itself costs (a block's regions lie apart, one per layer)."""
    sizes = np.asarray(layout.unit_sizes(None), dtype=np.int64)
    rows = layout.addr_rows(block_ids)
    nbytes = int(sizes.sum())
    dst = torch.zeros(nbytes * len(rows), dtype=torch.uint8)
    starts = dst.data_ptr() + nbytes * np.arange(len(rows), dtype=np.int64)
    return dst.numel() / _best_copy_s(starts, rows, sizes, repeat) / 1e9


def hash_chain_s(tokens: Sequence[int], block_size: int, *, repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds to hash ``tokens`` into their chain of block hashes
    (:func:`kvflow.keys.hash_blocks`, sha256), the work every store and retrieve of a request named
    by its tokens does before it can name an object. Beside :func:`region_copy_gbps` it gives the
    floor of such a call: the copies its blocks need plus the hashes that name them."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        hash_blocks(tokens, block_size)
        best = min(best, time.perf_counter() - start)
    return best


def _best_copy_s(
    starts: npt.NDArray[np.int64], rows: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64], repeat: int
) -> float:
    """The shortest of ``repeat`` timed calls of the copy loop gathering ``rows`` into ``starts``
    (one untimed call first: the loop is loaded or compiled at its first use)."""
    copy_rows(starts, rows, sizes, into_regions=False)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        copy_rows(starts, rows, sizes, into_regions=False)
        best = min(best, time.perf_counter() - start)
    return best
