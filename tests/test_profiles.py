"""Writer profiles and the store's book of them: what a reader split differently relies on."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence

import anyio
import attrs
import pytest
import torch

from kvflow import ConfigError, KVLayout, KVPool, KVRequest, ParallelConfig, PoolConfig
from kvflow.backends.base import Backend, GetStatus, ObjectRef, PutStatus
from kvflow.backends.memory import MemoryBackend
from kvflow.keys import KeyScope
from kvflow.profiles import SLOT_BYTES, SLOTS, Profile, ProfileBook, _slot_key, is_book_key
from kvflow.transfer import core
from kvflow.transfer import staging as staging_module
from tests.helpers import FaultyBackend, kv_keys

PROFILE = Profile(
    model="m",
    meaning="float32.kv8x4",
    order="flash_attn.123.123",
    block_size=16,
    hash_tokens=16,
    layer_ranges=((0, 2), (2, 4)),
    head_groups=2,
)


def test_a_profile_travels_as_json_and_names_its_objects() -> None:
    assert Profile.from_json(PROFILE.to_json()) == PROFILE
    scopes = list(PROFILE.scopes())
    assert [(s.layers, s.heads) for s in scopes] == [
        ((0, 2), (0, 4)),
        ((0, 2), (4, 8)),
        ((2, 4), (0, 4)),
        ((2, 4), (4, 8)),
    ]
    assert [s.heads for s in PROFILE.scopes(layers=(1, 2), heads=(3, 5))] == [(0, 4), (4, 8)]
    assert PROFILE.object_nbytes((0, 2)) == 2 * 2 * 16 * 4 * 4 * 4  # layers, K+V, tokens, heads, D, f32
    assert PROFILE.covers((0, 4)) and PROFILE.covers((1, 3)) and not PROFILE.covers((0, 5))


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "not json",
        '{"model": "m"}',
        PROFILE.to_json().replace("kv8x4", "kv8y4"),  # a meaning kvflow cannot read
        PROFILE.to_json().replace('"head_groups":2', '"head_groups":3'),  # 8 heads in 3 groups
        PROFILE.to_json().replace("flash_attn", "paged_magic"),  # an unknown layout kind
        PROFILE.to_json().replace('"hash_tokens":16', '"hash_tokens":5'),  # not a divisor
        PROFILE.to_json().replace("flash_attn.123.123", "mla.12"),  # K and V heads in an MLA layout
        PROFILE.to_json().replace("kv8x4", "mla512+64"),  # an MLA meaning in a K/V layout
        PROFILE.to_json().replace("flash_attn.123.123", "flash_attn.21.21"),  # a dim left out
        PROFILE.to_json().replace("flash_attn.123.123", "flash_attn.123"),  # one plane of two
    ],
)
def test_a_malformed_announcement_is_refused(text: str) -> None:
    with pytest.raises((ConfigError, ValueError, TypeError)):
        Profile.from_json(text)


async def test_the_book_holds_each_profile_once_and_skips_what_it_cannot_read() -> None:
    backend = MemoryBackend()
    first = ProfileBook(backend, PROFILE)
    await first.announce(float("inf"))
    again = ProfileBook(backend, PROFILE)  # the same split in another process: no second slot
    await again.announce(float("inf"))
    assert sum(is_book_key(k) for k in backend.stored_keys()) == 1
    # Garbage in a slot (another program, or a torn write) is skipped, never parsed as a profile.
    junk = torch.full((SLOT_BYTES,), ord("{"), dtype=torch.uint8)
    key = next(k for k in backend.stored_keys() if is_book_key(k))[:-1] + "1"  # slot 0 taken: 1
    await backend.put([ObjectRef(key, [junk.data_ptr()], [SLOT_BYTES], SLOT_BYTES)])
    other = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=4))
    await other.announce(float("inf"))  # takes the next free slot, after the junk
    assert sum(is_book_key(k) for k in backend.stored_keys()) == 3
    assert await first.others(float("inf")) == ()  # what it read when announcing, for 5 s
    first.forget()
    assert await first.others(float("inf")) == (other.own,)
    assert await other.others(float("inf")) == (PROFILE,)


async def test_a_full_book_is_reported_and_the_pool_keeps_working(caplog: pytest.LogCaptureFixture) -> None:
    backend = MemoryBackend()
    for groups in (1, 2, 4, 8):
        for first in range(4):
            ranges = ((0, first + 1), (first + 1, 4)) if first < 3 else ((0, 4),)
            order = "flash_attn.13.13" if groups == 8 else PROFILE.order  # one head: no head dim
            profile = attrs.evolve(PROFILE, head_groups=groups, layer_ranges=ranges, order=order)
            await ProfileBook(backend, profile).announce(float("inf"))
    assert sum(is_book_key(k) for k in backend.stored_keys()) == SLOTS
    late = ProfileBook(backend, attrs.evolve(PROFILE, block_size=32))
    with caplog.at_level(logging.WARNING, logger="kvflow.profiles"):
        await late.announce(float("inf"))
    assert "full" in caplog.text
    assert len(await late.others(float("inf"))) == SLOTS
    await late.others(float("inf"), max_age_s=0.0)  # a full book read again: not announcing at every store
    assert not late.due


async def test_an_evicted_announcement_is_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvflow.profiles as profiles

    backend = MemoryBackend()
    book = ProfileBook(backend, PROFILE)
    await book.announce(float("inf"))
    (key,) = [k for k in backend.stored_keys() if is_book_key(k)]
    assert await backend.remove([key]) == [True]  # the store evicted it
    await book.announce(float("inf"))  # within the minute: not looked at again
    assert not any(is_book_key(k) for k in backend.stored_keys())
    monkeypatch.setattr(profiles, "ANNOUNCE_EVERY_S", 0.0)
    await book.announce(float("inf"))
    assert [k for k in backend.stored_keys() if is_book_key(k)] == [key]


def caches(heads: int, layers: int = 2, block: int = 16) -> dict[str, torch.Tensor]:
    return {f"l{i}": torch.randn(2, 8, block, heads, 4) for i in range(layers)}


async def store_split(
    backend: Backend,
    tokens: list[int],
    blocks: int,
    tp: int = 2,
    block_offset: int = 0,
    cache: dict[str, torch.Tensor] | None = None,
    block: int = 16,
) -> list[dict[str, torch.Tensor]]:
    """An engine at TP=``tp`` (the model's 4 KV heads split over its ranks) with blocks of
    ``block`` tokens, hashed every 16, stores ``blocks`` blocks of the prompt from
    ``block_offset``; returns each rank's cache (``cache``: a one-rank engine's own)."""
    shards = [cache] if cache is not None and tp == 1 else [caches(4 // tp, block=block) for _ in range(tp)]
    for rank, shard in enumerate(shards):
        pool = KVPool.create(
            PoolConfig(hash_tokens=16),
            layout=KVLayout.from_kv_caches(shard),
            backend=backend,
            parallel=ParallelConfig(tp_rank=rank, tp_size=tp, num_kv_heads=4),
        )
        request = KVRequest(tokens=tokens, block_ids=range(blocks), block_offset=block_offset)
        assert (await pool.store(request)).stored == blocks
    return shards


async def store_large_blocks(backend: Backend, tokens: list[int]) -> dict[str, torch.Tensor]:
    """An engine with blocks of 32 tokens (hashed every 16) stores 32 tokens as its block 1."""
    big = {f"l{i}": torch.randn(2, 4, 32, 4, 4) for i in range(2)}
    layout = KVLayout.from_kv_caches(big)
    writer = KVPool.create(PoolConfig(hash_tokens=16), layout=layout, backend=backend)
    assert (await writer.store(KVRequest(tokens=tokens, block_ids=[1]))).stored == 1
    return big


async def test_a_prompt_loads_partly_from_its_own_keys_and_partly_from_another_split() -> None:
    """Blocks 0-3 under the reader's own keys, 4-7 only as another TP size's objects."""
    backend = MemoryBackend()
    tokens = list(range(8 * 16))
    mine = caches(4)
    own = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(mine), backend=backend)
    assert (await own.store(KVRequest(tokens=tokens, block_ids=range(4)))).stored == 4
    halves = await store_split(backend, tokens, 4, block_offset=4)
    assert len(kv_keys(backend)) == 4 + 2 * 4
    reader_caches = {name: torch.zeros_like(c) for name, c in mine.items()}
    reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(reader_caches), backend=backend)
    assert await reader.lookup(KVRequest(tokens=tokens)) == 8 * 16
    got = await reader.retrieve(KVRequest(tokens=tokens, block_ids=[7, 6, 5, 4, 3, 2, 1, 0]))
    assert got.hit_blocks == 8
    for name, cache in reader_caches.items():
        for i in range(4):  # own keys: block i of the prompt is cache block 7 - i
            assert torch.equal(cache[:, 7 - i], mine[name][:, i])
        for i in range(4, 8):  # the TP=2 objects: heads 0-1 from rank 0, 2-3 from rank 1
            for rank in range(2):
                assert torch.equal(cache[:, 7 - i, :, 2 * rank : 2 * rank + 2], halves[rank][name][:, i - 4])


async def test_a_rank_whose_heads_start_past_0_loads_another_split_and_block_size() -> None:
    """TP=2 rank 1 (model heads 2-3, blocks of 16 tokens) loads what a TP=4 engine stored in
    blocks of 32 tokens: each of its heads comes from another writer rank's objects, and heads and
    tokens both land at their own offsets, bit-exact."""
    backend = MemoryBackend()
    tokens = list(range(64))
    quarters = await store_split(backend, tokens, 2, tp=4, block=32)
    mine = {name: torch.zeros_like(c) for name, c in caches(2).items()}
    reader = KVPool.create(
        PoolConfig(),
        layout=KVLayout.from_kv_caches(mine),
        backend=backend,
        parallel=ParallelConfig(tp_rank=1, tp_size=2, num_kv_heads=4),
    )
    assert (await reader.retrieve(KVRequest(tokens=tokens, block_ids=[7, 6, 5, 4]))).hit_blocks == 4
    for name, cache in mine.items():
        for j, dst in enumerate([7, 6, 5, 4]):  # the prompt's block j, half of the writer's block j // 2
            big, half = divmod(j, 2)
            for h in range(2):  # the reader's head h is model head 2 + h, held by writer rank 2 + h
                wrote = quarters[2 + h][name][:, big, half * 16 : (half + 1) * 16, 0]
                assert torch.equal(cache[:, dst, :, h], wrote)


async def test_a_block_stored_inside_a_larger_block_past_the_prompt_is_not_promised() -> None:
    """A writer with blocks of 16 tokens (hashed every 8) stored 32 tokens; a reader with blocks
    of 8 asks for a prompt of 24. Tokens 16-24 sit in the writer's second block, named by the hash
    at token 32, which the reader's prompt does not reach: the lookup stops at 16 tokens."""
    backend = MemoryBackend()
    tokens = list(range(32))
    writer = KVPool.create(
        PoolConfig(hash_tokens=8), layout=KVLayout.from_kv_caches(caches(4)), backend=backend
    )
    assert (await writer.store(KVRequest(tokens=tokens, block_ids=range(2)))).stored == 2
    small = {f"l{i}": torch.zeros(2, 8, 8, 4, 4) for i in range(2)}  # blocks of 8 tokens
    reader = KVPool.create(PoolConfig(hash_tokens=8), layout=KVLayout.from_kv_caches(small), backend=backend)
    assert await reader.lookup(KVRequest(tokens=tokens)) == 32  # the whole prompt: every block named
    assert await reader.lookup(KVRequest(tokens=tokens[:24])) == 16
    got = await reader.retrieve(KVRequest(tokens=tokens[:24], block_ids=[0, 1, 2]))
    assert got.hit_blocks == 2 and got.failed_block_ids == (2,)


