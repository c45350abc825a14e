"""In-process copies of a backend call's objects: each object's regions to or from one buffer, the
whole batch in one compiled call (:mod:`kvflow.regions`).

An :class:`~kvflow.backends.base.ObjectBatch` goes to the copy loop as the columns it already is;
a list of objects of any shapes is first laid out flat.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvflow.backends.base import ObjectBatch, ObjectRef
from kvflow.regions import copy_ragged, copy_rows

__all__ = ["gather_objects", "scatter_objects"]


def gather_objects(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
    """Copy each object's regions back to back into the buffer at ``buffers[i]``."""
    _copy(buffers, objects, into_regions=False)


def scatter_objects(buffers: Sequence[int], objects: Sequence[ObjectRef]) -> None:
    """Copy the buffer at ``buffers[i]`` into object ``i``'s regions, in order."""
    _copy(buffers, objects, into_regions=True)


def _copy(buffers: Sequence[int], objects: Sequence[ObjectRef], *, into_regions: bool) -> None:
    if len(buffers) != len(objects):
        raise ValueError(f"{len(buffers)} buffers for {len(objects)} objects")
    starts = np.asarray(buffers, dtype=np.int64)
    if isinstance(objects, ObjectBatch):
        copy_rows(starts, objects.addrs, np.asarray(objects.sizes), into_regions=into_regions)
        return
    addrs: list[int] = []
    sizes: list[int] = []
    for obj in objects:
        if len(obj.addrs) != len(obj.sizes) or sum(obj.sizes) != obj.nbytes or min(obj.sizes, default=0) < 0:
            raise ValueError(
                f"object {obj.key!r}: {len(obj.addrs)} addresses, sizes {list(obj.sizes)} and "
                f"nbytes {obj.nbytes} do not agree (build it with ObjectRef.of)"
            )
        addrs.extend(obj.addrs)
        sizes.extend(obj.sizes)
    counts = np.fromiter((len(obj.sizes) for obj in objects), dtype=np.int64, count=len(objects))
    copy_ragged(starts, counts, np.asarray(addrs), np.asarray(sizes), into_regions=into_regions)
