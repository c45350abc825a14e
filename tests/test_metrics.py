"""kvflow.metrics: the figures a pool's user records, read back from a Prometheus registry after
real stores, loads and lookups through a local store; and nothing at all without prometheus_client."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

import kvflow.metrics as metrics_module
from kvflow import (
    BackendError,
    ConfigError,
    KVLayout,
    KVPool,
    KVRequest,
    ParallelConfig,
    PoolClosedError,
    PoolConfig,
    PutStatus,
    RequestError,
    RetrieveResult,
    StoreResult,
)
from kvflow.backends import ObjectRef
from kvflow.events import CpuEvent
from kvflow.keys import hash_blocks
from kvflow.metrics import (
    CATALOGUE,
    MeteredPool,
    Observations,
    PoolMetrics,
    TransferCounters,
)
from tests.helpers import FaultyBackend

BLOCK = 4
PROMPT = list(range(100, 100 + 5 * BLOCK + 2))  # 5 full blocks


def _caches() -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.randn(8, 2, BLOCK, 16) for i in range(2)}


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value is not None, f"no sample {name} {labels}"
    return value


async def test_a_metered_pool_records_what_it_moved(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    assert metrics.enabled
    caches = _caches()
    layout = KVLayout.from_kv_caches(caches)
    config = PoolConfig(backend=f"local://{tmp_path}/store?capacity=64MiB", model="m")
    async with KVPool.create(config, layout=layout) as raw:
        pool = MeteredPool(raw, metrics)
        first = KVRequest(tokens=PROMPT[: 3 * BLOCK], block_ids=[1, 2, 3])
        await pool.store(first)
        await pool.store(first)  # present now
        assert await pool.lookup(KVRequest(tokens=PROMPT)) == 3 * BLOCK
        loaded = await pool.retrieve(KVRequest(tokens=PROMPT, block_ids=[4, 5, 6, 7, 0]))
        assert loaded.hit_blocks == 3
    block = layout.block_nbytes
    assert _value(registry, "kvflow_stored_blocks_total") == 3
    assert _value(registry, "kvflow_stored_bytes_total") == 3 * block
    assert _value(registry, "kvflow_present_blocks_total") == 3
    assert _value(registry, "kvflow_lookups_total") == 1
    assert _value(registry, "kvflow_lookup_hit_tokens_total") == 3 * BLOCK
    assert _value(registry, "kvflow_lookup_missed_tokens_total") == 2 * BLOCK
    assert _value(registry, "kvflow_loaded_blocks_total") == 3
    assert _value(registry, "kvflow_loaded_bytes_total") == 3 * block
    assert _value(registry, "kvflow_load_failed_blocks_total", cause="miss") == 2
    assert _value(registry, "kvflow_load_failed_blocks_total", cause="error") == 0
    assert _value(registry, "kvflow_store_failed_blocks_total", cause="no_space") == 0
    assert _value(registry, "kvflow_store_seconds_count") == 2
    assert _value(registry, "kvflow_load_seconds_count") == 1
    assert _value(registry, "kvflow_lookup_seconds_count") == 1
    assert _value(registry, "kvflow_load_seconds_sum") > 0
    assert registry.get_sample_value("kvflow_store_reachable", {"model_name": "m", "client": "pool"}) is None
    metrics.set_reachable(False)
    assert _value(registry, "kvflow_store_reachable", client="pool") == 0
    metrics.set_reachable(True)
    assert _value(registry, "kvflow_store_reachable", client="pool") == 1


def test_every_catalogued_metric_is_registered_with_its_kind() -> None:
    registry = CollectorRegistry()
    PoolMetrics(registry=registry, prefix="x_")
    kinds = {family.name: family.type for family in registry.collect()}
    for spec in CATALOGUE:
        assert kinds[f"x_{spec.name}"] == spec.kind.value, spec.name


def test_without_prometheus_client_nothing_is_recorded_and_nothing_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_module, "_prometheus_client", lambda: None)
    metrics = PoolMetrics(labels={"model_name": "m"})
    assert not metrics.enabled
    metrics.looked_up(4, 8, 0.1)
    metrics.stored(None, 3, 0.1, 100)
    metrics.set_reachable(False)


counts = st.integers(min_value=0, max_value=1 << 40)
seconds = st.lists(st.floats(min_value=0, max_value=100), max_size=5)
observations = st.builds(
    Observations,
    st.builds(
        TransferCounters,
        loaded_blocks=counts,
        load_missed_blocks=counts,
        stored_bytes=counts,
        dropped_save_blocks=counts,
        lookups=counts,
    ),
    seconds,
    seconds,
    seconds,
    st.lists(st.tuples(st.sampled_from(["scheduler", "worker-tp0-pp0"]), st.booleans()), max_size=1),
)


@given(observations, observations)
def test_observations_survive_their_plain_form_and_add_up(a: Observations, b: Observations) -> None:
    assert Observations.from_data(a.to_data()) == a
    total = a.plus(b)
    assert total.counters.loaded_blocks == a.counters.loaded_blocks + b.counters.loaded_blocks
    assert total.counters.load_failed_blocks == a.counters.load_failed_blocks + b.counters.load_failed_blocks
    assert total.store_s == a.store_s + b.store_s
    assert total.empty == (a.empty and b.empty)
    assert total.counters.minus(b.counters) == a.counters


def test_the_operations_doc_example_runs_as_written(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    section = text.split("### In a custom engine", 1)[1]
    (program,) = re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    script = tmp_path / "example.py"
    script.write_text(program)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == "hit 32 tokens, stored 2 blocks" and f"`{first}`" in section


async def test_lookup_tokens_count_blocks_not_hashes_with_hash_tokens() -> None:
    """``lookup_missed_tokens_total`` counts tokens of full blocks a lookup did not find; with
    ``hash_tokens``, ``block_hashes`` holds one hash per ``hash_tokens`` tokens, not per block. A
    prompt of 3 blocks with 2 of them stored reads 2 blocks' tokens hit and 1 block's missed."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    config = PoolConfig(backend="memory://", model="m", hash_tokens=BLOCK // 2)
    async with KVPool.create(config, layout=KVLayout.from_kv_caches(_caches())) as raw:
        pool = MeteredPool(raw, metrics)
        hashes = hash_blocks(list(range(3 * BLOCK)), BLOCK // 2)  # two per block
        await pool.store(KVRequest(block_hashes=hashes[:4], block_ids=[1, 2]))
        assert await pool.lookup(KVRequest(block_hashes=hashes)) == 2 * BLOCK
    hit, missed = (
        _value(registry, "kvflow_lookup_hit_tokens_total"),
        _value(registry, "kvflow_lookup_missed_tokens_total"),
    )
    assert (hit, missed) == (2 * BLOCK, BLOCK)


def test_pool_metrics_of_two_label_sets_share_one_registry() -> None:
    """A process serving two models makes one PoolMetrics per model in one registry: both record,
    and the scrape carries each family's HELP/TYPE once."""
    registry = CollectorRegistry()
    a = PoolMetrics(labels={"model_name": "a"}, registry=registry)
    b = PoolMetrics(labels={"model_name": "b"}, registry=registry)
    a.looked_up(16, 32, 0.01)
    b.looked_up(0, 32, 0.01)
    assert registry.get_sample_value("kvflow_lookups_total", {"model_name": "a"}) == 1
    assert registry.get_sample_value("kvflow_lookups_total", {"model_name": "b"}) == 1
    assert generate_latest(registry).decode().count("# TYPE kvflow_lookups_total counter") == 1


def test_pool_metrics_with_label_names_in_another_order_share_a_registry() -> None:
    registry = CollectorRegistry()
    PoolMetrics(labels={"model_name": "a", "engine": "0"}, registry=registry).looked_up(16, 32, 0.01)
    PoolMetrics(labels={"engine": "1", "model_name": "b"}, registry=registry).looked_up(0, 32, 0.01)
    assert registry.get_sample_value("kvflow_lookups_total", {"model_name": "a", "engine": "0"}) == 1
    assert registry.get_sample_value("kvflow_lookups_total", {"model_name": "b", "engine": "1"}) == 1


@pytest.mark.parametrize("label", ["cause", "client", "le"])
def test_a_label_name_kvflow_uses_itself_is_refused_with_its_name(label: str) -> None:
    """A user's label named like a kvflow metric's own label (``cause`` of the failure counters,
    ``client`` of store_reachable, a histogram's ``le``) would collide with it (duplicate label
    names: prometheus_client accepts them and the scrape breaks): PoolMetrics refuses it with a
    ConfigError naming it, and registers nothing, so a corrected PoolMetrics then works."""
    registry = CollectorRegistry()
    with pytest.raises(ConfigError, match=rf"\['{label}'\].*choose other label names"):
        PoolMetrics(labels={"model_name": "m", label: "x"}, registry=registry)
    assert list(registry.collect()) == []
    PoolMetrics(labels={"model_name": "m", f"my_{label}": "x"}, registry=registry).looked_up(4, 8, 0.01)
    assert _value(registry, "kvflow_lookups_total", **{f"my_{label}": "x"}) == 1


@pytest.mark.parametrize(
    ("labels", "prefix", "match"),
    [
        ({"1bad": "x"}, "kvflow_", r"\['1bad'\] are not Prometheus label names"),
        ({"a-b": "x"}, "kvflow_", r"\['a-b'\] are not Prometheus label names"),
        ({"__meta": "x"}, "kvflow_", r"\['__meta'\] are not Prometheus label names"),
        ({"engine": "0"}, "bad-prefix", r"prefix 'bad-prefix' does not make Prometheus metric names"),
    ],
)
def test_a_name_prometheus_would_rewrite_is_refused(labels: dict[str, str], prefix: str, match: str) -> None:
    """prometheus_client rewrites a label name or metric name Prometheus does not take (``1bad``
    into ``_bad``), so a dashboard's queries would silently find nothing: refused, nothing
    registered."""
    registry = CollectorRegistry()
    with pytest.raises(ConfigError, match=match):
        PoolMetrics(labels=labels, registry=registry, prefix=prefix)
    assert list(registry.collect()) == []


def test_other_label_names_in_one_registry_and_prefix_say_to_match_or_use_another() -> None:
    """PoolMetrics with other label names than an earlier one of the same registry and prefix
    cannot share its metrics: a ConfigError says the names must match or to pass another
    registry= or prefix= (not prometheus_client's raw "Duplicated timeseries"); another prefix in
    the same registry works, and the first PoolMetrics keeps recording."""
    registry = CollectorRegistry()
    first = PoolMetrics(labels={"model_name": "a"}, registry=registry)
    with pytest.raises(ConfigError, match=r"label names must match.*registry= or prefix="):
        PoolMetrics(labels={"model_name": "b", "engine": "0"}, registry=registry)
    other = PoolMetrics(labels={"model_name": "b", "engine": "0"}, registry=registry, prefix="kvflow2_")
    first.looked_up(4, 8, 0.01)
    other.looked_up(0, 8, 0.01)
    assert _value(registry, "kvflow_lookups_total", model_name="a") == 1
    assert registry.get_sample_value("kvflow2_lookups_total", {"model_name": "b", "engine": "0"}) == 1


def test_a_name_the_registry_holds_from_elsewhere_is_a_config_error_and_leaves_nothing() -> None:
    """A registry where another metric already has one of kvflow's names: ConfigError saying to
    pass another registry= or prefix=, and none of kvflow's metrics stay half-registered."""
    from prometheus_client import Counter

    registry = CollectorRegistry()
    Counter("kvflow_stored_blocks", "someone else's", registry=registry)
    with pytest.raises(ConfigError, match="registry= or prefix="):
        PoolMetrics(labels={"model_name": "m"}, registry=registry)
    assert [m.name for m in registry.collect()] == ["kvflow_stored_blocks"]


@pytest.mark.parametrize("call", ["store", "retrieve"])
async def test_a_refused_request_is_not_counted_as_a_failed_transfer(call: str) -> None:
    """A call the pool refused before any I/O (a block id past the cache) raises RequestError and
    counts no blocks failed (an alert on store errors would page for a caller's bug)."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    async with KVPool.create(
        PoolConfig(backend="memory://", model="m"), layout=KVLayout.from_kv_caches(_caches())
    ) as raw:
        pool = MeteredPool(raw, metrics)
        with pytest.raises(RequestError):
            await getattr(pool, call)(KVRequest(tokens=PROMPT, block_ids=[1, 99]))
    assert _value(registry, "kvflow_store_failed_blocks_total", cause="error") == 0
    assert _value(registry, "kvflow_load_failed_blocks_total", cause="aborted") == 0


async def test_after_and_on_released_reach_the_pool() -> None:
    """MeteredPool takes the pool's ``after=`` and ``on_released=``: a store reads no block before
    its event completed (the bytes stored are those written just before it), calls
    ``on_released`` once, and a load writes nothing into the cache before its event completed."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    caches = _caches()
    async with KVPool.create(
        PoolConfig(backend="memory://", model="m"), layout=KVLayout.from_kv_caches(caches)
    ) as raw:
        pool = MeteredPool(raw, metrics)
        written = CpuEvent()
        released: list[bool] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: pool.store(
                    KVRequest(tokens=PROMPT, block_ids=[0, 1, 2, 3, 4]),
                    after=written,
                    on_released=lambda: released.append(True),
                )
            )
            await anyio.sleep(0.05)
            assert released == []  # waiting for the "forward"
            for cache in caches.values():
                cache[:5] = 7.0  # the forward writes the blocks, then records its event
            written.record()
        assert released == [True]

        for cache in caches.values():
            cache[5:] = 0.0
        free = CpuEvent()
        loaded: list[RetrieveResult] = []

        async def load() -> None:
            loaded.append(await pool.retrieve(KVRequest(tokens=PROMPT, block_ids=[5, 6, 7]), after=free))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await anyio.sleep(0.05)
            assert not loaded and all(bool((cache[5:] == 0).all()) for cache in caches.values())
            free.record()
        assert loaded[0].hit_blocks == 3
        assert all(bool((cache[5:8] == 7).all()) for cache in caches.values())
    assert _value(registry, "kvflow_stored_blocks_total") == 5
    assert _value(registry, "kvflow_loaded_blocks_total") == 3


