"""What the benchmarks compare kvflow with, each measured in the same run on the same blocks:

- :func:`memcpy_gbps`: the same bytes copied in object-sized chunks by `memmove` (the targets' baseline;
  the streaming stores of a put can pass it: :mod:`kvflow.copyloops`);
- :func:`region_copy_gbps`: the blocks' regions copied and nothing else (what the cache's layout
  costs: a block's regions lie apart, one per layer);
- :func:`hash_chain_s`: the sha256 chain that names a request's blocks by their tokens;
- :func:`bare_call_s`: the least a call that keys each object by text can do in Python: the hash
  chain, the key text, one dict operation per object, the addresses and one copy call, with no
  checks, deadline, budget, eviction, counters or results per request. Its ratio to memcpy is the
  most a Python store keyed per object reaches on this machine at that object size and batch.

Every copy is one call of the compiled copy loop the backends use (:func:`kvflow.regions.copy_rows`),
so no Python call per chunk weighs on a baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.regions import copy_rows

__all__ = ["bare_call_s", "best_s", "hash_chain_s", "memcpy_gbps", "region_copy_gbps"]


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
    (:func:`kvflow.regions.copy_rows`, with the streaming stores of their puts). Beside
    :func:`memcpy_gbps` of whole objects it shows what the cache's layout itself costs (a block's
    regions lie apart, one per layer)."""
    sizes = np.asarray(layout.unit_sizes(None), dtype=np.int64)
    rows = layout.addr_rows(block_ids)
    nbytes = int(sizes.sum())
    dst = torch.zeros(nbytes * len(rows), dtype=torch.uint8)
    starts = dst.data_ptr() + nbytes * np.arange(len(rows), dtype=np.int64)
    best = best_s(lambda: copy_rows(starts, rows, sizes, into_regions=False, stream=True), repeat)
    return dst.numel() / best / 1e9


def hash_chain_s(tokens: Sequence[int], block_size: int, *, repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds to hash ``tokens`` into their chain of block hashes
    (:func:`kvflow.keys.hash_blocks`, sha256), the work every store and retrieve of a request named
    by its tokens does before it can name an object. Beside :func:`region_copy_gbps` it gives the
    floor of such a call: the copies its blocks need plus the hashes that name them."""
    return best_s(lambda: hash_blocks(tokens, block_size), repeat)


def _best_copy_s(
    starts: npt.NDArray[np.int64], rows: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64], repeat: int
) -> float:
    """The shortest of ``repeat`` timed calls of the copy loop gathering ``rows`` into ``starts``
    (the untimed first call loads or compiles the loop)."""
    return best_s(lambda: copy_rows(starts, rows, sizes, into_regions=False), repeat)


def bare_call_s(
    source: KVLayout, target: KVLayout, block_ids: Sequence[int], tokens: Sequence[int], *, repeat: int = 3
) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of a bare store of ``block_ids`` from ``source``'s caches and a
    bare retrieve of them into ``target``'s (the same geometry), named by ``tokens``: the hash
    chain, a key text per block (a prefix and the hash in hex, as kvflow's), one dict insert or
    look-up per key, the blocks' addresses and one call of the copy loop between the cache and
    pre-faulted slots (the store's streamed, as the backends' puts: :mod:`kvflow.backends.copies`).
    Nothing is checked or counted and the call never yields to a loop; what kvflow adds over it is
    everything a library does beyond that."""
    sizes = np.asarray(source.unit_sizes(None), dtype=np.int64)
    nbytes = int(sizes.sum())
    slots = torch.ones(nbytes * len(block_ids), dtype=torch.uint8)  # written: its pages are faulted in
    base = slots.data_ptr()
    index: dict[str, int] = {}
    prefix = "bare@model@meaning@order@b16@l0-1@h0-1@d0.1@p0.1@"
    block_size = source.block_size

    def keys() -> list[str]:
        return [prefix + h.hex() for h in hash_blocks(tokens, block_size)]

    def store() -> None:
        named = keys()
        starts = [base + i * nbytes for i in range(len(named))]
        for key, start in zip(named, starts):
            index[key] = start
        rows = source.addr_rows(block_ids)
        copy_rows(np.asarray(starts, dtype=np.int64), rows, sizes, into_regions=False, stream=True)

    def retrieve() -> None:
        starts = [index[key] for key in keys()]
        rows = target.addr_rows(block_ids)
        copy_rows(np.asarray(starts, dtype=np.int64), rows, sizes, into_regions=True)

    return best_s(store, repeat), best_s(retrieve, repeat)


def best_s(call: Callable[[], object], repeat: int, *, warm: bool = True) -> float:
    """The shortest of ``repeat`` timed calls of ``call`` (``warm``: one untimed call first)."""
    if warm:
        call()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
