from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvflow.errors import RequestError
from kvflow.keys import ROOT_HASH, BlockKey, KeyScope, block_keys, decode_key, encode_key, hash_blocks

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


@given(tokens_st, st.integers(1, 17))
def test_each_hash_is_sha256_of_the_previous_and_the_blocks_tokens_as_int64(
    tokens: list[int], block_size: int
) -> None:
    """The chain as every store already holds it: h_i = sha256(h_{i-1} || block i's tokens as
    little-endian int64), from ROOT_HASH. Another definition would miss every stored object."""
    expected, previous = [], ROOT_HASH
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        previous = hashlib.sha256(previous + block).digest()
        expected.append(previous)
    assert hash_blocks(tokens, block_size) == expected


def test_the_chain_of_a_known_prompt_is_unchanged() -> None:
    """Pinned: the hash of tokens 0..31 in blocks of 16 (any change of the chain changes it)."""
    assert hash_blocks(list(range(32)), 16)[1].hex() == (
        "823f04b1029b2a29cd4e5a7935bba3b9021a5572b821b9850dbedbcf1e7ea23d"
    )


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
    for outside in (2**70, 2**63, -(2**63) - 1):  # the int64 range, exactly
        with pytest.raises(RequestError, match="int64"):
            hash_blocks([1, outside], 1)
    assert hash_blocks([2**63 - 1, -(2**63)], 1) != hash_blocks([2**63 - 2, -(2**63)], 1)
    with pytest.raises(RequestError, match="block_size"):
        hash_blocks([1, 2], 0)


token_st = st.text("abcdefghijklmnopqrstuvwxyz0123456789_.+-", min_size=1, max_size=16)


@st.composite
def ranges(draw: st.DrawFn, top: int) -> tuple[int, int]:
    first = draw(st.integers(0, top - 1))
    return first, draw(st.integers(first + 1, top))


@st.composite
def shards(draw: st.DrawFn) -> tuple[int, int]:
    size = draw(st.integers(1, 8))
    return draw(st.integers(0, size - 1)), size


scopes = st.builds(
    KeyScope,
    model=st.text(min_size=1, max_size=20),
    meaning=token_st,
    order=token_st,
    block_size=st.integers(1, 256),
    layers=ranges(200),
    heads=ranges(64),
    dcp=shards(),
    pcp=shards(),
)


@given(scopes, st.binary(min_size=1, max_size=32))
def test_codec_round_trip(scope: KeyScope, block_hash: bytes) -> None:
    key = BlockKey(scope, block_hash)
    text = encode_key(key)
    assert decode_key(text) == key


@given(scopes, scopes, st.binary(min_size=1, max_size=32))
def test_distinct_scopes_never_share_keys(a: KeyScope, b: KeyScope, block_hash: bytes) -> None:
    if a != b:
        assert block_keys(a, [block_hash]) != block_keys(b, [block_hash])


@pytest.mark.parametrize(
    "changes",
    [
        {"layers": (0, 2)},
        {"heads": (1, 2)},
        {"block_size": 32},
        {"order": "flash_attn.213.213"},
        {"meaning": "float16.kv2x64"},
        {"dcp": (1, 2)},
    ],
)
def test_every_coordinate_of_the_content_is_in_the_key(changes: dict[str, object]) -> None:
    """Anything that changes what the bytes hold or how they lie gives another key."""
    scope = KeyScope("m", "bfloat16.kv2x64", "flash_attn.123.123", 16, (0, 1), (0, 1))
    other = attrs.evolve(scope, **changes)
    h = [b"\x01" * 32]
    assert block_keys(scope, h) != block_keys(other, h)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": (2, 2)},
        {"layers": [0, 1]},  # a list, not a tuple
        {"layers": (0, 1, 2)},
        {"heads": (-1, 1)},
        {"heads": (0, 1.0)},
        {"dcp": [0, 1]},
        {"dcp": (0, 1, 2)},
        {"dcp": (2, 2)},
        {"meaning": "has@at"},
        {"meaning": "bfloat16.kv2x64\n"},  # (a regex's $ takes a trailing newline)
        {"order": ""},
        {"order": "flash_attn.123.123\n"},
        {"block_size": 0},
    ],
)
def test_bad_scopes_are_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "model": "m",
        "meaning": "bfloat16.kv2x64",
        "order": "flash_attn.123.123",
        "block_size": 16,
        "layers": (0, 1),
        "heads": (0, 1),
    }
    with pytest.raises(RequestError):
        KeyScope(**{**base, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "is not a kvflow key"),
        ("nokey", "is not a kvflow key"),
        ("kvf1@m@fp@pcp0@dcp0@h0@pp0@00", "is not a kvflow key"),
        ("kvf1@m@bf16@o@b16@l0-1@h0-1@d0.1@p0.1@00", "is not a kvflow key"),  # ten fields, old version
        ("kvf2@m@bf16@o@b16@l0-1@h0-1@d0.1@p0.1@00@00", "is not a kvflow key"),
        ("kvf2@m@bf16@o@b16@l0-1@h0-1@d0.1@p0.1@zz", "malformed block hash"),
        ("kvf2@m@bf16@o@bX@l0-1@h0-1@d0.1@p0.1@00", "malformed tokens-per-object field 'bX'"),
        ("kvf2@m@bf16@o@x16@l0-1@h0-1@d0.1@p0.1@00", "malformed tokens-per-object field 'x16'"),
        ("kvf2@m@bf16@o@b16@l0_1@h0-1@d0.1@p0.1@00", "malformed field 'l0_1'.*expected l<n>-<n>"),
        ("kvf2@m@bf16@o@b16@x0-1@h0-1@d0.1@p0.1@00", "malformed field 'x0-1'"),  # wrong tag
        ("kvf2@m@bf16@o@b16@l0-x@h0-1@d0.1@p0.1@00", "malformed field 'l0-x'"),
        ("kvf2@m@bf16@o@b16@lx-1@h0-1@d0.1@p0.1@00", "malformed field 'lx-1'"),
        ("kvf2@m@bf16@o@b16@l0-1@h0.1@d0.1@p0.1@00", r"malformed field 'h0\.1'.*expected h<n>-<n>"),
        ("kvf2@m@bf16@o@b16@l0-1@h0-1@d0-1@p0.1@00", r"malformed field 'd0-1'.*expected d<n>\.<n>"),
        ("kvf2@m@bf16@o@b16@l0-1@h0-1@d0.1@p01@00", r"malformed field 'p01'.*expected p<n>\.<n>"),
        ("kvf2@m@bf16@o@b16@l1-1@h0-1@d0.1@p0.1@00", "layers"),
    ],
)
def test_decode_rejects_foreign_text_saying_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(RequestError, match=says) as raised:
        decode_key(text)
    if "kvf2" in text:
        assert text in str(raised.value) or "layers" in says  # the whole key, to find it


