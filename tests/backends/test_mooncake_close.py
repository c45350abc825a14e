"""Closing a Mooncake backend while its puts and gets run: ``aclose`` returns only once none does.

Registered memory may be freed once ``aclose`` returns (docs/mooncake.md), so a put still reading
it, or a get still writing it, after that would publish bytes the engine wrote since or write
into memory that is no longer the caller's. A peer that stalls (SIGSTOP: a storage node that stops
answering, not one that dies) keeps Mooncake's calls running for up to about 30 s; here the peer
resumes once ``aclose`` has waited well past ``close_timeout``.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio
import pytest

from kvflow.backends.base import PutStatus
from kvflow.backends.mooncake import MooncakeBackend
from kvflow.errors import PoolClosedError
from kvflow.tools.mooncake_master import start_segment_holder
from tests.backends.conftest import MasterFactory
from tests.backends.test_mooncake import Slab, contiguous

SIZE = 1 << 20
CLOSE_TIMEOUT_S = 0.5
RESUME_AFTER_S = 3.0  # the peer resumes this long after aclose began: six close timeouts
#: how long after the call is counted the closes begin: its worker thread has started the Mooncake
#: call by then (a call whose thread had not, when aclose began, would be refused: not this test)
IN_MOONCAKE_S = 0.5


async def close_while_running(
    backend: MooncakeBackend, call: Callable[[], Awaitable[object]], holder_pid: int
) -> tuple[float, list[float], bool]:
    """Run ``call`` with the peer stopped; close the backend twice while it runs; resume the peer
    ``RESUME_AFTER_S`` later. Returns when the call ended and when each ``aclose`` returned
    (``time.monotonic()``), and whether one had returned before the peer resumed."""
    ended: list[float] = []
    closed: list[float] = []  # when each of two closes returned

    async def run() -> None:
        await call()
        ended.append(time.monotonic())

    async def close(after_s: float) -> None:
        # Once the call is in Mooncake, waiting for the peer. (A fixed delay raced a loop slowed by
        # a busy machine: the close began first, so the call was refused and never started.)
        while not backend._copies.count:
            await anyio.sleep(0.01)
        await anyio.sleep(IN_MOONCAKE_S + after_s)
        await backend.aclose()
        closed.append(time.monotonic())

    os.kill(holder_pid, signal.SIGSTOP)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                tg.start_soon(close, 0.0)
                tg.start_soon(close, 0.3)
                while not backend._copies.count:
                    await anyio.sleep(0.01)
                await anyio.sleep(RESUME_AFTER_S)
                closed_before_resume = bool(closed)
                os.kill(holder_pid, signal.SIGCONT)
    finally:
        os.kill(holder_pid, signal.SIGCONT)
    return ended[0], closed, closed_before_resume


@pytest.mark.mooncake
@pytest.mark.parametrize("op", ["get", "put"])
async def test_aclose_returns_only_once_no_put_or_get_touches_caller_memory(
    mooncake_master_factory: MasterFactory, op: str
) -> None:
    master = mooncake_master_factory()
    with start_segment_holder(master.address, segment="64MB") as holder:  # every object lives there
        backend = MooncakeBackend.from_url(master.url(segment="0", close_timeout=CLOSE_TIMEOUT_S))
        src = Slab(SIZE, seed=1).register(backend)
        dst = Slab(SIZE, fill=0xAA).register(backend)
        key = f"close/{uuid.uuid4().hex}"
        if op == "get":
            assert await backend.put([contiguous(key, src, 0, SIZE)]) == [PutStatus.STORED]
            call = functools.partial(backend.get, [contiguous(key, dst, 0, SIZE)])
        else:
            await backend.connect()
            call = functools.partial(backend.put, [contiguous(key, src, 0, SIZE)])
        ended, closed, closed_before_resume = await close_while_running(backend, call, holder.process.pid)
        assert not closed_before_resume, "aclose returned while the call still used the caller's memory"
        assert ended <= min(closed)  # both closes, the second one begun while the first waited
        with pytest.raises(PoolClosedError):
            await backend.get([contiguous(key, dst, 0, SIZE)])  # nothing starts once closing began
