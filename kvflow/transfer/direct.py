"""Objects of another split or layout that a cache can take as they are: where each byte lands.

A reader that misses a block under its own keys may find it in another engine's objects
(:mod:`kvflow.transfer.reshape`). Those can be fetched into a host chunk and copied into the cache
part by part: every byte moves twice. But when the reader needs every byte of an object (its
layers, KV heads and columns are all the reader's, in blocks of as many tokens, of one dtype), each
of its bytes has one place in the reader's cache block, and its bytes fall there in runs: a TP=2
writer's object in a TP=1 reader's ``vllm_cpu`` block (heads outermost) is one run per layer; in
an HND ``flashinfer`` block, two (K and V); an object of another pipeline split is its layers'
planes whole; a ``vllm_cpu`` object in a ``flash_attn`` block (another kind: heads and tokens
swapped) is a run per head and token, K's and V's. Where the backend writes the cache itself (a
host cache, or device memory its transport reaches: no staging) it then writes the object straight
into the cache as an object of several regions, with no second copy, as it writes a matched block.

:func:`object_regions` names those regions for one scope of a profile, or None when the object
does not fall into runs of at least the backend's
:attr:`~kvflow.backends.base.BackendCapabilities.min_region_bytes` (:data:`MIN_RUN_BYTES` unless
it says otherwise): a backend pays for each region, and a store whose compiled copy loop streams a
region of a few hundred bytes at memcpy's speed (the in-process ones) says so.

Which byte goes where is worked out as a copy would do it: each side's planes of one layer seen
as logical parts (:func:`kvflow.parts.part_views`), the reader's filled with the positions of their
elements and copied into the writer's, whose memory order is then the object's byte order.
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvflow.keys import KeyScope
from kvflow.layout import KVLayout, LayoutKind
from kvflow.parts import part_views, plane_shapes, plane_strides
from kvflow.profiles import Profile

__all__ = ["MIN_RUN_BYTES", "ObjectRegions", "min_run_bytes", "object_regions"]

#: The shortest run of an object's bytes written into the cache as a region of its own, unless the
#: backend says otherwise: a backend pays for each region (a step of its copy loop, an entry of a
#: transport's request, a buffer of a system call), and a run per token (1 KiB for 4 heads of 128
#: in bfloat16 in an NHD block) would cost a network store more than the chunk's copies.
MIN_RUN_BYTES = 4096


def min_run_bytes(said: int | None) -> int:
    """The shortest run written as a region of its own over a backend whose
    ``min_region_bytes`` is ``said`` (None: :data:`MIN_RUN_BYTES`)."""
    return MIN_RUN_BYTES if said is None else said


@attrs.frozen(eq=False)
class ObjectRegions:
    """The regions of a reader's cache block that one object fills, in the object's byte order:
    region ``i`` is ``sizes[i]`` bytes at ``offsets[i]`` into the block's plane ``planes[i]`` (an
    index into the layout's planes over every layer of its stage)."""

    planes: npt.NDArray[np.intp]
    offsets: npt.NDArray[np.int64]
    sizes: list[int]
    size_array: npt.NDArray[np.int64]  # :attr:`sizes` as an array (shared by every batch: not to modify)
    nbytes: int

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
    shortest: int = MIN_RUN_BYTES,
) -> ObjectRegions | None:
    """Where the bytes of an object of ``profile``'s ``scope`` go in a block of ``layout``, the
    cache of a reader that needs the model ``layers`` and KV ``heads`` and whose stage starts at
    ``first_layer``; None when they cannot go straight in: another dtype or block size, an object
    holding layers, heads or columns the reader does not need, or runs shorter than ``shortest``
    bytes (:func:`min_run_bytes` of the backend's say)."""
    if (
        profile.dtype != layout.dtype
        or profile.block_size != layout.block_size
        or profile.mla != layout.mla
        or not layers[0] <= scope.layers[0] < scope.layers[1] <= layers[1]
        or not heads[0] <= scope.heads[0] < scope.heads[1] <= heads[1]
    ):
        return None
    reader_shapes = plane_shapes(layout.kind, layout.block_size, heads[1] - heads[0], layout.widths)
    reader_orders = tuple(p.order or "0" for p in layout.layers[0].planes)
    if len(reader_orders) != len(reader_shapes):
        return None
    runs = _runs(
        profile.kind,
        tuple(profile.shapes),
        profile.plane_orders,
        layout.kind,
        tuple(reader_shapes),
        reader_orders,
        scope.heads[0] - heads[0],
    )
    itemsize = layout.dtype.itemsize
    if runs is None or int(runs.lengths.min()) * itemsize < shortest:
        return None
    count = scope.layers[1] - scope.layers[0]
    mine = np.asarray(
        [layout.unit_planes(layer - first_layer) for layer in range(*scope.layers)], dtype=np.intp
    )
    sizes = np.tile(runs.lengths * itemsize, count)
    nbytes = int(sizes.sum())
    if nbytes != profile.object_nbytes(scope.layers):  # (a plane shape read wrong: never guess)
        return None
    offsets = np.tile(runs.offsets * itemsize, count)
    return ObjectRegions(mine[:, runs.planes].reshape(-1), offsets, sizes.tolist(), sizes, nbytes)


