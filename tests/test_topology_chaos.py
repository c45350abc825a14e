"""Loads of several prompts at once by an engine split otherwise than the one that stored them.

Each scenario draws a writer and a reader (TP 1, 2 or 4; a pipeline split of the 4 layers; a cache
layout; blocks of 4 or 8 tokens; whole-block or layerwise objects; direct or through tiny staging
chunks), a model kind (MLA, or GQA with 2 or 8 KV heads) and three prompts, two of them sharing a
prefix. The writer stores some prompts (``store_many``), the reader's own profile sometimes stores
another from a block offset, some objects are then deleted, and the reader's gets fail at random
(raising, or reporting FAILED after copying). Every rank of the reader then loads all three prompts
in one call (``retrieve_many``, or a layerwise retrieve), each from a random block offset: every
block it reports HIT must hold that prompt's KV, bit for bit. The KV of a token is a function of
the prompt up to it, so every engine writes the same bytes under one key.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Sequence
from unittest import mock

import anyio
import anyio.lowlevel
import attrs
import pytest
import torch

from kvflow import ConfigError, KVLayout, KVPool, KVRequest
from kvflow.backends import ObjectRef
from kvflow.backends.base import GetStatus
from kvflow.backends.memory import MemoryBackend
from kvflow.profiles import is_book_key
from kvflow.transfer import direct
from tests.helpers import FaultyBackend, record_straight_loads, straight_runs
from tests.test_topology import (
    GQA_KINDS,
    HEAD_SIZE,
    LAYERS,
    NOPE,
    ROPE,
    Engine,
    empty_cache,
    read,
    write_block,
)

TOKENS = 32


def prompt_kv(tokens: Sequence[int], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, tokens, heads, width]`` of a prompt (MLA: the latent twice, one head);
    position t depends on ``tokens[: t + 1]`` only."""
    width, count = (NOPE + ROPE, 1) if heads == 0 else (HEAD_SIZE, heads)
    ks, vs = [], []
    for t in range(len(tokens)):
        digest = hashlib.sha256(repr(tuple(tokens[: t + 1])).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:6], "little"))
        ks.append(torch.randn(LAYERS, count, width, generator=gen))
        vs.append(ks[-1] if heads == 0 else torch.randn(LAYERS, count, width, generator=gen))
    return torch.stack(ks, 1), torch.stack(vs, 1)


