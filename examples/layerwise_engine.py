"""A synchronous engine that stores and loads its KV cache layer by layer with kvflow.

Engine A runs a prompt's prefill one layer at a time. After each layer's KV is written it calls
``save_layer(layer)``: kvflow stores that layer while A computes the next one. Engine B gets the
same prompt, looks it up, and loads the hit blocks layer by layer: ``wait_for_layer_load(layer)``
returns as soon as that layer is in place, while the next layer is still on its way, so B computes
layer ``l`` while layer ``l+1`` loads.

Run: python examples/layerwise_engine.py [backend-url] [--keep]
"""

from __future__ import annotations

import sys
import time

import torch

import kvflow
from kvflow.sync_layerwise import StepResult

NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM, LAYERS = 32, 4, 16, 64, 6
COMPUTE_S = 0.01  # the rest of a layer's work, besides writing its KV


class TinyEngine:
    """Stands in for an engine: a paged KV cache in vLLM's CPU layout and a layer-by-layer forward."""

    def __init__(self, backend: kvflow.Backend) -> None:
        self.kv_caches = {
            f"layers.{i}.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.float16)
            for i in range(LAYERS)
        }
        layout = kvflow.KVLayout.from_kv_caches(self.kv_caches)
        config = kvflow.PoolConfig(model="tiny", layerwise=True)
        self.kv = kvflow.SyncLayerwisePool.open(config, layout=layout, backend=backend)

    def write_kv(self, layer: int, tokens: list[int], block_ids: list[int], first_block: int) -> None:
        """The layer's "kernel": KV of blocks ``first_block..`` of the prompt into ``block_ids``."""
        cache = list(self.kv_caches.values())[layer]
        for i, block_id in enumerate(block_ids, start=first_block):
            chunk = torch.zeros(BLOCK, dtype=torch.float16)  # the last block may be partial
            part = tokens[i * BLOCK : (i + 1) * BLOCK]
            chunk[: len(part)] = torch.tensor(part, dtype=torch.float16)
            cache[block_id] = chunk.view(1, BLOCK, 1) * (layer + 1) / 1024

    def forward(
        self,
        tokens: list[int],
        block_ids: list[int],
        *,
        hit_blocks: int = 0,
        check: TinyEngine | None = None,
    ) -> StepResult:
        """One step, in the order a vLLM connector drives kvflow: start loads and stores, then per
        layer wait for its load, compute it, save it; finally wait for the saves."""
        full = len(tokens) // BLOCK
        if hit_blocks:
            hit = kvflow.KVRequest(request_id="prompt", block_ids=block_ids[:hit_blocks], tokens=tokens)
            self.kv.start_load([hit])
        if hit_blocks < full:
            ids = block_ids[hit_blocks:full]
            new = kvflow.KVRequest(request_id="prompt", block_ids=ids, tokens=tokens, block_offset=hit_blocks)
            self.kv.start_store([new])
        for layer in range(LAYERS):
            self.kv.wait_for_layer_load(layer, timeout_s=30)
            if check is not None and not self.same_layer(check, layer, block_ids[:hit_blocks]):
                raise RuntimeError(f"layer {layer} was not in place when wait_for_layer_load returned")
            self.write_kv(layer, tokens, block_ids[hit_blocks:], hit_blocks)  # only the missing blocks
            time.sleep(COMPUTE_S)
            self.kv.save_layer(layer)
        return self.kv.wait_for_save(timeout_s=30)

    def same_layer(self, other: TinyEngine, layer: int, block_ids: list[int]) -> bool:
        mine, theirs = list(self.kv_caches.values())[layer], list(other.kv_caches.values())[layer]
        return all(torch.equal(mine[b], theirs[i]) for i, b in enumerate(block_ids))


def main(url: str) -> int:
    backend = kvflow.open_backend(url)
    prompt = list(range(7, 7 + BLOCK * 10 + 3))  # 10 full blocks and 3 extra tokens

    first = TinyEngine(backend)
    saved = first.forward(prompt, list(range(11)))
    print("stored", saved.stored["prompt"].stored, "blocks x", LAYERS, "layers")

    second = TinyEngine(backend)
    hit_tokens = second.kv.lookup(kvflow.KVRequest(tokens=prompt), timeout_s=30)
    hit_blocks = hit_tokens // BLOCK
    targets = list(range(20, 31))
    start = time.perf_counter()
    loaded = second.forward(prompt, targets, hit_blocks=hit_blocks, check=first)
    elapsed = time.perf_counter() - start
    same = all(second.same_layer(first, layer, targets[:hit_blocks]) for layer in range(LAYERS))
    print(
        f"lookup hit {hit_tokens} tokens, loaded {loaded.loaded['prompt'].hit_blocks} blocks layer by layer "
        f"in a {LAYERS}-layer forward of {elapsed * 1e3:.0f} ms, identical: {same}"
    )
    if "--keep" not in sys.argv:  # on a store that outlives the run, leave nothing behind
        second.kv.remove(kvflow.KVRequest(tokens=prompt), timeout_s=30)
    second.kv.close()
    first.kv.close()
    return 0 if same and loaded.loaded["prompt"].hit_blocks == 10 else 1


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--keep"]
    sys.exit(main(args[0] if args else "memory://"))
