"""Region copies: each object's regions back to back in its buffer and back, one call per batch,
for objects by column (ObjectBatch) and for lists of objects of any shapes."""

from __future__ import annotations

import functools

import anyio
import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.backends import copies
from kvflow.backends.base import ObjectBatch, ObjectRef, keys_of, nbytes_of, some_of
from kvflow.backends.copies import copy_in_pieces, gather_objects, regions_of, scatter_objects
from kvflow.backends.pacing import Pacer
from kvflow.regions import copy_ragged, copy_rows, gather, scatter

POOL = 4096  # bytes of the memory the regions lie in


def regions(draw: st.DrawFn, count: int) -> tuple[list[int], list[int]]:
    """``count`` regions (offsets into the pool, sizes), possibly overlapping each other."""
    sizes = draw(st.lists(st.integers(0, 64), min_size=count, max_size=count))
    offsets = [draw(st.integers(0, POOL - size)) for size in sizes]
    return offsets, sizes


@st.composite
def ragged(draw: st.DrawFn) -> list[tuple[list[int], list[int]]]:
    """Objects of different region counts and sizes."""
    return [regions(draw, draw(st.integers(0, 5))) for _ in range(draw(st.integers(0, 6)))]


@st.composite
def columns(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Objects of one shape: a row of offsets each, the sizes shared."""
    count, width = draw(st.integers(0, 6)), draw(st.integers(0, 5))
    sizes = draw(st.lists(st.integers(0, 64), min_size=width, max_size=width))
    rows = [[draw(st.integers(0, POOL - size)) for size in sizes] for _ in range(count)]
    return rows, sizes


def pool() -> torch.Tensor:
    return torch.randint(0, 256, (POOL,), dtype=torch.uint8)


def reference(source: torch.Tensor, offsets: list[int], sizes: list[int]) -> bytes:
    return b"".join(bytes(source[o : o + s].tolist()) for o, s in zip(offsets, sizes))


def check_round_trip(
    objects: list[ObjectRef] | ObjectBatch, offsets: list[list[int]], sizes: list[list[int]]
) -> None:
    source = SOURCE
    buffers = [torch.full((max(1, sum(s)),), 7, dtype=torch.uint8) for s in sizes]
    gather_objects([b.data_ptr() for b in buffers], objects)
    for buf, offs, szs in zip(buffers, offsets, sizes):
        assert bytes(buf[: sum(szs)].tolist()) == reference(source, offs, szs)
    # scatter each buffer into a fresh pool at the same offsets: every region holds its bytes again
    # (where regions overlap, the later one's, as a plain memmove loop leaves them)
    before = source.clone()
    source.zero_()
    scatter_objects([b.data_ptr() for b in buffers], objects)
    expected = torch.zeros_like(source)
    for buf, offs, szs in zip(buffers, offsets, sizes):
        at = 0
        for o, s in zip(offs, szs):
            expected[o : o + s] = buf[at : at + s]
            at += s
    assert torch.equal(source, expected)
    source.copy_(before)


SOURCE = pool()


@settings(deadline=None)  # the first call loads the compiled copy loops
@given(ragged())
def test_a_list_of_objects_of_any_shapes_round_trips(shapes: list[tuple[list[int], list[int]]]) -> None:
    base = SOURCE.data_ptr()
    objects = [ObjectRef.of(f"k{i}", [base + o for o in offs], szs) for i, (offs, szs) in enumerate(shapes)]
    check_round_trip(objects, [offs for offs, _ in shapes], [szs for _, szs in shapes])


@settings(deadline=None)
@given(columns(), st.sampled_from([slice(None), slice(None, None, 2), slice(1, None)]))
def test_a_batch_by_column_round_trips_as_its_objects_would(
    shape: tuple[list[list[int]], list[int]], part: slice
) -> None:
    rows, sizes = shape
    base = SOURCE.data_ptr()
    addrs = np.asarray(rows, dtype=np.int64).reshape(len(rows), len(sizes)) + base
    batch = ObjectBatch([f"k{i}" for i in range(len(rows))], addrs, sizes, sum(sizes))[part]
    kept = rows[part]
    check_round_trip(batch, kept, [sizes] * len(kept))
    assert list(batch) == [ObjectRef.of(k, list(a), sizes) for k, a in zip(batch.keys, batch.addrs.tolist())]


def test_one_object_copies_match_the_batched_ones() -> None:
    source = pool()
    base = source.data_ptr()
    out = torch.zeros(30, dtype=torch.uint8)
    gather(out.data_ptr(), [base + 100, base + 10], [20, 10])
    assert bytes(out.tolist()) == reference(source, [100, 10], [20, 10])
    target = torch.zeros_like(source)
    scatter(out.data_ptr(), [target.data_ptr() + 5, target.data_ptr() + 50], [20, 10])
    assert torch.equal(target[5:25], source[100:120]) and torch.equal(target[50:60], source[10:20])


def test_as_many_buffers_as_objects() -> None:
    obj = ObjectRef.of("k", [SOURCE.data_ptr()], [4])
    with pytest.raises(ValueError, match="2 buffers for 1 objects"):
        gather_objects([0, 0], [obj])
    with pytest.raises(ValueError, match="0 buffers for 1 objects"):
        scatter_objects([], [obj])


def test_a_batch_checks_its_columns() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 3\) for 2 keys of 2 regions"):
        ObjectBatch(["a", "b"], np.zeros((2, 3), dtype=np.int64), [1, 2], 3)
    with pytest.raises(ValueError, match=r"sizes must be >= 0, got \[1, -2\]"):
        ObjectBatch(["a"], np.zeros((1, 2), dtype=np.int64), [1, -2], -1)
    with pytest.raises(ValueError, match=r"nbytes 4 is not the sum of the region sizes \[1, 2\]"):
        ObjectBatch(["a"], np.zeros((1, 2), dtype=np.int64), [1, 2], 4)


def test_a_batch_refuses_a_sizes_array_that_disagrees_with_its_sizes() -> None:
    """A batch of a checked one's shape may bring its region sizes as an array (kept, not checked
    region by region again); one that disagrees with the sizes and the byte count is refused, so a
    copy never goes by sizes the batch does not name (as one evolved from another would bring)."""
    base = SOURCE.data_ptr()
    batch = ObjectBatch(["k"], np.asarray([[base]], dtype=np.int64), [16], 16)
    batch.sizes_array()  # made, and kept by what is made of it
    with pytest.raises(ValueError, match="do not agree"):
        attrs.evolve(batch, sizes=[8], nbytes=8)
    with pytest.raises(ValueError, match="do not agree"):
        ObjectBatch(["k"], batch.addrs, [16], 16, sizes_array=np.asarray([-8, 24], dtype=np.int64))
    assert batch.with_rows(["j"], batch.addrs).sizes_array() is batch.sizes_array()


def test_a_batch_is_compared_by_identity() -> None:
    """Its address column is an array, which has no truth value: two batches are equal only when
    they are one, and a batch can be hashed."""
    batch = ObjectBatch(["a"], np.zeros((1, 1), dtype=np.int64), [1], 1)
    twin = ObjectBatch(["a"], np.zeros((1, 1), dtype=np.int64), [1], 1)
    assert batch == batch and batch != twin and len({batch, twin}) == 2


@pytest.mark.parametrize(
    ("addrs", "sizes", "nbytes"),
    [([0, 0], [4], 4), ([0], [4, 4], 8), ([0], [4], 5), ([0, 0], [8, -4], 4)],
    ids=["more addresses", "more sizes", "nbytes too small", "negative size"],
)
def test_a_list_copy_refuses_an_object_whose_fields_disagree(
    addrs: list[int], sizes: list[int], nbytes: int
) -> None:
    """An object built with the plain constructor, unchecked: its buffer was sized by ``nbytes``
    and its regions are paired by position, so a disagreement would copy out of bounds. Nothing is
    copied; the error names the key."""
    target = torch.zeros(16, dtype=torch.uint8)
    base = target.data_ptr()
    bad = ObjectRef("bad", [base + a for a in addrs], sizes, nbytes)
    good = ObjectRef.of("good", [base], [4])
    out = torch.full((32,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"object 'bad'.*do not agree"):
        scatter_objects([out.data_ptr(), out.data_ptr() + 16], [good, bad])
    assert torch.equal(target, torch.zeros(16, dtype=torch.uint8))


def test_the_copy_loops_refuse_columns_that_do_not_agree() -> None:
    """The compiled loops read the arrays unchecked: a shape that does not agree never reaches them."""
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match=r"shape \(1, 2\) for 1 buffers of 3 regions"):
        copy_rows(one, np.zeros((1, 2), dtype=np.int64), np.zeros(3, dtype=np.int64), into_regions=True)
    with pytest.raises(ValueError, match="1 buffers with 1 region counts \\(of 2 regions\\) for 1 addresses"):
        copy_ragged(one, one + 2, one, one, into_regions=False)
    with pytest.raises(ValueError, match="1 buffers with 2 region counts"):
        copy_ragged(one, np.zeros(2, dtype=np.int64), one[:0], one[:0], into_regions=False)


@settings(max_examples=50)
@given(
    st.integers(0, 6).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), unique=True) if n else st.just([]))
    )
)
def test_keys_sizes_and_some_of_a_batch_are_its_objects(case: tuple[int, list[int]]) -> None:
    count, picked = case
    picked.sort()
    addrs = np.arange(count * 2, dtype=np.int64).reshape(count, 2)
    batch = ObjectBatch([f"k{i}" for i in range(count)], addrs, [3, 4], 7)
    as_list = list(batch)
    assert keys_of(batch) == keys_of(as_list) == [f"k{i}" for i in range(count)]
    assert nbytes_of(batch) == nbytes_of(as_list) == [7] * count
    part = some_of(batch, picked)
    assert isinstance(part, ObjectBatch)
    assert list(part) == list(some_of(as_list, picked)) == [as_list[i] for i in picked]


def buffers_and_sizes(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Up to 4 buffers at any alignment, 2304 bytes apart (3 regions of up to 700 fit), and up to
    3 region sizes on either side of the streamed body (its vectors of 32 bytes, steps of 128)."""
    width = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(0, 700), min_size=width, max_size=width))
    count = draw(st.integers(1, 4))
    return [draw(st.integers(0, 63)) + i * 2304 for i in range(count)], sizes