def test_decode_refuses_a_field_that_is_not_valid_text() -> None:
    with pytest.raises(RequestError, match="not valid text"):
        decode_key("kvf2@m\ud800@x@y@b1@l0-1@h0-1@d0.1@p0.1@00")


def test_hash_blocks_refuses_bytes_rather_than_reading_them_as_packed_ids() -> None:
    with pytest.raises(RequestError, match="sequence of integer ids"):
        hash_blocks(bytes([1]) * 128, 16)
    assert hash_blocks(list(bytes([1]) * 32), 16) == hash_blocks([1] * 32, 16)


# --- decode_key reads only what encode_key writes ----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "kvf2@m@bf16@o@b\u00b2@l0-1@h0-1@d0.1@p0.1@00",  # superscript two: isdigit() but not int()
        "kvf2@m@bf16@o@b16@l\u00b2-3@h0-1@d0.1@p0.1@00",
        "kvf2@m@bf16@o@b16@l0-1@h0-1@d0.\u00b9@p0.1@00",
    ],
)
def test_decode_refuses_foreign_text_with_request_error(text: str) -> None:
    """Text that is not a kvflow key raises RequestError, also with digits int() does not read
    (`kvflow store` lists such an object as "other" by catching it)."""
    with pytest.raises(RequestError):
        decode_key(text)


@given(st.text(alphabet="0123456789abAB%41@-._b\u00b2\u0661\u0666 ", max_size=6))
@example("016")
@example("\u0661\u0666")  # Arabic-Indic digits "16"
def test_decode_accepts_only_what_encode_writes_tokens_field(body: str) -> None:
    """decode_key is "the inverse of encode_key": whatever it accepts is a key encode_key writes,
    so a decoded key names exactly the text it was read from (store_admin groups, lists and
    clears objects by the decoded fields)."""
    text = f"kvf2@m@bf16@o@b{body}@l0-1@h0-1@d0.1@p0.1@00"
    try:
        key = decode_key(text)
    except RequestError:
        return
    assert encode_key(key) == text


@pytest.mark.parametrize(
    "text",
    [
        "kvf2@m@bf16@o@b016@l0-1@h0-1@d0.1@p0.1@00",  # leading zero
        "kvf2@%41@bf16@o@b16@l0-1@h0-1@d0.1@p0.1@00",  # 'A' percent-encoded: decodes to model 'A'
        "kvf2@m@bf16@o@b16@l0-1@h0-1@d0.1@p0.1@AB",  # upper-case hash
        "kvf2@m@bf16@o@b\u0661\u0666@l0-1@h0-1@d0.1@p0.1@00",  # Arabic-Indic "16"
    ],
)
def test_decode_is_the_inverse_of_encode(text: str) -> None:
    """A text decode_key accepts re-encodes to itself: two stored keys never decode to one
    BlockKey (`kvflow store clear --model A` must not remove the objects of a key spelled `%41`)."""
    try:
        key = decode_key(text)
    except RequestError:
        return
    assert encode_key(key) == text


def test_store_inventory_lists_a_foreign_key_as_other() -> None:
    """`kvflow store` lists an object whose key is not a kvflow key as "other"."""
    from kvflow.tools.store_admin import StoredObject

    assert StoredObject.of("kvf2@m@bf16@o@b\u00b2@l0-1@h0-1@d0.1@p0.1@00", 1).kind == "other"


def test_decode_refuses_a_number_too_long_to_read() -> None:
    """A field of thousands of digits (int() refuses over 4300) is not a key: RequestError."""
    text = "kvf2@m@bf16@o@b" + "1" * 5000 + "@l0-1@h0-1@d0.1@p0.1@00"
    with pytest.raises(RequestError):
        decode_key(text)