async def test_engines_hashing_at_another_granularity_are_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    tokens = list(range(4 * 16))
    writer = KVPool.create(
        PoolConfig(hash_tokens=8), layout=KVLayout.from_kv_caches(caches(4)), backend=backend
    )
    await writer.store(KVRequest(tokens=tokens, block_ids=range(4)))
    reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(caches(4)), backend=backend)
    with caplog.at_level(logging.WARNING, logger="kvflow.profiles"):
        assert await reader.lookup(KVRequest(tokens=tokens)) == 0
        assert await reader.lookup(KVRequest(tokens=tokens)) == 0
    assert caplog.text.count("cannot share") == 1


def test_a_cache_that_disagrees_with_the_parallel_layout_is_refused() -> None:
    layout = KVLayout.from_kv_caches(caches(4))
    with pytest.raises(ConfigError, match="KV caches hold 4"):
        KVPool.create(
            PoolConfig(), layout=layout, parallel=ParallelConfig(tp_rank=0, tp_size=2, num_kv_heads=4)
        )
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ParallelConfig(tp_rank=0, tp_size=2)
    with pytest.raises(ConfigError, match="use_mla=True"):
        KVPool.create(PoolConfig(), layout=layout, parallel=ParallelConfig(use_mla=True))
    with pytest.raises(ConfigError, match="pp_layers"):
        KVPool.create(PoolConfig(), layout=layout, parallel=ParallelConfig(pp_size=2, pp_layers=(3, 1)))
    with pytest.raises(ConfigError, match="hash_tokens"):
        KVPool.create(PoolConfig(hash_tokens=5), layout=layout)


