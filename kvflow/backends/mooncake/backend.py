"""Mooncake Store backend: objects in a Mooncake cluster, moved zero-copy from and into KV memory.

``mooncake://127.0.0.1:50051?segment=1GiB&protocol=tcp`` (see :mod:`.config`). Puts and gets
are Mooncake's scatter-gather batch calls (one key, many regions); ``register_memory`` registers the
engine's KV memory once. Objects outside registered memory go through a staging buffer
(:mod:`.staging`).

Threads: Mooncake's calls block and release the GIL. Each runs through ``anyio.to_thread.run_sync``
with this backend's ``CapacityLimiter`` (``max_concurrency`` tokens), and holds one of as many
*slots* until the native call really returns. Calls that touch no caller memory (``exists``, the
health probe, ``setup``, ``close``) are bounded by ``anyio.fail_after`` and abandoned on timeout; an
abandoned call keeps its slot until Mooncake returns, so abandoned calls can never pile up beyond
``max_concurrency``: when every slot is held, calls fail fast. ``put`` and ``get`` read and write the
caller's memory, so they are never abandoned: returning while Mooncake still copies would let the
engine reuse a block that is being written or read. Mooncake bounds them itself (about 4.5 s when
the master is lost, at once when a peer is lost); an overrun of ``timeout_s`` is logged.

Health: ``RPC_FAIL`` (-900) or ``RPC_TIMEOUT`` (-901), a timeout or busy slots mark the master down
(:mod:`.health`).
While it is down, ``put``/``get`` report ``FAILED`` and ``exists`` raises ``BackendUnavailableError``
without calling Mooncake, and one call per ``health_interval_s`` probes the master.

Use a backend from one event loop. It owns the Mooncake client and closes it in :meth:`aclose`.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

import anyio
import anyio.to_thread
import attrs

from kvflow.backends.base import (
    BackendCapabilities,
    BackendStats,
    GetStatus,
    ObjectRef,
    PutStatus,
    takes_config,
)
from kvflow.backends.inflight import InFlight
from kvflow.backends.mooncake.absent import RecentAbsence
from kvflow.backends.mooncake.admin import ClusterUsage, fetch, parse_keys, parse_usage
from kvflow.backends.mooncake.calls import (
    check_objects,
    dedupe,
    distinct_rounds,
    get_chunk,
    get_results,
    put_chunk,
    put_results,
)
from kvflow.backends.mooncake.config import MooncakeConfig
from kvflow.backends.mooncake.health import HealthGate, StoreHealth
from kvflow.backends.mooncake.native import (
    MASTER_DOWN,
    NOT_READY,
    MasterNotListening,
    NativeStore,
    StoreModule,
    code_name,
    load_store_module,
    new_replicate_config,
    setup_store,
)
from kvflow.backends.mooncake.staging import Chunk, RegisteredMemory, StagingBuffer, plan_chunks
from kvflow.backends.mooncake.threads import Alone, ClientBusy, NativeCalls, SlotsBusy
from kvflow.errors import BackendError, BackendUnavailableError, ConfigError, PoolClosedError

__all__ = ["MooncakeBackend", "MooncakeConfig"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_PROBE_KEY = "kvflow/health-probe"
_MAX_BACKOFF = 16  # failed setups are retried after 1, 2, 4, ... at most this many health intervals
_WARN_EVERY_S = 10.0  # failed puts and gets are logged at most this often (per operation)


@attrs.define(eq=False)
class MooncakeBackend:
    """A client of one Mooncake cluster. Call every method from one event loop.

    The client connects on :meth:`connect` (or lazily on first use; a lazy connect that fails
    reports ``FAILED`` from put/get and raises from exists).
    """

    config: MooncakeConfig = attrs.field(
        factory=MooncakeConfig, validator=takes_config(MooncakeConfig, "mooncake://127.0.0.1:50051")
    )
    _module: StoreModule = attrs.field(init=False)
    _replicate: object = attrs.field(init=False)
    _store: NativeStore | None = attrs.field(default=None, init=False)
    _attempted: bool = attrs.field(default=False, init=False)
    _failed_setups: int = attrs.field(default=0, init=False)  # in a row, for the retry backoff
    _calls: NativeCalls = attrs.field(init=False)
    _connect_lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)
    _staging_lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)
    _staging: StagingBuffer | None = attrs.field(default=None, init=False)
    _registered: RegisteredMemory = attrs.field(factory=RegisteredMemory, init=False)
    _health: HealthGate = attrs.field(init=False)
    _stats: BackendStats = attrs.field(init=False)
    _absent: RecentAbsence = attrs.field(factory=RecentAbsence, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _closed_event: anyio.Event = attrs.field(factory=anyio.Event, init=False)  # aclose has returned
    _copies: InFlight = attrs.field(factory=InFlight, init=False)  # put and get chunks running on the client
    _unlogged: dict[str, int] = attrs.field(factory=dict, init=False)  # failed objects not yet logged, per op
    _logged_at: dict[str, float] = attrs.field(factory=dict, init=False)  # when each op last logged

    def __attrs_post_init__(self) -> None:
        self._module = load_store_module()
        self._replicate = new_replicate_config(self._module, self.config)
        self._calls = NativeCalls(self.config.max_concurrency)
        self._health = HealthGate(self.config.health_interval_s)
        self._stats = BackendStats(capacity_bytes=self.config.segment_bytes)

    @classmethod
    def from_url(cls, url: str) -> MooncakeBackend:
        return cls(MooncakeConfig.from_url(url))

    @classmethod
    def from_file(cls, path: str) -> MooncakeBackend:
        """From a ``mooncake.json`` as Mooncake and vllm-ascend read it."""
        return cls(MooncakeConfig.from_file(path))

    @classmethod
    def from_env(cls) -> MooncakeBackend:
        """From the ``mooncake.json`` that ``MOONCAKE_CONFIG_PATH`` names."""
        return cls(MooncakeConfig.from_env())

    # -- lifetime -------------------------------------------------------------------------------

    async def __aenter__(self) -> MooncakeBackend:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def connect(self) -> None:
        """Set up the Mooncake client now, if it is not. Raises BackendUnavailableError when the
        master cannot be reached (at most ``setup_timeout_s``; at once when nothing listens at its
        address). After a failure the next setup runs at most once per ``health_interval_s``, and
        after failed Mooncake setups (not mere refused connections) ever less often, up to
        every 16 intervals."""
        self._check_open()
        if self._store is None:
            await self._connected_store()

    async def aclose(self) -> None:
        """Close the client (shielded). Objects in this client's segment leave the cluster with it.

        Returns only once no put or get runs on the client: they read and write the caller's
        memory (registered memory may be freed once this returns), so this waits for them however
        long Mooncake takes to end them (a stalled peer: about 30 s without progress; bound the
        whole close where it is called, as :meth:`kvflow.SyncPool.close` does). No put or get
        starts once this has begun. Other calls (``exists``, abandoned after ``timeout_s``) are
        waited for ``close_timeout_s`` at most; the client is left to the process exit if they
        have not returned by then.
        """
        with anyio.CancelScope(shield=True):
            if self._closed:  # a second close returns when the first does
                await self._closed_event.wait()
                return
            self._closed = True
            try:
                await self._copies.drained()
                store, self._store = self._store, None
                # None: never connected, or a setup in flight closes its client itself
                if store is None or await self._close_native(store):
                    self._release_staging()
            finally:
                self._closed_event.set()

    async def _close_native(self, store: NativeStore) -> bool:
        """Close a client once no call runs on it (shielded, bounded by ``close_timeout_s``: only
        abandoned calls that touch no caller memory can still be running).

        Mooncake's ``close`` holds the GIL while it runs (about 2 s; about 11 s once the master is
        gone): no thread of this process runs meanwhile, and no timeout can end it early."""
        timeout_s = self.config.close_timeout_s
        with anyio.CancelScope(shield=True):
            outcome, _ = await self._calls.run_alone(store.close, timeout_s=timeout_s)
        if outcome is Alone.BUSY:
            log.warning(
                "Mooncake client not closed: calls abandoned earlier had not returned after %.1f s "
                "(close_timeout); it closes with the process",
                timeout_s,
            )
        elif outcome is Alone.OVERRAN:
            log.warning(
                "Mooncake's close had not returned after %.1f s (it takes longer while the master at %s "
                "is unreachable); it goes on in the background",
                timeout_s + 1.0,
                self.config.master,
            )
        return outcome is Alone.DONE

    # -- the Backend protocol -------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def capabilities(self) -> BackendCapabilities:
        """Device memory as the config says (``device_memory``); no ranged reads."""
        return BackendCapabilities(device_memory=self.config.reaches_device_memory, registers_memory=True)

    @property
    def native_store(self) -> NativeStore | None:
        """The Mooncake client (``MooncakeDistributedStore``) once connected, for tools and
        benchmarks. Calls on it block; do not close it (:meth:`aclose` does)."""
        return self._store

    def stats(self) -> BackendStats:
        """Counters of this client; ``capacity_bytes`` is the segment it contributes."""
        return self._stats

    def health(self) -> StoreHealth:
        """Whether this client believes the master reachable (as its last call or probe found).
        Safe from any thread: it returns an immutable snapshot and never calls Mooncake."""
        return self._health.state

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Register memory for zero-copy puts and gets (now, or when the client connects).

        Blocks while Mooncake registers (fast for TCP; RDMA pins the pages). The memory must stay
        valid until :meth:`aclose` returns.
        """
        self._check_open()
        if nbytes <= 0 or addr <= 0:
            raise ConfigError(f"register_memory needs a positive address and size, got {addr:#x}, {nbytes}")
        for piece, size in self._registered.add(addr, nbytes):  # (Mooncake refuses overlaps)
            if self._store is not None:
                self._register_native(self._store, piece, size)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = await self._key_call("exists", keys, lambda store, batch: store.batch_is_exist(batch))
        bad = [c for c in codes if c < 0]
        if bad:
            raise BackendUnavailableError(f"Mooncake batch_is_exist failed with {code_name(bad[0])}")
        found = [c == 1 for c in codes]
        self._absent.note(keys, found)
        return found

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete objects from the cluster. False where there was none, or where a reader's lease
        still holds it (Mooncake leases an object to every get for a few seconds): try again later."""
        codes = await self._key_call("remove", keys, lambda store, batch: store.batch_remove(batch))
        return [c == 0 for c in codes]

    # -- listing, for tools (kvflow store) ------------------------------------------------------

    async def list_keys(self) -> list[str]:
        """Every key the cluster holds (kvflow's and anyone else's), from the master's HTTP port
        (``metrics_port``). Raises BackendUnavailableError when it does not answer."""
        self._check_open()
        return parse_keys(await self._fetch("/get_all_keys"))

    async def cluster_usage(self) -> ClusterUsage:
        """The cluster's capacity, bytes in use and key count, from the master's HTTP port."""
        self._check_open()
        return parse_usage(await self._fetch("/metrics"))

    async def object_sizes(self, keys: Sequence[str]) -> list[int]:
        """Each key's object size in bytes (-1 where there is none), asking the master in batches.
        BackendUnavailableError when the master does not answer (never "none" for every key)."""

        def sizes(store: NativeStore, batch: list[str]) -> list[int]:
            found = store.batch_get_replica_desc(batch)
            # A key left out is absent, or the master did not answer: an exists call says which
            # (an error code there, which marks the master down).
            missing = [key for key in batch if key not in found]
            codes = store.batch_is_exist(missing) if missing else []
            errors = {key: code for key, code in zip(missing, codes) if code < 0}
            return [errors.get(key, _replica_size(found.get(key))) for key in batch]

        result: list[int] = []
        for start in range(0, len(keys), self.config.max_batch):
            result += await self._key_call("size", keys[start : start + self.config.max_batch], sizes)
        bad = [c for c in result if c < -1]
        if bad:
            raise BackendUnavailableError(f"Mooncake could not tell object sizes: {code_name(bad[0])}")
        return result

    async def _fetch(self, path: str) -> str:
        host, port, timeout_s = self.config.master_host, self.config.metrics_port, self.config.timeout_s
        with anyio.move_on_after(2 * timeout_s + 1.0):  # (the thread ends by then: admin.fetch)
            return await anyio.to_thread.run_sync(
                lambda: fetch(host, port, path, timeout_s), abandon_on_cancel=True
            )
        raise BackendUnavailableError(
            f"the Mooncake master at {host}:{port} did not answer {path} within {2 * timeout_s + 1.0:g} s; "
            "give it longer with timeout=N in the mooncake:// URL"
        )

    async def _key_call(
        self, op: str, keys: Sequence[str], call: Callable[[NativeStore, list[str]], list[int]]
    ) -> list[int]:
        """A call that names keys and touches no caller memory: bounded by ``timeout_s`` and
        abandoned after it. BackendUnavailableError (and the master marked down) when it cannot run."""
        self._check_open()
        if not keys:
            return []
        store = await self._usable_store()
        if store is None:
            self._check_open()  # (closed meanwhile: say so, not that the master is down)
            raise BackendUnavailableError(self._health.describe())
        batch, timeout_s = list(keys), self.config.timeout_s
        try:
            codes = await self._calls.run(
                self._unless_closed(lambda: call(store, batch)), timeout_s=timeout_s
            )
        except ClientBusy:  # the master may be fine: this client's threads all move objects
            raise BackendUnavailableError(
                f"Mooncake {op} of {len(batch)} keys not started within {timeout_s:.1f} s: every one of the "
                f"client's {self.config.max_concurrency} worker threads ran a put or get all that time "
                "(raise max_concurrency, the URL's concurrency, or timeout_s)"
            ) from None
        except (TimeoutError, SlotsBusy) as exc:
            self._mark_down(f"{op} of {len(batch)} keys: {_explain(exc, timeout_s)}")
            raise BackendUnavailableError(self._health.describe()) from None
        down = MASTER_DOWN.intersection(codes)
        if down:
            self._mark_down(f"{op} got {code_name(min(down))}")
            raise BackendUnavailableError(self._health.describe())
        return codes

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        """Store objects that are not stored yet; an existing key is ``PRESENT`` and kept as is
        (``STORED`` with ``check_present=False``: Mooncake keeps the old value either way)."""
        self._check_open()
        check_objects(objects)
        results = [PutStatus.FAILED] * len(objects)
        unique, repeats = dedupe(objects)
        store = await self._usable_store()
        if store is not None and unique:
            replicate = self._replicate
            for chunk, check in self._put_plan(objects, unique):
                outcome = await self._in_chunk(
                    chunk, functools.partial(put_chunk, store, objects, replicate=replicate, check=check)
                )
                if outcome is not None:
                    self._note_failures("put", put_results(objects, chunk, outcome, results))
                if not self._health.healthy:  # the rest would wait ~4.5 s per chunk to fail too
                    break
        for i, first in repeats:
            results[i] = PutStatus.PRESENT if results[first] is PutStatus.STORED else results[first]
        self._stats.count_puts(objects, results)
        return results

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        """Fill each object's regions; ``MISS`` leaves them untouched. A key asked for twice fills
        both objects (in separate native calls: :func:`~kvflow.backends.mooncake.calls.distinct_rounds`)."""
        self._check_open()
        check_objects(objects)
        results = [GetStatus.FAILED] * len(objects)
        store = await self._usable_store()
        if store is not None:
            for indices in distinct_rounds(objects):
                if self._closed:  # closed between two rounds: plan nothing (no new staging)
                    break
                for chunk in self._plan(objects, indices):
                    outcome = await self._in_chunk(chunk, lambda c: get_chunk(store, objects, c))
                    if outcome is not None:
                        self._note_failures("get", get_results(objects, chunk, outcome, results))
                    if not self._health.healthy:
                        break
                if not self._health.healthy:
                    break
        self._stats.count_gets(objects, results)
        return results

    # -- connection and health ------------------------------------------------------------------

    async def _usable_store(self) -> NativeStore | None:
        """The client if it may be called now; None (fail fast) while the master is down."""
        store = self._store
        if store is None:
            try:
                return await self._connected_store()
            except BackendUnavailableError:
                return None
        if self._health.healthy:
            return store
        if not self._health.claim_probe():
            return None
        ok, reason = False, "the probe was cancelled"
        try:
            ok, reason = await self._probe(store)
        except PoolClosedError:  # aclose began: a put or get fails, a key call says it was closed
            return None
        finally:  # also when the caller gave up meanwhile: the next call may probe again
            self._health.end_probe(ok, reason)
        if ok:
            log.warning("the Mooncake master at %s is reachable again", self.config.master)
            return store
        return None

    async def _connected_store(self) -> NativeStore:
        """Set the client up: the first time, or once a failed setup may be retried.

        A setup that failed, or that its caller gave up on (cancelled: its thread may still run),
        marks the master down, so that one call per health interval tries again; after failed
        Mooncake setups the interval doubles each time (:meth:`_back_off`)."""
        claimed = False
        if self._attempted:
            if not self._health.claim_probe():
                raise BackendUnavailableError(self._health.describe())
            claimed = True
        ok, reason = False, "a setup was given up by its caller before it ended"
        try:
            async with self._connect_lock:
                if self._store is None:
                    if self._attempted and not claimed:  # a concurrent first setup just failed
                        raise BackendUnavailableError(self._health.describe())
                    try:
                        store = await self._setup()
                    except BaseException as exc:
                        if isinstance(exc, Exception):
                            reason = str(exc)
                        self._attempted = True
                        self._mark_down(reason)
                        if not isinstance(exc, MasterNotListening):  # no Mooncake setup ran for that
                            self._back_off()
                        raise
                    self._attempted, self._failed_setups = True, 0
                    if self._closed:  # aclose() ran while this setup was in flight
                        await self._close_native(store)
                        self._release_staging()
                        raise PoolClosedError("the Mooncake backend was closed while it connected")
                    self._store = store
                ok = True
                return self._store
        finally:
            if claimed:
                self._health.end_probe(ok, reason)

    def _back_off(self) -> None:
        """After a failed Mooncake setup, wait 1, 2, 4... up to 16 health intervals before the next:
        each one against a master that does not answer freezes the process (Mooncake holds the
        GIL) and leaks a file descriptor (Mooncake's own leak)."""
        self._failed_setups += 1
        factor = min(2 ** (self._failed_setups - 1), _MAX_BACKOFF)
        self._health.defer_probe(factor * self.config.health_interval_s)

    async def _probe(self, store: NativeStore) -> tuple[bool, str]:
        def check() -> tuple[bool, str]:
            status = store.health_check()
            if status != 0:
                return False, f"health_check returned {status}"
            (code,) = store.batch_is_exist([_PROBE_KEY])
            return (True, "") if code >= 0 else (False, f"probe got {code_name(code)}")

        try:
            return await self._calls.run(self._unless_closed(check), timeout_s=self.config.probe_timeout_s)
        except ClientBusy:
            return False, "probe: not started, every worker thread ran a put or get"
        except (TimeoutError, SlotsBusy) as exc:
            return False, f"probe: {_explain(exc, self.config.probe_timeout_s)}"

    def _mark_down(self, reason: str) -> None:
        if self._health.healthy:
            log.warning("Mooncake master %s marked unreachable: %s", self.config.master, reason)
        self._health.mark_down(reason)

    async def _setup(self) -> NativeStore:
        store = await setup_store(self._module, self.config, self._calls)
        try:
            for addr, nbytes in self._registered.ranges():
                self._register_native(store, addr, nbytes)
            if self._staging is not None:
                self._register_native(store, self._staging.addr, self._staging.nbytes)
        except BaseException:  # connected, but unusable: close it (its segment stays mounted else)
            await self._close_native(store)
            raise
        return store

    def _register_native(self, store: NativeStore, addr: int, nbytes: int) -> None:
        rc = store.register_buffer(addr, nbytes)
        if rc != 0:
            raise BackendError(
                f"Mooncake could not register {nbytes} bytes at {addr:#x} ({code_name(rc)}); with "
                "RDMA, check the memory lock limit (ulimit -l) and that the memory is host or device memory"
            )

    def _release_staging(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    # -- native calls ---------------------------------------------------------------------------

    def _plan(
        self, objects: Sequence[ObjectRef], indices: Sequence[int], zero_copy: Sequence[bool] | None = None
    ) -> list[Chunk]:
        """Chunks of ``objects[i] for i in indices``; ``zero_copy``: which objects lie in registered
        memory, when the caller has asked already."""
        if zero_copy is None:
            zero_copy = self._registered.covers_each(objects)
        staging = None
        if not all(zero_copy[i] for i in indices):
            staging = self._staging_buffer()
        return plan_chunks(objects, indices, zero_copy, max_batch=self.config.max_batch, staging=staging)

    def _put_plan(self, objects: Sequence[ObjectRef], unique: list[int]) -> list[tuple[Chunk, bool]]:
        """The chunks of a put, each with whether it asks first which keys exist: not for keys that
        :meth:`exists` has just answered absent (the pool's exists-skip), else ``check_present``."""
        if not self.config.check_present:
            return [(chunk, False) for chunk in self._plan(objects, unique)]
        fresh = self._absent.take([objects[i].key for i in unique])
        known = [i for i, f in zip(unique, fresh) if f]
        unknown = [i for i, f in zip(unique, fresh) if not f]
        groups, zero_copy = ((known, False), (unknown, True)), self._registered.covers_each(objects)
        return [
            (chunk, check)
            for indices, check in groups
            if indices
            for chunk in self._plan(objects, indices, zero_copy)
        ]

    def _staging_buffer(self) -> StagingBuffer | None:
        if self._staging is None and self.config.staging_bytes:
            staging = StagingBuffer(self.config.staging_bytes)
            if self._store is not None:
                self._register_native(self._store, staging.addr, staging.nbytes)
            self._staging = staging
        return self._staging

    async def _in_chunk(self, chunk: Chunk, call: Callable[[Chunk], T]) -> T | None:
        """Run one chunk's native call (a put or get: it reads or writes caller memory, so
        :meth:`aclose` waits for it); None if it could not run (the master is marked down, or the
        backend is closing)."""
        if self._closed:
            return None
        started = time.monotonic()
        native = self._unless_closed(lambda: call(chunk))
        try:
            with self._copies.running():
                if chunk.staged:
                    async with self._staging_lock:
                        outcome = await self._calls.run(native, timeout_s=None)
                else:
                    outcome = await self._calls.run(native, timeout_s=None)
        except SlotsBusy as exc:
            self._mark_down(_explain(exc, self.config.timeout_s))
            return None
        except PoolClosedError:  # aclose began while it waited (for the staging buffer, a thread)
            return None
        elapsed = time.monotonic() - started
        if elapsed > self.config.timeout_s:
            log.warning("a Mooncake call for %d objects took %.1f s", len(chunk.keys), elapsed)
        return outcome

    def _note_failures(self, op: str, codes: list[int]) -> None:
        """Mark the master down on its codes; log failures: objects not ready yet (being written,
        lease run out) at debug level, others as a warning at most once per ``_WARN_EVERY_S`` per
        operation, with how many failed since (``stats()`` counts every one)."""
        if not codes:
            return
        down = MASTER_DOWN.intersection(codes)
        if down:
            self._mark_down(f"{op} got {code_name(min(down))}")
        names = ", ".join(sorted({code_name(c) for c in codes}))
        if NOT_READY.issuperset(codes):
            log.debug("Mooncake %s: %d object(s) not ready (%s)", op, len(codes), names)
            return
        now = time.monotonic()
        if now < self._logged_at.get(op, -math.inf) + _WARN_EVERY_S:
            self._unlogged[op] = self._unlogged.get(op, 0) + len(codes)
            return
        self._logged_at[op], earlier = now, self._unlogged.pop(op, 0)
        more = f"; {earlier} more since the last such message" if earlier else ""
        log.warning("Mooncake %s: %d object(s) failed (%s)%s", op, len(codes), names, more)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the Mooncake backend was closed; open a new one")

    def _unless_closed(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` for a worker thread, refused there (PoolClosedError) once :meth:`aclose` has
        begun: checked while the call holds its slot, which the close of the client waits for, so
        no call reaches a client that was closed (Mooncake crashes the process on one)."""

        def guarded() -> T:
            self._check_open()
            return fn()

        return guarded


def _replica_size(replicas: object) -> int:
    """The size of the first memory replica in Mooncake's replica descriptors, or -1."""
    for replica in replicas if isinstance(replicas, list) else ():
        if replica.is_memory_replica():
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
    return -1


def _explain(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, SlotsBusy):
        return "every worker slot is held by a Mooncake call that has not returned"
    return f"no answer within {timeout_s:.1f} s"
