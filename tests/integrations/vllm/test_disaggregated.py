"""Disaggregated prefill through the store, on the real engine (CPU): a ``kv_producer`` (prefill)
engine and a ``kv_consumer`` (decode) engine in two processes, one local store between them.

Three engine runs, shared by the tests below:

1. the producer prefills A, C, D, E (one token each), through a store whose puts take 2 s
   and with blocks staged through host buffers (so a put outlives the step unless the connector
   waits for it); right when ``generate`` returns, the store's directory is listed. Then vLLM's
   prefix cache is reset and the same prompts run again. KV events and Prometheus are on.
2. the consumer, on a copy of that store, runs A, C, D, E_HEAD with the reference's 12 tokens.
3. a consumer on an empty store runs A, C.

What they prove: the producer's blocks are all in the store when its output is returned (the
router may send the request on at once); the producer never looks up or loads; the consumer loads
every full block and computes only the tokens after them, with the reference's tokens, and stores
nothing (on a full store or an empty one); the connector's KV events carry exactly the stored
blocks' hashes (the hashes vLLM's own events give the same blocks); its Prometheus metrics count
what moved.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.backends.local.backend import key_of_file_name
from kvflow.backends.local.format import HEADER_SIZE
from kvflow.keys import decode_key
from kvflow.profiles import is_book_key
from tests.integrations.vllm.conftest import Reference
from tests.integrations.vllm.connector_helpers import (
    COUNTERS_ENV,
    kvflow_transfer_config,
    local_objects,
    read_counters,
)
from tests.integrations.vllm.engine_harness import EngineRun, EngineSpec, run_engine
from tests.integrations.vllm.prompts import BLOCK, E_HEAD, MAX_TOKENS, A, C, D, E

pytestmark = pytest.mark.slow

PREFILL = ((A, C, D, E), (A, C, D, E))
PREFILL_BLOCKS = 11 + 6 + 8 + 12
DECODE = ((A, C, D, E_HEAD),)


def _transfer(backend: str, role: str, **extra: Any) -> dict[str, Any]:
    # A short model_id: the tests read block hashes back from the local store's file names, and a
    # key longer than 200 bytes (the model's temp path, quoted, and the variant) is named by its digest.
    return {**kvflow_transfer_config(backend, model_id="tiny", **extra), "kv_role": role}


def _folder(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def producer(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[EngineRun, Path, Mapping[str, int]]]:
    root = tmp_path_factory.mktemp("kvflow-prefill")
    store, counters = root / "store", _folder(root, "counters")
    transfer = _transfer(
        f"slow-local://{store}?capacity=256MiB", "kv_producer", staging="always", staging_bytes="16MiB"
    )
    spec = EngineSpec(
        tiny_model_dir,
        PREFILL,
        max_tokens=1,
        block_size=BLOCK,
        max_num_batched_tokens=2048,  # one step computes (and stores) every prompt
        kv_transfer_config=transfer,
        env={COUNTERS_ENV: str(counters), "KVFLOW_TEST_PUT_DELAY_S": "2"},
        between_batches=(f"ls:{store}/objects", "reset"),
        kv_events=True,
        prometheus=True,
    )
    run = run_engine(spec)
    (moved,) = read_counters(counters).values()
    yield run, store, moved
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def consumer(
    producer: tuple[EngineRun, Path, Mapping[str, int]],
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
) -> Iterator[tuple[EngineRun, Path, Mapping[str, int]]]:
    root = tmp_path_factory.mktemp("kvflow-decode")
    store, counters = root / "store", _folder(root, "counters")
    shutil.copytree(producer[1], store)
    spec = EngineSpec(
        tiny_model_dir,
        DECODE,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        kv_transfer_config=_transfer(f"local://{store}?capacity=256MiB", "kv_consumer"),
        env={COUNTERS_ENV: str(counters)},
        prometheus=True,
    )
    run = run_engine(spec)
    (moved,) = read_counters(counters).values()
    yield run, store, moved
    shutil.rmtree(root, ignore_errors=True)


def _hash_of(file_name: str) -> bytes:
    key = key_of_file_name(file_name)
    assert key is not None, file_name
    return decode_key(key).block_hash


def _block_nbytes(store: Path) -> int:
    sizes = {path.stat().st_size - HEADER_SIZE for path in local_objects(store)}
    assert len(sizes) == 1, sizes  # whole-block objects of one model: all the same size
    return sizes.pop()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every kvflow sample of a Prometheus text, by name and labels (model and engine dropped)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvflow_"):
                labels = tuple(
                    sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
                )
                found[sample.name, labels] = sample.value
    return found


def _value(
    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[f"vllm:kvflow_{name}", tuple(sorted(labels.items()))]


def test_the_producers_blocks_are_stored_when_its_output_is_returned(
    producer: tuple[EngineRun, Path, Mapping[str, int]], reference: Reference
) -> None:
    """Listed right when ``generate`` returned: every full block is there, though every put took
    2 s longer than the step that computed it (staged: the blocks were free long before). Without
    the producer's wait, a third of them were not there yet."""
    run, store, moved = producer
    listed = [n for n in run.timings["between"][0]["ls"] if not is_book_key(n)]
    assert len(listed) == PREFILL_BLOCKS
    assert {_hash_of(n) for n in listed} == {_hash_of(p.name) for p in local_objects(store)}
    assert moved["stored_blocks"] == PREFILL_BLOCKS and moved["store_failed_blocks"] == 0
    # the prefill's one token is the reference's first
    assert [r.token_ids[0] for r in run.batches[0]] == [t[0] for t in reference.expected(PREFILL[:1])]


