"""The transfer layer: the one place that turns requests into backend calls.

A :class:`Transfer` owns a backend, the pool's byte budget, the registered layout (or, for a pool
that only looks up, its :class:`~kvflow.layout.KVFormat`) and the count of calls in flight. It
provides each stage once:

- keys: a request's block hashes in a :class:`~kvflow.keys.KeyScope`: what this rank holds (its
  stage's layers, its KV heads, its context shard), or every object a lookup needs; one object per
  block (whole-block pools) or per block and layer (layerwise pools: a *unit* is a layer index of
  this stage; ``None`` is the whole block). The pool's :class:`~kvflow.profiles.Profile` lists
  them all and is announced in the store, so that engines split differently find them;
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
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import anyio
import attrs
import torch

import kvflow.transfer.direct as direct
from kvflow.backends.base import Backend, GetStatus, ObjectRef, PutStatus, Touching, cancelled_as_fault
from kvflow.config import PoolConfig
from kvflow.device import Device
from kvflow.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    KVFlowError,
    LayoutError,
    PoolClosedError,
    RequestError,
)
from kvflow.keys import KeyScope, block_keys
from kvflow.layout import KVFormat, KVLayout
from kvflow.ownership import ParallelConfig
from kvflow.profiles import Profile, ProfileBook
from kvflow.request import KVRequest
from kvflow.transfer.batches import is_programming_error, run_batches
from kvflow.transfer.budget import ByteBudget
from kvflow.transfer.direct import ObjectRegions
from kvflow.transfer.objects import BlockObjects
from kvflow.transfer.plan import BlockPlan, Hashing, request_hashes
from kvflow.transfer.reshape import Source, needed_bytes, sources
from kvflow.transfer.spec import TransferSpec
from kvflow.transfer.staging import StagingPool, UnitShape

__all__ = ["Transfer", "Unit"]

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    #: how this engine splits the model into objects (announced in the store through ``book``)
    profile: Profile
    book: ProfileBook
    #: host staging, when blocks move through host buffers (None: the backend reads and writes
    #: the cache's memory itself)
    staging: StagingPool | None = None
    _scratch: StagingPool | None = attrs.field(default=None, init=False)
    _scopes: dict[Unit, KeyScope] = attrs.field(factory=dict, init=False)
    #: the scopes a lookup asks for: every namespace the engine's ranks load from (made once)
    _lookup_scopes: list[KeyScope] = attrs.field(init=False)
    _shapes: dict[Unit, UnitShape] = attrs.field(factory=dict, init=False)
    _regions: dict[tuple[Profile, KeyScope, tuple[int, int], int], ObjectRegions | None] = attrs.field(
        factory=dict, init=False
    )
    _budget: ByteBudget = attrs.field(init=False)
    #: a store may put without asking ``exists`` first: the backend's put answers PRESENT for held
    #: keys without copying them, and nothing is gained by knowing earlier (whole blocks read
    #: straight from the cache: no staging copy and no per-layer unit to skip)
    put_checks_present: bool = attrs.field(init=False)
    #: a request's backend calls run one after another, its last objects first (the backend's
    #: ``calls_in_turn``): its head is then the most recent use, and a put that outgrows the
    #: store keeps it. Staged chunks go in that order too.
    calls_in_turn: bool = attrs.field(init=False)
    #: the shortest run the backend takes as a region of its own (its ``min_region_bytes``; None:
    #: kvflow's default, :func:`kvflow.transfer.direct.min_run_bytes`)
    _min_region_bytes: int | None = attrs.field(init=False)
    _touch: Callable[[Sequence[str]], Awaitable[None]] | None = attrs.field(init=False)  # Touching's
    _inflight: int = attrs.field(default=0, init=False)
    _idle: anyio.Event | None = attrs.field(default=None, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _closing: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)  # one aclose at a time
    _backend_closed: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self._budget = ByteBudget(self.config.max_inflight_bytes)
        self._lookup_scopes = list(self.profile.scopes())
        capabilities = self.backend.capabilities
        capable = capabilities.put_checks_present
        self.put_checks_present = capable and self.staging is None and not self.config.layerwise
        self.calls_in_turn = capabilities.calls_in_turn
        self._min_region_bytes = capabilities.min_region_bytes
        self._touch = self.backend.touch if isinstance(self.backend, Touching) else None

    @classmethod
    def open(cls, spec: TransferSpec, *, backend: Backend, device: Device | None = None) -> Transfer:
        """A transfer of ``spec`` (a configuration already checked against the KV caches) over
        ``backend``: check what depends on the backend, choose direct or staged transfers, and
        register the memory the backend will read and write (the cache's, or the staging
        buffers). Nothing is registered before every check passed.

        ``device`` replaces the shim of the cache's device (tests use one whose events complete late).
        """
        config, layout, largest = spec.config, spec.layout, spec.largest
        batch = backend.max_batch
        if type(batch) is not int or batch < 1:
            raise ConfigError(
                f"the backend's max_batch is {batch!r}: it must be a positive integer, the most "
                "objects one put or get is given"
            )
        staging = None
        if layout is not None:
            unreachable = layout.device.type != "cpu" and not backend.capabilities.device_memory
            if unreachable and config.staging == "never":
                raise LayoutError(
                    f"the KV caches are on {layout.device}, which this backend cannot read or write, and "
                    "PoolConfig(staging='never') forbids staging them through host memory: set "
                    "staging='auto', or use a backend whose transport moves device memory (docs/device.md)"
                )
            limit = backend.capabilities.max_object_bytes
            if limit is not None and largest > limit:
                raise ConfigError(
                    f"this pool's objects (a block{' layer' if config.layerwise else ''} of its KV "
                    f"caches) are {largest} bytes, but the backend stores objects of at most {limit} "
                    f"bytes: give it room for them (arena://...?slot={-(-largest // 4096) * 4}KiB or more)"
                )
            if config.staging == "always" or unreachable:
                device = device or Device.of(layout.device)
                staging = StagingPool.create(device, config.staging_bytes, largest)
                _register(backend, staging.buffers())
            else:
                for addr, nbytes in layout.allocations():
                    backend.register_memory(addr, nbytes)
        book = ProfileBook(backend, spec.profile)
        return cls(backend, config, spec.format, spec.parallel, layout, spec.profile, book, staging)

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

    @property
    def closed_cleanly(self) -> bool:
        """Whether a close ended with every call ended and the backend closed (what it answered)."""
        return self._backend_closed and not self._inflight

    async def aclose(self, timeout_s: float | None = None) -> bool:
        """Refuse new calls, wait (bounded) for calls in flight, then close the backend (bounded).
        True when every call has ended and the backend closed; False when a call was still
        running at the bound (it may still read or write the KV cache) or the backend did not
        close in time. A later close waits for the one before it; if that one left the backend
        open and no call runs any more, it closes the backend (bounded), else it answers as
        things stand."""
        first, self._closed = not self._closed, True
        limit = self.config.timeout_s if timeout_s is None else timeout_s
        with anyio.CancelScope(shield=True):
            async with self._closing:
                deadline = time.monotonic() + limit
                if first and self._inflight:
                    self._idle = anyio.Event()
                    with anyio.move_on_after(limit):
                        await self._idle.wait()
                    if self._inflight:
                        log.warning(
                            "%d calls still running after %.1f s: they may still read or write the "
                            "KV cache; do not free it",
                            self._inflight,
                            limit,
                        )
                if not self._backend_closed and (first or not self._inflight):
                    await self._close_backend(deadline, limit)
        return self.closed_cleanly

    async def _close_backend(self, deadline: float, limit: float) -> None:
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope, cancelled_as_fault():
            await self.backend.aclose()
        self._backend_closed = not scope.cancelled_caught
        if scope.cancelled_caught:
            log.warning(
                "the backend did not close within %.1f s; call KVPool.aclose again to retry once no call "
                "runs (SyncPool.close leaves it open)",
                limit,
            )

    def deadline(self, timeout_s: float | None) -> float:
        """The deadline of a call given its ``timeout_s`` (default: the pool's), from now."""
        return time.monotonic() + (self.config.timeout_s if timeout_s is None else timeout_s)

    # -- keys -----------------------------------------------------------------------------------

    @property
    def units(self) -> tuple[Unit, ...]:
        """The units of one block: every layer (layerwise pools), or the whole block."""
        return tuple(range(self.format.num_layers)) if self.config.layerwise else (None,)

    @property
    def hashing(self) -> Hashing:
        return Hashing(self.format.block_size, self.profile.hash_tokens)

    @property
    def stage_layers(self) -> tuple[int, int]:
        """The model layers ``(first, end)`` this rank's stage holds."""
        return self.parallel.stage_layers(self.parallel.pp_rank, self.format.num_layers)

    def unit_layers(self, unit: Unit) -> tuple[int, int]:
        """The model layers ``(first, end)`` one object of ``unit`` holds."""
        first, end = self.stage_layers
        return (first, end) if unit is None else (first + unit, first + unit + 1)

    @property
    def heads(self) -> tuple[int, int]:
        """The model's KV heads ``(first, end)`` this rank holds (``(0, 1)`` for MLA)."""
        return self.profile.heads_of(self.parallel.kv_head_group)

    def scope(self, unit: Unit) -> KeyScope:
        """What this rank's object of ``unit`` holds."""
        scope = self._scopes.get(unit)
        if scope is None:
            p, profile = self.parallel, self.profile
            scope = self._scopes[unit] = KeyScope(
                profile.model,
                profile.meaning,
                profile.order,
                profile.block_size,
                self.unit_layers(unit),
                self.heads,
                (p.dcp_rank, p.dcp_size),
                (p.pcp_rank, p.pcp_size),
            )
        return scope

    def keys(self, hashes: Sequence[bytes], unit: Unit) -> list[str]:
        """This rank's key of each hash's object of ``unit``."""
        return block_keys(self.scope(unit), hashes)

    # -- addresses ------------------------------------------------------------------------------

    def require_layout(self) -> KVLayout:
        """The registered layout; ConfigError for a pool that only looks up."""
        if self.layout is None:
            raise ConfigError("this pool has no registered KV caches; create it with a layout")
        return self.layout

    def plan(self, requests: Sequence[KVRequest], *, loads: bool = False) -> BlockPlan:
        """Validate requests against the cache (``loads``: into it, each block by one request
        only); RequestError before anything moves."""
        return BlockPlan.build(requests, self.hashing, self.require_layout().num_blocks, loads=loads)

    def objects(self, keys: Sequence[str], block_ids: Sequence[int], unit: Unit) -> BlockObjects:
        """``keys[i]`` holds ``unit`` of engine block ``block_ids[i]`` (made a batch at a time)."""
        return BlockObjects(self.require_layout(), keys, block_ids, unit)

    def shape(self, unit: Unit) -> UnitShape:
        """How ``unit``'s objects lie in a staging chunk (staged transfers only)."""
        shape = self._shapes.get(unit)
        if shape is None:
            assert self.staging is not None
            shape = self._shapes[unit] = UnitShape.of(self.require_layout(), unit, self.staging.chunk_bytes)
        return shape

    def object_regions(
        self, profile: Profile, scope: KeyScope, layers: tuple[int, int]
    ) -> ObjectRegions | None:
        """Where an object of ``profile``'s ``scope`` lands in a block of this rank's cache, for a
        load of the model ``layers``, when it can go straight in with runs the backend takes
        (:func:`kvflow.transfer.direct.object_regions`; made once each)."""
        shortest = direct.min_run_bytes(self._min_region_bytes)
        key = (profile, scope, layers, shortest)
        if key not in self._regions:
            self._regions[key] = direct.object_regions(
                profile,
                self.require_layout(),
                scope,
                layers=layers,
                first_layer=self.stage_layers[0],
                heads=self.heads,
                shortest=shortest,
            )
        return self._regions[key]

    def in_call_order(self, items: Sequence[T]) -> Iterable[T]:
        """A request's chunks (staging chunks, batches; head first) in the order their backend
        calls go: the last first where the calls go in turn (``calls_in_turn``), so that the
        request's head is its most recent use."""
        return reversed(items) if self.calls_in_turn else items

    def load_order(self, count: int) -> list[int]:
        """Indices ``0..count-1`` rotated by rank, so that the members of a replica group do not
        all read the same object first; not rotated where the backend's calls go in turn (an
        in-process store: nothing to spread, and a rotated get would make a block past the head
        the prompt's most recent use)."""
        shift = self.parallel.tp_rank % count if count and not self.calls_in_turn else 0
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
            in_turn=self.calls_in_turn,
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
            in_turn=self.calls_in_turn,
        )

    async def exists(self, keys: Sequence[str], deadline: float) -> list[bool] | None:
        """The backend's answer per key, or None (logged) if it failed or ran past the deadline."""
        if not keys:
            return []
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())), cancelled_as_fault():
                found = await self.backend.exists(keys)
        except Exception as exc:  # a fault of the store means "unknown", never a crash
            if is_programming_error(exc):
                raise  # a misconfigured backend must not look like an empty cache forever
            log.warning("exists() of %d keys failed: %r", len(keys), exc)
            return None
        if not isinstance(found, list):  # a tuple, an array: what the protocol's list[bool] means
            try:
                found = list(found)
            except TypeError:
                raise TypeError(
                    f"the backend's exists answered {found!r}: it must return a list of bools, one "
                    "per key (docs/api.md)"
                ) from None
        if len(found) != len(keys):
            log.warning("exists() returned %d answers for %d keys", len(found), len(keys))
            return None
        if found.count(True) + found.count(False) != len(found):  # None for False, say: as truth values
            found = [bool(answer) for answer in found]
        return found

    async def touch(self, keys: Sequence[str], deadline: float) -> None:
        """Mark ``keys`` used, the first the most recently, where the backend can
        (:class:`~kvflow.backends.base.Touching`); a store that cannot is logged, not raised: only
        the order of eviction depends on it."""
        touch = self._touch
        if not keys or touch is None or time.monotonic() >= deadline:
            return
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())), cancelled_as_fault():
                await touch(keys)
        except Exception as exc:
            if is_programming_error(exc) and not isinstance(exc, BackendError):
                raise
            log.warning("touch() of %d keys failed: %r", len(keys), exc)

    async def remove(self, request: KVRequest, deadline: float) -> int:
        """Delete this rank's objects of the prompt's blocks from ``block_offset`` on (every unit);
        return how many existed. Raises BackendError when the store cannot be reached."""
        hashes = request_hashes(request, self.hashing)[request.block_offset :]
        keys = [k for u in self.units for k in self.keys(hashes, u)]
        if not keys:
            return 0
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())), cancelled_as_fault():
                removed = await self.backend.remove(keys)
        except TimeoutError as exc:
            raise TimeoutError(
                f"removing {len(keys)} objects did not end by the call's deadline: the store is slow "
                "or cannot be reached; try again, with a longer timeout_s"
            ) from exc
        except KVFlowError:
            raise
        except Exception as exc:  # a backend that broke the protocol's promise (BackendError only)
            raise BackendUnavailableError(f"removing {len(keys)} objects failed: {exc!r}") from exc
        return sum(map(bool, removed))

    # -- lookup ---------------------------------------------------------------------------------

    async def lookup(self, request: KVRequest, deadline: float) -> int:
        """Leading tokens of the prompt that the store holds for every rank of the engine (blocks
        before the request's ``block_offset`` count as held); stops at the offset when the backend
        fails.

        First under this engine's own keys (one ``exists`` call); only if a block is missing there,
        under the profiles of engines split differently (a second call), block by block: a block
        counts when one profile holds all of it."""
        hashing = self.hashing
        fine = hashing.fine(request)
        hashes = hashing.blocks(fine)
        offset = request.block_offset
        if offset > len(hashes):
            raise RequestError(f"block_offset={offset} is past the prompt's {len(hashes)} full blocks")
        block = self.format.block_size
        rest = hashes[offset:]
        if not rest:
            return offset * block
        namespaces = [block_keys(s, rest) for s in self._lookup_scopes]
        keys = namespaces[0] if len(namespaces) == 1 else [k for keys in namespaces for k in keys]
        found = await self.exists(keys, deadline)
        if found is None:
            return offset * block  # the engine recomputes the rest; the failure was logged
        n = len(rest)
        # A block is held when every namespace holds it: the leading blocks up to the first that
        # any namespace misses (one scan in C per namespace) ...
        parts = [found[k * n : (k + 1) * n] for k in range(len(namespaces))]
        first = min((part.index(False) for part in parts if False in part), default=n)
        if first == n:
            return (offset + n) * block
        # ... and from there on, those held in every namespace or whole under another profile,
        # asked in order, a few blocks first and four times as many each round, up to the first
        # block that no profile holds: a prompt nobody stored costs one block's keys per profile.
        held = [all(t) for t in zip(*(part[first:] for part in parts))]
        missing = [offset + first + i for i, h in enumerate(held) if not h]
        more: set[int] = set()
        at, size = 0, 1
        while at < len(missing):
            asked = missing[at : at + size]
            found_there = await self._held_elsewhere(fine, asked, deadline)
            more |= found_there
            if len(found_there) < len(asked):
                break
            at, size = at + size, size * 4
        held = [h or (offset + first + i) in more for i, h in enumerate(held)]
        return (offset + first + (held.index(False) if False in held else len(held))) * block

    async def _held_elsewhere(self, fine: list[bytes], indices: list[int], deadline: float) -> set[int]:
        """Which of the prompt's blocks ``indices`` another profile in the store holds whole, in
        objects that every rank's load can hold (:meth:`_loadable`)."""
        others = await self.book.others(deadline)
        if not others:
            return set()
        block = self.format.block_size
        wanted: dict[int, list[list[str]]] = {}  # per block, per profile: its keys (empty: unusable)
        flat: list[str] = []
        # whether a block's objects fit a load depends only on where it starts in the profile's blocks
        fits: dict[tuple[int, int], bool] = {}
        for index in indices:
            per_profile = []
            for p, profile in enumerate(others):
                tokens = (index * block, (index + 1) * block)
                found = sources(profile, fine, tokens, layers=self.model_layers) or []
                keys: list[str] = []
                if found:
                    at = (p, tokens[0] % profile.block_size)
                    if at not in fits:
                        fits[at] = self._loadable(profile, fine, tokens, found)
                    keys = [s.key for s in found] if fits[at] else []
                per_profile.append(keys)
                flat.extend(keys)
            wanted[index] = per_profile
        if not flat:
            return set()
        answer = await self.exists(flat, deadline)
        if answer is None:
            return set()
        present = dict(zip(flat, answer))
        return {
            index
            for index, per_profile in wanted.items()
            if any(keys and all(present[k] for k in keys) for keys in per_profile)
        }

    def _loadable(
        self, profile: Profile, fine: list[bytes], tokens: tuple[int, int], found: list[Source]
    ) -> bool:
        """Whether each rank's load of the block from ``found`` (its objects of ``profile``, for
        every rank) fits :attr:`scratch_limit`, as the load requires: each of this engine's objects
        (one rank's, of one unit) is filled from its own share of them."""
        limit = self.scratch_limit
        if needed_bytes(found) <= limit:  # all of them fit: so does any share
            return True
        for scope in self._lookup_scopes:
            share = sources(
                profile,
                fine,
                tokens,
                layers=scope.layers,
                heads=scope.heads,
                dcp_rank=scope.dcp[0],
                pcp_rank=scope.pcp[0],
            )
            if share and needed_bytes(share) > limit:
                return False
        return True

    @property
    def model_layers(self) -> tuple[int, int]:
        """Every model layer the engine's stages hold, ``(0, end)``."""
        p = self.parallel
        return 0, p.stage_layers(p.pp_size - 1, self.format.num_layers)[1]

    async def scratch(self, nbytes: int) -> StagingPool | None:
        """Host chunks of at least ``nbytes`` for objects of other profiles: the staging chunks when
        the pool stages and they are large enough, else chunks of their own, made and registered
        with the backend on first use and made again, at least twice as large, when a block needs
        more. None past :attr:`scratch_limit` (one block's objects larger than that)."""
        staging, pool = self.staging, self._scratch
        if staging is not None and nbytes <= staging.chunk_bytes:
            return staging
        if pool is not None and nbytes <= pool.chunk_bytes:
            return pool
        limit = self.scratch_limit
        if nbytes > limit:
            return None
        chunk = min(limit, max(nbytes, 2 * pool.chunk_bytes if pool is not None else 0))
        total = max(chunk, min(self.config.staging_bytes, _SCRATCH_BYTES))
        # (chunks of a pool made before are given back to it, and it goes once they all are)
        # one copy stream for the job's copies into the cache (a load's after= orders it once)
        if staging is not None:
            device = staging.device
        else:
            device = pool.device if pool is not None else Device.of(self.require_layout().device)
        pool = self._scratch = StagingPool.create(device, total, chunk)
        _register(self.backend, pool.buffers())
        return pool

    @property
    def scratch_limit(self) -> int:
        """The most bytes of other profiles' objects a block may need and still be loaded."""
        return max(self.config.staging_bytes, _SCRATCH_BYTES)


#: Buffers registered with a backend that pins them (``registers_memory``), kept allocated for as
#: long as the backend lives: pools sharing one backend come and go before it closes.
_REGISTERED: weakref.WeakKeyDictionary[Backend, list[torch.Tensor]] = weakref.WeakKeyDictionary()


def _register(backend: Backend, buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        backend.register_memory(buffer.data_ptr(), buffer.numel())
    if backend.capabilities.registers_memory:
        _REGISTERED.setdefault(backend, []).extend(buffers)


#: Host memory a pool that does not stage sets aside, on first use, for objects of other profiles.
_SCRATCH_BYTES = 64 << 20
