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

import attrs

from kvflow.config import nonnegative_int, positive_int
from kvflow.errors import ConfigError

__all__ = ["ParallelConfig", "owner"]


@attrs.frozen
class ParallelConfig:
    """How a model is split across ranks, as the engine configured it.

    ``num_kv_heads`` is the model's total number of KV heads (ignored for MLA). Ranks are 0-based.
    ``dcp_rank`` is ``tp_rank % dcp_size``, as in vLLM.
    """

    tp_rank: int = attrs.field(default=0, validator=nonnegative_int)
    tp_size: int = attrs.field(default=1, validator=positive_int)
    num_kv_heads: int = attrs.field(default=1, validator=positive_int)
    use_mla: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    dcp_size: int = attrs.field(default=1, validator=positive_int)
    pp_rank: int = attrs.field(default=0, validator=nonnegative_int)
    pp_size: int = attrs.field(default=1, validator=positive_int)
    pcp_rank: int = attrs.field(default=0, validator=nonnegative_int)
    pcp_size: int = attrs.field(default=1, validator=positive_int)

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
        if self.use_mla:
            return
        heads, tp = self.num_kv_heads, self.tp_size
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
