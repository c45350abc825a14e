"""Listing and clearing a Mooncake cluster (``kvflow store`` on mooncake://), against a real master
in a private network namespace (see ``conftest.py``): keys from the master's HTTP port, sizes from
the client, usage from the master's metrics; a model's objects removed, other keys left alone."""

from __future__ import annotations

import ctypes
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends.base import ObjectRef, PutStatus
from kvflow.backends.mooncake import MooncakeBackend
from kvflow.backends.mooncake.admin import fetch, parse_keys, parse_usage
from kvflow.errors import BackendUnavailableError
from kvflow.tools.mooncake_master import MasterProcess
from kvflow.tools.store_admin import clear_store, read_inventory

MakeBackend = Callable[[str], MooncakeBackend]
BLOCK = 4


def test_a_master_that_answers_too_slowly_is_a_clear_error_within_the_bound() -> None:
    """A master whose key listing trickles in (a line every 0.2 s for 6 s) is given up once
    ``timeout_s`` passed, with an error that says how to give it longer, not a bare timeout after
    the whole answer came."""
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:

        def trickle() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                for i in range(30):
                    if stop.wait(0.2):
                        return
                    conn.sendall(f"key-{i}\n".encode())

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        started = time.monotonic()
        try:
            with pytest.raises(BackendUnavailableError, match="timeout=N"):
                fetch("127.0.0.1", server.getsockname()[1], "/get_all_keys", 1.0)
            assert time.monotonic() - started < 3.0
        finally:
            stop.set()
            thread.join(5)


def test_master_answers_are_parsed() -> None:
    assert parse_keys("a\nb c\n\n") == ["a", "b c"]
    text = "# HELP x\nmaster_total_capacity_bytes 6.4e+07\nmaster_allocated_bytes 16384\nmaster_key_count 4\n"
    usage = parse_usage(text)
    assert (usage.capacity_bytes, usage.used_bytes, usage.keys) == (64_000_000, 16384, 4)
    assert parse_usage("").keys == 0


@pytest.mark.mooncake
async def test_store_admin_lists_and_clears_a_models_objects(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    # Short leases: reading an object's size leases it, and a leased object cannot be removed.
    master = mooncake_master_factory(extra_args=["--default_kv_lease_ttl=200"])
    url = master.url(segment="32MiB", metrics_port=master.metrics_port)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(8, 2, BLOCK, 16) for i in range(2)}
    layout = KVLayout.from_kv_caches(caches)
    pools = []
    for model in ("org/a", "b"):  # each writer's segment holds its objects while it is open
        pool = KVPool.create(
            PoolConfig(backend=url, model=model), layout=layout, backend=mooncake_backends(url)
        )
        stored = await pool.store(KVRequest(tokens=list(range(3 * BLOCK)), block_ids=[1, 2, 3]))
        assert stored.stored == 3
        pools.append(pool)
    foreign = mooncake_backends(url)
    buf = ctypes.create_string_buffer(100)
    assert await foreign.put([ObjectRef.of("not-kvflow", [ctypes.addressof(buf)], [100])]) == [
        PutStatus.STORED
    ]

    inventory = await read_inventory(url)
    stats = inventory.stats()
    assert stats["capacity_bytes"] >= 3 * (32 << 20) and stats["used_bytes"] > 0
    rows = {row["model"]: row for row in stats["models"]}
    assert sorted(rows) == ["b", "org/a"]
    for row in rows.values():
        assert row["blocks"] == 3 and row["objects"] == 3 and row["bytes"] == 3 * layout.block_nbytes
        assert row["parts"] == ["l0-2 h0-2 d0.1 p0.1"]
    assert sorted(p["model"] for p in stats["profiles"]) == ["b", "org/a"]
    assert stats["other"] == {"objects": 1, "bytes": 100}

    assert await clear_store(url, "org/a") == {
        "removed": 4,
        "failed": 0,
        "unnamed": 0,
    }  # its KV and its profile
    left = await read_inventory(url, sizes=False)
    assert {o.model for o in left.objects} == {"b", None}
    assert await clear_store(url) == {
        "removed": 4,
        "failed": 0,
        "unnamed": 0,
    }  # every kvflow object, not others'
    assert [o.key for o in (await read_inventory(url, sizes=False)).objects] == ["not-kvflow"]
    for pool in pools:
        await pool.aclose()


@pytest.mark.mooncake
async def test_listing_without_the_masters_http_port_says_how_to_fix_it(
    mooncake_master: MasterProcess,
) -> None:
    url = mooncake_master.url(segment=0, metrics_port=1, timeout=2)  # nothing listens on port 1
    with pytest.raises(BackendUnavailableError, match="metrics_port"):
        await read_inventory(url)