def copy_with_loop(
    at: npt.NDArray[np.int64], addrs: npt.NDArray[np.int64], sizes: list[int], *, ragged: bool, **how: bool
) -> None:
    """One call of either loop (``ragged``: as rows of any length) between the buffers at ``at``
    and the regions at ``addrs`` (a row per buffer)."""
    if ragged:
        counts = np.full(len(addrs), len(sizes), dtype=np.int64)
        copy_ragged(at, counts, addrs.ravel(), np.tile(sizes, len(addrs)), **how)
    else:
        copy_rows(at, addrs, np.asarray(sizes, dtype=np.int64), **how)


@st.composite
def streamed(draw: st.DrawFn) -> tuple[list[int], list[list[int]], list[int]]:
    """Buffers and sizes (:func:`buffers_and_sizes`) and regions anywhere in the pool: where each
    buffer starts, each row's region offsets, sizes."""
    starts, sizes = buffers_and_sizes(draw)
    rows = [[draw(st.integers(0, POOL - size)) for size in sizes] for _ in starts]
    return starts, rows, sizes


@settings(deadline=None)
@given(streamed(), st.booleans())
def test_a_streamed_gather_writes_what_memmove_writes_and_nothing_around_it(
    case: tuple[list[int], list[list[int]], list[int]], ragged_rows: bool
) -> None:
    """Streaming stores (:mod:`kvflow.copyloops`, used for every gather into a store's buffers)
    copy head, aligned body and tail: for every alignment and size the buffers hold exactly the
    bytes of a plain copy, and the bytes between and after them keep what was there."""
    starts, rows, sizes = case
    plain = torch.full((4 * 2304 + 64,), 7, dtype=torch.uint8)
    fast = plain.clone()
    addrs = np.asarray(rows, dtype=np.int64) + SOURCE.data_ptr()
    for out, stream in ((plain, False), (fast, True)):
        at = out.data_ptr() + np.asarray(starts, dtype=np.int64)
        copy_with_loop(at, addrs, sizes, ragged=ragged_rows, into_regions=False, stream=stream)
    assert torch.equal(fast, plain)
    for start, offs in zip(starts, rows):
        assert bytes(fast[start : start + sum(sizes)].tolist()) == reference(SOURCE, offs, sizes)


