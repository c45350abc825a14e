"""Batched backend calls: one result per object, in input order, faults turned into results.

``run_batches`` splits a request's objects into backend-sized batches and runs them concurrently
(:func:`~kvflow.transfer.together.together`), or one after another, the last batch first, for a
backend whose calls gain nothing from running at once (``in_turn``: its request's head is then its
most recent use, and a put that outgrows the store keeps it), holding the pool's byte budget so
that the bytes in backend calls at once stay bounded. A batch whose call raises a store fault, or
that has not finished by the deadline, gets the failure result for each of its objects; nothing is
dropped, and no call starts once the deadline has passed.
Programming errors (a misconfigured backend, a malformed request) are raised after every batch
ended.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from kvflow.backends.base import ObjectRef, cancelled_as_fault, nbytes_of
from kvflow.errors import BackendError, BackendUnavailableError, KVFlowError, RequestError
from kvflow.transfer.budget import ByteBudget
from kvflow.transfer.together import together

__all__ = ["is_programming_error", "run_batches"]

log = logging.getLogger(__name__)

R = TypeVar("R")


def is_programming_error(exc: BaseException) -> bool:
    """Errors that retrying or recomputing cannot fix: they must reach the caller."""
    if isinstance(exc, BackendUnavailableError):
        return False
    return isinstance(exc, (BackendError, RequestError, TypeError))


async def run_batches(
    objects: Sequence[ObjectRef],
    call: Callable[[Sequence[ObjectRef]], Awaitable[list[R]]],
    *,
    failed: R,
    max_batch: int,
    budget: ByteBudget,
    deadline: float,
    in_turn: bool = False,
) -> list[R]:
    """Run ``call`` over ``objects`` in batches; one result per object, in input order.

    A batch that raises, or that has not finished by ``deadline`` (``time.monotonic()`` seconds),
    gets ``failed`` for each of its objects. Returns when every batch finished or the deadline
    cancelled the rest. ``in_turn``: one batch at a time, the last first (else all at once).
    """
    results: list[R] = [failed] * len(objects)
    kind = type(failed)
    if not objects:
        return results
    if time.monotonic() >= deadline:
        # No call starts late: a store whose caller has given up must not publish the blocks,
        # which the engine may already be writing again (and a backend call that never yields
        # would run whole before any cancellation reached it).
        log.warning("backend calls for %d objects not started: their deadline passed", len(objects))
        return results
    size = max(1, max_batch)
    # Spread objects over batches of near-equal size so no batch is tiny.
    count = math.ceil(len(objects) / size)
    step = math.ceil(len(objects) / count)
    errors: list[Exception] = []

    async def one(start: int) -> None:
        batch = objects[start : start + step]  # of BlockObjects: an ObjectBatch, made now
        held = await budget.acquire(sum(nbytes_of(batch)))
        try:
            if time.monotonic() >= deadline:  # the budget came free late (the loop was held up)
                log.warning("a backend call for %d objects not started: its deadline passed", len(batch))
                return
            with cancelled_as_fault():
                answers = await call(batch)
            if len(answers) != len(batch):
                raise KVFlowError(f"backend returned {len(answers)} results for {len(batch)} keys")
            if set(map(type, answers)) != {kind}:
                wrong = next(a for a in answers if type(a) is not kind)
                raise TypeError(
                    f"the backend answered {wrong!r} for an object: its calls must return "
                    f"{kind.__name__} members, one per object (docs/api.md)"
                )
            results[start : start + len(batch)] = answers
        except Exception as exc:  # a backend fault becomes per-key failures
            if is_programming_error(exc):
                errors.append(exc)
            log.warning("backend call for %d objects failed: %r", len(batch), exc)
        finally:
            budget.release(held)

    starts = range(0, len(objects), step)
    with anyio.move_on_after(deadline - time.monotonic()) as scope:
        if in_turn:
            for start in reversed(starts):
                await one(start)
        else:
            await together([functools.partial(one, start) for start in starts])
    if scope.cancelled_caught:
        log.warning("backend calls for %d objects ran past their deadline", len(objects))
    if errors:
        raise errors[0]
    return results
