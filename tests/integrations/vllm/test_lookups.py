"""The scheduler side's lookups (:mod:`kvflow.integrations.vllm.lookups`) when vLLM asks again.

vLLM asks ``get_num_new_matched_tokens`` again, step after step, for a request whose blocks it could
not allocate. The answer is kept: asking again in the next step neither queries the store again nor
waits, and the request's first answer is the one timed until it is forgotten (allocated or finished), as
the scheduler counts the lookup once (docs/operations.md). After a step without an ask it looks up
afresh. Pure: fake lookup futures, no vLLM objects.
"""

from __future__ import annotations

import time

import attrs

from kvflow.integrations.vllm.lookups import Lookups
from kvflow.loop import CallFuture

BLOCK = 4
HASHES: tuple[bytes, ...] = (b"a", b"b", b"c")


@attrs.define
class FakeStore:
    """Starts lookups as futures the test answers; records each start."""

    answer_within_s: float = 60.0
    started: list[tuple[tuple[bytes, ...], int]] = attrs.Factory(list)
    futures: list[CallFuture[int]] = attrs.Factory(list)

    def start(self, hashes: tuple[bytes, ...], offset: int) -> CallFuture[int]:
        self.started.append((hashes, offset))
        self.futures.append(CallFuture(time.monotonic() + self.answer_within_s))
        return self.futures[-1]


def test_an_answer_is_kept_for_a_request_vllm_asks_again_until_it_is_forgotten() -> None:
    """Asked again over several steps (vLLM could not allocate the request's blocks), the request
    gets the kept answer: one store lookup and one latency sample in all, not one per ask. Once
    forgotten (allocated), the next ask (a readmission after preemption) looks up afresh and
    is sampled again."""
    store = FakeStore()
    lookups = Lookups(store.start, block_size=BLOCK, wait_s=0.001)
    lookups.prefetch("r", HASHES)
    store.futures[0].set_result(2 * BLOCK)
    for _ in range(5):
        assert lookups.poll("r", HASHES, 0) == 2 * BLOCK
        lookups.new_step()
    # vLLM's prefix cache now holds block 0: the kept answer reaches past it, so it still serves
    assert lookups.poll("r", HASHES, 1) == 2 * BLOCK
    assert len(store.started) == 1
    assert isinstance(lookups.forget("r"), float)  # one first answer, timed
    assert lookups.forget("r") is None  # taken once
    assert lookups.poll("r", HASHES, 0) is None and len(store.started) == 2
    assert lookups.forget("r") is None  # not answered yet: nothing timed
    assert lookups.poll("r", HASHES, 0) is None
    store.futures[2].set_result(3 * BLOCK)
    assert lookups.poll("r", HASHES, 0) == 3 * BLOCK
    assert isinstance(lookups.forget("r"), float)


def test_an_ask_after_a_step_without_one_looks_up_afresh() -> None:
    """A kept answer serves asks of consecutive steps only: after a step in which vLLM did not ask
    (it may have allocated the request, run it and preempted it: its blocks are in the store now),
    the request is looked up again and the new answer is used, not the old "nothing cached". Its
    seconds are still taken once until it is forgotten."""
    store = FakeStore()
    lookups = Lookups(store.start, block_size=BLOCK, wait_s=0.001)
    lookups.prefetch("r", HASHES)
    store.futures[0].set_result(0)
    assert lookups.poll("r", HASHES, 0) == 0
    lookups.new_step()
    lookups.new_step()  # a step without an ask
    assert lookups.poll("r", HASHES, 0) is None and len(store.started) == 2
    store.futures[1].set_result(3 * BLOCK)
    lookups.new_step()  # asked again in the next step: the running lookup answers
    assert lookups.poll("r", HASHES, 0) == 3 * BLOCK and len(store.started) == 2
    assert isinstance(lookups.forget("r"), float) and lookups.forget("r") is None


def test_a_kept_answer_gives_way_when_the_request_changed_and_is_still_sampled_once() -> None:
    """A kept answer serves only the blocks it was asked for: other block hashes, or a prefix-cache
    hit past the kept answer, start a new lookup. The scheduler still counts one lookup at the
    allocation, so the request's seconds are taken once."""
    store = FakeStore()
    lookups = Lookups(store.start, block_size=BLOCK, wait_s=0.001)
    lookups.prefetch("r", HASHES)
    store.futures[0].set_result(BLOCK)
    assert lookups.poll("r", HASHES, 0) == BLOCK
    assert lookups.poll("r", HASHES, 2) is None  # vLLM holds 2 blocks; the answer covered 1
    assert store.started[-1] == (HASHES, 2)
    store.futures[-1].set_result(3 * BLOCK)
    assert lookups.poll("r", HASHES, 2) == 3 * BLOCK
    longer: tuple[bytes, ...] = (*HASHES, b"d")
    assert lookups.poll("r", longer, 0) is None and store.started[-1] == (longer, 0)
    store.futures[-1].set_result(4 * BLOCK)
    assert lookups.poll("r", longer, 0) == 4 * BLOCK
    assert len(store.started) == 3
    assert isinstance(lookups.forget("r"), float) and lookups.forget("r") is None


def test_a_failed_or_overdue_lookup_is_kept_as_no_hit_and_not_waited_for_again() -> None:
    """A store that failed a lookup, or did not answer it in time, is not asked (nor waited for)
    again at every step while vLLM cannot allocate the request: "nothing cached" is kept."""
    store = FakeStore()
    lookups = Lookups(store.start, block_size=BLOCK, wait_s=0.001)
    lookups.prefetch("down", HASHES)
    store.futures[0].set_exception(ConnectionError("store down"))
    store.answer_within_s = 0.0  # the next lookup is overdue at once
    lookups.prefetch("slow", HASHES)
    for _ in range(3):
        assert lookups.poll("down", HASHES, 0) == 0
        assert lookups.poll("slow", HASHES, 1) == BLOCK  # only vLLM's own block
        lookups.new_step()
    assert len(store.started) == 3  # down, slow, slow again from block 1 (nothing reached past it)
    assert store.futures[-1].cancelled()
    assert isinstance(lookups.forget("down"), float) and isinstance(lookups.forget("slow"), float)


def test_clear_drops_kept_answers_but_not_the_requests_sample() -> None:
    """vLLM reset its prefix cache: the next ask looks the request up afresh; since the scheduler
    still counts it once, its seconds are not taken a second time."""
    store = FakeStore()
    lookups = Lookups(store.start, block_size=BLOCK, wait_s=0.001)
    lookups.prefetch("r", HASHES)
    store.futures[0].set_result(BLOCK)
    assert lookups.poll("r", HASHES, 0) == BLOCK
    lookups.clear()
    assert len(lookups) == 0
    assert lookups.poll("r", HASHES, 0) is None and len(store.started) == 2
    time.sleep(0.1)
    store.futures[1].set_result(2 * BLOCK)  # answered 0.1 s after it started
    assert lookups.poll("r", HASHES, 0) == 2 * BLOCK
    first = lookups.forget("r")  # the first answer's seconds, not the one after the reset
    assert first is not None and first < 0.1
    assert lookups.forget("r") is None
