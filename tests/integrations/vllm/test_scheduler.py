"""The connector under vLLM's real Scheduler and AsyncScheduler, TP=1 and TP=2, with faults.

Every scenario runs ``scheduler_harness.Harness`` (vLLM's scheduler, real worker-side connectors
over CPU caches, a fake forward that checks what every request computed from) and ends with the same
checks (the ``engines`` fixture): no block was written while a transfer on it ran, every KV block
vLLM allocated is free again, every object in the store holds exactly the KV the clean model
computes, and a fresh engine that loads every stored block computes from correct KV only.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvflow.errors import ConfigError
from kvflow.integrations.vllm import KVFlowConnector
from tests.integrations.vllm import scheduler_harness
from tests.integrations.vllm.scheduler_harness import Faults, Harness, block_hashes

A = list(range(10, 30))  # 5 full blocks of 4
A_LONG = [*A, *range(300, 309)]  # A's 5 blocks, 2 more, and a token
B_SHARED = [*A[:12], *range(400, 409)]  # A's first 3 blocks, then its own

MakeHarness = Callable[..., Harness]


@attrs.define
class Engines:
    store: Path
    model: Path
    made: list[Harness] = attrs.field(factory=list)
    prompts: list[list[int]] = attrs.field(factory=list)
    layerwise: bool = False  # every engine made stores and loads layer by layer
    draft_passes: int = 0  # every engine made runs vLLM's speculative-decoding order (Harness)

    def __call__(self, **kwargs: Any) -> Harness:
        if self.layerwise:
            kwargs["extra"] = {**kwargs.get("extra", {}), "layerwise": True}
        kwargs.setdefault("draft_passes", self.draft_passes)
        harness = Harness(self.store, self.model, **kwargs)
        self.made.append(harness)
        return harness

    def serve(self, harness: Harness, *prompts: list[int], max_tokens: int = 3) -> list[str]:
        """Add ``prompts`` at once and run until all finished; outputs must be the clean model's."""
        ids = [harness.add(p, max_tokens=max_tokens) for p in prompts]
        harness.run()
        self.prompts.extend(p for p in prompts if p not in self.prompts)
        for req_id, prompt in zip(ids, prompts):
            tracked = harness.requests[req_id]
            assert tracked.finished, req_id
            assert tracked.outputs == harness.expected_outputs(prompt, max_tokens), req_id
        return ids

    def check(self, harness: Harness) -> None:
        """What must hold after every scenario of every engine."""
        assert harness.writes_under_transfer == []
        assert harness.puts_after_step == []  # stores end inside their step: vLLM may reuse blocks
        assert harness.free_blocks() == harness.free_blocks_at_start
        assert not harness.scheduler.requests
        assert harness.scheduler.reset_prefix_cache() is True  # an idle engine holds no block
        assert harness.connector_state() == {}  # the connector forgot every request
        assert harness.agreement.alike()  # with vLLM, ranks calling apart would hang


def finish(engine: Harness, *, max_steps: int) -> None:
    """Step until every request ended (as ``Harness.run``), failing after ``max_steps`` steps: a
    livelock keeps stepping, loading or computing, and never ends."""
    for _ in range(max_steps):
        if not (engine.scheduler.has_requests() or engine._queued):
            return
        engine.step()
        if not engine.scheduler.has_unfinished_requests():
            engine.flush()
    raise AssertionError(
        f"no end after {max_steps} steps: {len(engine.loads)} loads; last computed {engine.computed[-9:]}"
    )


@pytest.fixture
def engines(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Engines]:
    faults = Faults()
    scheduler_harness.FAULTS = faults  # a fresh fault plan for every test
    engines = Engines(tmp_path / "store", tiny_model_dir)
    yield engines
    faults.fail_gets, faults.raise_calls = False, ""
    try:
        for harness in engines.made:
            engines.check(harness)
        if engines.prompts:
            assert engines.made[0].stored_objects_are_correct(engines.prompts) > 0
            # a fresh engine that loads every stored block computes from correct KV only
            verifier = engines(tp=engines.made[0].tp, num_kv_heads=engines.made[0].num_kv_heads)
            for prompt in list(engines.prompts):
                engines.serve(verifier, prompt)
            assert verifier.wrong_inputs == []
            engines.check(verifier)
    finally:
        for harness in engines.made:
            harness.close()


def loaded(harness: Harness) -> list[int]:
    return [w.counters().loaded_blocks for w in harness.workers]  # type: ignore[union-attr]


def stored(harness: Harness) -> list[int]:
    return [w.counters().stored_blocks for w in harness.workers]  # type: ignore[union-attr]


# -- hits -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, False), (2, False), (1, True), (2, True)])
def test_full_and_partial_hits_load_instead_of_compute(
    engines: Engines, tp: int, async_scheduling: bool
) -> None:
    first = engines(tp=tp, async_scheduling=async_scheduling)
    engines.serve(first, A)
    assert stored(first) == [5] * tp  # GQA, 2 KV heads: each rank stores its own heads' blocks
    second = engines(tp=tp, async_scheduling=async_scheduling)
    engines.serve(second, A_LONG)
    assert loaded(second) == [5] * tp and stored(second) == [2] * tp
    assert second.wrong_inputs == []


