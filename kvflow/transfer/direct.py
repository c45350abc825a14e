"""Objects of another split that a cache can take as they are: where each of their bytes lands.

A reader that misses a block under its own keys may find it in another engine's objects
(:mod:`kvflow.transfer.reshape`). Usually those are fetched into a host chunk and copied into the
cache part by part. But when both engines lay a layer out alike (the same layout kind, dtype and
block size) and the reader needs every byte of an object (its layers and KV heads are all the
reader's), the object is the reader's block less the other heads, and its bytes fall into the
cache in a few long runs: a TP=2 writer's object in a TP=1 reader's ``vllm_cpu`` block (heads
outermost) is one run per layer; in an HND ``flashinfer`` block, two (K and V); an object of
another pipeline split is its layers' planes whole. Where the backend writes the cache itself (a
host cache, or device memory its transport reaches: no staging) it then writes the object straight
into the cache as an object of several regions, with no second copy, as it writes a matched block.

:func:`object_regions` names those regions for one scope of a profile, or None when the object
does not fall into runs of at least :data:`MIN_RUN_BYTES` (an NHD block split by heads: a run per
token; planes whose dimensions lie in another order: shorter runs still).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
import numpy.typing as npt

from kvflow.keys import KeyScope
from kvflow.layout import KVLayout, LayoutKind
from kvflow.parts import plane_shapes, plane_strides
from kvflow.profiles import Profile

__all__ = ["MIN_RUN_BYTES", "ObjectRegions", "object_regions"]

#: The shortest run of an object's bytes written into the cache as a region of its own: a backend
#: pays for each region (a step of its copy loop, an entry of a transport's request), and a run per
#: token (1 KiB for 4 heads of 128 in bfloat16 in an NHD block) would cost more than the chunk's
#: copies.
MIN_RUN_BYTES = 4096

#: Where each layout kind keeps the KV heads in a plane's per-block shape (:func:`plane_shapes`);
#: MLA has one latent per token, no heads to split.
_HEAD_DIM = {
    LayoutKind.VLLM_CPU: 0,
    LayoutKind.FLASHINFER: 2,
    LayoutKind.FLASH_ATTN: 1,
    LayoutKind.KV_TUPLE: 1,
}


@attrs.frozen(eq=False)
class ObjectRegions:
    """The regions of a reader's cache block that one object fills, in the object's byte order:
    region ``i`` is ``sizes[i]`` bytes at ``offsets[i]`` into the block's plane ``planes[i]`` (an
    index into the layout's planes over every layer of its stage)."""

    planes: npt.NDArray[np.intp]
    offsets: npt.NDArray[np.int64]
    sizes: list[int]

    def addrs(self, block_rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The regions' addresses in each block whose plane addresses are a row of ``block_rows``
        (:meth:`KVLayout.addr_rows` over every layer)."""
        return block_rows[:, self.planes] + self.offsets


def object_regions(
    profile: Profile,
    layout: KVLayout,
    scope: KeyScope,
    *,
    layers: tuple[int, int],
    first_layer: int,
    heads: tuple[int, int],
) -> ObjectRegions | None:
    """Where the bytes of an object of ``profile``'s ``scope`` go in a block of ``layout``, the
    cache of a reader that needs the model ``layers`` and KV ``heads`` and whose stage starts at
    ``first_layer``; None when they cannot go straight in: another layout kind, dtype or block
    size, an object holding layers or heads the reader does not need, or runs shorter than
    :data:`MIN_RUN_BYTES`."""
    if (
        profile.kind is not layout.kind
        or profile.dtype != layout.dtype
        or profile.block_size != layout.block_size
        or not layers[0] <= scope.layers[0] < scope.layers[1] <= layers[1]
        or not heads[0] <= scope.heads[0] < scope.heads[1] <= heads[1]
    ):
        return None
    head_dim = _HEAD_DIM.get(layout.kind)
    if head_dim is None and scope.heads != heads:  # (MLA: one latent, (0, 1) on both sides)
        return None
    reader_shapes = plane_shapes(layout.kind, layout.block_size, heads[1] - heads[0], layout.widths)
    reader_orders = [p.order or "0" for p in layout.layers[0].planes]
    if len(reader_shapes) != len(profile.shapes) or len(reader_orders) != len(profile.shapes):
        return None
    per_plane = []
    for shape, order, reader, reader_order in zip(
        profile.shapes, profile.plane_orders, reader_shapes, reader_orders
    ):
        runs = _runs(shape, order, reader, reader_order, head_dim, scope.heads[0] - heads[0])
        if runs is None:
            return None
        per_plane.append(runs)
    itemsize = layout.dtype.itemsize
    if any(n * itemsize < MIN_RUN_BYTES for runs in per_plane for _, n in runs):
        return None
    planes: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    for layer in range(*scope.layers):
        for plane, runs in zip(layout.unit_planes(layer - first_layer), per_plane):
            for at, n in runs:
                planes.append(plane)
                offsets.append(at * itemsize)
                sizes.append(n * itemsize)
    if sum(sizes) != profile.object_nbytes(scope.layers):  # (a plane shape read wrong: never guess)
        return None
    return ObjectRegions(np.asarray(planes, dtype=np.intp), np.asarray(offsets, dtype=np.int64), sizes)


@functools.lru_cache(maxsize=256)
def _runs(
    shape: tuple[int, ...],
    order: str,
    reader: tuple[int, ...],
    reader_order: str,
    head_dim: int | None,
    head_offset: int,
) -> tuple[tuple[int, int], ...] | None:
    """A writer's plane of per-block ``shape`` laid out in ``order``, in a reader's plane of
    ``reader`` laid out in ``reader_order`` (the same shape but for more heads at ``head_dim``),
    its heads starting at ``head_offset`` there: ``(reader's element offset, elements)`` of each
    run of consecutive elements, in the writer's element order (the orders may differ: a run then
    ends at each element that does not follow the last). None when the shapes differ elsewhere
    or the heads do not fit."""
    if len(shape) != len(reader) or any(
        a != b for d, (a, b) in enumerate(zip(shape, reader)) if d != head_dim
    ):
        return None
    if head_dim is not None and head_offset + shape[head_dim] > reader[head_dim]:
        return None
    index = np.indices(shape).reshape(len(shape), -1)
    src = np.asarray(plane_strides(shape, order), dtype=np.int64) @ index
    if head_dim is not None:
        index[head_dim] += head_offset
    dst = (np.asarray(plane_strides(reader, reader_order), dtype=np.int64) @ index)[np.argsort(src)]
    breaks = np.flatnonzero(np.diff(dst) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [dst.size]))
    return tuple((int(dst[s]), int(e - s)) for s, e in zip(starts, ends))
