"""The scheduler side of the connector: look up hits, plan loads and saves, build each step's metadata.

Every method runs on vLLM's engine-core (scheduler) thread, in the order vLLM calls them:
``on_new_request`` when a request arrives; ``get_num_new_matched_tokens`` ->
``update_state_after_alloc`` for each admitted request, then one
``build_connector_meta`` per step; ``update_connector_output`` after each step; ``request_finished``
once per request. Only lookups do I/O (see :mod:`.lookups`); the rest is plain dict work.

Lookups go straight to the store: the scheduler computes every rank's keys itself from
``request.block_hashes``, the parallel layout and the layout fingerprint the workers sent in their
handshake, and takes the minimum hit over KV-head ranks and pipeline stages. No RPC to a worker.

Store policy: the full blocks of a request are stored once, by the step that computes them (prompt
blocks only unless ``save_decode_blocks``). Blocks vLLM found in its own prefix cache are taken as
stored (the request that computed them stored them), and blocks loaded from kvflow are stored by
definition.

A request's blocks computed in a step in which it also loaded are not stored in that step: on another
rank that load may have failed, and every rank computed from its (all-reduced) output. The scheduler
holds them back until vLLM's aggregated connector output for that step is in (one step later; two with
asynchronous scheduling). If it named no failed block of the load, a later step stores them; if it did,
vLLM recomputes from the first failed block, and the step that recomputes stores. A request that
finishes first leaves them unstored: a lost caching chance, never wrong data.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.clients import open_lookup_pool
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.lookups import Lookups
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata, KVFlowHandshake
from kvflow.integrations.vllm.planning import external_tokens, load_range, save_range
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.loop import CallFuture
from kvflow.request import KVRequest
from kvflow.sync import SyncPool

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Tracked:
    """A request the scheduler side follows from admission to ``request_finished``."""

    request: Request  # vLLM's live object: block_hashes and all_token_ids grow as it decodes
    block_ids: list[int]
    saved_upto: int  # blocks [0, saved_upto) are stored, loaded, or already being stored


@attrs.define(eq=False)
class _LoadCheck:
    """A sync load whose step's computed blocks wait for vLLM's verdict on the load."""

    span: KVRequest
    steps_left: int  # build_connector_meta calls until the load step's connector output is in


@attrs.define(eq=False)
class SchedulerSide:
    """Owns the lookup pool (once the workers' handshake arrived) and the per-request state."""

    config: ConnectorConfig
    shape: EngineShape
    #: vLLM schedules step N+1 before it processes step N's output (scheduler_config.async_scheduling)
    async_scheduling: bool = False
    _pool: SyncPool | None = attrs.field(default=None, init=False)
    _lookups: Lookups | None = attrs.field(default=None, init=False)
    _requests: dict[str, _Tracked] = attrs.field(factory=dict, init=False)
    _local_hits: dict[str, int] = attrs.field(factory=dict, init=False)
    _pending_loads: dict[str, KVRequest] = attrs.field(factory=dict, init=False)
    _pending_async: dict[str, KVRequest] = attrs.field(factory=dict, init=False)
    _loading: set[str] = attrs.field(factory=set, init=False)  # asynchronous loads not yet reported done
    _saving: set[str] = attrs.field(factory=set, init=False)  # requests some step stored blocks of
    _unchecked: dict[str, _LoadCheck] = attrs.field(factory=dict, init=False)  # no saves until checked
    _drop_saves: set[str] = attrs.field(factory=set, init=False)  # workers: forget, do not report

    # -- start-up ---------------------------------------------------------------------------------

    def on_handshake(self, handshakes: Mapping[tuple[int, int], KVFlowHandshake]) -> None:
        """Open the lookup pool with the layout every worker reported."""
        if not handshakes:
            log.warning("no worker reported its KV layout; kvflow lookups stay off (no hits)")
            return
        layouts = {h.format for h in handshakes.values()}
        if len(layouts) != 1 or next(iter(layouts)).block_size != self.shape.block_size:
            # Pipeline stages with different layer counts have different fingerprints; the core's
            # lookup uses one fingerprint for every namespace, so they are refused for now.
            raise ConfigError(
                f"workers report KV formats {sorted(map(str, layouts))}; "
                f"KVFlowConnector needs one layout with block size {self.shape.block_size} on every rank"
            )
        handshake = next(iter(handshakes.values()))
        pool = open_lookup_pool(self.config, self.shape, handshake)
        self._pool = pool
        self._lookups = Lookups(
            functools.partial(_start_lookup, pool),
            block_size=self.shape.block_size,
            wait_s=self.config.lookup_wait_s,
        )

    # -- admission ------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Start the request's lookup now, so that its answer is ready when vLLM admits it."""
        if self._lookups is not None:
            self._lookups.prefetch(request.request_id, tuple(request.block_hashes))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own (block-aligned) hit that kvflow can load, and whether the load is
        asynchronous; ``None`` while the lookup is still running (vLLM asks again next step).

        May be called more than once for one request; each call only refreshes this request's memo.
        """
        req_id = request.request_id
        hashes = tuple(request.block_hashes)
        block = self.shape.block_size
        local_blocks = num_computed_tokens // block
        self._local_hits[req_id] = num_computed_tokens
        if self._lookups is None or len(hashes) <= local_blocks:
            return 0, False
        hit = self._lookups.poll(req_id, hashes, local_blocks)
        if hit is None:
            return None, False
        tokens = external_tokens(hit, num_computed_tokens, request.num_tokens)
        return tokens, tokens > 0 and self.config.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember the request's blocks; plan the load of its external hit, if any.

        For an asynchronous load vLLM calls this twice: when it allocates the blocks to load into,
        and again (with no external tokens) when it schedules the request after the load.
        """
        req_id = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        num_local = self._local_hits.pop(req_id, 0)
        first, end = load_range(num_local, num_external_tokens, self.shape.block_size)
        tracked = self._requests.get(req_id)
        if tracked is None:
            tracked = self._requests[req_id] = _Tracked(request, block_ids, saved_upto=first)
        else:  # readmitted after preemption, or scheduled after its asynchronous load
            tracked.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        span = KVRequest(
            request_id=req_id,
            block_ids=block_ids[first:end],
            block_hashes=request.block_hashes[:end],
            block_offset=first,
        )
        if self.config.load_async:
            self._pending_async[req_id] = span
            self._loading.add(req_id)
        else:
            self._pending_loads[req_id] = span
        tracked.saved_upto = max(tracked.saved_upto, end)

    # -- per step ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVFlowConnectorMetadata:
        """This step's loads (before the forward), asynchronous loads and saves. Resets the step."""
        if self._lookups is not None:
            self._lookups.new_step()
        for req_id, check in list(self._unchecked.items()):
            check.steps_left -= 1
            if check.steps_left <= 0:
                del self._unchecked[req_id]
        loads: list[KVRequest] = []
        saves: list[KVRequest] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._take_load(new.req_id, loads)
            self._plan_save(tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0), saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
                self._take_load(req_id, loads)
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), saves)
        if self._pending_loads:
            log.warning("dropping kvflow loads of unscheduled requests %s", sorted(self._pending_loads))
            self._pending_loads.clear()
        async_loads = tuple(self._pending_async.values())
        self._pending_async.clear()
        drop_saves, self._drop_saves = frozenset(self._drop_saves), set()
        return KVFlowConnectorMetadata(
            loads=tuple(loads),
            async_loads=async_loads,
            saves=tuple(saves),
            preempted_req_ids=frozenset(scheduler_output.preempted_req_ids or ()),
            drop_saves=drop_saves,
        )

    def _take_load(self, req_id: str, loads: list[KVRequest]) -> None:
        span = self._pending_loads.pop(req_id, None)
        if span is not None:
            loads.append(span)
            # Hold back what this step computes until vLLM's verdict on the load is in.
            self._unchecked[req_id] = _LoadCheck(span, steps_left=2 if self.async_scheduling else 1)

    def _plan_save(self, tracked: _Tracked, computed_tokens: int, saves: list[KVRequest]) -> None:
        request = tracked.request
        if request.request_id in self._unchecked:
            return  # saved_upto stays: a later step stores these blocks (see the module docstring)
        if not self.config.save_decode_blocks:
            computed_tokens = min(computed_tokens, request.num_prompt_tokens)
        hashes = request.block_hashes
        start, end = save_range(tracked.saved_upto, computed_tokens, len(hashes), self.shape.block_size)
        end = min(end, len(tracked.block_ids))
        if end <= start:
            return
        req_id = request.request_id
        saves.append(
            KVRequest(
                request_id=req_id,
                block_ids=tracked.block_ids[start:end],
                block_hashes=hashes[:end],
                block_offset=start,
            )
        )
        tracked.saved_upto = end
        self._saving.add(req_id)

    def update_connector_output(
        self,
        finished_recving: set[str] | None,
        invalid_block_ids: set[int] | None = None,
        failed_recving: set[str] | None = None,
    ) -> None:
        """Every worker's output of a step: asynchronous loads that every worker reported done, and
        the blocks (or requests) whose load failed on some worker."""
        self._loading.difference_update(finished_recving or ())
        invalid, failed = invalid_block_ids or set(), failed_recving or set()
        for req_id, check in self._unchecked.items():
            span = check.span
            bad = [i for i, b in enumerate(span.block_ids) if b in invalid]
            if req_id in failed:
                bad.append(0)
            tracked = self._requests.get(req_id)
            if bad and tracked is not None:
                # vLLM recomputes from the first failed block; the step that does stores it.
                tracked.saved_upto = min(tracked.saved_upto, span.block_offset + min(bad))

    # -- the end of a request ---------------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        """Forget the request. True: vLLM keeps its blocks until every worker reports it.

        Whole-block stores read blocks after their step, so a request that had saves waits for
        every worker to list it as finished sending (each worker lists exactly the requests some
        step's metadata carried saves of, so both sides agree). A request whose asynchronous load
        is still running waits for every worker to list it as finished receiving, and only that:
        if it also had saves (preempted, then reloading), the next metadata tells the workers to drop
        them unreported, so vLLM frees its blocks once, after the load.
        """
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._local_hits.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._unchecked.pop(req_id, None)
        if self._lookups is not None:
            self._lookups.forget(req_id)
        saving = req_id in self._saving and not self.config.layerwise
        self._saving.discard(req_id)
        if req_id in self._loading:
            # Preempted after some saves, then aborted while reloading: vLLM must free the blocks
            # once, when every worker reports the load. Workers drop the old saves unreported.
            if saving:
                self._drop_saves.add(req_id)
            return True
        return saving

    def reset_cache(self) -> bool:
        """Drop the lookups in flight. The pool itself is shared with other engines and stays: False."""
        if self._lookups is not None:
            self._lookups.clear()
        log.warning(
            "kvflow's pool is shared by every engine using it and is not cleared by one engine's "
            "reset; after changing weights, give the connector a new model_id"
        )
        return False

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        self._lookups = None
        if pool is not None:
            pool.close()


def _start_lookup(pool: SyncPool, block_hashes: tuple[bytes, ...], block_offset: int) -> CallFuture[int]:
    return pool.submit_lookup(KVRequest(block_hashes=block_hashes, block_offset=block_offset))