@st.composite
def scattered(draw: st.DrawFn) -> tuple[list[int], list[list[int]], list[int]]:
    """Buffers and sizes (:func:`buffers_and_sizes`) and regions apart from each other, at any
    alignment: where each buffer starts, each row's region offsets, sizes."""
    starts, sizes = buffers_and_sizes(draw)
    rows, cursor = [], 0
    for _ in starts:
        row = []
        for size in sizes:
            cursor += draw(st.integers(0, 63))
            row.append(cursor)
            cursor += size
        rows.append(row)
    return starts, rows, sizes


@settings(deadline=None)
@given(scattered(), st.booleans())
def test_a_streamed_scatter_writes_what_memmove_writes_and_nothing_around_it(
    case: tuple[list[int], list[list[int]], list[int]], ragged_rows: bool
) -> None:
    """Every get streams into the engine's regions too (:mod:`kvflow.backends.copies`): for every
    alignment and size the regions hold exactly the bytes of a plain copy of their buffer, and
    the bytes between and after them keep what was there."""
    starts, rows, sizes = case
    source = torch.randint(0, 255, (4 * 2304 + 64,), dtype=torch.uint8)
    plain = torch.full((4 * 2304 + 4 * 3 * 64 + 64,), 7, dtype=torch.uint8)
    fast = plain.clone()
    at = source.data_ptr() + np.asarray(starts, dtype=np.int64)
    for out, stream in ((plain, False), (fast, True)):
        addrs = np.asarray(rows, dtype=np.int64) + out.data_ptr()
        copy_with_loop(at, addrs, sizes, ragged=ragged_rows, into_regions=True, stream=stream)
    assert torch.equal(fast, plain)
    written = torch.zeros_like(fast, dtype=torch.bool)
    for start, offs in zip(starts, rows):
        assert reference(fast, offs, sizes) == bytes(source[start : start + sum(sizes)].tolist())
        for offset, size in zip(offs, sizes):
            written[offset : offset + size] = True
    assert bool((fast[~written] == 7).all())