def rank_heads(heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads a TP rank holds: its slice, or the one head its replica group shares."""
    if heads == 0:
        return 0, 1
    per_rank = max(1, heads // tp)
    group = tp_rank // max(1, tp // heads)
    return group * per_rank, (group + 1) * per_rank


@attrs.define(eq=False)
class FlakyGets(FaultyBackend):
    """A memory backend whose KV gets fail at random with probability ``p``: a whole call raises,
    or an object copied is reported FAILED. The profile book's calls never fail."""

    rng: random.Random = attrs.field(factory=random.Random)
    p: float = 0.0

    @property
    def max_batch(self) -> int:
        return 3  # many calls per load, some failing

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        book = bool(objects) and all(is_book_key(o.key) for o in objects)
        await anyio.sleep(self.rng.random() * 0.002)
        if not book and self.rng.random() < self.p:
            raise ConnectionError("injected get failure")
        got = await self.inner.get(objects)
        if book:
            return got
        return [GetStatus.FAILED if g is GetStatus.HIT and self.rng.random() < self.p else g for g in got]


@attrs.define(eq=False)
class Rank:
    caches: dict[str, object]
    block_ids: dict[int, list[int]]  # prompt -> its blocks, in order
    pool: KVPool


@attrs.define
class Counts:
    hits: int = 0
    misses: int = 0  # MISS or FAILED
    reshaped: int = 0  # scenarios whose reader is split otherwise than its writer
    straight: int = 0  # blocks of another split written straight into the cache, whole


def open_rank(
    heads: int,
    engine: Engine,
    backend: FlakyGets,
    ranks: tuple[int, int],
    kvs: list[tuple[torch.Tensor, torch.Tensor]],
    rng: random.Random,
    *,
    filled: bool,
) -> Rank:
    """A rank (``(tp_rank, pp_rank)``) of ``engine`` with the prompts in random blocks of its cache
    (written when ``filled``; NaN otherwise)."""
    tp_rank, pp_rank = ranks
    first, end = engine.stage(pp_rank)
    per = TOKENS // engine.block_size
    total = per * len(kvs) + 3
    shuffled = rng.sample(range(total), per * len(kvs))
    block_ids = {p: shuffled[p * per : (p + 1) * per] for p in range(len(kvs))}
    lo, hi = rank_heads(heads, engine.tp, tp_rank)
    caches: dict[str, object] = {}
    for layer in range(first, end):
        cache = empty_cache(engine.kind, total, engine.block_size, hi - lo)
        caches[f"model.layers.{layer}.attn"] = cache
        for p, (k, v) in enumerate(kvs if filled else []):
            for i, n in enumerate(block_ids[p]):
                span = slice(i * engine.block_size, (i + 1) * engine.block_size)
                write_block(engine.kind, cache, n, k[layer, span, lo:hi], v[layer, span, lo:hi])
    parallel, config = engine.parallel(tp_rank, pp_rank, heads), engine.config(timeout_s=5)
    layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
    try:
        pool = KVPool.create(config, layout=layout, parallel=parallel, backend=backend)
    except ConfigError:  # staging too small for one object of this split: a larger one
        config = attrs.evolve(config, staging_bytes=256 << 20)
        pool = KVPool.create(config, layout=layout, parallel=parallel, backend=backend)
    return Rank(caches, block_ids, pool)


def draw_engine(rng: random.Random, heads: int) -> Engine:
    kinds = ("mla", "mla_tuple") if heads == 0 else GQA_KINDS
    return Engine(
        rng.choice((1, 2, 4)),
        rng.choice([(4,), (2, 2), (1, 3), (3, 1), (1, 1, 2)]),
        rng.choice(kinds),
        rng.choice((4, 8)),
        rng.random() < 0.5,
        rng.choice(("auto", "always")),
        rng.choice((256 << 20, 4 << 10, 1 << 10)),
    )


def every_rank(engine: Engine) -> list[tuple[int, int]]:
    return [(tp, pp) for tp in range(engine.tp) for pp in range(engine.pp)]


async def scenario(seed: int, counts: Counts, *, straight: bool = False) -> None:
    """One scenario (``straight``: the reader's cache is laid out as the writer's, with blocks of
    as many tokens, no staging, and ranks that need every byte of the objects they read, so that
    those objects fit it as they are and go straight in)."""
    rng = random.Random(seed)
    heads = rng.choice((0, 2, 8))
    base = [rng.randrange(1000) for _ in range(TOKENS)]
    prompts = [
        base,
        base[:12] + [rng.randrange(1000) for _ in range(TOKENS - 12)],
        [rng.randrange(1000) for _ in range(TOKENS)],
    ]
    kvs = [prompt_kv(p, heads) for p in prompts]
    inner = MemoryBackend()
    backend = FlakyGets(inner=inner, rng=rng)
    writer, reader = draw_engine(rng, heads), draw_engine(rng, heads)
    if straight:  # each rank's stage holds each object's layers (or one), its heads each object's
        reader = attrs.evolve(
            reader,
            tp=min(reader.tp, writer.tp),
            pp_layers=reader.pp_layers if writer.layerwise else (LAYERS,),
            kind=writer.kind,
            block_size=writer.block_size,
            staging="auto",
        )
    counts.reshaped += (writer.tp, writer.pp_layers, writer.block_size, writer.layerwise) != (
        reader.tp,
        reader.pp_layers,
        reader.block_size,
        reader.layerwise,
    )
    stored = rng.sample(range(3), rng.choice((1, 2, 3)))
    for ranks in every_rank(writer):
        rank = open_rank(heads, writer, backend, ranks, kvs, rng, filled=True)
        requests = [
            KVRequest(request_id=f"p{p}", tokens=prompts[p], block_ids=rank.block_ids[p]) for p in stored
        ]
        for result in await rank.pool.store_many(requests):
            assert not result.failed_indices
    if rng.random() < 0.5:  # the reader's own profile stores a prompt from a block offset
        own = rng.randrange(3)
        for ranks in every_rank(reader):
            rank = open_rank(heads, reader, backend, ranks, kvs, rng, filled=True)
            offset = rng.randrange(TOKENS // reader.block_size)
            await rank.pool.store(
                KVRequest(tokens=prompts[own], block_ids=rank.block_ids[own][offset:], block_offset=offset)
            )
    kv_keys = [k for k in inner.stored_keys() if not is_book_key(k)]
    await inner.remove(rng.sample(kv_keys, int(len(kv_keys) * rng.choice((0.0, 0.1, 0.3)))))
    backend.p = rng.choice((0.0, 0.05, 0.2))
    for tp_rank, pp_rank in every_rank(reader):
        rank = open_rank(heads, reader, backend, (tp_rank, pp_rank), kvs, rng, filled=False)
        offsets = [rng.randrange(TOKENS // reader.block_size) for _ in prompts]
        requests = [
            KVRequest(
                request_id=f"p{p}",
                tokens=prompts[p],
                block_ids=rank.block_ids[p][offsets[p] :],
                block_offset=offsets[p],
            )
            for p in range(3)
        ]
        if reader.layerwise:
            async with rank.pool.layerwise_retrieve(requests, depth=rng.choice((1, 2, 3))) as loader:
                async for _ in loader:
                    await anyio.lowlevel.checkpoint()
            results = loader.results()
        else:
            results = await rank.pool.retrieve_many(requests)
        lo, hi = rank_heads(heads, reader.tp, tp_rank)
        first, _ = reader.stage(pp_rank)
        for p, result in enumerate(results):
            k_all, v_all = kvs[p]
            for i, (n, status) in enumerate(zip(result.block_ids, result.statuses)):
                if status is not GetStatus.HIT:
                    counts.misses += 1
                    continue
                counts.hits += 1
                span = slice((offsets[p] + i) * reader.block_size, (offsets[p] + i + 1) * reader.block_size)
                for layer, cache in enumerate(rank.caches.values(), first):
                    k, v = read(None, reader.kind, cache, n)  # type: ignore[arg-type]
                    assert torch.equal(k, k_all[layer, span, lo:hi]) and torch.equal(
                        v, v_all[layer, span, lo:hi]
                    ), (
                        f"seed {seed}: writer {writer}, reader {reader}, rank tp{tp_rank} pp{pp_rank}: "
                        f"prompt {p} block {offsets[p] + i} layer {layer} reported HIT with other bytes"
                    )


@pytest.mark.parametrize("chunk", range(6))
def test_a_reader_split_otherwise_reports_hit_only_for_its_prompts_own_kv(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    counts = Counts()
    filled = record_straight_loads(monkeypatch)
    for seed in range(chunk * 25, chunk * 25 + 25):
        # every other scenario's reader is laid out as its writer, and objects that fit its cache
        # as they are go straight in (runs of any length: the tests' tiny heads make short ones)
        straight = seed % 2 == 1
        with mock.patch.object(direct, "min_run_bytes", straight_runs(straight)):
            anyio.run(functools.partial(scenario, seed, counts, straight=straight))
    counts.straight = sum(filled)
    # the sweep reached what it checks: reshaped loads, both ways, hits to check, and misses beside them
    assert counts.reshaped >= 10 and counts.hits >= 100 and counts.misses >= 10, counts
    assert counts.straight >= 5, counts
