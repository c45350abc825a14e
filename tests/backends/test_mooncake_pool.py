"""KVPool over a real Mooncake master: lookup across namespaces, and a master lost mid-run.

Runs inside the private network namespace that tests/backends/conftest.py requires.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from kvflow import KVPool, KVRequest, ParallelConfig, PoolConfig
from kvflow.tools.mooncake_master import MasterProcess
from kvflow.transfer import direct
from tests.backends.test_mooncake import REPO, MakeBackend, layout_of, prefix
from tests.helpers import BLOCK, LAYOUTS, record_straight_loads, straight_runs, zeros_like_caches

TOKENS = list(range(300, 300 + BLOCK * 8))

pytestmark = pytest.mark.mooncake


async def test_lookup_is_the_minimum_over_kv_head_and_pp_namespaces(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    backend = mooncake_backends(mooncake_master.url(segment="32MiB"))
    model = prefix()
    kept: list[object] = []
    pools = {}
    for tp in range(2):
        for pp in range(2):
            caches = LAYOUTS["kv_tuple"]()
            kept.append(caches)
            parallel = ParallelConfig(tp_rank=tp, tp_size=2, num_kv_heads=4, pp_rank=pp, pp_size=2)
            pools[tp, pp] = KVPool.create(
                PoolConfig(model=model), layout=layout_of(caches), backend=backend, parallel=parallel
            )
    for (tp, pp), blocks in {(0, 0): 8, (1, 0): 7, (0, 1): 4, (1, 1): 6}.items():
        assert (
            await pools[tp, pp].store(KVRequest(block_ids=list(range(blocks)), tokens=TOKENS))
        ).stored == blocks
    scheduler = KVPool.create(
        PoolConfig(model=model),
        backend=mooncake_backends(mooncake_master.url(segment="0")),
        parallel=ParallelConfig(tp_rank=0, tp_size=2, num_kv_heads=4, pp_size=2),
        format=pools[0, 0].format,
    )
    assert await scheduler.lookup(KVRequest(tokens=TOKENS)) == 4 * BLOCK
    await pools[0, 1].store(KVRequest(block_ids=list(range(8)), tokens=TOKENS))
    assert await scheduler.lookup(KVRequest(tokens=TOKENS)) == 6 * BLOCK


async def two_tp_writers(
    master: MasterProcess, backends: MakeBackend, kind: str
) -> tuple[str, list[dict[str, Any]]]:
    """A new model's name, and the caches of its two TP ranks (2 of its 4 KV heads each, laid out
    as ``kind``) once each stored 8 blocks of ``TOKENS``."""
    model = prefix()
    writers = []
    for tp in range(2):
        caches = LAYOUTS[kind]()
        pool = KVPool.create(
            PoolConfig(model=model),
            layout=layout_of(caches),
            backend=backends(master.url(segment="32MiB")),
            parallel=ParallelConfig(tp_rank=tp, tp_size=2, num_kv_heads=4),
        )
        assert (await pool.store(KVRequest(block_ids=range(8), tokens=TOKENS))).stored == 8
        writers.append(caches)
    return model, writers


async def test_a_reader_at_another_tensor_parallel_size_assembles_its_heads(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    """Two TP ranks store (k, v) tuples of 2 heads each; one TP=1 engine with a flash-attn cache of
    all 4 heads loads them: through the profile book and host chunks registered with Mooncake."""
    model, writers = await two_tp_writers(mooncake_master, mooncake_backends, "kv_tuple")
    reader_caches = {name: torch.zeros(2, 12, BLOCK, 4, 8, dtype=torch.float16) for name in writers[0]}
    reader = KVPool.create(
        PoolConfig(model=model),
        layout=layout_of(reader_caches),
        backend=mooncake_backends(mooncake_master.url(segment="0")),
    )
    assert await reader.lookup(KVRequest(tokens=TOKENS)) == 8 * BLOCK
    got = await reader.retrieve(KVRequest(block_ids=[11, 10, 9, 8, 7, 6, 5, 4], tokens=TOKENS))
    assert got.hit_blocks == 8
    for name, cache in reader_caches.items():
        for i, n in enumerate([11, 10, 9, 8, 7, 6, 5, 4]):
            for part in (0, 1):  # K, V
                for tp in range(2):
                    mine = writers[tp][name][part][i]  # type: ignore[index]
                    assert torch.equal(cache[part, n, :, 2 * tp : 2 * tp + 2], mine), (name, i, part, tp)


async def test_another_tensor_parallel_sizes_objects_go_straight_into_a_reader_laid_out_alike(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two TP ranks store vLLM CPU blocks of 2 heads each; a TP=1 engine laid out alike, with all 4
    heads, gets each object straight into its half of the cache block (kvflow.transfer.direct, its
    runs of any length allowed: these heads are tiny), one Mooncake get of several regions each."""
    monkeypatch.setattr(direct, "min_run_bytes", straight_runs(True))
    straight = record_straight_loads(monkeypatch)
    model, writers = await two_tp_writers(mooncake_master, mooncake_backends, "vllm_cpu")
    reader_caches = {name: torch.zeros(12, 4, BLOCK, 16, dtype=torch.float16) for name in writers[0]}
    reader = KVPool.create(
        PoolConfig(model=model),
        layout=layout_of(reader_caches),
        backend=mooncake_backends(mooncake_master.url(segment="0")),
    )
    blocks = [11, 10, 9, 8, 7, 6, 5, 4]
    got = await reader.retrieve(KVRequest(block_ids=blocks, tokens=TOKENS))
    assert got.hit_blocks == 8 and straight == [8]
    for name, cache in reader_caches.items():
        for i, n in enumerate(blocks):
            for tp in range(2):
                assert torch.equal(cache[n, 2 * tp : 2 * tp + 2], writers[tp][name][i]), (name, i, tp)  # type: ignore[index]


