from __future__ import annotations

import ctypes
import re

import pytest
import torch

from kvflow.errors import LayoutError
from kvflow.layout import KVFormat, KVLayout, LayoutKind
from kvflow.parts import object_planes
from tests.helpers import BLOCK, LAYOUTS, NUM_BLOCKS, block_bytes


def test_regions_are_exactly_each_blocks_bytes(layout_name: str) -> None:
    caches = LAYOUTS[layout_name]()
    layout = KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]
    assert layout.kind is LayoutKind(layout_name)
    assert (layout.block_size, layout.num_blocks, layout.num_layers) == (BLOCK, NUM_BLOCKS, 3)
    for block_id in (0, 5, NUM_BLOCKS - 1):
        got = b"".join(
            ctypes.string_at(a, n) for a, n in zip(layout.block_addrs(block_id), layout.block_sizes)
        )
        want = b"".join(block_bytes(entry, block_id) for entry in caches.values())
        assert got == want
        for layer, entry in enumerate(caches.values()):
            addrs, sizes = layout.layer_regions(block_id, layer)
            assert b"".join(ctypes.string_at(a, n) for a, n in zip(addrs, sizes)) == block_bytes(
                entry, block_id
            )
    # The vectorised addresses, the byte views the staging path copies and the typed views agree.
    ids = [NUM_BLOCKS - 1, 0, 5]
    for _ in range(2):  # each unit's columns are kept after its first use: each unit's own, still
        assert layout.addrs_of(ids) == [layout.block_addrs(b) for b in ids]
        for layer in range(layout.num_layers):
            assert layout.addrs_of(ids, layer) == [layout.layer_regions(b, layer)[0] for b in ids]
    flat = [(layer, p) for layer, views in enumerate(layout.typed_views) for p in range(len(views))]
    for (layer, p), view_u8 in zip(flat, layout.plane_views, strict=True):
        typed = layout.typed_views[layer][p]
        assert view_u8.dtype is torch.uint8 and view_u8.shape == (NUM_BLOCKS, layout.unit_sizes(layer)[p])
        for block_id in ids:
            assert (
                view_u8[block_id].numpy().tobytes()
                == typed[block_id].contiguous().view(torch.uint8).numpy().tobytes()
            )
    assert layout.heads == (1 if layout.mla else 2)


def test_permuted_but_dense_blocks_are_one_region_of_another_order() -> None:
    """An HND cache viewed as NHD: each block is still one dense span, in another order."""
    hnd = torch.randn(2, NUM_BLOCKS, 2, BLOCK, 8).half()  # [2, N, H, B, D] in memory
    nhd_view = hnd.permute(0, 1, 3, 2, 4)  # logical [2, N, B, H, D]
    layout = KVLayout.from_kv_caches({"l0": nhd_view})
    assert layout.block_sizes == [2 * BLOCK * 8 * 2, 2 * BLOCK * 8 * 2]
    plain = KVLayout.from_kv_caches({"l0": torch.randn(2, NUM_BLOCKS, BLOCK, 2, 8).half()})
    assert layout.order == "flash_attn.213.213" and plain.order == "flash_attn.123.123"
    assert layout.format().meaning == plain.format().meaning == "float16.kv2x8"  # the same content


def test_format_separates_dtype_block_size_head_size_and_kind() -> None:
    base = KVLayout.from_kv_caches({"l": torch.zeros(4, 2, 16, 16, dtype=torch.float16)}).format()
    assert base == KVLayout.from_kv_caches({"l": torch.ones(4, 2, 16, 16, dtype=torch.float16)}).format()
    others = [
        {"l": torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)},
        {"l": torch.zeros(4, 2, 32, 8, dtype=torch.float16)},
        {"l": torch.zeros(4, 2, 16, 32, dtype=torch.float16)},
        {"l": (torch.zeros(4, 16, 2, 8, dtype=torch.float16), torch.zeros(4, 16, 2, 8, dtype=torch.float16))},
    ]
    assert all(KVLayout.from_kv_caches(o).format() != base for o in others)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "entry",
    [
        torch.zeros(4, 16),
        torch.zeros(3, 4, 16, 2, 8),  # 5-D without a K/V dim of 2
        (torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)),
        (torch.zeros(4, 16, 2, 8), torch.zeros(4, 8, 2, 8)),
    ],
)
def test_unsupported_shapes_name_what_they_got(entry: object) -> None:
    with pytest.raises(LayoutError, match=r"unsupported KV cache .*tensor\[.*supported: vllm_cpu"):
        KVLayout.from_kv_caches({"layer0": entry})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "entry",
    [
        (torch.zeros(4, 16, 24), torch.zeros(4, 16, 24)),  # 3-D pair of one width: not MLA's two parts
        (torch.zeros(4, 16, 24), torch.zeros(5, 16, 8)),  # 3-D pair that disagree on more than width
        (torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 8)),  # 4-D MLA parts hold one head, not 2
        (torch.zeros(4, 16, 2, 8), "v"),  # not a tensor: said so, not an AttributeError
    ],
)
def test_pairs_that_are_not_kv_or_mla_parts_are_refused(entry: object) -> None:
    with pytest.raises(LayoutError, match=r"^layer 'layer0': unsupported KV cache \(tensor\["):
        KVLayout.from_kv_caches({"layer0": entry})  # type: ignore[dict-item]


