"""The compiled copy loops: loaded from numba's on-disk cache by the next process (not compiled
again), compiled in memory where no cache directory is writable, and loaded by a backend as it
opens rather than at its first copy on the event loop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from numba.core import caching

from kvflow import regions
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from kvflow.backends.arena import backend as arena_backend
from kvflow.backends.arena.table import compile_passes
from kvflow.backends.base import Backend
from kvflow.backends.memory import MemoryBackend
from kvflow.copyloops import STREAMS, Loops, compile_loops

# One process's use of the loops: which were loaded from the cache, which compiled.
PROBE = """
import json
from kvflow.copyloops import compile_loops
loops = compile_loops()
print(json.dumps({name: [sum(getattr(fn.stats, kind).values()) for kind in ("cache_hits", "cache_misses")]
                  for name, fn in (("rows", loops.rows), ("ragged", loops.ragged))}))
"""


def probe(cache_dir: Path) -> dict[str, list[int]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counts: dict[str, list[int]] = json.loads(done.stdout)
    return counts


def copies(loops: Loops) -> None:
    """Both loops copy two objects' regions out of ``source`` and back into ``target``."""
    source = torch.arange(64, dtype=torch.uint8)
    base, out, target = (
        source.data_ptr(),
        torch.zeros(16, dtype=torch.uint8),
        torch.zeros(64, dtype=torch.uint8),
    )
    starts = np.array([out.data_ptr(), out.data_ptr() + 8], dtype=np.int64)
    addrs = np.array([[base + 40, base + 2], [base + 10, base + 60]], dtype=np.int64)
    sizes = np.array([5, 3], dtype=np.int64)
    loops.rows(starts, addrs, sizes, False, False)
    assert out.tolist() == [40, 41, 42, 43, 44, 2, 3, 4, 10, 11, 12, 13, 14, 60, 61, 62]
    shift = target.data_ptr() - base
    counts = np.array([2, 2], dtype=np.int64)
    loops.ragged(starts, counts, addrs.ravel() + shift, np.tile(sizes, 2), True, False)
    assert torch.equal(target[[40, 2, 10, 60]], source[[40, 2, 10, 60]]) and int(target[20]) == 0


def test_the_next_process_loads_the_loops_from_the_cache(tmp_path: Path) -> None:
    assert probe(tmp_path) == {"rows": [0, 1], "ragged": [0, 1]}  # compiled, and saved
    saved = sorted(tmp_path.rglob("*.nbc"))
    assert saved
    assert probe(tmp_path) == {"rows": [1, 0], "ragged": [1, 0]}  # loaded, not compiled
    assert sorted(tmp_path.rglob("*.nbc")) == saved  # nothing more piled up


def test_without_a_writable_cache_the_loops_compile_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only install without NUMBA_CACHE_DIR: numba finds no place for its cache and
    refuses ``cache=True``; the loops are compiled without it and copy the same."""
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # renamed in numba 0.61
    monkeypatch.setattr(impl, "_locator_classes", [])
    loops = compile_loops()
    assert not loops.cached
    copies(loops)
    assert not compile_passes().cached  # the arena's claim, compiled the same way


def test_cached_loops_copy() -> None:
    loops = compile_loops()
    assert loops.cached
    copies(loops)


@pytest.mark.parametrize("kind", ["memory", "arena"])
async def test_a_backend_loads_the_loops_as_it_opens(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not at its first put, on the event loop, where numba's import and the load take a second."""
    loaded: list[str] = []
    monkeypatch.setattr(regions, "warm", lambda: loaded.append("copy loops"))
    monkeypatch.setattr(arena_backend, "passes", lambda: loaded.append("arena table"))
    if kind == "memory":
        backend: Backend = MemoryBackend()
    else:
        backend = ArenaBackend(
            ArenaConfig(str(tmp_path / "store"), capacity_bytes=1 << 20, slot_bytes=1 << 16)
        )
    assert loaded == (["copy loops"] if kind == "memory" else ["copy loops", "arena table"])
    await backend.aclose()


def test_warming_calls_each_loop_once_on_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba's first call in a process costs about 10 ms: a backend pays it as it opens, through
    :func:`kvflow.regions.warm`, not in its first put on the event loop."""
    calls: list[tuple[str, int]] = []

    def rows(*args: np.ndarray | bool) -> None:
        calls.append(("rows", sum(a.size for a in args if isinstance(a, np.ndarray))))

    def ragged(*args: np.ndarray | bool) -> None:
        calls.append(("ragged", sum(a.size for a in args if isinstance(a, np.ndarray))))

    monkeypatch.setattr(regions, "_kernels", lambda: Loops(rows, ragged, cached=True))
    regions.warm()
    assert calls == [("rows", 0), ("ragged", 0)]


@pytest.mark.skipif(not STREAMS, reason="streaming stores are written on x86-64 only (memmove elsewhere)")
def test_each_loop_writes_with_non_temporal_stores_both_ways_and_fences() -> None:
    """Each compiled loop has the streamed body twice, one for a put's gather and one for a get's
    scatter (four vector stores per step each), and a store fence after them: a loop whose
    scatter went back to memmove, or that lost its fence, has fewer. LLVM may copy each body
    alike when it unrolls the loops around them (twice, with a remainder, on an AMD Zen 4: six
    blocks of four stores), so the blocks that stream come in pairs, four stores each."""
    loops = compile_loops(cache=False)
    for loop in (loops.rows, loops.ragged):
        (llvm,) = loop.inspect_llvm().values()
        blocks = re.split(r"\n(?=[\w.]+:)", llvm)  # (each basic block starts with its label)
        streamed = [n for n in (len(re.findall(r"store <4 x i64> .*!nontemporal", b)) for b in blocks) if n]
        assert streamed and all(n == 4 for n in streamed) and len(streamed) % 2 == 0, streamed
        assert "call void @llvm.x86.sse.sfence()" in llvm
