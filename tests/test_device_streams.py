"""The CUDA/NPU-only code of the staging path (kvflow.device), run on the CPU through fakes: the
copy stream's device and the memory its host-to-device copies read. tests/test_cuda.py runs the
same paths on a GPU when one is there."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
import torch._utils

from kvflow import KVLayout, KVPool, KVRequest, MemoryBackend, PoolConfig
from kvflow.device import Device
from kvflow.events import CpuEvent
from kvflow.sync import SyncPool
from tests.helpers import BLOCK, LAYOUTS, block_bytes

TOKENS = list(range(300, 300 + BLOCK * 6))
SRC_IDS = [3, 1, 4, 0, 5, 2]
DST_IDS = [10, 11, 7, 8, 6, 9]


def moved_exactly(caches: dict[str, torch.Tensor]) -> bool:
    return all(
        block_bytes(caches[n], d) == block_bytes(caches[n], s)
        for s, d in zip(SRC_IDS, DST_IDS)
        for n in caches
    )


def staged_pool(caches: dict[str, torch.Tensor], device: Device) -> KVPool:
    config = PoolConfig(staging="always", staging_bytes=2 * 4096)
    return KVPool.create(
        config, layout=KVLayout.from_kv_caches(caches), backend=MemoryBackend(), device=device
    )


# -- 1. the copy stream context makes cuda:0 current on kvflow's loop thread ----------------------


@attrs.define
class FakeCudaRuntime:
    """The CUDA runtime state torch's device and stream functions touch, per host thread.

    Follows c10/cuda/CUDAFunctions.cpp (CUDA >= 12): ``cudaSetDevice`` creates the device's primary
    context; ``SetDevice`` (used by ``torch._C._cuda_setStream`` when the stream is on another
    device) calls it when the device differs; ``MaybeExchangeDevice`` (``torch.cuda.device``'s
    exit) only records a target device when that device has no context yet."""

    contexts: set[int] = attrs.field(factory=lambda: {1})  # the engine's process uses cuda:1
    set_device_calls: list[tuple[str, int]] = attrs.field(factory=list)
    _local: threading.local = attrs.field(factory=threading.local)
    _next_id: int = 1

    def _device(self) -> int:
        return getattr(self._local, "device", 0)  # a new host thread's current device is 0

    def _target(self) -> int:
        return getattr(self._local, "target", -1)

    def cuda_set_device(self, index: int) -> None:
        self.set_device_calls.append((threading.current_thread().name, index))
        self._local.device = index
        self.contexts.add(index)  # CUDA 12: cudaSetDevice initialises the primary context

    # torch.cuda.current_device / c10::cuda::GetDevice
    def current_device(self) -> int:
        return self._target() if self._target() >= 0 else self._device()

    # c10::cuda::SetDevice
    def set_device(self, index: int) -> None:
        self._local.target = -1
        if index != self._device():
            self.cuda_set_device(index)

    # torch.cuda._exchange_device / c10::cuda::ExchangeDevice
    def exchange_device(self, index: int) -> int:
        if index < 0:
            return -1
        cur = self._target()
        self._local.target = -1
        if cur < 0:
            cur = self._device()
            if index == cur:
                return cur
        self.cuda_set_device(index)
        return cur

    # torch.cuda._maybe_exchange_device / c10::cuda::MaybeExchangeDevice
    def maybe_exchange_device(self, index: int) -> int:
        if index < 0:
            return -1
        cur = self._device()
        if index == cur:
            return cur
        if index in self.contexts:
            self.cuda_set_device(index)
        else:
            self._local.target = index
        return cur

    def streams(self) -> dict[int, int]:
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        return self._local.streams

    # torch._C._cuda_getCurrentStream
    def get_current_stream(self, index: int) -> tuple[int, int, int]:
        return (self.streams().get(index, 0), index, 1)

    # torch._C._cuda_setStream (torch/csrc/cuda/Module.cpp: set_device when on another device)
    def set_stream(self, stream_id: int = 0, device_index: int = 0, device_type: int = 1) -> None:
        if self.current_device() != device_index:
            self.set_device(device_index)
        self.streams()[device_index] = stream_id

    def new_stream_id(self) -> int:
        self._next_id += 1
        return self._next_id


def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudaRuntime:
    runtime = FakeCudaRuntime()

    class FakeStream:
        def __init__(
            self,
            device: Any = None,
            priority: int = 0,
            stream_id: int | None = None,
            device_index: int | None = None,
            device_type: int = 1,
        ) -> None:
            if stream_id is None:  # a new stream, made on ``device`` as torch.cuda.Stream does
                with torch.cuda.device(device):
                    device_index = runtime.current_device()
                stream_id = runtime.new_stream_id()
            assert device_index is not None
            self.stream_id, self.device_index, self.device_type = stream_id, device_index, device_type
            self.waited: list[object] = []

        @property
        def device(self) -> torch.device:
            return torch.device("cuda", self.device_index)

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", runtime.current_device)
    monkeypatch.setattr(torch.cuda, "_exchange_device", runtime.exchange_device)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", runtime.maybe_exchange_device)
    monkeypatch.setattr(torch._utils, "_get_current_device_index", runtime.current_device)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", runtime.get_current_stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_setStream", runtime.set_stream, raising=False)
    runtime.set_device(1)  # the engine's thread: vLLM's worker calls torch.cuda.set_device(cuda:1)
    return runtime


@attrs.define(eq=False)
class CopiesOnTheHost(Device):
    """A cache on cuda:1 (streams, events: the real Device code over the fake runtime) whose copies
    themselves run on host tensors, so that the transfer can complete on a CPU."""

    def index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long)

    def gather_rows(self, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(source, 0, index, out=out)

    def scatter_rows(
        self, target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor | None = None
    ) -> None:
        target.index_copy_(0, index, rows if pick is None else rows.index_select(0, pick))

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def test_staged_copies_of_a_cache_on_cuda1_never_make_cuda0_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM worker on cuda:1 (every GPU visible, ``torch.cuda.set_device(1)``) stages through
    kvflow's loop thread. That thread's current device is 0 (CUDA's per-thread default); entering
    ``torch.cuda.stream(copy_stream)`` switches it to 1, and leaving restores device 0's stream with
    ``torch.cuda.set_stream``, i.e. ``cudaSetDevice(0)``: since CUDA 12 that creates a CUDA context
    (hundreds of MiB) on GPU 0 in every worker process whose cache is elsewhere."""
    runtime = fake_cuda(monkeypatch)
    device = CopiesOnTheHost(torch.device("cuda", 1), event_factory=CpuEvent, module=torch.cuda)
    caches = LAYOUTS["flash_attn"]()
    config = PoolConfig(staging="always", staging_bytes=2 * 4096)
    with SyncPool.open(
        config, layout=KVLayout.from_kv_caches(caches), backend=MemoryBackend(), device=device
    ) as pool:
        assert pool.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS)).stored == len(SRC_IDS)
        assert pool.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS)).hit_blocks == len(DST_IDS)
    assert all(
        block_bytes(caches[n], d) == block_bytes(caches[n], s)
        for s, d in zip(SRC_IDS, DST_IDS)
        for n in caches
    )
    on_zero = [call for call in runtime.set_device_calls if call[1] == 0]
    assert runtime.contexts == {1}, (
        f"kvflow created a CUDA context on GPU 0 for a cache on cuda:1: cudaSetDevice(0) from "
        f"{sorted({name for name, _ in on_zero})} ({len(on_zero)} calls)"
    )