def test_a_vllm_cpu_cache_of_odd_width_is_refused() -> None:
    """K and V lie side by side in the last dimension: an odd one would make V a column wider than
    the head size every other engine reads it as."""
    with pytest.raises(
        LayoutError, match=r"^layer 'a': a vLLM CPU cache \[4, 2, 8, 9\] .* must be even, not 9$"
    ):
        KVLayout.from_kv_caches({"a": torch.zeros(4, 2, 8, 9)})


def test_mla_parts_of_three_and_four_dimensions_lie_and_are_named_alike() -> None:
    """``[N, B, D]`` and ``[N, B, 1, D]`` hold a block's latent in the same bytes: one order, so
    engines of either shape share keys and read each other's objects."""
    three = KVLayout.from_kv_caches({"l": (torch.zeros(4, 8, 6), torch.zeros(4, 8, 2))})
    four = KVLayout.from_kv_caches({"l": (torch.zeros(4, 8, 1, 6), torch.zeros(4, 8, 1, 2))})
    assert three.order == four.order == "mla_tuple.13.13"
    assert three.format().meaning == four.format().meaning


def test_an_unsupported_cache_is_described_shape_by_shape() -> None:
    with pytest.raises(
        LayoutError, match=r"^layer 'x': unsupported KV cache \(tensor\[2, 3\], tensor\[4\]\); supported: "
    ):
        KVLayout.from_kv_caches({"x": (torch.zeros(2, 3), torch.zeros(4))})
    with pytest.raises(LayoutError, match=r"unsupported KV cache \(tensor\[2\], a str\); supported: "):
        KVLayout.from_kv_caches({"x": (torch.zeros(2), "v")})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("entry", "kind", "block_size", "widths"),
    [
        ((torch.zeros(4, 16, 512), torch.zeros(4, 16, 64)), LayoutKind.MLA_TUPLE, 16, (512, 64)),  # 3-D parts
        ((torch.zeros(4, 16, 1, 512), torch.zeros(4, 16, 1, 64)), LayoutKind.MLA_TUPLE, 16, (512, 64)),
        (torch.zeros(2, 3, 16, 2, 8), LayoutKind.FLASH_ATTN, 16, (8,)),  # 3 blocks: not [N, 2, ...]
        (torch.zeros(3, 2, 16, 2, 8), LayoutKind.FLASHINFER, 16, (8,)),  # 3 blocks: not [2, N, ...]
        (torch.zeros(2, 5, 2, 4, 8), LayoutKind.FLASH_ATTN, 2, (8,)),  # a block of 2 tokens
        (torch.zeros(1, 16, 24), LayoutKind.MLA, 16, (24,)),  # one block
    ],
)
def test_boundary_shapes_are_classified(
    entry: object, kind: LayoutKind, block_size: int, widths: tuple[int, ...]
) -> None:
    layout = KVLayout.from_kv_caches({"l": entry})  # type: ignore[dict-item]
    assert (layout.kind, layout.block_size, layout.widths) == (kind, block_size, widths)
    assert layout.block_nbytes == sum(v[0].numel() * 4 for v in layout.typed_views[0])


def test_non_dense_block_is_rejected() -> None:
    strided = torch.zeros(4, 2, 16, 32)[..., ::2]
    with pytest.raises(
        LayoutError,
        match=r"^layer 'l': a block of shape \(2, 16, 16\) with strides \(512, 32, 2\) is not one dense "
        "span of memory; make the KV cache contiguous within a block$",
    ):
        KVLayout.from_kv_caches({"l": strided})


