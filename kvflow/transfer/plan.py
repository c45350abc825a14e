"""A batch of requests, validated and flattened into blocks, before anything moves."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn

import attrs

from kvflow.errors import RequestError
from kvflow.keys import hash_blocks
from kvflow.request import KVRequest

__all__ = ["BlockPlan", "Hashing", "request_hashes"]


@attrs.frozen
class Hashing:
    """How a pool names a prompt's blocks: ``block_size`` tokens per block, a hash every
    ``hash_tokens`` tokens (a divisor of ``block_size``; a block's hash is the chain's hash at its
    last token, so engines with different block sizes but the same ``hash_tokens`` agree)."""

    block_size: int
    hash_tokens: int

    @property
    def per_block(self) -> int:
        return self.block_size // self.hash_tokens

    def fine(self, request: KVRequest) -> list[bytes]:
        """The prompt's hashes, one per ``hash_tokens`` tokens: the given ones as they are, or
        computed from its tokens. When both are given they must agree in count."""
        tokens, hashes = request.tokens, request.block_hashes
        if hashes is None:
            assert tokens is not None  # KVRequest requires one of them
            return hash_blocks(tokens, self.hash_tokens)
        if tokens is not None and len(tokens) // self.hash_tokens != len(hashes):
            raise RequestError(
                f"{len(hashes)} block hashes but {len(tokens)} tokens make "
                f"{len(tokens) // self.hash_tokens} full blocks of {self.hash_tokens}"
            )
        return list(hashes)

    def blocks(self, fine: Sequence[bytes]) -> list[bytes]:
        """The hash of each full block, from the prompt's fine hashes."""
        k = self.per_block
        return list(fine) if k == 1 else list(fine[k - 1 :: k])


def request_hashes(request: KVRequest, hashing: Hashing) -> list[bytes]:
    """The hash of each full block of the prompt."""
    return hashing.blocks(hashing.fine(request))


@attrs.frozen(eq=False)
class BlockPlan:
    """Requests flattened into blocks: flat block ``j`` is block ``indices[j]`` of request
    ``origins[j]``, has hash ``hashes[j]`` and lives in engine block ``block_ids[j]``; request ``r``
    spans ``spans[r]`` and its prompt's fine hashes are ``fine[r]``."""

    requests: tuple[KVRequest, ...]
    spans: tuple[tuple[int, int], ...]
    hashes: list[bytes]
    block_ids: list[int]
    indices: list[int]
    origins: list[int]
    fine: tuple[list[bytes], ...]

    @classmethod
    def build(
        cls, requests: Sequence[KVRequest], hashing: Hashing, num_blocks: int, *, loads: bool = False
    ) -> BlockPlan:
        """Check every request against the cache (``num_blocks``) and the pool's block size, and
        that an engine block two requests both name holds one block of one prompt: a store may
        read one block for two requests of a shared prefix (the same hash), never under two hashes
        (its bytes would be published under a key they do not belong to, a wrong hit for every
        later reader). ``loads``: the requests are loaded, so no two of them may name one
        destination block at all (one get would write it twice, and a failed second copy would
        spoil what the first reported loaded).

        Raises RequestError before anything moves. Pure; safe from any thread.
        """
        spans: list[tuple[int, int]] = []
        hashes: list[bytes] = []
        block_ids: list[int] = []
        indices: list[int] = []
        origins: list[int] = []
        fine: list[list[bytes]] = []
        seen: set[str] = set()
        if not isinstance(requests, Sequence):  # a generator, a dict's values: read once, here
            if not isinstance(requests, Iterable):  # (one KVRequest given to a *_many call, say)
                raise RequestError(
                    f"expected a sequence of kvflow.KVRequest (a list), got {type(requests).__name__}"
                )
            requests = list(requests)
        for r, request in enumerate(requests):
            if not isinstance(request, KVRequest):
                raise RequestError(f"expected a kvflow.KVRequest, got {type(request).__name__}")
            if request.request_id:
                if request.request_id in seen:
                    raise RequestError(
                        f"request {request.request_id!r} appears twice in one batch; pass it once"
                    )
                seen.add(request.request_id)
            prompt = hashing.fine(request)
            got = hashing.blocks(prompt)
            first, end = request.block_offset, request.end_block
            if end > len(got):
                raise RequestError(
                    f"blocks {first}..{end - 1} of the prompt requested, but it has {len(got)} full "
                    f"blocks of {hashing.block_size} tokens"
                )
            if max(request.block_ids, default=-1) >= num_blocks:  # one pass in C; then name the first
                block_id = next(b for b in request.block_ids if b >= num_blocks)
                raise RequestError(
                    f"block id {block_id} is out of range: the KV cache has {num_blocks} blocks "
                    f"(0..{num_blocks - 1})"
                )
            start = len(hashes)
            hashes.extend(got[first:end])
            block_ids.extend(request.block_ids)
            indices.extend(range(first, end))
            origins.extend([r] * (end - first))
            fine.append(prompt)
            spans.append((start, len(hashes)))
        if len(requests) > 1:  # (ids within one request: KVRequest checked them)
            # each engine block's last hash, compared with every naming of it: C loops only, so
            # a step's requests sharing a prefix cost no Python loop
            named = dict(zip(block_ids, hashes))
            repeated = len(named) < len(block_ids)
            if repeated and (loads or list(map(named.__getitem__, block_ids)) != hashes):
                _refuse_shared(requests, hashes, block_ids, indices, origins, loads=loads)
        return cls(tuple(requests), tuple(spans), hashes, block_ids, indices, origins, tuple(fine))

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests)


def _refuse_shared(
    requests: Sequence[KVRequest],
    hashes: list[bytes],
    block_ids: list[int],
    indices: list[int],
    origins: list[int],
    *,
    loads: bool,
) -> NoReturn:
    """Raise RequestError for the first engine block that several requests name (flat block ``j``
    is in engine block ``block_ids[j]``): in a load at all, in a store under different hashes.
    Called once the counts said there is one."""
    first: dict[int, int] = {}  # engine block -> the flat block that named it first
    for j, block_id in enumerate(block_ids):
        k = first.setdefault(block_id, j)
        if k == j:
            continue
        if loads:
            raise RequestError(
                f"block id {block_id} is the destination of two requests of one load; load "
                "each block into one request's blocks only"
            )
        if hashes[k] != hashes[j]:
            raise RequestError(
                f"block id {block_id} is named as block {indices[k]} of {_name(requests, origins[k])} "
                f"and as block {indices[j]} of {_name(requests, origins[j])}, which hold different "
                "KV; an engine block holds one block of one prompt, so name each block id only for "
                "the prompt block it holds (requests sharing a prefix may name its blocks each)"
            )
    raise AssertionError("_refuse_shared was called for a batch it finds nothing wrong with")


def _name(requests: Sequence[KVRequest], r: int) -> str:
    request_id = requests[r].request_id
    return f"request {request_id!r}" if request_id else f"request #{r} of the batch"
