"""The one request value every face takes: which blocks of which prompt.

``KVRequest(tokens=prompt, block_ids=[3, 7, 9])`` says: the engine blocks 3, 7 and 9 hold blocks
0, 1 and 2 of the prompt. ``block_offset=k`` shifts that: ``block_ids[i]`` holds block ``k + i``.
Blocks are full blocks of the pool's block size; a trailing partial block is never stored.

The prompt is named by its ``tokens`` (kvflow hashes them) or by ``block_hashes`` the engine computed
(vLLM's ``request.block_hashes``), one per full block from the request's first block. A lookup uses
the same value with no ``block_ids``: ``block_offset`` then counts the blocks the engine already
holds, which the lookup does not ask for.

Everything that can be checked without a pool is checked here, before anything moves: block ids are
non-negative integers (numpy integers too, never ``bool``), no block id appears twice, the offset is
non-negative, and tokens or hashes are given. The pool checks the rest (block ids against the cache,
the offset against the prompt's blocks).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable
from typing import cast

import attrs

from kvflow.errors import RequestError

__all__ = ["KVRequest", "as_index"]


def as_index(value: object, what: str) -> int:
    """``value`` as a non-negative ``int``: an integer (numpy and torch integers too), never a
    ``bool`` or a float; RequestError naming ``what`` otherwise. The one check of every index an
    engine passes (block ids, offsets, layers)."""
    if type(value) is int and value >= 0:  # the common case, without the calls below
        return value
    if isinstance(value, bool):
        raise RequestError(f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # int, numpy or torch integers
    except TypeError:
        raise RequestError(f"{what} must be an integer, got {value!r}") from None
    if number < 0:
        raise RequestError(f"{what} must be >= 0, got {number}")
    return number


def _block_ids(values: Iterable[object]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise RequestError(f"block_ids must be a sequence of integers, got {values!r}")
    given = tuple(values)
    ids = cast("tuple[int, ...]", given) if set(map(type, given)) <= {int} else ()  # checked in C
    if len(ids) != len(given) or min(ids, default=0) < 0:  # numpy or torch integers, or a bad one
        ids = tuple(as_index(v, "a block id") for v in given)
    if len(set(ids)) != len(ids):
        twice = sorted(b for b, n in Counter(ids).items() if n > 1)
        raise RequestError(
            f"block ids {twice} appear more than once in one request; each engine block holds one "
            "block of the prompt, so pass each id once"
        )
    return ids


def _tokens(values: Iterable[int] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)):
        raise RequestError(f"tokens must be a sequence of integer token ids, got {values!r}")
    return values if isinstance(values, tuple) else tuple(values)


def _hashes(values: Iterable[bytes] | None) -> tuple[bytes, ...] | None:
    if values is None:
        return None
    hashes = values if isinstance(values, tuple) else tuple(values)
    if not (set(map(type, hashes)) <= {bytes} and all(hashes)):  # checks in C; the rest one by one
        for h in hashes:
            if not isinstance(h, bytes) or not h:
                raise RequestError(f"block hashes must be non-empty bytes, got {h!r}")
    return hashes


def _offset(value: object) -> int:
    return as_index(value, "block_offset")


@attrs.frozen(kw_only=True)
class KVRequest:
    """Blocks ``block_offset ..`` of one prompt and the engine blocks that hold them.

    ``block_ids[i]`` holds block ``block_offset + i`` of the prompt named by ``tokens`` or
    ``block_hashes`` (hashes from the prompt's first block; both may be given when they agree).
    ``request_id`` names the request in results of a batch (a layerwise step).
    """

    block_ids: tuple[int, ...] = attrs.field(default=(), converter=_block_ids)
    tokens: tuple[int, ...] | None = attrs.field(default=None, converter=_tokens)
    block_hashes: tuple[bytes, ...] | None = attrs.field(default=None, converter=_hashes)
    block_offset: int = attrs.field(default=0, converter=_offset)
    request_id: str = ""

    def __attrs_post_init__(self) -> None:
        if self.tokens is None and self.block_hashes is None:
            raise RequestError("a KVRequest needs tokens or block_hashes to name the prompt")

    @property
    def end_block(self) -> int:
        """One past the last block of the prompt this request names a block id for."""
        return self.block_offset + len(self.block_ids)