@pytest.mark.parametrize(
    ("async_scheduling", "layerwise"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_one_worker_stores_the_blocks_a_prompt_only_request_computed_after_its_load(
    engines: Engines, async_scheduling: bool, layerwise: bool
) -> None:
    """An engine of one worker knows its own loads' verdict by the time its saves run, so the
    blocks a request computes right after its load are stored in that step, on condition (before:
    held for the scheduler's verdict a step later, and lost when the request finished first, as
    a prompt-only one does; vLLM's own prefix cache then held them, so no later request of that
    engine stored them either)."""
    extra = {"layerwise": layerwise, "load_async": False}  # (asynchronous scheduling: sync loads too)
    first = engines(async_scheduling=async_scheduling, extra=extra)
    engines.serve(first, A, max_tokens=1)
    second = engines(async_scheduling=async_scheduling, extra=extra)
    engines.serve(second, A_LONG, max_tokens=1)
    assert loaded(second) == [5] and stored(second) == [2]
    third = engines(async_scheduling=async_scheduling, extra=extra)
    engines.serve(third, A_LONG, max_tokens=1)
    assert loaded(third) == [7] and stored(third) == [0]


def test_one_worker_stores_nothing_computed_from_a_load_that_failed(engines: Engines) -> None:
    """The saves of blocks computed from a load whose verdict is still to come are dropped by the
    worker whose load failed (its gets wrote junk into the blocks): the store never holds them,
    though vLLM recomputes and stores the blocks afterwards (the fixture checks every object)."""
    first = engines()
    engines.serve(first, A, max_tokens=1)
    scheduler_harness.FAULTS.fail_gets = True
    second = engines()
    engines.serve(second, A_LONG, max_tokens=1)
    assert [w.counters().dropped_save_blocks for w in second.workers] == [2]  # type: ignore[union-attr]


def test_one_worker_stores_nothing_computed_a_step_later_from_a_load_that_failed(engines: Engines) -> None:
    """Asynchronous scheduling plans the next step before a load's step reports: a prompt longer
    than a step's budget computes its next blocks from a failed load's blocks in that next step,
    and their save waits for the failed step's verdict; the worker, which knows its load failed,
    drops it (the fixture checks every stored object, and a fresh engine loads them). The outputs
    are not checked: with synchronous loads under asynchronous scheduling vLLM may emit one token
    from the failed blocks (docs/vllm.md)."""
    first = engines()
    engines.serve(first, A, max_tokens=1)
    scheduler_harness.FAULTS.fail_gets = True
    second = engines(async_scheduling=True, max_num_batched_tokens=16, extra={"load_async": False})
    longer = [*A, *range(600, 625)]  # 5 blocks loaded, 25 tokens computed 16 a step
    second.add(longer, max_tokens=2)
    second.run()
    engines.prompts.append(longer)
    assert second.loads and second.loads[0][3] == 5
    # blocks 5-8 with the load's step (its own load failed), blocks 9-10 in the next
    assert [w.counters().dropped_save_blocks for w in second.workers] == [6]  # type: ignore[union-attr]


@pytest.mark.parametrize("layerwise", [False, True])
def test_saves_a_worker_dropped_with_its_steps_failed_load_are_planned_again(
    engines: Engines, layerwise: bool
) -> None:
    """A worker whose load of a step failed drops every save of that step, also those whose blocks
    do not rest on that load (another request's): the scheduler plans them again once the step
    settles failed (before: it counted them stored, and they never were). Here R's next blocks,
    computed from its own good load, are saved in the step where C's load fails."""
    engines.layerwise = layerwise
    c = list(range(700, 712))  # 3 blocks of another prefix
    first = engines()
    engines.serve(first, A, [*c, 7], max_tokens=1)
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_matching = True, block_hashes(c)[1].hex()
    second = engines(async_scheduling=True, max_num_batched_tokens=16, extra={"load_async": False})
    r = [*A, *range(600, 625)]  # 45 tokens: 5 blocks loaded, 25 computed 16 a step
    second.add(r, max_tokens=3)
    second.step()
    other = [*c, *range(800, 805)]
    second.add(other, max_tokens=3)  # its load, in R's next step, fails
    second.run()
    faults.fail_gets = False
    engines.prompts += [r, other]
    stored = faults.stored_block_hashes()
    assert [i for i, h in enumerate(block_hashes(r)) if h not in stored] == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tensor_parallel_ranks_store_the_blocks_a_prompt_only_request_computed_after_its_load(
    engines: Engines, async_scheduling: bool
) -> None:
    """TP=2, whole blocks: the ranks agree on whether the load arrived on every rank before their
    saves run, so the blocks a prompt-only request computes right after its load are stored in
    that step, as with one worker (before: held for the scheduler's verdict a step later, and lost
    when the request finished first)."""
    extra = {"load_async": False}
    first = engines(tp=2, async_scheduling=async_scheduling, extra=extra)
    engines.serve(first, A, max_tokens=1)
    second = engines(tp=2, async_scheduling=async_scheduling, extra=extra)
    engines.serve(second, A_LONG, max_tokens=1)
    assert loaded(second) == [5, 5] and stored(second) == [2, 2]
    assert second.agreement.calls[0]  # the ranks did agree (the fixture checks they called alike)
    third = engines(tp=2, async_scheduling=async_scheduling, extra=extra)
    engines.serve(third, A_LONG, max_tokens=1)
    assert loaded(third) == [7, 7] and stored(third) == [0, 0]


def test_tensor_parallel_ranks_drop_what_a_prompt_only_request_computed_from_a_load_failed_on_one(
    engines: Engines,
) -> None:
    """TP=2: rank 0's load fails, rank 1's arrives. Rank 1's KV of the new blocks is wrong too (it
    was computed from rank 0's junk, through the all-reduced attention output), so both ranks drop
    their saves; the fixture checks every stored object and reloads them in a fresh engine."""
    first = engines(tp=2)
    engines.serve(first, A, max_tokens=1)
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_matching = True, "@h0-1@"  # rank 0's KV head only
    second = engines(tp=2)
    engines.serve(second, A_LONG, max_tokens=1)
    zero, one = (w.counters() for w in second.workers)  # type: ignore[union-attr]
    assert zero.load_failed_blocks == 5 and one.loaded_blocks == 5
    assert zero.dropped_save_blocks == 2 and one.dropped_save_blocks == 2
    assert zero.stored_blocks == one.stored_blocks


def test_layerwise_tensor_parallel_ranks_hold_back_what_a_prompt_only_request_computed_after_its_load(
    engines: Engines,
) -> None:
    """Layer by layer, a rank stores each layer during the forward, before the ranks could agree on
    the loads of the layers after it: only the scheduler hears of every rank's loads, a step later.
    A prompt-only request finishes first (without asynchronous scheduling, which reports its
    output a step later), and its new blocks are not stored (a missed cache entry, never wrong KV;
    docs/vllm.md)."""
    engines.layerwise = True
    first = engines(tp=2)
    engines.serve(first, A, max_tokens=1)
    second = engines(tp=2)
    engines.serve(second, A_LONG, max_tokens=1)
    assert loaded(second) == [5, 5] and stored(second) == [0, 0]
    assert second.agreement.calls == {}  # no rank asks: none was made for a layerwise engine


def test_requests_sharing_a_prefix_in_one_step(engines: Engines) -> None:
    first = engines()
    engines.serve(first, A)
    second = engines()
    engines.serve(second, A_LONG, B_SHARED)  # B's first 3 blocks: loaded for A_LONG, shared by B
    assert second.wrong_inputs == []


def test_asynchronous_loads(engines: Engines) -> None:
    first = engines(extra={"load_async": True})
    engines.serve(first, A)
    second = engines(extra={"load_async": True})
    engines.serve(second, A_LONG)
    assert loaded(second) == [5] and second.wrong_inputs == []


def test_layerwise_transfers(engines: Engines) -> None:
    first = engines(extra={"layerwise": True})
    engines.serve(first, A)
    second = engines(extra={"layerwise": True})
    engines.serve(second, A_LONG)
    assert loaded(second) == [5] and second.wrong_inputs == []


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("calls", ["gets", "puts"])
def test_a_store_that_raises_fails_a_layerwise_step_not_the_engine(
    engines: Engines, calls: str, depth: int
) -> None:
    """A backend whose gets (or puts) raise BackendError: the step's loads are recomputed (its
    stores dropped), whatever the depth. At depth 2 two layers' gets raise at once (their errors
    must reach the connector as the one BackendError it handles, not as a group: the engine
    died of that); two layers' puts do only when their calls start in one turn of the loop."""
    extra = {"layerwise": True, "layerwise_depth": depth}
    if calls == "gets":
        engines.serve(engines(extra=dict(extra)), A)
    scheduler_harness.FAULTS.raise_calls = calls
    second = engines(extra=dict(extra))
    engines.serve(second, A_LONG if calls == "gets" else A)  # outputs exact: computed, not loaded
    scheduler_harness.FAULTS.raise_calls = ""
    if calls == "gets":
        assert second.workers[0].counters().load_failed_blocks > 0  # type: ignore[union-attr]
        assert loaded(second) == [0]
    else:
        assert stored(second) == [0]
        engines.prompts.clear()  # nothing was stored for the fixture's checks to read back


def test_layerwise_transfers_are_refused_under_vllms_micro_batching(engines: Engines) -> None:
    """Micro-batching (DBO) runs each layer once per micro-batch: a layer's store would read the
    blocks of the second micro-batch before they are written. Refused at start, naming the fix;
    whole blocks (stored after the forward) are not."""
    for layerwise in (True, False):
        engine = engines(extra={"layerwise": layerwise})
        config, kv_cache_config = engine.scheduler.vllm_config, engine.scheduler.kv_cache_config
        config.parallel_config.enable_dbo = True
        if layerwise:
            with pytest.raises(ConfigError, match=r"micro-batching .*set layerwise=false"):
                KVFlowConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        else:
            KVFlowConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config).shutdown()


# -- failed loads never leave wrong KV in the store -------------------------------------------------


def test_a_load_failing_on_one_rank_stores_nothing_computed_from_it_even_for_a_prefix_sharer(
    engines: Engines,
) -> None:
    """TP=2: R0 loads a stored prefix, R1 gets the same blocks through vLLM's prefix cache in the
    same step. Rank 0's load fails, rank 1's succeeds. Nothing either computed from the failed
    load may reach the store, on any rank; vLLM recomputes both and they come out exact."""
    first = engines(tp=2)
    engines.serve(first, A[:12])  # 3 blocks stored
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_matching = True, "@h0-1@"  # rank 0's head only
    second = engines(tp=2)
    engines.serve(second, A_LONG, B_SHARED)
    assert loaded(second)[1] == 3 and second.workers[0].counters().load_failed_blocks == 3  # type: ignore[union-attr]
    assert second.wrong_inputs  # the failed step did compute from junk (then vLLM recomputed it)


@pytest.mark.parametrize("sharers", [0, 1, 3])
def test_under_async_scheduling_a_failed_load_never_reaches_the_outputs(
    engines: Engines, sharers: int
) -> None:
    """vLLM's asynchronous scheduling (its default) plans step N+1 before step N's output arrives.
    A load before N's forward that fails (here one block of A's; an eviction between lookup and
    load does the same) gets its request rewound to the failed block, but vLLM still delivers the
    token that N+1 computed from that block, and requests admitted meanwhile read it through the
    prefix cache. So the connector loads asynchronously there unless told otherwise: a failed
    asynchronous load is reported before any forward reads its blocks. Every output is the clean
    model's (with loads before the forward, the request whose load failed returned another first
    token)."""
    first = engines()
    engines.serve(first, A)
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_left = True, 1
    faults.fail_gets_matching = scheduler_harness.block_hashes(A)[2].hex()
    engine = engines(max_num_batched_tokens=16, async_scheduling=True)  # load_async left unset
    owner = engine.add(A_LONG, max_tokens=3)
    engine.step()
    prompts = [[*A, *range(500 + 50 * j, 505 + 50 * j)] for j in range(sharers)]
    ids = [engine.add(p, max_tokens=8) for p in prompts]
    engine.run()
    faults.fail_gets = False
    engines.prompts += [A_LONG, *prompts]
    assert [load[4] for load in engine.loads] == [True] * len(engine.loads) and engine.loads
    for req_id, prompt, n in [(owner, A_LONG, 3), *((i, p, 8) for i, p in zip(ids, prompts))]:
        assert engine.requests[req_id].finished, req_id
        assert engine.requests[req_id].outputs == engine.expected_outputs(prompt, n), req_id


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async scheduling", "sync scheduling"])
@pytest.mark.parametrize("persistent", [False, True], ids=["one failed get", "every get fails"])
def test_a_request_whose_asynchronous_load_failed_from_its_first_block_is_computed(
    engines: Engines, async_scheduling: bool, persistent: bool
) -> None:
    """An asynchronous load that fails from block 0 leaves the request with nothing computed, and
    vLLM frees its blocks and asks the connector again. Answered with the same hit, it loaded,
    failed and was freed again: every step for ever when the store's gets keep failing (a segment
    on an unreachable node, a read error) while lookups still find the objects, and, with requests
    sharing the prefix in a small cache, vLLM's head-of-line wait for the blocks of an asynchronous
    load stopped every request after one failed get. The request is computed instead; every
    output is the clean model's."""
    first = engines()
    engines.serve(first, A)
    faults = scheduler_harness.FAULTS
    faults.fail_gets = True
    if not persistent:
        faults.fail_gets_left = 1
        faults.fail_gets_matching = scheduler_harness.block_hashes(A)[0].hex()
    extra = {} if async_scheduling else {"load_async": True}  # asynchronous loads either way
    engine = engines(num_blocks=24, max_num_batched_tokens=16, async_scheduling=async_scheduling, extra=extra)
    prompts = [(A_LONG, 3), *(([*A, *range(500 + 50 * j, 505 + 50 * j)], 8) for j in range(2))]
    ids = [engine.add(p, max_tokens=n) for p, n in prompts]
    finish(engine, max_steps=300)
    faults.fail_gets = False
    engines.prompts += [p for p, _ in prompts]
    assert engine.loads and all(load[4] for load in engine.loads)
    for req_id, (prompt, n) in zip(ids, prompts):
        assert engine.requests[req_id].outputs == engine.expected_outputs(prompt, n), req_id


def test_async_scheduling_never_stores_what_a_request_admitted_onto_a_failed_load_computed(
    engines: Engines,
) -> None:
    """vLLM's AsyncScheduler plans step N+1 before it sees step N's output: a request admitted in
    N+1 onto the blocks a failing load writes in N must not have its blocks stored.

    (vLLM 0.32 itself does not recompute that request's step N+1, which read the failed blocks, so
    its tokens may differ from the clean model's: the test asserts what kvflow owns, the store.)"""
    first = engines()
    engines.serve(first, A[:12])
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_left = True, 1
    second = engines(async_scheduling=True, extra={"load_async": False})  # as an operator may ask
    r0 = second.add(A_LONG, max_tokens=3)
    second.step()  # step N: R0 loads (and fails); its output is not processed yet
    r1 = second.add(B_SHARED, max_tokens=3)
    second.run()
    engines.prompts += [A_LONG, B_SHARED]
    assert second.requests[r0].finished and second.requests[r1].finished
    assert second.wrong_inputs  # the requests did compute from the failed blocks at first


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_loads_with_either_policy(engines: Engines, policy: str) -> None:
    first = engines()
    engines.serve(first, A)
    scheduler_harness.FAULTS.fail_gets = True
    second = engines(policy=policy)
    if policy == "recompute":
        engines.serve(second, A_LONG)
        assert stored(second) == [2]  # the recompute stored what it computed; loaded blocks exist
        return
    req_id = second.add(A_LONG, max_tokens=3)
    second.run()
    assert second.requests[req_id].finished and second.requests[req_id].outputs == []  # failed
    engines.prompts.append(A)


def test_an_async_load_that_misses_blocks_stores_them_again_after_the_recompute(engines: Engines) -> None:
    """Blocks evicted between lookup and an asynchronous load are recomputed and stored again, so a
    later request finds every block."""
    first = engines(extra={"load_async": True})
    engines.serve(first, A)
    scheduler_harness.FAULTS.evict_gets_left = 1  # the objects go between lookup and load
    second = engines(extra={"load_async": True})
    engines.serve(second, A_LONG)
    assert stored(second) == [7]  # the 5 evicted blocks again, and 2 new ones
    third = engines(extra={"load_async": True})
    engines.serve(third, A_LONG)
    assert loaded(third) == [7]


def test_a_rank_whose_load_failed_stores_nothing_of_its_step_even_saves_the_scheduler_planned(
    engines: Engines,
) -> None:
    """TP=2: in one step R loads (rank 0's load fails) and C computes a fresh prompt, whose save the
    scheduler plans (C reads no loaded block), as it plans R's new blocks on condition that R's load
    arrived. Rank 0 drops every save of that step; rank 1 stores C's and, told by rank 0 that R's
    load failed, drops R's."""
    first = engines(tp=2)
    engines.serve(first, A[:12])
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_matching = True, "@h0-1@"  # rank 0's KV head only
    second = engines(tp=2)
    fresh = [*range(900, 912)]  # 3 blocks nobody stored
    r, c = second.add(A_LONG, max_tokens=3), second.add(fresh, max_tokens=3)
    second.step()
    (load,) = second.loads
    assert load[1] == r
    assert (load[0], c, 0, 3) in second.saves  # the scheduler did plan C's save in the failing step
    zero, one = (w.counters() for w in second.workers)  # type: ignore[union-attr]
    assert zero.load_failed_blocks == 3 and zero.dropped_save_blocks == 3 + 4 and zero.stored_blocks == 0
    assert one.loaded_blocks == 3 and one.dropped_save_blocks == 4 and one.stored_blocks == 3
    second.run()
    assert second.requests[r].finished and second.requests[c].finished
    engines.prompts += [A_LONG, fresh]


@pytest.mark.parametrize("failed", [0, 2, 4])
def test_a_load_failing_in_some_blocks_is_recomputed_from_the_first_failed_block(
    engines: Engines, failed: int
) -> None:
    """One of five loaded blocks fails: vLLM keeps the blocks before it, recomputes from it on,
    and the step that recomputes stores from it on again."""
    first = engines()
    engines.serve(first, A)
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_matching = True, block_hashes(A)[failed].hex()
    second = engines()
    (r,) = engines.serve(second, A_LONG)
    counters = second.workers[0].counters()  # type: ignore[union-attr]
    assert counters.loaded_blocks == 4 and counters.load_failed_blocks == 1
    mine = [(start, end) for req, start, end in second.computed if req == r]
    assert mine[0][0] == 5 * 4  # computed after the 5 loaded blocks: the failure is not known yet
    assert mine[1][0] == failed * 4  # then recomputed from the failed block, not from the start
    assert all(start >= failed * 4 for start, _ in mine)  # the blocks before it are kept
    assert second.wrong_inputs == [(r, 20)]  # only the step that read the failed block went wrong
    resaved = [(first_block, n) for _, req, first_block, n in second.saves if req == r]
    assert resaved[-1] == (failed, 7 - failed)  # stored again from the failed block on


def test_a_preempted_request_reloads_its_blocks_when_it_resumes(engines: Engines) -> None:
    """A cache of 13 blocks: R loads A's 5 blocks, decodes, and is preempted when X grows; X reuses
    R's freed blocks, so when R resumes it loads the blocks vLLM lost from the store again."""
    first = engines()
    engines.serve(first, A)
    small = engines(num_blocks=14)
    x_prompt, r_prompt = [*range(600, 624)], A_LONG[:21]
    x = small.add(x_prompt, max_tokens=16)
    small.step()
    r = small.add(r_prompt, max_tokens=10)
    small.run()
    assert r in small.preempted
    loads = [(step, offset, n) for step, req, offset, n, _ in small.loads if req == r]
    assert len(loads) == 2 and loads[0][1:] == (0, 5)  # admitted: A's 5 blocks
    _, offset, n = loads[1]
    assert offset > 0 and offset + n == 5  # resumed: what vLLM's own cache lost, from the store
    assert small.wrong_inputs == []
    for req, prompt, tokens in ((x, x_prompt, 16), (r, r_prompt, 10)):
        assert small.requests[req].outputs == small.expected_outputs(prompt, tokens)
    engines.prompts += [x_prompt, r_prompt]


@pytest.mark.parametrize("tp", [1, 2])
def test_save_decode_blocks_stores_blocks_the_decode_completes(engines: Engines, tp: int) -> None:
    """A's 20 tokens fill 5 blocks; 5 decoded tokens complete a sixth, which only
    ``save_decode_blocks`` stores; a later engine then loads all six."""
    plain = engines(tp=tp)
    (p,) = engines.serve(plain, A, max_tokens=5)
    assert stored(plain) == [5] * tp  # prompt blocks only
    decoding = engines(tp=tp, extra={"save_decode_blocks": True})
    (d,) = engines.serve(decoding, A, max_tokens=5)
    assert stored(decoding) == [1] * tp  # the decode block (the prompt's five were present)
    decoded = [*A, *decoding.requests[d].outputs[:4]]  # 24 tokens: 6 full blocks
    assert decoding.requests[d].outputs == plain.requests[p].outputs
    reader = engines(tp=tp)
    engines.serve(reader, decoded)
    assert loaded(reader) == [6] * tp and reader.wrong_inputs == []


# -- blocks and transfers ----------------------------------------------------------------------------


def test_slow_stores_finish_inside_their_step_and_finished_requests_hold_nothing(engines: Engines) -> None:
    scheduler_harness.FAULTS.put_delay_s = 0.05
    harness = engines()
    engines.serve(harness, A, B_SHARED, max_tokens=1)
    assert harness.scheduler.reset_prefix_cache() is True  # right after the last request finished


@pytest.mark.parametrize("fails", [False, True], ids=["the load succeeds", "the load fails"])
def test_abort_during_an_asynchronous_load_keeps_its_blocks_until_the_load_ends(
    engines: Engines, fails: bool
) -> None:
    """The blocks stay vLLM's until the load ended; then they are free, and (the fixture checks)
    the connector keeps nothing of the request, also when the load failed (it kept the id of a
    request whose asynchronous load failed, to compute it when vLLM asks again, for good)."""
    first = engines(extra={"load_async": True})
    engines.serve(first, A)
    scheduler_harness.FAULTS.get_delay_s = 0.3
    scheduler_harness.FAULTS.fail_gets = fails
    second = engines(extra={"load_async": True})
    req_id = second.add(A_LONG, max_tokens=3)
    second.step()  # the load starts and runs for 0.3 s
    second.abort(req_id)
    assert second.free_blocks() < second.free_blocks_at_start  # the load may still write them
    second.run()  # idle steps until every worker reported the load ended: then they are free
    assert second.requests[req_id].outputs == []
    engines.prompts.append(A)


def test_preemption_with_transfers_in_flight(engines: Engines) -> None:
    """A cache too small for every request at once: vLLM preempts and resumes requests while loads
    and (delayed) stores run; no block is written under a transfer and every output is exact."""
    first = engines()
    engines.serve(first, A)
    faults = scheduler_harness.FAULTS
    faults.put_delay_s, faults.get_delay_s = 0.02, 0.02
    small = engines(num_blocks=14, max_num_batched_tokens=32)
    prompts = [A_LONG, B_SHARED, [*range(700, 724)], [*A[:8], *range(800, 815)]]
    engines.serve(small, *prompts, max_tokens=6)
    assert small.preempted  # the scenario did preempt


def test_reset_cache_lets_vllm_reset_and_keeps_the_store(engines: Engines) -> None:
    harness = engines()
    engines.serve(harness, A)
    connector = harness.scheduler.connector
    assert connector is not None and connector.reset_cache() is True
    assert harness.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    again = engines()
    engines.serve(again, A)
    assert loaded(again) == [5]  # the store kept its objects


def test_every_block_is_free_again_after_each_scenario_step_by_step(engines: Engines) -> None:
    harness = engines()
    req = harness.add(A, max_tokens=2)
    harness.step()
    assert harness.free_blocks() < harness.free_blocks_at_start
    harness.run()
    assert harness.requests[req].finished
    assert harness.free_blocks() == harness.free_blocks_at_start
    engines.prompts.append(A)


# -- randomized scenarios -------------------------------------------------------------------------
# Randomized scenarios under vLLM's real Scheduler / AsyncScheduler (tests/integrations/vllm/
# scheduler_harness.py): prompts sharing prefixes arrive at random steps into a small cache (so vLLM
# preempts), some are aborted, loads are synchronous or asynchronous, TP 1 or 2, and the store
# misbehaves at random (gets failing on one rank's heads, objects evicted between lookup and load,
# delays). The ``engines`` fixture then checks what kvflow owns: no block written under a transfer,
# every block free again, every stored object exactly the clean model's KV, and a fresh engine
# loading it all computes from correct KV only. Under the synchronous Scheduler with the recompute
# policy every finished request's outputs must also be the clean model's.

BASES = [list(range(10 + 100 * b, 42 + 100 * b)) for b in range(4)]  # 8 blocks of 4 each
BASE = BASES[0]


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        base = rng.choice(BASES)
        shared = rng.choice([0, 4, 8, 12, 20, 32])
        tail = rng.randrange(1, 14)
        out.append([*base[:shared], *range(1000 + 50 * i, 1000 + 50 * i + tail)])
    return out


@attrs.frozen
class Reach:
    """What one scenario did: requests preempted, loads, requests aborted, and steps that computed
    from KV a failed load left (vLLM recomputes those requests)."""

    preempted: int
    loads: int
    aborted: int
    wrong_inputs: int


def run(
    engines: Engines,
    seed: int,
    *,
    tp: int,
    async_scheduling: bool,
    load_async: bool,
    budget: int | None = None,
    long_prefill: int = 0,
) -> Reach:
    """One scenario; ``budget`` replaces the drawn token budget and ``long_prefill`` sets vLLM's cap
    on a prompt's tokens per step (neither changes what else the seed draws)."""
    rng = random.Random(seed)
    writer = engines(tp=tp)
    seeds = [[*b[: rng.choice([8, 12, 20, 32])], 7] for b in BASES]
    engines.serve(writer, *seeds, max_tokens=1)
    faults = scheduler_harness.FAULTS
    faults.get_delay_s = rng.choice([0.0, 0.0, 0.01])
    faults.put_delay_s = rng.choice([0.0, 0.0, 0.005])
    kind = rng.randrange(4)
    if kind == 1:
        faults.fail_gets, faults.fail_gets_left = True, rng.choice([1, 2])
        faults.fail_gets_matching = "@h0-1@" if tp == 2 and rng.random() < 0.7 else ""
    elif kind == 2:
        faults.evict_gets_left = rng.choice([1, 2])
    elif kind == 3:
        faults.fail_gets, faults.fail_gets_left = True, 1
        faults.fail_gets_matching = rng.choice(scheduler_harness.block_hashes(BASE)[:4]).hex()
    extra = {"load_async": load_async}  # (unset, it follows async_scheduling)
    num_blocks, drawn_budget = rng.choice([13, 16, 24]), rng.choice([16, 32, 64])
    engine = engines(
        tp=tp,
        async_scheduling=async_scheduling,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget or drawn_budget,
        extra=extra,
        early_loads=seed % 2 == 0,  # (odd seeds: a runner that never starts loads early)
    )
    if long_prefill:
        engine.scheduler.scheduler_config.long_prefill_token_threshold = long_prefill
    todo = prompts(rng, rng.randrange(4, 9))
    added: list[tuple[str, list[int], int]] = []
    aborted: set[str] = set()
    steps = 0
    while todo or engine.scheduler.has_requests() or engine._queued:
        steps += 1
        assert steps < 3000
        while todo and rng.random() < 0.4:
            prompt = todo.pop()
            max_tokens = rng.choice([1, 3, 8, 16])
            added.append((engine.add(prompt, max_tokens=max_tokens), prompt, max_tokens))
        if added and rng.random() < 0.04:
            req_id = rng.choice(added)[0]
            if not engine.requests[req_id].finished:
                engine.abort(req_id)
                aborted.add(req_id)
        engine.step()
        if not todo and not engine.scheduler.has_unfinished_requests():
            engine.flush()
    engine.flush()
    faults.evict_gets_left = 0  # the fixture's verifier runs on a sound store
    faults.fail_gets = False
    engines.prompts += [p for _, p, _ in added if p not in engines.prompts]
    engines.prompts += [s for s in seeds if s not in engines.prompts]
    if load_async or not async_scheduling:  # (docs/vllm.md: sync loads under async scheduling)
        for req_id, prompt, max_tokens in added:
            if req_id in aborted:
                continue
            tracked = engine.requests[req_id]
            assert tracked.finished, req_id
            assert tracked.outputs == engine.expected_outputs(prompt, max_tokens), (req_id, kind)
    if kind == 0 and faults.get_delay_s == 0:
        assert engine.wrong_inputs == [], engine.wrong_inputs
    return Reach(len(engine.preempted), len(engine.loads), len(aborted), len(engine.wrong_inputs))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("tp", "async_scheduling", "load_async"),
    [
        (1, False, False),
        (2, False, False),
        (1, True, False),
        (2, True, False),
        (1, False, True),
        (1, True, True),
        (2, True, True),
    ],
)
def test_random_scenario(
    engines: Engines, seed: int, tp: int, async_scheduling: bool, load_async: bool
) -> None:
    run(engines, seed, tp=tp, async_scheduling=async_scheduling, load_async=load_async)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("layerwise", "draft_passes"),
    [(True, 0), (True, 2), (False, 2)],
    ids=["layerwise", "layerwise, speculative decoding", "speculative decoding"],
)
@pytest.mark.parametrize(("tp", "async_scheduling", "load_async"), [(1, False, False), (2, True, True)])
def test_random_scenario_of_layerwise_engines_and_speculative_decoding(
    engines: Engines,
    seed: int,
    layerwise: bool,
    draft_passes: int,
    tp: int,
    async_scheduling: bool,
    load_async: bool,
) -> None:
    """The sweep above, every engine layerwise and/or in vLLM's order with speculative decoding:
    the step's output is taken before wait_for_save, and two draft passes save a layer again.
    A layerwise load's failure reached vLLM only at wait_for_save, a step late, after it had emitted
    a token computed from it; a layer saved twice in a step raised."""
    engines.layerwise, engines.draft_passes = layerwise, draft_passes
    run(engines, 200 + seed, tp=tp, async_scheduling=async_scheduling, load_async=load_async)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("tp", [1, 2])