async def test_a_prompt_loads_from_several_other_splits_in_the_order_they_were_announced() -> None:
    """Three other engines announced themselves: one with blocks of 64 tokens (none of this
    48-token prompt's blocks can be named by its hashes), TP=4 (blocks 0-1), TP=2 (all three).
    Each writer's bytes differ, so the reader's cache shows where each block came from: the split
    that cannot name a block is passed over, blocks 0-1 come from the first split that holds
    them, block 2 from the next."""
    backend = MemoryBackend()
    tokens = list(range(8 * 16))

    await store_split(
        backend, tokens, 2, tp=1, cache={f"l{i}": torch.randn(2, 8, 64, 4, 4) for i in range(2)}
    )
    quarters = await store_split(backend, tokens[:32], 2, tp=4)
    halves = await store_split(backend, tokens[:48], 3, tp=2)
    reader_caches = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(reader_caches), backend=backend)
    assert await reader.lookup(KVRequest(tokens=tokens[:48])) == 48
    got = await reader.retrieve(KVRequest(tokens=tokens[:48], block_ids=[7, 6, 5]))
    assert got.hit_blocks == 3
    for name, cache in reader_caches.items():
        for i in range(2):  # from the TP=4 engine: head h from rank h
            for rank in range(4):
                assert torch.equal(cache[:, 7 - i, :, rank : rank + 1], quarters[rank][name][:, i])
        for rank in range(2):  # block 2 from the TP=2 engine
            assert torch.equal(cache[:, 5, :, 2 * rank : 2 * rank + 2], halves[rank][name][:, 2])


