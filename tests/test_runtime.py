from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from kvflow import KVLayout, MemoryBackend, PoolClosedError, PoolConfig, SyncPool
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend, block_bytes, zeros_like_caches

TOKENS = list(range(BLOCK * 6))


def test_sync_facade_round_trip_starts_exactly_one_thread() -> None:
    src = LAYOUTS["vllm_cpu"]()
    dst = zeros_like_caches(src)
    backend = MemoryBackend()
    before = set(threading.enumerate())
    writer = SyncPool.open(layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    started = set(threading.enumerate()) - before
    assert len(started) == 1
    future = writer.submit_store(list(range(6)), tokens=TOKENS)
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(5).stored == 6
    assert writer.lookup(tokens=TOKENS, timeout_s=5) == 6 * BLOCK
    assert set(threading.enumerate()) - before == started
    reader = SyncPool.open(layout=KVLayout.from_kv_caches(dst), backend=backend)  # type: ignore[arg-type]
    result = reader.retrieve(list(range(6)), tokens=TOKENS, timeout_s=5)
    assert result.hit_blocks == 6
    assert all(block_bytes(dst["l0"], i) == block_bytes(src["l0"], i) for i in range(6))
    assert len(set(threading.enumerate()) - before) == 2  # one loop thread per SyncPool, nothing else
    reader.close()
    writer.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(PoolClosedError):
        writer.lookup(tokens=TOKENS)


def test_blocking_calls_time_out_when_the_backend_hangs() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend(hang_on={"get"})
    with SyncPool.open(
        PoolConfig(timeout_s=60), layout=KVLayout.from_kv_caches(src), backend=backend
    ) as pool:  # type: ignore[arg-type]
        with pytest.raises(TimeoutError):
            pool.retrieve([0], tokens=TOKENS[:BLOCK], timeout_s=0.3)
        # the loop is still healthy after a timed-out call
        assert pool.store([0], tokens=TOKENS[:BLOCK], timeout_s=5).stored == 1


def test_stop_cancels_a_call_that_was_given_up_on() -> None:
    src = LAYOUTS["vllm_cpu"]()
    backend = FaultyBackend(hang_on={"put"})
    pool = SyncPool.open(PoolConfig(timeout_s=600), layout=KVLayout.from_kv_caches(src), backend=backend)  # type: ignore[arg-type]
    stuck = pool.submit_store([0], tokens=TOKENS[:BLOCK])
    with pytest.raises(concurrent.futures.TimeoutError):
        stuck.result(0.2)
    start = time.monotonic()
    pool.close(timeout_s=0.2)  # the pool gives up waiting; stopping the loop cancels the put
    assert time.monotonic() - start < 5
    assert stuck.done()
