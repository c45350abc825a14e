"""Running a few calls at once: in a task group, or inline when there is only one.

A task group and its task cost about 50 us on this loop, as much as copying 300 KiB; most pool
calls have one unit to move (whole blocks) and nothing to run beside it, so they skip it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import anyio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["together", "unwrapped"]


async def together(calls: Sequence[Callable[[], Coroutine[Any, Any, object]]]) -> None:
    """Await every call concurrently; return when all ended. An error cancels the others and is
    raised as it is, whether the call ran inline (the only one) or in the task group, so callers
    catch the same errors either way (:func:`unwrapped`)."""
    if len(calls) == 1:
        await calls[0]()
        return
    with unwrapped():
        async with anyio.create_task_group() as tg:
            for call in calls:
                tg.start_soon(call)


@contextlib.contextmanager
def unwrapped() -> Iterator[None]:
    """Around a task group: its one error raised as it is, and so are errors of several tasks at
    once that are all of one class (one fault that several calls met, as two layers' gets of one
    store that cannot answer: the callers' ``except`` of that class must catch them as it catches
    one); errors of different classes stay an exception group."""
    try:
        yield
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        alike = all(type(exc) is type(first) for exc in group.exceptions)
        if alike and not isinstance(first, BaseExceptionGroup):  # (groups in a group: all kept)
            raise first from first.__cause__  # (its own cause kept; the group not shown as context)
        raise
