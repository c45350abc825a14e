"""``kvflow bench --scale``: how cost grows with the work.

- **store size**: the store already holds 1k, 10k and 100k blocks (quick: 1k and 10k); then one
  request of 1000 new blocks is stored, retrieved and looked up. Time per block should stay flat
  as the store grows.
- **many requests**: 256 requests of 8 blocks each stored, then retrieved, all at once (one task
  and one pool call each, as a serving engine's concurrent requests), and again in steps of 16
  requests, each step one :meth:`~kvflow.KVPool.store_many` / :meth:`~kvflow.KVPool.retrieve_many`
  call (as the vLLM connector moves a step's requests); reported as requests and blocks per second.

Small objects (8 KiB: 4 layers of 2 KiB) so that the per-block work, not the copy, dominates. Every
fill is checked: each of its stores must store every block, and after the timed calls a lookup
must still find every block filled (a store too small to hold them fails the run, so that "blocks
held" is what the store held).
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import torch

from kvflow.backends import open_backend
from kvflow.config import PoolConfig
from kvflow.layout import KVLayout
from kvflow.pool import KVPool
from kvflow.request import KVRequest

__all__ = ["run_scale_bench", "scale_main"]

_BLOCK = 16
_WORK = 1000  # blocks of the request timed at each store size
_STEP = 16  # requests per call in the many-requests run's steps
_LAYERS, _WIDTH = 4, 64  # caches of 4 layers of [blocks, 1, _BLOCK, _WIDTH] float16
_OBJECT_BYTES = _LAYERS * _BLOCK * _WIDTH * 2  # one block's object: 8 KiB


def _pool(url: str, blocks: int, model: str) -> tuple[KVPool, Any, dict[str, torch.Tensor]]:
    caches = {f"l{i}": torch.zeros(blocks, 1, _BLOCK, _WIDTH, dtype=torch.float16) for i in range(_LAYERS)}
    backend = open_backend(url)
    pool = KVPool.create(PoolConfig(model=model), layout=KVLayout.from_kv_caches(caches), backend=backend)
    return pool, backend, caches


def _scribble(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Fill the caches with random bytes; return a copy of them to check a retrieve against."""
    for cache in caches.values():
        cache.view(torch.int16).random_()
    return [cache.clone() for cache in caches.values()]


def _check(caches: dict[str, torch.Tensor], stored: list[torch.Tensor], what: str) -> None:
    """Raise unless the caches hold exactly the bytes ``stored`` (the retrieve started from zeros)."""
    pairs = zip(caches.values(), stored)
    if not all(torch.equal(got.view(torch.int16), want.view(torch.int16)) for got, want in pairs):
        raise RuntimeError(f"bench: {what} loaded other bytes than were stored")


def _zero(caches: dict[str, torch.Tensor]) -> None:
    for cache in caches.values():
        cache.zero_()


def _request(salt: int, blocks: int) -> KVRequest:
    return KVRequest(block_ids=range(blocks), tokens=[salt, *range(1, blocks * _BLOCK)])


