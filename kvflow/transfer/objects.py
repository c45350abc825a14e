"""The objects of many engine blocks, made a batch at a time, by column.

A request of 100k blocks would otherwise build 100k :class:`ObjectRef`s (and their address lists)
before the first backend call, and hold them all until the last one returns. Objects that live that
long outlast the garbage collector's young generations, and enough of them make it scan the whole
heap, again and again (measured with ``kvflow bench``: half of the pipeline's cost per block).
:class:`BlockObjects` is the same sequence made lazily: :func:`kvflow.transfer.batches.run_batches`
slices it once per batch, and each slice is an :class:`ObjectBatch` (keys and one array of
addresses, no object per block) that lives only through its backend call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import attrs

from kvflow.backends.base import ObjectBatch, ObjectRef
from kvflow.layout import KVLayout

__all__ = ["BlockObjects"]


@attrs.frozen
class BlockObjects(Sequence[ObjectRef]):
    """``keys[i]`` holds ``layer`` (None: every layer) of engine block ``block_ids[i]``."""

    layout: KVLayout
    keys: Sequence[str]
    block_ids: Sequence[int]
    layer: int | None
    _sizes: list[int] = attrs.field(init=False)
    _nbytes: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise ValueError(f"{len(self.keys)} keys for {len(self.block_ids)} blocks")
        sizes = self.layout.unit_sizes(self.layer)
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_nbytes", sum(sizes))

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, index: int) -> ObjectRef: ...

    @overload
    def __getitem__(self, index: slice) -> ObjectBatch: ...

    def __getitem__(self, index: int | slice) -> ObjectRef | ObjectBatch:
        if isinstance(index, slice):
            return self._batch(self.keys[index], self.block_ids[index])
        return self._batch([self.keys[index]], [self.block_ids[index]])[0]

    def __iter__(self) -> Iterator[ObjectRef]:
        return iter(self[:])

    def _batch(self, keys: Sequence[str], block_ids: Sequence[int]) -> ObjectBatch:
        return ObjectBatch(keys, self.layout.addr_rows(block_ids, self.layer), self._sizes, self._nbytes)
