"""The tools at their edges (`kvflow demo`, `kvflow bench`, `kvflow store`, the CLI): a verdict
that cannot pass on lost or wrong bytes, nothing left in a store, clear errors. Every store lives
in pytest's tmp_path."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import attrs
import pytest
import torch

from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends import GetStatus, ObjectRef, PutStatus
from kvflow.cli import main
from kvflow.tools import bench, bench_scale
from kvflow.tools.demo import run_demo
from kvflow.tools.store_admin import clear_store, read_inventory
from kvflow.tools.workload import Geometry
from tests.helpers import FaultyBackend, _book

SMALL = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)

# --- kvflow demo ----------------------------------------------------------------------------------


@attrs.define
class DownAfterTwoPuts(FaultyBackend):
    """A store that takes the first two KV puts, then fails every put (the profile book's pass)."""

    ok_puts: int = 2

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if not _book(objects):
            self.ok_puts -= 1
            if self.ok_puts < 0:
                raise ConnectionError("injected: the store went down")
        return await super().put(objects)


async def test_demo_is_not_verified_when_most_stores_failed() -> None:
    """README: the demo "exits non-zero if anything did not verify": a run whose stores failed (so most
    blocks are never retrieved) is NOT VERIFIED, though every block it did retrieve is right."""
    summary = await run_demo(geometry=SMALL, progress=False, backend=DownAfterTwoPuts())  # type: ignore[arg-type]
    assert summary.blocks_stored < 10  # the store failed nearly everything
    assert summary.blocks_retrieved < summary.blocks_requested
    assert not summary.verified, summary.as_dict()


async def test_demo_on_a_local_store_removes_only_what_it_stored(tmp_path: Path) -> None:
    """A workload prefix stored before the run (by "someone else") is found,
    reused and left in place; what the demo stored itself is removed; another model's object stays."""
    url = f"local://{tmp_path}/store?capacity=64MiB"
    from kvflow.keys import hash_blocks
    from kvflow.tools.workload import chat_workload, fill_block, make_kv_caches

    first = chat_workload(SMALL.block_size)[0]
    hashes = hash_blocks(first, SMALL.block_size)[:3]
    caches = make_kv_caches(SMALL, 4)
    for i, h in enumerate(hashes):
        fill_block(caches, SMALL, i, h)
    layout = KVLayout.from_kv_caches(caches)
    async with KVPool.create(PoolConfig(backend=url, model="demo-llama"), layout=layout) as pool:
        assert (await pool.store(KVRequest(block_ids=[0, 1, 2], block_hashes=hashes))).stored == 3
    async with KVPool.create(PoolConfig(backend=url, model="other"), layout=layout) as pool:
        assert (await pool.store(KVRequest(block_ids=[0], block_hashes=hashes[:1]))).stored == 1
    summary = await run_demo(url, geometry=SMALL, progress=False)
    assert summary.verified and summary.blocks_found == 3
    assert summary.blocks_removed == summary.blocks_stored
    kv = [o for o in (await read_inventory(url)).objects if o.kind == "kv"]
    assert sorted(o.model or "" for o in kv) == ["demo-llama"] * 3 + ["other"]


# --- kvflow bench ---------------------------------------------------------------------------------


@attrs.define
class CopiesOnlyOnce(FaultyBackend):
    """Copies a key's bytes on its first get; later gets of it answer HIT and copy nothing."""

    seen: set[str] = attrs.field(factory=set)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if _book(objects):
            return await self.inner.get(objects)
        fresh = [o for o in objects if o.key not in self.seen]
        if fresh:
            await self.inner.get(fresh)
        self.seen.update(o.key for o in objects)
        return [GetStatus.HIT] * len(objects)


async def test_bench_verifies_the_retrieves_it_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/benchmarks.md: the benchmarks "verify what they moved": every timed retrieve, not only the
    first, must bring every byte (a retrieve that moved nothing would be the fastest, and best-of
    would report it)."""
    real_open = bench.open_backend
    made: list[CopiesOnlyOnce] = []

    def open_backend(url: str) -> CopiesOnlyOnce:
        made.append(CopiesOnlyOnce(inner=real_open(url)))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(bench, "open_backend", open_backend)
    with pytest.raises(RuntimeError):
        await bench._store_retrieve("memory://", 16 << 10, 4, repeat=2)


@pytest.mark.parametrize("case", ["store_retrieve", "lookup"])
async def test_bench_removes_its_kv_when_a_run_fails(case: str, tmp_path: Path) -> None:
    """docs/benchmarks.md: `kvflow bench --backend URL` removes the KV it stored, so it may be pointed at a
    store in use: also when a run fails part-way (here a store too small for one batch)."""
    url = f"local://{tmp_path}/store?capacity=" + ("40KiB" if case == "store_retrieve" else "1MiB")
    with pytest.raises(RuntimeError):
        if case == "store_retrieve":
            await bench._store_retrieve(url, 16 << 10, 4, repeat=2)
        else:
            await bench._lookup_ms(url, 10_000)
    left = [o for o in (await read_inventory(url)).objects if o.kind == "kv"]
    assert not left, f"{len(left)} KV objects of {left[0].model} left in the store"


async def test_bench_removes_only_its_own_kv(tmp_path: Path) -> None:
    """Another model's object in the same store is not touched (the profile announcements the
    bench leaves are documented in docs/benchmarks.md)."""
    url = f"local://{tmp_path}/store?capacity=64MiB"
    caches = {"l0": torch.randn(4, 1, 16, 8, dtype=torch.float16)}
    async with KVPool.create(
        PoolConfig(backend=url, model="bench"), layout=KVLayout.from_kv_caches(caches)
    ) as pool:
        assert (await pool.store(KVRequest(block_ids=[0], tokens=list(range(16))))).stored == 1
    await bench._store_retrieve(url, 16 << 10, 4, repeat=2)
    await bench._lookup_ms(url, 20)
    objects = (await read_inventory(url)).objects
    assert [(o.kind, o.model) for o in objects if o.kind == "kv"] == [("kv", "bench")]
    assert all(o.kind in ("kv", "profiles") for o in objects)


async def test_bench_catches_a_backend_that_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "open_backend", lambda url: bench.NullBackend())
    with pytest.raises(RuntimeError, match="bench store 0 left some of its 4 blocks out of the store"):
        await bench._store_retrieve("memory://", 16 << 10, 4, repeat=2)


@pytest.mark.parametrize("run", ["store_size", "many_requests"])
async def test_bench_scale_checks_the_bytes_it_retrieved(run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvflow bench --scale` verifies what it moved too: a backend that answers every get HIT
    and copies nothing reports every block loaded, so only the bytes can tell."""
    monkeypatch.setattr(bench_scale, "open_backend", lambda url: bench.NullBackend())
    with pytest.raises(RuntimeError, match="other bytes than were stored"):
        if run == "store_size":
            await bench_scale._per_block_us("memory://", 0)
        else:
            await bench_scale._many_requests("memory://", 4, 2)