# -- 2. host-to-device copies from pageable memory on the copy stream ------------------------------


class StreamModule:
    """A ``torch.cuda``/``torch.npu`` stand-in: a copy stream whose context does nothing."""

    class Stream:
        def __init__(self, device: object = None) -> None:
            self.waited: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: object) -> Iterator[None]:
        yield

    @staticmethod
    @contextlib.contextmanager
    def device(device: object) -> Iterator[None]:
        yield

    @staticmethod
    def current_stream(device: object = None) -> StreamModule.Stream:
        return StreamModule.Stream()


@attrs.define(eq=False)
class PinnedTracking(Device):
    """The device code path (``_module`` set) on host tensors; ``host_buffer`` stands for pinned
    memory (the CPU build cannot pin) and remembers which ranges are pinned."""

    pinned: list[tuple[int, int]] = attrs.field(factory=list)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned.append((buffer.data_ptr(), buffer.data_ptr() + nbytes))
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether a copy of ``tensor`` reads pinned memory: a strided view is copied into pageable
        memory first (torch moves only dense tensors)."""
        ptr = tensor.data_ptr()
        return tensor.is_contiguous() and any(a <= ptr < b for a, b in self.pinned)


def pageable_copies(monkeypatch: pytest.MonkeyPatch, device: PinnedTracking) -> list[str]:
    """What non-blocking host-to-device copies read pageable memory from now on (tensor shapes)."""
    found: list[str] = []
    original = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("non_blocking") and self.device.type == "cpu" and not device.is_pinned(self):
            found.append(f"{tuple(self.shape)} {self.dtype}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return found


async def test_the_copy_streams_host_to_device_copies_read_pinned_memory_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy stream's host-to-device copies (the block indexes, the chunk's rows) read pinned
    memory only: a non-blocking copy out of pageable memory waits (torch_npu synchronises the copy
    stream, CachingHostAllocator.cpp ``process_non_blocking_copy``; CUDA stages it through driver
    buffers after a stream sync), and the loop must never wait for the device."""
    device = PinnedTracking(torch.device("cpu"), event_factory=CpuEvent, module=StreamModule)
    pageable = pageable_copies(monkeypatch, device)
    caches = LAYOUTS["flash_attn"]()
    async with staged_pool(caches, device) as pool:
        assert (await pool.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))).stored == len(SRC_IDS)
        assert (await pool.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))).hit_blocks == len(DST_IDS)
    assert moved_exactly(caches)
    assert not pageable, f"non_blocking host-to-device copies out of pageable memory: {pageable}"


