"""kvflow's vLLM connector on the real engine (CPU): stored prefixes load instead of recompute, and
the tokens stay exactly those of an engine without the connector.

Every test compares greedy tokens with the session's ``reference`` run (no connector). Hits are
read from vLLM's ``num_cached_tokens`` (its own prefix cache plus the connector's hit) and, where
it matters which blocks moved, from the workers' counters (``recording_connector.py``). Each test
is one or two fresh engine processes; the prompts and the expected block counts are in
``prompts.py``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow.backends.local.format import HEADER_SIZE, Header
from tests.integrations.vllm.conftest import Reference
from tests.integrations.vllm.connector_helpers import (
    COUNTERS_ENV,
    FAIL_MATCHING_ENV,
    FAIL_ONCE_FLAG_ENV,
    corrupt_local_store,
    kvflow_transfer_config,
    local_objects,
    read_counters,
)
from tests.integrations.vllm.engine_harness import EngineRun, EngineSpec, run_engine
from tests.integrations.vllm.prompts import (
    BLOCK,
    E_HEAD,
    FIRST_ENGINE,
    FIRST_ENGINE_STORED_BLOCKS,
    MAX_TOKENS,
    ONE_ENGINE,
    ONE_ENGINE_CACHED,
    ONE_ENGINE_LOADED_BLOCKS,
    ONE_ENGINE_STORED_BLOCKS,
    SECOND_ENGINE,
    SECOND_ENGINE_CACHED,
    SECOND_ENGINE_LOADED_BLOCKS,
    SECOND_ENGINE_STORED_BLOCKS,
    A,
    B,
    Batches,
    D,
    E,
    owned_by,
)

Engine = Callable[[EngineSpec], EngineRun]


def _spec(
    model: Path, batches: Batches, transfer: dict[str, Any], counters: Path, **kwargs: Any
) -> EngineSpec:
    env = {COUNTERS_ENV: str(counters), **kwargs.pop("env", {})}
    return EngineSpec(
        model,
        batches,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        kv_transfer_config=transfer,
        env=env,
        **kwargs,
    )


def _folder(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def _one_engine_run(
    model: Path, tmp_path: Path, backend: str | None = None, **kwargs: Any
) -> tuple[EngineRun, Mapping[int, Mapping[str, int]], Path]:
    """ONE_ENGINE with vLLM's prefix cache off: batch 1 stores, batch 2 can only hit kvflow."""
    store = tmp_path / "store"
    extra = kwargs.pop("extra", {})
    transfer = kvflow_transfer_config(backend or f"local://{store}?capacity=256MiB", **extra)
    counters = _folder(tmp_path, "counters")
    run = run_engine(_spec(model, ONE_ENGINE, transfer, counters, enable_prefix_caching=False, **kwargs))
    return run, read_counters(counters), store


def _assert_one_engine(
    run: EngineRun, counters: Mapping[int, Mapping[str, int]], reference: Reference
) -> None:
    assert run.outputs == reference.expected(ONE_ENGINE)
    first, second = run.batches
    assert tuple(r.num_cached_tokens for r in first) == (0, 0, 0, 0)
    assert tuple(r.num_cached_tokens for r in second) == ONE_ENGINE_CACHED
    for rank, moved in counters.items():
        assert moved["loaded_blocks"] == ONE_ENGINE_LOADED_BLOCKS, rank
        assert moved["load_failed_blocks"] == 0, rank
        assert moved["store_failed_blocks"] == 0 and moved["dropped_save_blocks"] == 0, rank


# -- two engines, two processes: the first stores, the second loads -----------------------------------


@pytest.fixture(scope="module")
def first_store(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[EngineRun, Path]]:
    """FIRST_ENGINE through the product connector (``kvflow.integrations.vllm``), in-process mode.

    Yields the run and its local store; tests copy the store before changing anything in it.
    """
    root = tmp_path_factory.mktemp("kvflow-vllm-first")
    store = root / "store"
    transfer = kvflow_transfer_config(f"local://{store}?capacity=256MiB", recording=False)
    run = run_engine(
        EngineSpec(
            tiny_model_dir, FIRST_ENGINE, max_tokens=MAX_TOKENS, block_size=BLOCK, kv_transfer_config=transfer
        )
    )
    yield run, store
    shutil.rmtree(root, ignore_errors=True)


