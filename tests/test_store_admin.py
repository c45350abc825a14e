"""``kvflow store`` on a local and an arena store: stats per model and layout, ls, clear (one model's
objects, or all of them), JSON for scripts, and no clearing from a terminal without --yes. Also the
stores' listings: every object's key read back (from its file name, or the arena's key area)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvflow.backends.local.backend as local
import kvflow.tools.store_admin as admin
from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends.arena import ArenaBackend
from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend
from kvflow.backends.local.backend import key_of_file_name
from kvflow.backends.local.format import (
    HEADER_SIZE,
    Header,
    TempName,
    WriterId,
    key_digest,
    object_file_name,
    payload_checksum,
)
from kvflow.backends.local.presence import JOURNAL_END
from kvflow.backends.local.space import SpaceLedger
from kvflow.cli import main
from kvflow.keys import KeyScope, block_keys
from kvflow.regions import buffer_address
from kvflow.tools.store_admin import read_inventory
from tests.helpers import bounded_shm

BLOCK = 4
MODELS = ("org/llama", "small")


async def _fill(url: str) -> int:
    """Three blocks of each model (and their profile announcements); the bytes of one block."""
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(8, 2, BLOCK, 16) for i in range(2)}
    layout = KVLayout.from_kv_caches(caches)
    for model in MODELS:
        async with KVPool.create(PoolConfig(backend=url, model=model), layout=layout) as pool:
            result = await pool.store(KVRequest(tokens=list(range(3 * BLOCK + 1)), block_ids=[1, 2, 3]))
            assert result.stored == 3
    return layout.block_nbytes


CAPACITY = {"local": 64 << 20, "arena": 64 * 4096}


@pytest.fixture(params=["local", "arena"])
def store(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, Path, int]:
    scheme = request.param
    url = f"{scheme}://{tmp_path}/store?capacity={CAPACITY[scheme]}" + (
        "&slot=4KiB" if scheme == "arena" else ""
    )
    return url, tmp_path / "store", anyio.run(_fill, url)


def _objects_in(url: str) -> int:
    return len(anyio.run(read_inventory, url).objects)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_count_objects_per_model_and_layout(
    store: tuple[str, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, block = store
    stats = _json(capsys, "store", "stats", url, "--json")
    assert isinstance(stats, dict)
    scheme = url.split(":")[0]
    assert stats["backend"] == scheme and stats["capacity_bytes"] == CAPACITY[scheme]
    assert stats["objects"] == 8 and stats["used_bytes"] >= stats["bytes"] > 6 * block
    rows = {row["model"]: row for row in stats["models"]}
    assert sorted(rows) == sorted(MODELS)
    for row in rows.values():
        assert (row["blocks"], row["objects"], row["bytes"]) == (3, 3, 3 * block)
        assert row["layout"].endswith(f"b{BLOCK}") and row["parts"] == ["l0-2 h0-2 d0.1 p0.1"]
    assert sorted(p["model"] for p in stats["profiles"]) == sorted(MODELS)
    assert stats["other"]["objects"] == 0
    assert main(["store", "stats", url]) == 0
    text = capsys.readouterr().out
    assert "org/llama" in text and "profile announcements: 2" in text


def test_stats_of_a_local_store_show_no_capacity_the_url_did_not_give(
    store: tuple[str, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """A local store has no capacity of its own (each opening process sets its budget), so a URL
    without one shows none rather than the default; an arena's is fixed when it is made."""
    url, _, _ = store
    scheme, bare = url.split(":")[0], url.split("?")[0]
    stats = _json(capsys, "store", "stats", bare, "--json")
    assert isinstance(stats, dict)
    assert stats["capacity_bytes"] == (CAPACITY[scheme] if scheme == "arena" else None)
    assert stats["objects"] == 8 and stats["used_bytes"] > 0
    assert main(["store", "stats", bare]) == 0
    text = capsys.readouterr().out
    if scheme == "local":
        assert "capacity ?" in text and "sets its own capacity" in text
    else:
        assert "capacity 256.00 KiB" in text and "sets its own" not in text


