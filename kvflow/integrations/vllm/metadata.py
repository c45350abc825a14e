"""What the scheduler side tells the workers each step, and what workers tell it once at start-up.

vLLM pickles these into every worker (with multiprocessing, across processes), so they hold plain
values only. A step's work is a list of :class:`kvflow.KVRequest` per kind: ``request_id`` is vLLM's
request id, ``block_hashes`` are the request's hashes from block 0 through the last block it names
(vLLM's ``request.block_hashes``, cut there), and ``block_offset`` is the first block it names, which
also decides which TP rank owns (stores) each block.
"""

from __future__ import annotations

from collections.abc import Set

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvflow.layout import KVFormat
from kvflow.request import KVRequest

__all__ = ["KVFlowConnectorMetadata", "KVFlowHandshake", "KVFlowWorkerMeta"]


@attrs.frozen
class KVFlowConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for every worker.

    ``step`` numbers the scheduler's steps (workers echo it back once the step's loads are known
    good or bad: :class:`KVFlowWorkerMeta`). ``loads`` must be in the KV cache before this step's
    forward reads them (the layers of a layerwise load: before each layer reads).
    ``async_loads`` start now and are reported done through ``get_finished`` (their requests are
    not in this step). ``saves`` are read once the forward wrote them, and within the step: when
    the step ends no kvflow transfer reads its blocks any more.
    ``save_tokens``: with KV events on, the tokens of each save's blocks (one entry per save, in
    order), which the workers put in the events of the blocks they stored; else empty.
    ``idle``: the step computes no token (every request it has waits, for instance for its load):
    a worker may wait longer for asynchronous loads in it (``ConnectorConfig.load_idle_wait_s``).
    ``bad_reads``: blocks this step's requests read that hold wrong KV (a failed load's, or
    computed from one, kept in vLLM's prefix cache since): workers report them with the step's
    load errors, so that vLLM recomputes every request reading them from there on.
    ``save_after``: empty, or per save the load steps whose verdict it still waits for: the
    workers store it only if their loads of those steps all arrived, on every rank (one worker
    knows its own; the ranks of a tensor-parallel engine agree first, :mod:`.agreement`), and drop
    it otherwise, as the saves of a step whose own load failed.
    ``load_early``: nothing but ``loads`` writes their blocks between the start of the step on a
    worker and its forward (vLLM zeroes no block and copies none before it in this step): a
    worker may start them when vLLM hands it the step (``handle_preemptions``), so that they run
    while vLLM prepares the step's inputs, and wait for them before the forward as before.
    """

    step: int = 0
    loads: tuple[KVRequest, ...] = ()
    async_loads: tuple[KVRequest, ...] = ()
    saves: tuple[KVRequest, ...] = ()
    save_tokens: tuple[tuple[int, ...], ...] = attrs.field(default=())
    idle: bool = False
    bad_reads: tuple[int, ...] = ()
    save_after: tuple[tuple[int, ...], ...] = attrs.field(default=())
    load_early: bool = False

    @save_tokens.validator
    @save_after.validator
    def _one_per_save(self, attribute: attrs.Attribute[object], value: tuple[tuple[int, ...], ...]) -> None:
        if value and len(value) != len(self.saves):
            raise ValueError(f"{len(value)} entries of {attribute.name} for {len(self.saves)} saves")

    def saves_after(self, failed_steps: Set[int]) -> tuple[tuple[KVRequest, ...], tuple[KVRequest, ...]]:
        """The saves to store, and those to drop: they wait for a step of ``failed_steps`` (one
        whose loads failed on this worker)."""
        if not self.save_after or not failed_steps:
            return self.saves, ()
        waits = [not failed_steps.isdisjoint(after) for after in self.save_after]
        return (
            tuple(s for s, dropped in zip(self.saves, waits) if not dropped),
            tuple(s for s, dropped in zip(self.saves, waits) if dropped),
        )

    def tokens_of(self, span: KVRequest) -> tuple[int, ...] | None:
        """The tokens of a save's blocks (None without KV events)."""
        for save, tokens in zip(self.saves, self.save_tokens):
            if save is span or save == span:
                return tokens
        return None


@attrs.frozen
class KVFlowWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler side with a step's output: the steps whose loads have
    ended on this worker (their failed blocks are in the same output's ``invalid_block_ids``).

    vLLM aggregates the workers' metas of one step; each worker lists a step once, so a step is
    settled on every worker when it was listed as often as there are workers."""

    steps: tuple[int, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVFlowWorkerMeta:
        if not isinstance(other, KVFlowWorkerMeta):
            raise TypeError(f"cannot aggregate KVFlowWorkerMeta with {type(other).__name__}")
        return KVFlowWorkerMeta(self.steps + other.steps)


@attrs.frozen
class KVFlowHandshake(KVConnectorHandshakeMetadata):
    """What each worker tells the scheduler side once, after registering its KV caches.

    The scheduler side has no KV tensors; it takes the layout's :class:`kvflow.KVFormat` (its
    meaning and byte order are part of every key, a layerwise lookup asks for every layer) from
    here, so that its lookups name exactly the keys the workers store.
    """

    format: KVFormat
    tp_rank: int
    pp_rank: int
