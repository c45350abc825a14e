"""Copies between scatter-gather region lists and one contiguous buffer.

All copies are plain ``memmove`` calls through ctypes, which release the GIL while they run. The
caller guarantees every address is valid for its size for the duration of the call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

__all__ = ["buffer_address", "gather", "scatter"]

_memmove = ctypes.memmove


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


def buffer_address(buf: bytearray | memoryview) -> int:
    """The address of a writable Python buffer's first byte (the buffer must outlive its use)."""
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("buffer_address needs a writable buffer")
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
