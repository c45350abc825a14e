"""Where another split's objects land when they go straight into a host cache (kvflow.transfer.direct).

Each case builds a reader's cache of a real model's shape (8 KV heads of 128, blocks of 16 tokens,
bfloat16), and checks the regions named for a writer's object against the bytes the object holds,
worked out by hand from the layouts. That the bytes arrive where these regions say is proven in
tests/test_topology.py, which loads every split and layout through this path bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import KVLayout
from kvflow.profiles import Profile
from kvflow.transfer.direct import MIN_RUN_BYTES, object_regions

LAYERS, HEADS, D, B = 4, 8, 128, 16
ITEM = 2  # bfloat16


def cache(kind: str, heads: int = HEADS) -> KVLayout:
    """A reader's 4 layers of 3 blocks of ``kind`` (``flashinfer_hnd``: HND in memory)."""

    def one() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if kind == "vllm_cpu":
            return torch.zeros(3, heads, B, 2 * D, dtype=torch.bfloat16)
        if kind == "flash_attn":
            return torch.zeros(2, 3, B, heads, D, dtype=torch.bfloat16)
        if kind == "flashinfer_hnd":
            return torch.zeros(3, 2, heads, B, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
        return torch.zeros(3, B, 576, dtype=torch.bfloat16)  # mla

    return KVLayout.from_kv_caches({f"layer.{i}": one() for i in range(LAYERS)})


def writer(
    layout: KVLayout, *, groups: int = 1, ranges: tuple[tuple[int, int], ...] = ((0, LAYERS),)
) -> Profile:
    """The profile of a writer laid out as ``layout`` but split in ``groups`` KV-head groups and
    the pipeline stages ``ranges``."""
    meaning = "bfloat16.mla576" if layout.mla else f"bfloat16.kv{HEADS}x{D}"
    return Profile(
        model="m",
        meaning=meaning,
        order=layout.order,
        block_size=B,
        hash_tokens=B,
        layer_ranges=ranges,
        head_groups=groups,
    )


def regions(
    profile: Profile,
    layout: KVLayout,
    *,
    layers: tuple[int, int] = (0, LAYERS),
    first_layer: int = 0,
    heads: tuple[int, int] = (0, HEADS),
    group: int = -1,
    shortest: int = MIN_RUN_BYTES,
) -> list[tuple[int, int, int]] | None:
    """``(plane, offset, bytes)`` of each region an object of the profile's ``group``-th scope
    (default: the last) fills, or None."""
    scope = list(profile.scopes())[group]
    found = object_regions(
        profile, layout, scope, layers=layers, first_layer=first_layer, heads=heads, shortest=shortest
    )
    if found is None:
        return None
    return list(zip(found.planes.tolist(), found.offsets.tolist(), found.sizes))


def test_a_tp2_writers_heads_go_in_one_run_per_layer_of_a_heads_outermost_block() -> None:
    layout = cache("vllm_cpu")  # [H, B, 2D] per block: heads 4-7 are the block's second half
    half = 4 * B * 2 * D * ITEM
    assert regions(writer(layout, groups=2), layout) == [(layer, half, half) for layer in range(LAYERS)]
    assert regions(writer(layout, groups=2), layout, group=0) == [(layer, 0, half) for layer in range(LAYERS)]


def test_an_hnd_block_takes_a_heads_split_in_two_runs_per_layer_k_then_v() -> None:
    layout = cache("flashinfer_hnd")  # [2, H, B, D] per block
    run = 4 * B * D * ITEM
    whole = HEADS * B * D * ITEM  # K's heads, then V's
    assert regions(writer(layout, groups=2), layout) == [
        (layer, at, run) for layer in range(LAYERS) for at in (run, whole + run)
    ]


def test_an_nhd_block_would_take_a_heads_split_a_token_at_a_time_so_it_goes_through_a_chunk() -> None:
    layout = cache("flash_attn")  # [B, H, D] per plane: each token's 4 heads are 1 KiB
    assert 4 * D * ITEM < MIN_RUN_BYTES
    assert regions(writer(layout, groups=2), layout) is None


def test_a_pipeline_stages_object_fills_its_layers_planes_whole() -> None:
    layout = cache("flash_attn")  # K and V planes per layer: indices 2 * layer and 2 * layer + 1
    plane = B * HEADS * D * ITEM
    stages = writer(layout, ranges=((0, 2), (2, 4)))
    assert regions(stages, layout) == [(p, 0, plane) for p in (4, 5, 6, 7)]
    # a reader whose stage holds layers 2-3 only: its planes count from its first layer
    stage = cache("flash_attn")
    assert regions(stages, stage, layers=(2, 4), first_layer=2) == [(p, 0, plane) for p in (0, 1, 2, 3)]


def test_mla_latents_of_another_split_go_in_whole() -> None:
    layout = cache("mla")
    stages = writer(layout, ranges=((0, 1), (1, 4)))
    assert regions(stages, layout, heads=(0, 1)) == [(p, 0, B * 576 * ITEM) for p in (1, 2, 3)]


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("the object holds layers the reader does not load", {"layers": (0, 2)}),
        ("the object holds heads the reader does not hold", {"heads": (4, 8)}),
    ],
)
def test_an_object_with_bytes_the_reader_does_not_need_goes_through_a_chunk(
    case: str, kwargs: dict[str, tuple[int, int]]
) -> None:
    layout = cache("vllm_cpu", heads=4 if "heads" in case else HEADS)
    whole = writer(cache("vllm_cpu"))  # one object per block: every layer, all 8 heads
    assert regions(whole, layout, **kwargs) is None  # type: ignore[arg-type]


