"""kvflow: move LLM KV-cache blocks between an engine's paged KV cache and a KV pool.

Core (this package) imports without vLLM, Mooncake or torch_npu.
"""

from kvflow.backends import Backend, BackendStats, GetStatus, ObjectRef, PutStatus, open_backend
from kvflow.backends.memory import MemoryBackend
from kvflow.config import PoolConfig
from kvflow.engine import LayerwiseEngine, StepResult
from kvflow.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    KVFlowError,
    LayoutError,
    MissingDependencyError,
    PoolClosedError,
    RequestError,
)
from kvflow.events import CpuEvent, CudaEvent, DeviceEvent, LayerEvents, NpuEvent, make_event, wait_event
from kvflow.keys import KeyScope, block_keys, decode_key, hash_blocks, layer_keys
from kvflow.layerwise import LayerOutcome, LayerwiseRequest, LayerwiseRetriever, LayerwiseStorer
from kvflow.layout import KVLayout, LayoutKind
from kvflow.ownership import ParallelConfig, owner
from kvflow.pool import KVPool
from kvflow.results import RetrieveResult, StoreResult
from kvflow.runtime import LoopThread, SyncPool

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "BackendStats",
    "BackendUnavailableError",
    "ConfigError",
    "CpuEvent",
    "CudaEvent",
    "DeviceEvent",
    "GetStatus",
    "KVFlowError",
    "KVLayout",
    "KVPool",
    "KeyScope",
    "LayerEvents",
    "LayerOutcome",
    "LayerwiseEngine",
    "LayerwiseRequest",
    "LayerwiseRetriever",
    "LayerwiseStorer",
    "LayoutError",
    "LayoutKind",
    "LoopThread",
    "MemoryBackend",
    "MissingDependencyError",
    "NpuEvent",
    "ObjectRef",
    "ParallelConfig",
    "PoolClosedError",
    "PoolConfig",
    "PutStatus",
    "RequestError",
    "RetrieveResult",
    "StepResult",
    "StoreResult",
    "SyncPool",
    "block_keys",
    "decode_key",
    "hash_blocks",
    "layer_keys",
    "make_event",
    "open_backend",
    "owner",
    "wait_event",
]
