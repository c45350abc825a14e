"""A synchronous engine using kvflow: register the KV cache, store a prompt's blocks after prefill,
and let a second engine instance load them instead of recomputing.

Run: python examples/custom_engine.py [backend-url] [--keep]
"""

from __future__ import annotations

import sys

import torch

import kvflow

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 32, 4, 16, 64, 4


class TinyEngine:
    """Stands in for an engine: a paged KV cache in vLLM's CPU layout and a fake prefill."""

    def __init__(self, backend: kvflow.Backend) -> None:
        self.kv_caches = {
            f"layers.{i}.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.float16)
            for i in range(LAYERS)
        }
        layout = kvflow.KVLayout.from_kv_caches(self.kv_caches)
        # One loop thread serves this engine; every call below returns a future or blocks with a timeout.
        self.kv = kvflow.SyncPool.open(kvflow.PoolConfig(model="tiny"), layout=layout, backend=backend)

    def prefill(self, tokens: list[int], block_ids: list[int]) -> None:
        for layer, cache in enumerate(self.kv_caches.values()):
            for i, block_id in enumerate(block_ids):
                chunk = torch.tensor(tokens[i * BLOCK : (i + 1) * BLOCK], dtype=torch.float16)
                cache[block_id] = chunk.view(1, BLOCK, 1) * (layer + 1)


def main(url: str) -> int:
    backend = kvflow.open_backend(url)
    prompt = list(range(7, 7 + BLOCK * 10 + 3))  # 10 full blocks and 3 extra tokens

    first = TinyEngine(backend)
    first.prefill(prompt, list(range(10)))
    # The store runs on kvflow's loop thread while the engine goes on decoding.
    saving = first.kv.submit_store(kvflow.KVRequest(block_ids=list(range(10)), tokens=prompt))
    print("stored", saving.result(timeout=30).stored, "blocks")

    second = TinyEngine(backend)
    hit_tokens = second.kv.lookup(kvflow.KVRequest(tokens=prompt), timeout_s=30)
    hit_blocks = hit_tokens // BLOCK
    targets = list(range(20, 20 + hit_blocks))
    loaded = second.kv.retrieve(kvflow.KVRequest(block_ids=targets, tokens=prompt), timeout_s=30)
    same = all(
        torch.equal(second.kv_caches[name][t], first.kv_caches[name][s])
        for name in first.kv_caches
        for s, t in zip(range(hit_blocks), targets)
    )
    print(f"lookup hit {hit_tokens} tokens, loaded {loaded.hit_blocks} blocks, identical: {same}")
    if "--keep" not in sys.argv:  # on a store that outlives the run, leave nothing behind
        second.kv.remove(kvflow.KVRequest(tokens=prompt), timeout_s=30)
    second.kv.close()
    first.kv.close()
    return 0 if same and loaded.hit_blocks == 10 else 1


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--keep"]
    sys.exit(main(args[0] if args else "memory://"))
