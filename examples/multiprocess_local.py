"""Two OS processes share KV through the local shared-memory backend, with no server.

Process "writer" computes a prompt's KV and stores it; process "reader", started afterwards with an
empty cache, looks the prompt up and loads it. Each builds its cache from the same seed, so the
reader can check every loaded byte.

Run: python examples/multiprocess_local.py [local:///dev/shm/DIR] [--keep]

Without a URL it uses a fresh directory in /dev/shm and removes it at the end; with one, the reader
removes the objects the writer stored. ``--keep`` keeps them.
"""

from __future__ import annotations

import multiprocessing
import shutil
import sys
import tempfile

import torch

import kvflow

BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 16, 2, 16, 64, 4
PROMPT = list(range(500, 500 + BLOCK * 8))


def computed_kv() -> dict[str, torch.Tensor]:
    """What the "engine" computes for PROMPT: the same bytes in every process."""
    gen = torch.Generator().manual_seed(1234)
    return {
        f"layers.{i}": torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen) for i in range(LAYERS)
    }


def writer(url: str) -> None:
    kv = computed_kv()
    with kvflow.SyncPool.open(
        kvflow.PoolConfig(backend=url, model="example"), layout=kvflow.KVLayout.from_kv_caches(kv)
    ) as pool:
        result = pool.store(kvflow.KVRequest(block_ids=list(range(8)), tokens=PROMPT), timeout_s=60)
    print(f"writer (pid {multiprocessing.current_process().pid}): stored {result.stored} blocks", flush=True)


def reader(url: str, keep: bool, verdict: multiprocessing.Queue[bool]) -> None:
    kv = {name: torch.zeros_like(t) for name, t in computed_kv().items()}
    with kvflow.SyncPool.open(
        kvflow.PoolConfig(backend=url, model="example"), layout=kvflow.KVLayout.from_kv_caches(kv)
    ) as pool:
        hit = pool.lookup(kvflow.KVRequest(tokens=PROMPT), timeout_s=60)
        request = kvflow.KVRequest(block_ids=range(hit // BLOCK), tokens=PROMPT)
        got = pool.retrieve(request, timeout_s=60)
        if not keep:
            pool.remove(request, timeout_s=60)
    expected = computed_kv()
    same = all(torch.equal(kv[n][:8], expected[n][:8]) for n in kv)
    print(
        f"reader (pid {multiprocessing.current_process().pid}): lookup hit {hit} tokens, "
        f"loaded {got.hit_blocks} blocks, identical: {same}",
        flush=True,
    )
    verdict.put(same and got.hit_blocks == 8)


def main(url: str, keep: bool) -> int:
    ctx = multiprocessing.get_context("spawn")
    first = ctx.Process(target=writer, args=(url,))
    first.start()
    first.join(120)
    verdict: multiprocessing.Queue[bool] = ctx.Queue()
    second = ctx.Process(target=reader, args=(url, keep, verdict))
    second.start()
    second.join(120)
    ok = first.exitcode == 0 and second.exitcode == 0 and verdict.get(timeout=5)
    return 0 if ok else 1


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--keep"]
    keep = "--keep" in sys.argv[1:]
    if args:
        sys.exit(main(args[0], keep))
    store = tempfile.mkdtemp(prefix="kvflow-example-", dir="/dev/shm")
    try:
        sys.exit(main(f"local://{store}", keep))
    finally:
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
