"""A store or a load of a batch of requests, unit by unit.

A :class:`StoreJob` knows which blocks this rank owns and their keys; :meth:`StoreJob.skip_present`
asks the store once which of them exist (over every unit), and :meth:`StoreJob.put` puts one unit
of the rest. A :class:`LoadJob` gets one unit at a time into the cache; a block that any unit fails
to load stays failed. Both report per request at the end (:meth:`results`). The face decides when
each unit moves: all at once (``KVPool``), or each layer once its device event fired (the layerwise
storer) or one layer ahead of the engine (the layerwise retriever).

Jobs are used from the transfer's event loop; a unit's call never runs twice.
"""

from __future__ import annotations

import attrs

from kvflow.backends.base import GetStatus, PutStatus
from kvflow.ownership import owner
from kvflow.results import RetrieveResult, StoreResult
from kvflow.transfer.core import Transfer, Unit
from kvflow.transfer.plan import BlockPlan

__all__ = ["LoadJob", "StoreJob"]

# Folding a block's per-unit put statuses: the worst one wins.
_SEVERITY = {PutStatus.PRESENT: 0, PutStatus.STORED: 1, PutStatus.NO_SPACE: 2, PutStatus.FAILED: 3}
_PUT_FAILURES = (PutStatus.NO_SPACE, PutStatus.FAILED)


@attrs.define(eq=False)
class StoreJob:
    """Puts the blocks of ``plan`` that this rank owns, unit by unit, skipping present keys."""

    transfer: Transfer
    plan: BlockPlan
    owned: list[int] = attrs.field(init=False)  # flat indices of the blocks this rank puts
    _keys: dict[Unit, list[str]] = attrs.field(init=False, factory=dict)
    _present: dict[Unit, list[bool]] = attrs.field(init=False, factory=dict)
    _statuses: dict[Unit, list[PutStatus]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        parallel = self.transfer.parallel
        rank = parallel.tp_rank
        self.owned = [j for j, i in enumerate(self.plan.indices) if owner(i, parallel) == rank]

    def keys(self, unit: Unit) -> list[str]:
        """The keys of this rank's owned blocks for ``unit``."""
        keys = self._keys.get(unit)
        if keys is None:
            hashes = [self.plan.hashes[j] for j in self.owned]
            keys = self._keys[unit] = self.transfer.keys(self.transfer.scope(), hashes, unit)
        return keys

    async def skip_present(self, deadline: float) -> None:
        """Ask once which owned keys exist, over every unit; those are not put. Reads no KV, so it
        may run before the blocks are written. A store that cannot answer means "none present"."""
        units = self.transfer.units
        n = len(self.owned)
        if not n:
            return
        found = await self.transfer.exists([k for u in units for k in self.keys(u)], deadline)
        for i, unit in enumerate(units):
            self._present[unit] = found[i * n : (i + 1) * n] if found is not None else [False] * n

    async def put(self, unit: Unit, deadline: float) -> int:
        """Put ``unit`` of every owned block not present; return how many failed to store."""
        present = self._present.get(unit) or [False] * len(self.owned)
        statuses = [PutStatus.PRESENT if p else PutStatus.FAILED for p in present]
        todo = [k for k, p in enumerate(present) if not p]
        if todo:
            keys, block_ids = self.keys(unit), self.plan.block_ids
            objects = self.transfer.objects(
                [keys[k] for k in todo], [block_ids[self.owned[k]] for k in todo], unit
            )
            for k, status in zip(todo, await self.transfer.put(objects, deadline)):
                statuses[k] = status
        self._statuses[unit] = statuses
        return sum(1 for s in statuses if s in _PUT_FAILURES)

    def abandon(self, unit: Unit) -> int:
        """``unit`` will never be written (its event never fired): it fails where not present."""
        present = self._present.get(unit) or [False] * len(self.owned)
        statuses = [PutStatus.PRESENT if p else PutStatus.FAILED for p in present]
        self._statuses[unit] = statuses
        return sum(1 for s in statuses if s is PutStatus.FAILED)

    def results(self) -> list[StoreResult]:
        """One :class:`StoreResult` per request: a block's status is the worst over its units
        (``None`` where another rank owns it; FAILED where a unit never finished)."""
        done = [self._statuses.get(u) for u in self.transfer.units]
        if any(s is None for s in done):  # cancelled: some unit never finished
            worst = [PutStatus.FAILED] * len(self.owned)
        else:
            worst = [max(column, key=_SEVERITY.__getitem__) for column in zip(*done)]
        flat: list[PutStatus | None] = [None] * len(self.plan)
        for j, status in zip(self.owned, worst):
            flat[j] = status
        return [StoreResult(tuple(flat[a:b])) for a, b in self.plan.spans]


@attrs.define(eq=False)
class LoadJob:
    """Gets every block of ``plan`` into the cache, unit by unit; every rank loads every block of its
    namespace, starting at a rank-dependent block."""

    transfer: Transfer
    plan: BlockPlan
    _order: list[int] = attrs.field(init=False)  # flat indices, rotated by rank
    _status: list[GetStatus] = attrs.field(init=False)  # per flat block: HIT until a unit is not
    _done: set[Unit] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self._order = self.transfer.load_order(len(self.plan))
        self._status = [GetStatus.HIT] * len(self.plan)

    async def get(self, unit: Unit, deadline: float) -> int:
        """Get ``unit`` of every block not failed yet; return how many blocks of it did not arrive."""
        status, plan = self._status, self.plan
        todo = [j for j in self._order if status[j] is GetStatus.HIT]  # a failed block stays failed
        keys = self.transfer.keys(self.transfer.scope(), [plan.hashes[j] for j in todo], unit)
        objects = self.transfer.objects(keys, [plan.block_ids[j] for j in todo], unit)
        hits = 0
        for j, result in zip(todo, await self.transfer.get(objects, deadline)):
            if result is GetStatus.HIT:
                hits += 1
            else:
                status[j] = result
        self._done.add(unit)
        return len(status) - hits

    def results(self) -> list[RetrieveResult]:
        """One :class:`RetrieveResult` per request: a block is a HIT only if every unit of it was
        loaded; otherwise the engine must recompute it."""
        status = self._status
        if len(self._done) < len(self.transfer.units):  # cancelled: unfinished units hold junk
            status = [GetStatus.FAILED if s is GetStatus.HIT else s for s in status]
        block_size = self.transfer.format.block_size
        return [
            RetrieveResult(tuple(self.plan.block_ids[a:b]), tuple(status[a:b]), block_size)
            for a, b in self.plan.spans
        ]
