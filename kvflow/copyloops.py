"""The compiled region-copy loops behind :func:`kvflow.regions.copy_rows` and
:func:`kvflow.regions.copy_ragged`.

Imported only at their first use (numba's import costs about half a second). Everything the loops
call is defined at module level, so numba's on-disk cache recognises them in the next process and
loads them instead of compiling again. Where no cache directory is writable (a read-only install
with no ``NUMBA_CACHE_DIR``), :func:`compile_loops` compiles them in memory instead.

A copy may *stream* (on x86-64), in either direction: the body of each destination region is
written with non-temporal stores, which skip the read of every destination line that an ordinary
store makes first. Into slots spread over a large arena that copy runs at about 1.5x ``memmove``
on the first VM of docs/benchmarks.md; out of them into an engine's cache, 1.2-1.5x on the second,
whose next read of what was loaded took as long either way. A streaming call ends with a store
fence, so what it wrote is visible to other cores before anything the caller writes after it (a
published table row, a load's completion).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import attrs
import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvflow.compiled import compile_cached

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


STREAMS = platform.machine().lower() in ("x86_64", "amd64")  # non-temporal stores are used here
_VECTOR = 32  # bytes of one vector store; the streamed body starts at a multiple of it
_STEP = 128  # bytes per step of the streaming loop: four vector stores


@intrinsic  # type: ignore[untyped-decorator]
def _stream(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """``memmove(dst, src, n)`` for regions that do not overlap, the destination written with
    non-temporal stores: up to the first ``_VECTOR``-aligned byte and the last partial step by
    ``memmove``, the steps between by vector loads and non-temporal vector stores. Where
    :data:`STREAMS` is false, ``memmove``."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        to, frm, size = args
        i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()

        def move(offset: Any, length: Any) -> None:
            cgutils.raw_memmove(
                builder,
                builder.inttoptr(builder.add(to, offset), ptr),
                builder.inttoptr(builder.add(frm, offset), ptr),
                length,
                1,
            )

        if not STREAMS:
            move(ir.Constant(i64, 0), size)
            return context.get_dummy_value()
        head = builder.and_(builder.neg(to), ir.Constant(i64, _VECTOR - 1))
        head = builder.select(builder.icmp_signed("<", head, size), head, size)
        end = builder.add(head, builder.and_(builder.sub(size, head), ir.Constant(i64, -_STEP)))
        vector = ir.VectorType(i64, _VECTOR // 8).as_pointer()
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        move(ir.Constant(i64, 0), head)
        with cgutils.for_range_slice(builder, head, end, ir.Constant(i64, _STEP)) as (at, _):
            for part in range(0, _STEP, _VECTOR):
                offset = builder.add(at, ir.Constant(i64, part))
                value = builder.load(builder.inttoptr(builder.add(frm, offset), vector), align=1)
                target = builder.inttoptr(builder.add(to, offset), vector)
                stored = builder.store(value, target, align=_VECTOR)
                stored.set_metadata("nontemporal", nontemporal)
        move(end, builder.sub(size, end))
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic  # type: ignore[untyped-decorator]
def _fence(typingctx: Any) -> Any:
    """A store fence after streaming stores (``sfence``): they are ordered with later stores only
    through it. Nothing where :data:`STREAMS` is false."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if STREAMS:
            sfence = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, sfence, "llvm.x86.sse.sfence"), [])
        return context.get_dummy_value()

    return types.void(), codegen


def _rows(starts: Addresses, addrs: Addresses, sizes: Addresses, into_regions: bool, stream: bool) -> None:
    for i in range(starts.shape[0]):  # pragma: no cover (compiled)
        at = starts[i]
        for j in range(sizes.shape[0]):
            if into_regions and stream:
                _stream(addrs[i, j], at, sizes[j])
            elif into_regions:
                _memmove(addrs[i, j], at, sizes[j])
            elif stream:
                _stream(at, addrs[i, j], sizes[j])
            else:
                _memmove(at, addrs[i, j], sizes[j])
            at += sizes[j]
    if stream:  # pragma: no cover (compiled)
        _fence()


def _ragged(
    starts: Addresses, counts: Addresses, addrs: Addresses, sizes: Addresses, into_regions: bool, stream: bool
) -> None:
    k = 0
    for i in range(starts.shape[0]):  # pragma: no cover (compiled)
        at = starts[i]
        for _ in range(counts[i]):
            if into_regions and stream:
                _stream(addrs[k], at, sizes[k])
            elif into_regions:
                _memmove(addrs[k], at, sizes[k])
            elif stream:
                _stream(at, addrs[k], sizes[k])
            else:
                _memmove(at, addrs[k], sizes[k])
            at += sizes[k]
            k += 1
    if stream:  # pragma: no cover (compiled)
        _fence()


_ROWS = "void(int64[::1], int64[:, ::1], int64[::1], boolean, boolean)"
_RAGGED = "void(int64[::1], int64[::1], int64[::1], int64[::1], boolean, boolean)"


@attrs.frozen
class Loops:
    """The compiled copy loops; each ``memmove``s between object ``i``'s buffer at ``starts[i]``
    and its regions, back to back (into the regions when ``into_regions``, else out of them), the
    destination written with streaming stores when ``stream``."""

    rows: Callable[[Addresses, Addresses, Addresses, bool, bool], None]  # regions addrs[i, :], of sizes
    ragged: Callable[[Addresses, Addresses, Addresses, Addresses, bool, bool], None]  # counts[i] regions each
    cached: bool  # whether they came from, or went to, numba's on-disk cache


def compile_loops(*, cache: bool = True) -> Loops:
    """The loops, compiled without the GIL: loaded from numba's on-disk cache (or compiled and
    saved there) when ``cache`` and a cache directory is writable, else compiled in memory."""
    return compile_cached(_compile, cache=cache)


def _compile(cache: bool) -> Loops:
    rows = numba.njit(_ROWS, nogil=True, cache=cache)(_rows)
    ragged = numba.njit(_RAGGED, nogil=True, cache=cache)(_ragged)
    return Loops(rows, ragged, cached=cache)
