"""The ranks' agreement on failed load steps (:mod:`kvflow.integrations.vllm.agreement`) in one
process, for tests whose worker sides of several ranks run one after another in the test's thread."""

from __future__ import annotations

from collections.abc import Sequence, Set

import attrs

from kvflow.integrations.vllm.agreement import FailedSteps
from kvflow.integrations.vllm.worker import WorkerSide

__all__ = ["RankAgreement"]


@attrs.define(eq=False)
class RankAgreement:
    """Every rank's loads of a step end before any rank's saves of it, so a rank's answer is the
    union of what every rank's worker knows at its call, as the all-reduce's would be. Each call is
    recorded per rank: with vLLM the ranks must call alike (one that calls where another does not
    stalls the group)."""

    sides: dict[int, WorkerSide] = attrs.field(factory=dict)  # rank -> its worker side, once made
    calls: dict[int, list[tuple[int, ...]]] = attrs.field(factory=dict)  # rank -> steps of each call

    def for_rank(self, rank: int) -> FailedSteps:
        self.calls[rank] = []

        def agree(steps: Sequence[int], failed_here: Set[int]) -> frozenset[int]:
            self.calls[rank].append(tuple(steps))
            failed = set(failed_here).union(*(side._failed_steps for side in self.sides.values()))
            return frozenset(step for step in steps if step in failed)

        return agree

    def alike(self) -> bool:
        """Whether every rank made the same calls."""
        made = list(self.calls.values())
        return all(calls == made[0] for calls in made)
