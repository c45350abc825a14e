"""Which engine blocks hold KV that is not known good on every rank. Pure bookkeeping, no I/O.

The rule that keeps the store free of wrong KV (docs/vllm.md has the argument): a block is stored
only when its KV is *trusted*. Every engine block that is not trusted has *dependencies*: the load
steps whose verdict it waits for, or ``BAD``.

- A load writes its blocks in step S: they depend on S until every worker reported S's loads ended
  (until then some rank's copy may be wrong, and with tensor parallelism every rank computed from
  every rank's copy).
- A step computes a request's new KV from the KV of its earlier positions: the blocks it writes get
  the union of the dependencies of the blocks it reads. A request that reads another's blocks
  through vLLM's prefix cache reads them like its own, loaded ones included. So KV computed from a
  pending load stays pending, even after the loaded blocks themselves were recomputed.
- A step that writes a block only up to a position inside it leaves the rest of the block as it
  was: the block keeps its dependencies too. (vLLM recomputes a failed block in place, and a
  request sharing it through the prefix cache may read all of it after a step that rewrote only
  its first positions.) A block vLLM hands out anew holds nothing yet: it forgets its previous
  user's dependencies (:meth:`BlockTrust.fresh`).
- When S settles, blocks depending on S drop the dependency if no load of S failed; otherwise they
  are ``BAD``, and stay so until a step rewrites them whole from trusted inputs. A loaded block is
  judged alone: bad when its own load failed, trusted otherwise.

``BAD`` is conservative: a block computed from a step in which some other block failed counts as
bad too. That costs a caching chance after a failure, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvflow.request import KVRequest

__all__ = ["BAD", "BlockTrust", "StepWork"]

#: The dependency of a block whose KV is wrong (a failed load, or computed from one).
BAD = -1

Deps = frozenset[int]
_CLEAN: Deps = frozenset()


@attrs.frozen
class StepWork:
    """What one request does in a step: the blocks it reads (those holding positions before the
    first one it computes) and the blocks it writes (those holding the positions it computes);
    ``partial``: the last written block is written only up to a position inside it."""

    reads: Sequence[int]
    writes: Sequence[int]
    partial: bool = False


@attrs.define
class BlockTrust:
    """Dependencies of the blocks that are not trusted. Used from the scheduler thread only."""

    _deps: dict[int, Deps] = attrs.field(factory=dict)
    _loads: dict[int, list[KVRequest]] = attrs.field(factory=dict)  # step -> its loads
    _loaded: dict[int, int] = attrs.field(factory=dict)  # block -> the step that loaded it, unwritten since

    def loading(self, step: int, load: KVRequest) -> None:
        """``load`` writes its blocks in ``step`` (before the step's forward)."""
        self._loads.setdefault(step, []).append(load)
        for block in load.block_ids:
            self._deps[block] = frozenset({step})
            self._loaded[block] = step

    def computed(self, work: Sequence[StepWork]) -> None:
        """A step's forward: every written block takes the dependencies of what its request read.

        Requests of one step may read blocks another writes in it (vLLM's prefix cache), so the
        statuses are propagated until they stop changing.
        """
        for item in work:
            for block in item.writes:
                self._loaded.pop(block, None)  # from now on computed, not only loaded
        kept = {  # what a partly written block held before: it keeps holding that
            item.writes[-1]: self._deps.get(item.writes[-1], _CLEAN)
            for item in work
            if item.partial and item.writes
        }
        for _ in range(len(work) + 1):
            changed = False
            for item in work:
                deps = frozenset().union(*(self._deps.get(b, _CLEAN) for b in item.reads))
                for block in item.writes:
                    new = deps | kept.get(block, _CLEAN)
                    if self._deps.get(block, _CLEAN) != new:
                        changed = True
                        self._set(block, new)
            if not changed:
                return

    def fresh(self, blocks: Iterable[int]) -> None:
        """vLLM handed ``blocks`` out anew (they hold no position of their request yet): they
        forget the dependencies of what they held before."""
        for block in blocks:
            self._deps.pop(block, None)
            self._loaded.pop(block, None)

    def settle(self, step: int, bad_blocks: Iterable[int]) -> list[KVRequest]:
        """Every worker reported ``step``'s loads ended; ``bad_blocks`` did not load. Return the
        step's loads."""
        bad = set(bad_blocks)
        loads = self._loads.pop(step, [])
        failed = any(b in bad for load in loads for b in load.block_ids)
        for block, deps in list(self._deps.items()):
            if step not in deps:
                continue
            if self._loaded.get(block) == step:  # loaded, not written since: judged by its own load
                del self._loaded[block]
                self._set(block, frozenset({BAD}) if block in bad else _CLEAN)
            else:
                self._set(block, (deps - {step}) | ({BAD} if failed else set()))
        return loads

    def load_ended(self, load: KVRequest, bad_blocks: Iterable[int]) -> None:
        """An asynchronous load ended on every worker (nobody read its blocks meanwhile)."""
        bad = set(bad_blocks)
        for block in load.block_ids:
            self._set(block, frozenset({BAD}) if block in bad else _CLEAN)

    def trusted(self, blocks: Iterable[int]) -> bool:
        """Whether every one of ``blocks`` holds KV known good on every rank."""
        deps = self._deps
        return not any(b in deps for b in blocks)

    def bad(self, block: int) -> bool:
        return BAD in self._deps.get(block, _CLEAN)

    @property
    def untrusted(self) -> int:
        return len(self._deps)

    def _set(self, block: int, deps: Deps) -> None:
        if deps:
            self._deps[block] = deps
        else:
            self._deps.pop(block, None)
