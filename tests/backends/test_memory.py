from __future__ import annotations

import torch

from kvflow import GetStatus, MemoryBackend, PutStatus, open_backend
from kvflow.backends import ObjectRef
from kvflow.backends.memory import MemoryConfig


def obj(key: str, *tensors: torch.Tensor) -> ObjectRef:
    return ObjectRef.of(key, [t.data_ptr() for t in tensors], [t.numel() * t.element_size() for t in tensors])


async def test_put_get_round_trip_of_scattered_regions() -> None:
    backend = MemoryBackend()
    a, b = torch.arange(100, dtype=torch.uint8), torch.arange(50, dtype=torch.int32)
    assert await backend.put([obj("k", a, b)]) == [PutStatus.STORED]
    x, y = torch.zeros_like(a), torch.zeros_like(b)
    assert await backend.get([obj("k", x, y), obj("missing", x)]) == [GetStatus.HIT, GetStatus.MISS]
    assert torch.equal(x, a) and torch.equal(y, b)
    assert await backend.exists(["k", "missing"]) == [True, False]


async def test_put_never_overwrites_and_size_mismatch_fails() -> None:
    backend = MemoryBackend()
    first, second = torch.ones(10, dtype=torch.uint8), torch.full((10,), 7, dtype=torch.uint8)
    await backend.put([obj("k", first)])
    assert await backend.put([obj("k", second)]) == [PutStatus.PRESENT]
    out = torch.zeros(10, dtype=torch.uint8)
    await backend.get([obj("k", out)])
    assert torch.equal(out, first)
    small = torch.zeros(4, dtype=torch.uint8)
    assert await backend.get([obj("k", small)]) == [GetStatus.FAILED]
    assert torch.equal(small, torch.zeros(4, dtype=torch.uint8))


async def test_lru_eviction_keeps_within_capacity() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=300))
    data = torch.zeros(100, dtype=torch.uint8)
    await backend.put([obj(k, data) for k in "abc"])
    await backend.get([obj("a", data)])  # a is now most recent
    assert await backend.put([obj("d", data)]) == [PutStatus.STORED]
    assert await backend.exists(list("abcd")) == [True, False, True, True]
    stats = backend.stats()
    assert stats.used_bytes == 300 and stats.evictions == 1
    too_big = torch.zeros(301, dtype=torch.uint8)
    assert await backend.put([obj("e", too_big)]) == [PutStatus.NO_SPACE]
    assert stats.no_space == 1 and stats.hits == 1
    assert await backend.remove(["a", "b", "zz"]) == [True, False, False]
    assert await backend.exists(list("acd")) == [False, True, True] and stats.used_bytes == 200


def test_url_parsing() -> None:
    backend = open_backend("memory://?capacity=1MiB")
    assert isinstance(backend, MemoryBackend) and backend.config.capacity_bytes == 1 << 20


async def test_a_recycled_buffer_holds_only_the_new_object() -> None:
    backend = MemoryBackend(MemoryConfig(capacity_bytes=200))
    a, b, c = (torch.full((100,), v, dtype=torch.uint8) for v in (1, 2, 3))
    await backend.put([obj("a", a), obj("b", b)])
    assert await backend.put([obj("c", c)]) == [PutStatus.STORED]  # evicts a, reuses its buffer
    out_b, out_c = torch.zeros(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    assert await backend.get([obj("a", out_b), obj("b", out_b), obj("c", out_c)]) == [
        GetStatus.MISS,
        GetStatus.HIT,
        GetStatus.HIT,
    ]
    assert torch.equal(out_b, b) and torch.equal(out_c, c)