@pytest.mark.parametrize(
    ("floor", "staging_bytes", "loaded"),
    [(64 << 20, 4096, 2), (4096, 4096, 0), (4096, 8192, 2)],
    ids=["a larger chunk made", "past the bound", "the bound raised"],
)
async def test_a_block_whose_other_objects_outgrow_a_staging_chunk_loads_through_a_larger_one(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    floor: int,
    staging_bytes: int,
    loaded: int,
) -> None:
    """The reader's staging chunk holds one of its own blocks; a block written by an engine with
    blocks twice as large needs twice that. The pool makes chunks large enough for it, up to
    staging_bytes or 64 MiB, whichever is larger (``floor`` stands for the 64 MiB). Past that bound
    the block is reported for recomputation (never half loaded) and the log says what to raise;
    raising it loads the block."""
    monkeypatch.setattr(core, "_SCRATCH_BYTES", floor)
    backend = MemoryBackend()
    tokens = list(range(32))
    big = {f"l{i}": torch.randn(2, 4, 32, 4, 4) for i in range(2)}
    writer = KVPool.create(PoolConfig(hash_tokens=16), layout=KVLayout.from_kv_caches(big), backend=backend)
    assert (await writer.store(KVRequest(tokens=tokens, block_ids=[1]))).stored == 1
    mine = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    reader = KVPool.create(
        PoolConfig(staging="always", staging_bytes=staging_bytes),
        layout=KVLayout.from_kv_caches(mine),
        backend=backend,
    )
    staging = reader._transfer.staging
    assert staging is not None and staging.chunk_bytes == staging_bytes  # 4096: one of its own blocks
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        got = await reader.retrieve(KVRequest(tokens=tokens, block_ids=[3, 5]))
    assert got.hit_blocks == loaded
    if loaded:
        for name, cache in mine.items():
            assert torch.equal(cache[:, 3], big[name][:, 1, :16]) and torch.equal(
                cache[:, 5], big[name][:, 1, 16:]
            )
    else:
        assert got.failed_block_ids == (3, 5)
        assert (
            "more than a load holds at once (4096 bytes" in caplog.text
            and "raise staging_bytes" in caplog.text
        )
        assert not mine["l0"].any()  # nothing half-written


async def test_a_pool_that_does_not_stage_makes_larger_chunks_when_a_later_block_needs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its host chunks for other splits' objects are made on first use, as large as that load
    needs (here 4 KiB: chunks of at least 32 MiB, lowered to 4 KiB); a later load from blocks
    twice as large gets chunks made for it, instead of missing because it came second."""
    monkeypatch.setattr(staging_module, "MAX_CHUNK_BYTES", 4096)
    monkeypatch.setattr(core, "_SCRATCH_BYTES", 16384)
    backend = MemoryBackend()
    first, second = list(range(32)), list(range(100, 132))
    halves = await store_split(backend, first, 2)  # objects of 2 KiB: 4 KiB a block
    big = await store_large_blocks(backend, second)  # objects of 8 KiB
    mine = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(mine), backend=backend)
    assert reader._transfer.staging is None
    assert (await reader.retrieve(KVRequest(tokens=first, block_ids=[3, 5]))).hit_blocks == 2
    assert reader._transfer._scratch is not None and reader._transfer._scratch.chunk_bytes == 4096
    assert (await reader.retrieve(KVRequest(tokens=second, block_ids=[1, 2]))).hit_blocks == 2
    for name, cache in mine.items():
        assert torch.equal(cache[:, 3, :, 2:], halves[1][name][:, 0])
        assert torch.equal(cache[:, 1], big[name][:, 1, :16]) and torch.equal(
            cache[:, 2], big[name][:, 1, 16:]
        )


@pytest.mark.parametrize("writer_block", [16, 32], ids=["rows of equal blocks", "blocks twice as large"])
async def test_a_load_from_another_split_cancelled_in_its_get_gives_its_chunk_back(writer_block: int) -> None:
    """The reader's own keys miss; it fetches another engine's objects into a staging chunk and is
    cancelled while that get runs. The chunk comes back: the next load finds staging free."""
    backend = FaultyBackend()
    tokens = list(range(32))
    if writer_block == 16:
        await store_split(backend, tokens, 2)
    else:
        await store_large_blocks(backend, tokens)
    mine = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    reader = KVPool.create(
        PoolConfig(staging="always", staging_bytes=8192),
        layout=KVLayout.from_kv_caches(mine),
        backend=backend,
    )
    staging = reader._transfer.staging
    assert staging is not None
    scope = anyio.CancelScope()
    gets: list[int] = []

    async def cancel(objects: object) -> None:
        gets.append(1)
        if len(gets) == 2:  # the first get asks for the reader's own keys (all missing)
            scope.cancel()
            await anyio.sleep_forever()

    backend.get_hook = cancel
    with scope:
        await reader.retrieve(KVRequest(tokens=tokens, block_ids=[3, 5]))
    assert scope.cancelled_caught and len(gets) == 2 and staging.in_use == 0
    backend.get_hook = None
    assert (await reader.retrieve(KVRequest(tokens=tokens, block_ids=[3, 5]))).hit_blocks == 2


async def test_a_split_whose_blocks_outgrow_what_a_load_holds_is_passed_over_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first split announced wrote blocks twice as large as a load of the reader may hold (its
    staging_bytes, and the 64 MiB floor lowered to it); the next one (TP=2, the reader's block
    size) fits, and the blocks come from it."""
    monkeypatch.setattr(core, "_SCRATCH_BYTES", 4096)
    backend = MemoryBackend()
    tokens = list(range(32))
    await store_large_blocks(backend, tokens)
    halves = await store_split(backend, tokens, 2)
    mine = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    reader = KVPool.create(
        PoolConfig(staging="always", staging_bytes=4096),
        layout=KVLayout.from_kv_caches(mine),
        backend=backend,
    )
    assert (await reader.retrieve(KVRequest(tokens=tokens, block_ids=[3, 5]))).hit_blocks == 2
    for name, cache in mine.items():
        for rank in range(2):
            assert torch.equal(cache[:, 3, :, 2 * rank : 2 * rank + 2], halves[rank][name][:, 0])
            assert torch.equal(cache[:, 5, :, 2 * rank : 2 * rank + 2], halves[rank][name][:, 1])


