"""What the scheduler side tells the workers each step, and what workers tell it once at start-up.

vLLM pickles these into every worker (with multiprocessing, across processes), so they hold plain
values only: request ids, block ids, block hashes.
"""

from __future__ import annotations

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

__all__ = ["BlockSpan", "KVFlowConnectorMetadata", "KVFlowHandshake"]


@attrs.frozen
class BlockSpan:
    """Blocks ``first_block ..`` of request ``req_id`` and the engine blocks that hold them.

    ``block_ids[i]`` holds block ``first_block + i`` of the request. ``block_hashes`` are the
    request's hashes from block 0 through the span's last block (vLLM's ``request.block_hashes``,
    cut there): kvflow's pool takes a request's hashes from its start, and ``first_block`` decides
    which TP rank owns (stores) each block.
    """

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    first_block: int

    def __attrs_post_init__(self) -> None:
        if self.first_block < 0 or self.first_block + len(self.block_ids) != len(self.block_hashes):
            raise ValueError(
                f"request {self.req_id}: blocks {self.first_block}..+{len(self.block_ids)} need "
                f"{self.first_block + len(self.block_ids)} hashes, got {len(self.block_hashes)}"
            )

    @property
    def end_block(self) -> int:
        """One past the span's last block index in the request."""
        return len(self.block_hashes)


@attrs.frozen
class KVFlowConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for every worker.

    ``loads`` must be in the KV cache before this step's forward reads them (the layers of a
    layerwise load: before each layer reads). ``async_loads`` start now and are reported done through
    ``get_finished`` (their requests are not in this step). ``saves`` are read once the forward
    wrote them. ``preempted_req_ids`` lost their blocks this step: workers finish reading them first.
    ``drop_saves``: finished requests whose earlier saves workers stop tracking without reporting
    them finished sending (vLLM frees their blocks when their asynchronous load is reported).
    """

    loads: tuple[BlockSpan, ...] = ()
    async_loads: tuple[BlockSpan, ...] = ()
    saves: tuple[BlockSpan, ...] = ()
    preempted_req_ids: frozenset[str] = frozenset()
    drop_saves: frozenset[str] = frozenset()


@attrs.frozen
class KVFlowHandshake(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler side once, after registering its KV caches.

    The scheduler side has no KV tensors; it takes the layout fingerprint (part of every key), the
    block size and the layer count (a layerwise lookup asks for every layer) from here, so that its
    lookups name exactly the keys the workers store.
    """

    fingerprint: str
    block_size: int
    num_layers: int
    tp_rank: int
    pp_rank: int
