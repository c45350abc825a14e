"""A backend's lifetime: a close waits for copies, and what calls use is released after the last."""

from __future__ import annotations

import gc
import os
import weakref

import anyio
import pytest

from kvflow.backends.inflight import InFlight, Lifetime
from kvflow.errors import BackendError, PoolClosedError


async def test_close_waits_for_copies_and_releases_after_the_last_call() -> None:
    released: list[str] = []
    life = Lifetime("closed; open a new one", release=lambda: released.append("released"))
    copy_may_end, other_may_end = anyio.Event(), anyio.Event()
    closed_at: list[int] = []

    async def copy() -> None:
        with life.call(copies=True):
            await copy_may_end.wait()

    async def other() -> None:  # a remove waiting for a lock, say: close does not wait for it
        with life.call():
            await other_may_end.wait()
            released.append("other ended")

    async def close() -> None:
        await life.close()
        closed_at.append(len(released))

    async with anyio.create_task_group() as tg:
        tg.start_soon(copy)
        tg.start_soon(other)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(close)
        await anyio.wait_all_tasks_blocked()
        assert not closed_at  # the copy still runs
        with pytest.raises(PoolClosedError, match="open a new one"), life.call():
            pass
        copy_may_end.set()
        await anyio.wait_all_tasks_blocked()
        assert closed_at == [0] and not released  # closed; the other call still uses the resource
        other_may_end.set()
    assert released == ["other ended", "released"]
    await life.close()  # a second close: nothing released twice
    assert released == ["other ended", "released"]


async def test_a_cancelled_close_still_waits_for_the_copy() -> None:
    life = Lifetime("closed")
    may_end = anyio.Event()
    order: list[str] = []

    async def copy() -> None:
        with life.call(copies=True):
            await may_end.wait()
            order.append("copy ended")

    async with anyio.create_task_group() as tg:
        tg.start_soon(copy)
        await anyio.wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            scope.cancel()
            tg.start_soon(lambda: _set_later(may_end))
            await life.close()
            order.append("close returned")
    assert order == ["copy ended", "close returned"]


async def _set_later(event: anyio.Event) -> None:
    await anyio.sleep(0.01)
    event.set()


async def test_close_waits_for_the_last_of_several_copies_whatever_ran_before() -> None:
    """Copies that came and went before the close leave nothing behind that could end its wait
    early, and of two copies running the first to end does not end it either."""
    life = Lifetime("closed")
    for _ in range(3):  # calls that came and went: the count fell to nought between them
        with life.call(copies=True):
            pass
    first_may_end, second_may_end = anyio.Event(), anyio.Event()
    closed: list[bool] = []

    async def copy(may_end: anyio.Event) -> None:
        with life.call(copies=True):
            await may_end.wait()

    async def close() -> None:
        await life.close()
        closed.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(copy, first_may_end)
        tg.start_soon(copy, second_may_end)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(close)
        tg.start_soon(close)  # a second close waits alike
        await anyio.wait_all_tasks_blocked()
        first_may_end.set()
        await anyio.wait_all_tasks_blocked()
        assert not closed  # the second copy still runs
        second_may_end.set()
    assert closed == [True, True]


async def test_a_drain_after_an_earlier_one_waits_for_the_calls_running_then() -> None:
    """The event an earlier drain waited on is spent: a later drain, while a new call runs, waits
    for that call instead of returning at once."""
    flight = InFlight()
    drained: list[int] = []

    async def drain(tag: int) -> None:
        await flight.drained()
        drained.append(tag)

    async with anyio.create_task_group() as tg:
        flight.enter()
        tg.start_soon(drain, 1)
        await anyio.wait_all_tasks_blocked()
        flight.leave()
        await anyio.wait_all_tasks_blocked()
        assert drained == [1]
        flight.enter()
        tg.start_soon(drain, 2)
        await anyio.wait_all_tasks_blocked()
        assert drained == [1]  # the second call still runs
        flight.leave()
    assert drained == [1, 2]


def test_a_lifetime_dropped_unclosed_is_freed_at_once() -> None:
    """Nothing a call leaves behind refers back to the lifetime: a backend dropped without its
    close frees what its release frees (an arena's mapping, a store's descriptors) at once, not
    when the garbage collector next runs."""
    life = Lifetime("closed")
    with life.call(copies=True), life.call():
        pass
    gone = weakref.ref(life)
    collecting = gc.isenabled()
    gc.disable()
    try:
        del life
        assert gone() is None
    finally:
        if collecting:
            gc.enable()


async def test_a_forked_childs_copy_refuses_calls_and_closes_at_once_releasing_nothing() -> None:
    """In a child forked from the process that opened a shared store's backend, every call is
    refused (it would write the store as its parent), and a close returns at once: the calls it
    counts may be its parent's, whose tasks the child has not, and what they use is not released
    under them (tasks forked along from the loop may still run)."""
    released: list[bool] = []
    life = Lifetime(
        "closed", release=lambda: released.append(True), owner=os.getpid() + 1
    )  # (as a child sees it)
    assert life.forked
    with pytest.raises(BackendError, match="forked"), life.call():
        pass
    life.copies.enter()  # a parent's put in flight at the fork
    closed = anyio.Event()

    async def close() -> None:
        await life.close()
        closed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
        with anyio.move_on_after(1):
            await closed.wait()
        returned = closed.is_set()
        if not returned:  # (a close waiting for the parent's call, shielded: let it end)
            life.copies.leave()
    assert returned, "a forked child's close waited for a call its parent was making"
    assert life.closed and released == []
    mine = Lifetime("closed", owner=os.getpid())
    assert not mine.forked
    with mine.call():  # (the opener's own calls run)
        pass
