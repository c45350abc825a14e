"""Shared test helpers: small KV caches of every supported layout, and a fault-injecting backend."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch

from kvflow.backends.base import BackendCapabilities, BackendStats, GetStatus, ObjectRef, PutStatus
from kvflow.backends.memory import MemoryBackend
from kvflow.profiles import is_book_key
from kvflow.transfer import jobs

NUM_BLOCKS = 12
BLOCK = 16


def open_fds() -> int:
    """How many descriptors this process has open (to prove a call left none behind)."""
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def bounded_shm(size: str = "256m") -> Iterator[Path]:
    """A fresh directory on tmpfs, removed afterwards. As root it is a private tmpfs of ``size``, so
    a store that takes more memory than a test meant (a bug, or a mutant) fails with ENOSPC instead
    of filling the host's memory; elsewhere a directory under /dev/shm."""
    path = Path(tempfile.mkdtemp(prefix="kvflow-test-", dir="/dev/shm"))
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def _rand(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


# name -> factory of {layer: entry}; each entry has NUM_BLOCKS blocks of BLOCK tokens.
LAYOUTS: dict[str, Callable[[], dict[str, object]]] = {
    "vllm_cpu": lambda: {f"l{i}": _rand(NUM_BLOCKS, 2, BLOCK, 2 * 8) for i in range(3)},
    "flash_attn": lambda: {f"l{i}": _rand(2, NUM_BLOCKS, BLOCK, 2, 8) for i in range(3)},
    "flashinfer": lambda: {f"l{i}": _rand(NUM_BLOCKS, 2, BLOCK, 2, 8) for i in range(3)},
    "kv_tuple": lambda: {
        f"l{i}": (_rand(NUM_BLOCKS, BLOCK, 2, 8), _rand(NUM_BLOCKS, BLOCK, 2, 8)) for i in range(3)
    },
    "mla": lambda: {f"l{i}": _rand(NUM_BLOCKS, BLOCK, 24) for i in range(3)},
    "mla_tuple": lambda: {
        f"l{i}": (_rand(NUM_BLOCKS, BLOCK, 1, 16), _rand(NUM_BLOCKS, BLOCK, 1, 8)) for i in range(3)
    },
}


def block_bytes(entry: object, block_id: int) -> bytes:
    """The bytes of one block of one registered layer entry, however it is laid out."""
    if isinstance(entry, torch.Tensor):
        if entry.dim() == 5 and entry.shape[0] == 2:
            parts = [entry[0, block_id], entry[1, block_id]]
        else:
            parts = [entry[block_id]]
    else:
        parts = [t[block_id] for t in entry]  # type: ignore[attr-defined]
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def zeros_like_caches(caches: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, entry in caches.items():
        if isinstance(entry, torch.Tensor):
            out[name] = torch.zeros_like(entry)
        else:
            out[name] = tuple(torch.zeros_like(t) for t in entry)  # type: ignore[attr-defined]
    return out


def kv_keys(backend: MemoryBackend) -> list[str]:
    """The keys of the KV objects in ``backend`` (not the profile book's announcements)."""
    return [k for k in backend.stored_keys() if not is_book_key(k)]


def kv_puts(backend: MemoryBackend) -> int:
    """Objects of KV ``backend`` stored (its puts, less the profile book's announcements)."""
    return backend.stats().puts - sum(1 for k in backend.stored_keys() if is_book_key(k))


def _book(objects: Sequence[ObjectRef]) -> bool:
    return bool(objects) and all(is_book_key(o.key) for o in objects)


@attrs.define(eq=False)
class FencedBackend(MemoryBackend):
    """A memory backend that moves only registered memory, as a transport that pins it does: every
    region of a KV put or get must lie inside a span given to ``register_memory``. A region outside
    (a stray address: out of a staging chunk, say) is recorded in ``strays`` and fails the call
    before a byte moves, so a test sees it instead of silently corrupted memory."""

    spans: list[tuple[int, int]] = attrs.field(factory=list)
    strays: list[tuple[str, int, int]] = attrs.field(factory=list)

    def register_memory(self, addr: int, nbytes: int) -> None:
        self.spans.append((addr, addr + nbytes))

    def _fence(self, objects: Sequence[ObjectRef]) -> None:
        if _book(objects):
            return  # the profile book's slots are its own small buffers
        stray = [
            (o.key, a, n)
            for o in objects
            for a, n in zip(o.addrs, o.sizes)
            if not any(lo <= a and a + n <= hi for lo, hi in self.spans)
        ]
        if stray:
            self.strays += stray
            raise ConnectionError(f"{len(stray)} regions outside registered memory, first {stray[0]}")

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        self._fence(objects)
        return await super().put(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        self._fence(objects)
        return await super().get(objects)


@attrs.define(eq=False)  # a backend is itself, not its fields (pools key registrations by it)
class FaultyBackend:
    """A memory backend that can be told to raise or hang in put, get or exists. Faults and the
    put hook apply to calls about KV objects; the profile book's small calls pass through."""

    inner: MemoryBackend = attrs.field(factory=MemoryBackend)
    raise_on: set[str] = attrs.field(factory=set)
    hang_on: set[str] = attrs.field(factory=set)
    calls: list[str] = attrs.field(factory=list)
    put_hook: Callable[[Sequence[ObjectRef]], Awaitable[None]] | None = None
    get_hook: Callable[[Sequence[ObjectRef]], Awaitable[None]] | None = None  # after the get moved the bytes
    #: declared as the inner backend's is (True), the pool puts without asking exists() first; off
    #: by default, so that a store's exists() can be faulted
    put_checks_present: bool = False
    #: declared as the inner backend's is (True), a request's batches run one after another, the
    #: last first; off by default, so that they run at once, as a network store's do
    calls_in_turn: bool = False

    @property
    def max_batch(self) -> int:
        return 4

    @property
    def capabilities(self) -> BackendCapabilities:
        return attrs.evolve(
            self.inner.capabilities,
            put_checks_present=self.put_checks_present,
            calls_in_turn=self.calls_in_turn,
        )

    async def _fault(self, op: str) -> None:
        self.calls.append(op)
        if op in self.raise_on:
            raise ConnectionError(f"injected {op} failure")
        if op in self.hang_on:
            await anyio.sleep_forever()

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if _book(objects):
            return await self.inner.put(objects)
        await self._fault("put")
        if self.put_hook is not None:
            await self.put_hook(objects)
        return await self.inner.put(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if _book(objects):
            return await self.inner.get(objects)
        await self._fault("get")
        results = await self.inner.get(objects)
        if self.get_hook is not None:
            await self.get_hook(objects)
        return results

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if keys and all(is_book_key(k) for k in keys):
            return await self.inner.exists(keys)
        await self._fault("exists")
        return await self.inner.exists(keys)

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        await self._fault("remove")
        return await self.inner.remove(keys)

    async def touch(self, keys: Sequence[str]) -> None:
        await self.inner.touch(keys)  # (no fault: a touch only orders eviction)

    def register_memory(self, addr: int, nbytes: int) -> None:
        pass

    def stats(self) -> BackendStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()


def straight_runs(straight: bool) -> Callable[[int | None], int]:
    """A stand-in for :func:`kvflow.transfer.direct.min_run_bytes`, whatever the backend says: runs
    of any length go straight into the cache (``straight``; the tests' tiny heads make short runs),
    or none does (every load of another split or layout goes through a chunk)."""
    shortest = 1 if straight else 1 << 62
    return lambda _said: shortest


def record_straight_loads(monkeypatch: Any) -> list[int]:
    """From now on (``monkeypatch``: pytest's), how many blocks each load of another split's objects
    straight into the cache filled (:mod:`kvflow.transfer.direct`), one entry per load."""
    filled_counts: list[int] = []
    in_place = jobs.LoadJob._get_in_place

    async def counted(self: jobs.LoadJob, *args: Any) -> set[int]:
        filled = await in_place(self, *args)
        filled_counts.append(len(filled))
        return filled

    monkeypatch.setattr(jobs.LoadJob, "_get_in_place", counted)
    return filled_counts