def _copy_store(store: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return copy


def _second_engine(
    stored: Path, reference: Reference, model: Path, tmp_path: Path, **extra: Any
) -> tuple[Mapping[str, int], Path]:
    """SECOND_ENGINE in a new process over a copy of the first engine's store: exact tokens, every
    external hit loaded; returns its counters and the store."""
    store = _copy_store(stored, tmp_path)
    counters = _folder(tmp_path, "counters")
    transfer = kvflow_transfer_config(f"local://{store}?capacity=256MiB", **extra)
    run = run_engine(_spec(model, SECOND_ENGINE, transfer, counters))
    assert run.outputs == reference.expected(SECOND_ENGINE)
    assert run.cached_tokens == SECOND_ENGINE_CACHED
    (moved,) = read_counters(counters).values()
    assert moved["loaded_blocks"] == SECOND_ENGINE_LOADED_BLOCKS
    assert moved["load_failed_blocks"] == 0
    assert moved["early_load_steps"] > 0  # loads started as vLLM handed the worker the step
    return moved, store


def test_first_engine_matches_reference_and_stores_every_full_prompt_block(
    first_store: tuple[EngineRun, Path], reference: Reference
) -> None:
    run, store = first_store
    assert run.outputs == reference.expected(FIRST_ENGINE)
    assert run.cached_tokens == (0, 0, 0, 0)
    assert len(local_objects(store)) == FIRST_ENGINE_STORED_BLOCKS


def test_second_engine_in_a_new_process_loads_what_the_first_stored(
    first_store: tuple[EngineRun, Path], reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """External hits, exact tokens, and no load of what vLLM's own prefix cache already holds."""
    moved, store = _second_engine(first_store[1], reference, tiny_model_dir, tmp_path)
    assert moved["stored_blocks"] == SECOND_ENGINE_STORED_BLOCKS and moved["present_blocks"] == 0
    assert len(local_objects(store)) == FIRST_ENGINE_STORED_BLOCKS + SECOND_ENGINE_STORED_BLOCKS


def test_loaded_kv_is_what_the_model_computes_with(
    first_store: tuple[EngineRun, Path], reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Objects whose KV is changed (but still valid objects) load, and change the tokens."""
    store = _copy_store(first_store[1], tmp_path)
    assert corrupt_local_store(store) == FIRST_ENGINE_STORED_BLOCKS
    counters = _folder(tmp_path, "counters")
    transfer = kvflow_transfer_config(f"local://{store}?capacity=256MiB")
    run = run_engine(_spec(tiny_model_dir, ((A, D),), transfer, counters))
    (moved,) = read_counters(counters).values()
    assert moved["loaded_blocks"] == 11 + 8 and moved["load_failed_blocks"] == 0
    assert moved["early_load_steps"] > 0  # the KV the forward used was loaded early
    assert run.cached_tokens == (11 * BLOCK, 8 * BLOCK - 1)
    expected = reference.expected(((A, D),))
    assert run.outputs[0] != expected[0]
    assert run.outputs[1] != expected[1]


def test_a_layerwise_engine_loads_what_a_whole_block_engine_stored(
    first_store: tuple[EngineRun, Path], reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each layer out of the other profile's whole-block objects (docs/topology.md), exact tokens;
    the blocks the layerwise engine computes it stores as its own per-layer objects."""
    _second_engine(first_store[1], reference, tiny_model_dir, tmp_path, layerwise=True)


def test_failed_loads_are_recomputed_with_the_recompute_policy(
    first_store: tuple[EngineRun, Path], reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every get fails after scribbling over its blocks: vLLM recomputes, the tokens stay exact."""
    store = _copy_store(first_store[1], tmp_path)
    counters = _folder(tmp_path, "counters")
    transfer = kvflow_transfer_config(f"failing-local://{store}?capacity=256MiB")
    run = run_engine(_spec(tiny_model_dir, ((A, D),), transfer, counters))
    assert run.outputs == reference.expected(((A, D),))
    (moved,) = read_counters(counters).values()
    assert moved["load_failed_blocks"] == 11 + 8 and moved["loaded_blocks"] == 0


# -- one engine, vLLM's prefix cache off: every mode -------------------------------------------------


def test_layerwise_mode_stores_and_loads_layer_by_layer(
    reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Through host staging (as a GPU cache over a host store moves), forced on the CPU cache."""
    run, counters, store = _one_engine_run(
        tiny_model_dir, tmp_path, extra={"layerwise": True, "staging": "always", "staging_bytes": "1MiB"}
    )
    _assert_one_engine(run, counters, reference)
    (moved,) = counters.values()
    assert moved["stored_blocks"] == ONE_ENGINE_STORED_BLOCKS
    assert len(local_objects(store)) == ONE_ENGINE_STORED_BLOCKS * 2  # one object per block and layer


def test_async_load_mode(reference: Reference, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Also: between the batches vLLM resets its prefix cache (the connector holds no block of a
    finished request, so the reset succeeds at once) and sleeps and wakes (which resets the
    connector's cache too); the second batch still loads everything and its tokens stay exact."""
    run, counters, store = _one_engine_run(
        tiny_model_dir, tmp_path, extra={"load_async": True}, between_batches=("reset", "sleep")
    )
    _assert_one_engine(run, counters, reference)
    assert len(local_objects(store)) == ONE_ENGINE_STORED_BLOCKS
    assert run.timings["between"] == [{"reset": True, "slept": True}]


@pytest.mark.slow
def test_multiprocess_mode(reference: Reference, tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's default: the scheduler in the engine-core process, the worker in its own; a prefix
    cache reset and a sleep between the batches work there too."""
    run, counters, store = _one_engine_run(
        tiny_model_dir, tmp_path, multiprocessing=True, between_batches=("reset", "sleep")
    )
    _assert_one_engine(run, counters, reference)
    assert run.timings["between"] == [{"reset": True, "slept": True}]
    assert counters[0]["stored_blocks"] == ONE_ENGINE_STORED_BLOCKS
    assert counters[0]["early_load_steps"] > 0  # (handed the step in the worker's own process)
    assert len(local_objects(store)) == ONE_ENGINE_STORED_BLOCKS


@pytest.mark.mooncake
def test_mooncake_backend(
    reference: Reference, tiny_model_dir: Path, tmp_path: Path, mooncake_master: Any
) -> None:
    """The same through a Mooncake master (the worker's client lends the memory; the scheduler's
    lookups use a client that lends none)."""
    extra = {"lookup_backend": mooncake_master.url(segment=0)}
    run, counters, _ = _one_engine_run(
        tiny_model_dir, tmp_path, backend=mooncake_master.url(segment="64MiB"), extra=extra
    )
    _assert_one_engine(run, counters, reference)
    (moved,) = counters.values()
    assert moved["stored_blocks"] == ONE_ENGINE_STORED_BLOCKS


@pytest.mark.slow
def test_tensor_parallel_replicas_store_each_block_once_and_both_load_everything(
    reference_kv1: Reference, tiny_model_dir_kv1: Path, tmp_path: Path
) -> None:
    """TP=2 with one KV head: both ranks hold the same KV. Each block is stored by its owner only
    (block i by rank i % 2), and each rank loads every block; whole blocks through host staging
    (forced on the CPU caches, as for GPU caches over a host store)."""
    run, counters, store = _one_engine_run(
        tiny_model_dir_kv1,
        tmp_path,
        multiprocessing=True,
        tensor_parallel_size=2,
        extra={"staging": "always", "staging_bytes": "1MiB"},
    )
    _assert_one_engine(run, counters, reference_kv1)
    assert sorted(counters) == [0, 1]
    for rank in (0, 1):
        assert counters[rank]["stored_blocks"] == owned_by(rank, 2), rank
        assert counters[rank]["not_owned_blocks"] == ONE_ENGINE_STORED_BLOCKS - owned_by(rank, 2), rank
        assert counters[rank]["present_blocks"] == 0, rank
    assert len(local_objects(store)) == ONE_ENGINE_STORED_BLOCKS


def _prompt_only_tp2(
    model: Path, tmp_path: Path, backend: str, env: Mapping[str, str] | None = None
) -> tuple[EngineRun, Mapping[int, Mapping[str, int]], Path]:
    """TP=2 in worker processes, one token per request, vLLM's prefix cache off: E_HEAD, then E
    (which loads E_HEAD's blocks 0-3 and computes its blocks 4-11 in that step, and finishes
    there), then E again (which loads what is stored of it)."""
    store = tmp_path / "store"
    counters = _folder(tmp_path, "counters")
    run = run_engine(
        EngineSpec(
            model,
            PROMPT_ONLY,
            max_tokens=1,
            block_size=BLOCK,
            kv_transfer_config=kvflow_transfer_config(f"{backend}://{store}?capacity=256MiB"),
            env={COUNTERS_ENV: str(counters), **(env or {})},
            enable_prefix_caching=False,
            multiprocessing=True,
            tensor_parallel_size=2,
        )
    )
    moved = read_counters(counters)
    assert sorted(moved) == [0, 1]
    return run, moved, store


PROMPT_ONLY: Batches = ((E_HEAD,), (E,), (E,))


@pytest.mark.slow
def test_tensor_parallel_ranks_store_what_a_prompt_only_request_computed_after_its_load(
    reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The ranks agree, over vLLM's tensor-parallel group, that E's load arrived on both before they
    store, so both store their head's objects of E's blocks 4-11 in the load's step (before, they
    were held for the scheduler's verdict a step later, and lost). The third batch loads all of E."""
    run, moved, store = _prompt_only_tp2(tiny_model_dir, tmp_path, "local")
    assert run.outputs == tuple(tokens[:1] for tokens in reference.expected(PROMPT_ONLY))
    assert run.cached_tokens == (0, 4 * BLOCK, 12 * BLOCK)
    for rank, counts in moved.items():
        assert counts["stored_blocks"] == 5 + 8 and counts["dropped_save_blocks"] == 0, rank
        assert counts["loaded_blocks"] == 4 + 12 and counts["load_failed_blocks"] == 0, rank
    assert len(local_objects(store)) == 2 * (5 + 8)  # each rank's own head


@pytest.mark.slow
def test_tensor_parallel_ranks_store_nothing_computed_from_a_load_that_failed_on_one_of_them(
    reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As above, but rank 0's load of E fails (junk in its blocks) while rank 1's arrives. Rank 1's
    KV of E's new blocks is wrong too (computed from rank 0's junk through the all-reduced attention
    output): told by rank 0, it drops them as rank 0 does, and vLLM's recompute stores them. No
    stored object holds junk or a value that is not finite, and the tokens are the reference's."""
    failed = tmp_path / "failed-once"
    env = {FAIL_MATCHING_ENV: "@h0-1@", FAIL_ONCE_FLAG_ENV: str(failed)}  # rank 0's KV head
    run, moved, store = _prompt_only_tp2(tiny_model_dir, tmp_path, "failonce-local", env)
    assert failed.exists()
    assert run.outputs == tuple(tokens[:1] for tokens in reference.expected(PROMPT_ONLY))
    assert moved[0]["load_failed_blocks"] == 4 and moved[1]["load_failed_blocks"] == 0
    for rank, counts in moved.items():
        assert counts["dropped_save_blocks"] == 8, rank  # E's blocks 4-11, computed from the junk
        assert counts["stored_blocks"] == 5 + 8, rank  # E_HEAD's, then E's 4-11 after the recompute
    objects = local_objects(store)
    assert len(objects) == 2 * (5 + 8)
    for path in objects:
        data = path.read_bytes()
        payload = np.frombuffer(data, np.float32, Header.unpack(data).payload_len // 4, HEADER_SIZE)
        assert np.isfinite(payload).all() and not (payload.view(np.uint32) == 0x7F7F7F7F).any(), path.name


@pytest.mark.slow
def test_engines_of_other_tensor_parallel_sizes_load_each_others_kv(
    first_store: tuple[EngineRun, Path], reference: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two KV heads: at TP=1 one object per block holds both, at TP=2 each rank stores its own head.

    A TP=2 engine loads what the TP=1 engine stored (each rank takes its head out of the TP=1
    objects) and stores its new blocks as per-head objects; then a TP=1 engine loads prompts whose
    first blocks the TP=1 engine stored and whose last ones only the TP=2 engine did (assembling
    its two heads from two objects). Tokens are the reference's throughout."""
    store = _copy_store(first_store[1], tmp_path)
    transfer = kvflow_transfer_config(f"local://{store}?capacity=256MiB")
    counters = _folder(tmp_path, "counters-tp2")
    run = run_engine(
        _spec(tiny_model_dir, SECOND_ENGINE, transfer, counters, multiprocessing=True, tensor_parallel_size=2)
    )
    assert run.outputs == reference.expected(SECOND_ENGINE)
    assert run.cached_tokens == SECOND_ENGINE_CACHED
    moved = read_counters(counters)
    assert sorted(moved) == [0, 1]
    for rank, counts in moved.items():
        assert counts["loaded_blocks"] == SECOND_ENGINE_LOADED_BLOCKS and counts["load_failed_blocks"] == 0, (
            rank
        )
        assert counts["stored_blocks"] == SECOND_ENGINE_STORED_BLOCKS, rank  # its own head's objects
    assert len(local_objects(store)) == FIRST_ENGINE_STORED_BLOCKS + 2 * SECOND_ENGINE_STORED_BLOCKS

    # B's blocks 10-11 and E_HEAD's block 4 exist only as the TP=2 engine's per-head objects.
    batches = ((B, E_HEAD),)
    counters = _folder(tmp_path, "counters-tp1")
    run = run_engine(_spec(tiny_model_dir, batches, transfer, counters))
    assert run.outputs == reference.expected(batches)
    assert run.cached_tokens == (12 * BLOCK, 5 * BLOCK)
    (counts,) = read_counters(counters).values()
    assert counts["loaded_blocks"] == 12 + 5 and counts["load_failed_blocks"] == 0
    assert counts["stored_blocks"] == 0  # everything was there, in one split or the other
