"""The slice of Mooncake's Python client kvflow uses: lazy import, typed surface, return codes.

``mooncake.store.MooncakeDistributedStore`` is a pybind11 class whose calls block and release the
GIL, except ``setup`` and ``close``: they hold it (``setup`` about 4.4 s per attempt against a master
that does not answer, ``close`` about 2 s, 11 s with the master gone), so no thread of the process
runs meanwhile. :func:`setup_store` therefore checks the master's port before it calls ``setup``.

Its batch calls return one int per key: ``>= 0`` success (a get returns the bytes read), or a
negative Mooncake ``ErrorCode``. The codes kvflow tells apart are below; the rest are failures.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, cast

import anyio
import attrs

from kvflow.backends.mooncake.config import MooncakeConfig
from kvflow.backends.mooncake.threads import ClientBusy, NativeCalls, SlotsBusy
from kvflow.errors import BackendUnavailableError, MissingDependencyError

__all__ = [
    "INVALID_PARAMS",
    "LEASE_EXPIRED",
    "MASTER_DOWN",
    "NOT_READY",
    "NO_SPACE",
    "OBJECT_NOT_FOUND",
    "REPLICA_NOT_READY",
    "RPC_FAIL",
    "RPC_TIMEOUT",
    "SETUP_RETRIES_ENV",
    "TRANSFER_FAIL",
    "MasterNotListening",
    "NativeStore",
    "check_master_listens",
    "code_name",
    "load_store_module",
    "new_replicate_config",
    "setup_retries_env",
    "setup_store",
]

log = logging.getLogger(__name__)

NO_SPACE = -200  # no segment has room; the master evicts about 5% later (on its own schedule)
INVALID_PARAMS = -600  # bad arguments; also "destination regions smaller than the object"
REPLICA_NOT_READY = -703  # the object is still being written
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707  # the object's lease ran out during the transfer
TRANSFER_FAIL = -800  # the data transfer failed: peer gone, or regions larger than the object
RPC_FAIL = -900  # the master cannot be reached
RPC_TIMEOUT = -901  # the master did not answer in time (stalled, or overloaded)
#: Codes that mean the master is not answering: the backend marks it down.
MASTER_DOWN = frozenset({RPC_FAIL, RPC_TIMEOUT})
#: Codes of an object that is there but not readable this moment: expected under load, not alarming.
NOT_READY = frozenset({REPLICA_NOT_READY, LEASE_EXPIRED})

_NAMES = {
    NO_SPACE: "NO_SPACE",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"


def code_name(code: int) -> str:
    return f"{_NAMES.get(code, 'error')} ({code})"


class NativeStore(Protocol):
    """The methods of ``MooncakeDistributedStore`` kvflow calls (each blocks; GIL released)."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...

    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]], config: object
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def get_size(self, key: str) -> int: ...

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...

    def get_hostname(self) -> str: ...

    def health_check(self) -> int: ...

    def close(self) -> int: ...


class StoreModule(Protocol):
    """``mooncake.store`` as far as kvflow is concerned."""

    def MooncakeDistributedStore(self) -> NativeStore: ...

    def ReplicateConfig(self) -> object: ...


def load_store_module() -> StoreModule:
    """Import ``mooncake.store``, or explain how to install it."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise MissingDependencyError(
            "mooncake-transfer-engine",
            "The Mooncake backend",
            "pip install 'kvflow[mooncake]' (no CUDA), or pip install mooncake-transfer-engine on GPU "
            "machines; both need Debian's libibverbs1",
        ) from exc
    return cast(StoreModule, module)


def new_replicate_config(module: StoreModule, config: MooncakeConfig) -> object:
    """Mooncake's ``ReplicateConfig`` for every put of this backend."""
    replicate = module.ReplicateConfig()
    replicate.replica_num = config.replicas  # type: ignore[attr-defined]
    replicate.with_hard_pin = config.hard_pin  # type: ignore[attr-defined]
    replicate.prefer_alloc_in_same_node = config.prefer_same_node  # type: ignore[attr-defined]
    if config.preferred_segment:
        replicate.preferred_segment = config.preferred_segment  # type: ignore[attr-defined]
    return replicate


@attrs.define
class _SharedEnv:
    """A process-wide environment variable that setups set while they run: the first to begin
    saves its old value, the last to end restores it (overlapping setups, one process)."""

    name: str
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _users: int = attrs.field(default=0, init=False)
    _saved: str | None = attrs.field(default=None, init=False)

    @contextmanager
    def set(self, value: str) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._saved = os.environ.get(self.name)
            self._users += 1
            os.environ[self.name] = value
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    if self._saved is None:
                        os.environ.pop(self.name, None)
                    else:
                        os.environ[self.name] = self._saved


