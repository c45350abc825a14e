"""One chunk of a put or get: the blocking Mooncake calls, and what their return codes mean.

``put_chunk`` and ``get_chunk`` run in a worker thread (they block; Mooncake releases the GIL).
``put_results`` and ``get_results`` run on the event loop and turn codes into per-key statuses:

=========================  =================================  =====================================
code                       put                                get
=========================  =================================  =====================================
``>= 0``                   ``STORED`` (0)                     ``HIT`` when it equals the size
key already there          ``PRESENT`` (checked first)        --
-704 OBJECT_NOT_FOUND      --                                 ``MISS``
-200 NO_SPACE              ``NO_SPACE``                       --
-600 INVALID_PARAMS        raise ``BackendError``             raise ``BackendError`` (size mismatch)
-800 TRANSFER_FAIL         ``FAILED``                         ``FAILED``, or raise if the stored
                                                              object has another size (sizes are
                                                              asked until one cannot be told; a
                                                              -900/-901 then counts for the key)
-900 RPC_FAIL, -901        ``FAILED``, master marked down     ``FAILED``, master marked down
other negative             ``FAILED``                         ``FAILED``
=========================  =================================  =====================================
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.mooncake.native import (
    INVALID_PARAMS,
    MASTER_DOWN,
    NO_SPACE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    NativeStore,
    code_name,
)
from kvflow.backends.mooncake.staging import Chunk
from kvflow.errors import BackendError

__all__ = ["check_objects", "dedupe", "get_chunk", "get_results", "put_chunk", "put_results"]

PRESENT = 1  # in a put chunk's outcome: the key existed, nothing was written


def check_objects(objects: Sequence[ObjectRef]) -> None:
    """Mooncake rejects empty keys and empty objects; say so before calling it."""
    for obj in objects:
        if obj.nbytes <= 0 or not obj.key:
            raise BackendError(
                f"Mooncake cannot hold the object {obj.key!r} of {obj.nbytes} bytes: keys must be "
                "non-empty and objects at least one byte"
            )


def dedupe(objects: Sequence[ObjectRef]) -> tuple[list[int], list[tuple[int, int]]]:
    """Indices of first occurrences of each key, and ``(index, first index)`` of repeats."""
    first: dict[str, int] = {}
    repeats: list[tuple[int, int]] = []
    for i, obj in enumerate(objects):
        j = first.setdefault(obj.key, i)
        if j != i:
            repeats.append((i, j))
    return list(first.values()), repeats


def distinct_rounds(objects: Sequence[ObjectRef]) -> list[list[int]]:
    """Indices of ``objects`` in rounds whose keys are distinct: round ``n`` holds the ``n``-th
    occurrence of each key. Mooncake's batch get given a key twice reports both copies arrived but
    fills only one (measured: ``tests/backends/test_mooncake.py``), so a get runs round by round;
    almost always there is one round, every object."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for i, obj in enumerate(objects):
        n = seen.get(obj.key, 0)
        seen[obj.key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    return rounds


# -- worker thread ------------------------------------------------------------------------------


def put_chunk(
    store: NativeStore, objects: Sequence[ObjectRef], chunk: Chunk, replicate: object, *, check: bool
) -> list[int]:
    """Skip keys that exist (if ``check``), copy staged objects into staging, put the rest.
    One code per key."""
    if not check:
        if chunk.staged:
            chunk.gather_staged(objects)
        return store.batch_put_from_multi_buffers(chunk.keys, chunk.addrs, chunk.sizes, replicate)
    exist = store.batch_is_exist(chunk.keys)
    failure = next((c for c in exist if c < 0), None)
    if failure is not None:  # nothing is put: a key answered absent (0) must not read as stored
        return [c if c < 0 else failure for c in exist]
    todo = [p for p, c in enumerate(exist) if c == 0]
    outcome = [PRESENT] * len(exist)
    if todo:
        if chunk.staged:
            chunk.gather_staged(objects, only=[c == 0 for c in exist])
        codes = store.batch_put_from_multi_buffers(
            [chunk.keys[p] for p in todo],
            [chunk.addrs[p] for p in todo],
            [chunk.sizes[p] for p in todo],
            replicate,
        )
        for p, code in zip(todo, codes):
            outcome[p] = code
    return outcome


def get_chunk(
    store: NativeStore, objects: Sequence[ObjectRef], chunk: Chunk
) -> tuple[list[int], dict[int, int]]:
    """Get into the regions (or staging) and copy staged hits out. Also returns the stored size of
    objects whose size differs from their regions (position in chunk -> size).

    Sizes are asked one key at a time, so they stop at the first the master cannot tell: each such
    answer may take about 4.3 s (the master gone), inside a call that cannot be abandoned. A key
    whose size could not be told because the master is down gets that code (-900/-901), which
    marks the master down; the keys after it stay ``TRANSFER_FAIL``."""
    codes = store.batch_get_into_multi_buffers(chunk.keys, chunk.addrs, chunk.sizes)
    expected = [objects[i].nbytes for i in chunk.indices]
    if chunk.staged:
        chunk.scatter_staged(objects, [c == n for c, n in zip(codes, expected)])
    mismatched: dict[int, int] = {}
    for p, code in enumerate(codes):
        if code == TRANSFER_FAIL:  # also Mooncake's answer when the regions are larger than the object
            size = store.get_size(chunk.keys[p])
            if size < 0:
                if size in MASTER_DOWN:
                    codes[p] = size
                break
            if size != expected[p]:
                mismatched[p] = size
    return codes, mismatched


# -- event loop ---------------------------------------------------------------------------------


def put_results(
    objects: Sequence[ObjectRef], chunk: Chunk, outcome: list[int], out: list[PutStatus]
) -> list[int]:
    """Write each key's status into ``out``; return the codes of the failed keys."""
    failed: list[int] = []
    for i, code in zip(chunk.indices, outcome):
        if code == 0:
            out[i] = PutStatus.STORED
        elif code == PRESENT:
            out[i] = PutStatus.PRESENT
        elif code == NO_SPACE:
            out[i] = PutStatus.NO_SPACE
        elif code == INVALID_PARAMS:
            obj = objects[i]
            raise BackendError(
                f"Mooncake rejected the put of {obj.key!r} ({obj.nbytes} bytes in regions of sizes "
                f"{list(obj.sizes)}) as {code_name(code)}: check the key and the region sizes"
            )
        else:
            out[i] = PutStatus.FAILED
            failed.append(code)
    return failed


def get_results(
    objects: Sequence[ObjectRef],
    chunk: Chunk,
    outcome: tuple[list[int], dict[int, int]],
    out: list[GetStatus],
) -> list[int]:
    """Write each key's status into ``out``; return the codes of the failed keys."""
    codes, mismatched = outcome
    failed: list[int] = []
    for p, (i, code) in enumerate(zip(chunk.indices, codes)):
        obj = objects[i]
        if code == obj.nbytes:
            out[i] = GetStatus.HIT
        elif code == OBJECT_NOT_FOUND:
            out[i] = GetStatus.MISS
        elif code == INVALID_PARAMS or p in mismatched:
            size = f"has {mismatched[p]} bytes" if p in mismatched else f"holds more than {obj.nbytes} bytes"
            raise BackendError(
                f"the object {obj.key!r} in Mooncake {size}, but the get gave regions of {obj.nbytes} "
                f"bytes (sizes {list(obj.sizes)}): it was stored with another layout; keys must "
                "name the KV's meaning and byte order"
            )
        else:
            out[i] = GetStatus.FAILED
            failed.append(code)
    return failed
