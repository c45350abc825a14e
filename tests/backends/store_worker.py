"""A separate OS process using a store of this host (local or arena), and :class:`Workers`, which
runs several of them for the tests of tests/backends/test_local.py and test_arena.py.

    python tests/backends/store_worker.py '<json spec>'

It opens the store, prints ``READY``, waits for a line on stdin (so that every worker starts at
once), runs its rounds and prints one JSON report line. Spec keys: dir, capacity, writer (0-255),
keys, size, rounds, batch, seed, url (a store URL: opened instead of the local store at dir), and
pause (put the first key and stop mid-write: prints ``PAUSED <temp file or slot>`` and sleeps until
killed).

Objects are ``size`` bytes split into three regions that lie out of order in memory, so every put
gathers and every get scatters. Byte 0 of an object is its writer; the rest is a pseudo-random
stream seeded by (key, writer), so a reader can check every byte of whatever version it got.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.backends.base import Backend, GetStatus, ObjectBatch, ObjectRef
from kvflow.regions import buffer_address


def content(key: str, writer: int, size: int) -> bytes:
    """The bytes writer ``writer`` stores under ``key``."""
    return bytes([writer]) + random.Random(f"{key}/{writer}").randbytes(size - 1)


def regions(addr: int, size: int) -> tuple[list[int], list[int]]:
    """Three regions of a ``size``-byte buffer at ``addr``, listed out of memory order."""
    a, b = size // 4, size // 2
    return [addr + b, addr, addr + a], [size - b, a, b - a]


def _by_column(refs: list[ObjectRef]) -> ObjectBatch:
    """The objects (of one shape) as a batch by column, as the transfer layer sends them."""
    return ObjectBatch(
        [r.key for r in refs], np.asarray([r.addrs for r in refs]), refs[0].sizes, refs[0].nbytes
    )


def _flatten(buf: bytearray) -> bytes:
    """The object a buffer holds, in the order :func:`regions` lists them."""
    size = len(buf)
    a, b = size // 4, size // 2
    return bytes(buf[b:] + buf[:a] + buf[a:b])


def _unflatten(data: bytes) -> bytearray:
    """The buffer whose regions (as :func:`regions` lists them) hold ``data``."""
    size = len(data)
    a, b = size // 4, size // 2
    head = size - b
    return bytearray(data[head : head + a] + data[head + a :] + data[:head])


def check(key: str, data: bytes, writers: int) -> str | None:
    """None when ``data`` is one writer's whole version of ``key``; else what is wrong."""
    if not data or data[0] >= writers:
        return f"{key}: writer byte {data[:1]!r} out of range"
    if data != content(key, data[0], len(data)):
        return f"{key}: bytes differ from writer {data[0]}'s version"
    return None


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    import kvflow.backends.arena.backend as arena
    import kvflow.backends.local.backend as local
    from kvflow.backends import open_backend

    backend: Backend
    if "url" in spec:
        backend = open_backend(spec["url"])
    else:
        backend = local.LocalBackend(local.LocalConfig(spec["dir"], capacity_bytes=spec["capacity"]))
    size, writer, writers = spec["size"], spec["writer"], spec.get("writers", 256)
    if spec.get("pause"):

        def pause(where: object) -> None:
            print(f"PAUSED {where}", flush=True)
            time.sleep(600)

        local._mid_write_hook = pause
        arena._mid_write_hook = pause
    print("READY", flush=True)
    sys.stdin.readline()

    report: dict[str, Any] = {"torn": [], "seen": {}, "put": {}, "get": {}}
    rng = random.Random(spec.get("seed", writer))
    keys = list(spec["keys"])
    for _ in range(spec.get("rounds", 1)):
        rng.shuffle(keys)
        for start in range(0, len(keys), spec.get("batch", 8)):
            batch = keys[start : start + spec.get("batch", 8)]
            sources = [_unflatten(content(key, writer, size)) for key in batch]
            refs = [ObjectRef.of(k, *regions(buffer_address(s), size)) for k, s in zip(batch, sources)]
            for put_status in await backend.put(_by_column(refs) if spec.get("by_column") else refs):
                report["put"][put_status.value] = report["put"].get(put_status.value, 0) + 1
            targets = [bytearray(size) for _ in batch]
            refs = [ObjectRef.of(k, *regions(buffer_address(t), size)) for k, t in zip(batch, targets)]
            got = await backend.get(_by_column(refs) if spec.get("by_column") else refs)
            for key, target, status in zip(batch, targets, got):
                report["get"][status.value] = report["get"].get(status.value, 0) + 1
                if status is GetStatus.HIT:
                    data = _flatten(target)
                    problem = check(key, data, writers)
                    if problem:
                        report["torn"].append(problem)
                    report["seen"].setdefault(key, []).append(data[0])
    report["evictions"] = backend.stats().evictions
    await backend.aclose()
    return report


class Workers:
    """Worker processes started together; each returns one JSON report."""

    def __init__(self, specs: list[dict[str, Any]]) -> None:
        script = Path(__file__)
        env = {**os.environ, "PYTHONPATH": str(script.parents[2])}
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(script), json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for spec in specs
        ]

    def wait_for(self, proc: subprocess.Popen[str], prefix: str, timeout: float = 30) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line.strip()
            if not line and proc.poll() is not None:
                break
        raise AssertionError(f"worker {proc.pid} never printed {prefix!r} (exit code {proc.poll()})")

    def go(self) -> None:
        """Once every worker has opened its store (READY), let them all start at once."""
        self.ready()
        self.start()

    def ready(self) -> None:
        """Wait until every worker has opened its store."""
        for proc in self.procs:
            self.wait_for(proc, "READY")

    def start(self) -> None:
        """Let every worker (all :meth:`ready`) start its rounds."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def run(self, timeout: float = 60) -> list[dict[str, Any]]:
        self.go()
        return self.reports(timeout)

    def reports(self, timeout: float = 60) -> list[dict[str, Any]]:
        """Once :meth:`go` let them start, wait for every worker's report."""
        reports = []
        for proc in self.procs:
            out, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"worker {proc.pid} exited with {proc.returncode}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports

    @classmethod
    def run_all(cls, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Start one worker per spec, run them together and return their reports (never leaks one)."""
        workers = cls(specs)
        try:
            return workers.run()
        finally:
            workers.kill_all()

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


async def read_all(backend: Backend, keys: list[str], size: int, writers: int) -> dict[str, int]:
    """Get every key; check every hit's bytes; return key -> writer of the version found."""
    found: dict[str, int] = {}
    for key in keys:
        target = bytearray(size)
        status = (await backend.get([ObjectRef.of(key, *regions(buffer_address(target), size))]))[0]
        if status is GetStatus.HIT:
            data = _flatten(target)
            assert check(key, data, writers) is None
            found[key] = data[0]
        else:
            assert status is GetStatus.MISS
    return found


def main() -> None:
    import anyio

    spec = json.loads(sys.argv[1])
    print(json.dumps(anyio.run(_run, spec)), flush=True)


if __name__ == "__main__":
    main()
