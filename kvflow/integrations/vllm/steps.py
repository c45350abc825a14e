"""How a worker moves one engine step's KV: whole blocks around the forward, or layer by layer in it.

Both kinds are driven by the worker's model-runner thread, in vLLM's order per step:
``load`` (before the forward, only when the step has loads) -> per layer ``wait_for_layer`` and
``save_layer`` -> ``finish`` (after the forward). ``finish`` answers with a :class:`StepOutcome`.

Either way a step's transfers stop touching its blocks before the step ends: a load before the
forward reads the blocks (or, layer by layer, before each layer does), a store before ``finish``
returns. So vLLM may free or reuse any block as soon as the step is over: no block is held for
kvflow between steps (which is what lets vLLM's prefix-cache reset, sleep and pause work on an idle
engine), except the blocks of an asynchronous load, which vLLM holds until every worker reports it.

- :class:`BlockSteps`: ``load`` gets every block of the step's loads and waits for them, so the
  forward reads complete blocks; ``finish`` stores the blocks the step computed and waits until
  the stores have read them: copied out to host staging (a device cache), or put (a host cache).
  Each moves all of the step's requests in one pool call. The outcome holds the stores' results
  as they ended by then (a staged put may still run: its result is counted when the next step
  ends). With ``wait_stored`` (a ``kv_producer``: a decode engine looks the blocks up as soon as
  the request's output is out) ``finish`` also waits for staged puts, so every store has ended
  when the step does.
- :class:`LayerwiseSteps`: one object per block and layer, through :class:`kvflow.SyncLayerwisePool`.
  ``load`` starts a layerwise retriever that fetches layer l+1 while layer l computes;
  ``wait_for_layer`` blocks until a layer is in place; the first ``save_layer`` starts a layerwise
  storer that puts each layer once the forward has written it; ``finish`` waits until every put of
  the step ended.

The scheduler side plans no save that reads a block whose load is not known good on every rank
(see :mod:`.scheduler`). On top of that, a rank whose load failed stores nothing of its step
(:attr:`StepOutcome.dropped`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import TypeVar

import attrs
import torch

from kvflow.errors import BackendError
from kvflow.events import DeviceEvent, make_event
from kvflow.integrations.vllm.timing import Stopwatch
from kvflow.loop import CallFuture
from kvflow.request import KVRequest
from kvflow.results import RetrieveResult, StoreResult
from kvflow.sync import SyncPool
from kvflow.sync_layerwise import SyncLayerwisePool

__all__ = ["STILL_RUNNING_LOG_S", "BlockSteps", "LayerwiseSteps", "StepOutcome", "each_result", "wait_ended"]

log = logging.getLogger(__name__)

T = TypeVar("T")


#: A sync load, its result (None: it failed as a whole) and the seconds it took.
Loaded = tuple[KVRequest, RetrieveResult | None, float]
#: A save, its store (possibly still running) and when that started and ended.
Storing = tuple[KVRequest, "concurrent.futures.Future[StoreResult]", Stopwatch]

#: How often a transfer still running past its deadline is logged (it may still touch its blocks,
#: so nothing may report it ended before it has).
STILL_RUNNING_LOG_S = 30.0


@attrs.frozen
class StepOutcome:
    """What one step's transfers did. ``loads``: each sync load, its result (None: it failed as a
    whole) and its seconds; ``stores``: each save and its store (no longer reading the step's
    blocks; a staged put may still be running) with its stopwatch; ``dropped``: saves not stored
    because a load of the step failed on this rank."""

    loads: tuple[Loaded, ...] = ()
    stores: tuple[Storing, ...] = ()
    dropped: tuple[KVRequest, ...] = ()

    @property
    def load_failed(self) -> bool:
        return any(result is None or result.failed_block_ids for _, result, _ in self.loads)


def wait_ended(future: CallFuture[T], what: str, log_every_s: float = STILL_RUNNING_LOG_S) -> T | None:
    """The transfer's result, or None (logged) if it raised.

    Waits until the transfer has really ended, however long: one still running at its
    ``answer_by`` may still read or write its blocks, and vLLM would reuse them once this returned.
    Logs an error then and every ``log_every_s`` after that.
    """
    started = time.monotonic()
    unbounded = future.answer_by == float("inf")  # (submitted without a bound: log as it waits)
    wait = log_every_s if unbounded else max(0.0, future.answer_by - started)
    while True:
        try:
            return future.result(wait)
        except concurrent.futures.TimeoutError:
            # The pool bounds every call itself, so this is a stuck call inside kvflow or its backend.
            wait = log_every_s
            log.error(
                "a kvflow %s is still running after %.0f s; the engine waits for it, because it may "
                "still touch its blocks (check the store backend)",
                what,
                time.monotonic() - started,
            )
        except Exception as exc:
            log.warning("a kvflow %s failed: %r", what, exc)
            return None


def wait_released(
    released: threading.Event, future: CallFuture[T], log_every_s: float = STILL_RUNNING_LOG_S
) -> None:
    """Wait until a store no longer reads its blocks (``released``), or has ended anyway. Waits
    however long, logging past the store's ``answer_by``: vLLM reuses the blocks once this returns."""
    started = time.monotonic()
    next_log = future.answer_by
    while not released.wait(0.05) and not future.done():
        if time.monotonic() >= next_log:
            log.error(
                "a kvflow store still reads its blocks after %.0f s; the engine waits for it (check the "
                "store backend)",
                time.monotonic() - started,
            )
            next_log = time.monotonic() + log_every_s