async def test_store_many_and_retrieve_many_record_each_request() -> None:
    """``store_many`` and ``retrieve_many`` (an engine step's requests in one call) return the
    pool's results, one per request, and record each request as ``store`` and ``retrieve`` do:
    its blocks, and one seconds sample each."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    layout = KVLayout.from_kv_caches(_caches())
    other = list(range(500, 500 + 3 * BLOCK))
    async with KVPool.create(PoolConfig(backend="memory://", model="m"), layout=layout) as raw:
        pool = MeteredPool(raw, metrics)
        released: list[bool] = []
        stored = await pool.store_many(
            [KVRequest(tokens=PROMPT, block_ids=[0, 1]), KVRequest(tokens=other, block_ids=[2, 3, 4])],
            on_released=lambda: released.append(True),
        )
        assert [r.stored for r in stored] == [2, 3] and released == [True]
        loaded = await pool.retrieve_many(
            [KVRequest(tokens=PROMPT, block_ids=[5, 6, 7]), KVRequest(tokens=other, block_ids=[0, 1])]
        )
        assert [r.hit_blocks for r in loaded] == [2, 2]
    assert _value(registry, "kvflow_stored_blocks_total") == 5
    assert _value(registry, "kvflow_stored_bytes_total") == 5 * layout.block_nbytes
    assert _value(registry, "kvflow_store_seconds_count") == 2
    assert _value(registry, "kvflow_loaded_blocks_total") == 4
    assert _value(registry, "kvflow_load_failed_blocks_total", cause="miss") == 1
    assert _value(registry, "kvflow_load_seconds_count") == 2


async def test_a_cancelled_store_counts_as_failed_with_its_seconds() -> None:
    """A store cancelled part-way (an engine's timeout, a shutdown) moved some blocks and has no
    result: it counts as failed as a whole, like a store that raised, with its seconds, and the
    cancellation goes on (the task group ends quietly)."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    layout = KVLayout.from_kv_caches(_caches())
    stalled = anyio.Event()

    async def stall_after_the_first_put(objects: Sequence[ObjectRef]) -> None:
        if backend.calls.count("put") > 1:
            stalled.set()
            await anyio.sleep_forever()

    backend = FaultyBackend(put_hook=stall_after_the_first_put)
    config = PoolConfig(backend="memory://", model="m", max_inflight_bytes=4 * layout.block_nbytes)
    async with KVPool.create(config, layout=layout, backend=backend) as raw:
        pool = MeteredPool(raw, metrics)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: pool.store(KVRequest(tokens=PROMPT, block_ids=range(5))))
            await stalled.wait()  # the second put began once the first ended (max_inflight_bytes)
            tg.cancel_scope.cancel()
        assert 0 < await raw.lookup(KVRequest(tokens=PROMPT)) < 5 * BLOCK  # some blocks moved
    assert _value(registry, "kvflow_store_failed_blocks_total", cause="error") == 5
    assert _value(registry, "kvflow_store_seconds_count") == 1
    assert _value(registry, "kvflow_stored_blocks_total") == 0


