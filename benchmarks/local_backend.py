"""Local backend throughput against memcpy of the same bytes.

    python benchmarks/local_backend.py [--dir /dev/shm/kvflow-bench] [--sizes 256KiB,1MiB,4MiB]
                                       [--total 256MiB] [--regions 2] [--repeat 3]
                                       [--io-compare] [--checksums]

For each object size it builds a fake KV cache of ``--total`` bytes whose objects are ``--regions``
regions each (K and V planes by default, far apart in memory) and measures, in GB/s:

- memcpy: the same bytes copied in object-sized chunks by one call of the compiled copy loop
  (:func:`kvflow.tools.baselines.memcpy_gbps`, the baseline of ``kvflow bench``), with `memmove`
  and with streaming stores (streamed);
- put (fill): storing every object into an empty store (the filesystem allocates new pages);
- put (churn): storing new objects into a full store (every put evicts, recycled pages reused);
- get: reading every object back into zeroed memory (verified each round, outside the timing);
- raw read, raw + xxh3: what a get cannot beat, the same object files read into the same places
  with no backend: open, one ``preadv`` of header and regions, close (and the xxh3 checksum of the
  regions that a get verifies).

Ratios are backend GB/s divided by memcpy GB/s: a put's by the faster of the plain and the
streamed memcpy (out of the CPU's caches the streamed copy is often 1.2-1.7x the plain one), the reads'
by the plain one. Every put and get must answer STORED or HIT for every object, or the run fails.
``--io-compare`` also times the two ways of moving bytes between memory and a file (mmap + memmove,
and preadv/pwritev) that the design chose between; ``--checksums`` times the checksums it chose
among.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import anyio
import xxhash

from kvflow.backends.base import GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend, LocalConfig
from kvflow.backends.local.format import HEADER_SIZE, object_file_name, region_views
from kvflow.config import parse_size
from kvflow.regions import buffer_address
from kvflow.tools.baselines import memcpy_gbps


def _objects(base: int, total: int, size: int, regions: int, prefix: str) -> list[ObjectRef]:
    count = total // size
    plane = total // regions
    part = size // regions
    return [
        ObjectRef.of(f"{prefix}{i}", [base + r * plane + i * part for r in range(regions)], [part] * regions)
        for i in range(count)
    ]


def _raw_reads(files: list[str], objects: list[ObjectRef], verify: bool) -> None:
    """Read each object file into its object's regions as plainly as Python can (see the module)."""
    header = bytearray(HEADER_SIZE)
    for path, obj in zip(files, objects):
        views = region_views(obj.addrs, obj.sizes)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [header, *views], 0)
        finally:
            os.close(fd)
        if verify:
            hasher = xxhash.xxh3_64()
            for view in views:
                hasher.update(view)
            hasher.intdigest()


def _best_rate(nbytes: int, run: Callable[[], None], repeat: int) -> float:
    rates = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


async def _move(
    call: Callable[[list[ObjectRef]], Awaitable[Sequence[object]]],
    objects: list[ObjectRef],
    batch: int,
    expected: object,
) -> float:
    """GB/s of passing ``objects`` to ``call`` in batches; every result must be ``expected``."""
    start = time.perf_counter()
    results: list[object] = []
    for i in range(0, len(objects), batch):
        results.extend(await call(objects[i : i + batch]))
    elapsed = time.perf_counter() - start
    wrong = len(results) - results.count(expected)
    if wrong:
        raise RuntimeError(f"{wrong} of {len(results)} objects were not {expected}: {set(results)}")
    return sum(o.nbytes for o in objects) / elapsed / 1e9


def _zero(buffer: bytearray) -> None:
    ctypes.memset(buffer_address(buffer), 0, len(buffer))


async def bench_size(directory: str, size: int, total: int, regions: int, repeat: int) -> dict[str, float]:
    src = bytearray(os.urandom(1 << 20)) * (total >> 20)
    dst = bytearray(total)
    objects = _objects(buffer_address(src), total, size, regions, "a")
    fresh = _objects(buffer_address(src), total, size, regions, "b")
    readback = _objects(buffer_address(dst), total, size, regions, "a")
    # the same bytes in object-sized chunks, one call of the compiled copy loop each (the baseline of
    # kvflow bench): plain (memmove) for gets, and the faster of plain and streamed for puts, whose
    # copies into the store's pages may stream
    plain = memcpy_gbps(total, size, repeat=repeat)
    streamed = memcpy_gbps(total, size, repeat=repeat, stream=True)

    fill, get, churn, raw, verified = [], [], [], [], []
    files = [os.path.join(directory, "objects", object_file_name(o.key)) for o in readback]
    for _ in range(repeat):
        shutil.rmtree(directory, ignore_errors=True)
        backend = LocalBackend(LocalConfig(directory, capacity_bytes=int(total * 1.1) + (1 << 20)))
        batch = backend.max_batch
        fill.append(await _move(backend.put, objects, batch, PutStatus.STORED))
        _zero(dst)  # every round's get must bring every byte (outside the timing)
        get.append(await _move(backend.get, readback, batch, GetStatus.HIT))
        if dst != src:
            raise RuntimeError("the local backend's get read back other bytes than were put")
        raw.append(_best_rate(total, partial(_raw_reads, files, readback, False), 1))
        verified.append(_best_rate(total, partial(_raw_reads, files, readback, True), 1))
        # Churn: the store is full; every new object evicts an old one and reuses its file.
        churn.append(await _move(backend.put, fresh, batch, PutStatus.STORED))
        await backend.aclose()
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "memcpy": plain,
        "memcpy_streamed": streamed,
        "memcpy_put": max(plain, streamed),
        "put_fill": statistics.median(fill),
        "put_churn": statistics.median(churn),
        "get": statistics.median(get),
        "raw_read": statistics.median(raw),
        "raw_xxh3": statistics.median(verified),
    }


