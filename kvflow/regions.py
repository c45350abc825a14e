"""Copies between scatter-gather region lists and contiguous buffers.

:func:`gather` and :func:`scatter` copy one object with a ``memmove`` per region through ctypes.
:func:`copy_rows` and :func:`copy_ragged` copy many objects' regions in one call of a compiled
loop (numba, :mod:`kvflow.copyloops`, compiled once and cached on disk), which pays no Python per
region: at the sizes of one block's layer (8-64 KiB regions) the ctypes call per region cost as
much as the copy (:mod:`kvflow.backends.copies` feeds them a backend call's objects). Every copy
releases the GIL while it runs. The caller guarantees every address is valid for its size for
the duration of the call."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvflow.copyloops import Loops

__all__ = ["buffer_address", "copy_ragged", "copy_rows", "gather", "scatter", "warm"]

_memmove = ctypes.memmove

Addresses = npt.NDArray[np.int64]


def gather(dst: int, addrs: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy the regions ``(addrs[i], sizes[i])`` back to back into memory starting at ``dst``."""
    offset = dst
    for addr, size in zip(addrs, sizes):
        _memmove(offset, addr, size)
        offset += size


def scatter(src: int, addrs: Sequence[int], sizes: Sequence[int]) -> None:
    """Copy memory starting at ``src`` into the regions ``(addrs[i], sizes[i])``, in order."""
    offset = src
    for addr, size in zip(addrs, sizes):
        _memmove(addr, offset, size)
        offset += size


def copy_rows(
    starts: Addresses, addrs: Addresses, sizes: Addresses, *, into_regions: bool, stream: bool = False
) -> None:
    """For each ``i``, copy between the buffer at ``starts[i]`` and the regions at ``addrs[i, :]``
    of the sizes ``sizes`` (one per column), back to back in the buffer: into the regions when
    ``into_regions``, else out of them; the destination written with streaming stores when
    ``stream`` (:mod:`kvflow.copyloops`). One compiled loop, without the GIL; buffers and regions
    must not overlap."""
    if addrs.shape != (len(starts), len(sizes)):
        raise ValueError(
            f"region addresses of shape {addrs.shape} for {len(starts)} buffers of {len(sizes)} regions"
        )
    _kernels().rows(
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(addrs, dtype=np.int64),
        np.ascontiguousarray(sizes, dtype=np.int64),
        into_regions,
        stream,
    )


def copy_ragged(
    starts: Addresses,
    counts: Addresses,
    addrs: Addresses,
    sizes: Addresses,
    *,
    into_regions: bool,
    stream: bool = False,
) -> None:
    """:func:`copy_rows` for rows of different lengths: buffer ``i`` goes with the next
    ``counts[i]`` regions of ``addrs`` and ``sizes`` (flat, every row's in turn)."""
    if len(counts) != len(starts) or not len(addrs) == len(sizes) == int(counts.sum()):
        raise ValueError(
            f"{len(starts)} buffers with {len(counts)} region counts (of {int(counts.sum())} regions) "
            f"for {len(addrs)} addresses and {len(sizes)} sizes"
        )
    _kernels().ragged(
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(counts, dtype=np.int64),
        np.ascontiguousarray(addrs, dtype=np.int64),
        np.ascontiguousarray(sizes, dtype=np.int64),
        into_regions,
        stream,
    )


@functools.cache
def _kernels() -> Loops:
    """The compiled copy loops (numba is imported, and the loops loaded from its on-disk cache or
    compiled, at the first use: :func:`warm` does it ahead of time)."""
    from kvflow.copyloops import compile_loops

    return compile_loops()


def warm() -> None:
    """Import and load (or compile) the copy loops now, and call them once on nothing, so that the
    first copy does not pay it in the middle of a transfer (the memory and arena backends call it
    as they open). numba's first call of any compiled function in a process takes about 10 ms."""
    loops, none = _kernels(), np.zeros(0, dtype=np.int64)
    loops.rows(none, none.reshape(0, 0), none, False, False)
    loops.ragged(none, none, none, none, False, False)


def buffer_address(buf: bytearray | memoryview) -> int:
    """The address of a writable Python buffer's first byte (the buffer must outlive its use)."""
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("buffer_address needs a writable buffer")
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
