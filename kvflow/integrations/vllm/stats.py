"""What a worker's connector moved: counters per block, and their form for vLLM's stats pipeline.

:class:`TransferCounters` is one worker's running total (read it with
``KVFlowConnector.counters()``). :class:`KVFlowConnectorStats` carries the counts of one interval
from each worker to vLLM's stats logger, which sums them over workers (``KV Transfer metrics: ...``
in vLLM's log when stats logging is on).
"""

from __future__ import annotations

from typing import Any

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvflow.results import RetrieveResult, StoreResult

__all__ = ["KVFlowConnectorStats", "TransferCounters"]


@attrs.frozen
class TransferCounters:
    """Blocks one worker moved, since it started.

    ``loaded_blocks`` arrived whole; ``load_failed_blocks`` missed or failed (vLLM recomputed them);
    ``stored_blocks`` were written by this rank, ``present_blocks`` were already in the store,
    ``not_owned_blocks`` belong to another rank of this rank's replica group (it stores them),
    ``store_failed_blocks`` could not be written (no space, store fault), ``dropped_save_blocks``
    were not stored because a load of the same step failed (their KV may rest on the failed blocks).
    """

    load_requests: int = 0
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    store_requests: int = 0
    stored_blocks: int = 0
    present_blocks: int = 0
    not_owned_blocks: int = 0
    store_failed_blocks: int = 0
    dropped_save_blocks: int = 0

    def with_load(self, result: RetrieveResult) -> TransferCounters:
        failed = len(result.failed_block_ids)
        return attrs.evolve(
            self,
            load_requests=self.load_requests + 1,
            loaded_blocks=self.loaded_blocks + len(result.block_ids) - failed,
            load_failed_blocks=self.load_failed_blocks + failed,
        )

    def with_failed_load(self, num_blocks: int) -> TransferCounters:
        return attrs.evolve(
            self,
            load_requests=self.load_requests + 1,
            load_failed_blocks=self.load_failed_blocks + num_blocks,
        )

    def with_store(self, result: StoreResult) -> TransferCounters:
        return attrs.evolve(
            self,
            store_requests=self.store_requests + 1,
            stored_blocks=self.stored_blocks + result.stored,
            present_blocks=self.present_blocks + result.present,
            not_owned_blocks=self.not_owned_blocks + result.not_owned,
            store_failed_blocks=self.store_failed_blocks + len(result.failed_indices),
        )

    def with_failed_store(self, num_blocks: int) -> TransferCounters:
        return attrs.evolve(
            self,
            store_requests=self.store_requests + 1,
            store_failed_blocks=self.store_failed_blocks + num_blocks,
        )

    def with_dropped_saves(self, num_blocks: int) -> TransferCounters:
        return attrs.evolve(self, dropped_save_blocks=self.dropped_save_blocks + num_blocks)

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)

    def minus(self, earlier: TransferCounters) -> TransferCounters:
        """The counts since ``earlier`` (a snapshot of the same worker)."""
        now, then = self.as_dict(), earlier.as_dict()
        return TransferCounters(**{key: now[key] - then[key] for key in now})

    @property
    def empty(self) -> bool:
        return not any(self.as_dict().values())


class KVFlowConnectorStats(KVConnectorStats):
    """One interval's :class:`TransferCounters`, summed over the workers that sent them."""

    @classmethod
    def of(cls, counters: TransferCounters) -> KVFlowConnectorStats:
        return cls(data=counters.as_dict())

    def reset(self) -> None:
        self.data = TransferCounters().as_dict()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, int):
                self.data[key] = int(self.data.get(key, 0)) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(value) for key, value in self.data.items() if isinstance(value, int)}

    def is_empty(self) -> bool:
        return not any(isinstance(v, int) and v for v in self.data.values())

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVFlowConnectorStats:
        return cls(data=dict(data or {}))