def io_compare(directory: str, size: int, count: int) -> None:
    """Time mmap + memmove against pwritev/preadv for ``count`` files of ``size`` bytes."""
    os.makedirs(directory, exist_ok=True)
    src = bytearray(os.urandom(size))
    view = memoryview(src)
    addr = buffer_address(src)
    paths = [os.path.join(directory, f"io{i}") for i in range(count)]
    total = size * count

    def write_mmap() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, size) as mm:
                ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(mm)), addr, size)
            os.close(fd)

    def write_pwritev() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            os.pwritev(fd, [view], 0)
            os.close(fd)

    def read_mmap() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
            with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                ctypes.memmove(addr, ctypes.addressof(ctypes.c_char.from_buffer(mm)), size)
            os.close(fd)

    def read_preadv() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.preadv(fd, [view], 0)
            os.close(fd)

    for name, run in [
        ("write mmap+memmove", write_mmap),
        ("write pwritev", write_pwritev),
        ("read mmap+memmove", read_mmap),
        ("read preadv", read_preadv),
    ]:
        print(f"  {name:20s} {_best_rate(total, run, 3):6.2f} GB/s  ({size >> 10} KiB x {count})")
    shutil.rmtree(directory, ignore_errors=True)


def _repeat(fn: Callable[[memoryview], object], buf: memoryview, times: int) -> None:
    for _ in range(times):
        fn(buf)


def checksums(sizes: list[int]) -> None:
    """Time the candidate checksums on one buffer per size (those that are importable here)."""
    import importlib
    import zlib

    candidates: dict[str, Callable[[memoryview], object]] = {"zlib.crc32": zlib.crc32}
    optional = {
        "xxhash.xxh3_64": ("xxhash", "xxh3_64_intdigest"),
        "xxhash.xxh64": ("xxhash", "xxh64_intdigest"),
        "crc32c.crc32c": ("crc32c", "crc32c"),
        "zlib_ng.crc32": ("zlib_ng.zlib_ng", "crc32"),
    }
    for name, (module, attr) in optional.items():
        try:
            candidates[name] = getattr(importlib.import_module(module), attr)
        except ImportError:
            print(f"  ({name}: not installed)")
    for size in sizes:
        buf = memoryview(bytearray(os.urandom(1 << 20)) * max(1, size >> 20))[:size]
        reps = max(1, (256 << 20) // size)
        cells = []
        for name, fn in candidates.items():
            rate = _best_rate(size * reps, partial(_repeat, fn, buf, reps), 3)
            cells.append(f"{name} {rate:5.1f}")
        print(f"  {size >> 10:>7} KiB: " + ", ".join(cells) + " GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/dev/shm/kvflow-bench")
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    parser.add_argument("--total", default="256MiB", help="bytes of objects per size (beyond the CPU caches)")
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--io-compare", action="store_true")
    parser.add_argument("--checksums", action="store_true", help="also time the candidate checksums")
    args = parser.parse_args()
    total = parse_size(args.total) >> 20 << 20
    print(f"local backend vs memcpy: {args.dir}, {total >> 20} MiB per size, {args.regions} regions/object")
    heads = ("put fill", "put churn", "get", "raw read", "raw + xxh3")
    print(
        f"{'object':>8} {'memcpy':>8} {'streamed':>8} "
        + " ".join(f"{h:>15}" for h in heads)
        + "   (GB/s, x memcpy: puts x the faster of memcpy and streamed)"
    )
    for text in args.sizes.split(","):
        size = parse_size(text)
        r = anyio.run(bench_size, args.dir, size, total, args.regions, args.repeat)
        cells = " ".join(
            f"{r[k]:6.2f} ({r[k] / r['memcpy_put' if k.startswith('put') else 'memcpy']:4.2f}x)"
            for k in ("put_fill", "put_churn", "get", "raw_read", "raw_xxh3")
        )
        print(f"{size >> 10:>5}KiB {r['memcpy']:8.2f} {r['memcpy_streamed']:8.2f} {cells}")
    if args.checksums:
        print("checksums (hot in cache when small, from memory when large):")
        checksums([256 << 10, 4 << 20, 256 << 20])
    if args.io_compare:
        print("raw file I/O, one region per file, from and into one buffer (hot in the CPU caches):")
        io_compare(args.dir, 1 << 20, 128)


if __name__ == "__main__":
    main()