async def test_a_cancelled_load_counts_as_aborted_with_its_seconds() -> None:
    """A load cancelled while its gets hang counts its blocks aborted, with its seconds, and the
    cancellation goes on (``move_on_after`` catches it)."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    backend = FaultyBackend()
    layout = KVLayout.from_kv_caches(_caches())
    async with KVPool.create(
        PoolConfig(backend="memory://", model="m"), layout=layout, backend=backend
    ) as raw:
        pool = MeteredPool(raw, metrics)
        await pool.store(KVRequest(tokens=PROMPT, block_ids=range(5)))
        backend.hang_on.add("get")
        with anyio.move_on_after(0.2) as scope:
            await pool.retrieve(KVRequest(tokens=PROMPT, block_ids=range(5)))
        assert scope.cancelled_caught
    assert _value(registry, "kvflow_load_failed_blocks_total", cause="aborted") == 5
    assert _value(registry, "kvflow_load_seconds_count") == 1
    assert _value(registry, "kvflow_load_seconds_sum") >= 0.2


@pytest.mark.parametrize("offset", [0, 1])
async def test_a_store_failing_as_a_whole_counts_the_blocks_this_rank_owns(offset: int) -> None:
    """TP=4 with 2 KV heads: ranks 0 and 1 hold the same KV and rank 0 stores the even blocks of a
    prompt. A store that works counts those (``stored``; the others are ``not_owned``); one that
    fails as a whole counts the same owned blocks failed, not every block of the request (its
    replica would count the others a second time)."""
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(2, 8, BLOCK, 1, 16) for i in range(2)}
    parallel = ParallelConfig(tp_rank=0, tp_size=4, num_kv_heads=2)
    request = KVRequest(tokens=PROMPT, block_ids=range(5 - offset), block_offset=offset)
    owned = len(range(offset, 5, 2))  # blocks 0, 2, 4 of 0..4; 2, 4 of 1..4

    async def refuse(objects: Sequence[ObjectRef]) -> None:
        raise BackendError("injected: the backend refuses every put")

    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    config = PoolConfig(backend="memory://", model="m")
    layout = KVLayout.from_kv_caches(caches)
    async with KVPool.create(config, layout=layout, parallel=parallel) as raw:
        assert (await MeteredPool(raw, metrics).store(request)).stored == owned
    assert _value(registry, "kvflow_stored_blocks_total") == owned

    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    backend = FaultyBackend(put_hook=refuse)
    async with KVPool.create(config, layout=layout, parallel=parallel, backend=backend) as raw:
        with pytest.raises(BackendError, match="injected"):
            await MeteredPool(raw, metrics).store(request)
    assert _value(registry, "kvflow_store_failed_blocks_total", cause="error") == owned


async def test_a_closed_pool_counts_nothing() -> None:
    """A closed pool refuses every call with PoolClosedError before anything moved, as it refuses
    a bad request: no lookup, no failed store or load, no seconds sample (a lookup never counted
    one; a store or load on a shut-down pool must not page as a store failure either)."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    raw = KVPool.create(PoolConfig(backend="memory://", model="m"), layout=KVLayout.from_kv_caches(_caches()))
    await raw.aclose()
    pool = MeteredPool(raw, metrics)
    request = KVRequest(tokens=PROMPT, block_ids=range(5))
    released: list[bool] = []
    with pytest.raises(PoolClosedError):
        await pool.store(request, on_released=lambda: released.append(True))
    assert released == [True]  # the pool's promise: a refused store releases its blocks at once
    with pytest.raises(PoolClosedError):
        await pool.store_many([request])
    with pytest.raises(PoolClosedError):
        await pool.retrieve(request)
    with pytest.raises(PoolClosedError):
        await pool.retrieve_many([request])
    with pytest.raises(PoolClosedError):
        await pool.lookup(request)
    assert _value(registry, "kvflow_store_failed_blocks_total", cause="error") == 0
    assert _value(registry, "kvflow_load_failed_blocks_total", cause="aborted") == 0
    for name in ("store", "load", "lookup"):
        assert _value(registry, f"kvflow_{name}_seconds_count") == 0


