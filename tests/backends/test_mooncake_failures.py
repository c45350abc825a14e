"""What a Mooncake master that is missing, or that cannot start, costs the rest of the process.

Mooncake's ``setup`` against a master that does not answer holds the GIL about 4.4 s per attempt
(no Python thread runs) and leaks a file descriptor each time; the backend checks the master's
port first (and backs off failed setups: tests/backends/test_mooncake.py, with a fake client).
Real Mooncake, inside the private network namespace that tests/backends/conftest.py requires.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from kvflow.errors import BackendUnavailableError
from kvflow.tools.mooncake_master import free_port, start_master
from tests.backends.conftest import MasterFactory
from tests.backends.test_mooncake import MakeBackend


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def longest_stall() -> Iterator[list[float]]:
    """A plain thread that sleeps 5 ms at a time; yields a list that holds, once the block ends,
    the longest time it could not run (the GIL held by a native call, say)."""
    stop, gaps = threading.Event(), [0.0]

    def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps[0], last = max(gaps[0], now - last), now

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield gaps
    finally:
        stop.set()
        thread.join()


@pytest.mark.mooncake
async def test_a_master_that_is_not_running_fails_connects_fast_and_freezes_no_thread(
    mooncake_isolated: None, mooncake_backends: MakeBackend
) -> None:
    """Nothing listens at the master's port: a connect fails within ``setup_timeout`` (at once,
    in fact), retries cost as little, no other thread stalls, and no file descriptor leaks."""
    backend = mooncake_backends(
        f"mooncake://127.0.0.1:{free_port()}?segment=16MiB&setup_retries=1&setup_timeout=2&health_interval=0.05"
    )
    fds = open_fds()
    with longest_stall() as stall:
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError, match="start mooncake_master"):
            await backend.connect()
        assert time.monotonic() - started < 3.0  # setup_timeout and some slack; Mooncake's own: 4.4 s
        for _ in range(10):  # each retry (one per health interval) as cheap
            await anyio.sleep(0.06)
            with pytest.raises(BackendUnavailableError):
                await backend.exists(["k"])
    assert stall[0] < 1.0, f"a Python thread could not run for {stall[0]:.1f} s"
    assert open_fds() - fds <= 2


@pytest.mark.mooncake
def test_a_master_whose_ports_another_master_holds_is_refused(
    mooncake_master_factory: MasterFactory, tmp_path: Path
) -> None:
    """The second master exits with code 1; its start must say so, not return a handle whose URL
    names the first master (whose /health answered for it)."""
    first = mooncake_master_factory()
    for rpc_port, metrics_port in ((first.rpc_port, free_port()), (free_port(), first.metrics_port)):
        log = tmp_path / f"second-{rpc_port}-{metrics_port}.log"
        with pytest.raises(BackendUnavailableError, match="exited with code 1") as info:
            start_master(rpc_port=rpc_port, metrics_port=metrics_port, log_path=log).stop()
        assert "in use" in str(info.value) and str(log) in str(info.value)
    assert first.alive() and first.healthy()
