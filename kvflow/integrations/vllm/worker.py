"""The worker side of the connector: loads, stores, and what each step reports back to vLLM.

Every method runs on the worker's model-runner thread. Transfers run on kvflow's loop thread; this
side submits them (through :mod:`.steps`) and waits on ``concurrent.futures.Future`` objects. A load
is never reported ended (done or failed) before its future is: a get past its deadline may still
write into its blocks. Such a load is logged as an error periodically and waited for.

Block lifetime, which is what makes asynchronous transfers safe:

- a whole-block store reads blocks after the step that computed them. Blocks of a running request
  are never freed; when a request finishes, the scheduler side has told vLLM to keep its blocks
  (``request_finished`` -> True) until every worker lists the request as finished sending, which this
  side does once the request's stores are all done, on every rank, even one that owned no block;
- a preempted request's blocks are freed at once, so :meth:`handle_preemptions` waits for its stores
  before the step may reuse them;
- an asynchronous load writes blocks of a request vLLM keeps waiting (and does not free, even when it
  is aborted) until every worker lists it as finished receiving; a request with earlier saves that
  is aborted while it reloads is reported only that way (the metadata's ``drop_saves``);
- layerwise steps end every transfer inside the step (``wait_for_save``), so nothing is delayed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping

import attrs

from kvflow.integrations.vllm.clients import open_layerwise_pool, open_worker_pool
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata, KVFlowHandshake
from kvflow.integrations.vllm.stats import TransferCounters
from kvflow.integrations.vllm.steps import STILL_RUNNING_LOG_S, BlockSteps, LayerwiseSteps, StepOutcome
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.layout import KVCacheEntry, KVLayout
from kvflow.loop import ANSWER_GRACE_S, CallFuture
from kvflow.request import KVRequest
from kvflow.results import RetrieveResult, StoreResult

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _AsyncLoad:
    span: KVRequest
    future: concurrent.futures.Future[RetrieveResult]
    deadline: float  # after it, a load still running is logged (and keeps its blocks until it ends)


@attrs.define(eq=False)
class WorkerSide:
    """Owns this worker's pool (through its step kind), the transfers in flight and the counters."""

    config: ConnectorConfig
    shape: EngineShape
    tp_rank: int
    pp_rank: int
    _steps: BlockSteps | LayerwiseSteps | None = attrs.field(default=None, init=False)
    _layout: KVLayout | None = attrs.field(default=None, init=False)
    _layer_index: dict[str, int] = attrs.field(factory=dict, init=False)
    # Requests that had saves: their stores not yet counted. A request leaves when reported finished.
    _stores: dict[str, list[concurrent.futures.Future[StoreResult]]] = attrs.field(factory=dict, init=False)
    # Stores of requests the scheduler told to forget (drop_saves): counted, never reported.
    _detached: list[concurrent.futures.Future[StoreResult]] = attrs.field(factory=list, init=False)
    _finished: set[str] = attrs.field(factory=set, init=False)  # finished, stores maybe in flight
    _async_loads: dict[str, _AsyncLoad] = attrs.field(factory=dict, init=False)
    _load_errors: set[int] = attrs.field(factory=set, init=False)
    _counters: TransferCounters = attrs.field(factory=TransferCounters, init=False)
    _reported: TransferCounters = attrs.field(factory=TransferCounters, init=False)

    @property
    def delays_frees(self) -> bool:
        """Whether finished requests wait for this side's stores (whole-block mode)."""
        return not self.config.layerwise

    # -- start-up ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, KVCacheEntry]) -> None:
        """Describe the KV caches and open the pool over them."""
        layout = KVLayout.from_kv_caches(kv_caches, block_size=self.shape.block_size)
        self._layout = layout
        self._layer_index = {layer.name: i for i, layer in enumerate(layout.layers)}
        if self.config.layerwise:
            engine = open_layerwise_pool(self.config, self.shape, layout, self.tp_rank, self.pp_rank)
            self._steps = LayerwiseSteps(engine)
        else:
            self._steps = BlockSteps(
                open_worker_pool(self.config, self.shape, layout, self.tp_rank, self.pp_rank)
            )
        log.info(
            "kvflow worker tp=%d pp=%d: %d layers of %s, %d blocks of %d tokens, %s, backend %s",
            self.tp_rank,
            self.pp_rank,
            layout.num_layers,
            layout.kind.value,
            layout.num_blocks,
            layout.block_size,
            "layerwise" if self.config.layerwise else "whole blocks",
            self.config.backend,
        )

    def handshake(self) -> KVFlowHandshake | None:
        if self._layout is None:
            return None
        return KVFlowHandshake(format=self._layout.format, tp_rank=self.tp_rank, pp_rank=self.pp_rank)

    # -- per step ---------------------------------------------------------------------------------

    def handle_preemptions(self, meta: KVFlowConnectorMetadata) -> None:
        """Finish reading the blocks of preempted requests before this step may overwrite them."""
        for req_id in meta.preempted_req_ids:
            pending = [f for f in self._stores.get(req_id, ()) if not f.done()]
            if not pending:
                continue
            _, not_done = concurrent.futures.wait(pending, timeout=self.config.preemption_wait_s)
            if not_done:
                log.error(
                    "request %s was preempted with %d kvflow stores still running after %.0f s; its "
                    "blocks are reused now, so those stores may hold wrong bytes",
                    req_id,
                    len(not_done),
                    self.config.preemption_wait_s,
                )

    def start_load_kv(self, meta: KVFlowConnectorMetadata) -> None:
        """Start this step's asynchronous loads; do its synchronous loads (before the forward)."""
        steps = self._steps
        for span in meta.async_loads:
            if steps is None:
                self._load_errors.update(span.block_ids)
                future: CallFuture[RetrieveResult] = CallFuture(time.monotonic())
                future.set_exception(RuntimeError("no KV caches registered"))
            else:
                future = steps.pool.submit_retrieve(span)
            self._async_loads[span.request_id] = _AsyncLoad(span, future, future.answer_by)
        if meta.loads:
            if steps is None:
                self._load_errors.update(b for span in meta.loads for b in span.block_ids)
            else:
                # Recorded now: with speculative decoding vLLM asks for load errors before
                # wait_for_save.
                self._record(StepOutcome(steps.load(meta.loads)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if self._steps is not None and layer is not None:
            self._steps.wait_for_layer(layer)

    def save_kv_layer(self, layer_name: str, meta: KVFlowConnectorMetadata) -> None:
        layer = self._layer_index.get(layer_name)
        if self._steps is not None and layer is not None:
            self._steps.save_layer(layer, meta.saves)

    def wait_for_save(self, meta: KVFlowConnectorMetadata) -> None:
        """End the step: count its loads, start (or, layerwise, finish) storing what it computed."""
        for req_id in meta.drop_saves:  # reported once, as finished receiving, by its load
            self._detached.extend(self._stores.pop(req_id, ()))
            self._finished.discard(req_id)
        for span in meta.saves:  # every rank tracks every saving request, stored or not
            self._stores.setdefault(span.request_id, [])
        if self._steps is None:
            return
        outcome = self._steps.finish(meta.saves)
        self._record(outcome)

    def _record(self, outcome: StepOutcome) -> None:
        counters = self._counters
        for span, loaded in outcome.loads:
            if loaded is None:
                self._load_errors.update(span.block_ids)
                counters = counters.with_failed_load(len(span.block_ids))
            else:
                self._load_errors.update(loaded.failed_block_ids)
                counters = counters.with_load(loaded)
        for span, future in outcome.stores:
            self._stores[span.request_id].append(future)
        if outcome.dropped:
            blocks = sum(len(span.block_ids) for span in outcome.dropped)
            log.warning("a kvflow load of this step failed; not storing its %d computed blocks", blocks)
            counters = counters.with_dropped_saves(blocks)
        self._counters = counters

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving): finished requests whose stores are all done on
        this rank (possibly none), and asynchronous loads that ended (failed blocks are reported by
        :meth:`take_load_errors` in the same step)."""
        self._harvest_stores()
        sending: set[str] = set()
        finished = {r for r in finished_req_ids if r in self._stores}
        if self.delays_frees:
            self._finished |= finished
            sending = {r for r in self._finished if not self._stores[r]}
            self._finished -= sending
            finished = sending
        for req_id in finished:
            del self._stores[req_id]
        return sending or None, self._harvest_async_loads() or None

    def _harvest_stores(self) -> None:
        for req_id, futures in self._stores.items():
            if futures:
                futures[:] = self._count_stores(req_id, futures)
        self._detached = self._count_stores("(finished)", self._detached)

    def _count_stores(
        self, req_id: str, futures: list[concurrent.futures.Future[StoreResult]]
    ) -> list[concurrent.futures.Future[StoreResult]]:
        """Count the ended stores; return those still running."""
        counters = self._counters
        running = []
        for future in futures:
            if not future.done():
                running.append(future)
                continue
            try:
                result = future.result()
            except Exception as exc:
                log.warning("a kvflow store of request %s failed: %r", req_id, exc)
                counters = counters.with_failed_store(1)
                continue
            counters = counters.with_store(result)
        self._counters = counters
        return running

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
            if load.future.exception() is None:
                result = load.future.result()
                self._load_errors.update(result.failed_block_ids)
                self._counters = self._counters.with_load(result)
            else:
                log.warning("a kvflow load of request %s failed: %r", req_id, load.future.exception())
                self._load_errors.update(load.span.block_ids)
                self._counters = self._counters.with_failed_load(len(load.span.block_ids))
            done.add(req_id)
        for req_id in done:
            del self._async_loads[req_id]
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- counters ---------------------------------------------------------------------------------

    @property
    def counters(self) -> TransferCounters:
        """Everything this worker moved since it started."""
        return self._counters

    def take_interval(self) -> TransferCounters | None:
        """The counts since the previous call, or None when nothing moved."""
        now = self._counters
        interval, self._reported = now.minus(self._reported), now
        return None if interval.empty else interval

    # -- the end ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Wait (bounded) for transfers in flight, then close the pool."""
        deadline = time.monotonic() + self.config.timeout_s + ANSWER_GRACE_S
        stores = [f for futures in self._stores.values() for f in futures] + self._detached
        concurrent.futures.wait(stores, timeout=max(0.0, deadline - time.monotonic()))
        loads = [load.future for load in self._async_loads.values()]
        concurrent.futures.wait(loads, timeout=max(0.0, deadline - time.monotonic()))
        self._harvest_stores()
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()
