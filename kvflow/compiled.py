"""Compiling numba functions once per install: loaded from numba's on-disk cache in every later
process, compiled in memory where no cache directory is writable (a read-only install with no
``NUMBA_CACHE_DIR``). Used by :mod:`kvflow.copyloops` and :mod:`kvflow.backends.arena.table`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["compile_cached"]

T = TypeVar("T")


def compile_cached(build: Callable[[bool], T], *, cache: bool = True) -> T:
    """``build(cache)``: ``build(True)`` when ``cache`` and numba finds a place for its cache, else
    ``build(False)``. ``build`` compiles its functions with ``numba.njit(..., cache=cache)``."""
    if cache:
        try:
            return build(True)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            if "no locator available" not in str(exc):
                raise
    return build(False)