@pytest.mark.parametrize("as_batch", [False, True], ids=["list", "batch"])
def test_a_backend_call_copies_streamed_both_ways(monkeypatch: pytest.MonkeyPatch, as_batch: bool) -> None:
    """A put's gather and a get's scatter both ask the copy loop for streaming stores, for objects
    by column and for a list (:mod:`kvflow.backends.copies`); the bytes round-trip."""
    from kvflow import regions

    seen: list[tuple[bool, bool]] = []  # (into the regions, streamed)
    for name in ("copy_rows", "copy_ragged"):
        real = getattr(regions, name)

        def recorded(*args, into_regions, stream=False, _real=real):  # type: ignore[no-untyped-def]
            seen.append((into_regions, stream))
            _real(*args, into_regions=into_regions, stream=stream)

        monkeypatch.setattr(regions, name, recorded)
    cache = torch.randint(0, 255, (2, 300), dtype=torch.uint8)
    expected = cache.clone()
    buffers = torch.zeros(2, 300, dtype=torch.uint8)
    addrs = np.asarray([[row.data_ptr(), row.data_ptr() + 100] for row in cache], dtype=np.int64)
    objects = (
        ObjectBatch(["a", "b"], addrs, [100, 200], 300)
        if as_batch
        else [ObjectRef.of(key, list(row), [100, 200]) for key, row in zip("ab", addrs.tolist())]
    )
    starts = [row.data_ptr() for row in buffers]
    gather_objects(starts, objects)
    cache.zero_()
    scatter_objects(starts, objects)
    assert torch.equal(buffers, expected) and torch.equal(cache, expected)
    assert seen == [(False, True), (True, True)]


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 96), min_size=1, max_size=40),
    st.integers(1, 200),
    st.booleans(),
    st.booleans(),
)
def test_an_object_copied_in_pieces_round_trips_as_one_copy_would(
    sizes: list[int], piece_bytes: int, into_buffer: bool, as_batch: bool
) -> None:
    """``copy_in_pieces`` cuts an object's regions at the pieces' edges (any region may span
    several pieces, or be empty): the buffer or the regions end as one copy of the whole object
    leaves them, nothing around them is written, and each copy call moves one piece, once."""
    nbytes = sum(sizes)
    source = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    regions_mem = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)  # the regions, apart
    offsets = (np.cumsum([0, *sizes[:-1]]) + 32 + 8 * np.arange(len(sizes))) % (nbytes + 1)
    offsets = np.minimum(offsets, nbytes + 32 - np.asarray(sizes)).clip(0)
    addrs = regions_mem.data_ptr() + offsets.astype(np.int64)
    if as_batch:
        objects: list[ObjectRef] | ObjectBatch = ObjectBatch(["k"], addrs.reshape(1, -1), sizes, nbytes)
    else:
        objects = [ObjectRef.of("k", addrs.tolist(), sizes)]
    at, lengths = regions_of(objects, 0)
    if into_buffer:
        expected = source.clone()
        expected[32 : 32 + nbytes] = torch.tensor(
            list(reference(regions_mem, offsets.tolist(), sizes)), dtype=torch.uint8
        )
    else:
        expected = regions_mem.clone()
        done = 0
        for o, s in zip(offsets.tolist(), sizes):
            expected[o : o + s] = source[32 + done : 32 + done + s]
            done += s
    pieces: list[int] = []  # the bytes each copy call moved
    ragged = copies.regions.copy_ragged

    def recorded(*args: object, **kwargs: object) -> None:
        pieces.append(int(np.sum(args[3])))  # type: ignore[call-overload]
        ragged(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(copies.regions, "copy_ragged", recorded)
        anyio.run(
            functools.partial(
                copy_in_pieces,
                source.data_ptr() + 32,
                at,
                lengths,
                Pacer(),
                into_buffer=into_buffer,
                piece_bytes=piece_bytes,
            )
        )
    assert torch.equal(source if into_buffer else regions_mem, expected)
    assert sum(pieces) == nbytes and all(0 < n <= piece_bytes for n in pieces), pieces  # each piece once
