"""The pools each side of the connector opens. Both sides use only kvflow's public faces.

The scheduler side only looks up; a worker stores and retrieves. Both are synchronous callers
(vLLM's scheduler and model-runner threads), so they use a :class:`kvflow.SyncPool`, whose event loop
runs in kvflow's one loop thread, and get :class:`~kvflow.loop.CallFuture` objects back. A layerwise
worker uses :class:`kvflow.SyncLayerwisePool`, the synchronous layer-by-layer face.

Each side opens its store's backend itself (:func:`open_store`) and hands it to the pool, which
owns and closes it; the side keeps it only to read whether the store is reachable (:mod:`.health`).

Every call returns at once. A pool answers each call within its timeout (with failed blocks or no
hit when the store misbehaves); a future still running at its ``answer_by`` is a loop thread held
up, which callers log and treat by the rule of each call (a load keeps its blocks until it ends).
"""

from __future__ import annotations

from kvflow.backends import Backend, open_backend
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.metadata import KVFlowHandshake
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.layout import KVLayout
from kvflow.sync import SyncPool
from kvflow.sync_layerwise import SyncLayerwisePool

__all__ = ["open_layerwise_pool", "open_lookup_pool", "open_store", "open_worker_pool"]


def open_store(url: str) -> Backend:
    """The backend a store URL names, for one pool (which then owns it)."""
    return open_backend(url)


def open_lookup_pool(
    config: ConnectorConfig, shape: EngineShape, handshake: KVFlowHandshake, backend: Backend
) -> SyncPool:
    """A lookup-only pool for the scheduler side: no KV caches, the format the workers reported."""
    return SyncPool.open(
        config.lookup_pool_config(shape.key_model(config.model_id)),
        format=handshake.format,
        parallel=shape.parallel(),
        backend=backend,
    )


def open_worker_pool(
    config: ConnectorConfig,
    shape: EngineShape,
    layout: KVLayout,
    tp_rank: int,
    pp_rank: int,
    backend: Backend,
) -> SyncPool:
    """A pool over this worker's registered KV caches."""
    return SyncPool.open(
        config.pool_config(shape.key_model(config.model_id)),
        layout=layout,
        parallel=shape.parallel(tp_rank, pp_rank),
        backend=backend,
    )


def open_layerwise_pool(
    config: ConnectorConfig,
    shape: EngineShape,
    layout: KVLayout,
    tp_rank: int,
    pp_rank: int,
    backend: Backend,
) -> SyncLayerwisePool:
    """A layerwise pool over this worker's KV caches, behind the synchronous layer-by-layer face."""
    return SyncLayerwisePool.open(
        config.pool_config(shape.key_model(config.model_id)),
        layout=layout,
        parallel=shape.parallel(tp_rank, pp_rank),
        depth=config.layerwise_depth,
        backend=backend,
    )
