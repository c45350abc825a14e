"""Blocks another engine wrote with another split or layout: which objects, and the copy out of them.

When a block is missing under a reader's own keys, it may be in the store under another engine's
:class:`~kvflow.profiles.Profile`: another tensor-parallel split of the KV heads, another
pipeline split of the layers, another layout kind or dimension order, or objects of another
number of tokens. :func:`sources` names the objects of that profile that hold what the reader
needs of one block (the layers and heads it serves, the block's tokens, its context shard);
:func:`copy_into` copies their overlap into the reader's cache block, one slice per layer, part
and object, through :mod:`kvflow.parts`. The objects are fetched whole into a host staging
chunk first (:meth:`kvflow.transfer.jobs.LoadJob.get` drives it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import attrs
import torch

from kvflow.device import Device
from kvflow.errors import LayoutError
from kvflow.keys import KeyScope
from kvflow.layout import KVLayout
from kvflow.parts import Part, object_planes, part_views
from kvflow.profiles import Profile

__all__ = ["Source", "copy_into", "copy_rows", "distinct_bytes", "needed_bytes", "sources"]


@attrs.frozen
class Source:
    """One object of another profile: its key, scope, first token in the prompt and size."""

    key: str
    scope: KeyScope
    first_token: int
    nbytes: int


def sources(
    profile: Profile,
    fine: Sequence[bytes],
    tokens: tuple[int, int],
    *,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
    dcp_rank: int | None = None,
    pcp_rank: int | None = None,
) -> list[Source] | None:
    """The objects of ``profile`` that hold ``tokens`` ``(first, end)`` of the prompt whose hashes
    (one per ``profile.hash_tokens`` tokens) are ``fine``, for ``layers`` and ``heads`` (default:
    all) of the given shards (default: all). None when one of them cannot be named: it would reach
    past the prompt's hashed tokens, or the profile does not cover the layers."""
    size, per_hash = profile.block_size, profile.hash_tokens
    if layers is not None and not profile.covers(layers):
        return None
    scopes = _scopes(profile, layers, heads, dcp_rank, pcp_rank)
    out: list[Source] = []
    for block in range(tokens[0] // size, (tokens[1] - 1) // size + 1):
        last = (block + 1) * size // per_hash - 1
        if last >= len(fine):
            return None
        digest = fine[last].hex()
        out.extend(
            Source(s.prefix + digest, s, block * size, profile.object_nbytes(s.layers)) for s in scopes
        )
    return out


def distinct_bytes(found: Sequence[Source]) -> dict[str, int]:
    """The bytes of each distinct object of ``found`` (a block's sources may name one object twice)."""
    return {s.key: s.nbytes for s in found}


def needed_bytes(found: Sequence[Source]) -> int:
    """The bytes a load of ``found`` holds at once: each distinct object once."""
    return sum(distinct_bytes(found).values())


@functools.lru_cache(maxsize=1024)
def _scopes(
    profile: Profile,
    layers: tuple[int, int] | None,
    heads: tuple[int, int] | None,
    dcp_rank: int | None,
    pcp_rank: int | None,
) -> tuple[KeyScope, ...]:
    """:meth:`Profile.scopes`, made once per profile and question: :func:`sources` asks it per block,
    and each scope keeps its key prefix."""
    return tuple(profile.scopes(layers=layers, heads=heads, dcp_rank=dcp_rank, pcp_rank=pcp_rank))


def _overlap(a: int, a_len: int, b: int, b_len: int) -> tuple[int, int] | None:
    first, end = max(a, b), min(a + a_len, b + b_len)
    return (first, end) if first < end else None


def _layer_parts(
    profile: Profile,
    buffer: torch.Tensor,
    offset: int,
    scope: KeyScope,
    layers: tuple[int, int],
    rows: int,
    row_nbytes: int,
) -> Iterator[tuple[int, list[Part]]]:
    """Each model layer of ``layers`` that the objects of ``scope`` (``rows`` of ``row_nbytes``
    at ``offset`` in ``buffer``) hold, with the logical parts of that layer in them."""
    span = _overlap(scope.layers[0], scope.layers[1] - scope.layers[0], layers[0], layers[1] - layers[0])
    if span is None:
        return
    for layer in range(*span):
        planes = object_planes(
            buffer,
            offset=offset + (layer - scope.layers[0]) * profile.layer_nbytes,
            rows=rows,
            row_nbytes=row_nbytes,
            dtype=profile.dtype,
            shapes=profile.shapes,
            orders=profile.plane_orders,
        )
        yield layer, part_views(profile.kind, planes)


def copy_into(
    layout: KVLayout,
    block_id: int,
    *,
    first_token: int,
    first_layer: int,
    layers: tuple[int, int],
    heads: tuple[int, int],
    profile: Profile,
    buffer: torch.Tensor,
    placed: Sequence[tuple[int, Source]],
) -> None:
    """Copy into cache block ``block_id`` (which holds the prompt's tokens from ``first_token``,
    heads ``heads`` and the stage whose first layer is ``first_layer``) the overlap of each object
    ``placed`` at its byte offset in ``buffer``, for the model layers ``layers``. Issues the copies
    on the current stream; the caller records an event after them."""
    for offset, source in placed:
        scope = source.scope
        moved = _on_device(buffer, offset, source.nbytes, layout.device)
        for layer, src_parts in _layer_parts(profile, moved, 0, scope, layers, 1, source.nbytes):
            mine = [v[block_id : block_id + 1] for v in layout.typed_views[layer - first_layer]]
            for dst in part_views(layout.kind, mine):
                for src in src_parts:
                    if src.name != dst.name:
                        continue
                    t = _overlap(source.first_token, src.view.size(1), first_token, dst.view.size(1))
                    h = _overlap(scope.heads[0], src.view.size(2), heads[0], dst.view.size(2))
                    c = _overlap(src.column, src.view.size(3), dst.column, dst.view.size(3))
                    if t is None or h is None or c is None:
                        continue
                    into = dst.view[
                        0,
                        t[0] - first_token : t[1] - first_token,
                        h[0] - heads[0] : h[1] - heads[0],
                        c[0] - dst.column : c[1] - dst.column,
                    ]
                    value = src.view[
                        0,
                        t[0] - source.first_token : t[1] - source.first_token,
                        h[0] - scope.heads[0] : h[1] - scope.heads[0],
                        c[0] - src.column : c[1] - src.column,
                    ]
                    _bits(into).copy_(_bits(value), non_blocking=True)


def copy_rows(
    device: Device,
    layout: KVLayout,
    block_ids: Sequence[int],
    rows: Sequence[int],
    *,
    first_layer: int,
    layers: tuple[int, int],
    heads: tuple[int, int],
    profile: Profile,
    buffer: torch.Tensor,
    regions: Sequence[tuple[int, KeyScope, int]],
) -> None:
    """The batched form of :func:`copy_into` when the writer's objects hold exactly the reader's
    blocks' tokens (same block size): ``regions`` lists, per scope of the profile, ``(offset,
    scope, nbytes)`` of rows of objects laid out one after another in ``buffer``; row ``rows[i]``
    of every region goes into cache block ``block_ids[i]``. Per region, layer and part: a slice's
    ``copy_`` per stretch of consecutive rows into consecutive blocks where they come in at most a
    quarter as many stretches as there are blocks (vLLM hands out a request's blocks mostly in
    order), else one ``index_copy_`` for all of them, which ran 5x slower on the CPU (warm; 1.4x
    even for blocks not consecutive at all: docs/benchmarks.md, twenty-first stop).

    Which parts of a region go where is the same in every layer: it is worked out once per region
    (:func:`_pairs`), and each layer's source is the first layer's view moved by a layer's bytes."""
    count = max(rows) + 1 if rows else 0
    stretches = _stretches(rows, block_ids)
    index = picked = None  # (None: by stretches)
    if len(stretches) * _FEW_STRETCHES > len(rows):  # scattered blocks: one index_copy_ each
        index = device.index(list(block_ids))  # (a tensor made on the device would wait for the stream)
        picked = None if list(rows) == list(range(len(rows))) else device.index(list(rows))
    work = []  # per region: the layers it holds of ``layers``, its pairs, a layer's elements
    for offset, scope, nbytes in regions:
        span = _overlap(scope.layers[0], scope.layers[1] - scope.layers[0], layers[0], layers[1] - layers[0])
        if span is not None:
            moved = _on_device(buffer, offset, count * nbytes, layout.device)
            pairs, step = _pairs(profile, layout, moved, scope, span[0], first_layer, heads, count, nbytes)
            work.append((span, pairs, step))
    for layer in range(*layers):
        dst_parts: list[Part] | None = None
        for span, pairs, step in work:
            if not span[0] <= layer < span[1]:
                continue
            if dst_parts is None:
                dst_parts = part_views(layout.kind, layout.typed_views[layer - first_layer])
            shift = (layer - span[0]) * step
            for j, into, first in pairs:
                target = _bits(dst_parts[j].view[into])
                value = first.as_strided(first.size(), first.stride(), first.storage_offset() + shift)
                if index is None:
                    for row, block, n in stretches:
                        target[block : block + n].copy_(value[row : row + n], non_blocking=True)
                    continue
                value = value[:count] if picked is None else value.index_select(0, picked)
                target.index_copy_(0, index, value)


#: A reader's part's index, its slice, and the source's slice in the first layer (see :func:`_pairs`).
_Pair = tuple[int, tuple[slice, ...], torch.Tensor]


def _pairs(
    profile: Profile,
    layout: KVLayout,
    moved: torch.Tensor,
    scope: KeyScope,
    layer: int,
    first_layer: int,
    heads: tuple[int, int],
    rows: int,
    row_nbytes: int,
) -> tuple[list[_Pair], int]:
    """What :func:`copy_rows` copies from one region (``rows`` objects of ``scope`` in ``moved``)
    into each layer, worked out on ``layer``, the first the region and the reader share: per pair
    of a source part and a reader's part that overlap, the reader's part's index (in
    :func:`~kvflow.parts.part_views` order), its slice, and the source's slice in ``layer`` (as
    :func:`_bits`); and how many of those elements lie between two layers of an object."""
    ((_, src_parts),) = _layer_parts(profile, moved, 0, scope, (layer, layer + 1), rows, row_nbytes)
    dst_parts = part_views(layout.kind, layout.typed_views[layer - first_layer])
    itemsize = src_parts[0].view.element_size()
    if profile.layer_nbytes % itemsize:
        raise LayoutError(f"a layer of {profile.layer_nbytes} bytes is not a whole number of {profile.dtype}")
    pairs: list[_Pair] = []
    for j, dst in enumerate(dst_parts):
        for src in src_parts:
            if src.name != dst.name:
                continue
            h = _overlap(scope.heads[0], src.view.size(2), heads[0], dst.view.size(2))
            c = _overlap(src.column, src.view.size(3), dst.column, dst.view.size(3))
            if h is None or c is None:
                continue
            into = (
                slice(None),
                slice(None),
                slice(h[0] - heads[0], h[1] - heads[0]),
                slice(c[0] - dst.column, c[1] - dst.column),
            )
            value = src.view[
                :, :, h[0] - scope.heads[0] : h[1] - scope.heads[0], c[0] - src.column : c[1] - src.column
            ]
            pairs.append((j, into, _bits(value)))
    return pairs, profile.layer_nbytes // itemsize


#: :func:`copy_rows` copies stretch by stretch where the blocks come in at most a quarter as many
#: stretches as there are blocks (each stretch's ``copy_`` costs a few microseconds of Python, or a
#: kernel's launch on a device).
_FEW_STRETCHES = 4


def _stretches(rows: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first row, first block, length)`` of each stretch in which the rows and the blocks both
    go up by one."""
    out: list[tuple[int, int, int]] = []
    for row, block in zip(rows, block_ids):
        if out and row == out[-1][0] + out[-1][2] and block == out[-1][1] + out[-1][2]:
            first_row, first_block, n = out[-1]
            out[-1] = (first_row, first_block, n + 1)
        else:
            out.append((row, block, 1))
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its element size (the same strides and memory): copies move the bits
    exactly, and for every dtype (torch has no copy kernels of some, fp8's ``index_copy_``)."""
    bits = _BITS.get(t.element_size())
    return t if bits is None else t.view(bits)


def _on_device(buffer: torch.Tensor, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of the staging ``buffer`` from ``offset``, on the cache's device: moved whole
    (a dense span of pinned memory) before any view of it is taken, since a strided view would be
    moved through a pageable copy, which waits. On the CPU, the same memory."""
    return buffer[offset : offset + nbytes].to(device, non_blocking=True)
