"""The Mooncake backend against a real master on loopback (see conftest.py for how to run it).

The first tests need no master (configuration, health gate, staging plans, isolation checks). The
rest start real masters and clients inside the test's private network namespace. This module is
also the peer program of the two-process tests: ``python -m tests.backends.test_mooncake peer ...``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar, cast

import anyio
import anyio.to_thread
import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.mooncake import MooncakeBackend
from kvflow.backends.mooncake import backend as backend_module
from kvflow.backends.mooncake.calls import distinct_rounds, put_chunk, put_results
from kvflow.backends.mooncake.config import MooncakeConfig, parse_mooncake_size
from kvflow.backends.mooncake.health import HealthGate
from kvflow.backends.mooncake.native import RPC_FAIL, SETUP_RETRIES_ENV, NativeStore, setup_retries_env
from kvflow.backends.mooncake.staging import RegisteredMemory, StagingBuffer, plan_chunks
from kvflow.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    MissingDependencyError,
    PoolClosedError,
)
from kvflow.layout import KVCacheEntry, KVFormat, KVLayout
from kvflow.regions import buffer_address
from kvflow.request import KVRequest
from kvflow.tools.mooncake_master import MasterProcess, NotIsolatedError, free_port, start_segment_holder

MakeBackend = Callable[[str], MooncakeBackend]
REPO = Path(__file__).resolve().parents[2]


# -- memory helpers -------------------------------------------------------------------------------


class Slab:
    """A bytearray and its address: seeded random content, or zeros."""

    def __init__(self, nbytes: int, seed: int | None = None, fill: int = 0) -> None:
        if seed is None:
            self.buf = bytearray([fill]) * nbytes
        else:
            self.buf = bytearray(random.Random(seed).randbytes(nbytes))
        self.addr = buffer_address(self.buf)

    def read(self, obj: ObjectRef) -> bytes:
        return b"".join(
            bytes(self.buf[a - self.addr : a - self.addr + n]) for a, n in zip(obj.addrs, obj.sizes)
        )

    def register(self, backend: MooncakeBackend) -> Slab:
        backend.register_memory(self.addr, len(self.buf))
        return self


def scattered(key: str, slab: Slab, start: int, nbytes: int, pieces: int, rng: random.Random) -> ObjectRef:
    """An object of ``nbytes`` at ``slab[start:]`` cut into ``pieces`` regions, in shuffled order."""
    cuts = sorted(rng.sample(range(1, nbytes), pieces - 1)) if pieces > 1 else []
    bounds = [0, *cuts, nbytes]
    parts = [(slab.addr + start + bounds[i], bounds[i + 1] - bounds[i]) for i in range(pieces)]
    rng.shuffle(parts)
    return ObjectRef.of(key, [a for a, _ in parts], [n for _, n in parts])


def contiguous(key: str, slab: Slab, start: int, nbytes: int) -> ObjectRef:
    return ObjectRef.of(key, [slab.addr + start], [nbytes])


def layout_of(caches: dict[str, object]) -> KVLayout:
    """The layout of test caches (tests.helpers builds them as plain dicts)."""
    return KVLayout.from_kv_caches(cast("dict[str, KVCacheEntry]", caches))


def prefix() -> str:
    return f"test/{uuid.uuid4().hex[:12]}/"


# -- configuration (no master needed) -------------------------------------------------------------


def test_a_get_asks_for_each_key_once_per_native_call() -> None:
    """Round n holds the n-th copy of each key, in the objects' order; no round names a key twice."""
    keys = ["a", "b", "a", "c", "a", "b"]
    objects = [ObjectRef.of(k, [4096 * i], [8]) for i, k in enumerate(keys)]
    assert distinct_rounds(objects) == [[0, 1, 3], [2, 5], [4]]
    assert distinct_rounds(objects[:2]) == [[0, 1]]
    assert distinct_rounds([]) == []


def test_url_sets_every_option() -> None:
    cfg = MooncakeConfig.from_url(
        "mooncake://127.0.0.1:50099?segment=1GiB&buffer=256MiB&protocol=tcp&replicas=2"
        "&preferred_segment=127.0.0.1:1234&prefer_same_node=true&hard_pin=1&setup_retries=2"
        "&setup_timeout=12.5&timeout=3&health_interval=0.5&probe_timeout=0.75&max_batch=64"
        "&concurrency=8&staging=8MiB&local_hostname=127.0.0.1&metadata=P2PHANDSHAKE&device="
    )
    assert cfg.master == "127.0.0.1:50099"
    assert (cfg.segment_bytes, cfg.buffer_bytes, cfg.staging_bytes) == (1 << 30, 256 << 20, 8 << 20)
    assert (cfg.replicas, cfg.preferred_segment, cfg.prefer_same_node, cfg.hard_pin) == (
        2,
        "127.0.0.1:1234",
        True,
        True,
    )
    assert (cfg.setup_retries, cfg.setup_timeout_s, cfg.timeout_s) == (2, 12.5, 3.0)
    assert (cfg.health_interval_s, cfg.probe_timeout_s, cfg.max_batch, cfg.max_concurrency) == (
        0.5,
        0.75,
        64,
        8,
    )
    assert MooncakeConfig.from_url("mooncake://127.0.0.1").master == "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mooncake://127.0.0.1:1?segmnt=1GiB", "segmnt"),
        ("mooncake://127.0.0.1:1?replicas=0", "replicas"),
        ("mooncake://127.0.0.1:1?timeout=soon", "timeout"),
        ("mooncake://127.0.0.1:1?hard_pin=maybe", "hard_pin"),
        ("mooncake://127.0.0.1:1?segment=lots", "lots"),
        ("mooncake://kv-master.example:50051", "local_hostname"),
        ("mooncake://127.0.0.1:1?segment=8MiB", "16MiB"),
        ("memory://", "mooncake://"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        MooncakeConfig.from_url(url)


def test_mooncake_json_file_as_vllm_ascend_writes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "worker-a.example",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "device_name": "",
                "alloc_in_same_node": True,
                "master_server_address": "kv-master.example:50088",
                "global_segment_size": "1GB",
                "local_buffer_size": 1073741824,
                "use_ascend_direct": False,
            }
        )
    )
    cfg = MooncakeConfig.from_file(path)
    assert cfg.master == "kv-master.example:50088" and cfg.local_hostname == "worker-a.example"
    assert cfg.segment_bytes == 1 << 30 and cfg.buffer_bytes == 1 << 30  # "GB" is 2**30 there
    assert cfg.prefer_same_node
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    assert MooncakeConfig.from_env() == cfg
    # a URL can start from the file and override single values
    over = MooncakeConfig.from_url(f"mooncake://?config={path}&segment=64MiB&replicas=2")
    assert over.master == cfg.master and over.segment_bytes == 64 << 20 and over.replicas == 2