def test_overlapping_blocks_are_rejected_and_a_single_block_has_no_stride_to_check() -> None:
    base = torch.zeros(64)
    for blocks in (2, 3):  # each block 16 floats, 8 apart
        overlapping = base.as_strided((blocks, 1, 16), (8, 16, 1))  # a block of one token
        with pytest.raises(LayoutError, match=r"^layer 'l': blocks overlap \(block stride 32 < 64 B\)$"):
            KVLayout.from_kv_caches({"l": overlapping})
    alone = base.as_strided((1, 1, 16), (0, 16, 1))
    assert KVLayout.from_kv_caches({"l": alone}).block_sizes == [64]


@pytest.mark.parametrize("field", ["block_size", "num_layers"])
@pytest.mark.parametrize("bad", [0, True, "3", 2.0])
def test_a_format_refuses_what_is_not_a_positive_integer(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"block_size": 16, "num_layers": 2, "meaning": "m", "order": "o"}
    kwargs[field] = bad
    with pytest.raises(
        LayoutError, match=f"^{field} must be a positive integer, got {re.escape(repr(bad))}$"
    ):
        KVFormat(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["meaning", "order"])
@pytest.mark.parametrize("bad", ["", "a b", 5, None])
def test_a_format_refuses_text_that_cannot_be_part_of_a_key(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"block_size": 16, "num_layers": 2, "meaning": "m", "order": "o"}
    kwargs[field] = bad
    with pytest.raises(LayoutError, match=rf"^{field} must be non-empty text of \[A-Za-z0-9_\.\+-\], got "):
        KVFormat(**kwargs)  # type: ignore[arg-type]


def test_mixed_layers_and_wrong_block_size_are_rejected() -> None:
    every = "every layer must share one layout; got"
    one = torch.zeros(4, 2, 16, 8)
    for other, what in (
        (torch.zeros(5, 2, 16, 8), r"block counts \['4', '5'\]"),
        (one.half(), r"dtypes \['torch.float16', 'torch.float32'\]"),
        (torch.zeros(4, 2, 32, 8), r"block sizes \['16', '32'\]"),
        (torch.zeros(4, 16, 8), r"layout kinds \['LayoutKind.MLA', 'LayoutKind.VLLM_CPU'\]"),
        (torch.zeros(4, 2, 16, 4), "per-block shapes"),
        (one.to("meta"), r"devices \['cpu', 'meta'\]"),
    ):
        with pytest.raises(LayoutError, match=f"^{every} {what}"):
            KVLayout.from_kv_caches({"a": one, "b": other})
    with pytest.raises(LayoutError, match="block_size=32"):
        KVLayout.from_kv_caches({"a": torch.zeros(4, 2, 16, 8)}, block_size=32)
    with pytest.raises(LayoutError, match=r"^no KV caches given; register at least one layer$"):
        KVLayout.from_kv_caches({})
    for caches in ([one], one):  # a list of layers, a tensor: a mapping asked for, not a raw error
        with pytest.raises(LayoutError, match=r"^kv_caches must be a mapping of layer name to tensor"):
            KVLayout.from_kv_caches(caches)  # type: ignore[arg-type]


def test_allocations_cover_shared_storage_once() -> None:
    whole = torch.zeros(3, 4, 2, 16, 8)
    layout = KVLayout.from_kv_caches({f"l{i}": whole[i] for i in range(3)})
    assert layout.allocations() == [(whole.data_ptr(), whole.numel() * 4)]


def test_a_cache_of_no_blocks_is_refused_with_a_layout_error() -> None:
    with pytest.raises(LayoutError, match="0 blocks"):
        KVLayout.from_kv_caches({"l0": torch.zeros(0, 2, 16, 16)})


@pytest.mark.parametrize(("offset", "row_nbytes"), [(1, 64), (2, 65)])
def test_objects_not_aligned_to_their_dtype_are_refused(offset: int, row_nbytes: int) -> None:
    """Planes of float16 objects at an odd offset, or rows an odd number of bytes apart, cannot be
    viewed as float16: refused, never read from the nearest aligned byte."""
    buffer = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="not aligned"):
        object_planes(
            buffer,
            offset=offset,
            rows=2,
            row_nbytes=row_nbytes,
            dtype=torch.float16,
            shapes=[(4, 2)],
            orders=["12"],
        )