class CountingExists(MemoryBackend):
    """Counts the KV keys (not the book's) that lookups ask about."""

    asked = 0

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self.asked += sum(not is_book_key(k) for k in keys)
        return await super().exists(keys)


@pytest.mark.parametrize("held", [0, 1, 2, 5, 8])
async def test_a_lookup_asks_another_split_only_as_far_as_it_holds_the_prompt(held: int) -> None:
    """A TP=2 engine holds the first ``held`` of 24 blocks of a prompt the reader (TP=1) never
    stored. The lookup finds them, and asks about the other split's objects in order, stopping
    soon after the first block it lacks: a prompt nobody stored costs one block's keys per split,
    not the whole prompt's (a long cold prompt took seconds with a layerwise split in the book)."""
    backend = CountingExists()
    tokens = list(range(24 * 16))
    await store_split(backend, list(range(1000, 1016)), 1)  # announces the split
    await store_split(backend, tokens, held)
    reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(caches(4)), backend=backend)
    backend.asked = 0
    assert await reader.lookup(KVRequest(tokens=tokens)) == held * 16
    elsewhere = backend.asked - 24  # the reader's own keys: one call for the whole prompt
    assert 2 * (held + 1) <= elsewhere <= 2 * (4 * held + 1)  # two objects (one per rank) a block


async def test_a_lookup_promises_no_block_whose_objects_outgrow_what_each_rank_may_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TP=2 engine wrote blocks of 32 tokens: two objects of 4096 bytes per block. A load holds
    4096 bytes of another split's objects at once (staging_bytes, the 64 MiB floor lowered). A
    TP=1 reader needs both objects per block: its lookup says 0, as its load would fail (the lookup
    said 64 tokens before, and every load of them failed). Each rank of a TP=2 reader needs one:
    the lookup promises the prompt, and both ranks load it."""
    monkeypatch.setattr(core, "_SCRATCH_BYTES", 4096)
    backend = MemoryBackend()
    tokens = list(range(64))
    halves = await store_split(backend, tokens, 2, block=32)
    config = PoolConfig(staging_bytes=4096)
    whole = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    one = KVPool.create(config, layout=KVLayout.from_kv_caches(whole), backend=backend)
    assert await one.lookup(KVRequest(tokens=tokens)) == 0
    assert (await one.retrieve(KVRequest(tokens=tokens, block_ids=range(4)))).hit_blocks == 0

    two = ParallelConfig(tp_size=2, num_kv_heads=4)
    for rank in range(2):
        mine = {name: torch.zeros_like(c) for name, c in caches(2).items()}
        pool = KVPool.create(
            config,
            layout=KVLayout.from_kv_caches(mine),
            backend=backend,
            parallel=attrs.evolve(two, tp_rank=rank),
        )
        assert await pool.lookup(KVRequest(tokens=tokens)) == 64  # for every rank of the engine
        assert (await pool.retrieve(KVRequest(tokens=tokens, block_ids=range(4)))).hit_blocks == 4
        for name, cache in mine.items():
            for j in range(4):  # the prompt's block j is half of the writer's block j // 2
                big, half = divmod(j, 2)
                assert torch.equal(cache[:, j], halves[rank][name][:, big, half * 16 : (half + 1) * 16])


async def test_a_prompt_the_first_split_fills_whole_is_not_looked_for_in_the_next() -> None:
    """Two other splits hold the prompt (TP=4 announced first, then TP=2): its blocks all come from
    the first, the second is not read."""
    backend = FaultyBackend()
    tokens = list(range(32))
    quarters = await store_split(backend, tokens, 2, tp=4)
    await store_split(backend, tokens, 2)
    reader_caches = {name: torch.zeros_like(c) for name, c in caches(4).items()}
    reader = KVPool.create(PoolConfig(), layout=KVLayout.from_kv_caches(reader_caches), backend=backend)
    backend.calls.clear()
    assert (await reader.retrieve(KVRequest(tokens=tokens, block_ids=[1, 0]))).hit_blocks == 2
    # the reader's own keys, then the eight TP=4 objects in two calls of four; no TP=2 object
    assert backend.calls.count("get") == 3
    for name, cache in reader_caches.items():
        for rank in range(4):
            assert torch.equal(cache[:, 1, :, rank : rank + 1], quarters[rank][name][:, 0])
            assert torch.equal(cache[:, 0, :, rank : rank + 1], quarters[rank][name][:, 1])


# --- what a reader does with what the book holds ----------------------------------------------------


async def _put_slot(backend: MemoryBackend, model: str, meaning: str, slot: int, text: str) -> None:
    payload = text.encode().ljust(SLOT_BYTES)
    assert len(payload) == SLOT_BYTES
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    ref = ObjectRef(_slot_key(model, meaning, slot), [buf.data_ptr()], [SLOT_BYTES], SLOT_BYTES)
    await backend.put([ref])


def _garbled(own: Profile, changes: dict[str, object]) -> str:
    data = json.loads(own.to_json())
    data["order"] = "flash_attn.213.213"  # another layout than the reader's: a profile it would use
    data.update(changes)
    return json.dumps(data)


GARBLED = {
    "head_groups=0": {"head_groups": 0},
    "hash_tokens=0": {"hash_tokens": 0},
    "block_size=32.0": {"block_size": 32.0},
    "head_groups=2.0": {"head_groups": 2.0},
    "block_size=-16": {"block_size": -16},
    "float layer ends": {"layer_ranges": [[0, 1.0], [1.0, 2]]},
    "an order no key can hold": {"order": "flash_attn.2/13.2/13"},
}


@pytest.mark.parametrize("changes", list(GARBLED.values()), ids=list(GARBLED))
@pytest.mark.parametrize("call", ["lookup", "retrieve", "store"])
async def test_a_garbled_announcement_never_makes_a_call_raise(changes: dict[str, object], call: str) -> None:
    """A malformed announcement in the shared store (another program, a torn or hostile write) is
    skipped: a lookup, retrieve or store of a pool of that model never raises for it."""
    backend = MemoryBackend()
    pool = KVPool.create(PoolConfig(model="m"), layout=KVLayout.from_kv_caches(caches(4)), backend=backend)
    try:
        own = pool._transfer.profile
        await _put_slot(backend, "m", own.meaning, 0, _garbled(own, changes))
        tokens = list(range(64))  # nothing stored: every block is looked for under other profiles
        if call == "lookup":
            assert await pool.lookup(KVRequest(tokens=tokens)) == 0
        elif call == "retrieve":
            result = await pool.retrieve(KVRequest(tokens=tokens, block_ids=range(4)))
            assert result.hit_blocks == 0
        else:
            await pool.store(KVRequest(tokens=tokens, block_ids=range(4)))
    finally:
        await pool.aclose()


@pytest.mark.parametrize("call", ["lookup", "retrieve", "store"])
async def test_deeply_nested_json_in_a_slot_is_skipped(call: str) -> None:
    """A slot holding JSON nested deeper than Python's recursion limit is skipped."""
    backend = MemoryBackend()
    pool = KVPool.create(PoolConfig(model="m"), layout=KVLayout.from_kv_caches(caches(4)), backend=backend)
    try:
        await _put_slot(backend, "m", pool._transfer.profile.meaning, 0, "[" * SLOT_BYTES)
        tokens = list(range(64))
        if call == "lookup":
            assert await pool.lookup(KVRequest(tokens=tokens)) == 0
        elif call == "retrieve":
            assert (await pool.retrieve(KVRequest(tokens=tokens, block_ids=range(4)))).hit_blocks == 0
        else:
            await pool.store(KVRequest(tokens=tokens, block_ids=range(4)))
    finally:
        await pool.aclose()