_SETUP_RETRIES = _SharedEnv(SETUP_RETRIES_ENV)


def setup_retries_env(retries: int) -> AbstractContextManager[None]:
    """Set ``MC_STORE_CLIENT_SETUP_RETRIES`` around ``setup`` (Mooncake reads it only there).

    The variable is process-wide: it keeps its old value (or absence) again once the last of the
    setups that overlap in this process has ended. Overlapping setups that ask for different
    retries each get the value set last.
    """
    return _SETUP_RETRIES.set(str(retries))


class MasterNotListening(BackendUnavailableError):
    """Nothing accepted a TCP connection at the master's address; no Mooncake setup was tried."""


async def check_master_listens(config: MooncakeConfig, timeout_s: float) -> None:
    """Raise MasterNotListening unless the master's RPC port accepts a TCP connection within
    ``timeout_s``.

    Mooncake's ``setup`` against a master that is not there holds the GIL for about 4.4 s per
    attempt (no Python thread of the process runs meanwhile, so no timeout can fire) and leaks a
    file descriptor each time. This check costs one TCP handshake and blocks no thread.
    """
    try:
        with anyio.fail_after(timeout_s):
            stream = await anyio.connect_tcp(config.master_host, config.master_port)
    except TimeoutError:
        why = f"no answer within {timeout_s:.1f} s"
    except OSError as exc:  # anyio puts the errors of each address it tried in __cause__
        causes = getattr(exc.__cause__, "exceptions", None) or [exc.__cause__ or exc]
        why = "; ".join(str(cause) for cause in causes)
    else:
        await stream.aclose()
        return
    raise MasterNotListening(
        f"nothing accepts connections at the Mooncake master address {config.master} ({why}): "
        "start mooncake_master there, or correct the address"
    )


def _abandon(store: NativeStore, lock: threading.Lock, state: dict[str, object]) -> None:
    """Nobody waits for this setup any more: its thread closes the client if it succeeds, and a
    setup that already succeeded is closed now (no segment stays mounted for nobody)."""
    with lock:
        state["abandoned"] = True
        if state.get("rc") == 0:
            store.close()


async def setup_store(module: StoreModule, config: MooncakeConfig, calls: NativeCalls) -> NativeStore:
    """A new client set up against the master; BackendUnavailableError if that fails or overruns
    (MasterNotListening, and no Mooncake call, when nothing accepts connections at its address).

    Mooncake retries ``setup_retries`` times (about 4.4 s each when the master is down) before it
    gives up; ``setup_timeout_s`` bounds the check of the master's port and the wait for the
    setup together. A setup abandoned by that timeout that succeeds later closes its client at
    once, so no orphan segment stays mounted.
    """
    started = time.monotonic()
    await check_master_listens(config, config.setup_timeout_s)
    store = module.MooncakeDistributedStore()
    lock = threading.Lock()
    state: dict[str, object] = {"abandoned": False}

    def setup() -> int:
        rc = store.setup(
            config.client_hostname,
            config.metadata_server,
            config.segment_bytes,
            config.buffer_bytes,
            config.protocol,
            config.device_name,
            config.master,
        )
        with lock:
            state["rc"] = rc
            if state["abandoned"] and rc == 0:
                store.close()
        return rc

    left_s = max(config.setup_timeout_s - (time.monotonic() - started), 0.01)
    try:
        with setup_retries_env(config.setup_retries):
            rc = await calls.run(setup, timeout_s=left_s)
    except (TimeoutError, SlotsBusy, ClientBusy) as exc:
        _abandon(store, lock, state)
        why = "it finished" if isinstance(exc, TimeoutError) else "a worker thread was free"
        raise BackendUnavailableError(
            f"Mooncake setup against the master at {config.master} was given up before {why} "
            f"(setup_timeout={config.setup_timeout_s:g} s): check that mooncake_master runs there"
        ) from None
    except BaseException:  # the caller gave up (cancelled): the same
        _abandon(store, lock, state)
        raise
    if rc == INVALID_PARAMS:
        raise BackendUnavailableError(
            f"Mooncake rejected the setup parameters ({code_name(rc)}): segment={config.segment_bytes}, "
            f"buffer={config.buffer_bytes}, protocol={config.protocol!r}, device={config.device_name!r}; "
            "its log on stderr says which"
        )
    if rc != 0:
        raise BackendUnavailableError(
            f"Mooncake setup against the master at {config.master} failed (code {rc}) after "
            f"{time.monotonic() - started:.1f} s and {config.setup_retries} attempt(s): check that "
            f"mooncake_master runs there, and that protocol={config.protocol!r} and "
            f"local_hostname={config.client_hostname!r} suit this host"
        )
    log.info("Mooncake client %s connected to %s", config.client_hostname, config.master)
    return store
