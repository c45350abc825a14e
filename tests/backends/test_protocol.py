"""What every embedded backend promises beyond its own tests (kvflow.backends.base.Backend); the
Mooncake backend has the same checks against a real master (tests/backends/test_mooncake.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest
import torch

from kvflow.backends import GetStatus, ObjectRef, PutStatus, open_backend
from tests.helpers import bounded_shm

KINDS = ["memory", "local", "arena"]


@contextlib.contextmanager
def store_url(kind: str, capacity: str, slot: str, tmpfs: str) -> Iterator[str]:
    """The URL of a new store of ``kind`` (on a private tmpfs of ``tmpfs`` but in memory)."""
    if kind == "memory":
        yield f"memory://?capacity={capacity}"
        return
    with bounded_shm(tmpfs) as path:
        yield f"{kind}://{path}/store?capacity={capacity}" + (f"&slot={slot}" if kind == "arena" else "")


@pytest.fixture(params=KINDS)
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    with store_url(request.param, "1MiB", "16KiB", "16m") as made:
        yield made


def region(buffer: torch.Tensor, key: str, at: int, nbytes: int) -> ObjectRef:
    return ObjectRef.of(key, [buffer.data_ptr() + at], [nbytes])


async def test_a_get_that_names_a_key_several_times_fills_every_object(url: str) -> None:
    """A load of several requests that share a prefix asks for one object into each request's
    blocks: every copy reported HIT must arrive."""
    backend = open_backend(url)
    try:
        src = torch.randint(0, 256, (32 << 10,), dtype=torch.uint8)
        dst = torch.full((64 << 10,), 0xAB, dtype=torch.uint8)
        a, b = region(src, "a", 0, 10_000), region(src, "b", 16 << 10, 7_000)
        assert await backend.put([a, b]) == [PutStatus.STORED] * 2
        gets = [
            region(dst, "a", 0, 10_000),
            region(dst, "b", 10_000, 7_000),
            region(dst, "a", 20_000, 10_000),
            region(dst, "a", 40_000, 10_000),
        ]
        assert await backend.get(gets) == [GetStatus.HIT] * 4
        for at in (0, 20_000, 40_000):
            assert torch.equal(dst[at : at + 10_000], src[:10_000]), at
        assert torch.equal(dst[10_000:17_000], src[16 << 10 : (16 << 10) + 7_000])
    finally:
        await backend.aclose()


async def test_a_put_that_names_a_key_twice_stores_the_first_and_reports_the_second_present(url: str) -> None:
    """A store of several requests that share a prefix puts one key for each of them."""
    backend = open_backend(url)
    try:
        src = torch.randint(0, 256, (32 << 10,), dtype=torch.uint8)
        puts = [region(src, "a", 0, 10_000), region(src, "a", 16 << 10, 10_000)]
        assert await backend.put(puts) == [PutStatus.STORED, PutStatus.PRESENT]
        dst = torch.zeros(10_000, dtype=torch.uint8)
        assert await backend.get([region(dst, "a", 0, 10_000)]) == [GetStatus.HIT]
        assert torch.equal(dst, src[:10_000])
    finally:
        await backend.aclose()


@pytest.fixture(params=KINDS)
def roomy_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store with room for 48 objects of 1 MiB."""
    with store_url(request.param, "64MiB", "1MiB", "96m") as made:
        yield made


@pytest.mark.parametrize("op", ["put", "get"])
async def test_aclose_returns_only_once_no_put_or_get_copies_the_callers_memory(
    roomy_url: str, op: str
) -> None:
    """A put reads the caller's memory and a get writes it until it returns; a close begun while
    one runs (between two of its pauses) returns after it, and the call answers for every object
    (a get reports what it copied before the close dropped the memory backend's objects as HIT,
    the rest MISS)."""
    backend = open_backend(roomy_url)
    count = 48
    src = torch.randint(0, 256, (count << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    puts = [region(src, f"k{i}", i << 20, 1 << 20) for i in range(count)]
    gets = [region(dst, f"k{i}", i << 20, 1 << 20) for i in range(count)]
    if op == "get":
        assert await backend.put(puts) == [PutStatus.STORED] * count
    order: list[str] = []
    answers: list[object] = []

    async def call() -> None:
        answers.extend(await (backend.put(puts) if op == "put" else backend.get(gets)))
        order.append(op)

    async def close() -> None:
        await backend.aclose()
        order.append("closed")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.lowlevel.checkpoint()  # the call copies until its first pause
            assert order == []  # still running: the close below begins mid-call
            tg.start_soon(close)
    assert order == [op, "closed"]
    assert len(answers) == count
    for i, answer in enumerate(answers if op == "get" else []):  # HIT: the object; else untouched
        part = slice(i << 20, (i + 1) << 20)
        assert torch.equal(dst[part], src[part] if answer is GetStatus.HIT else torch.zeros_like(src[part]))
