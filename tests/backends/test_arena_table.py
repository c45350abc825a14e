"""The arena table's compiled passes (:mod:`kvflow.backends.arena.table`) against plain models.

Tables are drawn at random (slots free, being written by this process, by a live or a dead other
writer, or published; keys that collide in their tag byte) with puts of keys drawn from the same
few, repeats included. The model is the rule as :meth:`ArenaFile.claim` states it, one key at a
time; the compiled claim must give the same slot, PRESENT or NO_SPACE for every key, the same
evictions and the same touched last uses (``now - i`` for the ``i``-th key: a request's first
blocks are its newest). A get's look-up is checked the same way, with rows found under an earlier
hold of the lock that may have gone stale, and a lookup's find (each key's published slot, nothing
touched) too. The arena's own tests
(tests/backends/test_arena.py) check both through real puts and gets.
"""

from __future__ import annotations

import attrs
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.backends.arena.table import NO_SPACE, PRESENT, REPEAT, UNKNOWN, passes

FREE, WRITING, READY = 0, 1, 2
ME = (7, 100, 5)  # namespace, pid, start of the claiming process
OTHER_ALIVE, OTHER_DEAD = (7, 200, 9), (7, 300, 9)
NOW = 10**6


@attrs.define
class Table:
    sets: int
    ways: int
    state: list[int]
    owner: list[tuple[int, int, int]]
    key: list[tuple[int, int]]
    used: list[int]

    def columns(self) -> dict[str, np.ndarray]:
        u64 = np.uint64
        return {
            "state": np.array(self.state, dtype=u64),
            "ns": np.array([o[0] for o in self.owner], dtype=u64),
            "pid": np.array([o[1] for o in self.owner], dtype=u64),
            "start": np.array([o[2] for o in self.owner], dtype=u64),
            "key0": np.array([k[0] for k in self.key], dtype=u64),
            "key1": np.array([k[1] for k in self.key], dtype=u64),
            "used": np.array(self.used, dtype=u64),
            "tags": np.array([k[1] & 0xFF for k in self.key], dtype=np.uint8),
        }