async def test_head_split_ranks_each_count_every_block_they_store_as_the_doc_says() -> None:
    """TP=2 with 2 KV heads: each rank holds its own head of every block, so each rank stores (and
    counts) every block; summed over ranks, as vLLM sums them, stored_blocks counts each block twice
    while stored_bytes counts each byte once. docs/operations.md says so (as for loaded_blocks),
    not that a block counts once, at its owner."""
    registry = CollectorRegistry()
    layout = None
    for rank in (0, 1):
        caches = {f"model.layers.{i}.self_attn.attn": torch.randn(2, 8, BLOCK, 1, 16) for i in range(2)}
        layout = KVLayout.from_kv_caches(caches)
        parallel = ParallelConfig(tp_rank=rank, tp_size=2, num_kv_heads=2)
        config = PoolConfig(backend="memory://", model="m")
        async with KVPool.create(config, layout=layout, parallel=parallel) as raw:
            metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)  # summed, as vLLM sums ranks
            result = await MeteredPool(raw, metrics).store(KVRequest(tokens=PROMPT, block_ids=range(5)))
            assert (result.stored, result.not_owned) == (5, 0)
    assert layout is not None
    assert _value(registry, "kvflow_stored_blocks_total") == 2 * 5
    assert _value(registry, "kvflow_stored_bytes_total") == 2 * 5 * layout.block_nbytes  # each rank its heads

    text = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| `vllm:kvflow_stored_blocks_total`")]
    assert "KV heads split over TP ranks" in row and "a TP=2 engine counts each block twice" in row


