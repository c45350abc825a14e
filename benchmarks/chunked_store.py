"""What keeping a chunked prompt's head the newest costs: a long prompt stored a chunk at a time.

    python benchmarks/chunked_store.py [--backend URL] [--blocks 2048] [--chunk 128]
                                       [--object 64KiB] [--repeat 5] [--json]

vLLM saves a long prompt as it computes it, one chunk a step. Each later chunk's store touches the
blocks before it, while they are at most ``kvflow.transfer.jobs.TOUCH_RATIO`` times the chunk
(docs/architecture.md), so that eviction takes the prompt from its tail. This times the pool's
stores of a whole prompt of ``--blocks`` blocks in chunks of ``--chunk`` (each block one object of
``--object`` bytes), with those touches and without them (the same stores, ``TOUCH_RATIO`` set to
0), in turns, ``--repeat`` times each, after one untimed store of a prompt (the store's memory
faulted in). It reports the medians in milliseconds, their ratio, and the touches a block stored.

Each store must answer STORED for every block of its chunk, and after each run the prompt is
looked up whole and removed (a run that left less fails). The store given by ``--backend``
(default ``memory://``) is left as it was found, but for the pool's profile announcement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
import torch

import kvflow.transfer.jobs as jobs
from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends import open_backend
from kvflow.config import parse_size
from kvflow.keys import hash_blocks

BLOCK = 16  # tokens a block


async def _store_prompt(pool: KVPool, blocks: int, chunk: int, first_token: int) -> float:
    """Seconds to store one prompt chunk by chunk; the prompt is then checked and removed."""
    hashes = hash_blocks(range(first_token, first_token + blocks * BLOCK), BLOCK)
    start_s = time.perf_counter()
    for start in range(0, blocks, chunk):
        end = min(start + chunk, blocks)
        request = KVRequest(block_ids=range(start, end), block_hashes=hashes[:end], block_offset=start)
        result = await pool.store(request)
        if result.stored != end - start:
            raise RuntimeError(f"a chunk's store kept {result.stored} of {end - start} blocks")
    took = time.perf_counter() - start_s
    held = await pool.lookup(KVRequest(block_hashes=hashes))
    await pool.remove(KVRequest(block_hashes=hashes))
    if held != blocks * BLOCK:
        raise RuntimeError(f"the store holds {held // BLOCK} of the prompt's {blocks} blocks")
    return took


def touches_per_block(blocks: int, chunk: int, ratio: int) -> float:
    """The touches the pool's rule makes for one prompt, per block stored."""
    touched = 0
    for start in range(chunk, blocks, chunk):
        if start <= ratio * min(chunk, blocks - start):
            touched += start
    return touched / blocks


async def run(url: str, blocks: int, chunk: int, object_bytes: int, repeat: int) -> dict[str, float]:
    floats = object_bytes // (2 * BLOCK * 4)
    if floats * 2 * BLOCK * 4 != object_bytes:
        raise SystemExit(f"--object must be a multiple of {2 * BLOCK * 4} bytes")
    caches = {"l0": torch.randn(blocks, 2, BLOCK, floats)}
    backend = open_backend(url)
    config = PoolConfig(model=f"chunked-store-{time.time_ns()}")
    pool = KVPool.create(config, layout=KVLayout.from_kv_caches(caches), backend=backend)
    ratio = jobs.TOUCH_RATIO
    times: dict[str, list[float]] = {"touched": [], "untouched": []}
    try:
        await _store_prompt(pool, blocks, chunk, 1 - blocks * BLOCK)  # untimed: the store's memory faulted in
        for r in range(repeat):
            for mode in ("touched", "untouched"):
                jobs.TOUCH_RATIO = ratio if mode == "touched" else 0
                first_token = (2 * r + (mode == "untouched")) * blocks * BLOCK + 1
                times[mode].append(await _store_prompt(pool, blocks, chunk, first_token))
    finally:
        jobs.TOUCH_RATIO = ratio
        await pool.aclose()
        await backend.aclose()
    touched_ms = statistics.median(times["touched"]) * 1e3
    untouched_ms = statistics.median(times["untouched"]) * 1e3
    return {
        "blocks": blocks,
        "chunk": chunk,
        "object_bytes": object_bytes,
        "touched_ms": touched_ms,
        "untouched_ms": untouched_ms,
        "ratio": touched_ms / untouched_ms,
        "touches_per_block": touches_per_block(blocks, chunk, ratio),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="memory://")
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--object", default="64KiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.blocks < 1 or args.chunk < 1 or args.repeat < 1:
        raise SystemExit("--blocks, --chunk and --repeat must be positive")
    out = anyio.run(run, args.backend, args.blocks, args.chunk, parse_size(args.object), args.repeat)
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{out['blocks']} blocks of {args.object} in chunks of {out['chunk']}, {args.backend}: "
        f"{out['touched_ms']:.1f} ms with the earlier blocks touched, {out['untouched_ms']:.1f} ms without "
        f"({out['ratio']:.2f}x; {out['touches_per_block']:.1f} touches a block stored)"
    )


if __name__ == "__main__":
    main()