def _completed(result: StoreResult) -> concurrent.futures.Future[StoreResult]:
    future: concurrent.futures.Future[StoreResult] = concurrent.futures.Future()
    future.set_result(result)
    return future


def each_result(future: concurrent.futures.Future[list[T]], count: int) -> list[concurrent.futures.Future[T]]:
    """A future per request of a call that moves ``count`` requests, resolved when the call ends
    (never before: a request's blocks are in use until then): its own result, or the call's
    error."""
    each: list[concurrent.futures.Future[T]] = [concurrent.futures.Future() for _ in range(count)]

    def resolve(done: concurrent.futures.Future[list[T]]) -> None:
        error = done.exception() if not done.cancelled() else concurrent.futures.CancelledError()
        if error is None and len(done.result()) != count:
            error = BackendError(f"a call of {count} requests answered {len(done.result())} results")
        for i, one in enumerate(each):
            if error is not None:
                one.set_exception(error)
            else:
                one.set_result(done.result()[i])

    future.add_done_callback(resolve)
    return each


def device_needs_event(device: torch.device) -> bool:
    """Whether KV on ``device`` is written asynchronously to the host (GPU and NPU streams)."""
    return device.type != "cpu"


def engine_event(pool: SyncPool) -> DeviceEvent | None:
    """An event recorded now on the engine's current stream, for a cache on a device (None on the
    CPU, where the forward is done when the host returns from it): a store reads no block before
    it, a load writes none (with asynchronous scheduling the stream may still run an earlier
    step, writing blocks vLLM has just handed to a loading request)."""
    layout = pool.layout
    assert layout is not None  # a worker's pool has its KV caches
    if not device_needs_event(layout.device):
        return None
    event = make_event(layout.device)
    event.record()
    return event