async def test_a_profile_claiming_huge_objects_does_not_size_the_scratch() -> None:
    """A profile whose layers are not the model's (here 2**50 of them) is not this model's: the
    reader ignores it rather than sizing host chunks for the objects it claims."""
    backend = MemoryBackend()
    pool = KVPool.create(PoolConfig(model="m"), layout=KVLayout.from_kv_caches(caches(4)), backend=backend)
    try:
        own = pool._transfer.profile
        data = json.loads(own.to_json())
        data.update(order="flash_attn.213.213", layer_ranges=[[0, 2**50]])
        await _put_slot(backend, "m", own.meaning, 0, json.dumps(data))
        result = await pool.retrieve(KVRequest(tokens=list(range(64)), block_ids=range(4)))
        assert result.hit_blocks == 0
    finally:
        await pool.aclose()


async def test_an_evicted_slot_taken_by_another_profile_is_read_again() -> None:
    """A slot read as profile A, then evicted and taken by engine B, is read as B."""
    backend = MemoryBackend()
    a = ProfileBook(backend, PROFILE)
    await a.announce(float("inf"))
    reader = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=1))
    assert await reader.others(float("inf")) == (PROFILE,)
    (slot0,) = [k for k in backend.stored_keys() if is_book_key(k)]
    assert await backend.remove([slot0]) == [True]  # the store evicted A's announcement
    b = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=4))
    await b.announce(float("inf"))  # B takes the first free slot: 0
    reader.forget()
    assert b.own in await reader.others(float("inf"))


async def test_an_engine_whose_slot_was_evicted_and_retaken_announces_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/topology.md: a profile is announced again every minute in case a store evicted it,
    also when another engine's announcement has since taken its slot."""
    import kvflow.profiles as profiles

    monkeypatch.setattr(profiles, "ANNOUNCE_EVERY_S", 0.0)
    backend = MemoryBackend()
    a = ProfileBook(backend, PROFILE)
    await a.announce(float("inf"))  # STORED into slot 0
    await a.announce(float("inf"))  # the minutely check: reads slot 0, sees itself
    (slot0,) = [k for k in backend.stored_keys() if is_book_key(k)]
    assert await backend.remove([slot0]) == [True]  # evicted
    b = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=4))
    await b.announce(float("inf"))  # B takes slot 0
    await a.announce(float("inf"))  # A's next check
    fresh = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=1))  # a reader started now
    assert PROFILE in await fresh.others(float("inf"))