def test_the_producer_never_looks_up_or_loads(producer: tuple[EngineRun, Path, Mapping[str, int]]) -> None:
    """After vLLM's prefix cache was reset, the same prompts again: a kv_both engine would load
    every full block; the producer computes them and finds them present instead."""
    run, _, moved = producer
    assert run.timings["between"][0]["reset"] is True
    assert run.cached_tokens == (0,) * 8
    assert moved["loaded_blocks"] == 0 and moved["load_requests"] == 0
    assert moved["present_blocks"] == PREFILL_BLOCKS
    samples = _samples(run.prometheus)
    assert _value(samples, "lookups_total") == 0
    assert _value(samples, "stored_blocks_total") == PREFILL_BLOCKS
    assert _value(samples, "present_blocks_total") == PREFILL_BLOCKS
    assert _value(samples, "stored_bytes_total") == PREFILL_BLOCKS * _block_nbytes(producer[1])
    assert _value(samples, "store_seconds_count") >= 2  # at least one store per batch
    assert _value(samples, "store_seconds_sum") >= 2.0  # the slow puts were waited for


def test_the_consumer_loads_every_full_block_computes_the_rest_and_stores_nothing(
    consumer: tuple[EngineRun, Path, Mapping[str, int]], reference: Reference
) -> None:
    run, store, moved = consumer
    assert run.outputs == reference.expected(DECODE)
    # A (365 tokens) and C (200) compute only what follows their last full block; D (256, all
    # full blocks) computes its last token; E_HEAD finds E's first 4 blocks only.
    assert run.cached_tokens == (11 * BLOCK, 6 * BLOCK, 8 * BLOCK - 1, 4 * BLOCK)
    assert moved["loaded_blocks"] == 11 + 6 + 8 + 4 and moved["load_failed_blocks"] == 0
    assert moved["store_requests"] == 0 and moved["stored_blocks"] == 0
    assert len(local_objects(store)) == PREFILL_BLOCKS  # E_HEAD's new block 4 was not stored
    samples = _samples(run.prometheus)
    assert _value(samples, "lookups_total") == 4
    assert _value(samples, "lookup_hit_tokens_total") == (11 + 6 + 8 + 4) * BLOCK
    assert _value(samples, "lookup_missed_tokens_total") == BLOCK  # E_HEAD's block 4
    assert _value(samples, "loaded_blocks_total") == 29
    assert _value(samples, "loaded_bytes_total") == 29 * _block_nbytes(store)
    assert _value(samples, "lookup_seconds_count") == 4 and _value(samples, "load_seconds_count") == 4
    assert _value(samples, "stored_blocks_total") == 0
    for cause in ("miss", "error", "aborted"):
        assert _value(samples, "load_failed_blocks_total", cause=cause) == 0
    assert _value(samples, "store_reachable", client="scheduler") == 1
    assert _value(samples, "store_reachable", client="worker-tp0-pp0") == 1


def test_a_consumer_on_an_empty_store_computes_everything_and_stores_nothing(
    reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    store, counters = tmp_path / "store", _folder(tmp_path, "counters")
    batches = ((A, C),)
    spec = EngineSpec(
        tiny_model_dir,
        batches,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        kv_transfer_config=_transfer(f"local://{store}?capacity=256MiB", "kv_consumer"),
        env={COUNTERS_ENV: str(counters)},
    )
    run = run_engine(spec)
    assert run.outputs == reference.expected(batches)
    assert run.cached_tokens == (0, 0)
    (moved,) = read_counters(counters).values()
    assert moved["store_requests"] == 0 and moved["loaded_blocks"] == 0
    assert list((store / "objects").iterdir()) == []


def test_kv_events_report_exactly_the_stored_blocks(
    producer: tuple[EngineRun, Path, Mapping[str, int]],
) -> None:
    """One BlockStored per stored block, medium CPU, with the hash vLLM's own (GPU) event gives the
    same block, its parent, and its 32 tokens."""
    run, store, _ = producer
    events = run.kv_events[0]
    ours = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    own = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert len(ours) == PREFILL_BLOCKS
    stored = {_hash_of(p.name) for p in local_objects(store)}
    hashes = [e["block_hashes"][0] for e in ours]
    assert sorted(hashes, key=str) == sorted(map(_event_hash(hashes[0]), stored), key=str)
    assert {h for e in own for h in e["block_hashes"]} >= set(hashes)  # the GPU cache's hashes
    parents = {e["block_hashes"][0]: e["parent_block_hash"] for e in ours}
    blocks = {tuple(p[i * BLOCK : (i + 1) * BLOCK]) for p in (A, C, D, E) for i in range(len(p) // BLOCK)}
    for event in ours:
        assert event["block_size"] == BLOCK and tuple(event["token_ids"]) in blocks
        parent = event["parent_block_hash"]
        assert parent is None or parent in parents  # a chain: every parent is a stored block
    assert sum(1 for e in ours if e["parent_block_hash"] is None) == 4  # one first block per prompt


def _event_hash(sample: object) -> Any:
    """How vLLM's events write a 32-byte block hash: an int of its last 8 bytes (the default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the bytes' hex."""
    if isinstance(sample, int):
        return lambda h: int.from_bytes(h, "big") & ((1 << 64) - 1)
    return lambda h: h.hex()