def test_bad_json_config_is_rejected_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:1", "global_segmnt_size": 5}))
    with pytest.raises(ConfigError, match="global_segmnt_size"):
        MooncakeConfig.from_file(path)
    path.write_text(json.dumps({"global_segment_size": 5}))
    with pytest.raises(ConfigError, match="master_server_address"):
        MooncakeConfig.from_file(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        MooncakeConfig.from_file(path)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeConfig.from_env()
    assert parse_mooncake_size("512MB", name="x") == 512 << 20
    with pytest.raises(ConfigError):
        parse_mooncake_size("-1", name="x")


def test_missing_package_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> object:
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(
        MissingDependencyError, match=r"pip install 'kvflow\[mooncake\]'.*libibverbs1"
    ) as info:
        MooncakeBackend.from_url("mooncake://127.0.0.1:50051")
    assert info.value.package == "mooncake-transfer-engine"


def test_master_refuses_to_start_outside_a_private_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow.tools import mooncake_master

    monkeypatch.setattr(mooncake_master, "network_interfaces", lambda: ["eth0", "lo"])
    with pytest.raises(NotIsolatedError, match="unshare -n"):
        mooncake_master.start_master()
    assert mooncake_master.main([]) == 2


def test_health_gate_fails_fast_and_probes_once_per_interval() -> None:
    now = [100.0]
    gate = HealthGate(1.0, clock=lambda: now[0])
    assert gate.healthy and not gate.claim_probe()
    gate.mark_down("put got RPC_FAIL (-900)")
    assert not gate.healthy and not gate.claim_probe()  # not before the interval
    assert "RPC_FAIL" in gate.describe()
    now[0] += 1.0
    assert gate.claim_probe()
    assert not gate.claim_probe()  # one probe at a time
    gate.end_probe(False, "health_check returned 2")
    assert not gate.claim_probe()  # the next one waits a full interval
    now[0] += 1.0
    assert gate.claim_probe()
    gate.end_probe(True)
    assert gate.healthy


def test_health_gate_state_is_a_snapshot_replaced_on_each_change() -> None:
    now = [5.0]
    gate = HealthGate(1.0, clock=lambda: now[0])
    first = gate.state
    assert first.reachable and first.reason is None
    gate.mark_down("get got RPC_FAIL (-900)")
    down = gate.state
    assert (down.reachable, down.since, down.reason) == (False, 5.0, "get got RPC_FAIL (-900)")
    assert first.reachable  # readers holding the old snapshot see it unchanged
    gate.mark_down("another failure")
    assert gate.state is down  # still down: the same snapshot (the first reason kept)
    now[0] = 7.0
    assert gate.claim_probe()
    gate.end_probe(True)
    assert gate.state.reachable and gate.state.since == 7.0


@given(st.lists(st.tuples(st.integers(1, 10_000), st.integers(1, 5_000)), min_size=1, max_size=20), st.data())
def test_registered_memory_contains_exactly_the_regions_inside_one_range(
    ranges: list[tuple[int, int]], data: st.DataObject
) -> None:
    memory = RegisteredMemory()
    covered: set[int] = set()
    for start, size in ranges:
        new = {b for a, n in memory.add(start, size) for b in range(a, a + n)}
        assert new == set(range(start, start + size)) - covered  # what to register: never an overlap
        covered |= new
    pieces = sorted(memory.ranges())
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(pieces))  # disjoint, as registered
    addr = data.draw(st.integers(0, 16_000))
    size = data.draw(st.integers(1, 3_000))
    expected = any(s <= addr and addr + size <= s + n for s, n in pieces)
    assert memory.contains(addr, size) == expected
    # an object is zero-copy iff each non-empty region is (the fast path must agree)
    regions = data.draw(st.lists(st.tuples(st.integers(1, 16_000), st.integers(0, 3_000)), max_size=6))
    obj = ObjectRef.of("k", [a for a, _ in regions], [n for _, n in regions])
    assert memory.covers(obj) == all(memory.contains(a, n) for a, n in regions if n)
    # a batch: each object as covers() says (the batch's fast path must agree)
    batch = data.draw(
        st.lists(
            st.lists(st.tuples(st.integers(1, 16_000), st.integers(0, 3_000)), max_size=4).map(
                lambda rs: ObjectRef.of("k", [a for a, _ in rs], [n for _, n in rs])
            ),
            max_size=5,
        )
    )
    assert memory.covers_each(batch) == [memory.covers(o) for o in batch]


def test_a_batch_inside_one_registered_range_is_covered_at_once() -> None:
    memory = RegisteredMemory()
    memory.add(1000, 1000)
    memory.add(5000, 100)
    inside = [ObjectRef.of("a", [1000, 1500], [10, 490]), ObjectRef.of("b", [1990], [10])]
    assert memory.covers_each(inside) == [True, True]
    assert memory.covers_each([*inside, ObjectRef.of("c", [1995], [10])]) == [True, True, False]
    assert memory.covers_each([*inside, ObjectRef.of("d", [5000], [100])]) == [True, True, True]
    assert memory.covers_each([*inside, ObjectRef.of("e", [], [])]) == [True, True, True]


@attrs.define
class ExistFails:
    """A client whose existence check fails for some keys (``codes``) and that records puts."""

    codes: list[int]
    puts: list[list[str]] = attrs.field(factory=list)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self.codes

    def batch_put_from_multi_buffers(self, keys: list[str], *_: object) -> list[int]:
        self.puts.append(keys)
        return [0] * len(keys)


@pytest.mark.parametrize("codes", [[0, -900], [-900, 0, 1], [-900]])
def test_a_put_whose_existence_check_fails_for_some_keys_stores_none_and_reports_none_stored(
    codes: list[int],
) -> None:
    """A key the check answered absent (0) beside one it failed for is not put, and is reported
    FAILED, never STORED (0 is also a put's success code)."""
    objects = [ObjectRef.of(f"k{i}", [4096 * (i + 1)], [10]) for i in range(len(codes))]
    (chunk,) = plan_chunks(objects, range(len(objects)), [True] * len(objects), max_batch=8, staging=None)
    store = ExistFails(codes)
    outcome = put_chunk(cast(NativeStore, store), objects, chunk, replicate=None, check=True)
    results = [PutStatus.FAILED] * len(objects)
    put_results(objects, chunk, outcome, results)
    assert store.puts == [] and results == [PutStatus.FAILED] * len(objects)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 7), st.data())
def test_chunks_respect_batch_and_staging_limits(
    sizes: list[int], max_batch: int, data: st.DataObject
) -> None:
    staging = StagingBuffer(8192)
    try:
        objects = [ObjectRef.of(f"k{i}", [4096 * (i + 1)], [n]) for i, n in enumerate(sizes)]
        zero_copy = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
        chunks = plan_chunks(objects, range(len(objects)), zero_copy, max_batch=max_batch, staging=staging)
        assert [i for c in chunks for i in c.indices] == list(range(len(objects)))
        for chunk in chunks:
            assert 1 <= len(chunk.indices) <= max_batch
            staged = [chunk.indices[p] for p, _ in chunk.staged]
            assert staged == [i for i in chunk.indices if not zero_copy[i]]
            slots = sorted((slot, objects[chunk.indices[p]].nbytes) for p, slot in chunk.staged)
            end = staging.addr
            for slot, n in slots:  # staged objects do not overlap and fit the buffer
                assert slot >= end
                end = slot + n
            assert end <= staging.addr + staging.nbytes
    finally:
        staging.close()


