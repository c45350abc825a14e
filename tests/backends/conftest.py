"""Fixtures for the backend tests: for Mooncake a real master on loopback and backends closed for
you; for the local backend a directory entry that vanishes while it is listed.

Mooncake opens listening ports on every interface, so these fixtures run only inside a private
network namespace that has nothing but loopback. Elsewhere the tests that use them are skipped, or
fail when ``KVFLOW_REQUIRE_MOONCAKE=1`` (CI). Run them as root::

    unshare -n bash -c 'ip link set lo up; export MC_TCP_BIND_ADDRESS=127.0.0.1 KVFLOW_REQUIRE_MOONCAKE=1;
        .venv/bin/pytest tests/backends/test_mooncake.py -x -q'
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvflow.backends.mooncake import MooncakeBackend
from kvflow.tools.mooncake_master import (
    MasterProcess,
    NotIsolatedError,
    check_private_netns,
    free_port,
    start_master,
)

REQUIRE_ENV = "KVFLOW_REQUIRE_MOONCAKE"


def mooncake_unusable_reason() -> str | None:
    """Why Mooncake tests cannot run here, or None when they can."""
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake client is not installed (pip install 'kvflow[mooncake]')"
    try:
        check_private_netns()
    except NotIsolatedError as exc:
        return f"not in a private network namespace with only loopback: {exc}"
    return None


@pytest.fixture(scope="session")
def mooncake_isolated() -> None:
    """Skip (or fail, with KVFLOW_REQUIRE_MOONCAKE=1) unless Mooncake may run in this process."""
    reason = mooncake_unusable_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def mooncake_master(
    mooncake_isolated: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MasterProcess]:
    """One master for the session, on free loopback ports."""
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    master = start_master(rpc_port=free_port(), metrics_port=free_port(), log_path=log)
    yield master
    master.stop()


MasterFactory = Callable[..., MasterProcess]


@pytest.fixture
def mooncake_master_factory(mooncake_isolated: None, tmp_path: Path) -> Iterator[MasterFactory]:
    """Start private masters for one test (to kill, restart or fill); all stopped at teardown.

    ``start(rpc_port=None, extra_args=())``: ``rpc_port`` reuses a port (a restart).
    """
    started: list[MasterProcess] = []

    def start(*, rpc_port: int | None = None, extra_args: Sequence[str] = ()) -> MasterProcess:
        master = start_master(
            rpc_port=rpc_port or free_port(),
            metrics_port=free_port(),
            extra_args=extra_args,
            log_path=tmp_path / f"master{len(started)}.log",
        )
        started.append(master)
        return master

    yield start
    for master in started:
        master.stop()


@pytest.fixture
async def mooncake_backends() -> AsyncIterator[Callable[[str], MooncakeBackend]]:
    """``make(url)`` -> a MooncakeBackend, closed at teardown (all at once: each close takes ~2 s)."""
    made: list[MooncakeBackend] = []

    def make(url: str) -> MooncakeBackend:
        backend = MooncakeBackend.from_url(url)
        made.append(backend)
        return backend

    yield make
    async with anyio.create_task_group() as tg:
        for backend in made:
            tg.start_soon(backend.aclose)


# --- the local backend ----------------------------------------------------------------------------


class _Vanished:
    """A directory entry removed between the listing and its stat."""

    def __init__(self, name: str) -> None:
        self.name = name

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.name)


@pytest.fixture
def vanish_first_entry(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to make every ``os.scandir`` list its entries by name, the first of them removed
    (by another process) between the listing and its stat."""
    real_scandir = os.scandir

    @contextlib.contextmanager
    def first_vanishes(fd: Any) -> Iterator[Any]:
        with real_scandir(fd) as entries:
            listed = sorted(entries, key=lambda e: e.name)
            yield iter([_Vanished(listed[0].name), *listed[1:]] if listed else [])

    return lambda: monkeypatch.setattr(os, "scandir", first_vanishes)
