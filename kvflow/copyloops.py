"""The compiled region-copy loops behind :func:`kvflow.regions.copy_rows` and
:func:`kvflow.regions.copy_ragged`.

Imported only at their first use (numba's import costs about half a second). Everything the loops
call is defined at module level, so numba's on-disk cache recognises them in the next process and
loads them instead of compiling again. Where no cache directory is writable (a read-only install
with no ``NUMBA_CACHE_DIR``), :func:`compile_loops` compiles them in memory instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["Loops", "compile_loops"]

Addresses = npt.NDArray[np.int64]


@intrinsic  # type: ignore[untyped-decorator]
def _memmove(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """``memmove(dst, src, n)`` on raw addresses, inlined into the compiled loop."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        to, frm, size = args
        ptr = ir.IntType(8).as_pointer()
        cgutils.raw_memmove(builder, builder.inttoptr(to, ptr), builder.inttoptr(frm, ptr), size, 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


def _rows(starts: Addresses, addrs: Addresses, sizes: Addresses, into_regions: bool) -> None:
    for i in range(starts.shape[0]):  # pragma: no cover (compiled)
        at = starts[i]
        for j in range(sizes.shape[0]):
            if into_regions:
                _memmove(addrs[i, j], at, sizes[j])
            else:
                _memmove(at, addrs[i, j], sizes[j])
            at += sizes[j]


def _ragged(
    starts: Addresses, counts: Addresses, addrs: Addresses, sizes: Addresses, into_regions: bool
) -> None:
    k = 0
    for i in range(starts.shape[0]):  # pragma: no cover (compiled)
        at = starts[i]
        for _ in range(counts[i]):
            if into_regions:
                _memmove(addrs[k], at, sizes[k])
            else:
                _memmove(at, addrs[k], sizes[k])
            at += sizes[k]
            k += 1


_ROWS = "void(int64[::1], int64[:, ::1], int64[::1], boolean)"
_RAGGED = "void(int64[::1], int64[::1], int64[::1], int64[::1], boolean)"


@attrs.frozen
class Loops:
    """The compiled copy loops; each ``memmove``s between object ``i``'s buffer at ``starts[i]``
    and its regions, back to back (into the regions when ``into_regions``, else out of them)."""

    rows: Callable[[Addresses, Addresses, Addresses, bool], None]  # regions addrs[i, :], of sizes
    ragged: Callable[[Addresses, Addresses, Addresses, Addresses, bool], None]  # counts[i] regions each
    cached: bool  # whether they came from, or went to, numba's on-disk cache


def compile_loops(*, cache: bool = True) -> Loops:
    """The loops, compiled without the GIL: loaded from numba's on-disk cache (or compiled and
    saved there) when ``cache`` and a cache directory is writable, else compiled in memory."""
    if cache:
        try:
            return _compile(cache=True)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            if "no locator available" not in str(exc):
                raise
    return _compile(cache=False)


def _compile(*, cache: bool) -> Loops:
    rows = numba.njit(_ROWS, nogil=True, cache=cache)(_rows)
    ragged = numba.njit(_RAGGED, nogil=True, cache=cache)(_ragged)
    return Loops(rows, ragged, cached=cache)
