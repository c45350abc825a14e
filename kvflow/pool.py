"""KVPool: the async face of kvflow, over the transfer layer.

Each call is a coroutine pipeline on the caller's event loop: hash -> key -> address -> put/get
(:mod:`kvflow.transfer`). Use one pool from one event loop. The pool owns its backend and closes it
in :meth:`KVPool.aclose`.

A pool made with ``PoolConfig(layerwise=True)`` keeps one object per block per layer: its
:meth:`~KVPool.store` and :meth:`~KVPool.retrieve` move every layer at once, its lookup counts a
block only when every layer is present, and :meth:`~KVPool.layerwise_store` /
:meth:`~KVPool.layerwise_retrieve` move layer by layer while the engine computes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any

import anyio
import attrs

from kvflow.backends import Backend, open_backend
from kvflow.backends.memory import MemoryBackend
from kvflow.config import PoolConfig
from kvflow.device import Device
from kvflow.errors import ConfigError
from kvflow.events import DeviceEvent, LayerEvents, check_after
from kvflow.layerwise import LayerwiseRetriever, LayerwiseStorer
from kvflow.layout import KVFormat, KVLayout
from kvflow.ownership import ParallelConfig
from kvflow.profiles import Profile
from kvflow.request import KVRequest
from kvflow.results import RetrieveResult, StoreResult
from kvflow.transfer import LoadJob, StoreJob, Transfer, TransferSpec
from kvflow.transfer.together import together

__all__ = ["KVPool", "check_timeout"]

log = logging.getLogger(__name__)

_CREATE = object()  # KVPool's constructor is private: make pools with KVPool.create
_UNNAMED = attrs.fields(PoolConfig).model.default  # PoolConfig's model when none is named


def check_create_arguments(
    config: object, layout: object, format: object, parallel: object, backend: object
) -> None:
    """TypeError, saying what to give, for an argument of :meth:`KVPool.create` of another type
    (a URL where a backend goes, the caches where their layout goes); also checked by the
    synchronous faces before they start their loop thread."""
    if isinstance(config, str) or isinstance(backend, str):
        raise TypeError(
            "KVPool.create takes a backend's URL as PoolConfig(backend=url), and backend= an opened "
            "backend (kvflow.backends.open_backend(url)); got a string"
        )
    expected = {"config": (config, PoolConfig), "layout": (layout, KVLayout)}
    expected |= {"format": (format, KVFormat), "parallel": (parallel, ParallelConfig)}
    for name, (value, kind) in expected.items():
        if value is not None and not isinstance(value, kind):
            hint = " (make it with KVLayout.from_kv_caches(kv_caches))" if name == "layout" else ""
            raise TypeError(
                f"KVPool.create: {name} must be a {kind.__name__}{hint}, got {type(value).__name__}"
            )


def check_timeout(timeout_s: float | None) -> None:
    """Refuse a timeout that is not a finite number of seconds > 0 (None: the pool's default)."""
    if timeout_s is None:
        return
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not ok or not 0 < timeout_s < float("inf"):
        raise ConfigError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")


@attrs.define(eq=False)
class KVPool:
    """Store, retrieve and look up KV blocks. Make it with :meth:`create`; call it from the event
    loop that created it."""

    _transfer: Transfer = attrs.field(alias="_transfer")
    _token: object = attrs.field(alias="_token", repr=False)

    def __attrs_post_init__(self) -> None:
        if self._token is not _CREATE:
            raise TypeError("make a pool with KVPool.create(...), which checks and registers the KV caches")

    @classmethod
    def create(
        cls,
        config: PoolConfig | None = None,
        *,
        layout: KVLayout | None = None,
        format: KVFormat | None = None,
        parallel: ParallelConfig | None = None,
        backend: Backend | None = None,
        device: Device | None = None,
    ) -> KVPool:
        """A pool over ``backend`` (default: the one ``config.backend`` names).

        With ``layout`` (the engine's registered KV caches) it stores, retrieves and looks up, and
        registers with the backend the memory it will read and write: the caches', or its staging
        buffers when blocks go through host memory (``config.staging``). Without a layout it only
        looks up, as an engine's scheduler does, and needs the ``format`` the workers' layouts have.
        ``device``: the shim of the caches' device (default: from the layout; tests pass their own).

        The configuration is checked against the layout before a backend is opened; a backend this
        opened itself is closed again when the backend refuses the pool (ConfigError, LayoutError):
        every kvflow backend closes at once when no call ever ran on it; a backend of another scheme
        whose close has to wait is left open when this runs on an event loop (a warning says so). A
        ``backend`` passed in stays the caller's to close then.
        """
        check_create_arguments(config, layout, format, parallel, backend)
        config = config or PoolConfig()
        # Checked before a backend is opened: a refused configuration opens nothing.
        spec = TransferSpec.of(config, parallel=parallel or ParallelConfig(), layout=layout, format=format)
        opened = backend is None  # then nobody else holds it: closed here if the pool is refused
        backend = open_backend(config.backend) if backend is None else backend
        try:
            transfer = Transfer.open(spec, backend=backend, device=device)
        except BaseException:
            if opened:
                _close_unused(backend)
            raise
        if config.model == _UNNAMED and not isinstance(backend, MemoryBackend):
            log.warning(
                "this pool names no model (PoolConfig.model is %r): in a shared store every such pool "
                "shares one namespace, so pools of two models whose KV has one shape would load each "
                "other's KV; give each model's pools its name, PoolConfig(model=...)",
                _UNNAMED,
            )
        return cls(_transfer=transfer, _token=_CREATE)

    # -- what it is ------------------------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        return self._transfer.config

    @property
    def format(self) -> KVFormat:
        """Block size, layer count, meaning and byte order of the KV caches this pool serves."""
        return self._transfer.format

    @property
    def layout(self) -> KVLayout | None:
        """The registered KV caches (None for a pool that only looks up)."""
        return self._transfer.layout

    @property
    def parallel(self) -> ParallelConfig:
        return self._transfer.parallel

    @property
    def backend(self) -> Backend:
        return self._transfer.backend

    @property
    def device(self) -> Device | None:
        """The caches' device shim when blocks move through host staging buffers, else None."""
        staging = self._transfer.staging
        return staging.device if staging is not None else None

    # -- lifetime -------------------------------------------------------------------------------

    async def __aenter__(self) -> KVPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def closed_cleanly(self) -> bool:
        """Whether a close has ended with every call ended and the backend closed (what
        :meth:`aclose` answered; False before any close)."""
        return self._transfer.closed_cleanly

    async def aclose(self, timeout_s: float | None = None) -> bool:
        """Refuse new calls, wait (bounded by ``timeout_s``, default the pool's) for calls in
        flight, then close the backend (within the same bound, but a backend's close always waits
        for its own puts and gets: a Mooncake call with a stalled peer can hold it about 30 s
        more; :meth:`kvflow.SyncPool.close` returns within its bound regardless).

        True when every call ended and the backend closed. False when a call was still running
        at the bound (a device copy or a backend call that does not return: it may still read or
        write the KV cache, so do not free it) or the backend did not close in time. A later
        close waits for the one before it; once no call runs any more it closes a backend left
        open (bounded), else it answers as things stand."""
        check_timeout(timeout_s)
        return await self._transfer.aclose(timeout_s)

    # -- operations -----------------------------------------------------------------------------

    async def lookup(self, request: KVRequest, *, timeout_s: float | None = None) -> int:
        """Leading tokens of the prompt present in every namespace the engine's ranks load from.

        Blocks before ``request.block_offset`` are not asked for and count as present (the engine
        holds them). The answer counts from the prompt's start; when the backend fails it stops
        at the offset. ``block_ids`` are not used.
        """
        check_timeout(timeout_s)
        transfer = self._transfer
        transfer.begin()
        try:
            return await transfer.lookup(request, transfer.deadline(timeout_s))
        finally:
            transfer.end()

    async def store(
        self,
        request: KVRequest,
        *,
        after: DeviceEvent | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> StoreResult:
        """Store the request's blocks that this rank owns (another rank of its replica group stores
        the rest); keys already present are skipped. Failures are results.

        ``after``: an event recorded on the engine's stream after the work that writes the blocks
        (a device cache's forward); no block is read before it completed (a
        :class:`~kvflow.events.DeviceEvent`; TypeError for anything else). ``on_released``: called
        once, on this loop, as soon as the blocks are no longer read (copied out to staging, or
        stored), possibly before the store ends; the engine may then reuse them. A store refused
        before anything is read (a bad request, timeout or ``after``, a closed pool) calls it
        before raising.
        """
        results = await self.store_many([request], after=after, on_released=on_released, timeout_s=timeout_s)
        return results[0]

    async def store_many(
        self,
        requests: Sequence[KVRequest],
        *,
        after: DeviceEvent | None = None,
        on_released: Callable[[], None] | None = None,
        timeout_s: float | None = None,
    ) -> list[StoreResult]:
        """:meth:`store` of several requests (an engine step's) in one call, one result per request
        in order: their blocks go to the backend together, in calls of up to its batch size, so the
        fixed cost of a call is paid once for all of them. ``on_released`` is called once, when no
        block of any of them is read any more. A block two requests share is put once (the
        later one reads ``PRESENT`` once the first is stored, else the first's failure); two
        requests that name one engine block for blocks of different hashes are refused
        (RequestError): an engine block holds one block of one prompt."""
        transfer = self._transfer
        try:
            check_timeout(timeout_s)
            check_after(after)
            deadline = transfer.deadline(timeout_s)  # from the call: the plan's hashing counts
            job = StoreJob(transfer, transfer.plan(requests), on_released)
            transfer.begin()
        except BaseException:  # refused before anything was read: released now
            if on_released is not None:
                on_released()
            raise

        async def put_units() -> None:
            await job.skip_present(deadline)  # reads no KV: may run before the event
            await together([functools.partial(job.put, unit, deadline, after) for unit in transfer.units])

        calls: list[Callable[[], Coroutine[Any, Any, object]]] = [put_units]
        if transfer.book.due:  # beside the store: engines split otherwise find this one's objects through it
            calls.append(functools.partial(transfer.book.announce, deadline))
        try:
            await together(calls)
            return job.results()
        finally:
            try:
                job.release_all()  # (the caller's on_released may raise)
            finally:
                transfer.end()

    async def retrieve(
        self, request: KVRequest, *, after: DeviceEvent | None = None, timeout_s: float | None = None
    ) -> RetrieveResult:
        """Load the request's blocks into its ``block_ids``; every rank loads every block of its
        namespace. Missing or failed blocks are reported (``failed_block_ids``), never raised.

        ``after``: an event recorded on the engine's stream after the work already queued there
        (a device cache's earlier steps may still write blocks vLLM has just handed to this
        request); nothing is written into the cache before it completed, and the blocks fail if it
        does not complete in time (a :class:`~kvflow.events.DeviceEvent`; TypeError for anything
        else). The gets themselves start at once.
        """
        return (await self.retrieve_many([request], after=after, timeout_s=timeout_s))[0]

    async def retrieve_many(
        self,
        requests: Sequence[KVRequest],
        *,
        after: DeviceEvent | None = None,
        timeout_s: float | None = None,
    ) -> list[RetrieveResult]:
        """:meth:`retrieve` of several requests (an engine step's) in one call, one result per
        request in order: their blocks come from the backend together, in calls of up to its
        batch size. No two of them may name one destination block (RequestError)."""
        check_timeout(timeout_s)
        check_after(after)
        transfer = self._transfer
        deadline = transfer.deadline(timeout_s)  # from the call: the plan's hashing counts
        job = LoadJob(transfer, transfer.plan(requests, loads=True), after)
        transfer.begin()
        try:
            await together([functools.partial(job.get, unit, deadline) for unit in transfer.units])
        finally:
            try:
                await job.settle_all(deadline)  # staged: the copies into the cache are done
            finally:
                transfer.end()
        return job.results()  # after the copies: one the device failed fails its blocks

    async def remove(self, request: KVRequest, *, timeout_s: float | None = None) -> int:
        """Delete the objects of the prompt's blocks from ``request.block_offset`` on, in this
        rank's namespace (``block_ids`` are not used); return how many there were.

        For tools and tests that clean up after themselves: other engines sharing the store lose
        these blocks too. Raises BackendError (or TimeoutError) when the store cannot do it.
        """
        check_timeout(timeout_s)
        transfer = self._transfer
        transfer.begin()
        try:
            return await transfer.remove(request, transfer.deadline(timeout_s))
        finally:
            transfer.end()

    async def profiles(self, *, timeout_s: float | None = None) -> tuple[Profile, ...]:
        """How the other engines that store this model (same meaning) in this store split it,
        read from the store now (docs/topology.md). Empty when the store cannot be read; an engine
        reads them at start so that its first lookups need not, and says at once when one of them
        hashes prompts at another granularity (its KV cannot be shared)."""
        check_timeout(timeout_s)
        transfer = self._transfer
        transfer.begin()
        try:
            return await transfer.book.others(transfer.deadline(timeout_s), max_age_s=0.0)
        finally:
            transfer.end()

    # -- layer by layer -------------------------------------------------------------------------

    def layerwise_store(
        self,
        requests: Sequence[KVRequest],
        events: LayerEvents,
        *,
        loaded_by: LayerwiseRetriever | None = None,
        timeout_s: float | None = None,
    ) -> LayerwiseStorer:
        """A storer that puts layer ``l`` of the requests' owned blocks once ``events`` says layer
        ``l`` is written (see :mod:`kvflow.layerwise`). Nothing moves before ``async with``.

        ``loaded_by``: the same forward's retriever: layer ``l`` is put only once its layers
        ``0..l`` arrived whole (a copy into the cache the device reports failed after the forward
        computed on it stops the store there). ``timeout_s`` (default: the pool's) bounds each
        layer's event wait (with ``loaded_by``: from the layer's load arriving, when the engine can
        start on it), each wait for those loads, and each layer's puts.
        """
        self._require_layerwise()
        check_timeout(timeout_s)
        if not isinstance(events, LayerEvents):
            raise TypeError(
                f"events must be a kvflow.events.LayerEvents (LayerEvents.create(num_layers, factory), "
                f"recorded as the layers are written), got {type(events).__qualname__}"
            )
        transfer = self._transfer
        return LayerwiseStorer(
            transfer, transfer.plan(requests), _timeout(self, timeout_s), events, loaded_by=loaded_by
        )

    def layerwise_retrieve(
        self,
        requests: Sequence[KVRequest],
        *,
        depth: int = 1,
        after: DeviceEvent | None = None,
        timeout_s: float | None = None,
    ) -> LayerwiseRetriever:
        """A retriever that loads the requests' blocks layer by layer, ``depth`` layers ahead of the
        last layer handed out (see :mod:`kvflow.layerwise`). Nothing moves before ``async with``.

        ``after``: as :meth:`retrieve`'s. ``timeout_s`` (default: the pool's) bounds each layer's gets.
        """
        self._require_layerwise()
        check_timeout(timeout_s)
        check_after(after)
        transfer = self._transfer
        return LayerwiseRetriever(
            transfer, transfer.plan(requests, loads=True), _timeout(self, timeout_s), depth, after
        )

    def _require_layerwise(self) -> None:
        if not self.config.layerwise:
            raise ConfigError(
                "layer-by-layer transfers need a pool made with PoolConfig(layerwise=True); use the "
                "same setting in every pool that shares the store, so that lookups see per-layer objects"
            )


def _close_unused(backend: Backend) -> None:
    """Close a backend that a refused :meth:`KVPool.create` opened from its config's URL. No call
    ever ran on it, so its close waits for nothing and ends here, on the caller's thread: on a loop
    of its own, or, when an event loop runs on this thread (an async caller, SyncPool's loop
    thread), in the caller's task. Never raises: the caller raises why the pool was refused."""
    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop runs on this thread
            anyio.run(backend.aclose)
            return
        closing = backend.aclose()  # runs now, in the caller's task, up to its first wait
        try:
            closing.send(None)
        except StopIteration:
            return
        closing.close()  # it would wait: left to the garbage collector
        log.warning("the backend a refused pool opened did not close at once; it is left open")
    except Exception as exc:
        log.warning("closing the backend a refused pool opened failed: %r", exc)


def _timeout(pool: KVPool, timeout_s: float | None) -> float:
    return pool.config.timeout_s if timeout_s is None else timeout_s
