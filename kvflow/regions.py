"""Copies between scatter-gather region lists and contiguous buffers.

:func:`gather` and :func:`scatter` copy one object with a ``memmove`` per region through ctypes.
:func:`copy_rows` and :func:`copy_ragged` copy many objects' regions in one call of a compiled
loop (numba, compiled once and cached on disk), which pays no Python per region: at the sizes of
one block's layer (8-64 KiB regions) the ctypes call per region cost as much as the copy
(:mod:`kvflow.backends.copies` feeds them a backend call's objects). Every copy releases the GIL
while it runs. The caller guarantees every address is valid for its size
for the duration of the call.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["buffer_address", "copy_ragged", "copy_rows", "gather", "scatter"]

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


def copy_rows(starts: Addresses, addrs: Addresses, sizes: Addresses, *, into_regions: bool) -> None:
    """For each ``i``, copy between the buffer at ``starts[i]`` and the regions at ``addrs[i, :]``
    of the sizes ``sizes`` (one per column), back to back in the buffer: into the regions when
    ``into_regions``, else out of them. One compiled loop, without the GIL."""
    if addrs.shape != (len(starts), len(sizes)):
        raise ValueError(
            f"region addresses of shape {addrs.shape} for {len(starts)} buffers of {len(sizes)} regions"
        )
    _kernels().rows(
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(addrs, dtype=np.int64),
        np.ascontiguousarray(sizes, dtype=np.int64),
        into_regions,
    )


def copy_ragged(
    starts: Addresses, counts: Addresses, addrs: Addresses, sizes: Addresses, *, into_regions: bool
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
    )


@attrs.frozen
class _Kernels:
    """The compiled copy loops; each ``memmove``s between object ``i``'s buffer at ``starts[i]``
    and its regions, back to back (into the regions when ``into_regions``, else out of them)."""

    rows: Callable[[Addresses, Addresses, Addresses, bool], None]  # regions addrs[i, :], of sizes
    ragged: Callable[[Addresses, Addresses, Addresses, Addresses, bool], None]  # counts[i] regions each


@functools.cache
def _kernels() -> _Kernels:
    """The copy loops, compiled without the GIL (numba is imported, and the loops loaded from its
    cache or compiled, at the first use)."""
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic  # type: ignore[untyped-decorator]
    def memmove(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            to, frm, size = args
            ptr = ir.IntType(8).as_pointer()
            cgutils.raw_memmove(builder, builder.inttoptr(to, ptr), builder.inttoptr(frm, ptr), size, 1)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64), codegen

    @numba.njit(  # type: ignore[untyped-decorator]
        "void(int64[::1], int64[:, ::1], int64[::1], boolean)", nogil=True, cache=True
    )
    def rows(starts: Addresses, addrs: Addresses, sizes: Addresses, into_regions: bool) -> None:
        for i in range(starts.shape[0]):  # pragma: no cover (compiled)
            at = starts[i]
            for j in range(sizes.shape[0]):
                if into_regions:
                    memmove(addrs[i, j], at, sizes[j])
                else:
                    memmove(at, addrs[i, j], sizes[j])
                at += sizes[j]

    @numba.njit(  # type: ignore[untyped-decorator]
        "void(int64[::1], int64[::1], int64[::1], int64[::1], boolean)", nogil=True, cache=True
    )
    def ragged(
        starts: Addresses, counts: Addresses, addrs: Addresses, sizes: Addresses, into_regions: bool
    ) -> None:
        k = 0
        for i in range(starts.shape[0]):  # pragma: no cover (compiled)
            at = starts[i]
            for _ in range(counts[i]):
                if into_regions:
                    memmove(addrs[k], at, sizes[k])
                else:
                    memmove(at, addrs[k], sizes[k])
                at += sizes[k]
                k += 1

    return _Kernels(rows, ragged)


def buffer_address(buf: bytearray | memoryview) -> int:
    """The address of a writable Python buffer's first byte (the buffer must outlive its use)."""
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("buffer_address needs a writable buffer")
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
