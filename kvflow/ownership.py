"""Replica groups and the pure owner function.

TP ranks whose KV is byte-identical form a replica group:

- MLA: every TP rank with the same DCP rank holds the same latent KV;
- GQA/MHA with ``num_kv_heads < tp_size``: the ``tp_size // num_kv_heads`` consecutive ranks that
  share one KV-head slice (split again by DCP rank);
- otherwise each rank holds KV of its own heads and stands alone.

Block ``i`` of a request is stored by exactly one member of each group, chosen from ``i`` and the
parallel layout alone (never from what a store answered at some moment), so every member makes the
same choice. Every member still loads every block, from the group's shared keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvflow.config import nonnegative_int, positive_int
from kvflow.errors import ConfigError

__all__ = ["ParallelConfig", "owned", "owner"]


def _layers(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"pp_layers must be a sequence of layer counts, one per stage, got {value!r}")
    counts = tuple(value)
    if not counts or any(type(c) is not int or c < 1 for c in counts):
        raise ConfigError(f"pp_layers must be layer counts > 0, one per stage, got {value!r}")
    return counts


@attrs.frozen
class ParallelConfig:
    """How a model is split across ranks, as the engine configured it.

    ``num_kv_heads`` is the model's total number of KV heads (ignored for MLA; needed when
    ``tp_size > 1``, otherwise the KV cache's own heads). Ranks are 0-based. ``dcp_rank`` is
    ``tp_rank % dcp_size``, as in vLLM. ``pp_layers``: the layers of each pipeline stage, in stage
    order, when they differ between stages (default: every stage has as many layers as this one).
    """

    tp_rank: int = attrs.field(default=0, validator=nonnegative_int)
    tp_size: int = attrs.field(default=1, validator=positive_int)
    num_kv_heads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
    use_mla: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    dcp_size: int = attrs.field(default=1, validator=positive_int)
    pp_rank: int = attrs.field(default=0, validator=nonnegative_int)
    pp_size: int = attrs.field(default=1, validator=positive_int)
    pcp_rank: int = attrs.field(default=0, validator=nonnegative_int)
    pcp_size: int = attrs.field(default=1, validator=positive_int)
    pp_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layers)

    def __attrs_post_init__(self) -> None:
        for rank, size, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.pp_rank, self.pp_size, "pp"),
            (self.pcp_rank, self.pcp_size, "pcp"),
        ):
            if not 0 <= rank < size:
                raise ConfigError(f"{what}_rank must be in [0, {what}_size={size}), got {rank}")
        if self.tp_size % self.dcp_size:
            raise ConfigError(
                f"dcp_size={self.dcp_size} must divide tp_size={self.tp_size} "
                "(decode context parallelism splits the TP group)"
            )
        if self.pp_layers is not None and len(self.pp_layers) != self.pp_size:
            raise ConfigError(
                f"pp_layers={self.pp_layers} must list the layers of each of the "
                f"pp_size={self.pp_size} stages"
            )
        if self.use_mla:
            return
        heads, tp = self.num_kv_heads, self.tp_size
        if heads is None:
            if tp > 1:
                raise ConfigError(
                    f"tp_size={tp}: give num_kv_heads (the model's total KV heads), or use_mla=True "
                    "for an MLA model, so that kvflow knows which ranks hold the same KV"
                )
            return  # tp_size 1, so dcp_size 1 (it divides tp_size, checked above)
        if heads >= tp:
            if heads % tp:
                raise ConfigError(
                    f"num_kv_heads={heads} must be divisible by tp_size={tp} "
                    "so that each rank holds a whole number of KV heads"
                )
            if self.dcp_size != 1:
                raise ConfigError(
                    f"dcp_size={self.dcp_size} needs KV heads replicated across TP ranks "
                    f"(num_kv_heads < tp_size), but num_kv_heads={heads}, tp_size={tp}"
                )
        else:
            if tp % heads:
                raise ConfigError(
                    f"tp_size={tp} must be divisible by num_kv_heads={heads} "
                    "so that KV heads replicate evenly across ranks"
                )
            if (tp // heads) % self.dcp_size:
                raise ConfigError(
                    f"dcp_size={self.dcp_size} must divide the KV replication factor "
                    f"tp_size // num_kv_heads = {tp // heads}"
                )

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    @property
    def replication(self) -> int:
        """How many consecutive TP ranks share one KV-head slice (all of them for MLA)."""
        if self.use_mla:
            return self.tp_size
        if self.num_kv_heads is None:
            return 1
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def replica_group_size(self) -> int:
        """How many ranks hold byte-identical KV with this one (vllm-ascend's ``put_step``)."""
        return self.replication // self.dcp_size

    @property
    def kv_head_group(self) -> int:
        """Which slice of the model's KV heads this rank holds, counted in slices of
        ``num_kv_heads // num_kv_head_groups`` heads (vllm-ascend's ``head_or_tp_rank``; 0 for MLA)."""
        return self.tp_rank // self.replication

    @property
    def num_kv_head_groups(self) -> int:
        """How many distinct KV-head slices the TP group holds (1 for MLA)."""
        return self.tp_size // self.replication

    @property
    def group_base(self) -> int:
        """The lowest TP rank of this rank's replica group."""
        return self.kv_head_group * self.replication + self.dcp_rank

    def stage_layers(self, pp_rank: int, num_layers: int) -> tuple[int, int]:
        """The model layers ``(first, end)`` of pipeline stage ``pp_rank``: from ``pp_layers``, or
        ``num_layers`` (this stage's count) per stage when stages are not listed."""
        if self.pp_layers is None:
            return pp_rank * num_layers, (pp_rank + 1) * num_layers
        first = sum(self.pp_layers[:pp_rank])
        return first, first + self.pp_layers[pp_rank]

    def replica_group(self) -> tuple[int, ...]:
        """The TP ranks holding the same KV as this one, lowest first (includes this rank)."""
        return tuple(self.group_base + j * self.dcp_size for j in range(self.replica_group_size))


def owner(block_index: int, parallel: ParallelConfig) -> int:
    """The TP rank, within ``parallel.tp_rank``'s replica group, that stores block ``block_index``.

    Pure: depends on its arguments only. Over any ``replica_group_size`` consecutive blocks each
    member of the group owns exactly one.
    """
    if block_index < 0:
        raise ConfigError(f"block_index must be >= 0, got {block_index}")
    return parallel.group_base + (block_index % parallel.replica_group_size) * parallel.dcp_size


def owned(block_indices: Sequence[int], parallel: ParallelConfig) -> list[int]:
    """Positions ``j`` of ``block_indices`` whose block ``parallel.tp_rank`` stores: the same answer
    as ``owner(block_indices[j], parallel) == parallel.tp_rank``, for a whole request at once."""
    size = parallel.replica_group_size
    if size == 1:
        return list(range(len(block_indices)))
    mine = (parallel.tp_rank - parallel.group_base) // parallel.dcp_size
    return [j for j, i in enumerate(block_indices) if i % size == mine]
