"""Engines split differently share one store: what a reader loads is the writer's KV, bit for bit.

A model's KV is drawn once (``Model``): K and V per layer, token and KV head, or MLA's latent per
layer and token. A writer engine (any TP size, pipeline split of the layers, layout kind, block
size, whole-block or layerwise objects) fills each rank's cache from it, written here by hand for
each layout (not through kvflow), and stores. A reader engine split some other way looks up (as a
scheduler: no caches) and loads every rank; each rank's cache must then hold exactly the model's
KV of its layers and heads, and the store must hold each piece of KV once.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Sequence
from unittest import mock

import anyio
import anyio.lowlevel
import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVLayout, KVPool, KVRequest, ParallelConfig, PoolConfig, RetrieveResult
from kvflow.backends.base import GetStatus, ObjectBatch, ObjectRef, keys_of
from kvflow.backends.memory import MemoryBackend
from kvflow.keys import decode_key
from kvflow.profiles import is_book_key
from kvflow.transfer import direct, jobs, reshape
from tests.helpers import FencedBackend, kv_keys, kv_puts, record_straight_loads, straight_runs

LAYERS = 4
HEAD_SIZE = 4
TOKENS = 16  # a multiple of every block size below
GQA_KINDS = ("vllm_cpu", "flash_attn", "flash_attn_hnd", "flashinfer_hnd", "kv_tuple")
HEADS = {"mla": 0, "gqa1": 1, "gqa2": 2, "gqa8": 8, "mha16": 16}  # 0: MLA
NOPE, ROPE = 6, 2  # MLA latent widths (the mla kind holds NOPE + ROPE columns in one tensor)


@attrs.frozen
class Engine:
    tp: int
    pp_layers: tuple[int, ...]
    kind: str
    block_size: int
    layerwise: bool
    staging: str = "auto"  # "always": through host staging chunks, as a device cache goes
    staging_bytes: int = 256 << 20  # tiny: one object per chunk, so reshaped loads go in many rounds

    @property
    def pp(self) -> int:
        return len(self.pp_layers)

    def stage(self, pp_rank: int) -> tuple[int, int]:
        first = sum(self.pp_layers[:pp_rank])
        return first, first + self.pp_layers[pp_rank]

    def parallel(self, tp_rank: int, pp_rank: int, heads: int) -> ParallelConfig:
        """The layout of one rank, for a model of ``heads`` KV heads (0: MLA)."""
        return ParallelConfig(
            tp_rank=tp_rank,
            tp_size=self.tp,
            num_kv_heads=heads or None,
            use_mla=heads == 0,
            pp_rank=pp_rank,
            pp_size=self.pp,
            pp_layers=self.pp_layers,
        )

    def config(self, **more: object) -> PoolConfig:
        """Its pools' configuration: every engine hashes prompts by 4 tokens, so they name blocks
        alike whatever their block size."""
        return PoolConfig(
            model="m",
            layerwise=self.layerwise,
            hash_tokens=4,
            staging=self.staging,
            staging_bytes=self.staging_bytes,
            **more,  # type: ignore[arg-type]
        )


@attrs.frozen(eq=False)
class Model:
    heads: int  # 0: MLA
    k: torch.Tensor  # [layers, tokens, heads, head_size] (MLA: the latent [layers, tokens, 1, width])
    v: torch.Tensor

    @classmethod
    def draw(cls, heads: int, seed: int) -> Model:
        gen = torch.Generator().manual_seed(seed)
        if heads == 0:
            latent = torch.randn(LAYERS, TOKENS, 1, NOPE + ROPE, generator=gen)
            return cls(0, latent, latent)
        return cls(
            heads,
            torch.randn(LAYERS, TOKENS, heads, HEAD_SIZE, generator=gen),
            torch.randn(LAYERS, TOKENS, heads, HEAD_SIZE, generator=gen),
        )

    def rank_heads(self, tp: int, tp_rank: int) -> tuple[int, int]:
        """The KV heads a TP rank holds: its slice, or the one head its replica group shares."""
        if self.heads == 0:
            return 0, 1
        per_rank = max(1, self.heads // tp)
        group = tp_rank // max(1, tp // self.heads)
        return group * per_rank, (group + 1) * per_rank


def empty_cache(kind: str, blocks: int, block: int, heads: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One layer's cache of ``kind``, filled with NaN (so an unwritten element can never match)."""
    d = HEAD_SIZE

    def nan(*shape: int) -> torch.Tensor:
        return torch.full(shape, float("nan"))

    if kind == "vllm_cpu":
        return nan(blocks, heads, block, 2 * d)
    if kind == "flash_attn":
        return nan(2, blocks, block, heads, d)
    if kind == "flash_attn_hnd":  # HND in memory, NHD shape
        return nan(2, blocks, heads, block, d).permute(0, 1, 3, 2, 4)
    if kind == "flashinfer_hnd":
        return nan(blocks, 2, heads, block, d).permute(0, 1, 3, 2, 4)
    if kind == "kv_tuple":
        return nan(blocks, block, heads, d), nan(blocks, block, heads, d)
    if kind == "mla":
        return nan(blocks, block, NOPE + ROPE)
    return nan(blocks, block, 1, NOPE), nan(blocks, block, 1, ROPE)  # mla_tuple