# -- a real master --------------------------------------------------------------------------------


@pytest.mark.mooncake
async def test_round_trip_of_objects_with_many_regions_is_bit_exact(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    writer = mooncake_backends(mooncake_master.url(segment="64MiB", max_batch=8))
    reader = mooncake_backends(mooncake_master.url(segment="16MiB", max_batch=5))
    rng, keys = random.Random(7), prefix()
    src = Slab(8 << 20, seed=1).register(writer)
    dst = Slab(8 << 20).register(reader)
    sizes = [rng.randrange(40_000, 200_000) for _ in range(24)]
    puts = [
        scattered(f"{keys}{i}", src, i * 300_000, n, rng.randrange(1, 34), rng) for i, n in enumerate(sizes)
    ]
    gets = [
        scattered(f"{keys}{i}", dst, i * 300_000, n, rng.randrange(1, 34), rng) for i, n in enumerate(sizes)
    ]
    await writer.connect()
    assert await writer.put(puts) == [PutStatus.STORED] * len(puts)
    assert await reader.get(gets) == [GetStatus.HIT] * len(gets)
    for put, get in zip(puts, gets):
        assert dst.read(get) == src.read(put)
    stats = reader.stats()
    assert stats.hits == len(gets) and stats.hit_bytes == sum(sizes)


@pytest.mark.mooncake
async def test_a_staged_get_that_misses_leaves_its_region_untouched(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    """A MISS never writes the caller's memory, also through the staging buffer (which holds
    other objects' bytes from an earlier get)."""
    backend = mooncake_backends(mooncake_master.url(segment="32MiB", staging="1MiB"))
    keys = prefix()
    src, dst = Slab(1 << 20, seed=2), Slab(1 << 20, fill=0xAB)  # never registered: staged
    puts = [contiguous(f"{keys}{i}", src, i * 100_000, 50_000) for i in range(3)]
    assert await backend.put(puts) == [PutStatus.STORED] * 3
    first = [contiguous(f"{keys}{i}", dst, 500_000 + i * 50_000, 50_000) for i in range(3)]
    assert await backend.get(first) == [GetStatus.HIT] * 3  # the staging buffer holds their bytes now
    missing, hit = contiguous(f"{keys}none", dst, 0, 50_000), contiguous(f"{keys}1", dst, 100_000, 50_000)
    assert await backend.get([missing, hit]) == [GetStatus.MISS, GetStatus.HIT]
    assert bytes(dst.buf[:50_000]) == b"\xab" * 50_000


@pytest.mark.mooncake
async def test_unregistered_memory_goes_through_the_staging_buffer(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    backend = mooncake_backends(mooncake_master.url(segment="32MiB", staging="1MiB"))
    keys = prefix()
    src, dst = Slab(4 << 20, seed=2), Slab(4 << 20)  # never registered
    rng = random.Random(3)
    puts = [scattered(f"{keys}{i}", src, i * 400_000, 300_000, 5, rng) for i in range(8)]
    gets = [scattered(f"{keys}{i}", dst, i * 400_000, 300_000, 3, rng) for i in range(8)]
    assert await backend.put(puts) == [PutStatus.STORED] * 8  # 3 objects per chunk at most
    assert await backend.get(gets) == [GetStatus.HIT] * 8
    assert all(dst.read(g) == src.read(p) for p, g in zip(puts, gets))
    with pytest.raises(BackendError, match="staging"):
        await backend.put([contiguous(f"{keys}big", src, 0, 2 << 20)])


@pytest.mark.mooncake
async def test_miss_exists_and_duplicate_puts(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    backend = mooncake_backends(mooncake_master.url(segment="16MiB"))
    keys = prefix()
    first, second = Slab(64 << 10, seed=4).register(backend), Slab(64 << 10, seed=5).register(backend)
    dst = Slab(64 << 10, fill=0xAB).register(backend)
    a = contiguous(f"{keys}a", first, 0, 10_000)
    assert await backend.exists([a.key, f"{keys}none"]) == [False, False]
    assert await backend.exists([]) == []
    assert await backend.put([a]) == [PutStatus.STORED]
    assert await backend.exists([a.key, f"{keys}none"]) == [True, False]
    # a second put of the key, even with other bytes, keeps the first value
    assert await backend.put([contiguous(a.key, second, 0, 10_000)]) == [PutStatus.PRESENT]
    # the same key twice in one batch: stored once
    b1, b2 = contiguous(f"{keys}b", first, 20_000, 5_000), contiguous(f"{keys}b", second, 0, 5_000)
    assert await backend.put([b1, b2]) == [PutStatus.STORED, PutStatus.PRESENT]
    got = await backend.get(
        [
            contiguous(a.key, dst, 0, 10_000),
            contiguous(f"{keys}none", dst, 20_000, 4_000),
            contiguous(b1.key, dst, 30_000, 5_000),
        ]
    )
    assert got == [GetStatus.HIT, GetStatus.MISS, GetStatus.HIT]
    assert bytes(dst.buf[:10_000]) == first.read(a)
    assert bytes(dst.buf[20_000:24_000]) == b"\xab" * 4_000  # a miss leaves the regions untouched
    assert bytes(dst.buf[30_000:35_000]) == first.read(b1)
    stats = backend.stats()
    assert (stats.puts, stats.present, stats.hits, stats.misses) == (2, 2, 2, 1)
    # Without the existence check a repeated put says STORED, but still writes nothing.
    unchecked = mooncake_backends(mooncake_master.url(segment="0", check_present="false"))
    second.register(unchecked)
    assert await unchecked.put([contiguous(a.key, second, 0, 10_000)]) == [PutStatus.STORED]
    assert await backend.get([contiguous(a.key, dst, 0, 10_000)]) == [GetStatus.HIT]
    assert bytes(dst.buf[:10_000]) == first.read(a)
    # remove: True where an object went, False where there was none (or a reader's lease, which
    # Mooncake gives every get for a few seconds, still holds it); then it is gone for everyone
    assert await backend.remove([f"{keys}none"]) == [False]
    deadline = time.monotonic() + 30
    while await backend.remove([a.key]) != [True]:
        assert time.monotonic() < deadline, "the object could not be removed within 30 s"
        await anyio.sleep(0.5)
    assert await unchecked.exists([a.key, b1.key]) == [False, True]
    assert await backend.get([contiguous(a.key, dst, 0, 10_000)]) == [GetStatus.MISS]


@pytest.mark.mooncake
async def test_the_same_key_twice_in_one_get_fills_both_objects(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    """A load of several requests asks for a block they share once per request, into each one's
    blocks: every copy must arrive (one native call is never given a key twice), registered
    memory and staging alike."""
    backend = mooncake_backends(mooncake_master.url(segment="16MiB", staging="1MiB"))
    keys = prefix()
    src = Slab(64 << 10, seed=6).register(backend)
    dst, unregistered = Slab(64 << 10, fill=0xAB).register(backend), Slab(64 << 10, fill=0xAB)
    a, b = contiguous(f"{keys}a", src, 0, 10_000), contiguous(f"{keys}b", src, 20_000, 7_000)
    assert await backend.put([a, b]) == [PutStatus.STORED] * 2
    for into in (dst, unregistered):
        got = await backend.get(
            [
                contiguous(a.key, into, 0, 10_000),
                contiguous(b.key, into, 10_000, 7_000),
                contiguous(a.key, into, 20_000, 10_000),
                contiguous(a.key, into, 40_000, 10_000),
            ]
        )
        assert got == [GetStatus.HIT] * 4
        for at in (0, 20_000, 40_000):
            assert bytes(into.buf[at : at + 10_000]) == src.read(a), at
        assert bytes(into.buf[10_000:17_000]) == src.read(b)


class CountingStore:
    """A Mooncake client that records the keys of every ``batch_is_exist`` call."""

    def __init__(self, store: object) -> None:
        self.store = store
        self.asked: list[list[str]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.asked.append(list(keys))
        return cast("list[int]", self.store.batch_is_exist(keys))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


@pytest.mark.mooncake
async def test_a_put_of_keys_exists_just_answered_absent_asks_no_second_time(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    """The pool's exists-skip then put: one existence check per key, not two."""
    backend = mooncake_backends(mooncake_master.url(segment="16MiB"))
    other = mooncake_backends(mooncake_master.url(segment="16MiB"))
    keys, slab, dst = prefix(), Slab(64 << 10, seed=7), Slab(64 << 10)
    for b in (backend, other):
        slab.register(b)
        dst.register(b)
    await backend.connect()
    counting = CountingStore(backend._store)
    backend._store = cast("NativeStore", counting)
    a, b, c, d = (contiguous(f"{keys}{n}", slab, 10_000 * i, 5_000) for i, n in enumerate("abcd"))
    assert await backend.exists([a.key, b.key, d.key]) == [False, False, False]
    # another client stores d meanwhile: the put cannot know, says STORED, and d keeps its value
    d_first = contiguous(d.key, slab, 50_000, 5_000)
    assert await other.put([d_first]) == [PutStatus.STORED]
    counting.asked.clear()
    assert await backend.put([a, b, c, d]) == [PutStatus.STORED] * 4
    assert counting.asked == [[c.key]]  # only the key exists was not asked about
    assert await backend.get([contiguous(d.key, dst, 0, 5_000)]) == [GetStatus.HIT]
    assert bytes(dst.buf[:5_000]) == slab.read(d_first)
    counting.asked.clear()  # an answer serves one put: the next put of a asks again
    assert await backend.put([a]) == [PutStatus.PRESENT]
    assert counting.asked == [[a.key]]


@pytest.mark.mooncake
async def test_wrong_sizes_and_empty_objects_raise_with_the_key(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    backend = mooncake_backends(mooncake_master.url(segment="16MiB"))
    key = prefix() + "sized"
    slab = Slab(64 << 10, seed=6).register(backend)
    assert await backend.put([contiguous(key, slab, 0, 1_000)]) == [PutStatus.STORED]
    with pytest.raises(BackendError, match=f"{key}.*more than 500 bytes"):
        await backend.get([contiguous(key, slab, 10_000, 500)])
    with pytest.raises(BackendError, match=f"{key}.*has 1000 bytes"):
        await backend.get([contiguous(key, slab, 10_000, 2_000)])
    with pytest.raises(BackendError, match="at least one byte"):
        await backend.put([ObjectRef.of(key + "0", [], [])])
    assert await backend.exists([key]) == [True]  # nothing else broke


@pytest.mark.mooncake
async def test_full_segment_reports_no_space_and_nothing_else_breaks(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    # A short lease lets the master evict soon after the segment fills.
    master = mooncake_master_factory(extra_args=["--default_kv_lease_ttl=200"])
    backend = mooncake_backends(master.url(segment="16MiB"))
    keys, mib = prefix(), 1 << 20
    src = Slab(mib, seed=8).register(backend)
    dst = Slab(mib).register(backend)
    objects = [contiguous(f"{keys}{i}", src, 0, mib) for i in range(24)]
    results = await backend.put(objects)
    stored = [o for o, r in zip(objects, results) if r is PutStatus.STORED]
    assert set(results) == {PutStatus.STORED, PutStatus.NO_SPACE}, results
    assert 8 <= len(stored) <= 16
    assert backend.stats().no_space == results.count(PutStatus.NO_SPACE)
    # Everything stored is still readable, bit-exact (or evicted: a miss, never a failure).
    assert all(await backend.exists([o.key for o in stored[-2:]]))
    for obj in stored:
        (status,) = await backend.get([contiguous(obj.key, dst, 0, mib)])
        assert status in (GetStatus.HIT, GetStatus.MISS)
        if status is GetStatus.HIT:
            assert bytes(dst.buf) == bytes(src.buf)
    # Eviction makes room again.
    deadline = time.monotonic() + 15
    while (await backend.put([contiguous(f"{keys}late", src, 0, mib)]))[0] is not PutStatus.STORED:
        assert time.monotonic() < deadline, "no room after 15 s"
        await anyio.sleep(0.2)
    assert backend.stats().put_failures == 0


@pytest.mark.mooncake
async def test_master_loss_fails_fast_and_recovery_needs_no_restart(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    master = mooncake_master_factory()
    backend = mooncake_backends(
        master.url(segment="16MiB", health_interval=0.5, probe_timeout=1, timeout=5, setup_retries=1)
    )
    keys = prefix()
    src = Slab(1 << 20, seed=9).register(backend)
    dst = Slab(1 << 20).register(backend)
    before = [contiguous(f"{keys}old{i}", src, i * 1000, 1000) for i in range(4)]
    assert await backend.put(before) == [PutStatus.STORED] * 4
    assert backend.health().reachable

    master.kill()
    started = time.monotonic()
    after = [contiguous(f"{keys}new{i}", src, i * 1000, 1000) for i in range(4)]
    assert await backend.put(after) == [PutStatus.FAILED] * 4
    assert await backend.get([contiguous(o.key, dst, 0, 1000) for o in before]) == [GetStatus.FAILED] * 4
    assert time.monotonic() - started < 12  # Mooncake's own wait is about 4.5 s per call
    down = backend.health()
    assert not down.reachable and down.reason  # what the vLLM connector reports and logs
    for _ in range(6):  # fast answers while down: no 4.5 s wait per call
        t = time.monotonic()
        with pytest.raises(BackendUnavailableError, match="unreachable"):
            await backend.exists([before[0].key])
        assert time.monotonic() - t < 2.0
        t = time.monotonic()
        assert await backend.put(after[:1]) == [PutStatus.FAILED]
        assert time.monotonic() - t < 2.0
        await anyio.sleep(0.25)

    restarted = mooncake_master_factory(rpc_port=master.rpc_port)
    assert restarted.alive()
    deadline = time.monotonic() + 30
    while (await backend.put(after[:1]))[0] is not PutStatus.STORED:
        assert time.monotonic() < deadline, "the backend did not recover within 30 s"
        await anyio.sleep(0.25)
    assert backend.health().reachable and backend.health().since > down.since
    assert await backend.exists([after[0].key, before[0].key]) == [True, False]  # a new master knows nothing
    got = await backend.get([contiguous(after[0].key, dst, 0, 1000), contiguous(before[1].key, dst, 0, 1000)])
    assert got == [GetStatus.HIT, GetStatus.MISS]
    assert bytes(dst.buf[:1000]) == src.read(after[0])


@pytest.mark.mooncake
def test_two_segment_holders_lend_memory_side_by_side(
    mooncake_master_factory: Callable[..., MasterProcess],
) -> None:
    """Storage nodes on one host (here, one namespace): each holder gets a port of its own (on
    mooncake_client's default port, the second one exited while mounting)."""
    master = mooncake_master_factory()
    with (
        start_segment_holder(master.address, segment="16MB") as first,
        start_segment_holder(master.address, segment="16MB") as second,
    ):
        assert first.process.poll() is None and second.process.poll() is None


@pytest.mark.mooncake
async def test_object_sizes_of_a_lost_master_raise_not_say_none(
    mooncake_master_factory: Callable[..., MasterProcess], mooncake_backends: MakeBackend
) -> None:
    """``object_sizes`` (what ``kvflow store ls`` lists) answers -1 only for a key that is not
    stored: Mooncake leaves every key out of its answer when the master does not answer, which read
    as "no such object" for every key, with the master still counted reachable."""
    master = mooncake_master_factory()
    backend = mooncake_backends(master.url(segment="16MiB", timeout=10))
    keys = prefix()
    src = Slab(1 << 20, seed=3).register(backend)
    stored = [contiguous(f"{keys}{i}", src, i * 1000, 1000) for i in range(3)]
    assert await backend.put(stored) == [PutStatus.STORED] * 3
    names = [o.key for o in stored]
    assert await backend.object_sizes([*names, f"{keys}absent"]) == [1000, 1000, 1000, -1]
    master.kill()
    with pytest.raises(BackendUnavailableError):
        await backend.object_sizes(names)
    assert not backend.health().reachable


@pytest.mark.mooncake
async def test_setup_against_a_dead_master_fails_within_the_bound(
    mooncake_isolated: None, mooncake_backends: MakeBackend
) -> None:
    backend = mooncake_backends(f"mooncake://127.0.0.1:{free_port()}?setup_retries=1&setup_timeout=20")
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="mooncake_master"):
        await backend.connect()
    assert time.monotonic() - started < 15  # one retry is about 4.4 s
    t = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        await backend.exists(["k"])
    slab = Slab(4096, seed=1)
    assert await backend.put([contiguous("k", slab, 0, 100)]) == [PutStatus.FAILED]
    assert time.monotonic() - t < 1.0  # no new setup before the health interval


# -- two OS processes -----------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.backends.test_mooncake", *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def _receive(process: subprocess.Popen[str], timeout_s: float = 60) -> list[str]:
    """The next protocol line ("KV ...") of a peer, split into words."""
    assert process.stdout is not None
    with anyio.fail_after(timeout_s):
        while True:
            line = await anyio.to_thread.run_sync(process.stdout.readline, abandon_on_cancel=True)
            if not line:
                raise AssertionError(f"peer exited with {process.wait()} before answering")
            if line.startswith("KV "):
                return line.split()[1:]


def _send(process: subprocess.Popen[str], *words: str) -> None:
    assert process.stdin is not None
    process.stdin.write(" ".join(words) + "\n")
    process.stdin.flush()


def _finish(processes: Sequence[subprocess.Popen[str]]) -> None:
    for process in processes:
        if process.poll() is None:
            _send(process, "EXIT")
    for process in processes:
        try:
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()


PEER_OBJECTS, PEER_SIZE = 16, 200_000


@pytest.mark.mooncake
async def test_two_processes_see_each_others_objects(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    keys = prefix()
    url = mooncake_master.url(segment="32MiB")
    backend = mooncake_backends(url)
    mine = Slab(PEER_OBJECTS * PEER_SIZE, seed=21).register(backend)
    await backend.connect()
    peer = _spawn("peer", url, keys + "peer/", "20")
    try:
        assert await _receive(peer) == ["PUT", *(["stored"] * PEER_OBJECTS)]
        theirs = Slab(PEER_OBJECTS * PEER_SIZE, seed=20)  # what the peer stored
        got = Slab(PEER_OBJECTS * PEER_SIZE).register(backend)
        peer_keys = [f"{keys}peer/{i}" for i in range(PEER_OBJECTS)]
        assert await backend.exists(peer_keys) == [True] * PEER_OBJECTS
        gets = [contiguous(k, got, i * PEER_SIZE, PEER_SIZE) for i, k in enumerate(peer_keys)]
        assert await backend.get(gets) == [GetStatus.HIT] * PEER_OBJECTS
        assert got.buf == theirs.buf
        puts = [contiguous(f"{keys}main/{i}", mine, i * PEER_SIZE, PEER_SIZE) for i in range(PEER_OBJECTS)]
        assert await backend.put(puts) == [PutStatus.STORED] * PEER_OBJECTS
        _send(peer, "GET", keys + "main/", "21")
        assert await _receive(peer) == ["GOT", "exact", *(["hit"] * PEER_OBJECTS)]
    finally:
        _finish([peer])


async def _peer(url: str, key_prefix: str, seed: int) -> None:
    """Put objects with content from ``seed``; on "GET PREFIX SEED" get and compare them."""
    async with MooncakeBackend.from_url(url) as backend:
        slab = Slab(PEER_OBJECTS * PEER_SIZE, seed=seed).register(backend)
        puts = [contiguous(f"{key_prefix}{i}", slab, i * PEER_SIZE, PEER_SIZE) for i in range(PEER_OBJECTS)]
        print("KV PUT", *(r.value for r in await backend.put(puts)), flush=True)
        while (words := (await anyio.to_thread.run_sync(sys.stdin.readline)).split()) != ["EXIT"]:
            if words[:1] == ["GET"]:
                other, expected = words[1], Slab(PEER_OBJECTS * PEER_SIZE, seed=int(words[2]))
                got = Slab(PEER_OBJECTS * PEER_SIZE).register(backend)
                gets = [contiguous(f"{other}{i}", got, i * PEER_SIZE, PEER_SIZE) for i in range(PEER_OBJECTS)]
                results = await backend.get(gets)
                exact = "exact" if got.buf == expected.buf else "differs"
                print("KV GOT", exact, *(r.value for r in results), flush=True)


# -- the pool over Mooncake -----------------------------------------------------------------------


@pytest.mark.mooncake
async def test_pool_round_trip_through_mooncake_for_every_layout(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    from kvflow import KVPool, PoolConfig
    from tests.helpers import BLOCK, LAYOUTS, block_bytes, zeros_like_caches

    tokens = list(range(500, 500 + BLOCK * 6 + 3))
    writer = mooncake_backends(mooncake_master.url(segment="32MiB"))
    reader = mooncake_backends(mooncake_master.url(segment="0"))  # a pure client: reads over TCP
    model = prefix()
    kept: list[object] = []
    for name, make in sorted(LAYOUTS.items()):
        src = make()
        dst = zeros_like_caches(src)
        kept += [src, dst]  # registered memory must outlive the backends
        config = PoolConfig(model=model + name, timeout_s=10)
        a = KVPool.create(config, layout=layout_of(src), backend=writer)
        b = KVPool.create(config, layout=layout_of(dst), backend=reader)
        stored = await a.store(KVRequest(block_ids=[4, 2, 7, 0, 9, 1], tokens=tokens))
        assert stored.stored == 6 and stored.ok, name
        assert await b.lookup(KVRequest(tokens=tokens)) == 6 * BLOCK
        result = await b.retrieve(KVRequest(block_ids=[0, 1, 2, 3, 5, 6], tokens=tokens))
        assert result.hit_blocks == 6, (name, result)
        for s, d in zip([4, 2, 7, 0, 9, 1], [0, 1, 2, 3, 5, 6]):
            for layer in src:
                assert block_bytes(dst[layer], d) == block_bytes(src[layer], s), (name, layer)


@pytest.mark.mooncake
async def test_two_processes_as_tp_ranks_of_an_mla_model_store_only_owned_blocks(
    mooncake_master: MasterProcess, mooncake_backends: MakeBackend
) -> None:
    from kvflow import KVPool, ParallelConfig, PoolConfig
    from kvflow.ownership import owner
    from tests.helpers import BLOCK

    model, url = prefix(), mooncake_master.url(segment="32MiB")
    ranks = [_spawn("rank", url, model, str(r)) for r in range(2)]
    try:
        reports = [await _receive(p, timeout_s=120) for p in ranks]
        formats = {(words[1], words[2]) for words in reports}
        assert len(formats) == 1 and all(words[0] == "STORED" for words in reports)
        statuses = [words[3].split(",") for words in reports]
        for rank, per_block in enumerate(statuses):
            parallel = ParallelConfig(tp_rank=rank, tp_size=2, use_mla=True)
            expected = ["stored" if owner(i, parallel) == rank else "none" for i in range(len(per_block))]
            assert per_block == expected, (rank, per_block)
        # The scheduler's view (no KV caches, another client): every block is in the pool once.
        scheduler = KVPool.create(
            PoolConfig(model=model),
            backend=mooncake_backends(mooncake_master.url(segment="0")),
            parallel=ParallelConfig(tp_rank=0, tp_size=2, use_mla=True),
            format=KVFormat(BLOCK, 3, *formats.pop()),
        )
        assert await scheduler.lookup(KVRequest(tokens=RANK_TOKENS)) == len(statuses[0]) * BLOCK
        for p in ranks:
            _send(p, "RETRIEVE")
        for p in ranks:  # every rank loads every block, including those the other rank stored
            assert await _receive(p) == ["RETRIEVED", str(len(statuses[0])), "exact"]
    finally:
        _finish(ranks)


RANK_TOKENS = list(range(2000, 2000 + 16 * 8))  # 8 blocks of tests.helpers.BLOCK (16) tokens


async def _rank(url: str, model: str, rank: int) -> None:
    """A TP rank of an MLA model: store the request, report per-block statuses, then retrieve."""
    import torch

    from kvflow import KVPool, ParallelConfig, PoolConfig
    from tests.helpers import LAYOUTS, block_bytes, zeros_like_caches

    torch.manual_seed(0)  # MLA ranks hold byte-identical KV
    src = LAYOUTS["mla"]()
    dst = zeros_like_caches(src)
    parallel = ParallelConfig(tp_rank=rank, tp_size=2, use_mla=True)
    async with MooncakeBackend.from_url(url) as backend:
        config = PoolConfig(model=model, timeout_s=20)
        layout = layout_of(src)
        pool = KVPool.create(config, layout=layout, backend=backend, parallel=parallel)
        result = await pool.store(KVRequest(block_ids=list(range(8)), tokens=RANK_TOKENS))
        words = ",".join("none" if s is None else s.value for s in result.statuses)
        print("KV STORED", pool.format.meaning, pool.format.order, words, flush=True)
        while (line := (await anyio.to_thread.run_sync(sys.stdin.readline)).split()) != ["EXIT"]:
            if line == ["RETRIEVE"]:
                reader = KVPool.create(
                    config,
                    layout=layout_of(dst),
                    backend=backend,
                    parallel=parallel,
                )
                got = await reader.retrieve(KVRequest(block_ids=[7, 6, 5, 4, 3, 2, 1, 0], tokens=RANK_TOKENS))
                exact = all(
                    block_bytes(dst[name], d) == block_bytes(src[name], s)
                    for s, d in zip(range(8), [7, 6, 5, 4, 3, 2, 1, 0])
                    for name in src
                )
                print("KV RETRIEVED", got.hit_blocks, "exact" if exact else "differs", flush=True)


def _main(argv: list[str]) -> int:
    """Peer programs of the two-process tests."""
    if argv[0] == "peer":
        anyio.run(_peer, argv[1], argv[2], int(argv[3]))
    elif argv[0] == "rank":
        anyio.run(_rank, argv[1], argv[2], int(argv[3]))
    else:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


# -- clients a setup makes but nobody keeps --------------------------------------------------------


class FakeStore:
    """A Mooncake client that records whether it was set up and closed, and how gets went."""

    instances: ClassVar[list[FakeStore]] = []
    master: ClassVar[str] = ""  # a loopback port that accepts connections, as a master's does
    setup_s: ClassVar[float] = 0.4
    setup_rc: ClassVar[int] = 0
    close_gate: ClassVar[threading.Event | None] = None  # close waits for it (up to 5 s)
    register_rc: ClassVar[list[int]] = [0]
    get_rc: ClassVar[int] = 0  # what every get answers for each key
    size_rc: ClassVar[int] = 0  # what get_size answers
    size_calls: ClassVar[int] = 0
    exist_rc: ClassVar[int] = 0  # what batch_is_exist answers for each key
    health_s: ClassVar[float] = 0.0  # how long a health check takes
    get_s: ClassVar[float] = 0.0  # how long a get takes
    after_close: ClassVar[list[str]] = []  # calls made on a closed client (a real one crashes)

    def __init__(self) -> None:
        self.set_up = False
        self.closed = False
        FakeStore.instances.append(self)

    def setup(self, *args: object) -> int:
        time.sleep(FakeStore.setup_s)
        self.set_up = FakeStore.setup_rc == 0
        return FakeStore.setup_rc

    def close(self) -> int:
        if FakeStore.close_gate is not None:
            FakeStore.close_gate.wait(5)
        self.closed = True
        return 0

    def register_buffer(self, addr: int, nbytes: int) -> int:
        return FakeStore.register_rc.pop(0) if len(FakeStore.register_rc) > 1 else FakeStore.register_rc[0]

    def health_check(self) -> int:
        self._called("health_check")
        time.sleep(FakeStore.health_s)
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._called("batch_is_exist")
        return [FakeStore.exist_rc] * len(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], *_: object) -> list[int]:
        self._called("batch_get_into_multi_buffers")
        time.sleep(FakeStore.get_s)
        return [FakeStore.get_rc] * len(keys)

    def _called(self, name: str) -> None:
        if self.closed:
            FakeStore.after_close.append(name)

    def get_size(self, key: str) -> int:
        FakeStore.size_calls += 1
        return FakeStore.size_rc


class FakeModule:
    MooncakeDistributedStore = FakeStore

    class ReplicateConfig:
        pass


def assert_none_left_open(fake: type[FakeStore]) -> None:
    left = [s for s in fake.instances if s.set_up and not s.closed]
    assert not left, f"{len(left)} of {len(fake.instances)} Mooncake clients set up and never closed"


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeStore]]:
    FakeStore.instances = []
    FakeStore.setup_s, FakeStore.setup_rc, FakeStore.close_gate = 0.4, 0, None
    FakeStore.register_rc = [0]
    FakeStore.get_rc, FakeStore.size_rc, FakeStore.size_calls = 0, 0, 0
    FakeStore.exist_rc, FakeStore.health_s, FakeStore.get_s, FakeStore.after_close = 0, 0.0, 0.0, []
    monkeypatch.setattr(backend_module, "load_store_module", lambda: FakeModule)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # setup checks the master's port first
        FakeStore.master = f"127.0.0.1:{listener.getsockname()[1]}"
        yield FakeStore


async def test_a_setup_whose_caller_gave_up_does_not_leave_a_client_open(
    fake_client: type[FakeStore],
) -> None:
    """A pool call's deadline cancels the first (lazy) setup while its thread sets the client up:
    that client is closed when its setup ends (no segment stays mounted for nobody)."""
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, health_interval_s=0.05))
    with anyio.move_on_after(0.1):
        await backend.exists(["k"])
    await anyio.sleep(fake_client.setup_s + 0.3)  # the abandoned setup has finished by now
    assert await backend.exists(["k"]) == [False]
    await backend.aclose()
    await anyio.sleep(0.1)
    leaked = [s for s in fake_client.instances if s.set_up and not s.closed]
    assert not leaked, (
        f"{len(leaked)} of {len(fake_client.instances)} Mooncake clients set up and never closed"
    )


async def test_a_lookup_that_probes_the_master_as_aclose_begins_never_calls_the_closed_client(
    fake_client: type[FakeStore],
) -> None:
    """An ``exists`` that finds the master marked down probes it first; an ``aclose`` that begins
    meanwhile closes the client once the probe's call returned. The lookup must not go on to call
    the closed client (a real one crashes the process): it raises PoolClosedError."""
    fake_client.setup_s = 0.0
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, health_interval_s=0.01))
    await backend.connect()
    fake_client.exist_rc = RPC_FAIL  # the master does not answer: marked down
    with pytest.raises(BackendUnavailableError):
        await backend.exists(["k"])
    fake_client.exist_rc, fake_client.health_s = 0, 0.3
    await anyio.sleep(0.05)  # past the health interval: the next call probes
    outcome: list[BaseException] = []

    async def lookup() -> None:
        try:
            await backend.exists(["k"])
        except Exception as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lookup)
        await anyio.sleep(0.1)  # the probe's health check runs
        await backend.aclose()
    assert fake_client.after_close == []
    assert len(outcome) == 1 and isinstance(outcome[0], PoolClosedError), outcome


async def test_a_get_that_probes_the_master_as_aclose_begins_reports_failed(
    fake_client: type[FakeStore],
) -> None:
    """A get that finds the master marked down probes it, its probe waiting for the one worker
    thread another get holds; an ``aclose`` that begins meanwhile refuses the probe. The get reports
    FAILED, as a put or get caught by a close does (never raises), and calls no closed client."""
    fake_client.setup_s, fake_client.get_s = 0.0, 0.4
    config = MooncakeConfig(master=fake_client.master, timeout_s=2, max_concurrency=1, health_interval_s=0.01)
    backend = MooncakeBackend(config)
    bufs = [bytearray(4096) for _ in range(2)]
    for buf in bufs:
        backend.register_memory(buffer_address(buf), len(buf))
    objs = [ObjectRef.of(f"k{i}", [buffer_address(buf)], [len(buf)]) for i, buf in enumerate(bufs)]
    await backend.connect()
    got: list[list[GetStatus]] = []

    async def second() -> None:
        got.append(await backend.get([objs[1]]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.get, [objs[0]])  # holds the only worker thread for 0.4 s
        await anyio.sleep(0.05)
        backend._mark_down("marked down, as a failed call would")
        await anyio.sleep(0.02)  # past the health interval: the next call probes
        tg.start_soon(second)
        await anyio.sleep(0.05)
        await backend.aclose()
    assert got == [[GetStatus.FAILED]]
    assert fake_client.after_close == []


async def test_a_lookup_queued_behind_long_gets_is_busy_and_leaves_the_master_up(
    fake_client: type[FakeStore],
) -> None:
    """One worker thread, held by a get that takes longer than ``timeout_s`` but returns: an
    ``exists`` that waits for it past ``timeout_s`` fails as busy, and the master is not marked down
    (the next calls go to Mooncake)."""
    fake_client.setup_s = 0.0
    config = MooncakeConfig(master=fake_client.master, max_concurrency=1, timeout_s=0.3, health_interval_s=30)
    backend = MooncakeBackend(config)
    buf = bytearray(4096)
    backend.register_memory(buffer_address(buf), len(buf))
    obj = ObjectRef.of("k", [buffer_address(buf)], [len(buf)])
    await backend.connect()
    fake_client.get_s = 1.0
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.get, [obj])
        await anyio.sleep(0.1)
        with pytest.raises(BackendUnavailableError, match="worker threads ran a put or get"):
            await backend.exists(["k"])
    fake_client.get_s = 0.0
    assert backend.health().reachable
    assert await backend.exists(["k"]) == [False]
    await backend.aclose()


async def test_a_staged_get_waiting_for_the_staging_buffer_does_not_start_once_aclose_began(
    fake_client: type[FakeStore],
) -> None:
    """Two gets into memory not registered go through the staging buffer, one after the other; an
    ``aclose`` that begins while the first runs lets it end and starts no more Mooncake calls."""
    fake_client.setup_s, fake_client.get_s = 0.0, 0.5
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, timeout_s=5))
    await backend.connect()
    bufs = [bytearray(4096) for _ in range(2)]
    gets: list[float] = []
    real_get = FakeStore.batch_get_into_multi_buffers

    def timed_get(self: FakeStore, keys: list[str], *args: object) -> list[int]:
        gets.append(time.monotonic())
        return real_get(self, keys, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FakeStore, "batch_get_into_multi_buffers", timed_get)
        async with anyio.create_task_group() as tg:
            for i, buf in enumerate(bufs):
                tg.start_soon(backend.get, [ObjectRef.of(f"k{i}", [buffer_address(buf)], [len(buf)])])
            await anyio.sleep(0.1)  # the first get runs; the second waits for the staging buffer
            began = time.monotonic()
            await backend.aclose()
    assert len(gets) == 1 and gets[0] < began, gets
    assert fake_client.after_close == []


async def test_a_setup_that_fails_after_connecting_closes_its_client(fake_client: type[FakeStore]) -> None:
    """A setup that connected but could not register the pool's memory closes its client (the
    gate retries once per health interval: one orphan client each time else)."""
    fake_client.setup_s = 0.0
    fake_client.register_rc = [-1, 0]  # the first registration is refused, later ones succeed
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, health_interval_s=0.05))
    buf = bytearray(4096)
    backend.register_memory(buffer_address(buf), len(buf))
    with pytest.raises(BackendError, match="register"):
        await backend.connect()
    await anyio.sleep(0.1)
    await backend.connect()  # the next interval: a new client
    await backend.aclose()
    leaked = [s for s in fake_client.instances if s.set_up and not s.closed]
    assert not leaked, (
        f"{len(leaked)} of {len(fake_client.instances)} Mooncake clients set up and never closed"
    )


