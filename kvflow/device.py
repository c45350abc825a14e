"""One small shim over ``torch.cuda``, ``torch.npu`` (``torch_npu``, loaded lazily) and the CPU.

The staging path (:mod:`kvflow.transfer.staging`) needs five things of the device that holds the KV
cache, and asks them of a :class:`Device` only, so the same code serves CUDA, Ascend NPU and the CPU:

- a dedicated *copy stream*, so copies overlap the engine's compute;
- making that stream (or the engine's current one) wait for an event: on the device when the event
  is a CUDA/NPU event, otherwise by polling it (the CPU, or a test's fake events);
- recording an event on a stream (``kvflow.events``: a CPU event is complete when recorded);
- pinned host memory for the staging buffers (plain memory on a CPU-only host);
- running copies "on" a stream: queued on the device, or done at once on the CPU.

A :class:`Device` is made from the cache's ``torch.device``; tests substitute a subclass (events that
complete late, copies that fail) through the same methods: ``gather_rows`` and ``scatter_rows`` are
the only places a staged transfer touches the cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from kvflow.errors import ConfigError, MissingDependencyError
from kvflow.events import DeviceEvent, make_event, poll_until

__all__ = ["Device"]


def _copy_rows(
    dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]
) -> None:
    """``dst[dst_rows[j]] = src[src_rows[j]]`` for 2-D byte tensors whose rows are dense spans."""
    width = src.size(1)
    if width != dst.size(1) or src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("row copies need byte rows of one width, each a dense span")
    d0, ds, s0, ss = dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0)
    memmove = ctypes.memmove
    for d, s in zip(dst_rows, src_rows):
        memmove(d0 + d * ds, s0 + s * ss, width)


def _module(kind: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` (importing ``torch_npu`` registers the latter)."""
    if kind == "cuda":
        return torch.cuda
    try:
        importlib.import_module("torch_npu")
    except ImportError as exc:
        raise MissingDependencyError(
            "torch_npu", "NPU KV caches", "pip install 'kvflow[npu]' (Ascend's torch_npu, matching your CANN)"
        ) from exc
    return torch.npu  # type: ignore[attr-defined]


@attrs.define(eq=False)
class Device:
    """The device of a KV cache: its copy stream, its events, pinned memory for staging.

    Create from any thread; use one instance's streams from the thread that issues its copies
    (kvflow's loop thread) and :meth:`wait_current` from the engine's thread.
    """

    device: torch.device
    event_factory: Callable[[], DeviceEvent] = attrs.field()
    _module: Any = None  # torch.cuda / torch.npu, None on the CPU
    _copy_stream: Any = attrs.field(default=None, init=False)

    @event_factory.default
    def _default_events(self) -> Callable[[], DeviceEvent]:
        return lambda: make_event(self.device)

    @classmethod
    def of(cls, device: torch.device | str) -> Device:
        device = torch.device(device)
        if device.type == "cpu":
            return cls(device)
        if device.type not in ("cuda", "npu"):
            raise ConfigError(f"kvflow moves KV caches on cpu, cuda and npu devices, not {device}")
        return cls(device, module=_module(device.type))

    @property
    def is_cpu(self) -> bool:
        return self._module is None

    # -- streams and events ---------------------------------------------------------------------

    @property
    def copy_stream(self) -> Any:
        """kvflow's own stream for staging copies (created on first use); None on the CPU."""
        if self._module is not None and self._copy_stream is None:
            self._copy_stream = self._module.Stream(device=self.device)
        return self._copy_stream

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        """Issue the enclosed copies on the copy stream (on the CPU they simply run now)."""
        if self._module is None:
            yield
            return
        # The cache's device first: leaving a stream context restores the thread's previous
        # device's stream, and on kvflow's loop thread that is device 0 (CUDA's default for a new
        # thread), which would get a context (hundreds of MiB) in a process whose cache is elsewhere.
        with self._module.device(self.device), self._module.stream(self.copy_stream):
            yield

    def record(self) -> DeviceEvent:
        """An event recorded on the current stream (inside :meth:`on_copy_stream`: the copy stream)."""
        event = self.event_factory()
        event.record()
        return event

    async def copies_wait_for(self, event: DeviceEvent, timeout_s: float) -> None:
        """Make the copy stream wait for ``event`` before the copies issued next: on the device when
        it is a device event (no host wait), else by polling it without blocking the loop."""
        native = getattr(event, "native", None)
        if self._module is not None and native is not None:
            self.copy_stream.wait_event(native)
            return
        await poll_until(event.query, timeout_s, "the engine's event")

    def wait_current(self, event: DeviceEvent, timeout_s: float) -> None:
        """Make the engine's current stream wait for ``event`` (a device-side wait for device
        events; a host wait otherwise). Engine thread; TimeoutError after ``timeout_s``."""
        native = getattr(event, "native", None)
        if self._module is not None and native is not None:
            self._module.current_stream(self.device).wait_event(native)
            return
        deadline = time.monotonic() + timeout_s
        delay = 50e-6
        while not event.query():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"a copy into the KV cache did not complete within {timeout_s} s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    # -- copies (issued inside :meth:`on_copy_stream`) ---------------------------------------------

    def gather_rows(self, source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[j] = source[index[j]]``: cache rows into host staging rows (contiguous ``out``).

        On a device: one gather and one device-to-host copy per call. On the CPU each row is one
        ``memmove`` (torch's CPU index kernels copy rows of this size several times slower)."""
        if self._module is None:
            _copy_rows(out, range(len(index)), source, index.tolist())
        else:
            out.copy_(source.index_select(0, index), non_blocking=True)

    def scatter_rows(
        self, target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor | None = None
    ) -> None:
        """``target[index[j]] = rows[pick[j]]`` (``rows[j]`` without ``pick``, an :meth:`index`):
        host staging rows into cache rows. On a device the rows move as they lie in the staging
        chunk (pinned) and are picked on the device: a pick on the host would copy them into
        pageable memory, whose copy to the device waits."""
        if self._module is None:
            _copy_rows(target, index.tolist(), rows, range(len(index)) if pick is None else pick.tolist())
            return
        moved = rows.to(self.device, non_blocking=True)
        target.index_copy_(0, index, moved if pick is None else moved.index_select(0, pick))

    # -- memory ---------------------------------------------------------------------------------

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for staging: pinned when the cache is on a device."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._module is not None)

    def index(self, ids: list[int]) -> torch.Tensor:
        """Block ids as an index tensor on the cache's device, moved from pinned memory (a
        non-blocking copy out of pageable memory waits: on an NPU for the whole copy stream)."""
        if self._module is None:
            return torch.tensor(ids, dtype=torch.long)
        host = self.host_buffer(8 * len(ids)).view(torch.long)
        host.numpy()[:] = ids
        return host.to(self.device, non_blocking=True)
