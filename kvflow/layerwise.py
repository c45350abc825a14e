"""Layerwise stores and loads: one object per block per layer, moved while the forward pass runs.

:class:`LayerwiseStorer` puts layer ``l`` of the blocks this rank owns once layer ``l``'s device
event (:class:`~kvflow.events.LayerEvents`) has fired, never before. Each layer's put runs as a
task of its own, so a put that fails or hangs is reported without holding back later layers.

:class:`LayerwiseRetriever` gets layer ``l`` into the KV cache and hands it out once it is in
place, keeping ``depth`` layers in flight ahead of the last one handed out, so that layer ``l+1``
moves while the engine computes layer ``l``. A block that any layer fails to load is failed for
the whole request: the engine must recompute it.

Both are faces over the transfer layer (a :class:`~kvflow.transfer.StoreJob` or
:class:`~kvflow.transfer.LoadJob` decides what each layer moves); :meth:`kvflow.KVPool.layerwise_store`
and :meth:`kvflow.KVPool.layerwise_retrieve` make them. Both work on a batch of requests (one forward
step's), own a task group, and are used alike::

    async with pool.layerwise_retrieve(requests) as loader:
        async for outcome in loader:  # one LayerOutcome per layer, in layer order
            ...                       # layer outcome.layer arrived (staged: once outcome.ready completed)
    results = loader.results()        # one RetrieveResult per request

Leaving the ``async with`` block cancels whatever has not finished; the results then report the
blocks of unfinished layers as failed. They are async iterators rather than async generator
functions so that no task group or cancel scope is ever suspended across a ``yield``; a consumer
that stops early leaves nothing behind to finalise.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import TypeVar

import anyio
import attrs
from anyio.abc import TaskGroup

from kvflow.config import positive_int
from kvflow.errors import ConfigError
from kvflow.events import DeviceEvent, LayerEvents
from kvflow.results import RetrieveResult, StoreResult
from kvflow.transfer import BlockPlan, LoadJob, StoreJob, Transfer
from kvflow.transfer.together import unwrapped

__all__ = ["LayerOutcome", "LayerwiseRetriever", "LayerwiseStorer"]

log = logging.getLogger(__name__)

T = TypeVar("T", bound="_LayerTasks")


@attrs.frozen
class LayerOutcome:
    """A layer of a layerwise store or load has finished; ``failed`` of its objects did not make it
    (a put that failed or found no space; a load that missed or failed).

    A staged load's copies into the cache may still run on the device: ``ready`` holds their events
    (make the compute stream wait on them before the layer's kernels read the blocks; empty when
    nothing is left to wait for).
    """

    layer: int
    failed: int
    ready: tuple[DeviceEvent, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failed == 0


@attrs.define(eq=False)
class _LayerTasks:
    """What the storer and the retriever share: a pool call in flight, a task group, and handing
    out one :class:`LayerOutcome` per layer in layer order as layers finish."""

    transfer: Transfer
    plan: BlockPlan
    timeout_s: float
    _failed: list[int | None] = attrs.field(init=False)  # per layer; None until it finished
    _ready: list[tuple[DeviceEvent, ...]] = attrs.field(init=False)
    _done: list[anyio.Event] = attrs.field(init=False, factory=list)
    _tg: TaskGroup | None = attrs.field(default=None, init=False)
    _used: bool = attrs.field(default=False, init=False)
    _next: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._failed = [None] * self.transfer.format.num_layers
        self._ready = [()] * self.transfer.format.num_layers

    @property
    def num_layers(self) -> int:
        return len(self._failed)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.plan.request_ids

    async def __aenter__(self: T) -> T:
        if self._used:
            raise RuntimeError("a layerwise storer or retriever runs once; open a new one")
        self._used = True
        self.transfer.begin()
        try:
            self._done = [anyio.Event() for _ in self._failed]
            tg = anyio.create_task_group()
            await tg.__aenter__()
        except BaseException:
            self.transfer.end()
            raise
        self._tg = tg
        self._start(tg)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        if tg is None:
            return None
        try:
            tg.cancel_scope.cancel()  # whatever has not finished is abandoned; results say so
            with unwrapped():  # a layer's error reaches the caller as it is, as a whole-block call's
                return await tg.__aexit__(exc_type, exc, tb)
        finally:
            await self._cleanup()
            self.transfer.end()

    async def _cleanup(self) -> None:
        """After the task group ended (shielded if it must wait)."""

    def __aiter__(self: T) -> T:
        return self

    async def __anext__(self) -> LayerOutcome:
        layer = self._next
        if layer >= len(self._failed):
            raise StopAsyncIteration
        if self._tg is None:
            raise RuntimeError("iterate a layerwise storer or retriever inside its `async with` block")
        await self._done[layer].wait()
        self._next = layer + 1
        self._advance(layer)
        failed = self._failed[layer]
        assert failed is not None
        return LayerOutcome(layer, failed, self._ready[layer])

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _finish(self, layer: int, failed: int, ready: tuple[DeviceEvent, ...] = ()) -> None:
        self._failed[layer] = failed
        self._ready[layer] = ready
        self._done[layer].set()
        log.debug("layer %d finished, %d objects failed", layer, failed)

    def _start(self, tg: TaskGroup) -> None:
        raise NotImplementedError

    def _advance(self, layer: int) -> None:
        """Layer ``layer`` was handed out."""


@attrs.define(eq=False)
class LayerwiseStorer(_LayerTasks):
    """Stores a batch of requests' owned blocks, layer by layer, as their events fire.

    Ownership and the exists-skip are :meth:`kvflow.KVPool.store`'s, per key and layer. Use from
    the pool's event loop.
    """

    events: LayerEvents
    #: the same step's loader, when the forward computes on what it loads: layer ``l`` is put only
    #: once the loader's layers ``0..l`` arrived whole in the cache (a copy the device reports
    #: failed only after the engine computed on it must not leave its results in the store)
    loaded_by: LayerwiseRetriever | None = None
    _job: StoreJob = attrs.field(init=False)
    _announced: anyio.Event | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.events.num_layers != self.num_layers:
            raise ConfigError(
                f"{self.events.num_layers} layer events for a KV cache of {self.num_layers} layers"
            )
        self._job = StoreJob(self.transfer, self.plan)

    def _start(self, tg: TaskGroup) -> None:
        tg.start_soon(self._run, tg)

    async def _run(self, tg: TaskGroup) -> None:
        """Wait for each layer's event in order and start that layer's put."""
        job = self._job
        if not job.owned:  # another rank of the replica group owns every block
            for layer in range(self.num_layers):
                self._finish(layer, await job.put(layer, self._deadline()))  # nothing to put
            return
        # Asking what is present reads no KV, so it runs while the engine computes layer 0; the
        # profile's announcement runs beside the whole store (engines split otherwise find it),
        # and the last layer is handed out once it ended: leaving the storer cancels what runs.
        self._announced = anyio.Event()
        tg.start_soon(self._announce, self._announced)
        await job.skip_present(self._deadline())
        for layer in range(self.num_layers):
            # With a loader, the engine computes layer ``layer`` once its load arrived: the layer's
            # event is given ``timeout_s`` from then, not from the start (a slow load of a layer
            # must not use up the time its compute is given). A loader may also be given once the
            # store runs (SyncLayerwisePool.start_load after start_store): asked again after the
            # event, when the layer was computed.
            whole = await self._rests_on_whole_loads(layer)
            fired = False
            if whole:
                try:
                    fired = await self.events.wait(layer, self.timeout_s)
                except TimeoutError as exc:
                    log.warning("layerwise store gives up at layer %d of %d: %s", layer, self.num_layers, exc)
                whole = not fired or await self._rests_on_whole_loads(layer)
            if not whole:
                log.warning(
                    "layerwise store gives up at layer %d: KV it was computed from did not load", layer
                )
                fired = False
            if not fired:  # this layer, and so every later one, will not be written: skip them
                for rest in range(layer, self.num_layers):
                    self._finish(rest, job.abandon(rest))
                return
            tg.start_soon(self._put_layer, layer)

    async def _rests_on_whole_loads(self, layer: int) -> bool:
        """Whether layer ``layer``'s KV rests only on loads that arrived whole (``loaded_by``)."""
        loader = self.loaded_by
        if loader is None:
            return True
        with anyio.move_on_after(self.timeout_s):
            return await loader.arrived_whole(layer)
        return False

    async def _announce(self, done: anyio.Event) -> None:
        try:
            await self.transfer.book.announce(self._deadline())
        finally:
            done.set()

    async def _put_layer(self, layer: int) -> None:
        failed = await self._job.put(layer, self._deadline())
        if layer == self.num_layers - 1 and self._announced is not None:
            await self._announced.wait()
        self._finish(layer, failed)

    async def _cleanup(self) -> None:
        self._job.release_all()

    def results(self) -> list[StoreResult]:
        """One :class:`StoreResult` per request: a block's status is the worst over its layers
        (``None`` where another rank owns it; FAILED where a layer never finished)."""
        return self._job.results()