# -- failures Mooncake makes costly: setups, sizes, logs, close --------------------------------------


async def test_a_setup_its_caller_gave_up_on_is_retried_only_after_the_health_interval(
    fake_client: type[FakeStore],
) -> None:
    """A cancelled setup counts as a failed one: the next call does not start another Mooncake
    setup at once (each one against a master that does not answer freezes the process ~4.4 s)."""
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, health_interval_s=0.5))
    with anyio.move_on_after(0.1) as scope:
        await backend.connect()
    assert scope.cancelled_caught
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="unreachable"):
        await backend.connect()
    assert time.monotonic() - started < 0.2 and len(fake_client.instances) == 1
    await anyio.sleep(0.6)
    await backend.connect()  # the health interval has passed: set up again
    assert len(fake_client.instances) == 2
    await backend.aclose()


async def test_failed_setups_are_retried_ever_less_often(fake_client: type[FakeStore]) -> None:
    """Each failed Mooncake setup leaks a file descriptor (Mooncake's own leak: one retry per
    health interval leaked 126 in two minutes): retries wait 1, 2, 4... up to 16 intervals."""
    fake_client.setup_s, fake_client.setup_rc = 0.0, -1
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, health_interval_s=0.02))
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        with pytest.raises(BackendUnavailableError):
            await backend.connect()
        await anyio.sleep(0.01)
    # one per interval: about 35; after 0, 0.02, 0.06, 0.14, 0.3, 0.62, 0.94 s: 7
    assert len(fake_client.instances) <= 9
    await backend.aclose()


