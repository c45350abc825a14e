"""The block-trust bookkeeping of the scheduler side, step by step (pure: no vLLM objects)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.integrations.vllm.trust import BAD, BadRead, BlockTrust, StepWork, _Snapshot, _Step
from kvflow.request import KVRequest


def load(*blocks: int, request_id: str = "r") -> KVRequest:
    return KVRequest(request_id=request_id, block_ids=blocks, block_hashes=[b"h"] * len(blocks))


def test_a_load_is_pending_until_its_step_settles_then_trusted() -> None:
    trust = BlockTrust()
    trust.loading(1, load(10, 11))
    assert not trust.trusted([10]) and trust.trusted([12])
    assert trust.settle(1, set()) == [load(10, 11)]
    assert trust.trusted([10, 11]) and trust.untrusted == 0


def test_what_a_step_computes_from_a_pending_load_waits_for_it_even_when_a_sharer_computes_it() -> None:
    trust = BlockTrust()
    trust.loading(1, load(10, 11))
    # r0 reads its loaded blocks and writes 12; r1 shares 10, 11 through the prefix cache, writes 20
    trust.computed([StepWork(reads=[10, 11], writes=[12]), StepWork(reads=[10, 11], writes=[20])])
    assert not trust.trusted([12]) and not trust.trusted([20])
    # a later step computes 21 from 10, 11, 20: it inherits the dependency
    trust.computed([StepWork(reads=[10, 11, 20], writes=[21])])
    assert not trust.trusted([21])
    trust.settle(1, set())
    assert trust.trusted([10, 11, 12, 20, 21])


def test_a_failed_load_makes_everything_computed_from_its_step_bad_until_rewritten() -> None:
    trust = BlockTrust()
    trust.loading(1, load(10, 11))
    trust.computed([StepWork(reads=[10, 11], writes=[12])])
    trust.loading(2, load(30))  # another step's load, not affected
    trust.settle(1, {11})
    assert trust.bad(11) and trust.bad(12)
    assert not trust.bad(10) and trust.trusted([10])  # loaded alone and fine
    # the recompute rewrites 11 and 12 from the trusted block 10: trusted again
    trust.computed([StepWork(reads=[10], writes=[11, 12])])
    assert trust.trusted([11, 12]) and not trust.trusted([30])


def test_a_rewrite_from_bad_inputs_stays_bad() -> None:
    trust = BlockTrust()
    trust.loading(1, load(10))
    trust.settle(1, {10})
    trust.computed([StepWork(reads=[10], writes=[11])])
    assert trust.bad(11)


def test_a_partly_recomputed_loaded_block_is_judged_by_its_inputs() -> None:
    """The last loaded block is rewritten for its last token: it then depends on every input."""
    trust = BlockTrust()
    trust.loading(1, load(10, 11))
    trust.computed([StepWork(reads=[10, 11], writes=[11])])
    trust.settle(1, {10})
    assert trust.bad(10) and trust.bad(11)


def test_requests_of_one_step_see_each_others_writes() -> None:
    """r1 reads block 12, which r0 recomputes in the same step from trusted inputs."""
    trust = BlockTrust()
    trust.loading(1, load(12))
    trust.settle(1, {12})
    assert trust.bad(12)
    trust.computed([StepWork(reads=[10, 12], writes=[20]), StepWork(reads=[10], writes=[12])])
    assert trust.trusted([12, 20])


def test_an_asynchronous_load_is_judged_when_it_ends() -> None:
    trust = BlockTrust()
    trust.load_ended(load(5, 6), {6})
    assert trust.trusted([5]) and trust.bad(6)
    trust.load_ended(load(5, 6), set())  # vLLM retried the load, and it worked
    assert trust.trusted([5, 6])


def test_settling_a_step_clears_every_block_that_waited_for_it_whatever_else_is_tracked() -> None:
    trust = BlockTrust()
    trust.loading(1, load(5))
    trust.loading(2, load(10, 11))
    trust.computed([StepWork(reads=[10, 11], writes=[12])])
    trust.settle(2, set())  # block 5 (of step 1) comes first and does not depend on step 2
    assert trust.trusted([10, 11, 12]) and not trust.trusted([5])


def test_a_bad_block_rewritten_in_part_keeps_a_bad_tail_until_its_writer_completes_it() -> None:
    """vLLM recomputes a failed block in place, possibly part of it per step: the positions not yet
    rewritten still hold what failed. A sharer reading the whole block reads them; the writer's own
    next step reads only the rewritten positions and completes the block."""
    trust = BlockTrust()
    trust.loading(1, load(10, 11))
    trust.settle(1, {11})
    trust.computed([StepWork(reads=[10], writes=[11], written_to=2)])  # positions 0-1 of 11 only
    assert trust.bad(11) and not trust.trusted([11])
    trust.computed([StepWork(reads=[10, 11], writes=[20])])  # a sharer reads all of 11
    assert trust.bad(20)
    trust.computed([StepWork(reads=[10, 11], writes=[11, 12], read_to=2, written_to=1)])  # the writer goes on
    assert trust.trusted([11]) and not trust.bad(12)
    trust.computed([StepWork(reads=[10, 11, 12], writes=[12], read_to=1)])  # and completes 12
    assert trust.trusted([10, 11, 12])


def test_a_block_handed_out_anew_forgets_its_previous_users_verdict() -> None:
    """A freed bad block reused for another request holds nothing yet: decode steps writing it
    position by position from good inputs make it trusted, not bad for ever."""
    trust = BlockTrust()
    trust.loading(1, load(11))
    trust.settle(1, {11})
    trust.fresh([11])
    trust.computed([StepWork(reads=[10], writes=[11], written_to=1)])
    trust.computed([StepWork(reads=[10, 11], writes=[11], read_to=1, written_to=2)])
    assert not trust.bad(11) and trust.untrusted == 0


def test_a_step_names_the_bad_blocks_its_requests_read_as_it_wrote_them() -> None:
    """Block 11's load failed and 12 was computed from it. A reader of 10-12 reads 11 first bad; in
    a step where another request rewrites 11 whole from good inputs, a reader of 11 reads it good
    (vLLM writes the batch's KV before attention reads); rewritten only in part, a reader of the
    whole block reads its bad tail (the block being recomputed), while its writer's next step,
    reading only what it rewrote, reads nothing bad."""
    trust = BlockTrust()
    trust.loading(1, load(10, 11))
    trust.computed([StepWork(reads=[10, 11], writes=[12])])
    trust.settle(1, {11})
    assert trust.computed([StepWork(reads=[10, 11, 12], writes=[13])]) == {0: BadRead(11, repairing=False)}
    assert trust.computed([StepWork(reads=[10], writes=[11]), StepWork(reads=[10, 11], writes=[20])]) == {}
    trust.loading(2, load(30, 31))
    trust.settle(2, {31})
    half = StepWork(reads=[30], writes=[31], written_to=2)  # positions 0-1 of 31 rewritten
    assert trust.computed([half, StepWork(reads=[30, 31], writes=[40])]) == {1: BadRead(31, repairing=True)}
    assert trust.bad(40)
    assert trust.computed([StepWork(reads=[30, 31], writes=[31], read_to=2)]) == {}  # its next step
    assert trust.trusted([31])


def test_a_block_two_requests_rewrite_in_one_step_holds_what_they_wrote() -> None:
    """A failed block recomputed in place by its request (positions 0-1) while a sharer vLLM rewound
    onto it writes positions 2-3 from what the first wrote in the same step: the block is good, and
    a request reading all of it in that step reads it good. Written only up to position 3 by the
    two, its last position keeps its bad tail."""
    for sharer_end, bad in ((None, {}), (3, {0: BadRead(12, repairing=True)})):
        trust = BlockTrust()
        trust.loading(1, load(10, 11, 12))
        trust.settle(1, {12})  # block 12's load failed
        owner = StepWork(reads=[10, 11], writes=[12], written_to=2)
        sharer = StepWork(reads=[10, 11, 12], read_to=2, writes=[12], written_to=sharer_end)
        reader = StepWork(reads=[10, 11, 12], writes=[13])
        assert trust.computed([reader, sharer, owner]) == bad
        assert trust.bad(12) == bool(bad) and trust.bad(13) == bool(bad)
        assert trust.computed([StepWork(reads=[10, 11, 12], read_to=3, writes=[12])]) == {}


class _EveryReadFollowed(_Step):
    """A step that follows every block a request reads through the step, one by one: the rule
    itself, without finding what the blocks nobody writes depend on in bulk."""

    def _split_reads(self, item: StepWork) -> tuple[frozenset[int], list[tuple[int, int | None]]]:
        last = len(item.reads) - 1
        every = [(block, item.read_to if i == last else None) for i, block in enumerate(item.reads)]
        return frozenset(), every


_blocks = st.integers(0, 7)
_deps = st.frozensets(st.sampled_from([BAD, 1, 2, 3]), min_size=1, max_size=2)
_work = st.builds(
    StepWork,
    reads=st.lists(_blocks, max_size=6),
    writes=st.lists(_blocks, max_size=3),
    read_to=st.none() | st.integers(1, 15),
    written_to=st.none() | st.integers(1, 15),
)


@settings(max_examples=300, deadline=None)
@given(
    heads=st.dictionaries(_blocks, _deps, max_size=6),
    tails=st.dictionaries(_blocks, st.tuples(st.integers(1, 15), _deps), max_size=3),
    work=st.lists(_work, max_size=4),
)
def test_a_step_finds_what_its_requests_read_as_the_rule_followed_block_by_block_does(
    heads: dict[int, frozenset[int]], tails: dict[int, tuple[int, frozenset[int]]], work: list[StepWork]
) -> None:
    """What the blocks no request of the step writes depend on is found in bulk (the prefix a
    request reads, hundreds of blocks after a load); the inputs and the bad reads of every request
    must be those of following every block through the step."""
    fast = _Step(_Snapshot(dict(heads), dict(tails)), work)
    rule = _EveryReadFollowed(_Snapshot(dict(heads), dict(tails)), work)
    assert fast.inputs == rule.inputs
    assert fast.bad_reads() == rule.bad_reads()