@attrs.frozen(eq=False)
class _Runs:
    """The runs of one layer of an object, in its byte order: run ``i`` is ``lengths[i]`` elements
    at element ``offsets[i]`` of the reader's plane ``planes[i]`` of the layer (read-only arrays)."""

    planes: npt.NDArray[np.intp]
    offsets: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]


#: How a reader's plane's position is told in :func:`_runs`: the plane's index above these bits.
_PLANE_SHIFT = 40


@functools.lru_cache(maxsize=256)
def _runs(
    kind: LayoutKind,
    shapes: tuple[tuple[int, ...], ...],
    orders: tuple[str, ...],
    reader_kind: LayoutKind,
    reader_shapes: tuple[tuple[int, ...], ...],
    reader_orders: tuple[str, ...],
    head_offset: int,
) -> _Runs | None:
    """A writer's layer of planes of per-block ``shapes`` laid out in ``orders`` (layout ``kind``),
    in a reader's layer of ``reader_kind`` (``reader_shapes``, ``reader_orders``) whose heads the
    writer's start ``head_offset`` into: each run of elements that follow one another in the
    reader's plane, in the writer's byte order (its planes one after another). None when an
    element of the writer's has no place in the reader's layer (heads or columns it lacks)."""
    reader: list[torch.Tensor] = []
    for plane, (shape, order) in enumerate(zip(reader_shapes, reader_orders)):
        size = math.prod(shape)
        positions = torch.arange(size, dtype=torch.int64) + (plane << _PLANE_SHIFT)
        reader.append(positions.as_strided((1, *shape), (size, *plane_strides(shape, order))))
    flat: list[torch.Tensor] = []
    writer: list[torch.Tensor] = []
    for shape, order in zip(shapes, orders):
        size = math.prod(shape)
        flat.append(torch.full((size,), -1, dtype=torch.int64))
        writer.append(flat[-1].as_strided((1, *shape), (size, *plane_strides(shape, order))))
    for src in part_views(kind, writer):
        for dst in part_views(reader_kind, reader):
            if src.name != dst.name:
                continue
            first = max(src.column, dst.column)
            end = min(src.column + src.view.size(3), dst.column + dst.view.size(3))
            if first >= end:
                continue
            h = src.view.size(2)
            if head_offset + h > dst.view.size(2):
                return None
            src.view[..., first - src.column : end - src.column].copy_(
                dst.view[:, :, head_offset : head_offset + h, first - dst.column : end - dst.column]
            )
    where: npt.NDArray[np.int64] = torch.cat(flat).numpy()
    if (where < 0).any():
        return None
    starts = np.flatnonzero(np.diff(where, prepend=where[0] - 2) != 1)
    lengths = np.diff(starts, append=where.size)
    heads = where[starts]
    runs = _Runs(
        (heads >> _PLANE_SHIFT).astype(np.intp), heads & ((1 << _PLANE_SHIFT) - 1), lengths.astype(np.int64)
    )
    for array in (runs.planes, runs.offsets, runs.lengths):
        array.setflags(write=False)  # (kept by the cache: shared by every call)
    return runs
