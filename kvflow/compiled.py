"""Compiling numba functions once per install: loaded from numba's on-disk cache in every later
process, compiled in memory where the cache cannot be used: no cache directory is writable (a
read-only install with no ``NUMBA_CACHE_DIR``), or reading or writing it fails (a cache file
another user made unreadable, a full filesystem). Used by :mod:`kvflow.copyloops` and
:mod:`kvflow.backends.arena.table`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

__all__ = ["compile_cached"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_warned = False  # a failing cache is logged once per process, not once per set of functions


def compile_cached(build: Callable[[bool], T], *, cache: bool = True) -> T:
    """``build(cache)``: ``build(True)`` when ``cache`` and numba's on-disk cache works, else
    ``build(False)``. ``build`` compiles its functions with ``numba.njit(..., cache=cache)``; none
    of what a failed ``build(True)`` made is used."""
    if cache:
        try:
            return build(True)
        except Exception as exc:  # the cache could not be read or written (OSError, a damaged file)
            no_place = isinstance(exc, RuntimeError) and "no locator available" in str(exc)
            if not no_place:  # (numba found no writable cache directory: the usual read-only install)
                _warn(exc)
    return build(False)


def _warn(exc: Exception) -> None:
    global _warned
    what = f"{type(exc).__name__}: {exc}"
    if _warned:
        logger.debug("numba's on-disk cache failed again (%s); compiling in memory", what)
        return
    _warned = True
    logger.warning(
        "numba's on-disk cache failed (%s); kvflow compiles its functions in memory instead, so "
        "their first use in each process is slower (seconds). Make the cache's files readable and "
        "writable by this user and leave room on its filesystem, or set NUMBA_CACHE_DIR to a "
        "directory of your own",
        what,
    )
