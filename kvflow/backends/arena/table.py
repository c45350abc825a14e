"""The arena table's compiled passes: the claim of a put, the look-up of a get and of a lookup.

:func:`Passes.claim` (:meth:`ArenaFile.claim`) decides, for each key of a put, under the exclusive
lock: present already (published, or being written by a live process, or earlier in the same
put), a slot to write it in, or no space. Written in Python over numpy it cost about 3.5 us per
object (0.21-0.23 ms of a 0.56-0.58 ms put of 64 objects of 64 KiB); here it is one pass of
compiled code over the table's columns. Whether the writer of a slot being written is alive needs
``/proc``, which compiled code cannot read: the caller asks :func:`Passes.foreign` for the slots
of other writers in the put's sets (almost always none), judges them, and passes the dead ones in.
The caller writes the claims themselves, in the order that keeps a killed writer's slots safe
(:meth:`ArenaFile._write_claims`).

:func:`Passes.locate` (:meth:`ArenaFile.locate`) finds, under the shared lock, the published
slot of each key of a get, checks a slot found before a pause still holds its key, and says which
hold an object of the size asked for (a use, for LRU). :func:`Passes.find` (:meth:`ArenaFile.find`,
``exists`` and ``remove``) finds each key's published slot and touches nothing.

Both read the table's columns (1-D views, one item per slot) and touch the last use of the
published objects they find. Loaded from numba's on-disk cache (:mod:`kvflow.compiled`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt

from kvflow.compiled import compile_cached

__all__ = ["NO_SPACE", "PRESENT", "REPEAT", "UNKNOWN", "Passes", "compile_passes", "passes"]

Column = npt.NDArray[np.uint64]
Rows = npt.NDArray[np.int64]

PRESENT = -1  # what :func:`Passes.claim` writes for a key present already
NO_SPACE = -2  # ... and for one whose set has no slot to give
REPEAT = -3  # ... and for a key earlier in the call (it shares that one's outcome)
UNKNOWN = -2  # a get's row not looked for yet (:func:`Passes.locate`)
_FREE, _WRITING, _READY = np.uint64(0), np.uint64(1), np.uint64(2)
_LAST = np.iinfo(np.int64).max  # the rank of a slot no claim may take
_TAG = np.uint64(0xFF)


def _foreign(
    state: Column,
    ns: Column,
    pid: Column,
    start: Column,
    sets: Rows,
    ways: int,
    me: Column,
) -> Rows:  # pragma: no cover (compiled)
    """The slots of ``sets`` being written by a writer other than ``me`` (namespace, pid, start)."""
    found = []
    for s in np.unique(sets):
        for row in range(s * ways, (s + 1) * ways):
            mine = ns[row] == me[0] and pid[row] == me[1] and start[row] == me[2]
            if state[row] == _WRITING and not mine:
                found.append(row)
    return np.array(found, dtype=np.int64)


def _claim(
    state: Column,
    ns: Column,
    pid: Column,
    start: Column,
    key0: Column,
    key1: Column,
    used: Column,
    tags: npt.NDArray[np.uint8],
    k0: Column,
    k1: Column,
    sets: Rows,
    ways: int,
    now: np.uint64,
    me: Column,
    dead: Rows,
    out: Rows,
) -> int:  # pragma: no cover (compiled)
    """For each key ``(k0[i], k1[i])`` of set ``sets[i]``: ``out[i]`` = the slot it takes, or
    PRESENT, or NO_SPACE, as :meth:`ArenaFile.claim` says; returns how many of the slots given
    held a published object (evictions). ``dead``: slots being written by writers known dead. A
    published key found is used at ``now - i``: a request's first blocks are its newest, so a
    full set evicts its last blocks first (a prefix lookup stops at the first miss)."""

    def dead_writer(row: int) -> bool:  # of a slot being written: whether its writer died
        if ns[row] == me[0] and pid[row] == me[1] and start[row] == me[2]:
            return False
        return bool(np.any(dead == row))

    n = k0.shape[0]
    # A key earlier in the call: the later ones are REPEAT (a stable sort keeps call order in runs).
    repeat = np.zeros(n, dtype=np.bool_)
    order = np.argsort(k0, kind="mergesort")
    for t in range(1, n):
        i = order[t]
        u = t - 1
        while u >= 0 and k0[order[u]] == k0[i]:
            if k1[order[u]] == k1[i]:
                repeat[i] = True
                break
            u -= 1
    # Each set's slots ranked for giving: free, a dead writer's, then by last use; never a slot of
    # a live writer.
    groups = np.unique(sets)
    group = np.searchsorted(groups, sets)
    rank = np.empty((groups.shape[0], ways), dtype=np.int64)
    for g in range(groups.shape[0]):
        for w in range(ways):
            row = groups[g] * ways + w
            if state[row] == _FREE:
                rank[g, w] = -2
            elif state[row] == _WRITING:
                rank[g, w] = -1 if dead_writer(row) else _LAST
            else:
                rank[g, w] = np.int64(used[row])
    # The slot that holds each key, in any state (the last way, if several); none of them is given.
    same = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        tag = np.uint8(k1[i] & _TAG)
        for w in range(ways):
            row = sets[i] * ways + w
            if tags[row] == tag and key0[row] == k0[i] and key1[row] == k1[i]:
                same[i] = row
                rank[group[i], w] = _LAST
    evictions = 0
    for i in range(n):
        if repeat[i]:
            out[i] = REPEAT
            continue
        row = same[i]
        if row >= 0:
            if state[row] == _READY:
                used[row] = now - np.uint64(i)
                out[i] = PRESENT
                continue
            if state[row] == _WRITING and not dead_writer(row):
                out[i] = PRESENT
                continue
        else:  # the best slot of its set: lowest rank, ties to the higher way
            g, best = group[i], -1
            for w in range(ways):
                if rank[g, w] < _LAST and (best < 0 or rank[g, w] <= rank[g, best]):
                    best = w
            if best < 0:
                out[i] = NO_SPACE
                continue
            rank[g, best] = _LAST
            row = sets[i] * ways + best
            if state[row] == _READY:
                evictions += 1
        out[i] = row
    return evictions


def _locate(
    state: Column,
    key0: Column,
    key1: Column,
    nbytes: Column,
    used: Column,
    tags: npt.NDArray[np.uint8],
    k0: Column,
    k1: Column,
    sets: Rows,
    ways: int,
    sizes: Rows,
    start: int,
    end: int,
    now: np.uint64,
    rows: Rows,
    found: npt.NDArray[np.bool_],
) -> None:  # pragma: no cover (compiled)
    """For each key ``i`` in ``[start, end)``: ``rows[i]`` = the published slot of the key, or -1
    (looked for where ``rows[i]`` is ``UNKNOWN``, or where the slot it names no longer holds the
    key, published: a put took it meanwhile); ``found[i]`` = whether that slot holds an object of
    ``sizes[i]`` bytes, whose last use becomes ``now - i`` (the get's first objects, a request's
    head, are its newest uses; a size of -1 is never found)."""
    for i in range(start, end):
        row = rows[i]
        if row >= 0 and not (state[row] == _READY and key0[row] == k0[i] and key1[row] == k1[i]):
            row = UNKNOWN
        if row == UNKNOWN:
            row = -1
            tag = np.uint8(k1[i] & _TAG)
            for r in range(sets[i] * ways, (sets[i] + 1) * ways):
                if tags[r] == tag and key0[r] == k0[i] and key1[r] == k1[i] and state[r] == _READY:
                    row = r
        rows[i] = row
        found[i] = row >= 0 and sizes[i] >= 0 and np.int64(nbytes[row]) == sizes[i]  # (-1: never)
        if found[i]:
            used[row] = now - np.uint64(i)


def _find(
    state: Column,
    key0: Column,
    key1: Column,
    tags: npt.NDArray[np.uint8],
    k0: Column,
    k1: Column,
    sets: Rows,
    ways: int,
    rows: Rows,
) -> None:  # pragma: no cover (compiled)
    """``rows[i]`` = the published slot of key ``(k0[i], k1[i])`` (the last way, if several), or -1."""
    for i in range(k0.shape[0]):
        row = -1
        tag = np.uint8(k1[i] & _TAG)
        for r in range(sets[i] * ways, (sets[i] + 1) * ways):
            if tags[r] == tag and key0[r] == k0[i] and key1[r] == k1[i] and state[r] == _READY:
                row = r
        rows[i] = row


_COLUMN = "uint64[::1]"
_FOREIGN = f"int64[::1]({', '.join([_COLUMN] * 4)}, int64[::1], int64, uint64[::1])"
_CLAIM = (
    f"int64({', '.join([_COLUMN] * 7)}, uint8[::1], {_COLUMN}, {_COLUMN}, int64[::1], int64, uint64, "
    "uint64[::1], int64[::1], int64[::1])"
)
_LOCATE = (
    f"void({', '.join([_COLUMN] * 5)}, uint8[::1], {_COLUMN}, {_COLUMN}, int64[::1], int64, int64[::1], "
    "int64, int64, uint64, int64[::1], boolean[::1])"
)

_FIND = f"void({', '.join([_COLUMN] * 3)}, uint8[::1], {_COLUMN}, {_COLUMN}, int64[::1], int64, int64[::1])"


@attrs.frozen
class Passes:
    """The compiled functions: ``foreign(state, ns, pid, start, sets, ways, me)``,
    ``claim(state, ns, pid, start, key0, key1, used, tags, k0, k1, sets, ways, now, me, dead, out)``
    ``locate(state, key0, key1, nbytes, used, tags, k0, k1, sets, ways, sizes, start, end, now,
    rows, found)`` and ``find(state, key0, key1, tags, k0, k1, sets, ways, rows)``."""

    foreign: Callable[..., Rows]
    claim: Callable[..., int]
    locate: Callable[..., None]
    find: Callable[..., None]
    cached: bool


def compile_passes(*, cache: bool = True) -> Passes:
    """The functions, loaded from numba's on-disk cache (or compiled and saved there), else compiled
    in memory."""
    return compile_cached(_compile, cache=cache)


def _compile(cache: bool) -> Passes:
    import numba  # here: its import takes half a second

    foreign = numba.njit(_FOREIGN, cache=cache)(_foreign)
    claim = numba.njit(_CLAIM, cache=cache)(_claim)
    locate = numba.njit(_LOCATE, cache=cache)(_locate)
    find = numba.njit(_FIND, cache=cache)(_find)
    return Passes(foreign, claim, locate, find, cached=cache)


@functools.cache
def passes() -> Passes:
    """The compiled functions, loaded at the first use (the arena backend loads them as it opens)."""
    return compile_passes()