def test_random_scenario_under_a_prefill_cap(engines: Engines, seed: int, tp: int) -> None:
    """The sweep above with a budget of 16 tokens a step and at most 2 of a prompt's (vLLM's
    ``long_prefill_token_threshold``): prompts and recomputes move in chunks ending inside blocks."""
    run(engines, 100 + seed, tp=tp, async_scheduling=False, load_async=False, budget=16, long_prefill=2)


@pytest.mark.parametrize(
    ("seed", "budget", "long_prefill"),
    [(89, None, 0), (128, None, 0), (100, 16, 4)],
    ids=["owner preempted", "owner aborted", "sharer of a chunked recompute"],
)
def test_no_request_computes_from_a_failed_block_vllm_keeps_in_its_prefix_cache(
    engines: Engines, seed: int, budget: int | None, long_prefill: int
) -> None:
    """With the recompute policy vLLM keeps a block whose load failed in its prefix cache, for its
    request to recompute in place. Seeds where another request reads it first: the request whose
    load failed is preempted (89) or aborted (128) before it recomputed the block, or rewrites it
    a few tokens a step under a prefill cap while a sharer reads all of it (100). kvflow reports
    such reads as load errors, so vLLM recomputes the readers: every output is the clean model's
    (checked in ``run``) and every stored object too (the fixture)."""
    reach = run(
        engines,
        seed,
        tp=1,
        async_scheduling=False,
        load_async=False,
        budget=budget,
        long_prefill=long_prefill,
    )
    assert reach.loads and reach.wrong_inputs, reach  # a load failed, and some step computed from it


