from __future__ import annotations

import ctypes

import pytest
import torch

from kvflow.errors import LayoutError
from kvflow.layout import KVLayout, LayoutKind
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


def test_non_dense_block_is_rejected() -> None:
    strided = torch.zeros(4, 2, 16, 32)[..., ::2]
    with pytest.raises(LayoutError, match="dense"):
        KVLayout.from_kv_caches({"l": strided})


def test_mixed_layers_and_wrong_block_size_are_rejected() -> None:
    with pytest.raises(LayoutError, match="block counts"):
        KVLayout.from_kv_caches({"a": torch.zeros(4, 2, 16, 8), "b": torch.zeros(5, 2, 16, 8)})
    with pytest.raises(LayoutError, match="dtypes"):
        KVLayout.from_kv_caches({"a": torch.zeros(4, 2, 16, 8), "b": torch.zeros(4, 2, 16, 8).half()})
    with pytest.raises(LayoutError, match="block_size=32"):
        KVLayout.from_kv_caches({"a": torch.zeros(4, 2, 16, 8)}, block_size=32)
    with pytest.raises(LayoutError, match="no KV caches"):
        KVLayout.from_kv_caches({})


def test_allocations_cover_shared_storage_once() -> None:
    whole = torch.zeros(3, 4, 2, 16, 8)
    layout = KVLayout.from_kv_caches({f"l{i}": whole[i] for i in range(3)})
    assert layout.allocations() == [(whole.data_ptr(), whole.numel() * 4)]


def test_a_cache_of_no_blocks_is_refused_with_a_layout_error() -> None:
    with pytest.raises(LayoutError, match="0 blocks"):
        KVLayout.from_kv_caches({"l0": torch.zeros(0, 2, 16, 16)})
