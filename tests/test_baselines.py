"""The benchmarks' baselines do the work they stand for: a baseline that skipped part of it would
make kvflow look slower beside it than it is."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch

from kvflow.layout import KVLayout
from kvflow.tools import baselines
from kvflow.tools.baselines import (
    CacheFlush,
    bare_call_s,
    best_s,
    flush_bytes,
    hash_chain_s,
    last_level_cache_bytes,
    memcpy_call,
    memcpy_gbps,
    plain_and_streamed_gbps,
    region_copy_gbps,
    shared_call_s,
)


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


def test_the_bare_call_sharing_the_loop_moves_every_block_in_runs_and_lets_other_work_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shared baseline copies what the bare call copies, in runs of at most ``RUN_BYTES`` (one
    copy call each), and a task waiting on the loop runs between its runs once the loop has been
    held long enough (here: at once), as between a backend's runs; without it the baseline would
    not stand for a call on a shared loop."""
    src, dst = caches(8, fill=True), caches(8, fill=False)
    ids = [6, 1, 4, 0, 7]
    source = KVLayout.from_kv_caches(src)
    run = 2  # blocks a run: RUN_BYTES made two blocks' worth
    monkeypatch.setattr(baselines, "RUN_BYTES", run * source.block_nbytes)
    monkeypatch.setattr("kvflow.backends.pacing.YIELD_EVERY_S", 0.0)
    copies: list[int] = []
    real = baselines.copy_rows

    def recorded(starts, addrs, sizes, *, into_regions, stream=False):  # type: ignore[no-untyped-def]
        copies.append(len(starts))
        real(starts, addrs, sizes, into_regions=into_regions, stream=stream)

    monkeypatch.setattr(baselines, "copy_rows", recorded)
    ran_between: list[int] = []

    async def main() -> tuple[float, float]:
        async with anyio.create_task_group() as tg:

            async def beside() -> None:
                while True:
                    ran_between.append(len(copies))
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(beside)
            await anyio.lowlevel.checkpoint()
            times = await shared_call_s(
                source, KVLayout.from_kv_caches(dst), ids, list(range(16 * len(ids))), repeat=1
            )
            tg.cancel_scope.cancel()
        return times

    store_s, retrieve_s = anyio.run(main)
    assert store_s > 0 and retrieve_s > 0
    assert copies == [2, 2, 1] * 4  # a store and a retrieve untimed, then each timed once
    # the waiting task ran between the runs of a call, not only between calls
    assert {1, 2, 4, 5} <= set(ran_between), ran_between
    for name in src:
        assert torch.equal(dst[name][ids], src[name][ids])
        assert not dst[name][[2, 3, 5]].any()  # only the blocks asked for


def test_the_bare_calls_refuse_tokens_that_name_other_blocks_than_asked_for() -> None:
    """Tokens for two full blocks and three block ids: no baseline times a copy of fewer blocks
    than kvflow's calls move beside it."""
    src, dst = KVLayout.from_kv_caches(caches(4, fill=True)), KVLayout.from_kv_caches(caches(4, fill=False))
    with pytest.raises(ValueError, match="name 2 full blocks for 3 block ids"):
        bare_call_s(src, dst, [0, 1, 2], range(32), repeat=1)
    with pytest.raises(ValueError, match="name 2 full blocks for 3 block ids"):
        anyio.run(functools.partial(shared_call_s, src, dst, [0, 1, 2], range(32), repeat=1))


def test_the_memcpy_baselines_copy_every_byte_plain_and_streamed() -> None:
    for stream in (False, True):
        call = memcpy_call((1 << 20) + 100, 64 << 10, stream=stream)  # whole chunks: 16 of 64 KiB
        assert call.src.numel() == 1 << 20 and not call.copied()
        call()
        assert call.copied()
    plain, streamed = plain_and_streamed_gbps(1 << 20, 64 << 10)
    assert plain > 0 and streamed > 0