def test_a_random_scenario_reaches_preemption_aborts_and_a_failed_load(engines: Engines) -> None:
    """The sweep above is worth something only if its scenarios reach what they are made for: one
    of its seeds preempts, aborts, loads, and has a step compute from a failed load (its request is
    then recomputed); the engines fixture checks that nothing wrong was stored or loaded."""
    reach = run(engines, 1, tp=1, async_scheduling=False, load_async=False)
    assert reach.preempted and reach.loads and reach.aborted and reach.wrong_inputs, reach


# --- a failed block recomputed in place, part by part, while another request shares it ----------


@pytest.fixture
def faults() -> Faults:
    scheduler_harness.FAULTS = Faults()
    return scheduler_harness.FAULTS


@contextlib.contextmanager
def _engine_after_a_was_stored(
    store: Path, model: Path, stored: Sequence[int] = A[:12], max_tokens: int = 2, **harness: Any
) -> Iterator[Harness]:
    """A second engine over ``store``, once a first one stored ``stored`` (A's first three blocks)."""
    first = Harness(store, model)
    second = None
    try:
        first.add(list(stored), max_tokens=max_tokens)
        first.run()
        second = Harness(store, model, **harness)
        yield second
    finally:
        first.close()
        if second is not None:
            second.close()


def _sharing_step(harness: Harness) -> tuple[list[int], list[int]]:
    """X and Y, both starting with A's 3 stored blocks, admitted together, with a long-prefill cap
    of 2 tokens: vLLM recomputes a failed block of X half a block per step while Y, sharing it
    through the prefix cache, reads all of it."""
    harness.scheduler.scheduler_config.long_prefill_token_threshold = 2
    x_prompt, y_prompt = [*A[:12], *range(500, 508)], [*A[:12], *range(700, 708)]
    harness.add(x_prompt, max_tokens=2)
    harness.add(y_prompt, max_tokens=2)
    return x_prompt, y_prompt


