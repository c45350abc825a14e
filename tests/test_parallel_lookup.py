"""A scheduler's lookup never promises more than every rank can load, over every parallel shape.

An engine's scheduler looks up with a pool that has no KV caches (``KVPool.create(format=...,
parallel=...)``): it names every object the engine's ranks need itself (every KV-head group,
pipeline stage, DCP and PCP shard) and counts a block only when all of them hold it. If it counted
a block some rank cannot load, that rank would compute on KV it never received. Here every shape
``ParallelConfig`` accepts (MLA and GQA, tp in {1, 2, 4, 8}, every dcp size it allows, pcp and pp
in {1, 2}) gets a store in which each rank stored a prefix of its own choosing, and the scheduler's
answer must be exactly the leading blocks every rank's own retrieve loads.
"""

from __future__ import annotations

import itertools

import anyio
import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import ConfigError, GetStatus, KVLayout, KVPool, KVRequest, ParallelConfig, PoolConfig
from kvflow.backends.memory import MemoryBackend

BLOCK = 4
BLOCKS = 4
TOKENS = list(range(7, 7 + BLOCKS * BLOCK))
LAYERS = 2  # per pipeline stage
HEAD_SIZE = 2


@attrs.frozen
class Shape:
    mla: bool
    heads: int | None  # the model's KV heads (None: MLA)
    tp: int
    dcp: int
    pcp: int
    pp: int

    def parallel(self, tp_rank: int = 0, pcp_rank: int = 0, pp_rank: int = 0) -> ParallelConfig:
        return ParallelConfig(
            tp_rank=tp_rank,
            tp_size=self.tp,
            num_kv_heads=self.heads,
            use_mla=self.mla,
            dcp_size=self.dcp,
            pcp_rank=pcp_rank,
            pcp_size=self.pcp,
            pp_rank=pp_rank,
            pp_size=self.pp,
        )

    def ranks(self) -> list[tuple[int, int, int]]:
        """Every rank of the engine as (tp_rank, pcp_rank, pp_rank)."""
        return list(itertools.product(range(self.tp), range(self.pcp), range(self.pp)))

    def __str__(self) -> str:
        model = "mla" if self.mla else f"gqa{self.heads}"
        return f"{model}-tp{self.tp}-dcp{self.dcp}-pcp{self.pcp}-pp{self.pp}"


def accepted_shapes() -> list[Shape]:
    """Every shape of the grid that ParallelConfig accepts (it refuses the others itself)."""
    shapes = []
    for mla, heads in [(True, None), *[(False, h) for h in (1, 2, 4, 8)]]:
        for tp, dcp, pcp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2), (1, 2)):
            shape = Shape(mla, heads, tp, dcp, pcp, pp)
            try:
                shape.parallel()
            except ConfigError:
                continue
            shapes.append(shape)
    return shapes


SHAPES = accepted_shapes()


def test_the_grid_holds_every_kind_of_shape() -> None:
    """The grid is not accidentally thin: DCP with MLA and with replicated GQA heads, PCP, PP."""
    names = {str(s) for s in SHAPES}
    for expected in (
        "mla-tp4-dcp2-pcp1-pp1",
        "mla-tp8-dcp8-pcp2-pp2",
        "gqa2-tp8-dcp4-pcp1-pp1",
        "gqa8-tp8-dcp1-pcp2-pp2",
    ):
        assert expected in names
    assert "gqa8-tp8-dcp2-pcp1-pp1" not in names  # no replication: DCP refused


