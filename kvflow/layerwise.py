"""Layerwise stores and loads: one object per block per layer, moved while the forward pass runs.

:class:`LayerwiseStorer` puts layer ``l`` of the blocks this rank owns once layer ``l``'s device
event (:class:`~kvflow.events.LayerEvents`) has fired, never before. Each layer's put runs as a
task of its own, so a put that fails or hangs is reported without holding back later layers.

:class:`LayerwiseRetriever` gets layer ``l`` into the KV cache and hands it out once it is in
place, keeping ``depth`` layers in flight ahead of the last one handed out, so that layer ``l+1``
moves while the engine computes layer ``l``. A block that any layer fails to load is failed for
the whole request: the engine must recompute it.

Both work on a batch of requests (one forward step's), own a task group, and are used alike::

    async with LayerwiseRetriever.open(pool, requests) as loader:
        async for outcome in loader:  # one LayerOutcome per layer, in layer order
            ...                       # layer outcome.layer is in place
    results = loader.results()        # one RetrieveResult per request

Leaving the ``async with`` block cancels whatever has not finished; the results then report the
blocks of unfinished layers as failed. They are async iterators rather than async generator
functions so that no task group or cancel scope is ever suspended across a ``yield``; a consumer
that stops early leaves nothing behind to finalise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import anyio
import attrs
from anyio.abc import TaskGroup

from kvflow.backends.base import GetStatus, PutStatus
from kvflow.config import positive
from kvflow.errors import ConfigError, RequestError
from kvflow.events import LayerEvents
from kvflow.keys import layer_keys
from kvflow.ownership import owner
from kvflow.results import RetrieveResult, StoreResult

if TYPE_CHECKING:
    from kvflow.pool import KVPool

__all__ = ["LayerOutcome", "LayerwisePlan", "LayerwiseRequest", "LayerwiseRetriever", "LayerwiseStorer"]

log = logging.getLogger(__name__)

T = TypeVar("T", bound="_LayerTasks")

# Folding a block's per-layer put statuses: the worst one wins.
_SEVERITY = {PutStatus.PRESENT: 0, PutStatus.STORED: 1, PutStatus.NO_SPACE: 2, PutStatus.FAILED: 3}
_PUT_FAILURES = (PutStatus.NO_SPACE, PutStatus.FAILED)


@attrs.frozen(eq=False)
class LayerwiseRequest:
    """One request's blocks in a layerwise store or load: ``block_ids[i]`` holds block
    ``block_offset + i`` of the request whose ``tokens`` or ``block_hashes`` are given."""

    request_id: str
    block_ids: Sequence[int]
    tokens: Sequence[int] | None = None
    block_hashes: Sequence[bytes] | None = None
    block_offset: int = 0


@attrs.frozen
class LayerOutcome:
    """A layer of a layerwise store or load has finished; ``failed`` of its objects did not make it
    (a put that failed or found no space; a load that missed or failed)."""

    layer: int
    failed: int

    @property
    def ok(self) -> bool:
        return self.failed == 0


@attrs.frozen(eq=False)
class LayerwisePlan:
    """A batch of requests, validated and flattened: flat block ``j`` is block ``indices[j]`` of its
    request, has hash ``hashes[j]`` and lives in ``block_ids[j]``; request ``r`` spans ``spans[r]``."""

    request_ids: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    hashes: list[bytes]
    block_ids: list[int]
    indices: list[int]

    @classmethod
    def build(cls, pool: KVPool, requests: Sequence[LayerwiseRequest]) -> LayerwisePlan:
        """Validate every request (RequestError before anything moves). Safe from any thread."""
        ids: list[str] = []
        spans: list[tuple[int, int]] = []
        hashes: list[bytes] = []
        block_ids: list[int] = []
        indices: list[int] = []
        seen: set[str] = set()
        for request in requests:
            if request.request_id in seen:
                raise RequestError(f"request {request.request_id!r} appears twice in one batch; pass it once")
            seen.add(request.request_id)
            got = pool.request_hashes(
                request.block_ids, request.tokens, request.block_hashes, request.block_offset
            )
            start = len(hashes)
            hashes.extend(got)
            block_ids.extend(request.block_ids)
            indices.extend(range(request.block_offset, request.block_offset + len(got)))
            ids.append(request.request_id)
            spans.append((start, len(hashes)))
        return cls(tuple(ids), tuple(spans), hashes, block_ids, indices)

    def __len__(self) -> int:
        return len(self.hashes)


@attrs.define(eq=False)
class _LayerTasks:
    """What the storer and the retriever share: a pool call in flight, a task group, and handing
    out one :class:`LayerOutcome` per layer in layer order as layers finish."""

    pool: KVPool
    plan: LayerwisePlan
    timeout_s: float
    _failed: list[int | None] = attrs.field(init=False)  # per layer; None until it finished
    _done: list[anyio.Event] = attrs.field(init=False, factory=list)
    _tg: TaskGroup | None = attrs.field(default=None, init=False)
    _used: bool = attrs.field(default=False, init=False)
    _next: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._failed = [None] * self.pool.require_layout().num_layers

    @property
    def num_layers(self) -> int:
        return len(self._failed)

    async def __aenter__(self: T) -> T:
        if self._used:
            raise RuntimeError("a layerwise storer or retriever runs once; open a new one")
        self._used = True
        self.pool.begin_call()
        try:
            self._done = [anyio.Event() for _ in self._failed]
            tg = anyio.create_task_group()
            await tg.__aenter__()
        except BaseException:
            self.pool.end_call()
            raise
        self._tg = tg
        self._start(tg)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        if tg is None:
            return None
        try:
            tg.cancel_scope.cancel()  # whatever has not finished is abandoned; results say so
            return await tg.__aexit__(exc_type, exc, tb)
        finally:
            self.pool.end_call()

    def __aiter__(self: T) -> T:
        return self

    async def __anext__(self) -> LayerOutcome:
        layer = self._next
        if layer >= len(self._failed):
            raise StopAsyncIteration
        if self._tg is None:
            raise RuntimeError("iterate a layerwise storer or retriever inside its `async with` block")
        await self._done[layer].wait()
        self._next = layer + 1
        self._advance(layer)
        failed = self._failed[layer]
        assert failed is not None
        return LayerOutcome(layer, failed)

    def _finish(self, layer: int, failed: int) -> None:
        self._failed[layer] = failed
        self._done[layer].set()
        log.debug("layer %d finished, %d objects failed", layer, failed)

    def _start(self, tg: TaskGroup) -> None:
        raise NotImplementedError

    def _advance(self, layer: int) -> None:
        """Layer ``layer`` was handed out."""


@attrs.define(eq=False)
class LayerwiseStorer(_LayerTasks):
    """Stores a batch of requests' owned blocks, layer by layer, as their events fire.

    Ownership is exactly :meth:`KVPool.store`'s: block ``i`` of a request is put by
    ``owner(i, parallel)``, and keys already present are skipped, per key and layer.
    Use from the pool's event loop.
    """

    events: LayerEvents
    _owned: list[int] = attrs.field(init=False)  # flat indices of the blocks this rank puts
    _statuses: list[list[PutStatus] | None] = attrs.field(init=False)  # per layer, per owned block

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.events.num_layers != self.num_layers:
            raise ConfigError(
                f"{self.events.num_layers} layer events for a KV cache of {self.num_layers} layers"
            )
        parallel = self.pool.parallel
        rank = parallel.tp_rank
        self._owned = [j for j, i in enumerate(self.plan.indices) if owner(i, parallel) == rank]
        self._statuses = [None] * self.num_layers

    @classmethod
    def open(
        cls,
        pool: KVPool,
        requests: Sequence[LayerwiseRequest],
        events: LayerEvents,
        *,
        timeout_s: float | None = None,
    ) -> LayerwiseStorer:
        """Plan a store; nothing is read before ``async with``, and no layer before its event.

        ``timeout_s`` (default: the pool's) bounds each layer's event wait and each layer's puts.
        Safe from any thread.
        """
        plan = LayerwisePlan.build(pool, requests)
        return cls(pool, plan, timeout_s or pool.config.timeout_s, events)

    def _start(self, tg: TaskGroup) -> None:
        tg.start_soon(self._run, tg)

    async def _run(self, tg: TaskGroup) -> None:
        """Wait for each layer's event in order and start that layer's put."""
        layers, n = self.num_layers, len(self._owned)
        if not n:  # another rank of the replica group owns every block
            for layer in range(layers):
                self._finish_layer(layer, [])
            return
        scope = self.pool.scope()
        hashes = [self.plan.hashes[j] for j in self._owned]
        keys = [layer_keys(scope, hashes, layer) for layer in range(layers)]
        # Asking what is present reads no KV, so it runs while the engine computes layer 0.
        found = await self.pool.exists_or_none([k for ks in keys for k in ks], self.timeout_s)
        present = found if found is not None else [False] * (n * layers)
        for layer in range(layers):
            try:
                fired = await self.events.wait(layer, self.timeout_s)
            except TimeoutError as exc:
                log.warning("layerwise store gives up at layer %d of %d: %s", layer, layers, exc)
                fired = False
            if not fired:  # this layer, and so every later one, will not be written: skip them
                for rest in range(layer, layers):
                    part = present[rest * n : (rest + 1) * n]
                    self._finish_layer(rest, [PutStatus.PRESENT if p else PutStatus.FAILED for p in part])
                return
            tg.start_soon(self._put_layer, layer, keys[layer], present[layer * n : (layer + 1) * n])

    async def _put_layer(self, layer: int, keys: list[str], present: list[bool]) -> None:
        statuses = [PutStatus.PRESENT] * len(keys)
        todo = [k for k, p in enumerate(present) if not p]
        block_ids = self.plan.block_ids
        objects = self.pool.layer_objects(
            [keys[k] for k in todo], [block_ids[self._owned[k]] for k in todo], layer
        )
        results = await self.pool.put_objects(objects, self.timeout_s)
        for k, status in zip(todo, results):
            statuses[k] = status
        self._finish_layer(layer, statuses)

    def _finish_layer(self, layer: int, statuses: list[PutStatus]) -> None:
        self._statuses[layer] = statuses
        self._finish(layer, sum(1 for s in statuses if s in _PUT_FAILURES))

    def results(self) -> list[StoreResult]:
        """One :class:`StoreResult` per request: a block's status is the worst over its layers
        (``None`` where another rank owns it; FAILED where a layer never finished)."""
        done = [statuses for statuses in self._statuses if statuses is not None]
        if len(done) < self.num_layers:  # cancelled: some layer never finished
            worst = [PutStatus.FAILED] * len(self._owned)
        else:
            worst = [max(column, key=_SEVERITY.__getitem__) for column in zip(*done)]
        flat: list[PutStatus | None] = [None] * len(self.plan)
        for j, status in zip(self._owned, worst):
            flat[j] = status
        return [StoreResult(tuple(flat[a:b])) for a, b in self.plan.spans]


@attrs.define(eq=False)
class LayerwiseRetriever(_LayerTasks):
    """Loads a batch of requests' blocks into the KV cache, layer by layer, ``depth`` layers ahead.

    Every rank loads every block of its namespace (as :meth:`KVPool.retrieve`). Use from the pool's
    event loop.
    """

    depth: int = attrs.field(validator=positive)
    _order: list[int] = attrs.field(init=False)  # flat indices, rotated by rank
    _status: list[GetStatus] = attrs.field(init=False)  # per flat block: HIT until a layer is not
    _started: int = attrs.field(default=0, init=False)  # layers whose fetch has started

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._order = self.pool.load_order(len(self.plan))
        self._status = [GetStatus.HIT] * len(self.plan)

    @classmethod
    def open(
        cls,
        pool: KVPool,
        requests: Sequence[LayerwiseRequest],
        *,
        depth: int = 1,
        timeout_s: float | None = None,
    ) -> LayerwiseRetriever:
        """Plan a load of ``requests``; nothing moves before ``async with``.

        ``depth`` layers are in flight ahead of the last layer handed out; ``timeout_s`` (default:
        the pool's) bounds each layer's gets. Safe from any thread.
        """
        plan = LayerwisePlan.build(pool, requests)
        return cls(pool, plan, timeout_s or pool.config.timeout_s, depth)

    def _start(self, tg: TaskGroup) -> None:
        self._fetch_through(self.depth - 1)

    def _advance(self, layer: int) -> None:
        self._fetch_through(layer + self.depth)

    def _fetch_through(self, last: int) -> None:
        tg = self._tg
        assert tg is not None
        while self._started <= min(last, self.num_layers - 1):
            tg.start_soon(self._fetch, self._started)
            self._started += 1

    async def _fetch(self, layer: int) -> None:
        status = self._status
        todo = [j for j in self._order if status[j] is GetStatus.HIT]  # a failed block stays failed
        keys = layer_keys(self.pool.scope(), [self.plan.hashes[j] for j in todo], layer)
        objects = self.pool.layer_objects(keys, [self.plan.block_ids[j] for j in todo], layer)
        results = await self.pool.get_objects(objects, self.timeout_s)
        hits = 0
        for j, result in zip(todo, results):
            if result is GetStatus.HIT:
                hits += 1
            elif status[j] is GetStatus.HIT:
                status[j] = result
        self._finish(layer, len(status) - hits)

    def results(self) -> list[RetrieveResult]:
        """One :class:`RetrieveResult` per request: a block is a HIT only if every layer of it was
        loaded; otherwise the engine must recompute it."""
        status = self._status
        if any(failed is None for failed in self._failed):  # cancelled: unfinished layers hold junk
            status = [GetStatus.FAILED if s is GetStatus.HIT else s for s in status]
        ids, block_size = self.plan.block_ids, self.pool.block_size
        return [RetrieveResult(tuple(ids[a:b]), tuple(status[a:b]), block_size) for a, b in self.plan.spans]
