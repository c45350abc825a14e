"""The seam between the connector and kvflow's core: the pools each side opens, and how it calls them.

The scheduler side only looks up; a worker stores and retrieves. Both are synchronous callers
(vLLM's scheduler and model-runner threads), so they use a :class:`kvflow.SyncPool`, whose event loop
runs in kvflow's one loop thread, and get ``concurrent.futures.Future`` objects back. A layerwise
worker wraps its pool in :class:`kvflow.LayerwiseEngine`, the synchronous layer-by-layer face.

Every call here returns at once. A pool applies its own timeout to each call and then resolves the
future with a result (never an exception for a store fault); callers wait on futures with that
timeout plus :data:`WAIT_MARGIN_S` and treat a future still running after it as failed.
"""

from __future__ import annotations

import concurrent.futures
import functools

from kvflow.engine import LayerwiseEngine
from kvflow.events import DeviceEvent, wait_event
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.metadata import BlockSpan, KVFlowHandshake
from kvflow.integrations.vllm.topology import EngineShape
from kvflow.layerwise import LayerwiseRequest
from kvflow.layout import KVLayout
from kvflow.pool import KVPool
from kvflow.results import RetrieveResult, StoreResult
from kvflow.runtime import LoopThread, SyncPool

__all__ = [
    "WAIT_MARGIN_S",
    "layerwise_request",
    "open_layerwise_engine",
    "open_lookup_pool",
    "open_worker_pool",
    "submit_lookup",
    "submit_retrieve",
    "submit_store",
]

#: Added to a pool's own timeout when waiting on its future: the pool answers by then.
WAIT_MARGIN_S = 5.0


def open_lookup_pool(config: ConnectorConfig, shape: EngineShape, handshake: KVFlowHandshake) -> SyncPool:
    """A lookup-only pool for the scheduler side: no KV caches, the workers' fingerprint."""
    pool_config = config.lookup_pool_config(shape.model)
    loop = LoopThread(name="kvflow-lookup").start()

    async def make() -> KVPool:
        return KVPool.create(
            pool_config,
            parallel=shape.parallel(),
            fingerprint=handshake.fingerprint,
            block_size=handshake.block_size,
            num_layers=handshake.num_layers,
        )

    try:
        pool = loop.call(make, timeout_s=pool_config.timeout_s + WAIT_MARGIN_S)
    except BaseException:
        loop.stop()
        raise
    return SyncPool(loop, pool)


def open_worker_pool(
    config: ConnectorConfig, shape: EngineShape, layout: KVLayout, tp_rank: int, pp_rank: int
) -> SyncPool:
    """A pool over this worker's registered KV caches."""
    return SyncPool.open(
        config.pool_config(shape.model), layout=layout, parallel=shape.parallel(tp_rank, pp_rank)
    )


def open_layerwise_engine(
    config: ConnectorConfig, shape: EngineShape, layout: KVLayout, tp_rank: int, pp_rank: int
) -> LayerwiseEngine:
    """A layerwise pool over this worker's KV caches, behind the synchronous layer-by-layer face."""
    return LayerwiseEngine.open(
        config.pool_config(shape.model),
        layout=layout,
        parallel=shape.parallel(tp_rank, pp_rank),
        depth=config.layerwise_depth,
    )


def submit_lookup(
    pool: SyncPool, block_hashes: tuple[bytes, ...], block_offset: int
) -> concurrent.futures.Future[int]:
    """Start a lookup of a request's hashes; blocks before ``block_offset`` count as present."""
    call = functools.partial(pool.pool.lookup, block_hashes=block_hashes, block_offset=block_offset)
    return pool.loop.submit(call)


def submit_store(
    pool: SyncPool, span: BlockSpan, written: DeviceEvent | None = None
) -> concurrent.futures.Future[StoreResult]:
    """Start storing the span's blocks that this rank owns; after ``written`` fired, when given
    (recorded on the engine's stream after the forward, so no store reads KV still being computed)."""
    if written is None:
        return pool.submit_store(
            span.block_ids, block_hashes=span.block_hashes, block_offset=span.first_block
        )
    event = written
    kv_pool = pool.pool

    async def store_once_written() -> StoreResult:
        await wait_event(event, kv_pool.config.timeout_s)
        return await kv_pool.store(
            block_ids=span.block_ids, block_hashes=span.block_hashes, block_offset=span.first_block
        )

    return pool.loop.submit(store_once_written)


def submit_retrieve(pool: SyncPool, span: BlockSpan) -> concurrent.futures.Future[RetrieveResult]:
    """Start loading the span's blocks into the KV cache."""
    return pool.submit_retrieve(span.block_ids, block_hashes=span.block_hashes, block_offset=span.first_block)


def layerwise_request(span: BlockSpan) -> LayerwiseRequest:
    """The span as a request of the layerwise face."""
    return LayerwiseRequest(
        span.req_id, span.block_ids, block_hashes=span.block_hashes, block_offset=span.first_block
    )
