"""vLLM engines described the way the connector sees them, for tests of what keeps engines whose
KV differs apart (tests/integrations/vllm/test_engine_variant.py).

Everything goes through the connector's own code (``describe_engine``, ``open_worker_pool``,
``ConnectorConfig``) and vLLM's own config objects and KV cache allocation, so the keys a test
computes are the keys the connector writes. No weights: vLLM's ``ModelConfig`` reads only
``config.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvflow.integrations.vllm.clients import open_store, open_worker_pool
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.topology import EngineShape, describe_engine
from kvflow.sync import SyncPool

BLOCK = 32
HEADS = 2
HEAD_DIM = 32
LAYERS = 2
NUM_BLOCKS = 8

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# Phi-3 style long-context model (LongRoPE): short factors up to 64 positions, long factors to 256.
PHI3: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": HEADS,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0] * (HEAD_DIM // 2),
        "long_factor": [4.0] * (HEAD_DIM // 2),
    },
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "sliding_window": None,
    "tie_word_embeddings": False,
}


def write_model(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def engine_config(
    model_dir: Path,
    *,
    cache_dtype: str = "auto",
    max_model_len: int = 256,
    served_model_name: str | None = None,
    dtype: str = "float32",
    **model_kwargs: Any,
) -> VllmConfig:
    """The VllmConfig of an engine with the kvflow connector (what describe_engine reads)."""
    transfer = KVTransferConfig(
        kv_connector="KVFlowConnector",
        kv_connector_module_path="kvflow.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={},
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            dtype=dtype,
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            served_model_name=served_model_name,
            **model_kwargs,
        ),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype),  # type: ignore[arg-type]
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def cache_dtype_of(config: VllmConfig) -> torch.dtype:
    """The torch dtype vLLM gives the KV cache tensors of this engine."""
    return kv_cache_dtype_str_to_dtype(config.cache_config.cache_dtype, config.model_config)


def kv_cache_config(config: VllmConfig, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """One full-attention group over every layer, placed the way vLLM places it (layer-compact)."""
    spec = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=config.model_config.get_total_num_kv_heads(),
        head_size=config.model_config.get_head_size(),
        dtype=cache_dtype_of(config),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * len(names), layers=names, layer_stride=page * num_blocks, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def allocate(kv_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """The per-layer caches vLLM's model runner allocates (and registers with the connector)."""
    return allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)


def shape_of(config: VllmConfig, kv_config: KVCacheConfig) -> EngineShape:
    return describe_engine(config, kv_config)


def worker_pool(
    config: VllmConfig, kv_config: KVCacheConfig, caches: dict[str, torch.Tensor], store_url: str
) -> SyncPool:
    """The pool a TP=1 worker's connector opens over ``caches`` (clients.open_worker_pool)."""
    from kvflow.layout import KVLayout

    connector = ConnectorConfig.from_extra_config({"backend": store_url})
    shape = describe_engine(config, kv_config)
    layout = KVLayout.from_kv_caches(caches, block_size=shape.block_size)
    return open_worker_pool(connector, shape, layout, 0, 0, open_store(store_url))


def vllm_block_hashes(tokens: Sequence[int], extra_keys: Sequence[Any] | None = None) -> list[bytes]:
    """vLLM's request.block_hashes for ``tokens`` (sha256, the default), full blocks only."""
    init_none_hash(sha256)
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        extra = tuple(extra_keys) if extra_keys and start == 0 else None
        parent = hash_block_tokens(sha256, parent, tokens[start : start + BLOCK], extra)
        hashes.append(bytes(parent))
    return hashes


def store_url(directory: Path) -> str:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return f"local://{directory}?capacity=64MiB"
