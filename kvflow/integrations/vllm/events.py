"""KV cache events: the blocks the connector put in the store, for KV-aware routers.

With vLLM's KV events on (``kv_events_config=KVEventsConfig(enable_kv_cache_events=True, ...)``),
each worker turns every save that ended into one ``BlockStored`` per block (as vLLM reports the
blocks of its own prefix cache: one hash each, its parent, its tokens), with ``medium="CPU"`` and
the hashes in vLLM's form (so a router sees the same hash for the block in the engine's GPU cache
and in the store). A rank reports a block when it stored it, found it present, or another rank of
its replica group owns it; it does not report a block it failed to store.

vLLM moves the workers' events to the scheduler side (:class:`KVFlowKVEvents`, merged across
workers in one step), each as its worker's report (:class:`WorkerEvent`), where
:class:`EventTally` releases a block's event once every worker reported it, possibly over several
steps (a staged put ends a step later): only then does every KV-head range and pipeline stage of
the block hold it. A worker that reports a block twice (two requests of a step computed it, or
it was stored again) still counts once. vLLM publishes what ``take_events`` yields.

No ``BlockRemoved``: neither store tells a client when it evicts (the local store evicts inside
whichever process writes next, possibly another engine's; Mooncake evicts inside its master). A
router should treat the store's blocks as hints that may expire (docs/disaggregated.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvflow.backends.base import PutStatus
from kvflow.request import KVRequest
from kvflow.results import StoreResult

__all__ = ["EventTally", "KVFlowKVEvents", "WorkerEvent", "stored_events"]

_REPORTED = (None, PutStatus.STORED, PutStatus.PRESENT)  # None: another rank of the group owns it


class WorkerEvent(KVCacheEvent):
    """``event`` as worker ``worker`` (``pp_rank * tp_size + tp_rank``) reported it."""

    worker: int
    event: KVCacheEvent

    def __hash__(self) -> int:
        return hash((self.worker, self.event))


class KVFlowKVEvents(KVConnectorKVEvents):
    """The reports (:class:`WorkerEvent`) of one step of one or more workers, as vLLM moves and
    merges them."""

    def __init__(self, events: Sequence[KVCacheEvent] = (), num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events)
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVFlowKVEvents:
        """Keep the reports of the events every worker reported (one report of each worker)."""
        by_event: dict[KVCacheEvent, dict[int, KVCacheEvent]] = {}
        for report in self._events:
            worker, event = _reported(report)
            by_event.setdefault(event, {}).setdefault(worker, report)
        self._events = [
            r for reports in by_event.values() if len(reports) >= self._workers for r in reports.values()
        ]
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []

    def __repr__(self) -> str:
        return f"<KVFlowKVEvents {len(self._events)} events of {self._workers} workers>"


def stored_events(
    span: KVRequest, tokens: Sequence[int], result: StoreResult, block_size: int
) -> list[BlockStored]:
    """One ``BlockStored`` per block of ``span`` this rank reports (see the module docstring).

    ``tokens`` are the tokens of the span's blocks (``block_size`` per block, from its first).
    """
    hashes = span.block_hashes or ()
    events = []
    for i, status in enumerate(result.statuses):
        if status not in _REPORTED:
            continue
        index = span.block_offset + i
        parent = maybe_convert_block_hash(BlockHash(hashes[index - 1])) if index else None
        events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(hashes[index]))],
                parent_block_hash=parent,
                token_ids=[int(t) for t in tokens[i * block_size : (i + 1) * block_size]],
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
                group_idx=0,
            )
        )
    return events


@attrs.define(eq=False)
class EventTally:
    """Which workers reported each block's event (scheduler thread only); an event is released
    once all ``workers`` have, each counted once however often it reported.

    An event some worker has not reported within ``max_age_s`` seconds of the first report (a
    worker's store is bounded by the pool's timeout, however many engine steps run meanwhile:
    its store failed) is dropped, so the tally stays small.
    """

    workers: int
    max_age_s: float = 120.0
    _pending: dict[KVCacheEvent, tuple[set[int], float]] = attrs.field(factory=dict, init=False)
    _ready: list[KVCacheEvent] = attrs.field(factory=list, init=False)

    def add(self, events: KVConnectorKVEvents | None) -> None:
        """One step's merged worker events (None when no worker had any)."""
        now = time.monotonic()
        for report in events.get_all_events() if events is not None else ():
            worker, event = _reported(report)
            seen, _ = self._pending.setdefault(event, (set(), now))
            seen.add(worker)
            if len(seen) >= self.workers:
                del self._pending[event]
                self._ready.append(event)
        oldest = now - self.max_age_s
        for event in [e for e, (_, first) in self._pending.items() if first < oldest]:
            del self._pending[event]

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready

    def __len__(self) -> int:
        return len(self._pending)


def _reported(report: KVCacheEvent) -> tuple[int, KVCacheEvent]:
    """(worker, event) of a report; an event that is not a :class:`WorkerEvent` is worker 0's."""
    if isinstance(report, WorkerEvent):
        return report.worker, report.event
    return 0, report