def test_a_failed_block_rewritten_in_part_is_not_trusted(
    tmp_path: Path, tiny_model_dir: Path, faults: Faults
) -> None:
    """A block whose load failed is good again only once a step rewrote it whole from good inputs
    (docs/vllm.md, "The rule"): after a step that rewrote half of it, KV a sharer computed from it
    is not stored."""
    with _engine_after_a_was_stored(tmp_path / "store", tiny_model_dir) as second:
        faults.fail_gets, faults.fail_gets_matching = True, block_hashes(A)[2].hex()
        x_prompt, y_prompt = _sharing_step(second)
        second.run()
        faults.fail_gets = False
        assert second.wrong_inputs, "the scenario did not make Y read the failed block"
        second.stored_objects_are_correct([A[:12], x_prompt, y_prompt])


def test_a_block_evicted_before_its_load_is_not_stored_half_recomputed(
    tmp_path: Path, tiny_model_dir: Path, faults: Faults
) -> None:
    """The recompute policy's own case: A's third block is evicted between the lookup and the load;
    the block stored again under A's key (every engine serving A loads it) holds A's KV, never a
    half-rewritten block's."""
    from kvflow.keys import decode_key
    from kvflow.profiles import is_book_key

    def hash_of(path: Path) -> bytes | None:
        key = faults.keys.get(path.name)
        return None if key is None or is_book_key(key) else decode_key(key).block_hash

    store = tmp_path / "store"
    with _engine_after_a_was_stored(store, tiny_model_dir) as second:
        x_prompt, y_prompt = _sharing_step(second)
        output = second.scheduler.schedule()  # the lookups answered: 3 blocks
        for path in (store / "objects").iterdir():
            if hash_of(path) == block_hashes(A)[2]:
                path.unlink()  # evicted before the load
        second._queued.append((output, second._execute(output)))
        done, result = second._queued.pop(0)
        second._apply(second.scheduler.update_from_output(done, result))
        second.run()
        assert second.wrong_inputs, "the scenario did not make Y read the missed block"
        second.stored_objects_are_correct([A[:12], x_prompt, y_prompt])


