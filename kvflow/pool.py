"""KVPool: the async facade over a backend, a layout and a parallel config.

Each call is a coroutine pipeline on the caller's event loop: hash -> key -> address -> put/get.
Use one pool from one event loop. The pool owns its backend and closes it in :meth:`aclose`.

A pool made with ``PoolConfig(layerwise=True)`` keeps one object per block per layer (layer keys)
instead of one per block: its store and retrieve run the layerwise storer and retriever of
:mod:`kvflow.layerwise` to completion, and its lookup counts a block only when every layer is present.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType

import anyio
import attrs

from kvflow.backends import Backend, GetStatus, ObjectRef, PutStatus, open_backend
from kvflow.config import PoolConfig
from kvflow.errors import ConfigError, LayoutError, PoolClosedError, RequestError
from kvflow.events import LayerEvents
from kvflow.keys import KeyScope, block_keys, layer_keys
from kvflow.layerwise import LayerwiseRequest, LayerwiseRetriever, LayerwiseStorer
from kvflow.layout import KVLayout
from kvflow.ownership import ParallelConfig, owner
from kvflow.pipeline import ByteBudget, is_programming_error, resolve_hashes, run_batches
from kvflow.results import RetrieveResult, StoreResult

__all__ = ["KVPool"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class KVPool:
    """Store, retrieve and look up KV blocks. Call from the event loop that created it.

    Without a layout (``layout=None``) the pool can only look up, as an engine's scheduler does;
    it then needs the ``fingerprint`` and ``block_size`` that the workers' layout has (and, for a
    layerwise pool, ``num_layers``).
    """

    backend: Backend
    parallel: ParallelConfig
    config: PoolConfig
    block_size: int
    fingerprint: str
    layout: KVLayout | None = None
    num_layers: int | None = None
    _budget: ByteBudget = attrs.field(init=False)
    _inflight: int = attrs.field(default=0, init=False)
    _idle: anyio.Event | None = attrs.field(default=None, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self._budget = ByteBudget(self.config.max_inflight_bytes)
        if self.layout is not None:
            self.num_layers = self.layout.num_layers

    @classmethod
    def create(
        cls,
        config: PoolConfig | None = None,
        *,
        layout: KVLayout | None = None,
        parallel: ParallelConfig | None = None,
        backend: Backend | None = None,
        fingerprint: str | None = None,
        block_size: int | None = None,
        num_layers: int | None = None,
    ) -> KVPool:
        """A pool over ``backend`` (or the one ``config.backend`` names), registering ``layout``."""
        config = config or PoolConfig()
        if layout is not None:
            if fingerprint is not None and fingerprint != layout.fingerprint:
                raise ConfigError("fingerprint disagrees with the layout's; pass one or the other")
            if block_size is not None and block_size != layout.block_size:
                raise ConfigError(f"block_size={block_size} but the layout has {layout.block_size}")
            if num_layers is not None and num_layers != layout.num_layers:
                raise ConfigError(f"num_layers={num_layers} but the layout has {layout.num_layers}")
            fingerprint, block_size = layout.fingerprint, layout.block_size
        elif fingerprint is None or block_size is None:
            raise ConfigError("a pool without a layout needs fingerprint and block_size")
        elif config.layerwise and (num_layers is None or num_layers < 1):
            raise ConfigError(
                "a layerwise pool without a layout needs num_layers (the layers of one pp rank's KV "
                "cache), so that its lookup can require every layer of a block"
            )
        backend = backend if backend is not None else open_backend(config.backend)
        if layout is not None:
            if layout.device.type != "cpu" and not getattr(backend, "accepts_device_memory", False):
                raise LayoutError(
                    f"the KV caches are on {layout.device}, but this backend copies host memory only; "
                    "use a backend that registers device memory (mooncake) or stage blocks on the host"
                )
            for addr, nbytes in layout.allocations():
                backend.register_memory(addr, nbytes)
        return cls(backend, parallel or ParallelConfig(), config, block_size, fingerprint, layout, num_layers)

    # -- lifetime -------------------------------------------------------------------------------

    async def __aenter__(self) -> KVPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Refuse new calls, wait (bounded) for calls in flight, then close the backend."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._inflight:
                self._idle = anyio.Event()
                with anyio.move_on_after(timeout_s or self.config.timeout_s):
                    await self._idle.wait()
            await self.backend.aclose()

    def begin_call(self) -> None:
        """Count a call in flight (``aclose`` waits for it); pair with :meth:`end_call`."""
        if self._closed:
            raise PoolClosedError("this pool was closed; create a new KVPool")
        self._inflight += 1

    def end_call(self) -> None:
        """The call counted by :meth:`begin_call` finished."""
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    # -- keys -----------------------------------------------------------------------------------

    def scope(self, head_or_tp_rank: int | None = None, pp_rank: int | None = None) -> KeyScope:
        """The key scope of this rank, or of another KV-head / pp namespace of the same model."""
        p = self.parallel
        return KeyScope(
            model=self.config.model,
            fingerprint=self.fingerprint,
            head_or_tp_rank=p.head_or_tp_rank if head_or_tp_rank is None else head_or_tp_rank,
            pp_rank=p.pp_rank if pp_rank is None else pp_rank,
            pcp_rank=p.pcp_rank,
            dcp_rank=p.dcp_rank,
        )

    def lookup_scopes(self) -> list[KeyScope]:
        """Every namespace an engine of this parallel layout needs: all KV-head ranks x pp ranks."""
        p = self.parallel
        return [self.scope(h, pp) for h in range(p.num_head_ranks) for pp in range(p.pp_size)]

    # -- stages shared with kvflow.layerwise: hashes, objects, batched puts and gets ------------

    def require_layout(self) -> KVLayout:
        """The registered layout; ConfigError for a lookup-only pool."""
        if self.layout is None:
            raise ConfigError("this pool has no registered KV caches; create it with a layout")
        return self.layout

    def request_hashes(
        self,
        block_ids: Sequence[int],
        tokens: Sequence[int] | None,
        block_hashes: Sequence[bytes] | None,
        block_offset: int,
    ) -> list[bytes]:
        """The hashes of blocks ``block_offset ..`` that ``block_ids`` hold, after validating both."""
        layout = self.require_layout()
        hashes = resolve_hashes(self.block_size, tokens, block_hashes)
        if block_offset < 0 or block_offset + len(block_ids) > len(hashes):
            raise RequestError(
                f"blocks {block_offset}..{block_offset + len(block_ids) - 1} requested, but the "
                f"request has {len(hashes)} full blocks"
            )
        layout.check_block_ids(block_ids)
        return hashes[block_offset : block_offset + len(block_ids)]

    def block_objects(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[ObjectRef]:
        """Whole-block objects: ``keys[i]`` holds every layer of block ``block_ids[i]``."""
        layout = self.require_layout()
        sizes, nbytes = layout.block_sizes, layout.block_nbytes
        addrs = layout.block_addrs
        return [ObjectRef(k, addrs(b), sizes, nbytes) for k, b in zip(keys, block_ids)]

    def layer_objects(self, keys: Sequence[str], block_ids: Sequence[int], layer: int) -> list[ObjectRef]:
        """Per-layer objects: ``keys[i]`` holds layer ``layer`` of block ``block_ids[i]``."""
        layout = self.require_layout()
        sizes = layout.layer_regions(0, layer)[1]
        nbytes = sum(sizes)
        return [
            ObjectRef(k, layout.layer_regions(b, layer)[0], sizes, nbytes) for k, b in zip(keys, block_ids)
        ]

    def load_order(self, count: int) -> list[int]:
        """Indices ``0..count-1`` rotated by rank, so that the members of a replica group do not all
        read the same object first."""
        shift = self.parallel.tp_rank % count if count else 0
        return list(range(shift, count)) + list(range(shift))

    async def put_objects(self, objects: Sequence[ObjectRef], timeout_s: float) -> list[PutStatus]:
        """Put in backend-sized batches within this pool's byte budget; one status per object."""
        return await run_batches(
            objects,
            self.backend.put,
            failed=PutStatus.FAILED,
            max_batch=self.backend.max_batch,
            budget=self._budget,
            timeout_s=timeout_s,
        )

    async def get_objects(self, objects: Sequence[ObjectRef], timeout_s: float) -> list[GetStatus]:
        """Get in backend-sized batches within this pool's byte budget; one status per object."""
        return await run_batches(
            objects,
            self.backend.get,
            failed=GetStatus.FAILED,
            max_batch=self.backend.max_batch,
            budget=self._budget,
            timeout_s=timeout_s,
        )

    async def exists_or_none(self, keys: Sequence[str], timeout_s: float) -> list[bool] | None:
        """The backend's answer per key, or None (logged) if it failed or took too long."""
        if not keys:
            return []
        try:
            with anyio.fail_after(timeout_s):
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

    # -- operations -----------------------------------------------------------------------------

    async def lookup(
        self,
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
        timeout_s: float | None = None,
    ) -> int:
        """Leading tokens present in every namespace this engine needs (0 if the backend fails).

        Blocks before ``block_offset`` are not asked for and count as present: the engine holds
        them already (its own prefix cache). The answer still counts from the request's start.
        """
        hashes = resolve_hashes(self.block_size, tokens, block_hashes)
        if not 0 <= block_offset <= len(hashes):
            raise RequestError(f"block_offset={block_offset} outside the request's {len(hashes)} full blocks")
        held = block_offset * self.block_size
        hashes = hashes[block_offset:]
        self.begin_call()
        try:
            if not hashes:
                return held
            scopes = self.lookup_scopes()
            if self.config.layerwise:  # a block counts only when every layer of it is present
                assert self.num_layers, "create() requires num_layers for a layerwise pool"
                layers = range(self.num_layers)
                namespaces = [layer_keys(scope, hashes, layer) for scope in scopes for layer in layers]
            else:
                namespaces = [block_keys(scope, hashes) for scope in scopes]
            keys = [k for namespace in namespaces for k in namespace]
            found = await self.exists_or_none(keys, timeout_s or self.config.timeout_s)
            if found is None:
                return held  # the engine recomputes the rest; the failure was logged
            n = len(hashes)
            hits = n
            for s in range(len(namespaces)):
                part = found[s * n : (s + 1) * n]
                first_missing = part.index(False) if False in part else n
                hits = min(hits, first_missing)
            return held + hits * self.block_size
        finally:
            self.end_call()

    async def store(
        self,
        *,
        block_ids: Sequence[int],
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
        timeout_s: float | None = None,
    ) -> StoreResult:
        """Store the blocks this rank owns. ``block_ids[i]`` holds block ``block_offset + i`` of the
        request whose tokens or hashes are given. Keys already present are skipped, per key."""
        if self.config.layerwise:
            request = LayerwiseRequest("", block_ids, tokens, block_hashes, block_offset)
            events = LayerEvents.completed(self.require_layout().num_layers)
            async with LayerwiseStorer.open(self, [request], events, timeout_s=timeout_s) as storer:
                async for _ in storer:
                    pass
            return storer.results()[0]
        hashes = self.request_hashes(block_ids, tokens, block_hashes, block_offset)
        self.begin_call()
        try:
            rank = self.parallel.tp_rank
            mine = [i for i in range(len(hashes)) if owner(block_offset + i, self.parallel) == rank]
            statuses: list[PutStatus | None] = [None] * len(hashes)
            keys = block_keys(self.scope(), [hashes[i] for i in mine])
            timeout = timeout_s or self.config.timeout_s
            present = await self.exists_or_none(keys, timeout) or [False] * len(keys)
            todo = [j for j, p in enumerate(present) if not p]
            for j, p in enumerate(present):
                if p:
                    statuses[mine[j]] = PutStatus.PRESENT
            objects = self.block_objects([keys[j] for j in todo], [block_ids[mine[j]] for j in todo])
            results = await self.put_objects(objects, timeout)
            for j, status in zip(todo, results):
                statuses[mine[j]] = status
            return StoreResult(tuple(statuses))
        finally:
            self.end_call()

    async def retrieve(
        self,
        *,
        block_ids: Sequence[int],
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        block_offset: int = 0,
        timeout_s: float | None = None,
    ) -> RetrieveResult:
        """Load blocks ``block_offset ..`` of the request into ``block_ids``; every rank loads every
        block of its namespace. Failed or missing blocks are reported, never raised."""
        if self.config.layerwise:
            request = LayerwiseRequest("", block_ids, tokens, block_hashes, block_offset)
            depth = self.require_layout().num_layers  # nobody computes in between: all layers at once
            async with LayerwiseRetriever.open(self, [request], depth=depth, timeout_s=timeout_s) as loader:
                async for _ in loader:
                    pass
            return loader.results()[0]
        hashes = self.request_hashes(block_ids, tokens, block_hashes, block_offset)
        self.begin_call()
        try:
            ids = list(block_ids)
            keys = block_keys(self.scope(), hashes)
            order = self.load_order(len(ids))
            objects = self.block_objects([keys[i] for i in order], [ids[i] for i in order])
            results = await self.get_objects(objects, timeout_s or self.config.timeout_s)
            statuses = [GetStatus.FAILED] * len(ids)
            for i, status in zip(order, results):
                statuses[i] = status
            return RetrieveResult(tuple(ids), tuple(statuses), self.block_size)
        finally:
            self.end_call()
