"""Device events: how an engine tells kvflow that a layer's KV is written, without a sync.

An engine launches layer ``l``'s kernels on its stream, then records an event on that stream
(:meth:`DeviceEvent.record`, on the engine's thread). kvflow's loop never blocks on the device: it
polls :meth:`DeviceEvent.query` with a short, bounded back-off (:func:`wait_event`) and reads the
layer's memory only once the event says the work before it has finished.

- :class:`CpuEvent`: complete as soon as it is recorded (CPU kernels finish before they return);
- :class:`CudaEvent`: a ``torch.cuda.Event`` on the current CUDA stream;
- :class:`NpuEvent`: a ``torch_npu`` event on the current NPU stream (``torch_npu`` loads lazily).

:class:`LayerEvents` holds one event per layer of one forward pass, recorded by the engine thread
and awaited by loop tasks; :func:`make_event` picks the kind for a device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import anyio
import attrs
import torch

from kvflow.errors import ConfigError, MissingDependencyError, RequestError
from kvflow.request import as_index

__all__ = [
    "CpuEvent",
    "CudaEvent",
    "DeviceEvent",
    "LayerEvents",
    "NpuEvent",
    "check_after",
    "make_event",
    "poll_until",
    "wait_event",
]

FIRST_POLL_S = 50e-6
MAX_POLL_S = 1e-3


@runtime_checkable
class DeviceEvent(Protocol):
    """A point in the engine's stream of device work."""

    def record(self) -> None:
        """Mark the current point of the engine's current stream. Call from the engine's thread."""
        ...

    def query(self) -> bool:
        """True once recorded and every piece of work queued before it has finished. Never blocks;
        any thread may call it."""
        ...