def a_key(sets: int, number: int, set_of: int) -> tuple[int, int]:
    """Key ``number`` of set ``set_of``: its first word picks the set; second words share their
    low byte (the tag) among keys, so tags match where keys do not."""
    return set_of + sets * number, (number << 8) | (number % 3)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Table, list[tuple[int, int]]]:
    sets, ways = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    numbers = st.integers(0, 5)
    state, owner, key, used = [], [], [], []
    for row in range(sets * ways):
        kind = draw(st.sampled_from(["free", "mine", "alive", "dead", "ready"]))
        state.append({"free": FREE, "ready": READY}.get(kind, WRITING))
        owner.append({"mine": ME, "alive": OTHER_ALIVE, "dead": OTHER_DEAD}.get(kind, ME))
        key.append(a_key(sets, draw(numbers), row // ways))
        used.append(draw(st.integers(0, 50)))  # ties between published slots happen
    table = Table(sets, ways, state, owner, key, used)
    put = draw(st.lists(st.tuples(st.integers(0, sets - 1), numbers), min_size=1, max_size=12))
    return table, [a_key(sets, number, s) for s, number in put]


def model(table: Table, put: list[tuple[int, int]]) -> tuple[list[int], int, list[int]]:
    """Slots (or PRESENT, NO_SPACE, REPEAT), evictions and last uses, one key at a time by the stated rule."""
    used, results, evictions = list(table.used), [], 0

    def live_writer(row: int) -> bool:
        return table.state[row] == WRITING and table.owner[row] != OTHER_DEAD

    taken = {row for row, key in enumerate(table.key) if key in put}  # hold a key of the put
    seen: set[tuple[int, int]] = set()
    for i, key in enumerate(put):
        if key in seen:
            results.append(REPEAT)
            continue
        seen.add(key)
        rows = range((key[0] % table.sets) * table.ways, (key[0] % table.sets + 1) * table.ways)
        holding = [row for row in rows if table.key[row] == key]
        if holding:
            row = holding[-1]
            if table.state[row] == READY:
                used[row] = NOW - i  # a request's first blocks are its newest uses
                results.append(PRESENT)
            elif live_writer(row):
                results.append(PRESENT)
            else:
                results.append(row)  # freed, or its writer died: the key takes its slot again
            continue

        def rank(row: int) -> tuple[int, int]:
            kind = table.state[row]
            first = -2 if kind == FREE else -1 if kind == WRITING else used[row]
            return first, -row  # ties to the higher way

        free = [row for row in rows if row not in taken and not live_writer(row)]
        if not free:
            results.append(NO_SPACE)
            continue
        row = min(free, key=rank)
        taken.add(row)
        evictions += table.state[row] == READY
        results.append(row)
    return results, evictions, used


def compiled(table: Table, put: list[tuple[int, int]], dead: list[int]) -> tuple[list[int], int, list[int]]:
    c = table.columns()
    k0 = np.array([k[0] for k in put], dtype=np.uint64)
    k1 = np.array([k[1] for k in put], dtype=np.uint64)
    sets = (k0 % np.uint64(table.sets)).astype(np.int64)
    out = np.full(len(put), -99, dtype=np.int64)
    evictions = passes().claim(
        c["state"], c["ns"], c["pid"], c["start"], c["key0"], c["key1"], c["used"], c["tags"],
        k0, k1, sets, table.ways, np.uint64(NOW), np.array(ME, dtype=np.uint64),
        np.array(dead, dtype=np.int64), out,
    )  # fmt: skip
    return out.tolist(), evictions, c["used"].tolist()


def foreign(table: Table, put: list[tuple[int, int]]) -> list[int]:
    c = table.columns()
    sets = np.array([k[0] % table.sets for k in put], dtype=np.int64)
    found = passes().foreign(
        c["state"], c["ns"], c["pid"], c["start"], sets, table.ways, np.array(ME, dtype=np.uint64)
    )
    return sorted(found.tolist())


@settings(max_examples=400, deadline=None)
@given(cases())
def test_the_compiled_claim_follows_the_rule(case: tuple[Table, list[tuple[int, int]]]) -> None:
    table, put = case
    others = foreign(table, put)
    put_sets = {k[0] % table.sets for k in put}
    assert others == [
        row
        for row in range(table.sets * table.ways)
        if row // table.ways in put_sets and table.state[row] == WRITING and table.owner[row] != ME
    ]
    dead = [row for row in others if table.owner[row] == OTHER_DEAD]  # the caller judges them
    assert compiled(table, put, dead) == model(table, put)


def test_a_full_set_of_live_writers_is_no_space_and_a_dead_ones_slot_is_taken() -> None:
    keys = [a_key(1, 1, 0), a_key(1, 2, 0)]
    table = Table(1, 2, [WRITING, WRITING], [OTHER_ALIVE, OTHER_DEAD], keys, [0, 0])
    assert compiled(table, [a_key(1, 3, 0)], dead=[])[0] == [NO_SPACE]  # the dead writer not yet judged
    assert compiled(table, [a_key(1, 3, 0), a_key(1, 4, 0)], dead=[1])[0] == [1, NO_SPACE]


Lookup = tuple[Table, list[int], list[tuple[int, int]], list[int], list[int], int, int]


@st.composite
def lookups(draw: st.DrawFn) -> Lookup:
    """A table with sizes, a get's keys and sizes, the rows an earlier hold of the lock found for
    them (right, stale, none, or not looked for yet) and the run ``[start, end)`` to look at."""
    table, keys = draw(cases())
    nbytes = [draw(st.sampled_from([100, 200])) for _ in table.state]
    sizes = [draw(st.sampled_from([100, 200])) for _ in keys]
    rows = [draw(st.sampled_from([UNKNOWN, -1, *range(table.sets * table.ways)])) for _ in keys]
    start = draw(st.integers(0, len(keys) - 1))
    end = draw(st.integers(start + 1, len(keys)))
    return table, nbytes, keys, sizes, rows, start, end


@settings(max_examples=400, deadline=None)
@given(lookups())
def test_the_compiled_lookup_finds_published_slots_and_checks_stale_ones(case: Lookup) -> None:
    table, nbytes, keys, sizes, rows, start, end = case
    # The model: a row found earlier stands while it still holds its key, published; otherwise
    # the key's published slot is looked for; found where the slot holds an object of that size.
    want_rows, want_found, want_used = list(rows), [False] * len(keys), list(table.used)
    for i in range(start, end):
        row = rows[i]
        if row == UNKNOWN or (row >= 0 and (table.state[row] != READY or table.key[row] != keys[i])):
            s = keys[i][0] % table.sets
            held = [r for r in range(s * table.ways, (s + 1) * table.ways) if table.key[r] == keys[i]]
            row = max((r for r in held if table.state[r] == READY), default=-1)
        want_rows[i] = row
        want_found[i] = row >= 0 and nbytes[row] == sizes[i]
        if want_found[i]:
            want_used[row] = NOW - i  # a request's first blocks are its newest uses
    c = table.columns()
    k0 = np.array([k[0] for k in keys], dtype=np.uint64)
    k1 = np.array([k[1] for k in keys], dtype=np.uint64)
    got_rows, got_found = np.array(rows, dtype=np.int64), np.zeros(len(keys), dtype=np.bool_)
    passes().locate(
        c["state"], c["key0"], c["key1"], np.array(nbytes, dtype=np.uint64), c["used"], c["tags"],
        k0, k1, (k0 % np.uint64(table.sets)).astype(np.int64), table.ways, np.array(sizes, dtype=np.int64),
        start, end, np.uint64(NOW), got_rows, got_found,
    )  # fmt: skip
    assert got_rows.tolist() == want_rows
    assert got_found.tolist() == want_found
    assert c["used"].tolist() == want_used


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_compiled_find_gives_each_keys_published_slot_and_touches_nothing(
    case: tuple[Table, list[tuple[int, int]]],
) -> None:
    table, keys = case
    want = []
    for key in keys:
        s = key[0] % table.sets
        held = [r for r in range(s * table.ways, (s + 1) * table.ways) if table.key[r] == key]
        want.append(max((r for r in held if table.state[r] == READY), default=-1))
    c = table.columns()
    k0 = np.array([k[0] for k in keys], dtype=np.uint64)
    k1 = np.array([k[1] for k in keys], dtype=np.uint64)
    rows = np.full(len(keys), -99, dtype=np.int64)
    passes().find(
        c["state"], c["key0"], c["key1"], c["tags"], k0, k1, (k0 % np.uint64(table.sets)).astype(np.int64),
        table.ways, rows,
    )  # fmt: skip
    assert rows.tolist() == want
    assert c["used"].tolist() == table.used
