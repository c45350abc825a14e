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
  next step) does not read its tail; one that reads the whole block does. Within a step positions
  are followed one request at a time: several requests may write parts of one block (a failed
  block's request recomputing it and a sharer vLLM rewound onto it), and a request reads what the
  others wrote before it in the block. A block vLLM hands out
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

__all__ = ["BAD", "BadRead", "BlockTrust", "StepWork"]

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


@attrs.frozen
class BadRead:
    """A request of a step read wrong KV: ``block`` is the first block it read it from;
    ``repairing``: another request of the step rewrites that block from good inputs."""

    block: int
    repairing: bool


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

    def computed(self, work: Sequence[StepWork]) -> dict[int, BadRead]:
        """A step's forward: every position written takes the dependencies of what its request read.
        Return, for each request (its index in ``work``) that read ``BAD`` KV, the first block it
        read it from.

        Requests of one step may read what another writes in it (vLLM's prefix cache; vLLM writes
        a layer's KV of the whole batch before any attention reads it), and several may write one
        block (a failed block's request recomputing it and a sharer vLLM rewound onto it), so the
        positions each request writes are followed through the step. A request reads only
        positions before its first one, so no request reads what it writes, nor, through others,
        what depends on that: starting from nothing and growing, the dependencies settle.
        """
        if not self._deps and not self._tails:  # every block is trusted (the usual step): so is
            return {}  # whatever this step writes, and nothing it reads is bad
        step = _Step(_Snapshot(dict(self._deps), dict(self._tails)), work)
        for item in work:
            for block in item.writes:
                self._loaded.pop(block, None)  # from now on computed, not only loaded
        for block, spans in step.written.items():
            # a block holds its new KV up to the furthest position written; before it, also what
            # no request wrote (every request reads the positions before its own, so they count
            # among its inputs in any case), after it what it held before
            ends = [end for _, _, end in spans]
            end = None if None in ends else max(e for e in ends if e is not None)
            head = step.deps_between(block, 0, end, spans)
            tail = None if end is None else step.before.span(block, end, None)
            self._set(block, head)
            if tail and end is not None:
                self._tails[block] = (end, tail)
            else:
                self._tails.pop(block, None)
        return step.bad_reads()

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

    def waits_for(self, blocks: Iterable[int]) -> Deps | None:
        """The load steps whose verdict ``blocks`` wait for (empty: trusted); None when one of them
        holds ``BAD`` KV."""
        found: set[int] = set()
        for block in blocks:
            found |= self._deps.get(block, _CLEAN)
            tail = self._tails.get(block)
            if tail is not None:
                found |= tail[1]
        return None if BAD in found else frozenset(found)

    def bad(self, block: int) -> bool:
        tail = self._tails.get(block)
        return BAD in self._deps.get(block, _CLEAN) or (tail is not None and BAD in tail[1])

    @property
    def any_bad(self) -> bool:
        """Whether some block holds ``BAD`` KV (in whole or in its tail)."""
        return any(BAD in deps for deps in self._deps.values()) or any(
            BAD in deps for _, deps in self._tails.values()
        )

    @property
    def untrusted(self) -> int:
        return len(self._deps.keys() | self._tails.keys())

    def _set(self, block: int, deps: Deps) -> None:
        if deps:
            self._deps[block] = deps
        else:
            self._deps.pop(block, None)


#: A request's positions written in one block: ``(request, first, end)``, ``end`` None to its end.
_Span = tuple[int, int, "int | None"]


@attrs.frozen
class _Snapshot:
    """What the blocks depended on before a step: their heads' dependencies, and their tails."""

    deps: dict[int, Deps]
    tails: dict[int, tuple[int, Deps]]

    def span(self, block: int, first: int, end: int | None) -> Deps:
        """What positions ``[first, end)`` of ``block`` depended on (``end`` None: to its end)."""
        head = self.deps.get(block, _CLEAN)
        tail = self.tails.get(block)
        if tail is None:
            return head
        start, deps = tail
        return (head if first < start else _CLEAN) | (deps if end is None or end > start else _CLEAN)


class _Step:
    """One step's writes, followed position by position: what each request's inputs depend on."""

    def __init__(self, before: _Snapshot, work: Sequence[StepWork]) -> None:
        self.work = work
        self.before = before
        self.written: dict[int, list[_Span]] = {}
        for r, item in enumerate(work):
            last = len(item.writes) - 1
            for i, block in enumerate(item.writes):
                own_first = i == 0 and bool(item.reads) and item.reads[-1] == block
                first = (item.read_to or 0) if own_first else 0
                end = item.written_to if i == last else None
                self.written.setdefault(block, []).append((r, first, end))
        # A request reads mostly blocks nobody writes in the step (a prefix, loaded or computed
        # before): what those depend on is fixed, found once, in bulk; only the others are
        # followed through the step.
        self.fixed: list[Deps] = []
        self.moving: list[list[tuple[int, int | None]]] = []
        for item in work:
            fixed, moving = self._split_reads(item)
            self.fixed.append(fixed)
            self.moving.append(moving)
        self.inputs: list[Deps] = [_CLEAN] * len(work)
        for _ in range(len(work) + 1):  # grows until settled (no request reads its own writes)
            changed = False
            for r in range(len(work)):
                deps = self.fixed[r].union(*(d for _, d in self._moved(r)))
                if deps != self.inputs[r]:
                    self.inputs[r], changed = deps, True
            if not changed:
                break

    def _split_reads(self, item: StepWork) -> tuple[Deps, list[tuple[int, int | None]]]:
        """What the blocks ``item`` reads whole that no request of the step writes depend on; and
        the others it reads (written in the step, or read in part), each with the end of what it
        reads of it (None: all of it)."""
        reads, written, heads, tails = item.reads, self.written, self.before.deps, self.before.tails
        whole = reads if item.read_to is None else reads[:-1]
        unwritten: Sequence[int] = [b for b in whole if b not in written] if written else whole
        moving: list[tuple[int, int | None]] = [(b, None) for b in whole if b in written] if written else []
        if item.read_to is not None and reads:
            moving.append((reads[-1], item.read_to))
        if not tails:
            return frozenset().union(*{heads.get(b, _CLEAN) for b in unwritten}), moving
        found = {heads.get(b, _CLEAN) for b in unwritten if b not in tails}
        tailed = (self.before.span(b, 0, None) for b in unwritten if b in tails)
        return frozenset().union(*found, *tailed), moving

    def _moved(self, r: int) -> Iterator[tuple[int, Deps]]:
        """Each of request ``r``'s moving reads, with what the positions it reads of it depend on."""
        for block, end in self.moving[r]:
            yield block, self.deps_between(block, 0, end, self.written.get(block, []))

    def _reads(self, item: StepWork) -> Iterator[tuple[int, Deps]]:
        """Each block ``item`` reads, in order, with what the positions it reads of it depend on."""
        last = len(item.reads) - 1
        for i, block in enumerate(item.reads):
            end = item.read_to if i == last else None
            yield block, self.deps_between(block, 0, end, self.written.get(block, []))

    def deps_between(self, block: int, first: int, end: int | None, spans: Sequence[_Span]) -> Deps:
        """What positions ``[first, end)`` of ``block`` depend on once the step wrote ``spans``."""
        deps: set[int] = set()
        covered: list[tuple[int, int | None]] = []
        for r, a, b in spans:
            if (end is None or a < end) and (b is None or b > first):
                deps |= self.inputs[r]
                covered.append((a, b))
        at = first  # the positions no span covers keep what they held
        for a, b in sorted(covered, key=lambda c: c[0]):
            if a > at:
                deps |= self.before.span(block, at, a)
            if b is None:
                return frozenset(deps)
            at = max(at, b)
        if end is None or at < end:
            deps |= self.before.span(block, at, end)
        return frozenset(deps)

    def bad_reads(self) -> dict[int, BadRead]:
        """Each request that read ``BAD`` KV: the first block it read it from, and whether a request
        of the step rewrites that block from good inputs (it is being recomputed)."""
        found: dict[int, BadRead] = {}
        for r, item in enumerate(self.work):
            if BAD not in self.inputs[r]:
                continue  # (the usual request: nothing it read is bad, no need to look block by block)
            block = next((b for b, deps in self._reads(item) if BAD in deps), None)
            if block is not None:
                repairing = any(
                    w != r and BAD not in self.inputs[w] for w, _, _ in self.written.get(block, ())
                )
                found[r] = BadRead(block, repairing)
        return found