@attrs.define(eq=False)
class BlockSteps:
    """Whole-block loads before the forward, whole-block stores after it, both within the step."""

    pool: SyncPool
    wait_stored: bool = False
    _load_failed: bool = attrs.field(default=False, init=False)
    _early: _StepLoad | None = attrs.field(default=None, init=False)

    def start_early(self, spans: Sequence[KVRequest]) -> None:
        """Submit the step's loads ahead of :meth:`load` of the same ``spans``, which waits for
        them: vLLM prepares the step's inputs meanwhile. Only for a step in which nothing else
        writes the loads' blocks before the forward (the scheduler side says so:
        ``KVFlowConnectorMetadata.load_early``)."""
        self._end_early()  # (one whose step never reached its load ends before another starts)
        self._early = self._submit(spans)

    def _submit(self, spans: Sequence[KVRequest]) -> _StepLoad:
        """The step's loads in one pool call, timed from now."""
        watch = Stopwatch()
        future = self.pool.submit_retrieve_many(spans, after=engine_event(self.pool))
        return _StepLoad(spans, future, watch.watch(future))

    def end_other_early(self, spans: Sequence[KVRequest]) -> None:
        """Wait for a load started early that is not of ``spans``: its step never reached its
        load (vLLM failed in between), and it must end before another step uses its blocks."""
        if self._early is not None and self._early.spans is not spans:
            self._end_early()

    def _end_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            wait_ended(early.future, "load")

    def load(self, spans: Sequence[KVRequest]) -> tuple[Loaded, ...]:
        """Load every block now, the step's loads in one call (or wait for them, started by
        :meth:`start_early`); the results (the caller records them at once)."""
        self.end_other_early(spans)
        early, self._early = self._early, None
        load = early if early is not None else self._submit(spans)
        future, watch = load.future, load.watch
        results: Sequence[RetrieveResult | None] | None = wait_ended(future, "load")
        if results is None:  # the call failed as a whole: every load of the step failed
            results = [None] * len(spans)
        loaded = tuple((span, result, watch.seconds) for span, result in zip(spans, results))
        self._load_failed = self._load_failed or StepOutcome(loaded).load_failed
        return loaded

    def wait_for_layer(self, layer: int) -> bool:
        return True  # load() already waited for every block

    def save_layer(self, layer: int, saves: Sequence[KVRequest]) -> None:
        """Nothing: whole blocks are stored after the forward."""

    def finish(self, saves: Sequence[KVRequest]) -> StepOutcome:
        """Store the step's computed blocks and wait until the stores have read them (the step's
        loads were reported by :meth:`load`)."""
        failed, self._load_failed = self._load_failed, False
        if failed:
            return StepOutcome(dropped=tuple(saves))
        if not saves:
            return StepOutcome()
        # The host returns from the forward before the device finishes it: order the reads.
        written = engine_event(self.pool)
        # The step's stores in one call: one plan and batched backend calls for every request.
        released, watch = threading.Event(), Stopwatch()
        future = self.pool.submit_store_many(saves, after=written, on_released=released.set)
        watch.watch(future)
        wait_released(released, future)  # once copied out, vLLM may reuse the blocks
        if self.pool.device is None or self.wait_stored:
            # Direct puts: released means stored, the result follows at once. A producer waits
            # for staged puts too: its request's output must not leave before its blocks are in.
            wait_ended(future, "store")
        return StepOutcome(stores=tuple(zip(saves, each_result(future, len(saves)), [watch] * len(saves))))

    def close(self) -> None:
        self._early = None  # (a load started early, never waited for: the pool's close waits, bounded)
        _closed(self.pool.close())


@attrs.define(eq=False)
class _StepLoad:
    """A step's loads in flight: submitted by :meth:`BlockSteps.load`, or before vLLM prepared the
    step's inputs (:meth:`BlockSteps.start_early`)."""

    spans: Sequence[KVRequest]  # the metadata's own tuple: the load of the same step passes it again
    future: CallFuture[list[RetrieveResult]]
    watch: Stopwatch


