"""kvflow's Mooncake backend against the raw Mooncake client doing the same batch calls.

Run as root inside a private network namespace (Mooncake listens on every interface)::

    unshare -n bash -c 'ip link set lo up; export MC_TCP_BIND_ADDRESS=127.0.0.1;
        .venv/bin/python benchmarks/mooncake_backend.py [--sizes 256KiB,512KiB,1MiB,2MiB]
        [--total 64MiB] [--regions 1,16] [--repeat 15] [--holder] [--json]'

One master on loopback and one client (kvflow's backend) whose segment takes every object; with
``--holder``, the client lends no memory and a second process (``mooncake_client``, a segment
holder as a storage node runs) takes every object, so puts and gets cross processes over TCP. Three
sides move the same ``--total`` bytes per batch (``total / size`` objects), each object ``--regions``
regions far apart in registered memory, through that one client:

- raw: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` on the backend's own
  Mooncake client, called directly on the loop's thread as a plain client's user calls them;
- kv: ``await MooncakeBackend.put`` / ``get`` (a put first asks which keys exist, to report
  ``PRESENT``; both run in a worker thread);
- kv*: the same with ``check_present=false`` (no existence check);
- kv+: ``put`` right after ``exists`` of the same keys (not timed), as the pool stores: it skips
  what is there first, so the put asks no second time.

Sharing one client keeps segment placement and page state equal for all sides (separate clients
differed by up to 30% from run to run). Each round uses fresh keys and rotates the order of the
sides; every key is removed between rounds; round 0 warms up and is not counted; every get is
checked against the source. Reported: median GB/s over ``--repeat`` rounds, ratios to raw, and
kvflow's own time: what its ``put``/``get`` took beyond the Mooncake calls it made (timed inside
the worker thread around each native call), the part of the gap that is kvflow's. The rest of a
ratio's distance from 1 is the client's own spread from call to call.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import time
import uuid
from typing import Protocol, cast

import anyio
import attrs

from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.mooncake import MooncakeBackend
from kvflow.backends.mooncake.native import NativeStore
from kvflow.config import parse_size
from kvflow.regions import buffer_address
from kvflow.tools.mooncake_master import free_port, start_master, start_segment_holder

SEGMENT = 1 << 30


class Store(NativeStore, Protocol):
    def remove_all(self, force: bool) -> int: ...


@attrs.define
class TimedStore:
    """The backend's client with its batch calls timed (they run in a worker thread); the raw side
    calls the client itself."""

    store: Store
    native_s: float = 0.0

    def _timed(self, name: str, *args: object) -> list[int]:
        start = time.perf_counter()
        try:
            return cast(list[int], getattr(self.store, name)(*args))
        finally:
            self.native_s += time.perf_counter() - start

    def batch_put_from_multi_buffers(self, *args: object) -> list[int]:
        return self._timed("batch_put_from_multi_buffers", *args)

    def batch_get_into_multi_buffers(self, *args: object) -> list[int]:
        return self._timed("batch_get_into_multi_buffers", *args)

    def batch_is_exist(self, *args: object) -> list[int]:
        return self._timed("batch_is_exist", *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


class Side(Protocol):
    async def prepare(self, objects: list[ObjectRef]) -> None: ...

    async def put(self, objects: list[ObjectRef]) -> None: ...

    async def get(self, objects: list[ObjectRef]) -> None: ...


@attrs.define
class Raw:
    """The plain Mooncake client, called directly (blocking the loop, as plain users do)."""

    store: Store
    replicate: object

    async def prepare(self, objects: list[ObjectRef]) -> None:
        pass

    async def put(self, objects: list[ObjectRef]) -> None:
        keys, addrs = [o.key for o in objects], [list(o.addrs) for o in objects]
        sizes = [list(o.sizes) for o in objects]
        codes = self.store.batch_put_from_multi_buffers(keys, addrs, sizes, self.replicate)
        assert all(c == 0 for c in codes), codes

    async def get(self, objects: list[ObjectRef]) -> None:
        keys, addrs = [o.key for o in objects], [list(o.addrs) for o in objects]
        sizes = [list(o.sizes) for o in objects]
        codes = self.store.batch_get_into_multi_buffers(keys, addrs, sizes)
        assert all(c == o.nbytes for c, o in zip(codes, objects)), codes


@attrs.define
class Kv:
    """kvflow's backend; ``check_present`` set for this side's calls; ``asked_first``: the keys'
    ``exists`` comes before the timed put, as the pool's exists-skip does."""

    backend: MooncakeBackend
    check_present: bool
    asked_first: bool = False

    async def prepare(self, objects: list[ObjectRef]) -> None:
        if self.asked_first:
            assert await self.backend.exists([o.key for o in objects]) == [False] * len(objects)

    async def put(self, objects: list[ObjectRef]) -> None:
        self.backend.config = attrs.evolve(self.backend.config, check_present=self.check_present)
        assert await self.backend.put(objects) == [PutStatus.STORED] * len(objects)

    async def get(self, objects: list[ObjectRef]) -> None:
        assert await self.backend.get(objects) == [GetStatus.HIT] * len(objects)


