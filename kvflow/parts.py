"""A layer's KV as logical parts, whatever layout holds it: for transforms between layouts.

Every layout kind holds, per layer and block, the same content: K and V of ``B`` tokens and the
``H`` KV heads of this rank (``head_size`` each), or MLA's latent per token (one tensor, or the
``nope`` and ``rope`` columns as two). :func:`part_views` shows a layer's planes as :class:`Part`
views ``[rows, tokens, heads, columns]`` over the same memory, for the engine's cache (rows are
cache blocks) and for objects another engine wrote (rows are objects in a buffer, decoded from
their ``order`` with :func:`object_planes`). Copying between two parts is then a slice and a
``copy_``, whichever layouts, head ranges and token ranges the two sides have.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kvflow.errors import LayoutError
from kvflow.layout import LayoutKind

__all__ = ["Part", "object_planes", "part_views", "plane_shapes", "plane_strides"]


@attrs.frozen(eq=False)
class Part:
    """``view[rows, tokens, heads, columns]`` of part ``name`` (``k``, ``v`` or ``latent``);
    ``column`` is where its columns start in the whole part (MLA tuples: rope after nope)."""

    name: str
    column: int
    view: torch.Tensor


def _heads_last(t: torch.Tensor) -> torch.Tensor:
    """``[rows, tokens, columns]`` or ``[rows, tokens, 1, columns]`` as ``[rows, tokens, 1, columns]``."""
    return t.unsqueeze(2) if t.dim() == 3 else t


def part_views(kind: LayoutKind, planes: Sequence[torch.Tensor]) -> list[Part]:
    """The logical parts of one layer whose planes are ``planes`` (each ``[rows, ...]`` as in
    the layout table of :mod:`kvflow.layout`)."""
    if kind is LayoutKind.VLLM_CPU:  # [rows, H, B, 2D]
        (t,) = planes
        d = t.size(3) // 2
        return [
            Part("k", 0, t[..., :d].permute(0, 2, 1, 3)),
            Part("v", 0, t[..., d:].permute(0, 2, 1, 3)),
        ]
    if kind is LayoutKind.FLASHINFER:  # [rows, 2, B, H, D]
        (t,) = planes
        return [Part("k", 0, t[:, 0]), Part("v", 0, t[:, 1])]
    if kind in (LayoutKind.FLASH_ATTN, LayoutKind.KV_TUPLE):  # K and V, each [rows, B, H, D]
        k, v = planes
        return [Part("k", 0, k), Part("v", 0, v)]
    if kind is LayoutKind.MLA:  # [rows, B, D]
        (t,) = planes
        return [Part("latent", 0, _heads_last(t))]
    nope, rope = planes  # MLA tuple: [rows, B, 1, D_nope], [rows, B, 1, D_rope]
    return [Part("latent", 0, _heads_last(nope)), Part("latent", nope.size(-1), _heads_last(rope))]


def plane_shapes(
    kind: LayoutKind, block_size: int, heads: int, widths: Sequence[int]
) -> list[tuple[int, ...]]:
    """The per-block shape of each plane of a layer of ``kind``."""
    b = block_size
    if kind is LayoutKind.VLLM_CPU:
        return [(heads, b, 2 * widths[0])]
    if kind is LayoutKind.FLASHINFER:
        return [(2, b, heads, widths[0])]
    if kind in (LayoutKind.FLASH_ATTN, LayoutKind.KV_TUPLE):
        return [(b, heads, widths[0])] * 2
    if kind is LayoutKind.MLA:
        return [(b, widths[0])]
    return [(b, 1, widths[0]), (b, 1, widths[1])]


def plane_strides(shape: tuple[int, ...], order: str) -> list[int]:
    """Element strides of a dense block of ``shape`` whose dims (numbered from 1) lie outermost to
    innermost as ``order`` lists them; dims of size 1 are not listed and get any stride.
    LayoutError when ``order`` does not describe a block of ``shape``."""
    listed = [int(c) for c in order if c != "0"]
    if sorted(listed) != sorted(d + 1 for d, n in enumerate(shape) if n > 1):
        raise LayoutError(f"plane order {order!r} does not describe a block of shape {shape}")
    strides = [1] * len(shape)
    step = 1
    for dim in reversed(listed):
        strides[dim - 1] = step
        step *= shape[dim - 1]
    return strides


def object_planes(
    buffer: torch.Tensor,
    *,
    offset: int,
    rows: int,
    row_nbytes: int,
    dtype: torch.dtype,
    shapes: Sequence[tuple[int, ...]],
    orders: Sequence[str],
) -> list[torch.Tensor]:
    """One layer's planes inside objects that lie ``row_nbytes`` apart in ``buffer`` (``uint8``):
    the layer's first plane starts ``offset`` bytes into the first object and each plane follows
    the previous one densely, in the dimension order the writer recorded."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset % itemsize or row_nbytes % itemsize:
        raise LayoutError(f"objects are not aligned to {dtype} ({offset=}, {row_nbytes=})")
    typed = buffer.view(dtype)
    out: list[torch.Tensor] = []
    at = offset // itemsize
    for shape, order in zip(shapes, orders):
        strides = plane_strides(shape, order)
        out.append(
            typed.as_strided((rows, *shape), (row_nbytes // itemsize, *strides), typed.storage_offset() + at)
        )
        size = 1
        for n in shape:
            size *= n
        at += size
    return out
