"""Lookups that never hold vLLM's scheduler thread for long.

vLLM asks the connector how many tokens it can load when it admits a request, on the scheduler
thread that also drives every running request. :class:`Lookups` runs lookups on kvflow's loop
thread:

- a lookup starts as soon as vLLM announces the request (``on_new_request``), from block 0, so its
  answer is usually ready when the scheduler asks;
- when the scheduler asks, it waits for the answer at most what is left of ``wait_s`` for the
  current step (all lookups of one step share that budget). If the store answered, the answer is
  used at once; if not, vLLM is told "ask again next step" (``None``) and the lookup keeps running;
- the answer is kept: vLLM asks again, step after step, about a request whose blocks it could not
  allocate, and each ask of the next step gets the kept answer at once, with no new lookup and no
  wait. It is looked up afresh after a step without an ask (the request may have been allocated,
  run and been preempted since: it holds more of the store now), when its blocks changed, and once
  forgotten (:meth:`Lookups.forget`: allocated or finished) or cleared;
- an answer from block 0 still serves a request whose own prefix cache turned out to hold the first
  blocks, as long as it reaches past them; otherwise the lookup is asked again from the first block
  vLLM does not hold;
- a lookup still running when its answer is due (the future's ``answer_by``: the pool's own
  bound plus the loop's grace) counts as "nothing cached" (and that answer is kept too).

So a slow or dead store delays admissions by at most the lookup timeout (and the grace) and each
step by at most ``wait_s``. A kept answer may age while vLLM keeps asking: the store may lose
objects it counted (the load then fails and vLLM recomputes them) or gain some (a missed hit, never
wrong data). A request's first answer is timed (start to answer) for the stats, and
:meth:`Lookups.forget` hands the seconds over once: the scheduler counts a lookup, with its
seconds, once per allocation. Used from the scheduler thread only.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

import attrs

from kvflow.integrations.vllm.timing import Stopwatch
from kvflow.loop import CallFuture

__all__ = ["LookupStart", "Lookups"]

log = logging.getLogger(__name__)

#: ``start(block_hashes, block_offset)`` starts a lookup and returns its future: the leading tokens
#: of the request the store holds, blocks before ``block_offset`` counted as held.
LookupStart = Callable[[tuple[bytes, ...], int], "CallFuture[int]"]


@attrs.define(eq=False)
class _Lookup:
    """One request's lookup: running, then (``hit`` set) answered and kept."""

    future: CallFuture[int]
    block_hashes: tuple[bytes, ...]
    block_offset: int
    watch: Stopwatch
    hit: int | None = None  # the answer, once there is one (0 for a failed or overdue lookup)
    asked: int = 0  # the step of the last ask

    def serves(self, block_hashes: tuple[bytes, ...], block_offset: int, block_size: int) -> bool:
        """Whether this lookup answers for a request of these blocks whose first ``block_offset``
        blocks vLLM holds."""
        if block_hashes != self.block_hashes or block_offset < self.block_offset:
            return False
        if block_offset == self.block_offset:
            return True
        # From an earlier block: usable once it shows the store's run reaches past vLLM's blocks.
        hit = self.hit
        future = self.future
        if hit is None and future.done() and not future.cancelled() and future.exception() is None:
            hit = future.result()  # answered, not yet asked for
        return hit is not None and hit >= block_offset * block_size


@attrs.define(eq=False)
class Lookups:
    """The lookups of requests waiting for admission (running or answered), by request id."""

    start: LookupStart
    block_size: int
    wait_s: float
    _lookups: dict[str, _Lookup] = attrs.field(factory=dict, init=False)
    _first_s: dict[str, float] = attrs.field(factory=dict, init=False)  # seconds of a first answer
    _step: int = attrs.field(default=0, init=False)
    _budget_s: float = attrs.field(default=0.0, init=False)

    def __attrs_post_init__(self) -> None:
        self._budget_s = self.wait_s

    def new_step(self) -> None:
        """A scheduler step ended: the next one may wait ``wait_s`` again."""
        self._step += 1
        self._budget_s = self.wait_s

    def prefetch(self, req_id: str, block_hashes: tuple[bytes, ...]) -> None:
        """Start looking up a request vLLM just received (from block 0)."""
        if block_hashes and req_id not in self._lookups:
            self._lookups[req_id] = self._begin(block_hashes, 0)

    def poll(self, req_id: str, block_hashes: tuple[bytes, ...], block_offset: int) -> int | None:
        """Leading tokens of the request the store holds (blocks before ``block_offset`` count as
        held), or None while the lookup is still running. Asked again in the next step, it
        answers from the kept answer when that serves."""
        lookup = self._lookups.get(req_id)
        if (
            lookup is None
            or (lookup.hit is not None and lookup.asked < self._step - 1)  # a step without an ask
            or not lookup.serves(block_hashes, block_offset, self.block_size)
        ):
            lookup = self._lookups[req_id] = self._begin(block_hashes, block_offset)
        lookup.asked = self._step
        if lookup.hit is None:
            hit = self._wait(req_id, lookup)
            if hit is None:
                return None
            lookup.hit = hit
            self._first_s.setdefault(req_id, lookup.watch.seconds)
        return max(lookup.hit, block_offset * self.block_size)

    def forget(self, req_id: str) -> float | None:
        """Drop a request's lookup and its kept answer; the seconds of its first answer since it
        was last forgotten, if it had one. Call it when the request finished and when vLLM
        allocated its blocks (its answer is used: readmitted after a preemption, it is looked up
        afresh, and timed again, as the scheduler counts it again)."""
        self._lookups.pop(req_id, None)
        return self._first_s.pop(req_id, None)

    def clear(self) -> None:
        """Drop every lookup and kept answer (vLLM reset its prefix cache): the next asks look up
        afresh. A request's first answer stays the one timed until it is forgotten."""
        self._lookups.clear()

    def __len__(self) -> int:
        return len(self._lookups)

    def _wait(self, req_id: str, lookup: _Lookup) -> int | None:
        """The lookup's answer within what is left of the step's budget; None if it is not due yet."""
        started = time.monotonic()
        try:
            hit = lookup.future.result(timeout=max(0.0, self._budget_s))
        except concurrent.futures.TimeoutError:
            self._budget_s -= time.monotonic() - started
            if time.monotonic() < lookup.future.answer_by:
                return None
            log.warning("kvflow lookup for request %s overran its timeout; computing it", req_id)
            lookup.future.cancel()
            return 0
        except Exception as exc:  # a store that is down means "no hit", never a failed request
            log.warning("kvflow lookup for request %s failed, computing it: %r", req_id, exc)
            return 0
        self._budget_s -= time.monotonic() - started
        return hit

    def _begin(self, block_hashes: tuple[bytes, ...], block_offset: int) -> _Lookup:
        watch = Stopwatch()
        future = self.start(block_hashes, block_offset)
        return _Lookup(future, block_hashes, block_offset, watch.watch(future), asked=self._step)
