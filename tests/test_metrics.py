"""kvflow.metrics: the figures a pool's user records, read back from a Prometheus registry after
real stores, loads and lookups through a local store; and nothing at all without prometheus_client."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

import kvflow.metrics as metrics_module
from kvflow import ConfigError, KVLayout, KVPool, KVRequest, PoolConfig, RequestError
from kvflow.keys import hash_blocks
from kvflow.metrics import (
    CATALOGUE,
    MeteredPool,
    Observations,
    PoolMetrics,
    TransferCounters,
)

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