def test_a_layerwise_profile_of_a_126_layer_model_fits_an_announcement() -> None:
    """A layerwise pool of a 126-layer model (Llama-3.1-405B) lists one range per layer; its
    profile fits an announcement."""
    profile = Profile(
        model="meta-llama/Llama-3.1-405B-Instruct",
        meaning="bfloat16.kv8x128",
        order="flash_attn.13.13",  # one KV head per rank (TP=8): no head dim in the order
        block_size=16,
        hash_tokens=16,
        layer_ranges=tuple((i, i + 1) for i in range(126)),
        head_groups=8,
    )
    assert len(profile.to_json().encode()) <= SLOT_BYTES


@attrs.define
class FlakyGets(FaultyBackend):
    """A store whose next get fails (a transient fault)."""

    fail_next: bool = False

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if self.fail_next:
            self.fail_next = False
            return [GetStatus.FAILED] * len(objects)
        return await self.inner.get(objects)


async def test_a_failed_read_of_the_book_does_not_announce_the_profile_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slot that exists but could not be read holds what it held when last read: a pool whose
    own slot's read failed does not take a second slot for its profile."""
    import kvflow.profiles as profiles

    monkeypatch.setattr(profiles, "ANNOUNCE_EVERY_S", 0.0)
    backend = FlakyGets()
    book = ProfileBook(backend, PROFILE)  # type: ignore[arg-type]
    await book.announce(float("inf"))
    backend.fail_next = True
    await book.announce(float("inf"))
    await book.announce(float("inf"))
    assert sum(is_book_key(k) for k in backend.inner.stored_keys()) == 1


async def test_objects_of_an_announcement_whose_layout_cannot_hold_its_meaning_are_never_loaded() -> None:
    """A slot announces K/V heads (the reader's own meaning) in an MLA layout, which has no K or V
    part (another program, another kvflow, a corrupt write), and objects are stored under it. The
    book skips it: the reader neither promises nor reports those blocks (copying them moved no
    byte, and the cache's old bytes came back as loaded)."""
    backend = MemoryBackend()
    tokens = list(range(32))
    mine = {name: t.fill_(7.0) for name, t in caches(4).items()}
    reader = KVPool.create(PoolConfig(model="m"), layout=KVLayout.from_kv_caches(mine), backend=backend)
    try:
        own = reader._transfer.profile
        foreign = json.loads(own.to_json()) | {"order": "mla.12"}
        await _put_slot(backend, "m", own.meaning, 0, json.dumps(foreign))
        fine = reader._transfer.hashing.fine(KVRequest(tokens=tokens))
        junk = torch.zeros(2 * 16 * 4 * 4, dtype=torch.uint8)  # as the announcement sizes them: one
        # plane [tokens, 4 columns] of float32 per layer
        scope = KeyScope(
            model="m", meaning=own.meaning, order="mla.12", block_size=16, layers=(0, 2), heads=(0, 4)
        )
        await backend.put(
            [
                ObjectRef(scope.prefix + fine[b].hex(), [junk.data_ptr()], [junk.numel()], junk.numel())
                for b in (0, 1)
            ]
        )
        assert await reader.lookup(KVRequest(tokens=tokens)) == 0
        got = await reader.retrieve(KVRequest(tokens=tokens, block_ids=[0, 1]))
        assert got.hit_blocks == 0
    finally:
        await reader.aclose()


async def test_context_sharded_profiles_of_another_block_size_are_not_read() -> None:
    """With decode or prefill context parallelism a rank's block holds its shard of the tokens,
    not a run of consecutive ones: only shards of the reader's own block size (in another layout,
    say) are read; another block size would be copied by token ranges it does not hold."""
    backend = MemoryBackend()
    for shard in ({"dcp_size": 2}, {"pcp_size": 2}):
        own = attrs.evolve(PROFILE, **shard)  # type: ignore[arg-type]
        other_layout = attrs.evolve(own, order="flash_attn.213.213")
        other_block = attrs.evolve(own, block_size=32)
        for profile in (other_layout, other_block):
            await ProfileBook(backend, profile).announce(float("inf"))
        assert await ProfileBook(backend, own).others(float("inf")) == (other_layout,)
    unsharded = attrs.evolve(PROFILE, block_size=32)  # without shards, another block size is read
    await ProfileBook(backend, unsharded).announce(float("inf"))
    assert unsharded in await ProfileBook(backend, PROFILE).others(float("inf"))


@attrs.define
class PutKeepsTheFirstValue(FaultyBackend):
    """A store whose put of a key that exists keeps the value there and says STORED (Mooncake's
    put), or with ``says_present`` PRESENT (the memory, local and arena stores); ``before_put``
    runs once, before the next put (another pool's announcement landing between this pool's read
    of the book and its put)."""

    before_put: Callable[[], Awaitable[None]] | None = None
    says_present: bool = False

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if self.before_put is not None:
            run, self.before_put = self.before_put, None
            await run()
        present = await self.inner.exists([o.key for o in objects])
        fresh = [o for o, there in zip(objects, present) if not there]
        await self.inner.put(fresh)
        kept = PutStatus.PRESENT if self.says_present else PutStatus.STORED
        return [kept if there else PutStatus.STORED for there in present]


