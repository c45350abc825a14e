"""Many pools of different shapes share one small, faulty memory store and run stores,
retrieves and removes of overlapping prompts concurrently. Whatever interleaving the seed picks,
every block a retrieve (or a layerwise load) reports loaded holds exactly the KV of that prompt's
tokens, and nothing writes a retrieve's blocks after it returned.

The KV of a token is a function of the prompt up to the token's hash_tokens group (so every engine,
whatever its block size, writes the same bytes under one key). The store evicts (tiny capacity);
its gets scribble junk into the regions of every object they do not report HIT, fail whole batches
after scribbling, or hang past the deadline; puts fail before or after storing; exists fails.
Pools: whole-block and layerwise, direct and staged (through a LateDevice, copies completing late),
blocks of 4 and 8 tokens (so loads reshape another engine's objects), and the two ranks of a TP=2
replica group (each stores half the blocks).
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Sequence

import anyio
import attrs
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import GetStatus, KVLayout, KVPool, KVRequest, MemoryBackend, ParallelConfig, PoolConfig
from kvflow.backends import ObjectRef
from kvflow.backends.arena import ArenaBackend
from kvflow.backends.base import BackendCapabilities, BackendStats, PutStatus
from kvflow.backends.memory import MemoryConfig
from kvflow.events import CpuEvent, LayerEvents
from kvflow.profiles import is_book_key
from tests.helpers import bounded_shm
from tests.test_staging import LateDevice

LAYERS, D, HASH = 3, 8, 4
BLOCKS = 40  # per pool cache


def token_kv(tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, tokens, 1, D]``: token t's from the prompt up to its hash group's end."""
    n = len(tokens) // HASH * HASH
    k = torch.empty(LAYERS, n, 1, D, dtype=torch.float16)
    v = torch.empty(LAYERS, n, 1, D, dtype=torch.float16)
    for g in range(n // HASH):
        gen = torch.Generator().manual_seed(hash(tuple(tokens[: (g + 1) * HASH])) & 0x7FFFFFFF)
        k[:, g * HASH : (g + 1) * HASH] = torch.randn(LAYERS, HASH, 1, D, generator=gen).half()
        v[:, g * HASH : (g + 1) * HASH] = torch.randn(LAYERS, HASH, 1, D, generator=gen).half()
    return k, v


@attrs.define(eq=False)
class ChaosBackend:
    inner: MemoryBackend
    rng: random.Random
    faults: bool = True
    hang_s: float = 0.6

    @property
    def max_batch(self) -> int:
        return 3

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.inner.capabilities

    def register_memory(self, addr: int, nbytes: int) -> None:
        pass

    def stats(self) -> BackendStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        pass

    @staticmethod
    def _scribble(obj: ObjectRef) -> None:
        for addr, size in zip(obj.addrs, obj.sizes):
            ctypes.memset(addr, 0x7B, size)

    async def _jitter(self) -> None:
        if self.faults:
            await anyio.sleep(self.rng.choice([0, 0, 0, 0.0005, 0.002]))

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        objects = list(objects)
        if all(is_book_key(o.key) for o in objects):
            return await self.inner.put(objects)
        await self._jitter()
        roll = self.rng.random() if self.faults else 1.0
        if roll < 0.08:
            raise ConnectionError("put fails before storing")
        results = await self.inner.put(objects)
        if roll < 0.14:
            raise ConnectionError("put fails after storing")
        return results

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        objects = list(objects)
        if all(is_book_key(o.key) for o in objects):
            return await self.inner.get(objects)
        await self._jitter()
        roll = self.rng.random() if self.faults else 1.0
        if roll < 0.06:
            for o in objects:
                self._scribble(o)
            raise ConnectionError("get fails after scribbling")
        if roll < 0.09:
            for o in objects:
                self._scribble(o)
            await anyio.sleep(self.hang_s)  # past the deadline: cancelled
        results = await self.inner.get(objects)
        out = []
        for o, r in zip(objects, results):
            if r is GetStatus.HIT and self.faults and self.rng.random() < 0.1:
                r = GetStatus.FAILED
            if r is not GetStatus.HIT:
                self._scribble(o)
            out.append(r)
        await self._jitter()
        return out

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if keys and not all(is_book_key(k) for k in keys) and self.faults and self.rng.random() < 0.05:
            raise ConnectionError("exists fails")
        return await self.inner.exists(keys)

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.remove(keys)


@attrs.define(eq=False)
class Engine:
    name: str
    pool: KVPool
    caches: dict[str, tuple[torch.Tensor, torch.Tensor]]
    block: int
    layerwise: bool
    free: list[int]


def make_engine(
    name: str,
    backend: ChaosBackend,
    rng: random.Random,
    *,
    block: int,
    layerwise: bool,
    staged: bool,
    tp: tuple[int, int] = (0, 1),
) -> Engine:
    caches = {
        f"model.layers.{layer}.attn": (
            torch.full((BLOCKS, block, 1, D), float("nan"), dtype=torch.float16),
            torch.full((BLOCKS, block, 1, D), float("nan"), dtype=torch.float16),
        )
        for layer in range(LAYERS)
    }
    unit = 2 * block * D * 2 * (1 if layerwise else LAYERS)
    config = PoolConfig(
        model="m",
        hash_tokens=HASH,
        layerwise=layerwise,
        staging="always" if staged else "auto",
        staging_bytes=unit * rng.choice([1, 2, 3]),
        timeout_s=0.4,
    )
    parallel = ParallelConfig(tp_rank=tp[0], tp_size=tp[1], num_kv_heads=1) if tp[1] > 1 else ParallelConfig()
    device = (
        LateDevice(torch.device("cpu"), max_delay_s=0.003, rng=random.Random(rng.random()))
        if staged
        else None
    )
    pool = KVPool.create(
        config,
        layout=KVLayout.from_kv_caches(caches),
        backend=backend,
        parallel=parallel,
        device=device,  # type: ignore[arg-type]
    )
    return Engine(name, pool, caches, block, layerwise, list(range(BLOCKS)))


def fill(engine: Engine, ids: list[int], k: torch.Tensor, v: torch.Tensor, first_block: int) -> None:
    b = engine.block
    for layer, (kc, vc) in enumerate(engine.caches.values()):
        for i, n in enumerate(ids):
            t = (first_block + i) * b
            kc[n].copy_(k[layer, t : t + b])
            vc[n].copy_(v[layer, t : t + b])


def check(
    engine: Engine,
    ids: list[int],
    statuses: Sequence[GetStatus],
    k: torch.Tensor,
    v: torch.Tensor,
    first_block: int,
    what: str,
) -> None:
    b = engine.block
    for layer, (kc, vc) in enumerate(engine.caches.values()):
        for i, (n, s) in enumerate(zip(ids, statuses)):
            if s is not GetStatus.HIT:
                continue
            t = (first_block + i) * b
            assert torch.equal(kc[n], k[layer, t : t + b]) and torch.equal(vc[n], v[layer, t : t + b]), (
                f"{what}: {engine.name} block {first_block + i} (cache block {n}) layer {layer}: wrong KV"
            )


PROMPTS = [
    list(range(1, 49)),
    list(range(1, 25)) + list(range(200, 224)),  # shares 24 tokens with the first
    list(range(1, 9)) + list(range(300, 340)),  # shares 8
    list(range(500, 548)),
]


def chaos_backends(rng: random.Random, arena: str | None, *, faults: bool = True) -> list[ChaosBackend]:
    """One small memory store, or (``arena``: a directory) two instances of one arena of few slots
    in one set, where every put may evict what a get wants; each behind a ChaosBackend."""
    if arena is None:
        capacity = rng.choice([3000, 6000, 20000]) if faults else 1 << 24
        return [ChaosBackend(MemoryBackend(MemoryConfig(capacity_bytes=capacity)), rng, faults=faults)]
    slots = rng.choice([4, 8, 16]) if faults else 256
    url = f"arena://{arena}?capacity={slots * 4}KiB&slot=4KiB"
    return [ChaosBackend(ArenaBackend.from_url(url), rng, faults=faults) for _ in range(2)]  # type: ignore[arg-type]


def take_blocks(
    engine: Engine, prompt: Sequence[int], first: int, count: int, rng: random.Random
) -> tuple[int, list[int]] | None:
    """Free cache blocks of ``engine`` for ``count`` blocks of ``prompt`` from block ``first`` (both
    clamped to the prompt's whole blocks), drawn at random: the first block and the ids, or None
    when too few are free."""
    full = len(prompt) // engine.block
    first = min(first, full - 1)
    count = max(1, min(count, full - first))
    if len(engine.free) < count:
        return None
    return first, [engine.free.pop(rng.randrange(len(engine.free))) for _ in range(count)]


#: The pools of a scenario: name, block size, layerwise, staged, (TP rank, TP size).
ENGINES = [
    ("whole4", 4, False, False, (0, 1)),
    ("whole4-staged", 4, False, True, (0, 1)),
    ("layer4", 4, True, False, (0, 1)),
    ("layer4-staged", 4, True, True, (0, 1)),
    ("whole8", 8, False, False, (0, 1)),
    ("whole8-staged", 8, False, True, (0, 1)),
    ("tp2r0", 4, False, True, (0, 2)),
    ("tp2r1", 4, False, False, (1, 2)),
]


def chaos_engines(
    backends: list[ChaosBackend], rng: random.Random, *, layerwise: bool = True
) -> list[Engine]:
    """The pools of :data:`ENGINES` (without the layerwise ones unless ``layerwise``), spread over
    ``backends`` in turn."""
    specs = [spec for spec in ENGINES if layerwise or not spec[2]]
    return [
        make_engine(name, backends[i % len(backends)], rng, block=block, layerwise=lw, staged=staged, tp=tp)
        for i, (name, block, lw, staged, tp) in enumerate(specs)
    ]


Op = tuple[int, int, int, int, int]  # kind (store, retrieve, remove), engine, prompt, first block, count


async def scenario(
    seed: int, ops: list[Op], faults: bool = True, arena: str | None = None
) -> tuple[int, int]:
    """Run ``ops`` in waves; check every load; return the blocks retrieves asked for and hit."""
    rng = random.Random(seed)
    asked = hit = 0
    kv = [token_kv(p) for p in PROMPTS]
    backends = chaos_backends(rng, arena, faults=faults)
    engines = chaos_engines(backends, rng)
    late: list[tuple[Engine, list[int], dict[str, tuple[torch.Tensor, torch.Tensor]]]] = []

    async def one(kind: int, e: int, p: int, first: int, count: int) -> None:
        engine = engines[e]
        prompt = PROMPTS[p]
        k, v = kv[p]
        taken = take_blocks(engine, prompt, first, count, rng)
        if taken is None:
            return
        first, ids = taken
        request = KVRequest(tokens=prompt, block_ids=ids, block_offset=first, request_id="r")
        kind %= 3
        if kind == 0:  # store
            fill(engine, ids, k, v, first)
            if engine.layerwise and rng.random() < 0.5:
                events = LayerEvents.create(LAYERS, CpuEvent)
                async with engine.pool.layerwise_store([request], events) as storer:
                    for layer in range(LAYERS):
                        events.record(layer)
                        await anyio.sleep(0)
                    events.seal()
                    async for _ in storer:
                        pass
            else:
                await engine.pool.store(request)
        elif kind == 1:  # retrieve
            for kc, vc in engine.caches.values():
                kc[ids] = float("nan")
                vc[ids] = float("nan")
            if engine.layerwise and rng.random() < 0.6:
                depth = rng.choice([1, 2, 3])
                async with engine.pool.layerwise_retrieve([request], depth=depth) as loader:
                    async for outcome in loader:
                        for event in outcome.ready:
                            while not event.query():
                                await anyio.sleep(0.0005)
                        if outcome.ok:  # the layer is in place for every block
                            b = engine.block
                            kc, vc = list(engine.caches.values())[outcome.layer]
                            for i, n in enumerate(ids):
                                t = (first + i) * b
                                assert torch.equal(kc[n], k[outcome.layer, t : t + b]), (
                                    f"{engine.name} layer {outcome.layer} said ok, block {first + i} wrong"
                                )
                result = loader.results()[0]
            else:
                result = await engine.pool.retrieve(request)
            check(engine, ids, result.statuses, k, v, first, f"retrieve p{p}")
            nonlocal asked, hit
            asked += len(ids)
            hit += result.statuses.count(GetStatus.HIT)
            snap = {name: (kc[ids].clone(), vc[ids].clone()) for name, (kc, vc) in engine.caches.items()}
            late.append((engine, ids, snap))
            return  # blocks stay taken until the end: a late write would show there
        else:  # remove
            await engine.pool.remove(request)
        engine.free.extend(ids)

    waves = 3
    try:
        await run_waves(waves, ops, one, rng)
    finally:
        for backend in backends:
            await backend.inner.aclose()
    await anyio.sleep(0.02)
    for engine, ids, snap in late:
        for name, (kc, vc) in engine.caches.items():
            same = torch.equal(kc[ids].view(torch.int16), snap[name][0].view(torch.int16)) and torch.equal(
                vc[ids].view(torch.int16), snap[name][1].view(torch.int16)
            )
            assert same, f"{engine.name}: blocks {ids} written after their retrieve returned"
    return asked, hit


async def run_waves(waves: int, ops: list[Op], one: object, rng: random.Random) -> None:
    for wave in range(waves):
        async with anyio.create_task_group() as tg:
            for op in ops[wave::waves]:
                tg.start_soon(one, *op)  # type: ignore[arg-type]
                if rng.random() < 0.5:
                    await anyio.sleep(rng.choice([0, 0.001, 0.003]))


op = st.tuples(
    st.integers(0, 2),
    st.integers(0, 7),
    st.integers(0, len(PROMPTS) - 1),
    st.integers(0, 10),
    st.integers(1, 8),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), ops=st.lists(op, min_size=6, max_size=30))
def test_every_block_reported_loaded_holds_its_prompts_kv(seed: int, ops: list[Op]) -> None:
    anyio.run(scenario, seed, ops)


def test_the_chaos_scenario_loads_blocks_at_all() -> None:
    """The sweep above is only worth something if its retrieves hit: a fixed schedule (no faults)
    of stores, each followed by two loads of the same prompt from other engines."""
    stores = [(0, e, p, 0, 8) for e in range(8) for p in range(2)]
    ops: list[Op] = []
    for _, e, p, _, _ in stores:
        ops += [(0, e, p, 0, 8), (1, (e + 3) % 8, p, 1, 6), (1, (e + 5) % 8, p, 0, 4)]
    asked = hit = 0
    for seed in range(3):
        a, h = anyio.run(scenario, seed, ops, False)
        asked, hit = asked + a, hit + h
    assert hit > asked // 2, (hit, asked)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), ops=st.lists(op, min_size=6, max_size=30))
def test_every_block_reported_loaded_from_a_small_shared_arena_holds_its_prompts_kv(
    seed: int, ops: list[Op]
) -> None:
    with bounded_shm("16m") as path:
        anyio.run(scenario, seed, ops, True, str(path / "store"))