async def poll_until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once ``ready()`` is true, polling with a back-off from 50 us doubling to 1 ms.

    Never blocks the event loop. Raises TimeoutError after ``timeout_s``.
    """
    if ready():
        return
    delay = FIRST_POLL_S
    try:
        with anyio.fail_after(timeout_s):
            while not ready():
                await anyio.sleep(delay)
                delay = min(delay * 2, MAX_POLL_S)
    except TimeoutError:
        raise TimeoutError(
            f"{what} did not complete within {timeout_s} s; check that the engine records it after "
            "launching the layer's work, or raise the timeout"
        ) from None


async def wait_event(event: DeviceEvent, timeout_s: float) -> None:
    """Wait (on the loop, without blocking it) until ``event`` completes; TimeoutError after ``timeout_s``."""
    await poll_until(event.query, timeout_s, "a device event")


@attrs.define(eq=False)
class CpuEvent:
    """The event of a CPU engine: its kernels have finished when they return, so the event is
    complete as soon as it is recorded."""

    _recorded: bool = attrs.field(default=False, init=False)

    def record(self) -> None:
        self._recorded = True

    def query(self) -> bool:
        return self._recorded


@attrs.define(eq=False)
class CudaEvent:
    """A CUDA event recorded on ``device``'s current stream. Not complete before it is recorded
    (unlike a bare ``torch.cuda.Event``, whose ``query()`` is true until its first record)."""

    device: torch.device = attrs.field(factory=lambda: torch.device("cuda"))
    _event: torch.cuda.Event = attrs.field(init=False, factory=torch.cuda.Event)
    _recorded: bool = attrs.field(default=False, init=False)

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self.device))
        self._recorded = True

    def query(self) -> bool:
        return self._recorded and bool(self._event.query())  # type: ignore[no-untyped-call]

    @property
    def native(self) -> torch.cuda.Event | None:
        """The recorded ``torch.cuda.Event`` (a stream can wait on it on the device), else None."""
        return self._event if self._recorded else None


def _torch_npu() -> ModuleType:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise MissingDependencyError(
            "torch_npu", "NPU events", "pip install 'kvflow[npu]' (Ascend's torch_npu, matching your CANN)"
        ) from exc


@attrs.define(eq=False)
class NpuEvent:
    """An NPU event recorded on ``device``'s current stream (needs ``torch_npu``, which is what
    makes ``"npu"`` a device name torch knows)."""

    device: torch.device | str = "npu"
    _npu: Any = attrs.field(init=False, factory=lambda: _torch_npu().npu)
    _event: Any = attrs.field(init=False)
    _recorded: bool = attrs.field(default=False, init=False)

    @_event.default
    def _new_event(self) -> Any:
        return self._npu.Event()

    def record(self) -> None:
        self._event.record(self._npu.current_stream(self.device))
        self._recorded = True

    def query(self) -> bool:
        return self._recorded and bool(self._event.query())

    @property
    def native(self) -> Any:
        """The recorded ``torch_npu`` event (a stream can wait on it on the device), else None."""
        return self._event if self._recorded else None


def check_after(after: object) -> None:
    """Refuse an ``after=`` that is neither None nor a :class:`DeviceEvent` (something with
    ``record()`` and ``query()``), with a TypeError that says what to pass. Called once per call at
    the API edge: deep inside, a wrong object would only look like an event that never completes."""
    if after is None or type(after) in _KVFLOW_EVENTS:  # (the protocol's isinstance takes microseconds)
        return
    if not isinstance(after, DeviceEvent):
        raise TypeError(
            f"after= must be a kvflow DeviceEvent (record() and query(); e.g. "
            f"kvflow.events.make_event(device), recorded on the engine's stream) or None, got "
            f"{type(after).__module__}.{type(after).__qualname__}"
        )


_KVFLOW_EVENTS = frozenset({CpuEvent, CudaEvent, NpuEvent})


def make_event(device: torch.device | str) -> DeviceEvent:
    """A new, unrecorded event of the kind ``device`` needs: cpu, cuda or npu."""
    kind = device.type if isinstance(device, torch.device) else device.split(":")[0]
    if kind == "cpu":
        return CpuEvent()
    if kind == "cuda":
        return CudaEvent(torch.device(device))
    if kind == "npu":  # a plain torch does not know "npu" until torch_npu is imported
        return NpuEvent(device)
    raise ConfigError(f"kvflow has no device events for {device}; it supports cpu, cuda and npu devices")


@attrs.define(eq=False)
class LayerEvents:
    """One device event per layer of one forward pass.

    The engine thread calls :meth:`record` once per layer, after launching the work that writes
    the layer's KV, and :meth:`seal` when the pass ends (layers not recorded by then never will
    be). Loop tasks call :meth:`wait`. Each flag is written once, by the engine thread, and
    :meth:`wait` reads ``sealed`` before ``recorded``, so the two threads need no lock.
    """

    factory: Callable[[], DeviceEvent]
    _events: list[DeviceEvent | None]
    _sealed: bool = False

    @classmethod
    def create(cls, num_layers: int, factory: Callable[[], DeviceEvent]) -> LayerEvents:
        """``num_layers`` layers whose events ``factory`` makes when each layer is recorded."""
        if num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
        return cls(factory, [None] * num_layers)

    @classmethod
    def completed(cls, num_layers: int) -> LayerEvents:
        """Every layer already written (a store issued after the forward pass)."""
        events = cls.create(num_layers, CpuEvent)
        for layer in range(num_layers):
            events.record(layer)
        events.seal()
        return events

    @property
    def num_layers(self) -> int:
        return len(self._events)

    def recorded(self, layer: int) -> bool:
        return self._events[layer] is not None

    def record(self, layer: int) -> None:
        """Record layer ``layer``'s event on the engine's current stream. Engine thread only.
        ``layer``: an integer (RequestError for a ``bool``, a float, one out of range)."""
        layer = as_index(layer, "a layer")
        if layer >= len(self._events):
            raise RequestError(f"layer {layer} is out of range: the KV cache has {len(self._events)} layers")
        if self._sealed:
            raise RequestError(f"layer {layer} was recorded after the pass ended; record before seal()")
        if self._events[layer] is not None:
            raise RequestError(f"layer {layer} was already recorded in this pass; record each layer once")
        event = self.factory()
        event.record()
        self._events[layer] = event  # published last: a waiter sees a recorded event or none

    def seal(self) -> None:
        """The pass has ended: waiters of layers not recorded stop waiting. Engine thread only."""
        self._sealed = True

    async def wait(self, layer: int, timeout_s: float) -> bool:
        """True once layer ``layer``'s event completed; False if the pass ended without recording
        it. Loop only; raises TimeoutError after ``timeout_s``."""

        def settled() -> bool:
            sealed = self._sealed  # read first: once sealed, no record can follow
            event = self._events[layer]
            return event.query() if event is not None else sealed

        await poll_until(settled, timeout_s, f"layer {layer}'s device event")
        return self._events[layer] is not None