async def test_a_partly_hit_chunk_is_scattered_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose hits are not its first rows (a block missed in the middle) moves its rows from
    the chunk (pinned) and picks them on the device: picked on the host, they were a fresh pageable
    copy, whose move to the device waits (on an NPU for the whole copy stream)."""
    device = PinnedTracking(torch.device("cpu"), event_factory=CpuEvent, module=StreamModule)
    pageable = pageable_copies(monkeypatch, device)
    caches = LAYOUTS["flash_attn"]()
    async with staged_pool(caches, device) as pool:
        assert (await pool.store(KVRequest(block_ids=SRC_IDS, tokens=TOKENS))).stored == len(SRC_IDS)
        assert await pool.remove(KVRequest(tokens=TOKENS[: 3 * BLOCK], block_offset=2)) == 1  # block 2 only
        got = await pool.retrieve(KVRequest(block_ids=DST_IDS, tokens=TOKENS))
    assert got.statuses[2] is not got.statuses[3]  # a miss, then a hit in the same chunk
    assert block_bytes(caches["l0"], DST_IDS[3]) == block_bytes(caches["l0"], SRC_IDS[3])
    assert not pageable, f"rows scattered out of pageable memory with non_blocking copies: {pageable}"


@pytest.mark.parametrize("writer_block", [BLOCK, BLOCK // 2], ids=["same block size", "half blocks"])
async def test_a_reshaped_load_moves_only_pinned_memory(
    writer_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load from another split's objects (a TP=1 writer, this TP=2 reader) moves each object's
    span of the staging chunk to the device whole, then takes its heads there: a strided view of
    the chunk would go through a pageable copy."""
    from tests.test_staging import DST_IDS as READER_IDS
    from tests.test_staging import TOKENS as PROMPT
    from tests.test_staging import head_of, staged, stored_by_a_tp1_writer, tp2_reader

    backend = MemoryBackend()
    src, ids = await stored_by_a_tp1_writer(backend, writer_block)
    device = PinnedTracking(torch.device("cpu"), event_factory=CpuEvent, module=StreamModule)
    pageable = pageable_copies(monkeypatch, device)
    reader, dst = tp2_reader(backend, staged(staging_bytes=4 * 4096), device, writer_block)
    async with reader:
        got = await reader.retrieve(KVRequest(block_ids=READER_IDS, tokens=PROMPT))
    assert got.hit_blocks == len(READER_IDS)
    for block, target in enumerate(READER_IDS):
        assert torch.equal(dst["l0"][target, 0], head_of(src, ids, "l0", block, 1))
    assert not pageable, f"non_blocking host-to-device copies out of pageable memory: {pageable}"
