"""A batch of requests, validated and flattened into blocks, before anything moves."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvflow.errors import RequestError
from kvflow.keys import hash_blocks
from kvflow.layout import KVFormat
from kvflow.request import KVRequest

__all__ = ["BlockPlan", "request_hashes"]


def request_hashes(request: KVRequest, block_size: int) -> list[bytes]:
    """The prompt's block hashes: the given ones as they are, or computed from its tokens.

    When both are given they must agree in count (one hash per full block of tokens).
    """
    tokens, hashes = request.tokens, request.block_hashes
    if hashes is None:
        assert tokens is not None  # KVRequest requires one of them
        return hash_blocks(tokens, block_size)
    if tokens is not None and len(tokens) // block_size != len(hashes):
        raise RequestError(
            f"{len(hashes)} block hashes but {len(tokens)} tokens make "
            f"{len(tokens) // block_size} full blocks of {block_size}"
        )
    return list(hashes)


@attrs.frozen(eq=False)
class BlockPlan:
    """Requests flattened into blocks: flat block ``j`` is block ``indices[j]`` of its request, has
    hash ``hashes[j]`` and lives in engine block ``block_ids[j]``; request ``r`` spans ``spans[r]``."""

    requests: tuple[KVRequest, ...]
    spans: tuple[tuple[int, int], ...]
    hashes: list[bytes]
    block_ids: list[int]
    indices: list[int]

    @classmethod
    def build(cls, requests: Sequence[KVRequest], fmt: KVFormat, num_blocks: int) -> BlockPlan:
        """Check every request against the cache (``num_blocks``) and the pool's block size.

        Raises RequestError before anything moves. Pure; safe from any thread.
        """
        spans: list[tuple[int, int]] = []
        hashes: list[bytes] = []
        block_ids: list[int] = []
        indices: list[int] = []
        seen: set[str] = set()
        for request in requests:
            if not isinstance(request, KVRequest):
                raise RequestError(f"expected a kvflow.KVRequest, got {type(request).__name__}")
            if request.request_id:
                if request.request_id in seen:
                    raise RequestError(
                        f"request {request.request_id!r} appears twice in one batch; pass it once"
                    )
                seen.add(request.request_id)
            got = request_hashes(request, fmt.block_size)
            first, end = request.block_offset, request.end_block
            if end > len(got):
                raise RequestError(
                    f"blocks {first}..{end - 1} of the prompt requested, but it has {len(got)} full "
                    f"blocks of {fmt.block_size} tokens"
                )
            for block_id in request.block_ids:
                if block_id >= num_blocks:
                    raise RequestError(
                        f"block id {block_id} is out of range: the KV cache has {num_blocks} blocks "
                        f"(0..{num_blocks - 1})"
                    )
            start = len(hashes)
            hashes.extend(got[first:end])
            block_ids.extend(request.block_ids)
            indices.extend(range(first, end))
            spans.append((start, len(hashes)))
        return cls(tuple(requests), tuple(spans), hashes, block_ids, indices)

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests)