def _fill_salts(blocks: int) -> range:
    """The requests (by salt) that :func:`_fill` stores."""
    return range(1_000_000, 1_000_000 + blocks // _WORK)


async def _fill(pool: KVPool, blocks: int) -> None:
    """Put ``blocks`` objects in the store, in requests of ``_WORK`` blocks; raise unless each
    request stored every block."""
    for salt in _fill_salts(blocks):
        stored = (await pool.store(_request(salt, _WORK))).stored
        if stored != _WORK:
            raise RuntimeError(
                f"bench: a fill stored {stored} of {_WORK} blocks: give the store room for "
                f"{blocks + 2 * _WORK} objects of {_OBJECT_BYTES >> 10} KiB"
            )


async def _check_held(pool: KVPool, blocks: int) -> None:
    """Raise unless a lookup still finds every block :func:`_fill` stored (a store too small for
    them evicts some, and the run would not measure a store holding ``blocks``)."""
    found = 0
    for salt in _fill_salts(blocks):
        found += await pool.lookup(_request(salt, _WORK)) // _BLOCK
    if found != blocks:
        raise RuntimeError(
            f"bench: a lookup found {found} of the {blocks} blocks filled (the store evicted): give "
            f"it room for {blocks + 2 * _WORK} objects of {_OBJECT_BYTES >> 10} KiB"
        )


async def _per_block_us(url: str, held: int) -> dict[str, float]:
    pool, backend, caches = _pool(url, _WORK, f"bench-scale-{time.time_ns()}")
    out: dict[str, float] = {"held_blocks": held}
    try:
        await _fill(pool, held)
        stored = _scribble(caches)
        start = time.perf_counter()
        if (await pool.store(_request(7, _WORK))).stored != _WORK:
            raise RuntimeError("bench: a store did not store every block")
        out["store_us_per_block"] = (time.perf_counter() - start) / _WORK * 1e6
        _zero(caches)
        start = time.perf_counter()
        if (await pool.retrieve(_request(7, _WORK))).hit_blocks != _WORK:
            raise RuntimeError("bench: a retrieve did not load every block")
        out["retrieve_us_per_block"] = (time.perf_counter() - start) / _WORK * 1e6
        _check(caches, stored, "a retrieve")
        start = time.perf_counter()
        if await pool.lookup(_request(7, _WORK)) != _WORK * _BLOCK:
            raise RuntimeError("bench: a lookup missed blocks it had stored")
        out["lookup_us_per_block"] = (time.perf_counter() - start) / _WORK * 1e6
        await _check_held(pool, held)
    finally:  # leave nothing in the store, also when a run failed
        with anyio.CancelScope(shield=True):
            for salt in [7, *_fill_salts(held)]:
                await pool.remove(_request(salt, _WORK))
            await backend.aclose()
    return out


async def _many_requests(url: str, requests: int, blocks: int) -> dict[str, float]:
    pool, backend, caches = _pool(url, requests * blocks, f"bench-many-{time.time_ns()}")

    def request(r: int, salt: int) -> KVRequest:
        ids = range(r * blocks, (r + 1) * blocks)
        return KVRequest(block_ids=ids, tokens=[salt, r, *range(2, blocks * _BLOCK)])

    async def concurrent(op: str, batch: list[KVRequest]) -> list[Any]:
        results: list[Any] = [None] * len(batch)

        async def one(i: int) -> None:
            call = pool.store if op == "store" else pool.retrieve
            results[i] = await call(batch[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(batch)):
                tg.start_soon(one, i)
        return results

    async def in_steps(op: str, batch: list[KVRequest]) -> list[Any]:
        call = pool.store_many if op == "store" else pool.retrieve_many
        results: list[Any] = []
        for start in range(0, len(batch), _STEP):
            results += await call(batch[start : start + _STEP])
        return results

    out: dict[str, float] = {"requests": requests, "blocks_per_request": blocks, "step_requests": _STEP}
    stored: list[KVRequest] = []
    try:
        for salt, (way, run) in enumerate((("", concurrent), ("_in_steps", in_steps))):
            batch = [request(r, salt) for r in range(requests)]
            stored += batch
            written = _scribble(caches)
            for op in ("store", "retrieve"):
                if op == "retrieve":
                    _zero(caches)
                start = time.perf_counter()
                results = await run(op, batch)
                seconds = time.perf_counter() - start
                moved = [r.stored if op == "store" else r.hit_blocks for r in results]
                if moved != [blocks] * requests:
                    raise RuntimeError(f"bench: a {op} of the many-requests run missed blocks")
                out[f"{op}{way}_requests_per_s"] = requests / seconds
                out[f"{op}{way}_blocks_per_s"] = requests * blocks / seconds
            _check(caches, written, f"the many-requests run's retrieve{way.replace('_', ' ')}")
    finally:  # leave nothing in the store, also when a run failed
        with anyio.CancelScope(shield=True):
            for one in stored:
                await pool.remove(one)
            await backend.aclose()
    return out


async def run_scale_bench(url: str, *, quick: bool) -> dict[str, Any]:
    sizes = (1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    capacity_url = url
    if url == "memory://":  # room for the largest store
        capacity_url = f"memory://?capacity={(max(sizes) + 2 * _WORK) * _OBJECT_BYTES}"
    return {
        "backend": url,
        "store_size": [await _per_block_us(capacity_url, n) for n in sizes],
        "many_requests": await _many_requests(capacity_url, 64 if quick else 256, 8),
    }


def scale_main(url: str, *, as_json: bool, quick: bool) -> int:
    result = anyio.run(lambda: run_scale_bench(url, quick=quick))
    if as_json:
        print(json.dumps(result))
        return 0
    print(f"backend {url}; per block of a {_WORK}-block request, {_OBJECT_BYTES >> 10} KiB objects")
    print(f"{'blocks held':>11} {'store us':>9} {'retrieve us':>11} {'lookup us':>9}")
    for row in result["store_size"]:
        print(
            f"{row['held_blocks']:>11,.0f} {row['store_us_per_block']:>9.1f} "
            f"{row['retrieve_us_per_block']:>11.1f} {row['lookup_us_per_block']:>9.1f}"
        )
    many = result["many_requests"]
    stores, loads = many["store_requests_per_s"], many["retrieve_requests_per_s"]
    print(
        f"{many['requests']:.0f} concurrent requests of {many['blocks_per_request']:.0f} blocks: "
        f"store {stores:,.0f} req/s, retrieve {loads:,.0f} req/s"
    )
    stores, loads = many["store_in_steps_requests_per_s"], many["retrieve_in_steps_requests_per_s"]
    print(
        f"  the same in steps of {many['step_requests']:.0f} requests, one call each: "
        f"store {stores:,.0f} req/s, retrieve {loads:,.0f} req/s"
    )
    return 0
