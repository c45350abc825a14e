"""KV cache events: the blocks the connector put in the store, for KV-aware routers.

With vLLM's KV events on (``kv_events_config=KVEventsConfig(enable_kv_cache_events=True, ...)``),
each worker turns every save that ended into one ``BlockStored`` per block (as vLLM reports the
blocks of its own prefix cache: one hash each, its parent, its tokens), with ``medium="CPU"`` and
the hashes in vLLM's form (so a router sees the same hash for the block in the engine's GPU cache
and in the store). A rank reports a block when it stored it, found it present, or another rank of
its replica group owns it; it does not report a block it failed to store.

vLLM moves the workers' events to the scheduler side (:class:`KVFlowKVEvents`, merged across
workers in one step), where :class:`EventTally` releases a block's event once every worker
reported it, possibly over several steps (a staged put ends a step later): only then does every
KV-head range and pipeline stage of the block hold it. vLLM publishes what ``take_events`` yields.

No ``BlockRemoved``: neither store tells a client when it evicts (the local store evicts inside
whichever process writes next, possibly another engine's; Mooncake evicts inside its master). A
router should treat the store's blocks as hints that may expire (docs/disaggregated.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvflow.backends.base import PutStatus
from kvflow.request import KVRequest
from kvflow.results import StoreResult

__all__ = ["EventTally", "KVFlowKVEvents", "stored_events"]

_REPORTED = (None, PutStatus.STORED, PutStatus.PRESENT)  # None: another rank of the group owns it


class KVFlowKVEvents(KVConnectorKVEvents):
    """The events of one step of one or more workers, as vLLM moves and merges them."""

    def __init__(self, events: Sequence[KVCacheEvent] = (), num_workers: int = 1) -> None:
        self._events: list[KVCacheEvent] = list(events)
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVFlowKVEvents:
        """Keep the events every worker reported (each once)."""
        counts = Counter(self._events)
        self._events = [event for event, n in counts.items() if n >= self._workers]
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
    """Counts each block's event over the workers (scheduler thread only).

    An event some worker has not reported within ``max_age_steps`` steps (its store failed there)
    is dropped, so the tally stays small.
    """

    workers: int
    max_age_steps: int = 64
    _pending: dict[KVCacheEvent, tuple[int, int]] = attrs.field(factory=dict, init=False)  # count, step
    _ready: list[KVCacheEvent] = attrs.field(factory=list, init=False)
    _step: int = attrs.field(default=0, init=False)

    def add(self, events: KVConnectorKVEvents | None) -> None:
        """One step's merged worker events (None when no worker had any)."""
        self._step += 1
        for event in events.get_all_events() if events is not None else ():
            count, first = self._pending.get(event, (0, self._step))
            if count + 1 >= self.workers:
                self._pending.pop(event, None)
                self._ready.append(event)
            else:
                self._pending[event] = (count + 1, first)
        oldest = self._step - self.max_age_steps
        for event in [e for e, (_, first) in self._pending.items() if first < oldest]:
            del self._pending[event]

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready

    def __len__(self) -> int:
        return len(self._pending)
