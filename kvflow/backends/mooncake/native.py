"""The slice of Mooncake's Python client kvflow uses: lazy import, typed surface, return codes.

``mooncake.store.MooncakeDistributedStore`` is a pybind11 class whose calls block and release the
GIL. Its batch calls return one int per key: ``>= 0`` success (a get returns the bytes read), or a
negative Mooncake ``ErrorCode``. The codes kvflow tells apart are below; the rest are failures.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, cast

from kvflow.backends.mooncake.config import MooncakeConfig
from kvflow.backends.mooncake.threads import NativeCalls, SlotsBusy
from kvflow.errors import BackendUnavailableError, MissingDependencyError

__all__ = [
    "INVALID_PARAMS",
    "MASTER_DOWN",
    "NO_SPACE",
    "OBJECT_NOT_FOUND",
    "RPC_FAIL",
    "RPC_TIMEOUT",
    "TRANSFER_FAIL",
    "NativeStore",
    "code_name",
    "load_store_module",
    "new_replicate_config",
    "setup_retries_env",
    "setup_store",
]

log = logging.getLogger(__name__)

NO_SPACE = -200  # no segment has room; the master evicts about 5% later (on its own schedule)
INVALID_PARAMS = -600  # bad arguments; also "destination regions smaller than the object"
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the data transfer failed: peer gone, or regions larger than the object
RPC_FAIL = -900  # the master cannot be reached
RPC_TIMEOUT = -901  # the master did not answer in time (stalled, or overloaded)
#: Codes that mean the master is not answering: the backend marks it down.
MASTER_DOWN = frozenset({RPC_FAIL, RPC_TIMEOUT})

_NAMES = {
    NO_SPACE: "NO_SPACE",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
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


@contextmanager
def setup_retries_env(retries: int) -> Iterator[None]:
    """Set ``MC_STORE_CLIENT_SETUP_RETRIES`` around ``setup`` (Mooncake reads it only there).

    The variable is process-wide; it is restored afterwards. Call from the event loop thread, with
    setups of this process serialized (the backend holds its connect lock).
    """
    previous = os.environ.get(SETUP_RETRIES_ENV)
    os.environ[SETUP_RETRIES_ENV] = str(retries)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(SETUP_RETRIES_ENV, None)
        else:
            os.environ[SETUP_RETRIES_ENV] = previous


def _abandon(store: NativeStore, lock: threading.Lock, state: dict[str, object]) -> None:
    """Nobody waits for this setup any more: its thread closes the client if it succeeds, and a
    setup that already succeeded is closed now (no segment stays mounted for nobody)."""
    with lock:
        state["abandoned"] = True
        if state.get("rc") == 0:
            store.close()


async def setup_store(module: StoreModule, config: MooncakeConfig, calls: NativeCalls) -> NativeStore:
    """A new client set up against the master; BackendUnavailableError if that fails or overruns.

    Mooncake retries ``setup_retries`` times (about 4.4 s each when the master is down) before it
    gives up; ``setup_timeout_s`` bounds the wait for it. A setup abandoned by that timeout that
    succeeds later closes its client at once, so no orphan segment stays mounted.
    """
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

    started = time.monotonic()
    try:
        with setup_retries_env(config.setup_retries):
            rc = await calls.run(setup, timeout_s=config.setup_timeout_s)
    except (TimeoutError, SlotsBusy) as exc:
        _abandon(store, lock, state)
        why = "a worker slot is free" if isinstance(exc, SlotsBusy) else "it finished"
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
