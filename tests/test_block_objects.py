"""The objects of many blocks are made a batch at a time, and each batch's die with its call."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import anyio
import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow import KVLayout, KVPool, KVRequest, PoolConfig
from kvflow.backends.base import ObjectBatch, ObjectRef, PutStatus
from kvflow.keys import hash_blocks
from kvflow.profiles import is_book_key
from kvflow.transfer.objects import BlockObjects
from tests.helpers import BLOCK, LAYOUTS, FaultyBackend

LAYOUT = KVLayout.from_kv_caches(LAYOUTS["vllm_cpu"]())  # type: ignore[arg-type]
BLOCKS = LAYOUT.num_blocks


def eager(keys: Sequence[str], block_ids: Sequence[int], layer: int | None) -> list[ObjectRef]:
    """The objects built one by one from the layout's per-block answers."""
    out = []
    for key, block in zip(keys, block_ids):
        if layer is None:
            addrs, sizes = LAYOUT.block_addrs(block), LAYOUT.block_sizes
        else:
            addrs, sizes = LAYOUT.layer_regions(block, layer)
        out.append(ObjectRef.of(key, addrs, sizes))
    return out


@given(
    st.lists(st.integers(0, BLOCKS - 1), max_size=12),
    st.sampled_from([None, 0, 2]),
    st.slices(12),
    st.integers(-12, 11),
)
def test_every_slice_and_index_is_the_objects_built_one_by_one(
    blocks: list[int], layer: int | None, part: slice, index: int
) -> None:
    keys = [f"k{i}" for i in range(len(blocks))]
    lazy = BlockObjects(LAYOUT, keys, blocks, layer)
    expected = eager(keys, blocks, layer)
    assert len(lazy) == len(expected)
    assert list(lazy) == expected
    batch = lazy[part]
    assert isinstance(batch, ObjectBatch)  # by column: no object per block
    assert list(batch) == expected[part]
    assert [batch[i] for i in range(len(batch))] == expected[part]
    if -len(expected) <= index < len(expected):
        assert lazy[index] == expected[index]
    else:
        with pytest.raises(IndexError):
            lazy[index]


def test_as_many_keys_as_blocks() -> None:
    with pytest.raises(ValueError, match="2 keys for 3 blocks"):
        BlockObjects(LAYOUT, ["a", "b"], [0, 1, 2], None)


@attrs.define
class OneCallAtATime(FaultyBackend):
    """Puts one batch at a time, and checks at the start of each that the objects of every call
    that returned before are freed."""

    lock: anyio.Lock = attrs.field(factory=anyio.Lock)
    returned: list[weakref.ref[Sequence[ObjectRef]]] = attrs.field(factory=list)
    checked: int = 0

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        async with self.lock:
            for ref in self.returned:
                assert ref() is None, "a returned batch's objects are still alive"
            self.checked += len(self.returned)
            results = await super().put(objects)
        if not any(is_book_key(o.key) for o in objects):
            self.returned.append(weakref.ref(objects))
        return results


async def test_the_objects_of_a_batch_are_gone_once_its_call_returned() -> None:
    """A store of many blocks holds the objects of the batches in flight only: those of a call
    that returned are freed before the next call starts (the backend takes 4 per call)."""
    backend = OneCallAtATime()
    pool = KVPool.create(PoolConfig(model="m"), layout=LAYOUT, backend=backend)
    hashes = hash_blocks(list(range(BLOCKS * BLOCK)), BLOCK)
    results = await pool.store(KVRequest(block_ids=range(BLOCKS), block_hashes=hashes))
    assert results.statuses == (PutStatus.STORED,) * BLOCKS
    assert len(backend.returned) == -(-BLOCKS // backend.max_batch) and backend.checked >= 2
    await pool.aclose()


@pytest.mark.parametrize("blocks", [3, BLOCKS], ids=["one call", "several calls"])
async def test_backends_receive_the_objects_of_blocks_by_column(blocks: int) -> None:
    """Every put and get of whole blocks reaches the backend as an ObjectBatch (keys and one
    address array), also when the request fits one call: an in-process backend copies a batch in
    one native call, and a plain sequence of objects sends it down its per-object path (a request
    passed on unsliced once made stores three times slower)."""
    seen: list[type] = []

    async def record(objects: Sequence[ObjectRef]) -> None:
        seen.append(type(objects))

    backend = FaultyBackend(put_hook=record, get_hook=record)
    pool = KVPool.create(PoolConfig(model="m"), layout=LAYOUT, backend=backend)
    request = KVRequest(block_ids=range(blocks), block_hashes=hash_blocks(list(range(blocks * BLOCK)), BLOCK))
    assert (await pool.store(request)).stored == blocks
    assert (await pool.retrieve(request)).hit_blocks == blocks
    assert len(seen) == 2 * -(-blocks // backend.max_batch) and set(seen) == {ObjectBatch}
    await pool.aclose()
