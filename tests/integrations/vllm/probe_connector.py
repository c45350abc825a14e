"""A do-nothing vLLM KV connector that records every call it receives, for tests and API surveys.

Load it with ``kv_connector="ProbeConnector",
kv_connector_module_path="tests.integrations.vllm.probe_connector"`` (the repository root on
``PYTHONPATH``); ``kv_connector_extra_config={"probe_log": "/path/log.jsonl"}`` names the
file each call is appended to as one JSON object (role, pid, method, arguments summarised).
It never loads or stores anything: ``get_num_new_matched_tokens`` always answers ``(0, False)``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class ProbeMetadata(KVConnectorMetadata):
    def __init__(self, step: int) -> None:
        self.step = step


class ProbeHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side once, at engine start (after register_kv_caches)."""

    def __init__(self, pid: int, tp_rank: int, storage_ptr: int) -> None:
        self.pid = pid
        self.tp_rank = tp_rank
        self.storage_ptr = storage_ptr


def _tensor_info(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "data_ptr": t.data_ptr(),
        "storage_ptr": t.untyped_storage().data_ptr(),
        "storage_nbytes": t.untyped_storage().nbytes(),
        "contiguous": t.is_contiguous(),
    }


class ProbeConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._path = str(self._kv_transfer_config.get_from_extra_config("probe_log", ""))
        self._step = 0
        self._storage_ptr = 0
        groups = []
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            groups.append(
                {
                    "layer_names": list(group.layer_names),
                    "spec_type": type(spec).__name__,
                    "block_size": spec.block_size,
                    "num_kv_heads": getattr(spec, "num_kv_heads", None),
                    "head_size": getattr(spec, "head_size", None),
                    "dtype": str(getattr(spec, "dtype", None)),
                    "page_size_bytes": spec.page_size_bytes,
                }
            )
        rank_info: dict[str, Any] = {}
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            rank_info = {
                "worker_tp_rank": get_tensor_model_parallel_rank(),
                "worker_tp_size": get_tensor_model_parallel_world_size(),
            }
        pc = vllm_config.parallel_config
        mc = vllm_config.model_config
        self._log(
            "__init__",
            num_blocks=kv_cache_config.num_blocks,
            groups=groups,
            tensors=[
                {
                    "size": t.size,
                    "layers": list(t.layers),
                    "layer_stride": t.layer_stride,
                    "block_stride": t.block_stride,
                    "offset": t.offset,
                }
                for t in kv_cache_config.kv_cache_tensors
            ],
            kv_cache_layout=kv_cache_config.kv_cache_layout,
            hash_block_size=kv_cache_config.hash_block_size,
            kv_tp_replicas=kv_cache_config.kv_tp_replicas,
            cache_block_size=vllm_config.cache_config.block_size,
            tp_size=pc.tensor_parallel_size,
            pp_size=pc.pipeline_parallel_size,
            dcp_size=pc.decode_context_parallel_size,
            pcp_size=pc.prefill_context_parallel_size,
            parallel_rank=pc.rank,
            model=mc.model,
            served_model_name=str(mc.served_model_name),
            use_mla=mc.use_mla,
            total_num_kv_heads=mc.get_total_num_kv_heads(),
            num_kv_heads_per_rank=mc.get_num_kv_heads(pc),
            head_size=mc.get_head_size(),
            num_layers=mc.get_num_layers(pc),
            model_dtype=str(mc.dtype),
            cache_dtype=str(vllm_config.cache_config.cache_dtype),
            prefix_caching_hash_algo=str(vllm_config.cache_config.prefix_caching_hash_algo),
            async_scheduling=vllm_config.scheduler_config.async_scheduling,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            **rank_info,
        )

    def _log(self, method: str, **fields: Any) -> None:
        if not self._path:
            return
        record = {"role": self._role.name, "pid": os.getpid(), "method": method, **fields}
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        info: dict[str, Any] = {}
        for name, kv in kv_caches.items():
            if isinstance(kv, torch.Tensor):
                info[name] = _tensor_info(kv)
            else:
                info[name] = [_tensor_info(t) for t in kv]
        first = next(iter(kv_caches.values()))
        if isinstance(first, torch.Tensor):
            self._storage_ptr = first.untyped_storage().data_ptr()
        self._log("register_kv_caches", caches=info)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._log("get_handshake_metadata")
        return ProbeHandshake(os.getpid(), get_tensor_model_parallel_rank(), self._storage_ptr)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._log("handle_preemptions", step=getattr(kv_connector_metadata, "step", None))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._log("bind_connector_metadata", step=getattr(connector_metadata, "step", None))
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._log("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        attn = forward_context.attn_metadata
        self._log("start_load_kv", attn_metadata=type(attn).__name__)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log("wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._log(
            "save_kv_layer",
            layer_name=layer_name,
            kv_layer=_tensor_info(kv_layer),
            attn_metadata=type(attn_metadata).__name__,
        )

    def wait_for_save(self) -> None:
        self._log("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._log("get_finished", finished_req_ids=sorted(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._log("get_block_ids_with_load_errors")
        return set()

    def shutdown(self) -> None:
        self._log("shutdown")

    # ---- scheduler side ----
    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._log(
            "set_xfer_handshake_metadata_pp_aware",
            metadata={f"{pp},{tp}": vars(meta) for (pp, tp), meta in metadata.items()},
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._log(
            "get_num_new_matched_tokens",
            req_id=request.request_id,
            num_computed_tokens=num_computed_tokens,
            num_tokens=request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_block_hashes=len(request.block_hashes),
            block_hash_types=sorted({type(h).__name__ for h in request.block_hashes}),
            block_hash_lens=sorted({len(h) for h in request.block_hashes}),
            first_block_hash=request.block_hashes[0].hex() if request.block_hashes else None,
            request_num_computed_tokens=request.num_computed_tokens,
            num_preemptions=request.num_preemptions,
        )
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._log(
            "update_state_after_alloc",
            req_id=request.request_id,
            block_ids=[list(g) for g in blocks.get_block_ids()],
            num_external_tokens=num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        cached = scheduler_output.scheduled_cached_reqs
        self._log(
            "build_connector_meta",
            step=self._step,
            new_reqs=[
                {
                    "req_id": r.req_id,
                    "block_ids": [list(g) for g in r.block_ids],
                    "num_computed_tokens": r.num_computed_tokens,
                    "num_prompt_tokens": len(r.prompt_token_ids or []),
                }
                for r in scheduler_output.scheduled_new_reqs
            ],
            cached_reqs={
                "req_ids": list(cached.req_ids),
                "resumed": sorted(cached.resumed_req_ids),
                "new_block_ids": [None if b is None else [list(g) for g in b] for b in cached.new_block_ids],
                "num_computed_tokens": list(cached.num_computed_tokens),
            },
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            finished_req_ids=sorted(scheduler_output.finished_req_ids),
            preempted_req_ids=sorted(scheduler_output.preempted_req_ids or ()),
            has_sync_kv_loads=scheduler_output.has_sync_kv_loads,
        )
        return ProbeMetadata(self._step)

    def update_connector_output(self, connector_output: Any) -> None:
        self._log(
            "update_connector_output",
            finished_sending=sorted(connector_output.finished_sending or ()),
            finished_recving=sorted(connector_output.finished_recving or ()),
            invalid_block_ids=sorted(connector_output.invalid_block_ids),
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._log(
            "request_finished",
            req_id=request.request_id,
            block_ids=list(block_ids),
            num_tokens=request.num_tokens,
            num_block_hashes=len(request.block_hashes),
            status=str(request.status),
        )
        return False, None
