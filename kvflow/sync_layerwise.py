"""SyncLayerwisePool: layer-by-layer loads and stores for a synchronous engine's forward pass.

The engine calls, on its own thread, in this order per step (a vLLM connector maps its hooks one to one)::

    kv.start_load(requests)             # start_load_kv: before the forward
    kv.start_store(requests)            # before the step's first save_layer
    for layer in range(kv.num_layers):
        kv.wait_for_layer_load(layer)   # wait_for_layer_load: blocks until this layer is in place
        ...                             # launch the layer's kernels
        kv.save_layer(layer)            # save_kv_layer: records an event; never blocks
    result = kv.wait_for_save()         # wait_for_save: every put of the step finished or failed

The transfers run on kvflow's loop thread (as :class:`~kvflow.SyncPool`'s do): a
:class:`~kvflow.layerwise.LayerwiseRetriever` and a :class:`~kvflow.layerwise.LayerwiseStorer`
per step, each in one task on that loop. ``save_layer`` and ``wait_for_layer_load`` never
cross into the loop: the storer polls the step's layer events, and the retriever reports each
layer through a condition the engine thread waits on. ``start_load`` and ``start_store`` cross
once per step. A step ends in ``wait_for_save``; after it no transfer of the step touches the
step's blocks any more.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvflow.backends import Backend, GetStatus
from kvflow.config import PoolConfig, positive_int
from kvflow.device import Device
from kvflow.errors import ConfigError, PoolClosedError, RequestError
from kvflow.events import DeviceEvent, LayerEvents, make_event
from kvflow.layerwise import LayerOutcome, LayerwiseRetriever, LayerwiseStorer
from kvflow.layout import KVFormat, KVLayout
from kvflow.ownership import ParallelConfig
from kvflow.pool import check_timeout
from kvflow.request import KVRequest, as_index
from kvflow.results import RetrieveResult, StoreResult
from kvflow.sync import SyncPool, start_pool, stop_pool

if TYPE_CHECKING:
    from typing import Self

__all__ = ["StepResult", "SyncLayerwisePool"]

log = logging.getLogger(__name__)

_LEAST_S = 1e-3  # what close leaves the pool's own close when the step took its whole bound

_NOT_LAYERWISE = (
    "the layerwise face needs a pool made with PoolConfig(layerwise=True); use the same setting in "
    "the scheduler's pool, so that its lookups see the per-layer objects"
)


@attrs.frozen
class StepResult:
    """What a step's transfers did, by request id."""

    stored: Mapping[str, StoreResult]
    loaded: Mapping[str, RetrieveResult]

    @property
    def failed_block_ids(self) -> frozenset[int]:
        """Blocks a load of this step did not fill: the engine must recompute them."""
        return frozenset(b for result in self.loaded.values() for b in result.failed_block_ids)


