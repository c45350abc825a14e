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
  was: that *tail* keeps what it depended on. (vLLM recomputes a failed block in place, and a
  request sharing it through the prefix cache may read all of it after a step that rewrote only
  its first positions.) A request that reads only the block's first positions (the writer's own
  next step) does not read its tail; one that reads the whole block does. A block vLLM hands out
  anew holds nothing yet: it forgets its previous user's dependencies (:meth:`BlockTrust.fresh`).
- When S settles, blocks depending on S drop the dependency if no load of S failed; otherwise they
  are ``BAD``, and stay so until a step rewrites them whole from trusted inputs. A loaded block is
  judged alone: bad when its own load failed, trusted otherwise.

``BAD`` is conservative: a block computed from a step in which some other block failed counts as
bad too. That costs a caching chance after a failure, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

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
    first one it computes) and the blocks it writes (those holding the positions it computes).
    ``read_to``: the positions it reads of its last read block, ``written_to``: those of its last
    written block that hold its KV after the step (None: the whole block)."""

    reads: Sequence[int]
    writes: Sequence[int]
    read_to: int | None = None
    written_to: int | None = None


@attrs.define
class BlockTrust:
    """Dependencies of the blocks that are not trusted. Used from the scheduler thread only."""

    _deps: dict[int, Deps] = attrs.field(factory=dict)
    _loads: dict[int, list[KVRequest]] = attrs.field(factory=dict)  # step -> its loads
    _loaded: dict[int, int] = attrs.field(factory=dict)  # block -> the step that loaded it, unwritten since
    _tails: dict[int, tuple[int, Deps]] = attrs.field(factory=dict)  # block -> (stale from, its deps)

    def loading(self, step: int, load: KVRequest) -> None:
        """``load`` writes its blocks in ``step`` (before the step's forward)."""
        self._loads.setdefault(step, []).append(load)
        for block in load.block_ids:
            self._deps[block] = frozenset({step})
            self._loaded[block] = step
            self._tails.pop(block, None)

    def computed(self, work: Sequence[StepWork]) -> None:
        """A step's forward: every written block takes the dependencies of what its request read.

        Requests of one step may read blocks another writes in it (vLLM's prefix cache), so the
        statuses are propagated until they stop changing.
        """
        for item in work:
            for block in item.writes:
                self._loaded.pop(block, None)  # from now on computed, not only loaded
        tails = {  # the positions a partly written block keeps from before, and their dependencies
            item.writes[-1]: (item.written_to, self._stale(item.writes[-1], item.written_to))
            for item in work
            if item.writes and item.written_to is not None
        }
        for item in work:
            for block in item.writes:
                tail = tails.get(block)
                if tail is not None and tail[1]:
                    self._tails[block] = tail
                else:
                    self._tails.pop(block, None)
        for _ in range(len(work) + 1):
            changed = False
            for item in work:
                deps = self._read_deps(item)
                for block in item.writes:
                    if self._deps.get(block, _CLEAN) != deps:
                        changed = True
                        self._set(block, deps)
            if not changed:
                return

    def _stale(self, block: int, written_to: int) -> Deps:
        """What the positions of ``block`` from ``written_to`` on depend on before this step."""
        head = self._deps.get(block, _CLEAN)
        tail = self._tails.get(block)
        if tail is None:
            return head
        start, deps = tail
        return deps | (head if written_to < start else _CLEAN)

    def _read_deps(self, item: StepWork) -> Deps:
        """What ``item`` reads depends on: each read block's, and its tail's where it reads that."""
        return frozenset().union(*(deps for _, deps in self._reads(item)))

    def _reads(self, item: StepWork) -> Iterator[tuple[int, Deps]]:
        """Each block ``item`` reads, with what the positions it reads of it depend on."""
        last = len(item.reads) - 1
        for i, block in enumerate(item.reads):
            deps = self._deps.get(block, _CLEAN)
            tail = self._tails.get(block)
            if tail is not None and (i < last or item.read_to is None or item.read_to > tail[0]):
                deps = deps | tail[1]
            yield block, deps

    def bad_reads(self, work: Sequence[StepWork]) -> set[int]:
        """The blocks ``work`` reads whose KV (what of it the reader reads) is ``BAD``, as it holds
        once the step wrote (call after :meth:`computed`: a block another request of the step
        rewrites whole from good inputs is read good, as vLLM writes a layer's KV of the whole
        batch before any request's attention reads it)."""
        return {block for item in work for block, deps in self._reads(item) if BAD in deps}

    def fresh(self, blocks: Iterable[int]) -> None:
        """vLLM handed ``blocks`` out anew (they hold no position of their request yet): they
        forget the dependencies of what they held before."""
        for block in blocks:
            self._deps.pop(block, None)
            self._loaded.pop(block, None)
            self._tails.pop(block, None)

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
        for block, (start, deps) in list(self._tails.items()):
            if step in deps:
                settled = (deps - {step}) | ({BAD} if failed else set())
                if settled:
                    self._tails[block] = (start, settled)
                else:
                    del self._tails[block]
        return loads

    def load_ended(self, load: KVRequest, bad_blocks: Iterable[int]) -> None:
        """An asynchronous load ended on every worker (nobody read its blocks meanwhile)."""
        bad = set(bad_blocks)
        for block in load.block_ids:
            self._set(block, frozenset({BAD}) if block in bad else _CLEAN)
            self._tails.pop(block, None)

    def trusted(self, blocks: Iterable[int]) -> bool:
        """Whether every one of ``blocks`` holds KV known good on every rank, all its positions."""
        deps, tails = self._deps, self._tails
        return not any(b in deps or b in tails for b in blocks)

    def bad(self, block: int) -> bool:
        tail = self._tails.get(block)
        return BAD in self._deps.get(block, _CLEAN) or (tail is not None and BAD in tail[1])

    @property
    def untrusted(self) -> int:
        return len(self._deps.keys() | self._tails.keys())

    def _set(self, block: int, deps: Deps) -> None:
        if deps:
            self._deps[block] = deps
        else:
            self._deps.pop(block, None)