@attrs.define(eq=False)
class LayerwiseSteps:
    """Layer-by-layer loads and stores inside the forward, through kvflow's layerwise face."""

    engine: SyncLayerwisePool
    _loads: tuple[KVRequest, ...] = attrs.field(default=(), init=False)  # started, not yet reported
    _storing: bool = attrs.field(default=False, init=False)
    _saved: set[int] = attrs.field(factory=set, init=False)  # layers recorded this step
    _load_failed: bool = attrs.field(default=False, init=False)
    _load_watch: Stopwatch | None = attrs.field(default=None, init=False)  # start -> last layer in
    _store_started: float = attrs.field(default=0.0, init=False)
    _early: Sequence[KVRequest] | None = attrs.field(default=None, init=False)  # loads started early

    @property
    def pool(self) -> SyncPool:
        """The pool itself, for whole-request calls (asynchronous loads of every layer)."""
        return self.engine

    def start_early(self, spans: Sequence[KVRequest]) -> None:
        """Start the layerwise load ahead of :meth:`load` of the same ``spans``, which then adds
        nothing: its first layers arrive while vLLM prepares the step's inputs. Only for a step in
        which nothing else writes the loads' blocks before the forward (as :class:`BlockSteps`)."""
        self.end_other_early(spans)
        self.load(spans)
        self._early = spans

    def end_other_early(self, spans: Sequence[KVRequest]) -> None:
        """End the step of a load started early that is not of ``spans``: that step never reached
        its load (vLLM failed in between); its transfers end before another step starts."""
        if self._early is not None and self._early is not spans:
            self._early = None
            self.finish(())

    def load(self, spans: Sequence[KVRequest]) -> tuple[Loaded, ...]:
        """Start the layerwise load (unless :meth:`start_early` did); its results come with
        :meth:`end_loads`."""
        if self._early is not None and self._early is spans:
            self._early = None
            return ()
        self.end_other_early(spans)
        self._loads = tuple(spans)
        self._load_watch = Stopwatch()
        self.engine.start_load(spans)
        return ()

    def end_loads(self) -> tuple[Loaded, ...]:
        """The step's loads, once they ended (at once after the forward waited for every layer),
        each reported once: the caller records them when vLLM asks for the step's load errors,
        which speculative decoding does before :meth:`finish`."""
        loads, self._loads = self._loads, ()
        if not loads:
            return ()
        watch = self._load_watch or Stopwatch()
        loaded = self.engine.wait_for_load()
        return tuple((span, loaded.get(span.request_id), watch.seconds) for span in loads)

    def wait_for_layer(self, layer: int) -> bool:
        arrived = self.engine.wait_for_layer_load(layer)
        if not arrived:
            self._load_failed = True
        if self._load_watch is not None:
            self._load_watch.ended = time.monotonic()
        return arrived

    def save_layer(self, layer: int, saves: Sequence[KVRequest]) -> None:
        if not saves or self._load_failed:
            # After a failed layer the rest of the forward may rest on missing KV: record no more
            # layers, so the storer skips them and the store never holds a partly wrong block.
            return
        if layer in self._saved:
            # A draft model's pass again (speculative decoding): its later passes write the KV of
            # drafted tokens, past the blocks this step stores. Recorded once, at the first.
            return
        self._saved.add(layer)
        if not self._storing:
            self.engine.start_store(saves)
            self._storing = True
            self._store_started = time.monotonic()
        self.engine.save_layer(layer)

    def finish(self, saves: Sequence[KVRequest]) -> StepOutcome:
        """End the step: its loads not yet reported (:meth:`end_loads`) and its stores."""
        loads, storing, failed = self._loads, self._storing, self._load_failed
        watch, store_started = self._load_watch or Stopwatch(), self._store_started
        self._loads, self._storing, self._load_failed, self._load_watch = (), False, False, None
        self._saved = set()
        try:
            result = self.engine.wait_for_save()
        except BackendError as exc:  # a backend fault: count everything of the step as failed
            # A TimeoutError (a transfer that would not stop) or a programming error propagates:
            # the step's blocks may still be written, so going on as if it failed would be wrong.
            log.error("kvflow's layerwise transfers of this step failed: %r; recomputing its loads", exc)
            return StepOutcome(tuple((span, None, watch.seconds) for span in loads), dropped=tuple(saves))
        loaded = tuple((span, result.loaded.get(span.request_id), watch.seconds) for span in loads)
        if failed or not storing:  # after a failed load the saves stopped: not stored, for the load
            return StepOutcome(loaded, dropped=tuple(saves) if failed else ())
        stored = result.stored
        ended = Stopwatch(store_started, time.monotonic())
        stores = tuple(
            (span, _completed(stored[span.request_id]), ended) for span in saves if span.request_id in stored
        )
        return StepOutcome(loaded, stores, dropped=tuple(s for s in saves if s.request_id not in stored))

    def close(self) -> None:
        self._early = None  # (the engine's close ends a step started early, bounded)
        _closed(self.engine.close())


def _closed(ended: bool) -> None:
    if not ended:
        log.warning(
            "kvflow: a transfer was still running when the worker shut down (its pool's timeout ran "
            "out); it may still read or write the KV cache until the process ends"
        )