@attrs.define(eq=False)
class _Step:
    """One forward step's layerwise work. The engine thread owns it; the loop thread reports into
    it under ``_cond``."""

    events: LayerEvents | None = None
    loader: LayerwiseRetriever | None = None
    storer: LayerwiseStorer | None = None
    saved: bool = False  # save_layer was called (engine thread)
    load_timed_out: bool = False  # the engine stopped waiting for a layer (engine thread)
    load_failed: bool = False  # a layer's load wait said False: later layers rest on missing KV
    closed: bool = False  # the pool was closed under the step (by any thread): nothing it loaded counts
    futures: list[concurrent.futures.Future[None]] = attrs.field(factory=list)
    _cond: threading.Condition = attrs.field(factory=threading.Condition)
    _running: int = 0
    _load_ended: bool = False  # the loader's task ended (loop thread, under _cond)
    _layers_in: list[LayerOutcome] = attrs.field(factory=list)  # per layer handed out
    _loaded: list[RetrieveResult] = attrs.field(factory=list)
    _stored: list[StoreResult] = attrs.field(factory=list)
    _error: Exception | None = None

    # -- loop thread --------------------------------------------------------------------------

    def layer_loaded(self, outcome: LayerOutcome) -> None:
        with self._cond:
            self._layers_in.append(outcome)
            self._cond.notify_all()

    def finish(
        self,
        *,
        loaded: list[RetrieveResult] | None = None,
        stored: list[StoreResult] | None = None,
        error: Exception | None = None,
        load_ended: bool = False,
    ) -> None:
        with self._cond:
            self._load_ended = self._load_ended or load_ended
            self._loaded = loaded or self._loaded
            self._stored = stored or self._stored
            self._error = self._error or error
            self._running -= 1
            self._cond.notify_all()

    # -- engine thread ------------------------------------------------------------------------

    def spawn(
        self, submit: Callable[..., concurrent.futures.Future[None]], *args: Any, loads: bool = False
    ) -> None:
        """Run ``submit(*args)`` (a load when ``loads``) as one of the step's drivers. If it cannot
        be submitted (a closed pool) it has ended at once: a load, with no layer handed out."""
        with self._cond:
            self._running += 1
        try:
            future = submit(*args)
        except BaseException:
            self.finish(load_ended=loads)
            raise
        with self._cond:  # one step with close()'s: a driver started as the pool closes is cancelled too
            self.futures.append(future)
            closed = self.closed
        if closed:
            future.cancel()

    def close(self) -> None:
        """The pool is closing under the step (any thread): cancel its drivers, and any started later."""
        with self._cond:
            self.closed = True
            futures = list(self.futures)
        for future in futures:
            future.cancel()

    def wait_layer(self, layer: int, timeout_s: float) -> LayerOutcome | bool | None:
        """``layer``'s outcome once handed out; False if the load ended without it; None if the
        wait timed out."""
        with self._cond:
            # Not "nothing running": a storer waits for layer events this blocked engine never records.
            ready = self._cond.wait_for(lambda: len(self._layers_in) > layer or self._load_ended, timeout_s)
            if not ready:
                return None
            return self._layers_in[layer] if len(self._layers_in) > layer else False

    def wait_finished(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout_s)

    @property
    def has_error(self) -> bool:
        """A transfer of the step raised (a programming error, which wait_for_save raises)."""
        with self._cond:
            return self._error is not None

    def wait_load_ended(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._load_ended, timeout_s)

    def loads(self, *, failed: bool = False) -> dict[str, RetrieveResult]:
        """The loader's results by request id; every block failed when ``failed``, or when the
        engine computed without some layer (the pool closed under the step, a layer never came)."""
        loader = self.loader
        if loader is None:
            return {}
        if failed or self.load_timed_out or self.closed:  # (the loader may still run: from its plan)
            plan, size = loader.plan, loader.transfer.format.block_size
            return {
                rid: RetrieveResult(tuple(plan.block_ids[a:b]), (GetStatus.FAILED,) * (b - a), size)
                for rid, (a, b) in zip(loader.request_ids, plan.spans)
            }
        with self._cond:
            loaded = self._loaded
        return dict(zip(loader.request_ids, loaded))

    def result(self) -> StepResult:
        with self._cond:
            if self._error is not None:
                raise self._error
            stored = self._stored
        return StepResult(dict(zip(self.storer.request_ids, stored)) if self.storer else {}, self.loads())


def _check_named(requests: Sequence[KVRequest]) -> None:
    """A step's results are by request id (:class:`StepResult`): requests without one would share
    the empty id, and all but one's results would be lost (its failed blocks with them)."""
    if len(requests) > 1 and not all(request.request_id for request in requests):
        raise RequestError(
            "a step of several requests needs a request_id on each (its results are by id); "
            "set KVRequest.request_id"
        )


async def _drive_load(step: _Step, loader: LayerwiseRetriever) -> None:
    error: Exception | None = None
    try:
        async with loader:
            async for outcome in loader:
                step.layer_loaded(outcome)
    except PoolClosedError:  # closed (from another thread) before the step's transfers began
        step.close()
    except Exception as exc:  # a programming error: wait_for_save raises it
        error = exc
    finally:
        step.finish(loaded=loader.results(), error=error, load_ended=True)


