"""A backend's counters: each object's result counted once, in its kind, with its bytes."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvflow.backends.base import BackendStats, GetStatus, ObjectBatch, ObjectRef, PutStatus


@st.composite
def objects(draw: st.DrawFn) -> list[ObjectRef] | ObjectBatch:
    """Objects of any sizes as a list, or of one size as a batch by column."""
    count = draw(st.integers(0, 12))
    if draw(st.booleans()):
        sizes = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        keys = [f"k{i}" for i in range(count)]
        return ObjectBatch(keys, np.zeros((count, len(sizes)), dtype=np.int64), sizes, sum(sizes))
    return [ObjectRef.of(f"k{i}", [0], [draw(st.integers(0, 1000))]) for i in range(count)]


@given(objects(), st.data())
def test_puts_are_counted_by_result_with_the_bytes_stored(
    objs: list[ObjectRef] | ObjectBatch, data: st.DataObject
) -> None:
    results = data.draw(st.lists(st.sampled_from(PutStatus), min_size=len(objs), max_size=len(objs)))
    stats = BackendStats(puts=1, put_bytes=10, present=2, no_space=3, put_failures=4)
    stats.count_puts(objs, results)
    stored = [obj.nbytes for obj, result in zip(objs, results) if result is PutStatus.STORED]
    assert (stats.puts, stats.put_bytes) == (1 + len(stored), 10 + sum(stored))
    assert stats.present == 2 + results.count(PutStatus.PRESENT)
    assert stats.no_space == 3 + results.count(PutStatus.NO_SPACE)
    assert stats.put_failures == 4 + results.count(PutStatus.FAILED)


@given(objects(), st.data())
def test_gets_are_counted_by_result_with_the_bytes_hit(
    objs: list[ObjectRef] | ObjectBatch, data: st.DataObject
) -> None:
    results = data.draw(st.lists(st.sampled_from(GetStatus), min_size=len(objs), max_size=len(objs)))
    stats = BackendStats(hits=1, hit_bytes=10, misses=2, get_failures=3)
    stats.count_gets(objs, results)
    hit = [obj.nbytes for obj, result in zip(objs, results) if result is GetStatus.HIT]
    assert (stats.hits, stats.hit_bytes) == (1 + len(hit), 10 + sum(hit))
    assert stats.misses == 2 + results.count(GetStatus.MISS)
    assert stats.get_failures == 3 + results.count(GetStatus.FAILED)