def test_the_region_baselines_copy_as_the_backends_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """A retrieve's region baseline writes the caches' regions, as a get does; a store's reads
    them (gathered into a buffer), as a put does. Both copy streamed, as the backends' puts and
    gets do (:mod:`kvflow.backends.copies`), and so do the bare calls."""
    copies: list[tuple[bool, bool]] = []  # (into the regions, streamed)
    real = baselines.copy_rows

    def recorded(starts, addrs, sizes, *, into_regions, stream=False):  # type: ignore[no-untyped-def]
        copies.append((into_regions, stream))
        real(starts, addrs, sizes, into_regions=into_regions, stream=stream)

    monkeypatch.setattr(baselines, "copy_rows", recorded)
    src, dst = caches(8, fill=True), caches(8, fill=False)
    before = {name: t.clone() for name, t in src.items()}
    assert region_copy_gbps(KVLayout.from_kv_caches(src), [0, 3]) > 0
    assert all(torch.equal(before[name], src[name]) for name in src)  # read only
    assert region_copy_gbps(KVLayout.from_kv_caches(dst), [0, 3], into_regions=True) > 0
    for name in dst:
        assert dst[name][[0, 3]].all() and not dst[name][[1, 2, 4, 5, 6, 7]].any()
    assert set(copies) == {(False, True), (True, True)}
    copies.clear()
    bare_call_s(KVLayout.from_kv_caches(src), KVLayout.from_kv_caches(dst), [0, 3], range(32), repeat=1)
    assert set(copies) == {(False, True), (True, True)}


def test_best_s_calls_before_ahead_of_each_timed_call_outside_its_timing() -> None:
    """``before`` (a cache flush in ``kvflow bench``) runs before every timed call and is not timed:
    a slow ``before`` beside an instant call still gives an instant best."""
    log: list[str] = []

    def before() -> None:
        log.append("before")
        time.sleep(0.02)

    best = best_s(lambda: log.append("call"), 3, before=before)
    assert log == ["call"] + ["before", "call"] * 3  # one untimed warm-up call, then before each timed one
    assert best < 0.01


BASELINES: dict[str, tuple[int, Callable[[KVLayout, KVLayout, Callable[[], object]], object]]] = {
    # name: (timed calls at repeat=2, the baseline called with a ``before``)
    "memcpy": (2, lambda s, t, before: memcpy_gbps(1 << 20, 64 << 10, repeat=2, before=before)),
    "store memcpy, plain and streamed": (
        4,
        lambda s, t, before: plain_and_streamed_gbps(1 << 20, 64 << 10, repeat=2, before=before),
    ),
    "regions": (2, lambda s, t, before: region_copy_gbps(s, [0, 3], repeat=2, before=before)),
    "hash chain": (2, lambda s, t, before: hash_chain_s(range(32), 16, repeat=2, before=before)),
    "bare store and retrieve": (
        4,
        lambda s, t, before: bare_call_s(s, t, [0, 3], range(32), repeat=2, before=before),
    ),
    "bare store and retrieve sharing the loop": (
        4,
        lambda s, t, before: anyio.run(
            functools.partial(shared_call_s, s, t, [0, 3], range(32), repeat=2, before=before)
        ),
    ),
}


@pytest.mark.parametrize("name", list(BASELINES))
def test_every_baseline_calls_before_ahead_of_each_of_its_timed_calls(name: str) -> None:
    """Each baseline passes ``before`` to each of its timed calls (a baseline timed in cache beside
    kvflow's calls timed out of it would make kvflow look slower than it is)."""
    timed, baseline = BASELINES[name]
    calls: list[None] = []
    baseline(
        KVLayout.from_kv_caches(caches(4, fill=True)),
        KVLayout.from_kv_caches(caches(4, fill=False)),
        lambda: calls.append(None),
    )
    assert len(calls) == timed


def test_the_cache_flush_reads_eight_times_the_largest_cache_from_256_mib_to_1_gib(tmp_path: Path) -> None:
    sizes = ["48K", "1024K", "32768K", "weird", "12KM", "\u00b2K", "1G"]
    for index, size in enumerate(sizes):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / f"index{len(sizes)}" / "size").mkdir(parents=True)  # unreadable: skipped, not raised
    assert last_level_cache_bytes(tmp_path) == 1 << 30
    (tmp_path / "index6" / "size").write_text("512k\n")  # lower case reads as Linux means it
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None  # Linux says nothing: the 256 MiB floor
    assert [flush_bytes(n) for n in (None, 0, 16 << 20, 32 << 20, 100 << 20, 300 << 20)] == [
        256 << 20,
        256 << 20,
        256 << 20,
        256 << 20,
        800 << 20,
        1 << 30,  # a VM reporting its host's whole cache: 2.4 GiB a call would gain nothing
    ]
    flush = CacheFlush()
    assert flush.nbytes == flush_bytes(last_level_cache_bytes())
    assert flush() == flush.nbytes // 8  # every word of the buffer read (each holds 1)
    small = CacheFlush(nbytes=1 << 20)
    assert small() == (1 << 20) // 8
