"""Awaiting kvflow directly in a script: store blocks, look them up, retrieve them elsewhere.

Run: python examples/async_script.py [backend-url] [--keep]
"""

from __future__ import annotations

import sys

import anyio
import torch

import kvflow


async def main(url: str) -> int:
    backend = kvflow.open_backend(url)
    # An Ascend-style layer: a (K, V) tuple, each [num_blocks, block_size, heads, head_dim].
    source = {f"l{i}": (torch.randn(16, 32, 2, 64), torch.randn(16, 32, 2, 64)) for i in range(2)}
    target = {name: (torch.zeros_like(k), torch.zeros_like(v)) for name, (k, v) in source.items()}
    tokens = list(range(32 * 5))

    config = kvflow.PoolConfig(model="example-async-script")  # a shared store keeps models apart by name
    async with kvflow.KVPool.create(
        config, layout=kvflow.KVLayout.from_kv_caches(source), backend=backend
    ) as pool:
        stored = await pool.store(kvflow.KVRequest(block_ids=[0, 1, 2, 3, 4], tokens=tokens))
        hit = await pool.lookup(kvflow.KVRequest(tokens=tokens))
        print("stored", stored.stored, "blocks; lookup says", hit, "tokens")
        reader = kvflow.KVPool.create(config, layout=kvflow.KVLayout.from_kv_caches(target), backend=backend)
        got = await reader.retrieve(kvflow.KVRequest(block_ids=[10, 11, 12, 13, 14], tokens=tokens))
        if "--keep" not in sys.argv:  # on a store that outlives the run, leave nothing behind
            await pool.remove(kvflow.KVRequest(tokens=tokens))
    ok = got.hit_blocks == 5 and all(
        torch.equal(target[n][p][10 + i], source[n][p][i]) for n in source for p in (0, 1) for i in range(5)
    )
    print("retrieved", got.hit_blocks, "blocks, bit-exact:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--keep"]
    sys.exit(anyio.run(main, args[0] if args else "memory://"))
