"""Block hashes, key scopes and the one key codec.

A request's tokens become prefix-chained block hashes ``h_i = sha256(h_{i-1} || tokens of block i)``;
only full blocks are hashed. Engine-provided hashes (vLLM's 32-byte ``request.block_hashes``) are used
as they are. A :class:`KeyScope` says which cache a hash belongs to (model, rank coordinates that make
KV differ, layout fingerprint); :func:`block_keys` and :func:`layer_keys` turn hashes into backend
keys with one precomputed prefix per scope, and :func:`decode_key` turns a key back into its parts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from functools import cached_property
from urllib.parse import quote, unquote

import attrs

from kvflow.errors import RequestError

__all__ = [
    "ROOT_HASH",
    "BlockKey",
    "KeyScope",
    "block_keys",
    "decode_key",
    "encode_key",
    "hash_blocks",
    "layer_keys",
]

ROOT_HASH = hashlib.sha256(b"kvflow block hash chain v1").digest()
_VERSION = "kvf1"


def hash_blocks(tokens: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Prefix-chained sha256 hashes of the full blocks of ``tokens`` (a trailing partial block is
    ignored). Deterministic across processes and machines; token ids are hashed as int64."""
    if block_size <= 0:
        raise RequestError(f"block_size must be > 0, got {block_size}")
    try:
        packed = array("q", tokens).tobytes()
    except (TypeError, OverflowError) as exc:
        raise RequestError(f"tokens must be integers in the int64 range: {exc}") from exc
    width = block_size * 8
    view = memoryview(packed)
    hashes: list[bytes] = []
    previous = parent
    for start in range(0, len(packed) - width + 1, width):
        digest = hashlib.sha256(previous)
        digest.update(view[start : start + width])
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def _nonnegative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise RequestError(f"{attribute.name} must be >= 0, got {value}")


def _fingerprint(_: object, __: attrs.Attribute[str], value: str) -> None:
    if not value or "@" in value:
        raise RequestError(f"a layout fingerprint must be non-empty and free of '@', got {value!r}")


@attrs.frozen
class KeyScope:
    """Everything besides the block hash that makes two caches' KV differ."""

    model: str
    fingerprint: str = attrs.field(validator=_fingerprint)
    kv_head_group: int = attrs.field(default=0, validator=_nonnegative)
    pp_rank: int = attrs.field(default=0, validator=_nonnegative)
    pcp_rank: int = attrs.field(default=0, validator=_nonnegative)
    dcp_rank: int = attrs.field(default=0, validator=_nonnegative)

    @cached_property
    def prefix(self) -> str:
        """The key text shared by every block of this scope; keys append the hash in hex."""
        return (
            f"{_VERSION}@{quote(self.model, safe='')}@{self.fingerprint}"
            f"@pcp{self.pcp_rank}@dcp{self.dcp_rank}@h{self.kv_head_group}@pp{self.pp_rank}@"
        )


@attrs.frozen
class BlockKey:
    """A decoded key: its scope, the block hash and, for per-layer objects, the layer index."""

    scope: KeyScope
    block_hash: bytes
    layer: int | None = None


def block_keys(scope: KeyScope, hashes: Sequence[bytes]) -> list[str]:
    """The whole-block key of each hash, in order."""
    prefix = scope.prefix
    return [prefix + h.hex() for h in hashes]


def layer_keys(scope: KeyScope, hashes: Sequence[bytes], layer: int) -> list[str]:
    """The per-layer key of each hash for ``layer``, in order."""
    prefix = scope.prefix
    suffix = f"@L{layer}"
    return [prefix + h.hex() + suffix for h in hashes]


def encode_key(key: BlockKey) -> str:
    if key.layer is None:
        return block_keys(key.scope, [key.block_hash])[0]
    return layer_keys(key.scope, [key.block_hash], key.layer)[0]


def _rank(field: str, tag: str) -> int:
    if not field.startswith(tag) or not field[len(tag) :].isdigit():
        raise RequestError(f"malformed key field {field!r}, expected {tag}<n>")
    return int(field[len(tag) :])


def decode_key(text: str) -> BlockKey:
    """The inverse of :func:`encode_key`. Raises RequestError for text that is not a kvflow key."""
    fields = text.split("@")
    if len(fields) not in (8, 9) or fields[0] != _VERSION:
        raise RequestError(f"{text!r} is not a kvflow key")
    scope = KeyScope(
        model=unquote(fields[1]),
        fingerprint=fields[2],
        pcp_rank=_rank(fields[3], "pcp"),
        dcp_rank=_rank(fields[4], "dcp"),
        kv_head_group=_rank(fields[5], "h"),
        pp_rank=_rank(fields[6], "pp"),
    )
    try:
        block_hash = bytes.fromhex(fields[7])
    except ValueError as exc:
        raise RequestError(f"malformed block hash in key {text!r}") from exc
    layer = _rank(fields[8], "L") if len(fields) == 9 else None
    return BlockKey(scope, block_hash, layer)