def caches(shape: Shape) -> dict[str, object]:
    """One rank's KV caches: MLA's latent, or (k, v) of the heads a rank holds."""
    if shape.mla:
        return {f"l{i}": torch.zeros(BLOCKS, BLOCK, 6) for i in range(LAYERS)}
    assert shape.heads is not None
    heads = max(1, shape.heads // shape.tp)
    return {
        f"l{i}": (torch.zeros(BLOCKS, BLOCK, heads, HEAD_SIZE), torch.zeros(BLOCKS, BLOCK, heads, HEAD_SIZE))
        for i in range(LAYERS)
    }


@attrs.define(eq=False)
class Engine:
    shape: Shape
    backend: MemoryBackend
    pools: dict[tuple[int, int, int], KVPool]
    scheduler: KVPool

    @classmethod
    def open(cls, shape: Shape) -> Engine:
        backend = MemoryBackend()
        config = PoolConfig(model="m", timeout_s=5.0)
        pools = {}
        for tp, pcp, pp in shape.ranks():
            layout = KVLayout.from_kv_caches(caches(shape))  # type: ignore[arg-type]
            pools[tp, pcp, pp] = KVPool.create(
                config, layout=layout, parallel=shape.parallel(tp, pcp, pp), backend=backend
            )
        scheduler = KVPool.create(
            config, format=pools[0, 0, 0].format, parallel=shape.parallel(), backend=backend
        )
        return cls(shape, backend, pools, scheduler)

    async def store(self, rank: tuple[int, int, int], blocks: int) -> None:
        """The rank stores its owned blocks of the prompt's first ``blocks`` blocks."""
        if blocks:
            result = await self.pools[rank].store(
                KVRequest(tokens=TOKENS[: blocks * BLOCK], block_ids=list(range(blocks)))
            )
            assert not result.failed_indices

    async def loadable(self, rank: tuple[int, int, int]) -> int:
        """Leading blocks the rank's own retrieve loads."""
        got = await self.pools[rank].retrieve(KVRequest(tokens=TOKENS, block_ids=list(range(BLOCKS))))
        statuses = list(got.statuses)
        return statuses.index(GetStatus.MISS) if GetStatus.MISS in statuses else BLOCKS


async def check(shape: Shape, stored: list[int]) -> None:
    engine = Engine.open(shape)
    ranks = shape.ranks()
    for rank, blocks in zip(ranks, stored):
        await engine.store(rank, blocks)
    loadable = {rank: await engine.loadable(rank) for rank in ranks}
    looked_up = await engine.scheduler.lookup(KVRequest(tokens=TOKENS))
    assert looked_up % BLOCK == 0
    for rank in ranks:  # never more than any rank loads ...
        assert looked_up <= loadable[rank] * BLOCK, (rank, loadable)
    assert looked_up == min(loadable.values()) * BLOCK, loadable  # ... and no less than all of them
    for rank in ranks:  # every rank's own pool (with caches) answers the same
        assert await engine.pools[rank].lookup(KVRequest(tokens=TOKENS)) == looked_up


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_lookup_only_pool_never_reports_more_than_every_rank_loads(
    shape: Shape, data: st.DataObject
) -> None:
    count = len(shape.ranks())
    # most ranks store everything; some store a shorter prefix (or nothing)
    blocks = st.one_of(st.just(BLOCKS), st.integers(0, BLOCKS))
    stored = data.draw(st.lists(blocks, min_size=count, max_size=count), label="stored")
    anyio.run(check, shape, stored)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.dcp > 1 or s.pcp > 1], ids=str)
def test_shards_that_stored_nothing_make_the_lookup_zero(shape: Shape) -> None:
    """Only the ranks of the first DCP and PCP shard stored: the other shards' ranks load nothing,
    so the scheduler must report nothing."""
    stored = [BLOCKS if shape.parallel(tp).dcp_rank == 0 and pcp == 0 else 0 for tp, pcp, _ in shape.ranks()]

    async def run() -> None:
        engine = Engine.open(shape)
        for rank, blocks in zip(shape.ranks(), stored):
            await engine.store(rank, blocks)
        assert await engine.scheduler.lookup(KVRequest(tokens=TOKENS)) == 0
        first_shard = next(r for r, n in zip(shape.ranks(), stored) if n)
        assert await engine.loadable(first_shard) == BLOCKS  # what the first shard stored is there

    anyio.run(run)


async def test_mla_tp4_dcp2_with_only_the_dcp0_ranks_stored_reports_nothing() -> None:
    """The case that was reported: the scheduler said 64 tokens, rank 1 loaded none."""
    shape = Shape(mla=True, heads=None, tp=4, dcp=2, pcp=1, pp=1)
    engine = Engine.open(shape)
    for tp in (0, 2):  # dcp_rank 0
        await engine.store((tp, 0, 0), BLOCKS)
    assert await engine.loadable((0, 0, 0)) == BLOCKS
    assert await engine.loadable((1, 0, 0)) == 0
    assert await engine.pools[1, 0, 0].lookup(KVRequest(tokens=TOKENS)) == 0
    assert await engine.scheduler.lookup(KVRequest(tokens=TOKENS)) == 0
    for tp in (1, 3):  # now the dcp-1 shard too: every rank loads everything
        await engine.store((tp, 0, 0), BLOCKS)
    assert await engine.scheduler.lookup(KVRequest(tokens=TOKENS)) == BLOCKS * BLOCK