def _objects(base: int, size: int, regions: int, count: int, prefix: str) -> list[ObjectRef]:
    """``count`` objects of ``size`` bytes, each ``regions`` regions one plane apart."""
    part = size // regions
    plane = part * count
    return [
        ObjectRef.of(f"{prefix}{i}", [base + r * plane + i * part for r in range(regions)], [part] * regions)
        for i in range(count)
    ]


def _check_and_clear(src: bytearray, dst: bytearray, nbytes: int) -> None:
    """The get filled exactly the bytes the put read; zero them for the next round."""
    if memoryview(dst)[:nbytes] != memoryview(src)[:nbytes]:
        raise SystemExit("a get did not bring back the bytes that were put")
    ctypes.memset(buffer_address(dst), 0, nbytes)


@attrs.frozen
class Round:
    """One side's put and get in a round: seconds each took, and seconds inside Mooncake's calls
    (the backend's client is timed inside; the raw side's calls are not, so 0 there)."""

    put_s: float
    get_s: float
    put_native_s: float
    get_native_s: float

    def seconds(self, op: str) -> float:
        return self.put_s if op == "put" else self.get_s

    def native_s(self, op: str) -> float:
        return self.put_native_s if op == "put" else self.get_native_s


async def _timed(side: Side, puts: list[ObjectRef], gets: list[ObjectRef], timer: TimedStore) -> Round:
    await side.prepare(puts)
    before = timer.native_s
    start = time.perf_counter()
    await side.put(puts)
    middle = time.perf_counter()
    after_put = timer.native_s
    await side.get(gets)
    end = time.perf_counter()
    return Round(middle - start, end - middle, after_put - before, timer.native_s - after_put)