async def test_a_master_port_that_never_answers_ends_the_setup_within_setup_timeout(
    fake_client: type[FakeStore],
) -> None:
    """A port whose connections hang (here: a full accept queue drops them) fails the connect
    after ``setup_timeout``, and Mooncake's setup, which would hold the GIL, is never called."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as stalled:
        port = stalled.getsockname()[1]
        queued = [socket.socket() for _ in range(3)]
        try:
            for sock in queued:
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))  # fills the accept queue
            backend = MooncakeBackend(MooncakeConfig(master=f"127.0.0.1:{port}", setup_timeout_s=0.5))
            started = time.monotonic()
            with pytest.raises(BackendUnavailableError, match=r"no answer within 0\.5 s"):
                await backend.connect()
            assert 0.4 < time.monotonic() - started < 1.5
            assert not fake_client.instances
            await backend.aclose()
        finally:
            for sock in queued:
                sock.close()


async def test_sizes_after_a_failed_get_stop_at_the_first_the_master_cannot_tell(
    fake_client: type[FakeStore],
) -> None:
    """A get that fails with TRANSFER_FAIL asks each key's size (to tell a layout mismatch); with
    the master gone each answer takes ~4.3 s inside a call that cannot be abandoned. The first
    RPC_FAIL ends the questions, fails the chunk and marks the master down."""
    fake_client.setup_s, fake_client.get_rc, fake_client.size_rc = 0.0, -800, -900
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master))
    slab = Slab(8 * 1000).register(backend)
    objects = [contiguous(f"k{i}", slab, i * 1000, 1000) for i in range(8)]
    assert await backend.get(objects) == [GetStatus.FAILED] * 8
    assert fake_client.size_calls == 1
    assert not backend.health().reachable and "RPC_FAIL" in (backend.health().reason or "")
    await backend.aclose()


async def test_objects_not_ready_log_no_warning_and_other_failures_log_at_most_one_per_interval(
    fake_client: type[FakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    """Gets of keys still being written (-703) or past their lease (-707) are routine under load:
    no warning for each (stats count them). Other failures warn once per interval, not per call."""
    fake_client.setup_s = 0.0
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master))
    slab = Slab(1000).register(backend)
    obj = contiguous("k", slab, 0, 1000)
    with caplog.at_level(logging.WARNING, logger="kvflow.backends.mooncake"):
        for code in (-703, -707, -703):
            fake_client.get_rc = code
            assert await backend.get([obj]) == [GetStatus.FAILED]
        assert not caplog.records
        fake_client.get_rc, fake_client.size_rc = -800, 1000
        for _ in range(5):
            assert await backend.get([obj]) == [GetStatus.FAILED]
    assert [r.getMessage() for r in caplog.records] == [
        "Mooncake get: 1 object(s) failed (TRANSFER_FAIL (-800))"
    ]
    assert backend.stats().get_failures == 8
    await backend.aclose()


async def test_a_close_that_overruns_is_logged_as_such_not_as_calls_still_running(
    fake_client: type[FakeStore], caplog: pytest.LogCaptureFixture
) -> None:
    """Mooncake's close takes ~11 s once the master is gone; no other call ran, so the log must not
    blame calls still running."""
    fake_client.setup_s, fake_client.close_gate = 0.0, threading.Event()
    backend = MooncakeBackend(MooncakeConfig(master=fake_client.master, close_timeout_s=0.1))
    await backend.connect()
    try:
        with caplog.at_level(logging.WARNING, logger="kvflow.backends.mooncake"):
            await backend.aclose()
    finally:
        fake_client.close_gate.set()  # the close ends in its thread
    (record,) = caplog.records
    assert "close had not returned" in record.getMessage() and "calls" not in record.getMessage()


def test_setups_that_overlap_leave_the_retries_variable_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two backends connecting at once: the variable is restored once the last setup ends (the
    first one's end used to restore it, and the second's end then set the first one's value)."""
    monkeypatch.delenv(SETUP_RETRIES_ENV, raising=False)
    first, second = setup_retries_env(3), setup_retries_env(1)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert os.environ[SETUP_RETRIES_ENV] == "1"  # the second setup still runs
    second.__exit__(None, None, None)
    assert SETUP_RETRIES_ENV not in os.environ
    monkeypatch.setenv(SETUP_RETRIES_ENV, "7")
    with setup_retries_env(2):
        assert os.environ[SETUP_RETRIES_ENV] == "2"
    assert os.environ[SETUP_RETRIES_ENV] == "7"
