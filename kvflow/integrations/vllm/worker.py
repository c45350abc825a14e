"""The worker side of the connector: loads, stores, and what each step reports back to vLLM.

Every method runs on the worker's model-runner thread. Transfers run on kvflow's loop thread; this
side submits them (through :mod:`.steps`) and waits on futures. A transfer is never reported ended
before its future is: a get or put past its deadline may still touch its blocks. Such a transfer
is logged as an error periodically and waited for.

Block lifetime: a step's loads and stores end inside the step (:mod:`.steps`), so vLLM may reuse
every block once the step is over and a finished or preempted request's blocks are never held for
kvflow. The one exception is an asynchronous load: it writes blocks of a request vLLM keeps waiting
(and does not free, even when it is aborted) until every worker lists it as finished receiving.

What each step reports: asynchronous loads that ended (``get_finished``), the blocks any load of
this worker failed to fill (``take_load_errors``), the steps whose loads have ended
(:meth:`worker_meta`), which the scheduler side needs before it stores anything computed from them,
what moved and how long it took (:meth:`take_interval`, with whether the store is reachable:
:mod:`.health`), and, with KV events on, the blocks it stored (:meth:`take_events`, :mod:`.events`).

A ``kv_producer`` waits for its staged puts too before a step ends (``BlockSteps.wait_stored``),
so its request's output leaves the engine only once the request's blocks are in the store.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

import attrs

from kvflow.integrations.vllm.agreement import FailedSteps, ranks_must_agree
from kvflow.integrations.vllm.clients import open_layerwise_pool, open_store, open_worker_pool
from kvflow.integrations.vllm.config import ConnectorConfig, KVRole
from kvflow.integrations.vllm.events import KVFlowKVEvents, WorkerEvent, stored_events
from kvflow.integrations.vllm.health import StoreWatch
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata, KVFlowHandshake, KVFlowWorkerMeta
from kvflow.integrations.vllm.steps import (
    STILL_RUNNING_LOG_S,
    BlockSteps,
    LayerwiseSteps,
    StepOutcome,
    each_result,
    engine_event,
)
from kvflow.integrations.vllm.timing import Stopwatch
from kvflow.integrations.vllm.topology import EngineShape, check_layer_names
from kvflow.integrations.vllm.wrapping import Wrapping
from kvflow.layout import KVCacheEntry, KVLayout
from kvflow.loop import CallFuture
from kvflow.metrics import Observations, TransferCounters
from kvflow.ownership import ParallelConfig, owned
from kvflow.request import KVRequest
from kvflow.results import RetrieveResult, StoreResult

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)

#: How many of the last steps' load failures a worker keeps for the saves waiting on them: a save
#: waits at most for the loads of its own step and of the step before (asynchronous scheduling).
_FAILED_STEPS_KEPT = 16


@attrs.define(eq=False)
class _AsyncLoad:
    span: KVRequest
    future: concurrent.futures.Future[RetrieveResult]
    deadline: float  # after it, a load still running is logged (and keeps its blocks until it ends)
    watch: Stopwatch


@attrs.define(eq=False)
class _Put:
    """A store whose result is counted once it ended (a staged put may outlive its step)."""

    span: KVRequest
    future: concurrent.futures.Future[StoreResult]
    watch: Stopwatch
    tokens: tuple[int, ...] | None  # the blocks' tokens, for KV events (None: events off)


@attrs.define(eq=False)
class WorkerSide:
    """Owns this worker's pool (through its step kind), the loads in flight and the counters."""

    config: ConnectorConfig
    shape: EngineShape
    tp_rank: int
    pp_rank: int
    #: With several ranks: which of a step's ``save_after`` steps failed on any rank (:mod:`.agreement`)
    agree: FailedSteps | None = None
    #: The connector vLLM runs kvflow inside, if any: with ``load_early=auto`` it decides whether
    #: loads may start in ``handle_preemptions`` (:mod:`.wrapping`)
    wrapping: Wrapping = attrs.field(factory=Wrapping, kw_only=True)
    _early: bool = attrs.field(default=True, init=False)  # loads may start in handle_preemptions
    _steps: BlockSteps | LayerwiseSteps | None = attrs.field(default=None, init=False)
    _layout: KVLayout | None = attrs.field(default=None, init=False)
    _layer_index: dict[str, int] = attrs.field(factory=dict, init=False)
    _async_loads: dict[str, _AsyncLoad] = attrs.field(factory=dict, init=False)
    _load_errors: set[int] = attrs.field(factory=set, init=False)
    _settled_steps: set[int] = attrs.field(factory=set, init=False)  # loads ended, not yet reported
    _loading_step: int | None = attrs.field(default=None, init=False)  # a layerwise load not yet recorded
    _idle: bool = attrs.field(default=False, init=False)  # this step computes nothing
    # Recent steps whose loads failed here: saves waiting for their verdict are dropped (save_after)
    _failed_steps: set[int] = attrs.field(factory=set, init=False)
    _puts: list[_Put] = attrs.field(factory=list, init=False)
    _counters: TransferCounters = attrs.field(factory=TransferCounters, init=False)
    _reported: TransferCounters = attrs.field(factory=TransferCounters, init=False)
    _samples: dict[str, list[float]] = attrs.field(factory=lambda: {"load": [], "store": []}, init=False)
    _events: list[Any] = attrs.field(factory=list, init=False)
    _watch: StoreWatch | None = attrs.field(default=None, init=False)
    _block_nbytes: int = attrs.field(default=0, init=False)
    _parallel: ParallelConfig | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if self.agree is None and ranks_must_agree(self.shape, self.config.layerwise):
            # Its scheduler plans saves resting on loads not yet settled: alone, a rank whose own
            # load arrived would store KV computed from another rank's failed one.
            raise ValueError(
                "a worker of a tensor-parallel engine needs its ranks' agreement on failed loads: "
                "pass agree= (kvflow.integrations.vllm.agreement.tensor_parallel_agreement())"
            )
        self._early = self.wrapping.early_loads(self.config.load_early)
        if self.config.load_early == "auto" and not self._early and self.config.role.loads:
            log.info("kvflow worker tp=%d pp=%d: %s", self.tp_rank, self.pp_rank, self.wrapping.refusal())

    @property
    def loads_early(self) -> bool:
        """Whether this worker starts a step's loads in :meth:`handle_preemptions` (where the
        step allows: ``KVFlowConnectorMetadata.load_early``), per ``load_early`` and
        :attr:`wrapping`."""
        return self._early

    # -- start-up ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, KVCacheEntry]) -> None:
        """Describe the KV caches and open the pool over them."""
        layout = KVLayout.from_kv_caches(kv_caches, block_size=self.shape.block_size)
        parallel = self.shape.parallel(self.tp_rank, self.pp_rank)
        check_layer_names(list(kv_caches), parallel.stage_layers(self.pp_rank, layout.num_layers))
        self._layout, self._parallel = layout, parallel
        self._block_nbytes = layout.block_nbytes
        self._layer_index = {layer.name: i for i, layer in enumerate(layout.layers)}
        store = open_store(self.config.backend)  # the pool owns it; the watch only reads its health
        ranks = (self.tp_rank, self.pp_rank)
        if self.config.layerwise:
            self._steps = LayerwiseSteps(open_layerwise_pool(self.config, self.shape, layout, *ranks, store))
        else:
            pool = open_worker_pool(self.config, self.shape, layout, *ranks, store)
            self._steps = BlockSteps(pool, wait_stored=self.config.role is KVRole.PRODUCER)
        self._watch = StoreWatch(store, f"worker-tp{self.tp_rank}-pp{self.pp_rank}", self.config.backend)
        log.info(
            "kvflow worker tp=%d pp=%d: %d layers of %s, %d blocks of %d tokens, %s, backend %s, role %s",
            self.tp_rank,
            self.pp_rank,
            layout.num_layers,
            layout.kind.value,
            layout.num_blocks,
            layout.block_size,
            "layerwise" if self.config.layerwise else "whole blocks",
            self.config.backend,
            self.config.role.value,
        )

    def handshake(self) -> KVFlowHandshake | None:
        if self._steps is None:
            return None
        return KVFlowHandshake(format=self._steps.pool.format, tp_rank=self.tp_rank, pp_rank=self.pp_rank)

    # -- per step ---------------------------------------------------------------------------------

    def handle_preemptions(self, meta: KVFlowConnectorMetadata) -> None:
        """vLLM hands the worker the step here, before it prepares the step's inputs: start the
        step's loads now when nothing else writes their blocks before the forward
        (``meta.load_early``) and no other connector's ``handle_preemptions`` may run after this
        one (:attr:`loads_early`); :meth:`start_load_kv` waits for them (layerwise: each layer's
        wait does). kvflow holds no block of a preempted request (every transfer ends within its
        step), so there is nothing else to do."""
        steps = self._steps
        if steps is None:
            return
        # A load started early in a step that failed before its load (vLLM went on) ends before
        # this step writes any block (start_early ends it first too): vLLM calls this first in
        # every step, and start_load_kv comes after the forward in a step without loads.
        if self._early and meta.load_early and meta.loads:
            steps.start_early(meta.loads)
        else:
            steps.end_other_early(meta.loads)

    def start_load_kv(self, meta: KVFlowConnectorMetadata) -> None:
        """Start this step's asynchronous loads; do its synchronous loads (before the forward)."""
        steps = self._steps
        if steps is not None:
            steps.end_other_early(meta.loads)
        self._idle = meta.idle
        self._load_errors.update(meta.bad_reads)  # (reported with the step's output)
        if meta.async_loads:
            # The step's asynchronous loads in one call; each request's future resolves when it ended.
            spans = list(meta.async_loads)
            batch: CallFuture[list[RetrieveResult]]
            if steps is None:
                self._load_errors.update(b for span in spans for b in span.block_ids)
                batch = CallFuture(time.monotonic())
                batch.set_exception(RuntimeError("no KV caches registered"))
            else:
                batch = steps.pool.submit_retrieve_many(spans, after=engine_event(steps.pool))
            for span, future in zip(spans, each_result(batch, len(spans))):
                watch = Stopwatch().watch(future)
                self._async_loads[span.request_id] = _AsyncLoad(span, future, batch.answer_by, watch)
        if meta.loads:
            if steps is None:
                self._load_errors.update(b for span in meta.loads for b in span.block_ids)
                self._failed_steps.add(meta.step)
            else:
                # Recorded now: with speculative decoding vLLM asks for load errors before
                # wait_for_save.
                self._record(StepOutcome(steps.load(meta.loads)), step=meta.step)
        if isinstance(steps, LayerwiseSteps) and meta.loads:
            self._loading_step = meta.step  # its loads end with the forward: _end_layerwise_loads
        else:
            self._settled_steps.add(meta.step)  # every load of the step has ended (or there is none)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if self._steps is not None and layer is not None:
            self._steps.wait_for_layer(layer)

    def save_kv_layer(self, layer_name: str, meta: KVFlowConnectorMetadata) -> None:
        layer = self._layer_index.get(layer_name)
        if self._steps is not None and layer is not None:
            self._steps.save_layer(layer, meta.saves_after(self._failed_steps)[0])

    def wait_for_save(self, meta: KVFlowConnectorMetadata) -> None:
        """End the step: its stores (and, layerwise, its loads) have ended when this returns."""
        self._end_layerwise_loads()
        if self._steps is not None:
            saves, dropped = (
                self._saves_of_step(meta, failed=sys.exc_info()[1]) if self.config.role.stores else ((), ())
            )
            outcome = self._steps.finish(saves)  # (the scheduler plans no save for a consumer)
            self._record(attrs.evolve(outcome, dropped=outcome.dropped + dropped), meta, step=meta.step)
        # a save waits for the verdict of the last few steps' loads, no older
        self._failed_steps = {s for s in self._failed_steps if s > meta.step - _FAILED_STEPS_KEPT}

    def _saves_of_step(
        self, meta: KVFlowConnectorMetadata, *, failed: BaseException | None
    ) -> tuple[tuple[KVRequest, ...], tuple[KVRequest, ...]]:
        """The step's saves to store, and those to drop. vLLM ends a step from a ``finally``, so
        ``failed`` (the exception in flight) means its forward raised: the blocks may hold KV half
        written, and every save is dropped (without asking the other ranks, which may never get
        there: they wait in the forward's own collectives)."""
        if failed is not None:
            if meta.saves:
                log.warning(
                    "the forward of step %d failed (%r): storing none of its blocks", meta.step, failed
                )
            return (), meta.saves
        return meta.saves_after(self._failed_anywhere(meta))

    def _failed_anywhere(self, meta: KVFlowConnectorMetadata) -> frozenset[int] | set[int]:
        """The steps this step's saves wait for whose loads failed here, or with several ranks on
        any rank (every rank asks in the same step: the metadata is one)."""
        if not meta.save_after or self.agree is None:
            return self._failed_steps
        return self.agree(sorted({s for after in meta.save_after for s in after}), self._failed_steps)

    def _end_layerwise_loads(self) -> None:
        """Record a layerwise step's loads once the forward ended, and list the step as settled:
        when vLLM asks for the step's load errors or its worker meta, or at wait_for_save, whichever
        comes first (speculative decoding asks before wait_for_save: a failed load reported only
        there reached vLLM a step late, after it had emitted a token computed from it)."""
        step, self._loading_step = self._loading_step, None
        if step is None or not isinstance(self._steps, LayerwiseSteps):
            return
        self._record(StepOutcome(self._steps.end_loads()), step=step)
        self._settled_steps.add(step)

    def _record(
        self, outcome: StepOutcome, meta: KVFlowConnectorMetadata | None = None, *, step: int | None = None
    ) -> None:
        """Count a step's transfers and keep its failed blocks for vLLM (and, failed, the step)."""
        if step is not None and outcome.load_failed:
            self._failed_steps.add(step)
        counters = self._counters
        for span, loaded, seconds in outcome.loads:
            self._samples["load"].append(seconds)
            if loaded is None:
                self._load_errors.update(span.block_ids)
                counters = counters.with_failed_load(len(span.block_ids))
            else:
                self._load_errors.update(loaded.failed_block_ids)
                counters = counters.with_load(loaded, self._block_nbytes)
        for span, future, watch in outcome.stores:  # counted once they ended (a staged put may still run)
            tokens = meta.tokens_of(span) if meta is not None and self.config.kv_events else None
            self._puts.append(_Put(span, future, watch, tokens))
        if outcome.dropped:
            blocks = sum(self._owned_blocks(span) for span in outcome.dropped)
            log.warning(
                "a kvflow load failed on this worker (of this step, or of one the step's saves rest on); "
                "not storing %d computed blocks",
                blocks,
            )
            counters = counters.with_dropped_saves(blocks)
        self._counters = counters
        self._count_puts()

    def _count_puts(self) -> None:
        """Count the stores that ended (their blocks were released inside their step already)."""
        counters, running = self._counters, []
        for put in self._puts:
            future = put.future
            if not future.done():
                running.append(put)
                continue
            self._samples["store"].append(put.watch.seconds)
            if future.cancelled() or future.exception() is not None:
                log.warning("a kvflow store of request %s failed: %r", put.span.request_id, _error(future))
                counters = counters.with_failed_store(self._owned_blocks(put.span))
                continue
            result = future.result()
            counters = counters.with_store(result, self._block_nbytes)
            if put.tokens is not None:
                self._events += stored_events(put.span, put.tokens, result, self.shape.block_size)
        self._counters, self._puts = counters, running

    def _owned_blocks(self, span: KVRequest) -> int:
        """How many of ``span``'s blocks this rank stores (each block counts at its owner only)."""
        assert self._parallel is not None  # spans come after register_kv_caches
        return len(owned(range(span.block_offset, span.end_block), self._parallel))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving): never any sending (stores end inside their step);
        the asynchronous loads that ended (failed blocks are reported by :meth:`take_load_errors`
        in the same step)."""
        self._count_puts()
        if self._watch is not None:
            self._watch.poll()
        # Steps run back to back while a request waits for its load, each holding the GIL;
        # waiting here lends it to kvflow's loop thread (ConnectorConfig.load_wait_s), and in a
        # step that computes nothing, a load that ends meanwhile is reported in this step rather
        # than the next (ConnectorConfig.load_idle_wait_s).
        wait_s = self.config.load_idle_wait_s if self._idle else self.config.load_wait_s
        self._idle = False  # one step's
        if self._async_loads and wait_s > 0:
            concurrent.futures.wait(
                [load.future for load in self._async_loads.values()],
                timeout=wait_s,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        return None, self._harvest_async_loads() or None

    def _harvest_async_loads(self) -> set[str]:
        done: set[str] = set()
        now = time.monotonic()
        for req_id, load in self._async_loads.items():
            if not load.future.done():
                # Never report it before it ended: vLLM would free blocks the get may still write.
                if now >= load.deadline:
                    log.error(
                        "a kvflow load of request %s is still running past its deadline; its blocks "
                        "stay held until it ends (check the store backend)",
                        req_id,
                    )
                    load.deadline = now + STILL_RUNNING_LOG_S
                continue
            self._samples["load"].append(load.watch.seconds)
            if not load.future.cancelled() and load.future.exception() is None:
                result = load.future.result()
                self._load_errors.update(result.failed_block_ids)
                self._counters = self._counters.with_load(result, self._block_nbytes)
            else:
                log.warning("a kvflow load of request %s failed: %r", req_id, _error(load.future))
                self._load_errors.update(load.span.block_ids)
                self._counters = self._counters.with_failed_load(len(load.span.block_ids))
            done.add(req_id)
        for req_id in done:
            del self._async_loads[req_id]
        return done

    def take_load_errors(self) -> set[int]:
        self._end_layerwise_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KVFlowWorkerMeta | None:
        """The steps whose loads ended since the last call (their errors are already taken)."""
        self._end_layerwise_loads()
        if not self._settled_steps:
            return None
        steps, self._settled_steps = tuple(sorted(self._settled_steps)), set()
        return KVFlowWorkerMeta(steps)

    # -- counters ---------------------------------------------------------------------------------

    @property
    def counters(self) -> TransferCounters:
        """Everything this worker moved since it started."""
        return self._counters

    def take_interval(self) -> Observations | None:
        """What moved since the previous call, how long each transfer took, and whether the store
        is reachable (the first time and after a change); None when there is nothing to say."""
        now = self._counters
        observed = Observations(
            now.minus(self._reported),
            load_s=self._samples["load"],
            store_s=self._samples["store"],
            reachability=self._watch.report() if self._watch is not None else (),
        )
        self._reported = now
        self._samples = {"load": [], "store": []}
        return None if observed.empty else observed

    def take_events(self) -> KVFlowKVEvents | None:
        """The ``BlockStored`` events of the stores that ended since the previous call."""
        if not self._events:
            return None
        events, self._events = self._events, []
        worker = self.pp_rank * self.shape.tp_size + self.tp_rank
        return KVFlowKVEvents([WorkerEvent(worker=worker, event=event) for event in events])

    @property
    def store_reachable(self) -> bool:
        """Whether this worker's store answered at the last step (True before the first)."""
        return self._watch is None or self._watch.reachable

    # -- the end ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Wait (bounded) for transfers in flight, then close the pool."""
        futures: list[concurrent.futures.Future[Any]] = [load.future for load in self._async_loads.values()]
        futures += [put.future for put in self._puts]
        limit = max([load.deadline for load in self._async_loads.values()], default=0.0)
        limit = max(limit, time.monotonic() + self.config.timeout_s if self._puts else 0.0)
        if futures:
            concurrent.futures.wait(futures, timeout=max(0.0, limit - time.monotonic()))
        self._count_puts()
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()


def _error(future: concurrent.futures.Future[Any]) -> BaseException | str:
    return "cancelled" if future.cancelled() else future.exception() or "unknown"