@attrs.define(eq=False)
class LayerwiseRetriever(_LayerTasks):
    """Loads a batch of requests' blocks into the KV cache, layer by layer, ``depth`` layers ahead.

    Every rank loads every block of its namespace (as :meth:`kvflow.KVPool.retrieve`). Use from the
    pool's event loop.
    """

    depth: int = attrs.field(validator=positive_int)
    after: DeviceEvent | None = None  # nothing is written into the cache before it (KVPool.retrieve)
    _job: LoadJob = attrs.field(init=False)
    _started: int = attrs.field(default=0, init=False)  # layers whose fetch has started
    _settled: list[anyio.Event] = attrs.field(factory=list, init=False)  # per layer, once its copies ended
    _whole: list[bool] = attrs.field(factory=list, init=False)  # per layer: every block arrived intact

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._job = LoadJob(self.transfer, self.plan, self.after)

    def _start(self, tg: TaskGroup) -> None:
        self._settled = [anyio.Event() for _ in range(self.num_layers)]
        self._whole = [False] * self.num_layers
        self._fetch_through(self.depth - 1)

    async def arrived_whole(self, layer: int) -> bool:
        """Whether layers ``0..layer`` arrived whole in the cache: every block got, and every copy
        into the cache completed without a device error (known only once it completed). Waits
        until those layers settled; False for a layer never fetched once the retriever ended, and
        when the retriever never ran."""
        if not self._settled:
            return False
        for below in range(layer + 1):
            await self._settled[below].wait()
            if not self._whole[below]:
                return False
        return True

    def _advance(self, layer: int) -> None:
        self._fetch_through(layer + self.depth)

    def _fetch_through(self, last: int) -> None:
        tg = self._tg
        assert tg is not None
        while self._started <= min(last, self.num_layers - 1):
            tg.start_soon(self._fetch, self._started)
            self._started += 1

    async def _fetch(self, layer: int) -> None:
        deadline = self._deadline()
        try:
            failed = await self._job.get(layer, deadline)
            self._finish(layer, failed, self._job.ready(layer))  # handed out: the engine may wait on it
            copied = await self._job.settle(layer, deadline)  # then the staging chunks go back
            self._whole[layer] = failed == 0 and copied
        finally:
            self._settled[layer].set()

    async def _cleanup(self) -> None:
        await self._job.settle_all(self._deadline())
        for settled in self._settled:  # layers never fetched: not whole
            settled.set()

    def results(self) -> list[RetrieveResult]:
        """One :class:`RetrieveResult` per request: a block is a HIT only if every layer of it was
        loaded; otherwise the engine must recompute it."""
        return self._job.results()
