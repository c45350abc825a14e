"""The per-request stages between hashes and backend calls.

``resolve_hashes`` (hash) -> ``KeyScope``/``block_keys`` (key) -> ``ObjectRef`` from the layout
(address) -> ``run_batches`` (put/get). ``run_batches`` splits a request's objects into backend-sized
batches and runs them concurrently in a task group, holding a byte budget so that the bytes in
backend calls at once stay bounded. A batch whose call raises gets the failure result for each of
its keys; nothing is dropped and no error escapes as an exception.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
import attrs

from kvflow.backends.base import ObjectRef
from kvflow.errors import BackendError, BackendUnavailableError, KVFlowError, RequestError
from kvflow.keys import hash_blocks

__all__ = ["ByteBudget", "is_programming_error", "resolve_hashes", "run_batches"]

log = logging.getLogger(__name__)

R = TypeVar("R")


def resolve_hashes(
    block_size: int,
    tokens: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
) -> list[bytes]:
    """The request's block hashes: given ones as they are, or computed from ``tokens``.

    When both are given they must agree in count (one hash per full block of tokens).
    """
    if block_hashes is None:
        if tokens is None:
            raise RequestError("pass tokens or block_hashes")
        return hash_blocks(tokens, block_size)
    hashes = list(block_hashes)
    for h in hashes:
        if not isinstance(h, bytes) or not h:
            raise RequestError(f"block hashes must be non-empty bytes, got {h!r}")
    if tokens is not None and len(tokens) // block_size != len(hashes):
        raise RequestError(
            f"{len(hashes)} block hashes but {len(tokens)} tokens make "
            f"{len(tokens) // block_size} full blocks of {block_size}"
        )
    return hashes


@attrs.define
class ByteBudget:
    """At most ``limit`` bytes held at once; a request larger than the limit waits for all of it."""

    limit: int
    _held: int = 0
    _changed: anyio.Event = attrs.field(factory=anyio.Event)

    async def acquire(self, nbytes: int) -> int:
        need = min(nbytes, self.limit)
        while self._held + need > self.limit:
            changed = self._changed
            await changed.wait()
        self._held += need
        return need

    def release(self, held: int) -> None:
        self._held -= held
        self._changed.set()
        self._changed = anyio.Event()


async def run_batches(
    objects: Sequence[ObjectRef],
    call: Callable[[Sequence[ObjectRef]], Awaitable[list[R]]],
    *,
    failed: R,
    max_batch: int,
    budget: ByteBudget,
    timeout_s: float,
) -> list[R]:
    """Run ``call`` over ``objects`` in batches; one result per object, in input order.

    A batch that raises, or that has not finished within ``timeout_s``, gets ``failed`` for each of
    its objects. Returns when every batch finished or the timeout cancelled the rest.
    """
    results: list[R] = [failed] * len(objects)
    if not objects:
        return results
    size = max(1, max_batch)
    # Spread objects over batches of near-equal size so no batch is tiny.
    count = math.ceil(len(objects) / size)
    step = math.ceil(len(objects) / count)

    errors: list[Exception] = []

    async def one(start: int) -> None:
        batch = objects[start : start + step]
        held = await budget.acquire(sum(o.nbytes for o in batch))
        try:
            answers = await call(batch)
            if len(answers) != len(batch):
                raise KVFlowError(f"backend returned {len(answers)} results for {len(batch)} keys")
            results[start : start + len(batch)] = answers
        except Exception as exc:  # a backend fault becomes per-key failures
            if is_programming_error(exc):
                errors.append(exc)
            log.warning("backend call for %d objects failed: %r", len(batch), exc)
        finally:
            budget.release(held)

    with anyio.move_on_after(timeout_s) as scope:
        async with anyio.create_task_group() as tg:
            for start in range(0, len(objects), step):
                tg.start_soon(one, start)
    if scope.cancelled_caught:
        log.warning("backend calls for %d objects timed out after %.1f s", len(objects), timeout_s)
    if errors:
        raise errors[0]
    return results


def is_programming_error(exc: Exception) -> bool:
    """Errors that retrying or recomputing cannot fix: they must reach the caller."""
    if isinstance(exc, BackendUnavailableError):
        return False
    return isinstance(exc, (BackendError, RequestError, TypeError))
