"""The Mooncake backend recovers, and says why it cannot: a probe or connect its caller gave up
on, a master that stalls (RPC_TIMEOUT), memory registered in overlapping ranges. A real master on
loopback, inside a private network namespace (tests/backends/conftest.py)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import anyio
import pytest

from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.mooncake import MooncakeBackend
from kvflow.errors import BackendUnavailableError
from kvflow.regions import buffer_address
from kvflow.tools.mooncake_master import MasterProcess, free_port

MakeBackend = Callable[[str], MooncakeBackend]


@pytest.mark.mooncake
async def test_a_cancelled_probe_does_not_stop_recovery(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    """docs/mooncake.md "When the master goes away": while the master is down, "at most once per
    health_interval one call (lazily, no background task) probes"; "after the master restarts ...
    the same backend stores and reads again, with no reconnect by the caller". A caller's
    cancellation (the pool's fail_after) may hit the call that is probing: the gate must still
    probe again later, else the backend never recovers."""
    master = mooncake_master_factory()
    backend = mooncake_backends(
        master.url(segment="16MiB", timeout=0.5, health_interval=0.2, probe_timeout=2)
    )
    buf = bytearray(b"x" * 4096)
    backend.register_memory(buffer_address(buf), len(buf))
    key = f"recovery/{uuid.uuid4().hex}"
    assert await backend.put([ObjectRef.of(key, [buffer_address(buf)], [4096])]) == [PutStatus.STORED]

    pid = master.process.pid
    os.kill(pid, signal.SIGSTOP)  # a stalled master
    try:
        with pytest.raises(BackendUnavailableError):
            await backend.exists([key])  # times out after 0.5 s: master marked down
        assert not backend.health().reachable
        await anyio.sleep(0.3)  # the next call may probe
        with anyio.move_on_after(0.3) as scope:  # the caller gives up while the probe waits
            await backend.exists([key])
        assert scope.cancelled_caught, "the probe was expected to be waiting on the stalled master"
    finally:
        os.kill(pid, signal.SIGCONT)
    master.wait_healthy(10)

    deadline = time.monotonic() + 20
    while True:
        try:
            assert await backend.exists([key]) == [True]
            break
        except BackendUnavailableError as exc:
            assert time.monotonic() < deadline, f"never recovered after the master came back: {exc}"
            await anyio.sleep(0.3)
    assert backend.health().reachable


@pytest.mark.mooncake
async def test_a_cancelled_connect_is_retried(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    """docs/mooncake.md "What each call does": "The client connects on await backend.connect() (or
    async with), else lazily on the first call. A lazy connect that fails ... is retried at most
    once per health_interval." A caller that gives up on a connect (its own timeout) must not leave
    the backend refusing every later call while the master is healthy."""
    backend = mooncake_backends(mooncake_master.url(segment="16MiB", health_interval=0.2))
    with anyio.move_on_after(0.002) as scope:
        await backend.connect()
    assert scope.cancelled_caught, "the setup finished before the cancellation; shorten the delay"
    buf = bytearray(b"y" * 4096)
    backend.register_memory(buffer_address(buf), len(buf))
    obj = ObjectRef.of(f"recovery/{uuid.uuid4().hex}", [buffer_address(buf)], [4096])
    deadline = time.monotonic() + 15
    while True:
        await anyio.sleep(0.3)
        try:
            assert await backend.exists([obj.key]) == [False]
            break
        except BackendUnavailableError as exc:
            assert time.monotonic() < deadline, (
                f"the backend never connected after a cancelled connect: {exc}"
            )
    assert await backend.put([obj]) == [PutStatus.STORED]


@pytest.mark.mooncake
async def test_a_master_started_after_a_timed_out_first_lookup_is_used(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    """The engine starts before the master. Its first lookup (the pool wraps ``exists`` in
    ``fail_after(deadline)``, kvflow/transfer/core.py) fails: nothing listens at the master's port.
    docs/mooncake.md: a lazy connect that fails "is retried at most once per health_interval", and
    once the master is up "the same backend stores and reads again, with no reconnect by the
    caller"."""
    port = free_port()
    backend = mooncake_backends(
        f"mooncake://127.0.0.1:{port}?segment=16MiB&health_interval=0.2&setup_retries=1"
    )
    with pytest.raises(BackendUnavailableError, match="nothing accepts connections"):
        with anyio.fail_after(1.0):  # as KVPool's lookup does
            await backend.exists(["k"])  # (fails at once: nothing listens at the master's port)
    mooncake_master_factory(rpc_port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            assert await backend.exists(["k"]) == [False]
            break
        except BackendUnavailableError as exc:
            assert time.monotonic() < deadline, f"the backend never used the master that came up: {exc}"
            await anyio.sleep(0.5)


@pytest.mark.mooncake
async def test_a_stalled_master_is_marked_down_by_a_put(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    """docs/mooncake.md "When the master goes away": "kvflow's health gate turns this into fast
    answers. A -900, a timeout or busy slots mark the master down. While down, put/get report
    FAILED ... at once". A master that stops answering (SIGSTOP) makes every Mooncake call wait
    about 30 s and return RPC_TIMEOUT (-901): that is a timeout of the master too. A put of two
    chunks must not wait that long twice, and the gate must be down after it."""
    master = mooncake_master_factory()
    backend = mooncake_backends(master.url(segment="16MiB", max_batch=1, health_interval=60))
    buf = bytearray(b"s" * 8192)
    backend.register_memory(buffer_address(buf), len(buf))
    keys = [f"recovery/{uuid.uuid4().hex}/{i}" for i in range(2)]
    objects = [ObjectRef.of(k, [buffer_address(buf) + 4096 * i], [4096]) for i, k in enumerate(keys)]
    await backend.connect()
    pid = master.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert await backend.put(objects) == [PutStatus.FAILED] * 2
        elapsed = time.monotonic() - started
        health = backend.health()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not health.reachable, "the stalled master was not marked down: every later call waits ~30 s again"
    assert elapsed < 45, f"the put waited {elapsed:.0f} s: Mooncake's 30 s wait once per chunk"


@pytest.mark.mooncake
async def test_registering_a_larger_range_over_a_registered_one_before_connect(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    """docs/mooncake.md: ``register_memory(addr, nbytes)`` registers memory "now, or at connect";
    a range inside one already registered is skipped (staging.RegisteredMemory.add). A range that
    grows one registered before (a pool registering a whole allocation after one of its tensors)
    is refused by Mooncake as an overlap (-600): the backend must still connect and store, not
    fail its setup and then refuse every call while saying "the Mooncake master is reachable"."""
    backend = mooncake_backends(mooncake_master.url(segment="16MiB"))
    buf = bytearray(b"r" * 65536)
    addr = buffer_address(buf)
    backend.register_memory(addr, 4096)
    backend.register_memory(addr, 65536)  # grows the first range
    obj = ObjectRef.of(f"recovery/{uuid.uuid4().hex}", [addr + 8192], [4096])
    first = await backend.put([obj])
    second = await backend.put([obj])
    assert (first, second) in (([PutStatus.STORED], [PutStatus.PRESENT]),), (first, second)
    out = bytearray(4096)
    assert await backend.get([ObjectRef.of(obj.key, [buffer_address(out)], [4096])]) == [GetStatus.HIT]