async def test_pool_survives_a_lost_master_with_bounded_failures(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    master = mooncake_master_factory()
    backend = mooncake_backends(
        master.url(segment="16MiB", health_interval=0.5, probe_timeout=1, timeout=5, setup_retries=1)
    )
    src = LAYOUTS["vllm_cpu"]()
    dst = zeros_like_caches(src)
    config = PoolConfig(model=prefix(), timeout_s=8)
    writer = KVPool.create(config, layout=layout_of(src), backend=backend)
    reader = KVPool.create(config, layout=layout_of(dst), backend=backend)
    assert (await writer.store(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS))).stored == 4

    master.kill()
    started = time.monotonic()
    stored = await writer.store(KVRequest(block_ids=[4, 5, 6, 7], tokens=TOKENS, block_offset=4))
    assert stored.failed_indices == (0, 1, 2, 3)
    got = await reader.retrieve(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS))
    assert got.failed_block_ids == (0, 1, 2, 3)
    assert time.monotonic() - started < 20
    t = time.monotonic()
    assert await reader.lookup(KVRequest(tokens=TOKENS)) == 0
    assert time.monotonic() - t < 2.0  # the health gate answers at once while the master is down

    restarted = mooncake_master_factory(rpc_port=master.rpc_port)
    assert restarted.alive()
    deadline = time.monotonic() + 30
    while (await writer.store(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS))).stored != 4:
        assert time.monotonic() < deadline, "the pool did not recover within 30 s of the restart"
        await anyio.sleep(0.25)
    assert await reader.lookup(KVRequest(tokens=TOKENS)) == 4 * BLOCK
    assert (await reader.retrieve(KVRequest(block_ids=[0, 1, 2, 3], tokens=TOKENS))).hit_blocks == 4


def test_demo_verifies_through_mooncake(mooncake_master: MasterProcess) -> None:
    url = mooncake_master.url(segment="256MiB")
    proc = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "demo", "--backend", url, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True and summary["blocks_retrieved"] > 0
