"""In-process copies of a backend call's objects: each object's regions to or from one buffer, the
whole batch in one compiled call (:mod:`kvflow.regions`).

A gather writes the store's own buffers with streaming stores (:mod:`kvflow.copyloops`): nobody
reads a stored object again soon, so its lines need not be read first nor kept in the caches. A
scatter writes the engine's cache with ordinary stores: its kernels read the loaded KV next, and
what is still in the caches they read faster (streamed loads of a 32 MiB prompt made no load faster
and the forward after them slower in ``benchmarks/vllm_ttft.py``: docs/benchmarks.md, 2026-12-04).

An :class:`~kvflow.backends.base.ObjectBatch` goes to the copy loop as the columns it already is;
a list of objects of any shapes is first laid out flat.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.backends.base import ObjectBatch, ObjectRef
from kvflow.regions import copy_ragged, copy_rows

__all__ = ["check_object", "gather_objects", "scatter_objects"]


def gather_objects(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
    """Copy each object's regions back to back into the buffer at ``buffers[i]`` (streamed)."""
    _copy(buffers, objects, into_regions=False, stream=True)


def scatter_objects(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
    """Copy the buffer at ``buffers[i]`` into object ``i``'s regions, in order."""
    _copy(buffers, objects, into_regions=True, stream=False)


def check_object(obj: ObjectRef) -> None:
    """Raise ValueError unless ``obj``'s addresses, sizes and byte count agree (a copy of it would
    leave part of its buffer unwritten, or write past it)."""
    if len(obj.addrs) != len(obj.sizes) or sum(obj.sizes) != obj.nbytes or min(obj.sizes, default=0) < 0:
        raise ValueError(
            f"object {obj.key!r}: {len(obj.addrs)} addresses, sizes {list(obj.sizes)} and "
            f"nbytes {obj.nbytes} do not agree (build it with ObjectRef.of)"
        )


def _copy(buffers: Sequence[int], objects: Sequence[ObjectRef], *, into_regions: bool, stream: bool) -> None:
    if len(buffers) != len(objects):
        raise ValueError(f"{len(buffers)} buffers for {len(objects)} objects")
    starts = np.asarray(buffers, dtype=np.int64)
    if isinstance(objects, ObjectBatch):
        sizes = np.asarray(objects.sizes)
        copy_rows(starts, objects.addrs, sizes, into_regions=into_regions, stream=stream)
        return
    addrs: list[int] = []
    sizes_of: list[int] = []
    for obj in objects:
        check_object(obj)
        addrs.extend(obj.addrs)
        sizes_of.extend(obj.sizes)
    counts = np.fromiter((len(obj.sizes) for obj in objects), dtype=np.int64, count=len(objects))
    copy_ragged(
        starts, counts, np.asarray(addrs), np.asarray(sizes_of), into_regions=into_regions, stream=stream
    )
