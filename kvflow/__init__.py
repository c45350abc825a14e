"""kvflow: move LLM KV-cache blocks between an engine's paged KV cache and a KV pool.

Core (this package) imports without vLLM, Mooncake or torch_npu.
"""

from kvflow.backends import Backend, BackendStats, GetStatus, ObjectRef, PutStatus, open_backend
from kvflow.backends.memory import MemoryBackend
from kvflow.config import PoolConfig
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
from kvflow.keys import KeyScope, block_keys, decode_key, hash_blocks, layer_keys
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
    "GetStatus",
    "KVFlowError",
    "KVLayout",
    "KVPool",
    "KeyScope",
    "LayoutError",
    "LayoutKind",
    "LoopThread",
    "MemoryBackend",
    "MissingDependencyError",
    "ObjectRef",
    "ParallelConfig",
    "PoolClosedError",
    "PoolConfig",
    "PutStatus",
    "RequestError",
    "RetrieveResult",
    "StoreResult",
    "SyncPool",
    "block_keys",
    "decode_key",
    "hash_blocks",
    "layer_keys",
    "open_backend",
    "owner",
]
