from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import RequestError
from kvflow.keys import BlockKey, KeyScope, block_keys, decode_key, encode_key, hash_blocks, layer_keys

tokens_st = st.lists(st.integers(0, 2**31), max_size=200)


@given(tokens_st, st.integers(1, 17))
def test_only_full_blocks_are_hashed(tokens: list[int], block_size: int) -> None:
    hashes = hash_blocks(tokens, block_size)
    assert len(hashes) == len(tokens) // block_size
    assert all(len(h) == 32 for h in hashes)


@given(tokens_st.filter(lambda t: len(t) >= 8), st.integers(1, 4), st.data())
def test_hashes_chain_on_the_prefix(tokens: list[int], block_size: int, data: st.DataObject) -> None:
    """Changing a token changes the hash of its block and of every later block, and no earlier one."""
    hashes = hash_blocks(tokens, block_size)
    full = len(hashes) * block_size
    pos = data.draw(st.integers(0, full - 1))
    changed = list(tokens)
    changed[pos] += 1
    other = hash_blocks(changed, block_size)
    block = pos // block_size
    assert other[:block] == hashes[:block]
    assert all(a != b for a, b in zip(other[block:], hashes[block:]))


def test_hash_is_independent_of_pythonhashseed() -> None:
    code = "from kvflow.keys import hash_blocks; print(hash_blocks(list(range(64)), 16)[-1].hex())"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1
    assert outs.pop().strip() == hash_blocks(list(range(64)), 16)[-1].hex()


def test_bad_tokens_are_rejected() -> None:
    with pytest.raises(RequestError, match="int64"):
        hash_blocks([1, 2**70], 1)
    with pytest.raises(RequestError, match="block_size"):
        hash_blocks([1, 2], 0)


scopes = st.builds(
    KeyScope,
    model=st.text(min_size=1, max_size=20),
    fingerprint=st.text("0123456789abcdef", min_size=1, max_size=16),
    kv_head_group=st.integers(0, 64),
    pp_rank=st.integers(0, 8),
    pcp_rank=st.integers(0, 8),
    dcp_rank=st.integers(0, 8),
)


@given(scopes, st.binary(min_size=1, max_size=32), st.one_of(st.none(), st.integers(0, 200)))
def test_codec_round_trip(scope: KeyScope, block_hash: bytes, layer: int | None) -> None:
    key = BlockKey(scope, block_hash, layer)
    text = encode_key(key)
    assert decode_key(text) == key


@given(scopes, scopes, st.binary(min_size=1, max_size=32))
def test_distinct_scopes_never_share_keys(a: KeyScope, b: KeyScope, block_hash: bytes) -> None:
    if a != b:
        assert block_keys(a, [block_hash]) != block_keys(b, [block_hash])
        assert layer_keys(a, [block_hash], 0) != layer_keys(b, [block_hash], 0)


def test_layer_keys_differ_per_layer_and_from_block_keys() -> None:
    scope = KeyScope("m", "ab")
    h = [b"\x01" * 32]
    assert len({block_keys(scope, h)[0], layer_keys(scope, h, 0)[0], layer_keys(scope, h, 1)[0]}) == 3


@pytest.mark.parametrize(
    "text", ["", "nokey", "kvf1@m@fp@pcp0@dcp0@hX@pp0@00", "kvf1@m@fp@pcp0@dcp0@h0@pp0@zz"]
)
def test_decode_rejects_foreign_text(text: str) -> None:
    with pytest.raises(RequestError):
        decode_key(text)