def test_another_kinds_object_goes_in_a_run_per_head_and_token_where_the_backend_takes_short_runs() -> None:
    """A ``vllm_cpu`` object (``[H, B, 2D]``: each head's tokens, K's columns then V's) in a
    ``flash_attn`` block (K and V planes ``[B, H, D]``): a run of ``D`` elements per head and token,
    K's into the layer's first plane and V's into its second; with the heads of a TP=2 writer's
    second group four heads in."""
    reader = cache("flash_attn")
    run = D * ITEM  # 256 bytes
    for groups, group, first_head in ((1, 0, 0), (2, 1, 4), (2, 0, 0)):
        heads = range(first_head, first_head + HEADS // groups)
        expected = [
            (2 * layer + kv, (token * HEADS + head) * run, run)
            for layer in range(LAYERS)
            for head in heads
            for token in range(B)
            for kv in (0, 1)
        ]
        profile = writer(cache("vllm_cpu"), groups=groups)
        assert regions(profile, reader, group=group, shortest=run) == expected
        assert regions(profile, reader, group=group, shortest=run + 1) is None  # runs too short
        assert regions(profile, reader, group=group) is None  # kvflow's default: 4 KiB


def test_a_flash_attn_object_in_a_vllm_cpu_block_interleaves_k_and_v_columns() -> None:
    """The other way: a ``flash_attn`` object (K's plane, then V's) in a ``vllm_cpu`` block, where a
    head's token holds K's columns then V's: all of K's runs come first, each landing in the first
    half of its head's token row, then V's in the second halves."""
    reader = cache("vllm_cpu")
    run, row = D * ITEM, 2 * D * ITEM
    expected = [
        (layer, (head * B + token) * row + kv * run, run)
        for layer in range(LAYERS)
        for kv in (0, 1)
        for token in range(B)
        for head in range(HEADS)
    ]
    assert regions(writer(cache("flash_attn")), reader, shortest=run) == expected


def test_another_block_size_or_more_heads_than_the_reader_goes_through_a_chunk() -> None:
    layout = cache("vllm_cpu")
    other_size = Profile(
        model="m",
        meaning=f"bfloat16.kv{HEADS}x{D}",
        order=layout.order,
        block_size=2 * B,
        hash_tokens=B,
        layer_ranges=((0, LAYERS),),
        head_groups=2,
    )
    assert regions(other_size, layout, shortest=1) is None
    half = cache("flash_attn", heads=4)  # a TP=2 reader's rank: an object of all 8 heads is more
    assert regions(writer(cache("vllm_cpu")), half, heads=(0, 4), shortest=1) is None
