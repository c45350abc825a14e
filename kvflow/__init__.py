"""kvflow: move LLM KV-cache blocks between an engine's paged KV cache and a KV pool.

The public API is the names below. They load on first use, so ``import kvflow`` (and the ``kvflow``
command) costs nothing until a name is needed; the core never imports vLLM, Mooncake or torch_npu.
Everything else is reachable as a module: :mod:`kvflow.keys` (hashes and keys),
:mod:`kvflow.ownership` (who stores which block), :mod:`kvflow.events` (device events),
:mod:`kvflow.layerwise` (the async layer-by-layer storer and retriever), :mod:`kvflow.transfer`
(the layer under every face).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # faces
    "KVPool": "kvflow.pool",
    "SyncPool": "kvflow.sync",
    "SyncLayerwisePool": "kvflow.sync_layerwise",
    # values
    "KVRequest": "kvflow.request",
    "PoolConfig": "kvflow.config",
    "ParallelConfig": "kvflow.ownership",
    "KVLayout": "kvflow.layout",
    "KVFormat": "kvflow.layout",
    # results
    "StoreResult": "kvflow.results",
    "RetrieveResult": "kvflow.results",
    "PutStatus": "kvflow.backends.base",
    "GetStatus": "kvflow.backends.base",
    # backends
    "Backend": "kvflow.backends.base",
    "open_backend": "kvflow.backends",
    "MemoryBackend": "kvflow.backends.memory",
    "LocalBackend": "kvflow.backends.local",
    "MooncakeBackend": "kvflow.backends.mooncake",
    # errors
    "KVFlowError": "kvflow.errors",
    "ConfigError": "kvflow.errors",
    "LayoutError": "kvflow.errors",
    "RequestError": "kvflow.errors",
    "PoolClosedError": "kvflow.errors",
    "BackendError": "kvflow.errors",
    "BackendUnavailableError": "kvflow.errors",
    "MissingDependencyError": "kvflow.errors",
}

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "ConfigError",
    "GetStatus",
    "KVFlowError",
    "KVFormat",
    "KVLayout",
    "KVPool",
    "KVRequest",
    "LayoutError",
    "LocalBackend",
    "MemoryBackend",
    "MissingDependencyError",
    "MooncakeBackend",
    "ParallelConfig",
    "PoolClosedError",
    "PoolConfig",
    "PutStatus",
    "RequestError",
    "RetrieveResult",
    "StoreResult",
    "SyncLayerwisePool",
    "SyncPool",
    "open_backend",
]

if TYPE_CHECKING:
    from kvflow.backends import open_backend
    from kvflow.backends.base import Backend, GetStatus, PutStatus
    from kvflow.backends.local import LocalBackend
    from kvflow.backends.memory import MemoryBackend
    from kvflow.backends.mooncake import MooncakeBackend
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
    from kvflow.layout import KVFormat, KVLayout
    from kvflow.ownership import ParallelConfig
    from kvflow.pool import KVPool
    from kvflow.request import KVRequest
    from kvflow.results import RetrieveResult, StoreResult
    from kvflow.sync import SyncPool
    from kvflow.sync_layerwise import SyncLayerwisePool


# modules reachable as attributes (``kvflow.keys.hash_blocks``) without importing them first
_MODULES = frozenset(
    {"backends", "config", "errors", "events", "keys", "layerwise", "layout", "ownership", "transfer"}
)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"kvflow.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_MODULES])