async def test_a_lookup_counts_only_the_tokens_the_engine_does_not_hold(tmp_path: Path) -> None:
    """A lookup from ``block_offset`` (blocks the engine holds itself) counts as hit or missed only
    the tokens past them."""
    registry = CollectorRegistry()
    metrics = PoolMetrics(labels={"model_name": "m"}, registry=registry)
    config = PoolConfig(backend=f"local://{tmp_path}/store?capacity=64MiB", model="m")
    async with KVPool.create(config, layout=KVLayout.from_kv_caches(_caches())) as raw:
        pool = MeteredPool(raw, metrics)
        await pool.store(KVRequest(tokens=PROMPT[: 3 * BLOCK], block_ids=[1, 2, 3]))
        assert await pool.lookup(KVRequest(tokens=PROMPT, block_offset=2)) == 3 * BLOCK
    assert _value(registry, "kvflow_lookup_hit_tokens_total") == 1 * BLOCK  # block 2 only
    assert _value(registry, "kvflow_lookup_missed_tokens_total") == 2 * BLOCK  # blocks 3 and 4


def test_a_store_counts_blocks_without_space_apart_from_failed_ones() -> None:
    result = StoreResult((PutStatus.STORED, PutStatus.NO_SPACE, PutStatus.NO_SPACE, PutStatus.FAILED))
    counters = TransferCounters().with_store(result, 10)
    assert counters.store_failures() == {"no_space": 2, "error": 1, "load_failed": 0}
    assert counters.stored_blocks == 1 and counters.stored_bytes == 10
