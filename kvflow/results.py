"""What store and retrieve report, per block."""

from __future__ import annotations

import attrs

from kvflow.backends.base import GetStatus, PutStatus

__all__ = ["RetrieveResult", "StoreResult"]


@attrs.frozen
class StoreResult:
    """One entry per block of the request: its put status, or ``None`` where another rank of this
    rank's replica group owns the block (this rank did not store it)."""

    statuses: tuple[PutStatus | None, ...]

    def count(self, status: PutStatus | None) -> int:
        return sum(1 for s in self.statuses if s is status)

    @property
    def stored(self) -> int:
        return self.count(PutStatus.STORED)

    @property
    def present(self) -> int:
        return self.count(PutStatus.PRESENT)

    @property
    def not_owned(self) -> int:
        return self.count(None)

    @property
    def failed_indices(self) -> tuple[int, ...]:
        """Blocks this rank owned but could not store (no space or failure)."""
        bad = (PutStatus.NO_SPACE, PutStatus.FAILED)
        return tuple(i for i, s in enumerate(self.statuses) if s in bad)

    @property
    def ok(self) -> bool:
        return not self.failed_indices


@attrs.frozen
class RetrieveResult:
    """One status per requested block, and the block ids the engine must recompute."""

    block_ids: tuple[int, ...]
    statuses: tuple[GetStatus, ...]
    block_size: int

    @property
    def failed_block_ids(self) -> tuple[int, ...]:
        """Destination block ids that were not filled (miss or failure): recompute them."""
        return tuple(b for b, s in zip(self.block_ids, self.statuses) if s is not GetStatus.HIT)

    @property
    def hit_blocks(self) -> int:
        """How many leading blocks were loaded: the usable prefix."""
        for i, status in enumerate(self.statuses):
            if status is not GetStatus.HIT:
                return i
        return len(self.statuses)

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size