async def run(
    sizes: list[int], regions_list: list[int], total: int, repeat: int, holder: bool = False
) -> list[dict[str, object]]:
    master = start_master(rpc_port=free_port(), metrics_port=free_port())
    rows: list[dict[str, object]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(master.stop)
        if holder:
            stack.enter_context(start_segment_holder(master.address, segment=str(SEGMENT)))
        max_batch = max(total // size for size in sizes)
        segment = 0 if holder else SEGMENT
        backend = MooncakeBackend.from_url(master.url(segment=segment, max_batch=max_batch))
        src, dst = bytearray(total), bytearray(total)
        src[:] = bytes(range(256)) * (total // 256)
        for buf in (src, dst):
            backend.register_memory(buffer_address(buf), total)
        await backend.connect()
        store = cast(Store, backend.native_store)
        timer = TimedStore(store)
        backend._store = timer  # the kv sides' calls are timed inside; the raw side calls ``store``
        sides: list[tuple[str, Side]] = [
            ("raw", Raw(store, backend._replicate)),
            ("kv", Kv(backend, check_present=True)),
            ("kvnc", Kv(backend, check_present=False)),
            ("kvp", Kv(backend, check_present=True, asked_first=True)),
        ]
        for size in sizes:
            for regions in regions_list:
                batch = total // size
                nbytes = size // regions * regions * batch
                rounds: dict[str, list[Round]] = {name: [] for name, _ in sides}
                for round_ in range(repeat + 1):
                    turn = round_ % len(sides)
                    for name, side in sides[turn:] + sides[:turn]:
                        tag = uuid.uuid4().hex[:8]
                        puts = _objects(buffer_address(src), size, regions, batch, f"bench/{tag}/")
                        gets = _objects(buffer_address(dst), size, regions, batch, f"bench/{tag}/")
                        timed = await _timed(side, puts, gets, timer)
                        _check_and_clear(src, dst, nbytes)
                        store.remove_all(True)
                        if round_:
                            rounds[name].append(timed)
                med = {
                    f"{name}_{op}": statistics.median(nbytes / r.seconds(op) / 1e9 for r in rs)
                    for name, rs in rounds.items()
                    for op in ("put", "get")
                }
                own = {  # kvflow's time beside Mooncake's calls, and the kv side's rate in those calls
                    f"kv_{op}_own_ms": statistics.median(
                        (r.seconds(op) - r.native_s(op)) * 1e3 for r in rounds["kv"]
                    )
                    for op in ("put", "get")
                }
                native = {
                    op: statistics.median(nbytes / r.native_s(op) / 1e9 for r in rounds["kv"])
                    for op in ("put", "get")
                }
                rows.append(
                    {
                        "size": size,
                        "objects": batch,
                        "regions": regions,
                        **{f"{k}_gbps": round(v, 2) for k, v in med.items()},
                        "put_ratio": round(med["kv_put"] / med["raw_put"], 2),
                        "put_nocheck_ratio": round(med["kvnc_put"] / med["raw_put"], 2),
                        "put_asked_ratio": round(med["kvp_put"] / med["raw_put"], 2),
                        "get_ratio": round(med["kv_get"] / med["raw_get"], 2),
                        "kv_put_ms": round(nbytes / med["kv_put"] / 1e6, 2),
                        "kv_get_ms": round(nbytes / med["kv_get"] / 1e6, 2),
                        **{k: round(v, 2) for k, v in own.items()},
                        "put_native_ratio": round(native["put"] / med["raw_put"], 2),
                        "get_native_ratio": round(native["get"] / med["raw_get"], 2),
                    }
                )
        await backend.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="256KiB,512KiB,1MiB,2MiB")
    parser.add_argument("--regions", default="1,16", help="regions per object, comma separated")
    parser.add_argument("--total", default="64MiB", help="bytes per batch (objects = total / size)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--holder", action="store_true", help="objects in a second process's segment (across processes)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    regions = [int(r) for r in args.regions.split(",")]
    rows = anyio.run(run, sizes, regions, parse_size(args.total), args.repeat, args.holder)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    columns = [
        ("objects", "objects"),
        ("regions", "regions"),
        ("raw put", "raw_put_gbps"),
        ("kv put", "kv_put_gbps"),
        ("ratio", "put_ratio"),
        ("kv* put", "kvnc_put_gbps"),
        ("ratio*", "put_nocheck_ratio"),
        ("kv+ put", "kvp_put_gbps"),
        ("ratio+", "put_asked_ratio"),
        ("raw get", "raw_get_gbps"),
        ("kv get", "kv_get_gbps"),
        ("ratio", "get_ratio"),
        ("put ms", "kv_put_ms"),
        ("own", "kv_put_own_ms"),
        ("get ms", "kv_get_ms"),
        ("own", "kv_get_own_ms"),
        ("n.put", "put_native_ratio"),
        ("n.get", "get_native_ratio"),
    ]
    print(f"{'size':>9}" + "".join(f"{head:>9}" for head, _ in columns))
    for row in rows:
        size = f"{int(str(row['size'])) >> 10}KiB"
        print(f"{size:>9}" + "".join(f"{row[key]!s:>9}" for _, key in columns))
    print(
        "(GB/s, median of rounds; ratio = kvflow / raw Mooncake client; * = check_present=false; "
        "+ = right after exists, as the pool puts; put ms / get ms: kvflow's call, own: its time "
        "outside Mooncake's calls, median of rounds; n.put / n.get: the kv side's rate inside Mooncake's "
        "calls against raw, the ratio kvflow would read with no time of its own)"
    )


if __name__ == "__main__":
    main()
