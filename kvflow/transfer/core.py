"""The transfer layer: the one place that turns requests into backend calls.

A :class:`Transfer` owns a backend, the pool's byte budget, the registered layout (or, for a pool
that only looks up, its :class:`~kvflow.layout.KVFormat`) and the count of calls in flight. It
provides each stage once:

- keys: a request's block hashes in a :class:`~kvflow.keys.KeyScope` (this rank's namespace, or
  every namespace a lookup needs), one object per block (whole-block pools) or per block and layer
  (layerwise pools: a *unit* is a layer index; ``None`` is the whole block);
- ownership: which blocks this rank stores (:func:`kvflow.ownership.owner`);
- the exists-skip: keys already present are not put again;
- addresses: an engine block of a unit as a scatter-gather :class:`~kvflow.backends.ObjectRef`;
- batched put/get within the budget, with one result per object and a deadline;
- staging through host buffers (:mod:`kvflow.transfer.staging`) when the backend cannot reach the
  cache's memory (a GPU or NPU cache over a TCP store), or when asked to (``staging="always"``).

The faces (:class:`kvflow.KVPool`, the layerwise storer and retriever, and through them the
synchronous faces) are thin: they build a :class:`~kvflow.transfer.jobs.StoreJob` or
:class:`~kvflow.transfer.jobs.LoadJob` and decide when each unit moves. Use a transfer from one
event loop. Deadlines are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import anyio
import attrs

from kvflow.backends.base import Backend, GetStatus, ObjectRef, PutStatus
from kvflow.config import PoolConfig
from kvflow.device import Device
from kvflow.errors import ConfigError, LayoutError, PoolClosedError, RequestError
from kvflow.keys import KeyScope, block_keys, layer_keys
from kvflow.layout import KVFormat, KVLayout
from kvflow.ownership import ParallelConfig
from kvflow.request import KVRequest
from kvflow.transfer.batches import is_programming_error, run_batches
from kvflow.transfer.budget import ByteBudget
from kvflow.transfer.plan import BlockPlan, request_hashes
from kvflow.transfer.staging import StagingPool, UnitShape

__all__ = ["Transfer", "Unit"]

log = logging.getLogger(__name__)

#: What one object holds of a block: a layer index (layerwise pools) or ``None``, every layer.
Unit = int | None


@attrs.define(eq=False)
class Transfer:
    """Requests to backend calls for one pool. Build with :meth:`open`; call from one event loop."""

    backend: Backend
    config: PoolConfig
    format: KVFormat
    parallel: ParallelConfig
    layout: KVLayout | None
    #: host staging, when blocks move through host buffers (None: the backend reads and writes
    #: the cache's memory itself)
    staging: StagingPool | None = None
    _shapes: dict[Unit, UnitShape] = attrs.field(factory=dict, init=False)
    _budget: ByteBudget = attrs.field(init=False)
    _inflight: int = attrs.field(default=0, init=False)
    _idle: anyio.Event | None = attrs.field(default=None, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self._budget = ByteBudget(self.config.max_inflight_bytes)

    @classmethod
    def open(
        cls,
        config: PoolConfig,
        *,
        backend: Backend,
        parallel: ParallelConfig,
        layout: KVLayout | None = None,
        format: KVFormat | None = None,
        device: Device | None = None,
    ) -> Transfer:
        """Check the layout against the backend, choose direct or staged transfers, and register
        the memory the backend will read and write (the cache's, or the staging buffers).

        A pool that only looks up passes ``format`` instead of ``layout``. ``device`` replaces the
        shim of the cache's device (tests use one whose events complete late).
        """
        if layout is None:
            if format is None:
                raise ConfigError(
                    "a pool needs the KV caches' layout (to store and retrieve) or their KVFormat "
                    "(to look up only, as an engine's scheduler does)"
                )
            return cls(backend, config, format, parallel, None)
        if format is not None and format != layout.format:
            raise ConfigError(f"format {format} disagrees with the layout's {layout.format}; pass one")
        unreachable = layout.device.type != "cpu" and not backend.capabilities.device_memory
        if unreachable and config.staging == "never":
            raise LayoutError(
                f"the KV caches are on {layout.device}, which this backend cannot read or write, and "
                "PoolConfig(staging='never') forbids staging them through host memory: set "
                "staging='auto', or use a backend whose transport moves device memory (docs/device.md)"
            )
        staging = None
        if config.staging == "always" or unreachable:
            device = device or Device.of(layout.device)
            units: list[int | None] = list(range(layout.num_layers)) if config.layerwise else [None]
            largest = max(sum(layout.plane_views[p].size(1) for p in layout.unit_planes(u)) for u in units)
            staging = StagingPool.create(device, config.staging_bytes, largest)
            for chunk in staging.buffers():
                backend.register_memory(chunk.data_ptr(), chunk.numel())
        else:
            for addr, nbytes in layout.allocations():
                backend.register_memory(addr, nbytes)
        return cls(backend, config, layout.format, parallel, layout, staging)

    # -- lifetime -------------------------------------------------------------------------------

    def begin(self) -> None:
        """Count a call in flight (``aclose`` waits for it); pair with :meth:`end`."""
        if self._closed:
            raise PoolClosedError("this pool was closed; create a new one")
        self._inflight += 1

    def end(self) -> None:
        """The call counted by :meth:`begin` finished."""
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Refuse new calls, wait (bounded) for calls in flight, then close the backend (bounded)."""
        if self._closed:
            return
        self._closed = True
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        with anyio.CancelScope(shield=True):
            deadline = time.monotonic() + limit
            if self._inflight:
                self._idle = anyio.Event()
                with anyio.move_on_after(limit):
                    await self._idle.wait()
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope:
                await self.backend.aclose()
            if scope.cancelled_caught:
                log.warning("the backend did not close within %.1f s; abandoning it", limit)

    def deadline(self, timeout_s: float | None) -> float:
        """The deadline of a call given its ``timeout_s`` (default: the pool's), from now."""
        return time.monotonic() + (self.config.timeout_s if timeout_s is None else timeout_s)

    # -- keys -----------------------------------------------------------------------------------

    @property
    def units(self) -> tuple[Unit, ...]:
        """The units of one block: every layer (layerwise pools), or the whole block."""
        return tuple(range(self.format.num_layers)) if self.config.layerwise else (None,)

    def scope(
        self,
        kv_head_group: int | None = None,
        pp_rank: int | None = None,
        dcp_rank: int | None = None,
        pcp_rank: int | None = None,
    ) -> KeyScope:
        """This rank's key scope, or that of another namespace of the same model."""
        p = self.parallel
        return KeyScope(
            model=self.config.model,
            fingerprint=self.format.fingerprint,
            kv_head_group=p.kv_head_group if kv_head_group is None else kv_head_group,
            pp_rank=p.pp_rank if pp_rank is None else pp_rank,
            pcp_rank=p.pcp_rank if pcp_rank is None else pcp_rank,
            dcp_rank=p.dcp_rank if dcp_rank is None else dcp_rank,
        )

    def lookup_scopes(self) -> list[KeyScope]:
        """Every namespace the engine's ranks load from: every KV-head group, pipeline stage, and
        decode- and prefill-context shard. A block is usable only when all of them hold it."""
        p = self.parallel
        return [
            self.scope(h, pp, dcp, pcp)
            for h in range(p.num_kv_head_groups)
            for pp in range(p.pp_size)
            for dcp in range(p.dcp_size)
            for pcp in range(p.pcp_size)
        ]

    @staticmethod
    def keys(scope: KeyScope, hashes: Sequence[bytes], unit: Unit) -> list[str]:
        """The key of each hash's object of ``unit`` in ``scope``."""
        return block_keys(scope, hashes) if unit is None else layer_keys(scope, hashes, unit)

    # -- addresses ------------------------------------------------------------------------------

    def require_layout(self) -> KVLayout:
        """The registered layout; ConfigError for a pool that only looks up."""
        if self.layout is None:
            raise ConfigError("this pool has no registered KV caches; create it with a layout")
        return self.layout

    def plan(self, requests: Sequence[KVRequest]) -> BlockPlan:
        """Validate requests against the cache; RequestError before anything moves."""
        return BlockPlan.build(requests, self.format, self.require_layout().num_blocks)

    def objects(self, keys: Sequence[str], block_ids: Sequence[int], unit: Unit) -> list[ObjectRef]:
        """``keys[i]`` holds ``unit`` of engine block ``block_ids[i]``."""
        layout = self.require_layout()
        if unit is None:
            sizes, nbytes, addrs = layout.block_sizes, layout.block_nbytes, layout.block_addrs
            return [ObjectRef(k, addrs(b), sizes, nbytes) for k, b in zip(keys, block_ids)]
        regions = layout.layer_regions
        sizes = regions(0, unit)[1]
        nbytes = sum(sizes)
        return [ObjectRef(k, regions(b, unit)[0], sizes, nbytes) for k, b in zip(keys, block_ids)]

    def shape(self, unit: Unit) -> UnitShape:
        """How ``unit``'s objects lie in a staging chunk (staged transfers only)."""
        shape = self._shapes.get(unit)
        if shape is None:
            assert self.staging is not None
            shape = self._shapes[unit] = UnitShape.of(self.require_layout(), unit, self.staging.chunk_bytes)
        return shape

    def load_order(self, count: int) -> list[int]:
        """Indices ``0..count-1`` rotated by rank, so that the members of a replica group do not
        all read the same object first."""
        shift = self.parallel.tp_rank % count if count else 0
        return list(range(shift, count)) + list(range(shift))

    # -- backend calls --------------------------------------------------------------------------

    async def put(self, objects: Sequence[ObjectRef], deadline: float) -> list[PutStatus]:
        """Put in backend-sized batches within the byte budget; one status per object."""
        return await run_batches(
            objects,
            self.backend.put,
            failed=PutStatus.FAILED,
            max_batch=self.backend.max_batch,
            budget=self._budget,
            deadline=deadline,
        )

    async def get(self, objects: Sequence[ObjectRef], deadline: float) -> list[GetStatus]:
        """Get in backend-sized batches within the byte budget; one status per object."""
        return await run_batches(
            objects,
            self.backend.get,
            failed=GetStatus.FAILED,
            max_batch=self.backend.max_batch,
            budget=self._budget,
            deadline=deadline,
        )

    async def exists(self, keys: Sequence[str], deadline: float) -> list[bool] | None:
        """The backend's answer per key, or None (logged) if it failed or ran past the deadline."""
        if not keys:
            return []
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                found = await self.backend.exists(keys)
        except Exception as exc:  # a fault of the store means "unknown", never a crash
            if is_programming_error(exc):
                raise  # a misconfigured backend must not look like an empty cache forever
            log.warning("exists() of %d keys failed: %r", len(keys), exc)
            return None
        if len(found) != len(keys):
            log.warning("exists() returned %d answers for %d keys", len(found), len(keys))
            return None
        return found

    async def remove(self, request: KVRequest, deadline: float) -> int:
        """Delete this rank's objects of the prompt's blocks from ``block_offset`` on (every unit);
        return how many existed. Raises BackendError when the store cannot be reached."""
        hashes = request_hashes(request, self.format.block_size)[request.block_offset :]
        keys = [k for u in self.units for k in self.keys(self.scope(), hashes, u)]
        if not keys:
            return 0
        with anyio.fail_after(max(0.0, deadline - time.monotonic())):
            return sum(await self.backend.remove(keys))

    # -- lookup ---------------------------------------------------------------------------------

    async def lookup(self, request: KVRequest, deadline: float) -> int:
        """Leading tokens of the prompt that every namespace holds (blocks before the request's
        ``block_offset`` count as held); stops at the offset when the backend fails."""
        hashes = request_hashes(request, self.format.block_size)
        offset = request.block_offset
        if offset > len(hashes):
            raise RequestError(f"block_offset={offset} is past the prompt's {len(hashes)} full blocks")
        held = offset * self.format.block_size
        rest = hashes[offset:]
        if not rest:
            return held
        namespaces = [self.keys(s, rest, u) for s in self.lookup_scopes() for u in self.units]
        found = await self.exists([k for keys in namespaces for k in keys], deadline)
        if found is None:
            return held  # the engine recomputes the rest; the failure was logged
        n = hits = len(rest)
        for i in range(len(namespaces)):
            part = found[i * n : (i + 1) * n]
            hits = min(hits, part.index(False) if False in part else n)
        return held + hits * self.format.block_size