@pytest.mark.parametrize("says_present", [False, True])
async def test_two_pools_racing_for_a_slot_both_get_announced_in_one_call(says_present: bool) -> None:
    """Pools A and B read the book empty; A's announcement lands in slot 0 before B's put of slot
    0, which the store keeps as A's (answering STORED, as Mooncake, or PRESENT). B finds A there
    (reading the slot back after a STORED) and takes slot 1 in the same call. Before: B counted
    slot 0 as its own for a minute (STORED), or stayed out of the book until its next store
    (PRESENT), and engines split otherwise could not find its KV meanwhile: an engine that stores
    once, or rarely, for good."""
    backend = PutKeepsTheFirstValue(says_present=says_present)
    a = ProfileBook(backend, PROFILE)  # type: ignore[arg-type]
    b = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=4))  # type: ignore[arg-type]
    backend.before_put = lambda: a.announce(float("inf"))
    await b.announce(float("inf"))  # read the book empty; A took slot 0 before B's put
    assert sum(is_book_key(k) for k in backend.inner.stored_keys()) == 2
    reader = ProfileBook(backend, attrs.evolve(PROFILE, head_groups=1))  # type: ignore[arg-type]
    assert set(await reader.others(float("inf"))) == {PROFILE, b.own}
    assert not b.due  # announced: it does not look again for a minute


@attrs.define
class SlotBeingWritten(FaultyBackend):
    """A store where another live writer holds slot 0's key, not yet published (the arena answers
    PRESENT to a put of it, while exists and get do not see it); every put is recorded."""

    puts: list[str] = attrs.field(factory=list)

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        self.puts += [o.key for o in objects]
        held = [o.key.endswith("@0") for o in objects]
        kept = await self.inner.put([o for o, h in zip(objects, held) if not h])
        answers = iter(kept)
        return [PutStatus.PRESENT if h else next(answers) for h in held]


async def test_a_slot_another_writer_still_writes_is_tried_once_and_the_next_one_taken() -> None:
    """Slot 0 reads as free but answers PRESENT (another writer's put of it has not published):
    the pool takes slot 1 in the same call, with two puts (before this was mended, it put slot 0
    again sixteen times, stayed out of the book, and did so again at every store)."""
    backend = SlotBeingWritten()
    book = ProfileBook(backend, PROFILE)  # type: ignore[arg-type]
    await book.announce(float("inf"))
    assert [k.rsplit("@", 1)[1] for k in backend.puts] == ["0", "1"]
    assert not book.due
    assert PROFILE in await ProfileBook(backend, attrs.evolve(PROFILE, head_groups=4)).others(float("inf"))  # type: ignore[arg-type]


@attrs.define
class KeepsNothing(FaultyBackend):
    """A store whose puts answer STORED and keep nothing."""

    puts: int = 0

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        self.puts += 1
        return [PutStatus.STORED] * len(objects)


async def test_an_announcement_a_store_did_not_keep_is_put_once_per_call() -> None:
    """Stored, then not there when read back: the call ends (the next store looks again), one put."""
    backend = KeepsNothing()
    book = ProfileBook(backend, PROFILE)  # type: ignore[arg-type]
    await book.announce(float("inf"))
    assert backend.puts == 1 and book.due


async def test_a_pool_whose_announcement_a_read_finds_gone_announces_at_its_next_store() -> None:
    """After `kvflow store clear` (or an eviction) a pool that reads the book for a lookup and
    finds its own profile gone announces it at its next store, not a minute later; a full book
    does not send it announcing at every store."""
    backend = MemoryBackend()
    book = ProfileBook(backend, PROFILE)
    await book.announce(float("inf"))
    (key,) = [k for k in backend.stored_keys() if is_book_key(k)]
    assert await backend.remove([key]) == [True]  # `kvflow store clear`
    await book.announce(float("inf"))  # within the minute, and nothing read since: not looked at
    assert not any(is_book_key(k) for k in backend.stored_keys())
    assert await book.others(float("inf"), max_age_s=0.0) == ()  # a lookup reads the book
    await book.announce(float("inf"))  # the next store
    assert [k for k in backend.stored_keys() if is_book_key(k)] == [key]
    await book.others(float("inf"), max_age_s=0.0)  # found there: no announcing at every store
    assert not book.due


async def test_a_profile_too_large_to_announce_is_reported_once_a_minute_not_at_every_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A profile that does not fit a slot is never in the book; reading the book for lookups must
    not send the pool reading it again and warning at every store."""
    huge = attrs.evolve(PROFILE, layer_ranges=tuple((i, i + 1) for i in range(600)))
    assert len(huge.to_json().encode()) > SLOT_BYTES
    backend = MemoryBackend()
    book = ProfileBook(backend, huge)
    with caplog.at_level(logging.WARNING, logger="kvflow.profiles"):
        for _ in range(3):
            await book.announce(float("inf"))  # a store
            await book.others(float("inf"), max_age_s=0.0)  # a lookup reads the book
    assert sum("does not fit" in r.getMessage() for r in caplog.records) == 1
    assert not book.due
