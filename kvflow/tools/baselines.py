"""What the benchmarks compare kvflow with, each measured in the same run on the same blocks:

- :func:`memcpy_gbps`: the same bytes copied in object-sized chunks by `memmove`; with
  ``stream=True`` by streaming (non-temporal) stores, as the backends' puts and gets copy
  (:mod:`kvflow.copyloops`): out of the CPU's caches these run 1.2-1.7x faster than `memmove`, and
  in them lose to it, so both directions are compared with the faster of the two
  (:func:`plain_and_streamed_gbps`);
- :func:`region_copy_gbps`: the blocks' regions copied and nothing else (what the cache's layout
  costs: a block's regions lie apart, one per layer), gathered with streaming stores as a put
  gathers them, or with ``into_regions=True`` scattered into them, streamed, as a get scatters;
- :func:`hash_chain_s`: the sha256 chain that names a request's blocks by their tokens;
- :func:`bare_call_s`: the least a call that keys each object by text can do in Python: the hash
  chain, the key text, one dict operation per object, the addresses and one copy call, with no
  checks, deadline, budget, eviction, counters or results per request. Its ratio to memcpy is the
  most a Python store keyed per object reaches on this machine at that object size and batch;
- :func:`shared_call_s`: the bare call as it must run on an event loop that it shares as kvflow's
  in-process backends share theirs: its copies in runs of 4 MiB, the loop let run between runs
  once it has been held long enough (:mod:`kvflow.backends.pacing`). Its ratio to memcpy is the
  most such a call reaches here: what sharing the loop costs, measured.

Every copy is one call of the compiled copy loop the backends use (:func:`kvflow.regions.copy_rows`),
so no Python call per chunk weighs on a baseline.

Each takes ``before``, called ahead of every timed call and outside its timing: ``kvflow bench``
passes a :class:`CacheFlush`, so that its baselines start from the CPU's caches as kvflow's own
calls do (a bare retrieve timed back to back, its bytes still in the caches, ran 1.4-2.3x as fast
as in the state kvflow's retrieves were timed in: docs/benchmarks.md, seventh stop).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio.lowlevel
import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvflow.backends.pacing import RUN_BYTES, RUN_OBJECTS, Pacer
from kvflow.keys import hash_blocks
from kvflow.layout import KVLayout
from kvflow.regions import copy_rows

__all__ = [
    "Before",
    "CacheFlush",
    "MemcpyCall",
    "bare_call_s",
    "best_s",
    "flush_bytes",
    "hash_chain_s",
    "last_level_cache_bytes",
    "memcpy_call",
    "memcpy_gbps",
    "plain_and_streamed_gbps",
    "region_copy_gbps",
    "shared_call_s",
]

#: A call made ahead of each timed call, outside its timing (a :class:`CacheFlush`), or None.
Before = Callable[[], object] | None


#: Where Linux says how large each of the first CPU's caches is.
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = _CACHES) -> int | None:
    """The size of the largest cache the first CPU reports (``index*/size``, e.g. ``32768K``); None
    where Linux says nothing readable."""
    sizes = []
    for entry in caches.glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        size = re.fullmatch(r"([0-9]+)([KMG]?)", text)
        if size is not None:
            sizes.append(int(size[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[size[2]])
    return max(sizes, default=None)


#: The least and the most a :class:`CacheFlush` reads by default.
FLUSH_FLOOR, FLUSH_CAP = 256 << 20, 1 << 30


def flush_bytes(cache_bytes: int | None) -> int:
    """What a :class:`CacheFlush` reads by default, given the largest cache the CPU reports: eight
    times it, at least :data:`FLUSH_FLOOR` and at most :data:`FLUSH_CAP`.

    The cap is for virtual machines that report their host's whole cache: one of this project's,
    an Intel Xeon VM of 2 cores, reports a 300 MiB L3, and there a 16 MiB copy ran as slowly after
    a read of 128 MiB as after one of 2.4 GiB (eight times 300 MiB), which took 234 ms a call."""
    return min(FLUSH_CAP, max(FLUSH_FLOOR, 8 * (cache_bytes or 0)))


@attrs.define
class CacheFlush:
    """A call that pushes everything out of the CPU's caches by reading a buffer of ``nbytes``
    (:func:`flush_bytes` of the largest cache by default): after it a copy finds its source and
    destination in memory, as a store or a load of KV finds them, whatever the call before it
    touched. Returns the sum of the buffer's words (each 1), the proof that it read them all.

    On this project's first VM (an AMD EPYC reporting a 32 MiB L3), a copy of 4 MiB after a read
    of 64 MiB still ran 1.3-1.5x as fast as after a read of 256 or 512 MiB, which ran alike."""

    nbytes: int = attrs.field(factory=lambda: flush_bytes(last_level_cache_bytes()))
    _words: np.ndarray[Any, np.dtype[np.uint64]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._words = np.ones(max(1, self.nbytes // 8), dtype=np.uint64)  # written: its pages are faulted in

    def __call__(self) -> int:
        # numpy's sum, on this thread alone: torch's reduction ran 100x slower and woke its worker
        # threads, which then spun beside the timed call.
        return int(self._words.sum())


@attrs.define
class MemcpyCall:
    """One call of the compiled copy loop (:func:`kvflow.regions.copy_rows`, one region per chunk)
    copying ``src`` into ``dst`` (pre-faulted buffers of the same size) in chunks, with streaming
    stores when ``stream`` (as a put copies). A call checks nothing: :meth:`copied` does, after a
    timing."""

    src: torch.Tensor
    dst: torch.Tensor
    chunk: int
    stream: bool

    def __call__(self) -> None:
        offsets = self.chunk * np.arange(self.src.numel() // self.chunk, dtype=np.int64)
        starts, addrs = self.dst.data_ptr() + offsets, (self.src.data_ptr() + offsets).reshape(-1, 1)
        sizes = np.asarray([self.chunk], dtype=np.int64)
        copy_rows(starts, addrs, sizes, into_regions=False, stream=self.stream)

    def copied(self) -> bool:
        return bool(torch.equal(self.src, self.dst))


def memcpy_call(nbytes: int, chunk: int, *, stream: bool = False) -> MemcpyCall:
    """A :class:`MemcpyCall` copying ``nbytes`` (rounded down to whole chunks) in ``chunk``-byte
    copies between two buffers of that size, the destination zeroed (so that :meth:`MemcpyCall.copied`
    tells a copy from none)."""
    chunk = max(1, min(chunk, nbytes))
    src = torch.randint(0, 255, (chunk * max(1, nbytes // chunk),), dtype=torch.uint8)
    return MemcpyCall(src=src, dst=torch.zeros_like(src), chunk=chunk, stream=stream)


def memcpy_gbps(
    nbytes: int, chunk: int, *, repeat: int = 3, stream: bool = False, before: Before = None
) -> float:
    """Best-of-``repeat`` memcpy throughput copying ``nbytes`` in ``chunk``-byte copies between two
    buffers of ``nbytes`` each (pre-faulted, so the figure is the copy alone, not page faults), by
    one call of the compiled copy loop (:func:`memcpy_call`), so no Python call per chunk weighs on
    the figure at small chunks; with streaming stores when ``stream``. Raises if the copy did not
    copy (a baseline that moved nothing would make anything beside it look slow)."""
    call = memcpy_call(nbytes, chunk, stream=stream)
    best = best_s(call, repeat, before=before)
    if not call.copied():
        raise RuntimeError("the memcpy baseline did not copy its bytes: the copy loop is broken")
    return call.dst.numel() / best / 1e9


def plain_and_streamed_gbps(
    nbytes: int, chunk: int, *, repeat: int = 3, before: Before = None
) -> tuple[float, float]:
    """The plain and the streamed :func:`memcpy_gbps` of the same bytes, each best of ``repeat``.
    A store's and a retrieve's baseline is the faster of the two (``max``): puts and gets write
    with streaming stores, which out of the CPU's caches often beat `memmove` by 1.2-1.7x, and in
    them lose to it."""
    plain = memcpy_gbps(nbytes, chunk, repeat=repeat, before=before)
    return plain, memcpy_gbps(nbytes, chunk, repeat=repeat, stream=True, before=before)


def region_copy_gbps(
    layout: KVLayout,
    block_ids: Sequence[int],
    *,
    repeat: int = 3,
    into_regions: bool = False,
    before: Before = None,
) -> float:
    """Best-of-``repeat`` throughput of the copies a store of these blocks must make and nothing
    else: each block's regions (one per layer and plane) gathered back to back into a pre-faulted
    buffer, every block in one call of the compiled copy loop the backends use
    (:func:`kvflow.regions.copy_rows`, with the streaming stores of their puts). With
    ``into_regions``, the copies a retrieve must make instead: the buffer scattered into the
    regions, streamed too, as the backends' gets copy. Beside :func:`memcpy_gbps` of whole
    objects it shows what the cache's layout itself costs (a block's regions lie apart, one per
    layer)."""
    sizes = np.asarray(layout.unit_sizes(None), dtype=np.int64)
    rows = layout.addr_rows(block_ids)
    nbytes = int(sizes.sum())
    buffer = torch.ones(nbytes * len(rows), dtype=torch.uint8)  # written: its pages are faulted in
    starts = buffer.data_ptr() + nbytes * np.arange(len(rows), dtype=np.int64)

    def copy() -> None:
        copy_rows(starts, rows, sizes, into_regions=into_regions, stream=True)

    best = best_s(copy, repeat, before=before)
    return buffer.numel() / best / 1e9


def hash_chain_s(tokens: Sequence[int], block_size: int, *, repeat: int = 3, before: Before = None) -> float:
    """Best-of-``repeat`` seconds to hash ``tokens`` into their chain of block hashes
    (:func:`kvflow.keys.hash_blocks`, sha256), the work every store and retrieve of a request named
    by its tokens does before it can name an object. Beside :func:`region_copy_gbps` it gives the
    floor of such a call: the copies its blocks need plus the hashes that name them."""
    return best_s(lambda: hash_blocks(tokens, block_size), repeat, before=before)


@attrs.define
class _BareCalls:
    """The bare store and retrieve of :func:`bare_call_s`: the hash chain of ``tokens``, a key text
    per block (a prefix and the hash in hex, as kvflow's), one dict insert or look-up per key, the
    blocks' addresses and the copies between the cache and pre-faulted slots, streamed both ways as
    the backends' puts and gets copy (:mod:`kvflow.backends.copies`). Each call is a generator
    that copies ``run`` blocks a call of the copy loop (all in one by default) and yields between
    those calls, so that :func:`shared_call_s` can share the loop there."""

    source: KVLayout
    target: KVLayout
    block_ids: Sequence[int]
    tokens: Sequence[int]
    _sizes: npt.NDArray[np.int64] = attrs.field(init=False)
    _slots: torch.Tensor = attrs.field(init=False)
    _index: dict[str, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._sizes = np.asarray(self.source.unit_sizes(None), dtype=np.int64)
        # written: its pages are faulted in
        self._slots = torch.ones(int(self._sizes.sum()) * len(self.block_ids), dtype=torch.uint8)

    def _keys(self) -> list[str]:
        prefix = "bare@model@meaning@order@b16@l0-1@h0-1@d0.1@p0.1@"
        return [prefix + h.hex() for h in hash_blocks(self.tokens, self.source.block_size)]

    def store(self, run: int | None = None) -> Iterator[None]:
        named = self._keys()
        nbytes, base = int(self._sizes.sum()), self._slots.data_ptr()
        starts = [base + i * nbytes for i in range(len(named))]
        for key, start in zip(named, starts):
            self._index[key] = start
        yield from self._copies(starts, self.source, run, into_regions=False)

    def retrieve(self, run: int | None = None) -> Iterator[None]:
        index = self._index
        yield from self._copies([index[key] for key in self._keys()], self.target, run, into_regions=True)

    def _copies(
        self, starts: list[int], layout: KVLayout, run: int | None, *, into_regions: bool
    ) -> Iterator[None]:
        """The copies between the slots at ``starts`` and the blocks' regions in ``layout``, ``run``
        blocks a call of the copy loop (all in one by default), yielding between calls."""
        rows = layout.addr_rows(self.block_ids)
        if len(rows) != len(starts):
            raise ValueError(f"the tokens name {len(starts)} full blocks for {len(rows)} block ids")
        step = max(1, run or len(starts))
        for first in range(0, len(starts), step):
            if first:
                yield
            copy_rows(
                np.asarray(starts[first : first + step], dtype=np.int64),
                rows[first : first + step],
                self._sizes,
                into_regions=into_regions,
                stream=True,
            )


def bare_call_s(
    source: KVLayout,
    target: KVLayout,
    block_ids: Sequence[int],
    tokens: Sequence[int],
    *,
    repeat: int = 3,
    before: Before = None,
) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of a bare store of ``block_ids`` from ``source``'s caches and a
    bare retrieve of them into ``target``'s (the same geometry), named by ``tokens``: the hash
    chain, a key text per block, one dict insert or look-up per key, the blocks' addresses and one
    call of the copy loop between the cache and pre-faulted slots (:class:`_BareCalls`). Nothing
    is checked or counted and the call never yields to a loop; what kvflow adds over it is
    everything a library does beyond that."""
    calls = _BareCalls(source, target, block_ids, tokens)
    store_s = best_s(lambda: list(calls.store()), repeat, before=before)
    return store_s, best_s(lambda: list(calls.retrieve()), repeat, before=before)


async def shared_call_s(
    source: KVLayout,
    target: KVLayout,
    block_ids: Sequence[int],
    tokens: Sequence[int],
    *,
    repeat: int = 3,
    before: Before = None,
) -> tuple[float, float]:
    """:func:`bare_call_s` as a call on an event loop must make it when it shares the loop as
    kvflow's in-process backends do (:mod:`kvflow.backends.pacing`): the copies in runs of at most
    :data:`~kvflow.backends.pacing.RUN_BYTES` (and :data:`~kvflow.backends.pacing.RUN_OBJECTS`
    blocks), a :class:`~kvflow.backends.pacing.Pacer` checked before each run but the first, a
    checkpoint at the end, as the memory backend runs a put or a get of objects of up to
    :func:`~kvflow.backends.pacing.whole_bytes`. Its ratio to memcpy is the most a call keyed per
    object reaches here while it keeps the loop's other work waiting no longer than kvflow's calls
    may. (The backends copy a larger object a piece at a time with a look at the clock between
    pieces; this call copies it whole, alone, so above that size it is a little quicker than a
    call at kvflow's cadence can be.)"""
    calls = _BareCalls(source, target, block_ids, tokens)
    nbytes = max(1, source.block_nbytes)
    run = max(1, min(RUN_OBJECTS, RUN_BYTES // nbytes))

    async def shared(steps: Callable[[int | None], Iterator[None]]) -> None:
        pacer = Pacer()
        for _ in steps(run):
            if pacer.due():
                await pacer.pause()
        await anyio.lowlevel.checkpoint()

    async def best(steps: Callable[[int | None], Iterator[None]]) -> float:
        await shared(steps)  # untimed, as best_s's first call
        fastest = float("inf")
        for _ in range(repeat):
            if before is not None:
                before()
            start = time.perf_counter()
            await shared(steps)
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    return await best(calls.store), await best(calls.retrieve)


def best_s(call: Callable[[], object], repeat: int, *, warm: bool = True, before: Before = None) -> float:
    """The shortest of ``repeat`` timed calls of ``call`` (``warm``: one untimed call first;
    ``before``: called ahead of each timed call, untimed)."""
    if warm:
        call()
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
