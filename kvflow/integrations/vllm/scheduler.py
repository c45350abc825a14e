"""The scheduler side of the connector: look up hits, plan loads and saves, build each step's metadata.

Every method runs on vLLM's engine-core (scheduler) thread, in the order vLLM calls them:
``on_new_request`` when a request arrives; ``get_num_new_matched_tokens`` ->
``update_state_after_alloc`` for each admitted request, then one
``build_connector_meta`` per step; ``update_connector_output`` after each step; ``request_finished``
once per request. Only lookups do I/O (see :mod:`.lookups`); the rest is plain dict work.

Lookups go straight to the store: the scheduler computes every rank's keys itself from
``request.block_hashes``, the parallel layout (vLLM's layer partition included) and the KV format
the workers sent in their handshake, and counts a block when every KV-head range and pipeline
stage holds it, under this engine's keys or under another engine's split (:mod:`kvflow.profiles`).
No RPC to a worker.

Store policy: the full blocks of a request are stored once, by the step that computes them (prompt
blocks only unless ``save_decode_blocks``). Blocks vLLM found in its own prefix cache are taken as
stored (the request that computed them stored them), and blocks loaded from kvflow are stored by
definition.

What is never stored: KV computed from a block whose load is not known good on every rank
(:mod:`.trust`). A step's loads settle when every worker listed the step in its
:class:`~.metadata.KVFlowWorkerMeta`; until then (one step later, two with asynchronous
scheduling) every save that reads one of their blocks, through the request's own loads or through
vLLM's prefix cache, is held back: ``saved_upto`` stays, and a later step stores the blocks. A
failed block stays untrusted until a step recomputes it; every request reading it has ``saved_upto``
lowered to it, so the step that recomputes stores again. A request that finishes first leaves held
blocks unstored: a lost caching chance, never wrong data. An engine of one worker holds nothing
back for a load's verdict: that worker knows its own loads when its saves run, so the save is
planned at once with the steps it waits for (``save_after``), and the worker drops it if one of
those steps' loads failed there. A tensor-parallel engine of one pipeline stage storing whole
blocks does the same: its ranks agree on which of those steps failed on any rank before they store
(:mod:`.agreement`).

Roles (vLLM's ``kv_role``): a ``kv_producer`` opens no lookup pool and plans no load; a
``kv_consumer`` plans no save. The scheduler side also counts its lookups (hit and missed tokens,
seconds: :meth:`SchedulerSide.take_interval`) and, with KV events on, turns the workers' reports of
stored blocks into events once every worker reported a block (:mod:`.events`).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
from vllm.v1.request import Request, RequestStatus

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.agreement import plans_saves_after_loads
from kvflow.integrations.vllm.clients import open_lookup_pool, open_store
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.events import EventTally
from kvflow.integrations.vllm.health import StoreWatch
from kvflow.integrations.vllm.lookups import Lookups
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata, KVFlowHandshake
from kvflow.integrations.vllm.planning import external_tokens, load_range, save_range
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.integrations.vllm.trust import BadRead, BlockTrust, StepWork
from kvflow.loop import ANSWER_GRACE_S, CallFuture
from kvflow.metrics import Observations, TransferCounters
from kvflow.request import KVRequest
from kvflow.sync import SyncPool

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class _Tracked:
    """A request the scheduler side follows from admission to ``request_finished``."""

    request: Request  # vLLM's live object: block_hashes and all_token_ids grow as it decodes
    block_ids: list[int]
    saved_upto: int  # blocks [0, saved_upto) are stored, loaded, or already being stored


@attrs.define(eq=False)
class SchedulerSide:
    """Owns the lookup pool (once the workers' handshake arrived) and the per-request state."""

    config: ConnectorConfig
    shape: EngineShape
    # vLLM's kv_load_failure_policy is "recompute": a failed block stays in its prefix cache
    recomputes_failures: bool = True
    _pool: SyncPool | None = attrs.field(default=None, init=False)
    _lookups: Lookups | None = attrs.field(default=None, init=False)
    _requests: dict[str, _Tracked] = attrs.field(factory=dict, init=False)
    _local_hits: dict[str, int] = attrs.field(factory=dict, init=False)
    _answered: dict[str, tuple[int, int]] = attrs.field(factory=dict, init=False)  # hit, asked tokens
    _lookup_s: list[float] = attrs.field(factory=list, init=False)  # of lookups counted since reported
    _pending_loads: dict[str, KVRequest] = attrs.field(factory=dict, init=False)
    _pending_async: dict[str, KVRequest] = attrs.field(factory=dict, init=False)
    _async_loads: dict[str, KVRequest] = attrs.field(factory=dict, init=False)  # until finished_recving
    # Blocks of asynchronous loads in flight that some worker already reported failed (every block
    # of a request reported failed whole): a worker reports its failures as its own load ends,
    # maybe steps before the last one.
    _async_bad: dict[str, set[int]] = attrs.field(factory=dict, init=False)
    # Requests whose asynchronous load failed, until vLLM allocates them again: computed, not loaded.
    _load_failed: set[str] = attrs.field(factory=set, init=False)
    _trust: BlockTrust = attrs.field(factory=BlockTrust, init=False)
    _repairs: dict[bytes, int] | None = attrs.field(default=None, init=False)  # memo, until the next step
    _reports: Counter[int] = attrs.field(factory=Counter, init=False)  # step -> workers that settled it
    # step -> (request, first block) of each save planned in it, until the step settles: a worker
    # whose load of the step failed drops them all, so a failed step's saves are planned again
    _planned: dict[int, list[tuple[str, int]]] = attrs.field(factory=dict, init=False)
    _step: int = attrs.field(default=0, init=False)
    _counters: TransferCounters = attrs.field(factory=TransferCounters, init=False)  # lookups
    _reported: TransferCounters = attrs.field(factory=TransferCounters, init=False)
    _watch: StoreWatch | None = attrs.field(default=None, init=False)
    _tally: EventTally = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # a worker's store ends within its timeout: a report missing for twice that never comes
        self._tally = EventTally(
            self.shape.tp_size * self.shape.pp_size, max_age_s=2 * self.config.timeout_s + ANSWER_GRACE_S
        )

    @property
    def _saves_after_loads(self) -> bool:
        """Whether a save resting on loads not yet settled is planned at once, with ``save_after``:
        the workers learn whether those loads arrived on every rank by the time they store it."""
        return plans_saves_after_loads(self.shape, self.config.layerwise)

    # -- start-up ---------------------------------------------------------------------------------

    def on_handshake(self, handshakes: Mapping[tuple[int, int], KVFlowHandshake]) -> None:
        """Open the lookup pool with the layout every worker reported (not for a producer)."""
        if not self.config.role.loads:
            log.info("kvflow: kv_role=%s: this engine stores and never looks up", self.config.role.value)
            return
        if not handshakes:
            log.warning("no worker reported its KV layout; kvflow lookups stay off (no hits)")
            return
        # Stages may hold different numbers of layers (vLLM's partition, in the engine shape); the
        # rest of the format (block size, meaning, byte order) must agree, since a lookup names
        # every stage's objects with it.
        layouts = {attrs.evolve(h.format, num_layers=1) for h in handshakes.values()}
        if len(layouts) != 1 or next(iter(layouts)).block_size != self.shape.block_size:
            raise ConfigError(
                f"workers report KV formats {sorted(map(str, layouts))}; KVFlowConnector needs one "
                f"layout kind and dtype with block size {self.shape.block_size} on every rank"
            )
        first = min(handshakes.values(), key=lambda h: (h.pp_rank, h.tp_rank))
        url = self.config.lookup_backend or self.config.backend
        store = open_store(url)  # the pool owns it; the watch only reads its health
        pool = open_lookup_pool(self.config, self.shape, first, store)
        self._pool = pool
        _read_profiles(pool, self.config.lookup_timeout_s)
        self._watch = StoreWatch(store, "scheduler", url)
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

        May be called more than once for one request (vLLM asks again when it could not allocate
        its blocks); each call only refreshes this request's memo, and the lookup is counted once,
        when the request is allocated.
        """
        req_id = request.request_id
        hashes = tuple(request.block_hashes)
        block = self.shape.block_size
        local_blocks = num_computed_tokens // block
        read = hashes[: local_blocks + 1]  # the block past the aligned hit too: vLLM's may end in it
        self._answered.pop(req_id, None)  # an earlier ask's answer (vLLM could not allocate) is stale
        if self.recomputes_failures and self._reads_repair(read):
            return None, False
        self._local_hits[req_id] = num_computed_tokens
        if (
            self._lookups is None
            or len(hashes) <= local_blocks
            or req_id in self._load_failed
            or request.skip_reading_prefix_cache  # (prompt logprobs: vLLM would take 0 tokens anyway)
        ):
            # (a failed asynchronous load that vLLM rewound to block 0 is not tried again: loaded
            # again, the same failure would free its blocks again, for ever)
            return 0, False
        hit = self._lookups.poll(req_id, hashes, local_blocks)
        if hit is None:
            return None, False
        self._answered[req_id] = (hit - num_computed_tokens, len(hashes) * block - num_computed_tokens)
        tokens = external_tokens(hit, num_computed_tokens, request.num_tokens)
        return tokens, tokens > 0 and self.config.load_async

    def _reads_repair(self, hashes: Sequence[bytes]) -> bool:
        """Whether vLLM's prefix cache would give a request of these block hashes a ``BAD`` block
        that a running request is recomputing. Such a request waits (vLLM asks again next step)
        until the block is good: admitted, it would read wrong KV, and vLLM, told so, may rewind
        the request recomputing the block instead of it, every step (docs/vllm.md)."""
        if self._repairs is None:  # once a step: which bad blocks running requests still compute
            self._repairs = {}
            block = self.shape.block_size
            for tracked in self._requests.values() if self._trust.any_bad else ():
                request = tracked.request
                if request.status != RequestStatus.RUNNING:
                    continue
                ahead = min(len(tracked.block_ids), len(request.block_hashes))
                for i in range(request.num_computed_tokens // block, ahead):
                    if self._trust.bad(tracked.block_ids[i]):
                        self._repairs[request.block_hashes[i]] = tracked.block_ids[i]
        repairs = self._repairs
        waits = bool(repairs) and any(h in repairs for h in hashes)
        if waits:
            log.debug("a request waits for a block being recomputed after a failed load")
        return waits

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
        answered = self._answered.pop(req_id, None)
        # its answer is used: readmitted, it is looked up afresh
        seconds = self._lookups.forget(req_id) if self._lookups is not None else None
        if answered is not None:
            self._counters = self._counters.with_lookup(*answered)
            if seconds is not None:
                self._lookup_s.append(seconds)
        self._load_failed.discard(req_id)
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
        else:
            self._pending_loads[req_id] = span
        tracked.saved_upto = max(tracked.saved_upto, end)

    # -- per step ---------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVFlowConnectorMetadata:
        """This step's loads (before the forward), asynchronous loads and saves. Resets the step."""
        if self._lookups is not None:
            self._lookups.new_step()
        self._repairs = None
        self._step += 1
        step = self._step
        scheduled = scheduler_output.num_scheduled_tokens
        # (request, tokens computed before this step, tokens computed by the end of it)
        work: list[tuple[_Tracked, int, int]] = []
        loads: list[KVRequest] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._trust.fresh(tracked.block_ids[self._held_blocks(new.num_computed_tokens) :])
            self._take_load(new.req_id, step, loads)
            work.append(
                (tracked, new.num_computed_tokens, new.num_computed_tokens + scheduled.get(new.req_id, 0))
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
                self._trust.fresh(tracked.block_ids[self._held_blocks(computed) :])
                self._take_load(req_id, step, loads)
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
                self._trust.fresh(new_ids[0])
            work.append((tracked, computed, computed + scheduled.get(req_id, 0)))
        block = self.shape.block_size
        done = [
            StepWork(
                reads=t.block_ids[: -(-before // block)],
                writes=t.block_ids[before // block : -(-after // block)],
                read_to=before % block or None,
                written_to=after % block or None,
            )
            for t, before, after in work
        ]
        bad_reads = self._bad_reads(work, self._trust.computed(done))
        saves: list[KVRequest] = []
        waits: list[tuple[int, ...]] = []  # per save, the load steps whose verdict it waits for
        if self.config.role.stores:
            for tracked, _, after in work:  # only now: a save may read blocks another request loads
                self._plan_save(tracked, after, saves, waits)
        if saves:
            self._planned[step] = [(save.request_id, save.block_offset) for save in saves]
        if self._pending_loads:
            log.warning("dropping kvflow loads of unscheduled requests %s", sorted(self._pending_loads))
            self._pending_loads.clear()
        async_loads = tuple(self._pending_async.values())
        self._async_loads.update(self._pending_async)
        self._pending_async.clear()
        tokens: tuple[tuple[int, ...], ...] = ()
        if self.config.kv_events and saves:
            tokens = tuple(self._save_tokens(span) for span in saves)
        return KVFlowConnectorMetadata(
            step=step,
            loads=tuple(loads),
            async_loads=async_loads,
            saves=tuple(saves),
            save_tokens=tokens,
            idle=not any(scheduled.values()),
            bad_reads=bad_reads,
            save_after=tuple(waits) if any(waits) else (),
            load_early=bool(loads) and _no_other_writes_before_forward(scheduler_output),
        )

    def _bad_reads(self, work: list[tuple[_Tracked, int, int]], found: dict[int, BadRead]) -> tuple[int, ...]:
        """Blocks to report so that vLLM recomputes the requests of the step that read wrong KV.

        With the recompute policy vLLM keeps a failed block in its prefix cache, meant for its
        request to recompute in place; if that request is preempted or aborted first, or another
        one reads the block while it is recomputed in chunks, that reader computes from it. vLLM
        rewinds, for a reported block, the first running request holding it among its computed
        blocks, and only reverts the step of the others holding it. So:

        - a bad block nobody is recomputing is reported: some holder recomputes it;
        - one being recomputed is not (that would rewind its recomputing request, which may be
          part-way through it, and a reader reading it every step would then stop it for ever):
          the next block the reader has computed is reported instead, if it has one: only
          requests that read the bad block too hold that one among their computed blocks (a
          request recomputing the bad block has not got past it), so a reader is rewound there,
          and its KV from there on is recomputed once the bad block is good. Else, if the reader
          samples in this step, the bad block is reported all the same (its token must not be
          emitted; this may rewind a request recomputing the block); else nothing is: what it
          computes is bad (never stored), and is found when read.

        With the fail policy vLLM evicts failed blocks, so nothing is reported."""
        if not self.recomputes_failures or not found:
            return ()
        block = self.shape.block_size
        report: set[int] = set()
        for i, bad in found.items():
            tracked, before, after = work[i]
            if not bad.repairing:
                report.add(bad.block)
                continue
            read = tracked.block_ids[: -(-before // block)]
            later = read[read.index(bad.block) + 1 :] if bad.block in read else []
            if later:  # held, among computed blocks, only by requests that read the bad block too
                report.add(later[0])
            elif after >= tracked.request.num_tokens:  # it samples a token in this step
                report.add(bad.block)
        if report:
            log.info("%d block(s) read this step hold KV of a failed load: vLLM recomputes them", len(report))
        return tuple(sorted(report))

    def _save_tokens(self, span: KVRequest) -> tuple[int, ...]:
        block = self.shape.block_size
        request = self._requests[span.request_id].request
        return tuple(request.all_token_ids[span.block_offset * block : span.end_block * block])

    def _held_blocks(self, computed_tokens: int) -> int:
        """How many of a request's first blocks hold positions it has computed (or found)."""
        return -(-computed_tokens // self.shape.block_size)

    def _take_load(self, req_id: str, step: int, loads: list[KVRequest]) -> None:
        span = self._pending_loads.pop(req_id, None)
        if span is not None:
            loads.append(span)
            self._trust.loading(step, span)

    def _plan_save(
        self, tracked: _Tracked, computed_tokens: int, saves: list[KVRequest], waits: list[tuple[int, ...]]
    ) -> None:
        """Plan the save of the request's full blocks computed and not yet stored, when their KV is
        trusted, or waits only for the verdict of loads the workers will know of when they store it
        (:func:`~.agreement.plans_saves_after_loads`)."""
        request = tracked.request
        if not self.config.save_decode_blocks:
            computed_tokens = min(computed_tokens, request.num_prompt_tokens)
        hashes = request.block_hashes
        start, end = save_range(tracked.saved_upto, computed_tokens, len(hashes), self.shape.block_size)
        end = min(end, len(tracked.block_ids))
        if end <= start:
            return  # nothing new
        steps = self._trust.waits_for(tracked.block_ids[start:end])
        if steps is None or (steps and not self._saves_after_loads):
            # Held back: saved_upto stays, a later step stores these blocks. (A rank computes from
            # every rank's loads; across pipeline stages, or layer by layer, only the scheduler
            # hears of them all.)
            return
        waits.append(tuple(sorted(steps)))
        saves.append(
            KVRequest(
                request_id=request.request_id,
                block_ids=tracked.block_ids[start:end],
                block_hashes=hashes[:end],
                block_offset=start,
            )
        )
        tracked.saved_upto = end

    def update_connector_output(
        self,
        finished_recving: set[str] | None,
        invalid_block_ids: set[int] | None = None,
        failed_recving: set[str] | None = None,
        settled_steps: Sequence[int] = (),
        kv_cache_events: KVConnectorKVEvents | None = None,
    ) -> None:
        """Every worker's output of a step: the steps whose loads ended on some workers (each worker
        lists a step once), asynchronous loads that every worker reported done, the blocks (or
        requests) whose load failed on some worker, and (KV events on) the blocks workers stored."""
        if self.config.kv_events:
            self._tally.add(kv_cache_events)
        self._repairs = None
        bad = set(invalid_block_ids or ())
        failed = failed_recving or set()
        self._reports.update(settled_steps)
        workers = self.shape.tp_size * self.shape.pp_size  # each reports every step once
        for step in sorted(s for s in set(settled_steps) if self._reports[s] >= workers):
            del self._reports[step]
            loads = self._trust.settle(step, bad)
            planned = self._planned.pop(step, [])
            if any(b in bad for load in loads for b in load.block_ids):  # some worker dropped them
                for req_id, first in planned:
                    tracked = self._requests.get(req_id)
                    if tracked is not None:  # stored again by a later step, once trusted
                        tracked.saved_upto = min(tracked.saved_upto, first)
        if bad or failed:  # kept until every worker ended the load
            for req_id, running in self._async_loads.items():
                reported = set(running.block_ids) if req_id in failed else bad.intersection(running.block_ids)
                if reported:
                    self._async_bad.setdefault(req_id, set()).update(reported)
        judged_bad = bool(bad or failed)
        for req_id in finished_recving or ():
            load = self._async_loads.pop(req_id, None)
            if load is not None:
                reported = self._async_bad.pop(req_id, set())
                self._trust.load_ended(load, reported)
                if reported and req_id in self._requests:  # (not one finished meanwhile)
                    self._load_failed.add(req_id)
                judged_bad = judged_bad or bool(reported)
        if judged_bad:
            for tracked in self._requests.values():
                # vLLM recomputes every request that reads a failed block from that block on; the
                # step that recomputes it stores it again.
                for index, block in enumerate(tracked.block_ids[: tracked.saved_upto]):
                    if self._trust.bad(block):
                        tracked.saved_upto = index
                        break

    # -- the end of a request ---------------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        """Forget the request. True (vLLM keeps its blocks until every worker reports it finished
        receiving) only while an asynchronous load may still write its blocks: stores end inside
        their step, so nothing else holds a block."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._load_failed.discard(req_id)
        self._local_hits.pop(req_id, None)
        self._answered.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        if self._lookups is not None:
            self._lookups.forget(req_id)
        if req_id in self._pending_async:  # allocated, but its load was never sent to the workers
            del self._pending_async[req_id]
            return False
        return req_id in self._async_loads

    def reset_cache(self) -> bool:
        """vLLM resets its prefix cache (also on sleep, pause and KV-memory release): drop what this
        engine remembers of the store (lookups in flight and their answers). The store itself is
        shared with other engines and is never cleared here; after changing weights, give the
        connector a new ``model_id`` or clear the model's objects (docs/vllm.md)."""
        if self._lookups is not None:
            self._lookups.clear()
        self._local_hits.clear()
        self._answered.clear()
        log.info(
            "kvflow forgot its lookups; its store (%s) is shared and keeps its objects", self.config.backend
        )
        return True

    # -- what it tells vLLM besides the steps ------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """``BlockStored`` events of blocks every worker reported stored, since the previous call."""
        return self._tally.take()

    def take_interval(self) -> Observations | None:
        """Lookups answered since the previous call (counts and seconds) and, the first time and
        after a change, whether the lookup store is reachable; None when there is nothing to say."""
        seconds, self._lookup_s = self._lookup_s, []
        reachability: tuple[tuple[str, bool], ...] = ()
        if self._watch is not None:
            self._watch.poll()
            reachability = self._watch.report()
        now = self._counters
        observed = Observations(now.minus(self._reported), lookup_s=seconds, reachability=reachability)
        self._reported = now
        return None if observed.empty else observed

    def shutdown(self) -> None:
        pool, self._pool = self._pool, None
        self._lookups = None
        if pool is not None:
            pool.close()


def _start_lookup(pool: SyncPool, block_hashes: tuple[bytes, ...], block_offset: int) -> CallFuture[int]:
    return pool.submit_lookup(KVRequest(block_hashes=block_hashes, block_offset=block_offset))


def _read_profiles(pool: SyncPool, timeout_s: float) -> None:
    """Read how other engines split this model in the store, at start: the first lookups then
    need not, and an engine whose KV this one cannot share is named now (docs/topology.md)."""
    try:
        others = pool.profiles(timeout_s=timeout_s)
    except Exception as exc:
        log.warning("kvflow could not read the store's profiles at start: %r", exc)
        return
    if others:
        log.info("kvflow: the store holds this model's KV of %d other split(s) as well", len(others))


def _no_other_writes_before_forward(scheduler_output: SchedulerOutput) -> bool:
    """Whether vLLM writes no KV block on the workers before this step's forward: it zeroes new
    blocks (models with Mamba layers, caches of mixed precision) and copies blocks (copy on write)
    there, after the step reaches a worker and before its inputs are prepared. A vLLM that does not
    report these writes is taken to make them."""
    missing = object()
    zeroed = getattr(scheduler_output, "new_block_ids_to_zero", missing)
    copies = getattr(scheduler_output, "kv_cache_block_copies", missing)
    return not (zeroed is missing or copies is missing or zeroed or copies)