@pytest.mark.parametrize("mode", ["--layerwise", "--staged", "--topology"])
def test_bench_modes_do_not_silently_ignore_backend(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--layerwise, --staged and --topology run on an in-process store of their own: a --backend given with
    them is refused, not dropped without a word."""
    ran: list[str] = []
    monkeypatch.setattr("kvflow.tools.bench_layerwise.layerwise_main", lambda **k: ran.append("l") or 0)
    monkeypatch.setattr("kvflow.tools.bench_staged.staged_main", lambda **k: ran.append("s") or 0)
    monkeypatch.setattr("kvflow.tools.bench_topology.topology_main", lambda **k: ran.append("t") or 0)
    try:
        rc = main(["bench", mode, "--backend", "local:///tmp/some-store"])
    except SystemExit as exc:
        rc = exc.code  # type: ignore[assignment]
    assert rc != 0 or not ran, "the --backend was silently ignored"


# --- kvflow store ---------------------------------------------------------------------------------


def test_store_stats_creates_nothing_in_a_directory_that_is_no_store(tmp_path: Path) -> None:
    """docs/operations.md: for local stores "the directory must be a store an engine made": a directory
    that is not a store (a typo naming a home directory) is refused, and nothing is made in it."""
    plain = tmp_path / "just-a-directory"
    plain.mkdir(mode=0o700)  # private, as a home directory is (a 0755 one is refused, with "run chmod 700")
    rc = main(["store", "stats", f"local://{plain}"])
    assert sorted(p.name for p in plain.iterdir()) == [], (
        f"rc={rc}, created {sorted(p.name for p in plain.iterdir())}"
    )


def test_clear_with_an_empty_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model ""` (an unset shell variable, say) is refused, not announced as "every kvflow object" and
    then matched against nothing."""
    store = tmp_path / "store"
    anyio.run(_fill_two_models, f"local://{store}")
    rc = main(["store", "clear", f"local://{store}", "--model", "", "--yes"])
    out = capsys.readouterr()
    assert rc != 0 and "model" in out.err, (rc, out.out)


async def _fill_two_models(url: str, models: Sequence[str] = ("a", "ab")) -> None:
    caches = {"l0": torch.randn(4, 1, 16, 8, dtype=torch.float16)}
    for model in models:
        async with KVPool.create(
            PoolConfig(backend=url, model=model), layout=KVLayout.from_kv_caches(caches)
        ) as pool:
            assert (await pool.store(KVRequest(block_ids=[0, 1], tokens=list(range(33))))).stored == 2


def test_clear_and_ls_match_the_model_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model a` never touches "ab", "A", "a b", "a@b" or "%61"."""
    url = f"local://{tmp_path}/store"
    models = ("a", "ab", "A", "a b", "a@b", "%61", "a/")
    anyio.run(_fill_two_models, url, models)
    assert main(["store", "ls", url, "--model", "a", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {o["model"] for o in listed} == {"a"} and len(listed) == 3  # 2 blocks + 1 announcement
    assert main(["store", "clear", url, "--model", "a", "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 3
    left = anyio.run(read_inventory, url).objects
    assert sorted({o.model or "" for o in left}) == sorted(set(models) - {"a"})
    assert len(left) == 3 * (len(models) - 1)


def test_clear_refuses_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2, nothing removed."""
    url = f"local://{tmp_path}/store"
    anyio.run(_fill_two_models, url)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["store", "clear", url]) == 2
    assert len(anyio.run(read_inventory, url).objects) == 6
    assert anyio.run(clear_store, url) == {"removed": 6, "failed": 0, "unnamed": 0}


# --- the CLI --------------------------------------------------------------------------------------


def test_demo_with_a_bad_url_says_what_to_do_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad URL is a one-line error and exit 2 (not a traceback with exit 1, NOT VERIFIED's code)."""
    assert main(["demo", "--backend", "foo://"]) == 2
    assert "unknown backend URL 'foo://'" in capsys.readouterr().err


def test_a_models_name_finds_its_objects_under_every_engine_variant() -> None:
    """A vLLM engine keys its model as ``name#variant`` (kvflow.integrations.vllm.topology): ``--model
    name`` finds those, and never another name's."""
    from kvflow.tools.store_admin import _names

    assert _names("llama", "llama") and _names("llama#0123456789abcdef", "llama")
    assert not _names("llama2#0123456789abcdef", "llama") and not _names("llama#x", "llama")
    assert not _names("llama#0123456789abcdef", "llama#") and not _names("a#llama", "llama")


def test_only_the_command_word_starts_a_mooncake_master(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mooncake-master`` is a command only where the command stands (the first word that is no
    option): as another command's value (``kvflow store ls ... --model mooncake-master``) it is
    that value, and no master starts; ``kvflow -v mooncake-master --port 1`` still hands the words
    after it to the master."""
    import kvflow.tools.mooncake_master as mooncake_master

    started: list[list[str]] = []

    def fake_master(argv: list[str]) -> int:
        started.append(argv)
        return 0

    monkeypatch.setattr(mooncake_master, "main", fake_master)
    store = tmp_path / "mooncake-master"
    rc = main(["store", "ls", f"local://{store}", "--model", "mooncake-master"])
    assert not started
    assert rc != 0 and "no store at" in capsys.readouterr().err  # `store ls` itself answered
    assert main(["-v", "mooncake-master", "--port", "1"]) == 0
    assert started == [["--port", "1"]]


@pytest.mark.parametrize("argv", [["demo"], ["bench", "--staged"]])
@pytest.mark.parametrize("device", ["foo", "cuda:x", "npux", "cuda:99"])
def test_a_device_the_tools_cannot_use_is_a_one_line_error_before_anything_runs(
    argv: list[str], device: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow demo --device foo` (a typo), a malformed index, or a device this machine does not
    have is refused up front with one line naming it and exit 2, as a bad --backend is (not a
    torch traceback and exit 1); nothing is stored or measured."""
    from kvflow.tools import demo

    monkeypatch.setattr(demo, "open_backend", lambda url: pytest.fail("the demo opened a backend"))
    monkeypatch.setattr(
        "kvflow.tools.bench_staged.make_kv_caches", lambda *a: pytest.fail("the bench made caches")
    )
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err
    assert device in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--device", "cuda"],
        ["--quick", "--device", "cpu"],
        ["--scale", "--device", "cuda"],
        ["--topology", "--device", "cpu"],
    ],
)
def test_bench_refuses_a_device_without_staged(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`--device` says where `--staged`'s caches live; given to another bench it would be ignored
    (the bench runs on the CPU), so it is refused with what to add, before anything runs."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2
    assert "--device says where --staged's caches live: add --staged" in capsys.readouterr().err


def test_cuda_on_a_machine_without_cuda_says_to_use_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--device cuda:0` where torch sees no CUDA device (a CPU-only build) is exit 2 with a line
    saying so, not "Torch not compiled with CUDA enabled" from deep inside the run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda:0"]) == 2
    err = capsys.readouterr().err
    assert "sees no cuda device" in err and "use --device cpu" in err, err


def test_bench_plot_to_a_file_it_cannot_write_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow bench --plot` into a missing directory, onto a directory, or in a format matplotlib
    does not write is one line and exit 2 before anything is measured (not a savefig traceback
    after minutes of measuring)."""
    pytest.importorskip("matplotlib")
    ran: list[str] = []

    async def fake_run(url: str, *, quick: bool, progress: bool) -> dict[str, object]:
        ran.append(url)
        return {}

    monkeypatch.setattr(bench, "run_bench", fake_run)
    for target in (tmp_path / "no-such-dir" / "x.png", tmp_path, tmp_path / "x.nosuchformat"):
        assert main(["bench", "--quick", "--plot", str(target)]) == 2
        err = capsys.readouterr().err
        assert str(target) in err and len(err.strip().splitlines()) == 1, err
    assert not ran


def test_bench_plot_that_fails_to_write_keeps_the_results_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plot that cannot be written after the run (the directory went away meanwhile) is one line
    and exit 2, and the results were printed first: nothing measured is lost."""
    pytest.importorskip("matplotlib")
    row = {"object_kib": 64.0, "batch": 1, "best_memcpy_gbps": 1.0, "store_gbps": 2.0, "retrieve_gbps": 3.0}
    result: dict[str, object] = {"backend": "memory://", "store_retrieve": [row]}
    target = tmp_path / "gone" / "x.png"
    target.parent.mkdir()

    async def fake_run(url: str, *, quick: bool, progress: bool) -> dict[str, object]:
        target.parent.rmdir()
        return result

    monkeypatch.setattr(bench, "run_bench", fake_run)
    assert main(["bench", "--json", "--plot", str(target)]) == 2
    out = capsys.readouterr()
    assert json.loads(out.out) == result
    assert f"--plot {target}: could not write the plot" in out.err and len(out.err.strip().splitlines()) == 1


def test_bench_plot_draws_each_size_at_its_largest_batch_beside_the_baseline_of_both_directions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot has one point per object size, from that size's largest batch, for the store, the
    retrieve and the memcpy both are compared with (the faster of memmove and the streamed copy),
    and is written as a PNG."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from kvflow.tools.bench_plot import plot_throughput

    def row(kib: float, batch: int, base: float) -> dict[str, float]:
        return {
            "object_kib": kib,
            "batch": batch,
            "memcpy_gbps": base,
            "best_memcpy_gbps": base + 0.5,
            "store_gbps": base + 0.1,
            "retrieve_gbps": base + 0.2,
        }

    result = {"backend": "memory://", "store_retrieve": [row(64, 16, 1), row(64, 256, 2), row(256, 64, 3)]}
    drawn: dict[str, list[float]] = {}
    real = Axes.plot

    def plot(self: Axes, xs: list[float], ys: list[float], style: str, *, label: str) -> object:
        drawn[label] = [*xs, *ys]
        return real(self, xs, ys, style, label=label)

    monkeypatch.setattr(Axes, "plot", plot)
    target = tmp_path / "throughput.png"
    plot_throughput(result, str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == {
        "memcpy (the faster of memmove and streamed)": [64, 256, 2.5, 3.5],
        "store": [64, 256, 2.1, 3.1],
        "retrieve": [64, 256, 2.2, 3.2],
    }