def block_kv(
    kind: str, cache: torch.Tensor | tuple[torch.Tensor, ...], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of cache block ``n`` as ``[tokens, heads, columns]`` views (MLA: the latent twice)."""
    d = HEAD_SIZE
    if kind == "vllm_cpu":
        assert isinstance(cache, torch.Tensor)
        return cache[n, :, :, :d].transpose(0, 1), cache[n, :, :, d:].transpose(0, 1)
    if kind in ("flash_attn", "flash_attn_hnd"):
        assert isinstance(cache, torch.Tensor)
        return cache[0, n], cache[1, n]
    if kind == "flashinfer_hnd":
        assert isinstance(cache, torch.Tensor)
        return cache[n, 0], cache[n, 1]
    if kind == "kv_tuple":
        return cache[0][n], cache[1][n]
    if kind == "mla":
        assert isinstance(cache, torch.Tensor)
        latent = cache[n].unsqueeze(1)
        return latent, latent
    raise AssertionError("mla_tuple is read with mla_latent")


def mla_tuple_latent(cache: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
    return torch.cat([cache[0][n], cache[1][n]], dim=-1)  # [tokens, 1, NOPE + ROPE]


def fill(
    model: Model, kind: str, cache: object, n: int, layer: int, tokens: int, heads: tuple[int, int]
) -> None:
    size = _block_size(kind, cache)
    k = model.k[layer, tokens : tokens + size, heads[0] : heads[1]]
    v = model.v[layer, tokens : tokens + size, heads[0] : heads[1]]
    write_block(kind, cache, n, k, v)


def write_block(kind: str, cache: object, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k`` and ``v`` (``[tokens, heads, columns]``; MLA: the latent, twice) into cache
    block ``n``."""
    if kind == "mla_tuple":
        nope, rope = cache  # type: ignore[misc]
        nope[n].copy_(k[..., :NOPE])
        rope[n].copy_(k[..., NOPE:])
        return
    dst_k, dst_v = block_kv(kind, cache, n)  # type: ignore[arg-type]
    dst_k.copy_(k)
    dst_v.copy_(v)


def read(model: Model, kind: str, cache: object, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "mla_tuple":
        latent = mla_tuple_latent(cache, n)  # type: ignore[arg-type]
        return latent, latent
    k, v = block_kv(kind, cache, n)  # type: ignore[arg-type]
    return k.clone(), v.clone()


def _block_size(kind: str, cache: object) -> int:
    first = cache[0] if isinstance(cache, tuple) else cache
    assert isinstance(first, torch.Tensor)
    return (
        first.shape[2]
        if kind in ("vllm_cpu", "flash_attn", "flash_attn_hnd", "flashinfer_hnd")
        else first.shape[1]
    )


@attrs.define(eq=False)
class Rank:
    engine: Engine
    tp_rank: int
    pp_rank: int
    caches: dict[str, object]
    block_ids: list[int]
    pool: KVPool


def open_rank(
    model: Model,
    engine: Engine,
    backend: MemoryBackend,
    tp_rank: int,
    pp_rank: int,
    *,
    filled: bool,
    seed: int,
    in_order: bool = False,
) -> Rank:
    first, end = engine.stage(pp_rank)
    blocks = TOKENS // engine.block_size
    heads = model.rank_heads(engine.tp, tp_rank)
    ids = list(range(3, blocks + 3)) if in_order else random.Random(seed).sample(range(blocks + 3), blocks)
    caches: dict[str, object] = {}
    for layer in range(first, end):
        caches[f"model.layers.{layer}.attn"] = empty_cache(
            engine.kind, blocks + 3, engine.block_size, heads[1] - heads[0]
        )
        if filled:
            for i, n in enumerate(ids):
                fill(
                    model,
                    engine.kind,
                    caches[f"model.layers.{layer}.attn"],
                    n,
                    layer,
                    i * engine.block_size,
                    heads,
                )
    parallel, config = engine.parallel(tp_rank, pp_rank, model.heads), engine.config()
    layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
    return Rank(
        engine,
        tp_rank,
        pp_rank,
        caches,
        ids,
        KVPool.create(config, layout=layout, parallel=parallel, backend=backend),
    )


def ranks(
    model: Model, engine: Engine, backend: MemoryBackend, *, filled: bool, seed: int, in_order: bool = False
) -> list[Rank]:
    """Every rank of ``engine``, its request's blocks at random in its cache (``in_order``: in
    consecutive cache blocks, as vLLM mostly hands them out)."""
    return [
        open_rank(
            model, engine, backend, tp, pp, filled=filled, seed=seed + 31 * tp + 7 * pp, in_order=in_order
        )
        for tp in range(engine.tp)
        for pp in range(engine.pp)
    ]


def request(rank: Rank) -> KVRequest:
    return KVRequest(tokens=list(range(TOKENS)), block_ids=rank.block_ids)


def expected_objects(model: Model, engine: Engine) -> int:
    """Objects a whole engine stores: one per block, per KV-head slice, per layer range."""
    head_groups = 1 if model.heads == 0 else min(model.heads, engine.tp)
    ranges = LAYERS if engine.layerwise else engine.pp
    return (TOKENS // engine.block_size) * head_groups * ranges


async def share(model: Model, writer: Engine, reader: Engine, seed: int, *, in_order: bool = False) -> None:
    """The writer engine stores a prompt, the reader loads it (``in_order``: into consecutive
    cache blocks) and holds exactly the writer's KV for its heads and layers."""
    backend = FencedBackend()  # every region moved must lie in memory a pool registered
    for rank in ranks(model, writer, backend, filled=True, seed=seed):
        result = await rank.pool.store(request(rank))
        assert not result.failed_indices
    keys = kv_keys(backend)
    assert len(keys) == expected_objects(model, writer) == kv_puts(backend)  # each piece once
    assert {decode_key(k).scope.order.split(".")[0] for k in keys} == {_kind_name(writer.kind)}

    readers = ranks(model, reader, backend, filled=False, seed=seed + 1, in_order=in_order)
    scheduler = KVPool.create(
        PoolConfig(model="m", layerwise=reader.layerwise, hash_tokens=4),
        format=readers[0].pool.format,
        parallel=attrs.evolve(readers[0].pool.parallel, tp_rank=0, pp_rank=0),
        backend=backend,
    )
    assert await scheduler.lookup(KVRequest(tokens=list(range(TOKENS)))) == TOKENS
    for rank in readers:
        got = await load(rank)
        assert got.failed_block_ids == (), (rank.tp_rank, rank.pp_rank)
        heads = model.rank_heads(reader.tp, rank.tp_rank)
        first, _ = reader.stage(rank.pp_rank)
        for offset, cache in enumerate(rank.caches.values()):
            layer = first + offset
            for i, n in enumerate(rank.block_ids):
                tokens = slice(i * reader.block_size, (i + 1) * reader.block_size)
                k, v = read(model, reader.kind, cache, n)
                assert torch.equal(k, model.k[layer, tokens, heads[0] : heads[1]]), (layer, i)
                assert torch.equal(v, model.v[layer, tokens, heads[0] : heads[1]]), (layer, i)
    assert kv_puts(backend) == expected_objects(model, writer)  # loading stored nothing
    assert backend.strays == []


async def load(rank: Rank) -> RetrieveResult:
    """Load the rank's blocks as its engine would: layer by layer, two layers in flight, where its
    pool is layerwise (several layers then look in the writer's objects at once)."""
    if not rank.engine.layerwise:
        return await rank.pool.retrieve(request(rank))
    async with rank.pool.layerwise_retrieve([request(rank)], depth=2) as loader:
        async for _ in loader:
            await anyio.lowlevel.checkpoint()
    return loader.results()[0]


def _kind_name(kind: str) -> str:
    return {"flash_attn_hnd": "flash_attn", "flashinfer_hnd": "flashinfer"}.get(kind, kind)


def splits(layers: int) -> list[tuple[int, ...]]:
    """Every pipeline split of ``layers`` layers into up to 4 stages."""
    out = []
    for cuts in itertools.product([False, True], repeat=layers - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        sizes.append(run)
        if len(sizes) <= 4:
            out.append(tuple(sizes))
    return out


def engines(model_heads: int, tp: int) -> st.SearchStrategy[Engine]:
    kinds = ("mla", "mla_tuple") if model_heads == 0 else GQA_KINDS
    return st.builds(
        Engine,
        tp=st.just(tp),
        pp_layers=st.sampled_from(splits(LAYERS)),
        kind=st.sampled_from(kinds),
        block_size=st.sampled_from((4, 8)),
        layerwise=st.booleans(),
    )


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize(("writer_tp", "reader_tp"), list(itertools.product((1, 2, 4, 8), repeat=2)))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_a_reader_split_any_way_loads_exactly_the_writers_kv(
    heads: str, writer_tp: int, reader_tp: int, data: st.DataObject, seed: int
) -> None:
    model_heads = HEADS[heads]
    writer = data.draw(engines(model_heads, writer_tp), label="writer")
    reader = data.draw(engines(model_heads, reader_tp), label="reader")
    if model_heads == 0 and (writer.kind == "mla_tuple") != (reader.kind == "mla_tuple"):
        reader = attrs.evolve(reader, kind=writer.kind)  # MLA as one latent or as (nope, rope): not mixed
    # objects that fit the cache as they are go straight in (runs of any length), or all through chunks
    straight = data.draw(st.booleans(), label="straight into the cache")
    with mock.patch.object(direct, "min_run_bytes", straight_runs(straight)):
        anyio.run(share, Model.draw(model_heads, seed), writer, reader, seed)


@pytest.mark.parametrize("writer_split", splits(LAYERS))
@pytest.mark.parametrize("reader_split", splits(LAYERS))
def test_every_pipeline_split_reads_every_other(
    writer_split: tuple[int, ...], reader_split: tuple[int, ...]
) -> None:
    model = Model.draw(8, 5)
    writer = Engine(2, writer_split, "flash_attn", 8, False)
    reader = Engine(4, reader_split, "vllm_cpu", 8, False)
    anyio.run(share, model, writer, reader, 11)


@pytest.mark.parametrize(
    ("writer_kind", "reader_kind"),
    [*itertools.product(GQA_KINDS, repeat=2), ("mla", "mla"), ("mla_tuple", "mla_tuple")],
)
def test_every_layout_kind_reads_every_other(writer_kind: str, reader_kind: str) -> None:
    """Deterministic: each pair of layout kinds, across TP sizes and block sizes (and the fast test
    the mutation run selects for the copy code; the sweep above draws shapes at random)."""
    mla = writer_kind.startswith("mla")
    model = Model.draw(0 if mla else 8, 3)
    writer = Engine(2, (2, 2), writer_kind, 4, False)
    reader = Engine(4, (4,), reader_kind, 8, False)
    anyio.run(share, model, writer, reader, 7)


@pytest.mark.parametrize("path", ["stretches", "index"])
@pytest.mark.parametrize("in_order", [True, False], ids=["blocks in order", "blocks at random"])
@pytest.mark.parametrize(
    ("writer_kind", "reader_kind"), [("vllm_cpu", "vllm_cpu"), ("vllm_cpu", "flash_attn"), ("mla", "mla")]
)
def test_a_reshaped_load_lands_the_same_kv_by_stretches_and_by_index(
    monkeypatch: pytest.MonkeyPatch, path: str, in_order: bool, writer_kind: str, reader_kind: str
) -> None:
    """Both ways ``reshape.copy_rows`` copies a chunk's blocks into the cache, each forced for every
    chunk: a slice per stretch of consecutive blocks (vLLM's usual order, which takes it unforced)
    and ``index_copy_``, with the blocks in consecutive cache blocks and at random."""
    seen: list[tuple[int, int]] = []  # (blocks, stretches) of each chunk copied
    stretches = reshape._stretches

    def recorded(rows: list[int], block_ids: list[int]) -> list[tuple[int, int, int]]:
        out = stretches(rows, block_ids)
        seen.append((len(rows), len(out)))
        return out

    monkeypatch.setattr(reshape, "_stretches", recorded)
    monkeypatch.setattr(reshape, "_FEW_STRETCHES", 0 if path == "stretches" else 10**9)
    monkeypatch.setattr(direct, "min_run_bytes", straight_runs(False))  # every block through a chunk
    mla = writer_kind == "mla"
    model = Model.draw(0 if mla else 8, 5)
    writer = Engine(2, (2, 2), writer_kind, 4, False)  # another TP size and pipeline split
    reader = Engine(1, (LAYERS,), reader_kind, 4, False)  # the same block size: copy_rows's case
    anyio.run(functools.partial(share, model, writer, reader, 3, in_order=in_order))
    assert seen, "the load copied no chunk from the writer's objects"
    if in_order:  # every chunk in few stretches: what the rule copies by stretches unforced
        assert all(count >= 2 and n * 4 <= count for count, n in seen), seen


@pytest.mark.parametrize(
    ("heads", "writer", "reader"),
    [
        ("gqa8", Engine(2, (2, 2), "vllm_cpu", 4, False), Engine(1, (LAYERS,), "vllm_cpu", 4, False)),
        ("gqa8", Engine(4, (1, 3), "flashinfer_hnd", 8, False), Engine(2, (4,), "flashinfer_hnd", 8, False)),
        ("gqa8", Engine(2, (1, 3), "flash_attn", 4, True), Engine(1, (2, 2), "flash_attn", 4, False)),
        ("gqa8", Engine(8, (4,), "kv_tuple", 4, True), Engine(2, (1, 3), "kv_tuple", 4, True)),
        ("gqa2", Engine(2, (2, 2), "flash_attn_hnd", 8, False), Engine(4, (4,), "flash_attn_hnd", 8, False)),
        ("mla", Engine(2, (1, 3), "mla", 4, False), Engine(4, (4,), "mla", 4, False)),
        ("mla", Engine(1, (2, 2), "mla_tuple", 8, True), Engine(2, (4,), "mla_tuple", 8, False)),
        # another layout kind: a run per head and token, or per token
        ("gqa8", Engine(2, (2, 2), "vllm_cpu", 4, False), Engine(1, (LAYERS,), "flash_attn", 4, False)),
        (
            "gqa8",
            Engine(1, (LAYERS,), "flash_attn", 8, False),
            Engine(1, (LAYERS,), "flashinfer_hnd", 8, False),
        ),
        ("gqa2", Engine(2, (1, 3), "kv_tuple", 4, True), Engine(1, (LAYERS,), "vllm_cpu", 4, False)),
    ],
)
@pytest.mark.parametrize("in_order", [True, False], ids=["blocks in order", "blocks at random"])
def test_objects_that_fit_a_host_cache_as_they_are_go_straight_in(
    monkeypatch: pytest.MonkeyPatch, heads: str, writer: Engine, reader: Engine, in_order: bool
) -> None:
    """Objects whose every byte the reader needs, whichever layout holds them, are written straight
    into the cache blocks (``kvflow.transfer.direct``): forced here for runs of any length (the
    tests' tiny heads make short runs, which otherwise go through a chunk), and each rank's cache
    must hold the writer's KV exactly."""
    straight = record_straight_loads(monkeypatch)
    monkeypatch.setattr(direct, "min_run_bytes", straight_runs(True))
    chunks: list[int] = []
    monkeypatch.setattr(jobs, "copy_rows", lambda *a, **k: chunks.append(1))  # (no chunk may be copied)
    anyio.run(functools.partial(share, Model.draw(HEADS[heads], 9), writer, reader, 5, in_order=in_order))
    assert straight and sum(straight) > 0, "no block went straight into the cache"
    assert chunks == []


def test_objects_of_uneven_pipeline_stages_go_straight_in_as_a_batch_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An uneven pipeline split's stages hold objects of different shapes (1 and 3 layers): each
    shape's objects reach the backend as one batch by column (``ObjectBatch``), never as a list of
    objects, whose regions (one per head and token, in another layout kind) cost Python each."""
    straight = record_straight_loads(monkeypatch)
    monkeypatch.setattr(direct, "min_run_bytes", straight_runs(True))
    sent: list[type] = []
    get = FencedBackend.get

    async def recorded(self: FencedBackend, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if not any(is_book_key(key) for key in keys_of(objects)):  # (the profile book's reads aside)
            sent.append(type(objects))
        return await get(self, objects)

    monkeypatch.setattr(FencedBackend, "get", recorded)
    writer, reader = Engine(1, (1, 3), "vllm_cpu", 4, False), Engine(1, (LAYERS,), "flash_attn", 4, False)
    anyio.run(share, Model.draw(HEADS["gqa8"], 9), writer, reader, 5)
    assert sum(straight) > 0, "no block went straight into the cache"
    assert sent and set(sent) == {ObjectBatch}, sent


@attrs.define(eq=False)
class OneGetFails(FencedBackend):
    """Gets one object per call, and fails the call for an object of ``part`` (a key's text: the
    writer's heads, say) that lands at ``at`` (once)."""

    at: int = -1
    part: str = "@h0-4@"
    failed: bool = False

    @property
    def max_batch(self) -> int:
        return 1

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if not self.failed and any(obj.addrs[0] == self.at and self.part in obj.key for obj in objects):
            self.failed = True
            raise ConnectionError("injected: this object's get fails")
        return await super().get(objects)


@pytest.mark.parametrize("first", [True, False], ids=["the first copy fails", "the second copy fails"])
def test_one_prompt_loaded_twice_straight_in_counts_each_copy_of_an_object_for_its_own_block(
    monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """Two requests of a call may load one prompt into different blocks: another split's objects
    then come twice under one key, each into its own block. A get failing for one of them fails
    that block only, never the other, and never reports a block whose get failed."""
    monkeypatch.setattr(direct, "min_run_bytes", straight_runs(True))
    model = Model.draw(HEADS["gqa8"], 9)
    writer, reader = Engine(2, (LAYERS,), "vllm_cpu", 4, False), Engine(1, (LAYERS,), "vllm_cpu", 4, False)
    backend = OneGetFails()

    async def run() -> None:
        for rank in ranks(model, writer, backend, filled=True, seed=1):
            assert not (await rank.pool.store(request(rank))).failed_indices
        blocks = TOKENS // reader.block_size
        caches = {
            f"model.layers.{layer}.attn": empty_cache(reader.kind, 2 * blocks, reader.block_size, 8)
            for layer in range(LAYERS)
        }
        layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
        pool = KVPool.create(
            reader.config(), layout=layout, parallel=reader.parallel(0, 0, 8), backend=backend
        )
        copies = [list(range(blocks)), list(range(blocks, 2 * blocks))]
        broken = copies[0 if first else 1][2]  # its first writer rank's object (heads 0-3) fails
        backend.at = int(layout.addr_rows([broken])[0][0])
        requests = [
            KVRequest(tokens=list(range(TOKENS)), block_ids=ids, request_id=f"r{i}")
            for i, ids in enumerate(copies)
        ]
        results = await pool.retrieve_many(requests)
        assert backend.failed
        failed = {n for result in results for n in result.failed_block_ids}
        assert broken in failed  # (blocks after it in its request fail too: a prefix is loaded)
        other = copies[1 if first else 0]
        assert not failed & set(other), "a block whose own get hit was reported failed"
        for ids in copies:
            for i, n in enumerate(ids):
                if n in failed:
                    continue
                for layer, cache in enumerate(caches.values()):
                    k, v = read(model, reader.kind, cache, n)
                    tokens = slice(i * reader.block_size, (i + 1) * reader.block_size)
                    assert torch.equal(k, model.k[layer, tokens]) and torch.equal(
                        v, model.v[layer, tokens]
                    ), n

    anyio.run(run)


TINY = 64  # bytes of staging: every chunk is sized to one object, the least that works


@pytest.mark.parametrize(
    ("heads", "writer", "reader"),
    [
        (
            "gqa8",
            Engine(1, (4,), "flash_attn", 4, False),
            Engine(4, (2, 2), "vllm_cpu", 8, False, "auto", TINY),
        ),
        (
            "gqa2",
            Engine(4, (4,), "kv_tuple", 8, True),
            Engine(1, (1, 3), "flashinfer_hnd", 4, False, "auto", TINY),
        ),
        (
            "mha16",
            Engine(8, (2, 2), "vllm_cpu", 4, False),
            Engine(2, (4,), "flash_attn_hnd", 8, True, "always", 16 << 10),
        ),
        (
            "gqa8",
            Engine(2, (4,), "flash_attn", 8, False),
            Engine(8, (4,), "kv_tuple", 4, False, "always", 16 << 10),
        ),
        ("mla", Engine(2, (1, 1, 2), "mla", 4, True), Engine(8, (4,), "mla", 8, False, "auto", TINY)),
        # chunks of two blocks of eight objects each (equal block sizes: rows of objects per chunk)
        (
            "gqa8",
            Engine(4, (2, 2), "flash_attn", 4, False),
            Engine(1, (4,), "vllm_cpu", 4, False, "auto", 10 << 10),
        ),
        # a chunk of exactly one block's eight objects: one row per round
        (
            "gqa8",
            Engine(4, (2, 2), "flash_attn", 4, False),
            Engine(1, (4,), "vllm_cpu", 4, False, "auto", 4 << 10),
        ),
        # smaller blocks than the writer's: two blocks share objects, placed in a chunk once
        (
            "gqa2",
            Engine(2, (4,), "kv_tuple", 8, False),
            Engine(1, (4,), "flash_attn", 4, False, "auto", 3 << 10),
        ),
        (
            "mla",
            Engine(1, (4,), "mla_tuple", 8, False),
            Engine(2, (2, 2), "mla_tuple", 4, True, "always", 16 << 10),
        ),
    ],
)
def test_a_reader_with_one_small_staging_chunk_loads_the_writers_kv_round_by_round(
    heads: str, writer: Engine, reader: Engine
) -> None:
    """Deterministic, and the fast tests the mutation run selects for the transform path: TP sizes
    up and down, pipeline splits, layerwise on either side, staged or not; the reader's staging
    holds one object at a time, so every load of another profile's objects takes many rounds."""
    anyio.run(share, Model.draw(HEADS[heads], 13), writer, reader, 17)


# -- a reader of another block size packs several blocks' objects into one chunk ----------------
# Writer blocks of 12 tokens, reader blocks of 8 (hash_tokens 4): reader block 1 needs writer
# objects 0 and 1, block 2 object 1, block 4 objects 2 and 3, ... With a chunk of three writer
# objects the second chunk starts at reader block 4, which needs object 2 (placed in the first
# chunk) and object 3: the packing must count both again, or it places four objects' addresses
# in a chunk of three and the backend writes past the chunk's end.

STRADDLE_LAYERS, STRADDLE_HEADS, STRADDLE_D = 2, 2, 4
STRADDLE_TOKENS = 96  # 8 writer blocks of 12, 12 reader blocks of 8


def straddle_model() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (
        torch.randn(STRADDLE_LAYERS, STRADDLE_TOKENS, STRADDLE_HEADS, STRADDLE_D, generator=gen),
        torch.randn(STRADDLE_LAYERS, STRADDLE_TOKENS, STRADDLE_HEADS, STRADDLE_D, generator=gen),
    )


def straddle_caches(block: int, blocks: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        f"model.layers.{layer}.attn": (
            torch.full((blocks, block, STRADDLE_HEADS, STRADDLE_D), float("nan")),
            torch.full((blocks, block, STRADDLE_HEADS, STRADDLE_D), float("nan")),
        )
        for layer in range(STRADDLE_LAYERS)
    }


def straddle_config(**kw: object) -> PoolConfig:
    return PoolConfig(model="m", hash_tokens=4, **kw)  # type: ignore[arg-type]


async def test_a_reshaped_load_of_straddling_blocks_never_addresses_past_its_chunk() -> None:
    k, v = straddle_model()
    backend = FencedBackend()
    wblock, rblock = 12, 8
    n_w, n_r = STRADDLE_TOKENS // wblock, STRADDLE_TOKENS // rblock
    src = straddle_caches(wblock, n_w)
    for layer, (kc, vc) in enumerate(src.values()):
        for i in range(n_w):
            kc[i].copy_(k[layer, i * wblock : (i + 1) * wblock])
            vc[i].copy_(v[layer, i * wblock : (i + 1) * wblock])
    writer = KVPool.create(straddle_config(), layout=KVLayout.from_kv_caches(src), backend=backend)
    stored = await writer.store(KVRequest(tokens=list(range(STRADDLE_TOKENS)), block_ids=list(range(n_w))))
    assert stored.ok
    object_bytes = (
        2 * STRADDLE_LAYERS * wblock * STRADDLE_HEADS * STRADDLE_D * 4
    )  # one writer object: every layer's K and V

    dst = straddle_caches(rblock, n_r)
    reader = KVPool.create(
        straddle_config(staging_bytes=3 * object_bytes),  # the scratch chunk: three writer objects
        layout=KVLayout.from_kv_caches(dst),
        backend=backend,
        parallel=ParallelConfig(),
    )
    got = await reader.retrieve(KVRequest(tokens=list(range(STRADDLE_TOKENS)), block_ids=list(range(n_r))))
    assert backend.strays == [], f"{len(backend.strays)} regions outside the registered chunk"
    assert got.failed_block_ids == ()
    for layer, (kc, vc) in enumerate(dst.values()):
        for i in range(n_r):
            assert torch.equal(kc[i], k[layer, i * rblock : (i + 1) * rblock])
            assert torch.equal(vc[i], v[layer, i * rblock : (i + 1) * rblock])


# -- caches the sweeps above do not draw ------------------------------------------------------------


async def _tp1_to_tp2_rank1(
    src: object, dst: object, dst_heads: int = 1, **parallel: object
) -> RetrieveResult:
    """``src`` (one layer) stored by a TP=1 engine, loaded into ``dst`` by rank 1 of TP=2."""
    backend = MemoryBackend()
    tokens = list(range(TOKENS))
    config = PoolConfig(model="m", hash_tokens=4)
    writer = KVPool.create(config, layout=KVLayout.from_kv_caches({"l0": src}), backend=backend)  # type: ignore[dict-item]
    assert (await writer.store(KVRequest(tokens=tokens, block_ids=[1, 0]))).stored == 2
    reader = KVPool.create(
        config,
        layout=KVLayout.from_kv_caches({"l0": dst}),  # type: ignore[dict-item]
        backend=backend,
        parallel=ParallelConfig(tp_rank=1, tp_size=2, **parallel),  # type: ignore[arg-type]
    )
    return await reader.retrieve(KVRequest(tokens=tokens, block_ids=list(range(TOKENS // dst_block(dst)))))


def dst_block(cache: object) -> int:
    return cache[0].size(1) if isinstance(cache, tuple) else cache.size(2)  # type: ignore[no-any-return, attr-defined]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
async def test_an_fp8_cache_loads_from_another_tp_size_bit_for_bit(dtype: torch.dtype) -> None:
    """torch has no ``index_copy_`` for fp8: the copy moves the bits as integers."""
    src = torch.randn(2, 3, 8, 2, HEAD_SIZE).to(dtype)  # flash_attn: K|V, blocks, tokens, 2 heads, D
    dst = torch.zeros(2, 3, 8, 1, HEAD_SIZE).to(dtype)
    got = await _tp1_to_tp2_rank1(src, dst, num_kv_heads=2)
    assert got.hit_blocks == 2
    for block, stored in ((0, 1), (1, 0)):
        assert torch.equal(dst[:, block, :, 0].view(torch.uint8), src[:, stored, :, 1].view(torch.uint8))


async def test_an_mla_cache_of_three_dimensional_parts_loads_into_four_dimensional_ones() -> None:
    """A (nope, rope) cache of ``[N, B, D]`` parts stored in blocks of 8, read as ``[N, B, 1, D]``
    parts in blocks of 4 (another block size: the copy goes through the parts' views)."""
    nope, rope = torch.randn(2, 8, NOPE), torch.randn(2, 8, ROPE)
    into = torch.full((4, 4, 1, NOPE), float("nan")), torch.full((4, 4, 1, ROPE), float("nan"))
    got = await _tp1_to_tp2_rank1((nope, rope), into, use_mla=True)
    assert got.hit_blocks == 4
    for block in range(4):
        stored, half = (1, 0)[block // 2], block % 2
        assert torch.equal(into[0][block, :, 0], nope[stored, 4 * half : 4 * half + 4])
        assert torch.equal(into[1][block, :, 0], rope[stored, 4 * half : 4 * half + 4])