def test_ls_lists_one_models_blocks_and_announcements(
    store: tuple[str, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, block = store
    listed = _json(capsys, "store", "ls", url, "--model", "org/llama", "--json")
    assert isinstance(listed, list)
    assert sorted(o["kind"] for o in listed) == ["kv", "kv", "kv", "profiles"]
    assert {o["model"] for o in listed} == {"org/llama"}
    assert all(o["bytes"] == block and len(o["hash"]) == 64 for o in listed if o["kind"] == "kv")


def test_clear_of_one_model_leaves_the_others(
    store: tuple[str, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path, _ = store
    assert _json(capsys, "store", "clear", url, "--model", "org/llama", "--json") == {
        "url": url,
        "model": "org/llama",
        "removed": 4,
        "failed": 0,
        "unnamed": 0,
    }
    left = _json(capsys, "store", "ls", url, "--json")
    assert isinstance(left, list) and {o["model"] for o in left} == {"small"} and len(left) == 4
    assert _json(capsys, "store", "clear", url, "--json")["removed"] == 4  # type: ignore[index]
    assert url.startswith("arena:") or list((path / "objects").iterdir()) == []
    stats = _json(capsys, "store", "stats", url, "--json")
    assert stats["objects"] == 0 and stats["used_bytes"] == 0  # type: ignore[index]


def test_clear_refuses_on_a_terminal_without_yes(
    store: tuple[str, Path, int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _, _ = store
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["store", "clear", url]) == 2
    assert "--yes" in capsys.readouterr().err
    assert _objects_in(url) == 8  # nothing removed
    assert main(["store", "clear", url, "--yes"]) == 0
    assert _objects_in(url) == 0


def test_a_store_this_user_may_not_read_is_not_called_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stores are private (0700) by default: an operator who is not the engines' user must be told
    that the store is there and cannot be read, not that there is none."""
    url = f"local://{tmp_path}/store?capacity=1MiB"
    anyio.run(LocalBackend.from_url(url).aclose)  # (a store, as an engine makes it)
    real_lstat = os.lstat

    def refused(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if "kvflow.lock" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", refused)
    assert main(["store", "stats", url]) == 1
    err = capsys.readouterr().err
    assert "may not be read by this user" in err and "no store at" not in err


def test_bad_targets_are_refused_with_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "stats", f"local://{tmp_path}/nothing-here"]) == 1
    assert "no store at" in capsys.readouterr().err
    (tmp_path / "a-file").write_bytes(b"")
    assert main(["store", "stats", f"local://{tmp_path}/a-file"]) == 1  # (a traceback, for a while)
    assert "no store at" in capsys.readouterr().err
    assert not (tmp_path / "nothing-here").exists()  # not created by looking
    assert main(["store", "stats", f"arena://{tmp_path}/nothing-here"]) == 1
    assert "no arena store at" in capsys.readouterr().err
    assert not (tmp_path / "nothing-here").exists()
    assert main(["store", "ls", "memory://"]) == 1
    assert "local://, arena:// and mooncake://" in capsys.readouterr().err


@given(st.text(min_size=1, max_size=120))
def test_every_key_comes_back_from_its_file_name(key: str) -> None:
    name = object_file_name(key)
    assert key_of_file_name(name) == (None if name.startswith("~") else key)


async def test_the_local_backend_lists_keys_and_sizes_also_of_keys_too_long_for_a_name(
    tmp_path: Path,
) -> None:
    """A key too long for a file name is named by its digest, and its object keeps the key after
    the payload: listing gives it back, and the object reads as any other."""
    backend = LocalBackend.from_url(f"local://{tmp_path}/s")
    try:
        data = bytearray(os.urandom(300))
        long_key = "k" * 300
        objects = [ObjectRef.of(k, [buffer_address(data)], [n]) for k, n in (("a/b c", 10), (long_key, 300))]
        await backend.put(objects)
        assert object_file_name(long_key).startswith("~")
        (tmp_path / "s" / "objects" / ".hidden").write_bytes(b"not kvflow's")
        assert sorted(await backend.list_objects(), key=str) == sorted(
            [("a/b c", 10), (long_key, 300)], key=str
        )
        out = bytearray(300)
        assert await backend.get([ObjectRef.of(long_key, [buffer_address(out)], [300])]) == [GetStatus.HIT]
        assert out == data
        assert await backend.usage() == 2 * HEADER_SIZE + 310 + len(long_key)
        assert await backend.clear() == 2
        assert await backend.list_objects() == [] and await backend.usage() == 0
    finally:
        await backend.aclose()


def test_clear_by_model_reaches_a_model_whose_keys_are_too_long_for_a_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A served name that is a long path makes keys longer than a file name may be: `kvflow store`
    still lists and clears that model's KV (and leaves the other model's)."""
    url = f"local://{tmp_path}/store?capacity=64MiB"
    long_model = "/models/" + "x" * 180
    caches = {"l0": torch.randn(8, 2, BLOCK, 16)}

    async def fill() -> None:
        for model in (long_model, "small"):
            async with KVPool.create(
                PoolConfig(backend=url, model=model), layout=KVLayout.from_kv_caches(caches)
            ) as pool:
                assert (
                    await pool.store(KVRequest(tokens=list(range(3 * BLOCK)), block_ids=[1, 2, 3]))
                ).stored == 3

    anyio.run(fill)
    listed = _json(capsys, "store", "ls", url, "--model", long_model, "--json")
    assert isinstance(listed, list) and sorted(o["kind"] for o in listed) == ["kv", "kv", "kv", "profiles"]
    assert _json(capsys, "store", "clear", url, "--model", long_model, "--json")["removed"] == 4  # type: ignore[index]
    left = anyio.run(read_inventory, url).objects
    assert {o.model for o in left} == {"small"} and all(o.kind != "other" for o in left)


def test_clear_by_model_says_so_when_an_arena_kept_no_keys_that_long(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """An arena keeps keys of up to 254 bytes for listing: a model named by a long path stores
    KV that `--model` cannot find. The put warns once, and `clear --model` says what it left and
    fails (exit 1), rather than report success with the model's KV still there."""
    with bounded_shm("64m") as shm:
        url = f"arena://{shm}/store?capacity=16MiB&slot=64KiB"
        long_model = "/models/" + "x" * 220
        caches = {"l0": torch.randn(8, 2, BLOCK, 16)}

        async def fill() -> None:
            async with KVPool.create(
                PoolConfig(backend=url, model=long_model), layout=KVLayout.from_kv_caches(caches)
            ) as pool:
                for start in (0, 3):
                    request = KVRequest(tokens=list(range(start, start + 3 * BLOCK)), block_ids=[1, 2, 3])
                    assert (await pool.store(request)).stored == 3

        with caplog.at_level("WARNING", logger="kvflow"):
            anyio.run(fill)
        warned = [r for r in caplog.records if "longer than the 254 a slot keeps" in r.getMessage()]
        assert len(warned) == 1  # once per backend, not per put
        assert main(["store", "clear", url, "--model", long_model, "--yes", "--json"]) == 1
        out, err = capsys.readouterr()
        outcome = json.loads(out)
        assert outcome["removed"] == 0 and outcome["unnamed"] >= 6  # its KV: six blocks, left
        assert "objects were left whose keys the store did not keep" in err
        assert main(["store", "clear", url, "--yes", "--json"]) == 0  # every object: they go
        assert json.loads(capsys.readouterr().out)["removed"] == outcome["unnamed"]


@pytest.mark.parametrize("case", ["kept no key", "another key kept"])
async def test_a_digest_named_object_without_its_key_lists_unnamed_and_still_reads(
    case: str, tmp_path: Path
) -> None:
    """An object that keeps no key (written before objects kept them) or whose kept key does not
    match its header's digest lists with no key; a get of its key still reads it."""
    backend = LocalBackend.from_url(f"local://{tmp_path}/s")
    try:
        key, payload = "k" * 300, os.urandom(40)
        kept = b"" if case == "kept no key" else ("j" * 300).encode()
        header = Header(len(payload), 0, key_digest(key), len(kept))
        header = attrs.evolve(header, checksum=payload_checksum([memoryview(payload)], header))
        (tmp_path / "s" / "objects" / object_file_name(key)).write_bytes(header.pack() + payload + kept)
        assert await backend.list_objects() == [(None, 40)]
        out = bytearray(40)
        assert await backend.get([ObjectRef.of(key, [buffer_address(out)], [40])]) == [GetStatus.HIT]
        assert bytes(out) == payload
    finally:
        await backend.aclose()


async def test_the_arena_lists_keys_sizes_and_keys_too_long_to_keep(tmp_path: Path) -> None:
    backend = ArenaBackend.from_url(f"arena://{tmp_path}/s?capacity=64KiB&slot=4KiB")
    try:
        data = bytearray(b"x" * 300)
        kept = "k" * 254  # a slot keeps 254 bytes of its key
        odd = "a\udcff"  # a lone surrogate: not UTF-8, but a str key all the same
        nul = "a\0b"  # keys are joined by NULs to be encoded in one call: not this one
        huge = "o" * 65_540  # (its length is no u16)
        sizes = {"a/b c": 10, kept: 20, odd: 30, "l" * 255: 40, "m" * 256: 50, "n" * 300: 60, nul: 70}
        sizes[huge] = 80
        await backend.put([ObjectRef.of(k, [buffer_address(data)], [n]) for k, n in sizes.items()])
        listed = sorted(await backend.list_objects(), key=str)
        expected = [("a/b c", 10), (kept, 20), (odd, 30), (None, 40), (None, 50), (None, 60), (nul, 70)]
        expected.append((None, 80))
        assert listed == sorted(expected, key=str)
        out = bytearray(30)
        assert await backend.get([ObjectRef.of(odd, [buffer_address(out)], [30])]) == [GetStatus.HIT]
        assert await backend.usage() == 360
        assert await backend.clear() == 8
        assert await backend.list_objects() == [] and await backend.usage() == 0
    finally:
        await backend.aclose()
    attached = ArenaBackend.attach(f"arena://{tmp_path}/s?slot=1MiB")  # read as it was made
    assert (attached.config.slot_bytes, attached.config.capacity_bytes) == (4096, 64 * 1024)
    await attached.aclose()


def test_a_kvflow_shaped_key_with_a_lone_surrogate_lists_as_another_object(tmp_path: Path) -> None:
    """A key shaped as kvflow's whose model holds a lone surrogate is no kvflow key: ``ls``,
    ``stats`` and ``clear --model`` list it as another object (they raised UnicodeEncodeError)."""
    url = f"local://{tmp_path}/store?capacity=1MiB"
    buf = bytearray(b"x" * 64)

    async def put() -> None:
        backend = LocalBackend.from_url(url)
        try:
            for model in ("m\ud800", "good"):
                key = f"kvf2@{model}@x@y@b1@l0-1@h0-1@d0.1@p0.1@00"
                assert await backend.put([ObjectRef.of(key, [buffer_address(buf)], [64])]) == [
                    PutStatus.STORED
                ]
        finally:
            await backend.aclose()

    anyio.run(put)
    assert main(["store", "ls", url]) == 0
    assert main(["store", "clear", url, "--model", "good", "--yes"]) == 0
    assert _objects_in(url) == 1  # the odd one, another object


def test_ls_prints_a_key_holding_a_lone_surrogate_as_an_escape(tmp_path: Path) -> None:
    """A key may hold a lone surrogate (the stores take any str); printing it to a UTF-8 terminal
    raised UnicodeEncodeError, with a traceback instead of the listing."""
    url = f"local://{tmp_path}/store?capacity=1MiB"
    buf = bytearray(b"x" * 64)

    async def put() -> None:
        backend = LocalBackend.from_url(url)
        try:
            assert await backend.put([ObjectRef.of("odd\ud800key", [buffer_address(buf)], [64])])
        finally:
            await backend.aclose()

    anyio.run(put)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # (a UTF-8 terminal, strict)
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "store", "ls", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "odd\\ud800key" in done.stdout


def _objects(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {
        p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in (root / "objects").iterdir()
    }


def test_stats_opens_a_local_store_as_an_engine_does_and_tidies_it_as_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvflow store stats`` creates no store, but opening one (as an engine does) tidies it:
    a missing ``tmp/`` is made, the directory's mode becomes the store's (0700, private), the
    lock file grows to its journal's size, dead writers' temp files go; no object changes
    (docs/operations.md)."""
    url = f"local://{tmp_path}/store?capacity=64MiB"
    anyio.run(_fill, url)
    root = tmp_path / "store"
    objects = _objects(root)
    assert objects
    os.rmdir(root / "tmp")
    os.chmod(root, 0o750)
    os.truncate(root / "kvflow.lock", 16)
    assert main(["store", "stats", url]) == 0
    assert (root / "tmp").is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert (root / "kvflow.lock").stat().st_size == JOURNAL_END

    me = WriterId.current()
    dead = TempName(
        WriterId(me.namespace, me.pid, me.start + 1), 4096, "ab12cd"
    ).format()  # this pid, an older process
    (root / "tmp" / dead).write_bytes(b"\0" * 4096)
    os.chmod(root / "tmp" / dead, 0o600)
    assert main(["store", "stats", url]) == 0
    assert not (root / "tmp" / dead).exists()
    assert _objects(root) == objects
    capsys.readouterr()


async def _put_blocks(url: str, model: str, count: int) -> None:
    """``count`` small KV objects of ``model`` (64 bytes each), put straight into a local store."""
    scope = KeyScope(model, "float32.kv2x8", "vllm_cpu.123", BLOCK, (0, 2), (0, 2))
    keys = block_keys(scope, [i.to_bytes(32, "big") for i in range(count)])
    buf = bytearray(64)
    backend = LocalBackend.from_url(url)
    try:
        for start in range(0, count, 64):
            batch = [ObjectRef.of(key, [buffer_address(buf)], [64]) for key in keys[start : start + 64]]
            assert await backend.put(batch) == [PutStatus.STORED] * len(batch)
    finally:
        await backend.aclose()


@attrs.define
class Sections:
    """What each lock section of a local store did: ``remove`` per object removed, ``scan`` per
    recount of the whole directory. ``before``, when set, runs as a section is asked for (before
    the lock is tried)."""

    done: list[list[str]] = attrs.field(factory=list)
    before: Callable[[], None] | None = None

    @property
    def removed(self) -> int:
        return sum(section.count("remove") for section in self.done)


@pytest.fixture
def sections(monkeypatch: pytest.MonkeyPatch) -> Sections:
    """Record the lock sections of every local store this test opens (from now on)."""
    record = Sections()
    locked, locked_blocking = SpaceLedger.locked, SpaceLedger.locked_blocking
    remove_if, scan = SpaceLedger.remove_if, SpaceLedger.scan

    def counting_locked(self: SpaceLedger, timeout_s: float) -> Any:
        if record.before is not None:
            record.before()
        record.done.append([])
        return locked(self, timeout_s)

    def counting_locked_blocking(self: SpaceLedger, timeout_s: float) -> Any:
        record.done.append([])
        return locked_blocking(self, timeout_s)

    def counting_remove_if(self: SpaceLedger, name: str, is_bad: Any) -> bool:
        record.done[-1].append("remove")
        return remove_if(self, name, is_bad)

    def counting_scan(self: SpaceLedger) -> None:
        record.done[-1].append("scan")
        scan(self)

    monkeypatch.setattr(SpaceLedger, "locked", counting_locked)
    monkeypatch.setattr(SpaceLedger, "locked_blocking", counting_locked_blocking)
    monkeypatch.setattr(SpaceLedger, "remove_if", counting_remove_if)
    monkeypatch.setattr(SpaceLedger, "scan", counting_scan)
    return record


@contextlib.contextmanager
def lock_holder(root: Path) -> Iterator[Callable[[], None]]:
    """A function that takes the store's lock as another process would (its own open file of
    ``kvflow.lock``) and keeps it: a stopped engine. Released on leaving."""
    fd = os.open(root / "kvflow.lock", os.O_RDWR)

    def take() -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    try:
        yield take
    finally:
        os.close(fd)


def _file_names(root: Path) -> set[str]:
    return {p.name for p in (root / "objects").iterdir()}


def test_clear_of_one_model_removes_in_lock_sections_of_a_bounded_size(
    tmp_path: Path, sections: Sections, capsys: pytest.CaptureFixture[str]
) -> None:
    """`clear --model` removed all of the model's objects in one lock section, which every engine's
    puts wait for (0.8 s for 40,000 objects, past their lock timeout for some 500,000); it removes
    at most 256 per section, as `clear` does."""
    url = f"local://{tmp_path}/store"
    anyio.run(_put_blocks, url, "big", 600)
    anyio.run(_put_blocks, url, "small", 5)
    kept = {n for n in _file_names(tmp_path / "store") if "@small@" in n}
    sections.done.clear()
    outcome = _json(capsys, "store", "clear", url, "--model", "big", "--json")
    assert outcome == {"url": url, "model": "big", "removed": 600, "failed": 0, "unnamed": 0}
    removes = [section.count("remove") for section in sections.done]
    assert sum(removes) == 600 and max(removes) <= 256
    assert _file_names(tmp_path / "store") == kept and len(kept) == 5


def test_stats_of_a_local_store_read_its_usage_counter_without_a_scan_under_the_lock(
    tmp_path: Path, sections: Sections, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stats` recounted the whole directory in one lock section (0.55 s for 40,000 objects, which
    every engine's puts waited for); it reads the usage counter the engines keep instead, which
    is the files' total."""
    url = f"local://{tmp_path}/store"
    anyio.run(_put_blocks, url, "m", 300)
    sections.done.clear()
    stats = _json(capsys, "store", "stats", url, "--json")
    assert isinstance(stats, dict) and stats["objects"] == 300
    assert stats["used_bytes"] == sum(p.stat().st_size for p in (tmp_path / "store" / "objects").iterdir())
    assert sections.done and not any("scan" in section for section in sections.done)


@pytest.mark.parametrize(
    "argv",
    [["stats"], ["ls"], ["clear", "--yes"], ["clear", "--model", "m", "--yes"]],
    ids=["stats", "ls", "clear", "clear --model"],
)
def test_a_lock_taken_after_the_tool_opened_the_store_is_a_message_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """An engine stopped inside a lock section just after `kvflow store` opened the store: the
    wait for the lock ended in a TimeoutError traceback; now the command says which lock to look
    at and what to do, removes nothing, and exits 1."""
    url = f"local://{tmp_path}/store?lock_timeout=0.1"
    anyio.run(_put_blocks, url, "m", 5)
    before = _file_names(tmp_path / "store")
    opened = admin._open_local
    with lock_holder(tmp_path / "store") as take:

        def open_then_lock(url: str) -> Any:
            backend = opened(url)
            take()
            return backend

        monkeypatch.setattr(admin, "_open_local", open_then_lock)
        assert main(["store", argv[0], url, *argv[1:]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvflow store: ") and "Traceback" not in err
    assert f"waited 0.1s for the lock {tmp_path}/store/kvflow.lock" in err
    assert "`lslocks` shows its PID" in err and "try again" in err
    if argv == ["clear", "--yes"]:
        assert "removed 0 of 5 objects" in err
    assert _file_names(tmp_path / "store") == before


@pytest.mark.parametrize("model", [None, "m"])
def test_a_clear_stopped_part_way_by_a_held_lock_says_how_many_it_removed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sections: Sections,
    capsys: pytest.CaptureFixture[str],
    model: str | None,
) -> None:
    """Another process takes the store's lock and keeps it once `clear` (or `clear --model`) has
    removed 4 of 10 objects (4 per section here): the command died with a traceback and did not
    say how many went; now it says, truly, exits 1, and gives the count in its JSON too."""
    monkeypatch.setattr(local, "_LIST_GROUP", 4)
    monkeypatch.setattr(admin, "_REMOVE_GROUP", 4)
    url = f"local://{tmp_path}/store?lock_timeout=0.1"
    root = tmp_path / "store"
    anyio.run(_put_blocks, url, "m", 10)
    by_model = ["--model", model] if model else []
    with lock_holder(root) as take:

        def take_after_four() -> None:
            if sections.removed == 4:
                take()

        sections.before = take_after_four
        assert main(["store", "clear", url, *by_model, "--yes", "--json"]) == 1
    out, err = capsys.readouterr()
    objects = f"objects of model {model!r}" if model else "objects"
    assert err.startswith(f"kvflow store: removed 4 of 10 {objects} from {url}, then: the local store ")
    assert "lslocks" in err and "Traceback" not in err
    assert json.loads(out) == {
        "url": url,
        "model": model,
        "removed": 4,
        "failed": 6,
        "error": err[14:].strip(),
    }
    assert len(_file_names(root)) == 6
