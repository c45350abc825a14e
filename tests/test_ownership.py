from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import ConfigError
from kvflow.ownership import ParallelConfig, owned, owner


@st.composite
def parallel_groups(draw: st.DrawFn) -> list[ParallelConfig]:
    """Every rank's ParallelConfig of one valid layout (MLA, GQA replicated, GQA split, DCP)."""
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    use_mla = draw(st.booleans())
    if use_mla:
        heads = 1
        dcp = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
    else:
        heads = draw(st.sampled_from([h for h in (1, 2, 4, 8, 16, 32) if h % tp == 0 or tp % h == 0]))
        rep = max(1, tp // heads)
        dcp = draw(st.sampled_from([d for d in (1, 2, 4) if rep % d == 0 and (heads < tp or d == 1)]))
    return [ParallelConfig(r, tp, heads, use_mla, dcp_size=dcp) for r in range(tp)]


def identical_kv(a: ParallelConfig, b: ParallelConfig) -> bool:
    """Ground truth: which ranks hold byte-identical KV, from first principles."""
    if a.dcp_rank != b.dcp_rank:
        return False
    if a.use_mla:
        return True
    return first_head(a) == first_head(b)


def first_head(p: ParallelConfig) -> int:
    """The first KV head a rank holds (heads replicate when there are fewer than ranks)."""
    if p.num_kv_heads < p.tp_size:
        return (p.tp_rank * p.num_kv_heads) // p.tp_size
    return p.tp_rank * (p.num_kv_heads // p.tp_size)


@given(parallel_groups(), st.integers(0, 10_000))
def test_each_block_has_exactly_one_owner_per_replica_group(ranks: list[ParallelConfig], start: int) -> None:
    for p in ranks:
        group = [q.tp_rank for q in ranks if identical_kv(p, q)]
        assert list(p.replica_group()) == group
        assert p.replica_group_size == len(group)
        for i in range(start, start + 2 * p.replica_group_size):
            who = owner(i, p)
            assert who in group
            # every member computes the same owner from its own config
            assert all(owner(i, ranks[g]) == who for g in group)
        window = [owner(i, p) for i in range(start, start + p.replica_group_size)]
        assert sorted(window) == group


@given(parallel_groups(), st.lists(st.integers(0, 10_000), max_size=40))
def test_owned_is_owner_for_a_whole_request(ranks: list[ParallelConfig], indices: list[int]) -> None:
    for p in ranks:
        assert owned(indices, p) == [j for j, i in enumerate(indices) if owner(i, p) == p.tp_rank]


@given(parallel_groups())
def test_head_namespaces_match_replica_groups(ranks: list[ParallelConfig]) -> None:
    for p in ranks:
        for q in ranks:
            same_ns = (p.kv_head_group, p.dcp_rank) == (q.kv_head_group, q.dcp_rank)
            assert same_ns == identical_kv(p, q)
    assert {p.kv_head_group for p in ranks} == set(range(ranks[0].num_kv_head_groups))


def test_documented_tables() -> None:
    mla = [ParallelConfig(r, 4, 1, True) for r in range(4)]
    assert [owner(i, mla[0]) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    gqa = [ParallelConfig(r, 16, 8, False) for r in range(16)]
    assert gqa[5].replica_group() == (4, 5)
    assert [owner(i, gqa[5]) for i in range(4)] == [4, 5, 4, 5]
    assert gqa[5].kv_head_group == 2
    mha = ParallelConfig(3, 4, 32, False)
    assert [owner(i, mha) for i in range(3)] == [3, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_rank": 4, "tp_size": 4, "use_mla": True}, r"tp_rank must be in \[0, tp_size=4\), got 4"),
        ({"tp_rank": -1, "tp_size": 4, "use_mla": True}, "tp_rank must be an integer >= 0, got -1"),
        ({"tp_size": 0}, "tp_size must be an integer > 0, got 0"),
        ({"pp_rank": 1, "pp_size": 1}, r"pp_rank must be in \[0, pp_size=1\), got 1"),
        ({"pcp_rank": 2, "pcp_size": 2}, r"pcp_rank must be in \[0, pcp_size=2\), got 2"),
        (
            {"tp_size": 4, "num_kv_heads": 6},
            "num_kv_heads=6 must be divisible by tp_size=4 so that each rank holds a whole number of KV "
            "heads",
        ),
        (
            {"tp_size": 6, "num_kv_heads": 4},
            "tp_size=6 must be divisible by num_kv_heads=4 so that KV heads replicate evenly across ranks",
        ),
        (
            {"tp_size": 4, "num_kv_heads": 8, "dcp_size": 2},
            r"dcp_size=2 needs KV heads replicated across TP ranks \(num_kv_heads < tp_size\)",
        ),
        (
            {"tp_size": 4, "num_kv_heads": 4, "dcp_size": 2},  # heads == tp: one head each, none shared
            r"dcp_size=2 needs KV heads replicated",
        ),
        (
            {"tp_size": 6, "num_kv_heads": 2, "dcp_size": 2},
            r"dcp_size=2 must divide the KV replication factor tp_size // num_kv_heads = 3$",
        ),
        (
            {"tp_size": 4, "num_kv_heads": 1, "dcp_size": 3},
            r"dcp_size=3 must divide tp_size=4 \(decode context parallelism splits the TP group\)",
        ),
        ({"dcp_size": 2, "tp_size": 2, "tp_rank": 0, "num_kv_heads": None}, "give num_kv_heads"),
        (
            {"tp_size": 2, "num_kv_heads": None},
            r"tp_size=2: give num_kv_heads \(the model's total KV heads\), or use_mla=True for an MLA "
            "model, so that kvflow knows which ranks hold the same KV",
        ),
        ({"dcp_size": 2, "num_kv_heads": None}, "dcp_size=2 must divide tp_size=1"),
        (
            {"pp_size": 2, "pp_layers": (4,)},
            r"pp_layers=\(4,\) must list the layers of each of the pp_size=2 stages",
        ),
        ({"pp_layers": "4"}, "pp_layers must be a sequence of layer counts, one per stage, got '4'"),
        ({"pp_layers": 4}, "pp_layers must be a sequence of layer counts, one per stage, got 4"),
        ({"pp_layers": ()}, r"pp_layers must be layer counts > 0, one per stage, got \(\)"),
        ({"pp_size": 2, "pp_layers": (2, 0)}, r"pp_layers must be layer counts > 0"),
        ({"pp_size": 2, "pp_layers": (2, 1.0)}, r"pp_layers must be layer counts > 0"),
    ],
)
def test_invalid_layouts_are_rejected_saying_why(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp_size": 4, "num_kv_heads": 4},  # one KV head per rank
        {"tp_size": 4, "num_kv_heads": 2, "dcp_size": 2},  # replication 2, split by dcp 2
        {"pp_size": 3, "pp_layers": [1, 1, 1]},  # stages of one layer each
        {"pp_size": 2, "pp_layers": range(1, 3)},
    ],
)
def test_boundary_layouts_are_accepted(kwargs: dict[str, object]) -> None:
    config = ParallelConfig(**kwargs)  # type: ignore[arg-type]
    if "pp_layers" in kwargs:
        assert config.pp_layers == tuple(kwargs["pp_layers"])  # type: ignore[call-overload]


def test_negative_block_index_is_rejected() -> None:
    with pytest.raises(ConfigError, match="block_index must be >= 0, got -1"):
        owner(-1, ParallelConfig())
