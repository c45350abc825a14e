"""Compiling kvflow's numba functions where numba's on-disk cache fails (:mod:`kvflow.compiled`).

A cache file another user made unreadable, a replace the directory refuses, a full filesystem: the
functions are compiled in memory instead, with one warning that says so, and a backend opens as
usual. The faults are made in numba's cache (or with ``RLIMIT_FSIZE``), which stop root too.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from numba.core import caching

import kvflow.compiled as compiled
from kvflow.backends.arena.table import compile_passes
from kvflow.copyloops import Loops, compile_loops


def fails(exc: BaseException) -> Callable[..., object]:
    def raising(*args: object, **kwargs: object) -> object:
        raise exc

    return raising


def copy_some(loops: Loops) -> None:
    """The loops copy: two regions of ``source`` into one buffer."""
    source, out = np.arange(16, dtype=np.uint8), np.zeros(5, dtype=np.uint8)
    base = source.ctypes.data
    starts = np.array([out.ctypes.data], dtype=np.int64)
    addrs = np.array([[base + 9, base + 2]], dtype=np.int64)
    loops.rows(starts, addrs, np.array([2, 3], dtype=np.int64), False, False)
    assert out.tolist() == [9, 10, 2, 3, 4]


@pytest.fixture
def warnings_of_this_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The test starts as a process that has warned of no failed cache yet."""
    monkeypatch.setattr(compiled, "_warned", False, raising=False)
    caplog.set_level(logging.WARNING, logger="kvflow.compiled")


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "kvflow.compiled" and r.levelno >= logging.WARNING
    ]


def test_an_unreadable_cache_compiles_in_memory_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, warnings_of_this_process: None
) -> None:
    """A cache file another user made (umask 077): reading it is refused. Both sets of functions
    compile in memory and work; the process is told once."""
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/cache/_rows-33.py312.nbi")
    monkeypatch.setattr(caching.IndexDataCacheFile, "load", fails(denied))
    loops = compile_loops()
    assert not loops.cached
    copy_some(loops)
    assert not compile_passes().cached
    said = cache_warnings(caplog)
    assert len(said) == 1, said
    assert "PermissionError" in said[0] and "_rows-33.py312.nbi" in said[0]
    assert "compiles its functions in memory" in said[0] and "NUMBA_CACHE_DIR" in said[0]


@pytest.mark.parametrize(
    "code",
    [errno.ENOSPC, errno.EFBIG, errno.EPERM],
    ids=["a full filesystem", "a file size limit", "a replace a sticky directory refuses"],
)
def test_a_cache_that_cannot_be_written_compiles_in_memory(
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    warnings_of_this_process: None,
) -> None:
    """Nothing found in the cache, and saving what was compiled fails: the functions compiled for
    the cache are dropped, and the ones compiled in memory are used."""
    monkeypatch.setattr(caching.IndexDataCacheFile, "load", lambda self, key: None)  # a miss
    monkeypatch.setattr(caching.IndexDataCacheFile, "save", fails(OSError(code, os.strerror(code))))
    loops = compile_loops()
    assert not loops.cached
    copy_some(loops)
    said = cache_warnings(caplog)
    assert len(said) == 1 and os.strerror(code) in said[0], said


# A process whose files may not grow past 4 KiB (Python ignores SIGXFSZ: the write fails with
# EFBIG), with an empty cache: the memory backend (whose opening loads the copy loops) opens.
_SMALL_FILES = """
import resource
import anyio
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from kvflow.backends import open_backend
anyio.run(open_backend("memory://?capacity=1MiB").aclose)
print("opened")
"""


def test_a_backend_opens_where_the_cache_cannot_be_written(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", _SMALL_FILES], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "opened", done.stderr
    assert done.stderr.count("numba's on-disk cache failed") == 1, done.stderr
    assert os.strerror(errno.EFBIG) in done.stderr