def _stored_hashes(faults: Faults) -> set[bytes]:
    from kvflow.keys import decode_key
    from kvflow.profiles import is_book_key

    return {decode_key(k).block_hash for k in faults.keys.values() if not is_book_key(k)}


@pytest.mark.parametrize("budget", [0, 6], ids=["whole prompt", "chunks ending inside blocks"])
def test_blocks_recomputed_after_a_failed_load_are_stored(
    tmp_path: Path, tiny_model_dir: Path, faults: Faults, budget: int
) -> None:
    """After vLLM recomputes what a failed load left bad (in chunks that end inside blocks, too),
    the recomputed blocks are stored, and so are the blocks of a later request that reads them
    through the prefix cache: a failure costs no caching once it is recomputed."""
    with _engine_after_a_was_stored(tmp_path / "store", tiny_model_dir, [*A[:8], 7], 1) as second:
        faults.fail_gets, faults.fail_gets_left = True, 1
        faults.fail_gets_matching = block_hashes(A[:8])[1].hex()
        if budget:
            second.scheduler.max_num_scheduled_tokens = budget
        x_prompt = [*A[:8], *range(500, 514)]  # 5 full blocks
        second.add(x_prompt, max_tokens=3)
        second.run()
        faults.fail_gets = False
        assert second.loads
        z_prompt = [*x_prompt, *range(600, 613)]  # a later request reading X's blocks
        second.add(z_prompt, max_tokens=2)
        second.run()
        second.stored_objects_are_correct([[*A[:8], 7], x_prompt, z_prompt])
        have = _stored_hashes(faults)
        assert [i for i, h in enumerate(block_hashes(z_prompt)) if h not in have] == []