async def _drive_store(step: _Step, storer: LayerwiseStorer) -> None:
    error: Exception | None = None
    try:
        async with storer:
            async for _ in storer:
                pass
    except PoolClosedError:  # as in _drive_load: the step ends as a cancelled one
        step.close()
    except Exception as exc:  # a programming error: wait_for_save raises it
        error = exc
    finally:
        step.finish(stored=storer.results(), error=error)


@attrs.define(eq=False)
class SyncLayerwisePool(SyncPool):
    """A :class:`SyncPool` of a layerwise pool, plus the per-step face of an engine's forward pass.

    Make it with :meth:`open`. Call the step methods from one engine thread; the :class:`SyncPool`
    methods (whole requests, every layer at once) from any thread but the loop thread. ``depth``
    is how many layers a load keeps in flight ahead of the engine; ``event_factory`` makes the
    event :meth:`save_layer` records (default: the kind the KV cache's device needs).
    """

    depth: int = attrs.field(default=1, kw_only=True, validator=positive_int)
    event_factory: Callable[[], DeviceEvent] | None = attrs.field(default=None, kw_only=True)
    _step: _Step | None = attrs.field(default=None, init=False)
    _device: Device = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not self.config.layerwise:
            raise ConfigError(_NOT_LAYERWISE)
        if self.event_factory is None:
            self.event_factory = functools.partial(make_event, self.kv_layout.device)
        self._device = self._pool.device or Device.of(self.kv_layout.device)

    @classmethod
    def open(
        cls,
        config: PoolConfig | None = None,
        *,
        layout: KVLayout | None = None,
        format: KVFormat | None = None,
        parallel: ParallelConfig | None = None,
        backend: Backend | None = None,
        device: Device | None = None,
        depth: int = 1,
        event_factory: Callable[[], DeviceEvent] | None = None,
    ) -> Self:
        """Start the loop thread and a layerwise pool over ``layout`` (required) on it."""
        config = config or PoolConfig(layerwise=True)
        if not config.layerwise:
            raise ConfigError(_NOT_LAYERWISE)
        if layout is None or format is not None:
            raise ConfigError("the layerwise face moves KV: open it with the KV caches' layout, not a format")
        loop, pool = start_pool(config, layout=layout, parallel=parallel, backend=backend, device=device)
        try:
            return cls._on_loop(loop, pool, depth=depth, event_factory=event_factory)
        except BaseException:
            try:
                stop_pool(loop, pool, None)  # stops the loop thread even when the close raises
            except Exception:  # the refusal is the error to raise, not this
                log.warning("closing the refused layerwise pool failed too", exc_info=True)
            raise

    @property
    def kv_layout(self) -> KVLayout:
        layout = self.layout
        assert layout is not None  # opened with a layout
        return layout

    @property
    def num_layers(self) -> int:
        return self.format.num_layers

    # -- one forward step -----------------------------------------------------------------------

    def start_load(self, requests: Sequence[KVRequest]) -> None:
        """Start loading ``requests``' blocks, layer 0 first. Once per step, before the forward.
        No block is written before an event recorded now on the engine's stream (from
        ``event_factory``) completed: work already queued there may still write the blocks.

        Raises RequestError for a malformed request, or for several of which one has no
        ``request_id`` (the step's result is by id); nothing is loaded then.
        """
        if not requests:
            return
        _check_named(requests)
        step = self._current(starting=True)
        if step.loader is not None:
            raise RequestError("start_load was already called in this step; pass all its requests at once")
        assert self.event_factory is not None
        # The engine's stream may still run earlier steps' work on these blocks (their previous
        # owner's): the loads write none before it is done.
        engine_done = self.event_factory()
        engine_done.record()
        loader = self._pool.layerwise_retrieve(requests, depth=self.depth, after=engine_done)  # plans only
        step.loader = loader  # (refused below, the step's load has failed: its layers wait no more)
        if step.storer is not None:  # (started first) its layers rest on this load too
            step.storer.loaded_by = loader
        step.spawn(self._loop.submit, _drive_load, step, loader, loads=True)

    def start_store(self, requests: Sequence[KVRequest]) -> None:
        """Store ``requests``' owned blocks as the step's layers are saved. Once per step, before its
        first :meth:`save_layer`. Raises RequestError for a malformed request, or for several of
        which one has no ``request_id``."""
        if not requests:
            return
        _check_named(requests)
        step = self._current(starting=True)
        if step.storer is not None:
            raise RequestError("start_store was already called in this step; pass all its requests at once")
        if step.saved:
            raise RequestError(
                "start_store came after save_layer in this step; call it before the first save_layer"
            )
        assert self.event_factory is not None
        events = LayerEvents.create(self.num_layers, self.event_factory)
        storer = self._pool.layerwise_store(requests, events, loaded_by=step.loader)  # plans only
        step.events, step.storer = events, storer
        step.spawn(self._loop.submit, _drive_store, step, storer)

    def save_layer(self, layer: int) -> None:
        """Layer ``layer``'s KV writes have been launched: record its event on the current stream.
        Never blocks; the step's storer puts the layer once the event fires.

        Once :meth:`wait_for_layer_load` said False in this step, nothing more is stored: the rest
        of the forward rests on KV that did not arrive, and the storer skips the layers not
        recorded."""
        step = self._current()
        layer = self._check_layer(layer)
        step.saved = True
        if step.events is not None and not step.load_failed:
            step.events.record(layer)

    def wait_for_layer_load(self, layer: int, timeout_s: float | None = None) -> bool:
        """Block until layer ``layer`` of the step's loads is in place (at once when there are none).

        True when every block of the layer arrived. False when some block missed or failed, or
        after ``timeout_s`` (default: the pool's timeout), or once the pool was closed (from any
        thread); then the step reports every loaded block failed, because the engine computes
        without the layer. :meth:`wait_for_save` has the blocks. RuntimeError at once on the loop
        thread, PoolClosedError in a process forked from the pool's.
        """
        check_timeout(timeout_s)
        self._loop.check_can_wait("SyncLayerwisePool.wait_for_layer_load")
        layer = self._check_layer(layer)
        step = self._step
        if step is None or step.loader is None:
            return True
        if step.load_timed_out or step.closed:
            step.load_failed = True
            return False
        deadline = time.monotonic() + (self._timeout if timeout_s is None else timeout_s)
        arrived = step.wait_layer(layer, deadline - time.monotonic())
        why = "was not loaded in time"
        if isinstance(arrived, LayerOutcome):
            try:
                for event in arrived.ready:  # staged copies into the cache: the engine's stream waits
                    self._device.wait_current(event, max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # a host wait (no device stream) ran out: the layer may not be there
                arrived = None
            except Exception as exc:  # a host wait heard the device say a copy failed
                arrived, why = None, f"failed on the device ({exc!r})"
            else:
                if not arrived.ok:
                    step.load_failed = True
                return arrived.ok
        if arrived is None:
            step.load_timed_out = True
            log.warning("layer %d %s; the step's loaded blocks count as failed", layer, why)
        step.load_failed = True
        return False

    def wait_for_load(self, timeout_s: float | None = None) -> Mapping[str, RetrieveResult]:
        """The step's loads by request id, once its loader ended: at once after the forward waited
        for every layer. For an engine that must know them before :meth:`wait_for_save` (vLLM
        asks for a step's load errors before it with speculative decoding). Every block of them is
        failed when the engine computed without some layer, the pool was closed under the step, a
        transfer raised, or the loader did not end within ``timeout_s`` (default: the pool's;
        :meth:`wait_for_save` then waits for it its own timeout, and cancels it). Empty when the
        step loads nothing; :meth:`wait_for_save` reports the loads again. RuntimeError at once on
        the loop thread, PoolClosedError in a process forked from the pool's."""
        check_timeout(timeout_s)
        self._loop.check_can_wait("SyncLayerwisePool.wait_for_load")
        step = self._step
        if step is None or step.loader is None:
            return {}
        if step.load_timed_out or step.closed:  # failed whatever the loader says: no wait for it
            return step.loads()
        if not step.wait_load_ended(self._timeout if timeout_s is None else timeout_s):
            step.load_timed_out = True
            log.warning("the step's layerwise load did not end in time; its loaded blocks count as failed")
        return step.loads(failed=step.has_error)

    def wait_for_save(self, timeout_s: float | None = None) -> StepResult:
        """End the step: block until every put of the step finished or failed (and every load ended).

        Layers never saved are not stored. After ``timeout_s`` (default: the pool's timeout) the
        step's transfers are cancelled and reported failed. Raises the error a transfer raised if
        it was a programming error (a misconfigured backend), never for a failed put or get.
        Raises TimeoutError if a transfer does not stop even when cancelled; the step then stays
        current, so that :meth:`close` still cancels and waits for it. After a :meth:`close` (from
        any thread) it ends the step as cancelled: every block it loaded is reported failed.
        """
        check_timeout(timeout_s)
        self._loop.check_can_wait("SyncLayerwisePool.wait_for_save")
        step = self._step
        if step is None:
            return StepResult({}, {})
        if step.events is not None:
            step.events.seal()
        self._end(step, self._timeout if timeout_s is None else timeout_s)
        self._step = None  # only now: nothing of the step runs any more
        return step.result()

    def close(self, timeout_s: float | None = None) -> bool:
        """Cancel the current step's transfers, close the pool and stop the loop thread (bounded by
        ``timeout_s``, default the pool's); False when something had to be abandoned. Called from
        another thread mid-step, the engine thread's step goes on to its end as a cancelled one:
        its layer waits say False and :meth:`wait_for_save` reports every block it loaded failed.
        In a process forked from the pool's, it returns False at once."""
        check_timeout(timeout_s)
        self._loop.check_off_loop("closing a SyncLayerwisePool")
        deadline = time.monotonic() + (self._timeout if timeout_s is None else timeout_s)
        step = self._step  # left current, for the engine thread to end (in wait_for_save)
        if step is not None and not self._loop.forked:  # (a forked child's transfers run in the parent)
            step.close()  # (its events are not sealed here: the engine thread may record them)
            step.wait_finished(max(0.0, deadline - time.monotonic()))
        return super().close(max(_LEAST_S, deadline - time.monotonic()))  # one bound for both

    # -- helpers ----------------------------------------------------------------------------------

    @property
    def _timeout(self) -> float:
        return self.config.timeout_s

    def _current(self, *, starting: bool = False) -> _Step:
        """The current step (a new one if none); ``starting`` a transfer, PoolClosedError if the
        pool was closed under it."""
        if self._step is None:
            self._step = _Step()
        if starting and self._step.closed:
            raise PoolClosedError(
                "the pool was closed during this step: end it with wait_for_save (it reports the "
                "step's loads failed), then open a new pool"
            )
        return self._step

    def _check_layer(self, layer: int) -> int:
        """``layer`` as an int in range; RequestError for a ``bool``, a float, one out of range."""
        layer = as_index(layer, "a layer")
        if layer >= self.num_layers:
            raise RequestError(f"layer {layer} is out of range: the KV cache has {self.num_layers} layers")
        return layer

    def _end(self, step: _Step, timeout_s: float) -> None:
        if step.wait_finished(timeout_s):
            return
        log.warning("the step's layerwise transfers did not finish within %.1f s; cancelling them", timeout_s)
        for future in step.futures:
            future.cancel()
        if not step.wait_finished(timeout_s):
            raise TimeoutError(
                f"the step's layerwise transfers did not stop within {timeout_s} s of being cancelled; "
                "a backend call is stuck, so do not reuse the step's blocks: restart the engine's KV pool"
            )
