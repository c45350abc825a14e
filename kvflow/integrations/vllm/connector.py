"""``KVFlowConnector``: the class vLLM instantiates, twice (scheduler role and worker role).

It only translates vLLM's calls to the side its role owns (:mod:`.scheduler` or :mod:`.worker`) and
fills in vLLM's return types. Which thread calls what is documented on each side. Besides the
steps it gives vLLM: stats every step (:mod:`.stats`; Prometheus through
:meth:`KVFlowConnector.build_prom_metrics`) and, with KV events on, the blocks it stored
(:mod:`.events`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvflow.errors import ConfigError
from kvflow.integrations.vllm.agreement import ranks_must_agree, tensor_parallel_agreement
from kvflow.integrations.vllm.config import (
    ConnectorConfig,
    KVRole,
    decode_saves_refusal,
    sync_load_warning,
    weak_hash_warning,
)
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata, KVFlowHandshake, KVFlowWorkerMeta
from kvflow.integrations.vllm.scheduler import SchedulerSide
from kvflow.integrations.vllm.stats import KVFlowConnectorStats, KVFlowPromMetrics, TransferCounters
from kvflow.integrations.vllm.topology import describe_engine, worker_ranks
from kvflow.integrations.vllm.worker import WorkerSide
from kvflow.integrations.vllm.wrapping import Wrapping

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVFlowConnector"]

log = logging.getLogger(__name__)


class KVFlowConnector(KVConnectorBase_V1):
    """Prefix KV caching through a kvflow pool. Configure with ``KVTransferConfig(
    kv_connector="KVFlowConnector", kv_connector_module_path="kvflow.integrations.vllm",
    kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={...})``;
    docs/vllm.md lists the extra config keys.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        events = vllm_config.kv_events_config
        async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        config = ConnectorConfig.from_extra_config(
            transfer.kv_connector_extra_config,
            role=KVRole.of(transfer.kv_role),
            kv_events=bool(events is not None and events.enable_kv_cache_events),
            async_scheduling=async_scheduling,
        )
        if config.layerwise and getattr(vllm_config.parallel_config, "use_ubatching", False):
            raise ConfigError(
                "layerwise=true cannot run with vLLM's micro-batching (enable_dbo, or ubatch_size > 1): "
                "each layer then runs once per micro-batch, and a layer's store cannot tell when all of "
                "its blocks are written; set layerwise=false"
            )
        shape = describe_engine(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # How vLLM's metrics label our hits: the local backend lives in host memory.
        local = config.backend.startswith("local:")
        self._cache_hit_source = CacheHitSource.HOST if local else CacheHitSource.EXTERNAL_UNSPECIFIED
        if role == KVConnectorRole.SCHEDULER:
            recompute = transfer.kv_load_failure_policy == "recompute"
            self._scheduler = SchedulerSide(config, shape, recomputes_failures=recompute)
            weak = weak_hash_warning(
                vllm_config.cache_config.prefix_caching_hash_algo,
                seeded=os.environ.get("PYTHONHASHSEED") is not None,
            )
            if weak is not None:
                log.warning(weak)
            refused = decode_saves_refusal(config, async_scheduling=async_scheduling, recompute=recompute)
            if refused is not None:
                raise ConfigError(refused)
            unsafe = sync_load_warning(config, async_scheduling=async_scheduling, recompute=recompute)
            if unsafe is not None:
                log.warning(unsafe)
            if config.role.loads and self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning(
                    "kv_load_failure_policy=%r: a block evicted between lookup and load fails the "
                    "request; set kv_load_failure_policy='recompute' to recompute it instead",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
        else:
            tp_rank, pp_rank = worker_ranks()
            agree = tensor_parallel_agreement() if ranks_must_agree(shape, config.layerwise) else None
            # vLLM's workers build the connector inside set_current_vllm_config(<the engine's
            # config>): it names a wrapper (MultiConnector) our own copy of it does not show.
            current = get_current_vllm_config_or_none()
            wrapping = Wrapping.of(current.kv_transfer_config if current is not None else None, transfer)
            self._worker = WorkerSide(config, shape, tp_rank, pp_rank, agree, wrapping=wrapping)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss, never an error

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layerwise hooks run between layers; a captured full CUDA graph would skip them.
        return extra_config.get("layerwise") is True

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on the worker-side connector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on the scheduler-side connector")
        return self._worker

    def _metadata(self) -> KVFlowConnectorMetadata:
        return _ours(self._get_connector_metadata())

    def counters(self) -> TransferCounters | None:
        """This worker's running totals (None on the scheduler side). Model-runner thread."""
        return None if self._worker is None else self._worker.counters

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_side().handshake()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker_side().handle_preemptions(_ours(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._worker_side().save_kv_layer(layer_name, self._metadata())

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's interval (a worker's transfers, or the scheduler's lookups), every step."""
        side = self._worker if self._worker is not None else self._scheduler
        interval = side.take_interval() if side is not None else None
        return None if interval is None else KVFlowConnectorStats.of(interval)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVFlowConnectorStats.from_data(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """kvflow's ``vllm:kvflow_*`` metrics (docs/operations.md), labelled like vLLM's own."""
        return KVFlowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """The blocks this worker stored since the previous step (KV events on), for vLLM to merge
        across workers and hand to the scheduler side."""
        return self._worker.take_events() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ---------------------------------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        handshakes: dict[tuple[int, int], KVFlowHandshake] = {}
        for ranks, meta in metadata.items():
            if not isinstance(meta, KVFlowHandshake):
                raise ConfigError(f"worker {ranks} sent {type(meta).__name__}, not KVFlowHandshake")
            handshakes[ranks] = meta
        self._scheduler_side().on_handshake(handshakes)

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._scheduler_side().update_connector_output(
            connector_output.finished_recving,
            connector_output.invalid_block_ids,
            connector_output.failed_recving,
            meta.steps if isinstance(meta, KVFlowWorkerMeta) else (),
            connector_output.kv_cache_events,
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored`` events of blocks every worker stored, for vLLM's KV event publisher."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request), None

    def reset_cache(self) -> bool | None:
        return self._scheduler_side().reset_cache()


def _ours(meta: KVConnectorMetadata) -> KVFlowConnectorMetadata:
    if not isinstance(meta, KVFlowConnectorMetadata):
        raise TypeError(f"expected KVFlowConnectorMetadata, got {type(meta).__name__}")
    return meta