def test_a_decode_block_completed_after_a_recompute_is_stored(
    tmp_path: Path, tiny_model_dir: Path, faults: Faults
) -> None:
    """X's prompt ends inside a block the failed step computed; vLLM recomputes it in part, then
    decode steps complete it from good KV: with save_decode_blocks it is stored."""
    extra = {"save_decode_blocks": True}
    with _engine_after_a_was_stored(
        tmp_path / "store", tiny_model_dir, [*A[:8], 7], 1, extra=extra
    ) as second:
        faults.fail_gets, faults.fail_gets_left = True, 1
        faults.fail_gets_matching = block_hashes(A[:8])[1].hex()
        x_prompt = [*A[:8], *range(500, 514)]  # 22 tokens: its last block holds 2 of them
        rid = second.add(x_prompt, max_tokens=7)
        second.run()
        faults.fail_gets = False
        full = [*x_prompt, *second.requests[rid].outputs]
        second.stored_objects_are_correct([[*A[:8], 7], full])
        have = _stored_hashes(faults)
        assert [i for i, h in enumerate(block_hashes(full[:-1])) if h not in have] == []


@pytest.mark.parametrize("cap", [1, 2, 3])
@pytest.mark.parametrize(("sharers", "tail"), [(2, 5), (3, 5), (2, 1), (3, 1), (4, 1), (5, 1), (4, 5)])
def test_sharers_of_a_failed_block_recomputed_in_chunks_all_finish(
    engines: Engines, cap: int, sharers: int, tail: int
) -> None:
    """Block 2 of A fails to load for the first request, which recomputes it ``cap`` tokens a step;
    requests sharing A through vLLM's prefix cache arrive the step after and read all of block 2
    every step (with ``tail`` tokens of their own: one token, and they hold no block of their own
    and sample at once). Reporting their reads must not rewind the requests recomputing the block
    (vLLM rewinds the first running request holding a reported block), or none of them ever ends:
    each ends, with the clean model's outputs."""
    first = engines()
    engines.serve(first, A)
    faults = scheduler_harness.FAULTS
    faults.fail_gets, faults.fail_gets_left = True, 1
    faults.fail_gets_matching = scheduler_harness.block_hashes(A)[2].hex()
    engine = engines(max_num_batched_tokens=16)
    engine.scheduler.scheduler_config.long_prefill_token_threshold = cap
    owner = engine.add(A_LONG, max_tokens=3)
    engine.step()
    prompts = [[*A, *range(500 + 50 * j, 500 + 50 * j + tail)] for j in range(sharers)]
    ids = [engine.add(p, max_tokens=8) for p in prompts]
    finish(engine, max_steps=400)
    faults.fail_gets = False
    engines.prompts += [A_LONG, *prompts]
    for req_id, prompt, n in [(owner, A_LONG, 3), *((i, p, 8) for i, p in zip(ids, prompts))]:
        assert engine.requests[req_id].finished, req_id
        assert engine.requests[req_id].outputs == engine.expected_outputs(prompt, n), req_id
