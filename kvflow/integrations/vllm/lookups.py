"""Lookups that never hold vLLM's scheduler thread for long.

vLLM asks the connector how many tokens it can load when it admits a request, on the scheduler
thread that also drives every running request. :class:`Lookups` runs lookups on kvflow's loop
thread:

- a lookup starts as soon as vLLM announces the request (``on_new_request``), from block 0, so its
  answer is usually ready when the scheduler asks;
- when the scheduler asks, it waits for the answer at most what is left of ``wait_s`` for the
  current step (all lookups of one step share that budget). If the store answered, the answer is
  used at once; if not, vLLM is told "ask again next step" (``None``) and the lookup keeps running;
- an answer from block 0 still serves a request whose own prefix cache turned out to hold the first
  blocks, as long as it reaches past them; otherwise the lookup is asked again from the first block
  vLLM does not hold;
- a lookup still running when its answer is due (the future's ``answer_by``: the pool's own
  bound plus the loop's grace) counts as "nothing cached".

So a slow or dead store delays admissions by at most the lookup timeout (and the grace) and each
step by at most ``wait_s``. Each answered lookup leaves its seconds (start to answer) for the
stats (:meth:`Lookups.take_seconds`). Used from the scheduler thread only.
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
class _Pending:
    future: CallFuture[int]
    num_blocks: int
    block_offset: int
    watch: Stopwatch

    def serves(self, num_blocks: int, block_offset: int, block_size: int) -> bool:
        """Whether this lookup answers for a request of ``num_blocks`` whose first ``block_offset``
        blocks vLLM holds."""
        if num_blocks != self.num_blocks or block_offset < self.block_offset:
            return False
        if block_offset == self.block_offset:
            return True
        # From an earlier block: usable once it shows the store's run reaches past vLLM's blocks.
        if not self.future.done() or self.future.exception() is not None:
            return False
        return self.future.result() >= block_offset * block_size


@attrs.define(eq=False)
class Lookups:
    """The lookups of requests waiting for admission, by request id."""

    start: LookupStart
    block_size: int
    wait_s: float
    _pending: dict[str, _Pending] = attrs.field(factory=dict, init=False)
    _budget_s: float = attrs.field(default=0.0, init=False)
    _seconds: list[float] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        self._budget_s = self.wait_s

    def new_step(self) -> None:
        """A scheduler step ended: the next one may wait ``wait_s`` again."""
        self._budget_s = self.wait_s

    def prefetch(self, req_id: str, block_hashes: tuple[bytes, ...]) -> None:
        """Start looking up a request vLLM just received (from block 0)."""
        if block_hashes and req_id not in self._pending:
            self._pending[req_id] = self._begin(block_hashes, 0)

    def poll(self, req_id: str, block_hashes: tuple[bytes, ...], block_offset: int) -> int | None:
        """Leading tokens of the request the store holds (blocks before ``block_offset`` count as
        held), or None while the lookup is still running."""
        pending = self._pending.get(req_id)
        if pending is None or not pending.serves(len(block_hashes), block_offset, self.block_size):
            pending = self._pending[req_id] = self._begin(block_hashes, block_offset)
        started = time.monotonic()
        try:
            hit = pending.future.result(timeout=max(0.0, self._budget_s))
        except concurrent.futures.TimeoutError:
            self._budget_s -= time.monotonic() - started
            if time.monotonic() < pending.future.answer_by:
                return None
            log.warning("kvflow lookup for request %s overran its timeout; computing it", req_id)
            pending.future.cancel()
            hit = 0
        except Exception as exc:  # a store that is down means "no hit", never a failed request
            log.warning("kvflow lookup for request %s failed, computing it: %r", req_id, exc)
            hit = 0
        else:
            self._budget_s -= time.monotonic() - started
        del self._pending[req_id]
        self._seconds.append(pending.watch.seconds)
        return max(hit, block_offset * self.block_size)

    def take_seconds(self) -> list[float]:
        """The seconds of each lookup answered since the previous call."""
        seconds, self._seconds = self._seconds, []
        return seconds

    def forget(self, req_id: str) -> None:
        """Drop a request's lookup (it finished while waiting)."""
        self._pending.pop(req_id, None)

    def clear(self) -> None:
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)

    def _begin(self, block_hashes: tuple[bytes, ...], block_offset: int) -> _Pending:
        watch = Stopwatch()
        future = self.start(block_hashes, block_offset)
        return _Pending(future, len(block_hashes), block_offset, watch.watch(future))
