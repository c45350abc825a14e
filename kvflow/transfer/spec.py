"""What a pool will be, checked before any backend is opened or touched.

:meth:`TransferSpec.of` checks a pool's configuration against its KV caches (or, for a pool that
only looks up, their :class:`~kvflow.layout.KVFormat`) and derives what follows from them: the
format, the :class:`~kvflow.profiles.Profile` it announces, the size of its largest object. Only
what depends on the backend (can it reach the caches' memory, how large an object may be) is left
to :meth:`kvflow.transfer.Transfer.open`. So a pool that opens its own backend from its config's
URL refuses a bad configuration before it opens one (nothing to close afterwards).
"""

from __future__ import annotations

import attrs

from kvflow.config import PoolConfig
from kvflow.errors import ConfigError
from kvflow.layout import KVFormat, KVLayout
from kvflow.ownership import ParallelConfig
from kvflow.profiles import Profile

__all__ = ["TransferSpec"]


@attrs.frozen
class TransferSpec:
    """A pool's configuration, checked against its KV caches. Pure; safe from any thread."""

    config: PoolConfig
    parallel: ParallelConfig
    format: KVFormat
    #: the registered KV caches (None for a pool that only looks up)
    layout: KVLayout | None
    #: how this engine splits the model into objects
    profile: Profile
    #: the bytes of the pool's largest object (a block, or a block's layer); 0 without a layout
    largest: int

    @classmethod
    def of(
        cls,
        config: PoolConfig,
        *,
        parallel: ParallelConfig,
        layout: KVLayout | None = None,
        format: KVFormat | None = None,
    ) -> TransferSpec:
        """Check ``config`` and ``parallel`` against ``layout`` (to store and retrieve) or
        ``format`` (to look up only); ConfigError saying what to change."""
        if layout is None:
            if format is None:
                raise ConfigError(
                    "a pool needs the KV caches' layout (to store and retrieve) or their KVFormat "
                    "(to look up only, as an engine's scheduler does)"
                )
            mine = format
        else:
            mine = layout.format(_total_kv_heads(layout, parallel))
            if format is not None and format != mine:
                raise ConfigError(f"format {format} disagrees with the layout's {mine}; pass one")
            stage = parallel.pp_layers[parallel.pp_rank] if parallel.pp_layers is not None else None
            if stage is not None and stage != layout.num_layers:
                raise ConfigError(
                    f"pp_layers={parallel.pp_layers} gives stage {parallel.pp_rank} {stage} layers, "
                    f"but its KV caches have {layout.num_layers}"
                )
        return cls(config, parallel, mine, layout, _profile(config, parallel, mine), _largest(config, layout))


def _profile(config: PoolConfig, parallel: ParallelConfig, format: KVFormat) -> Profile:
    hash_tokens = config.hash_tokens or format.block_size
    if format.block_size % hash_tokens:
        raise ConfigError(
            f"hash_tokens={hash_tokens} must divide the block size {format.block_size} "
            "(a block's key is the prompt's hash at the block's last token)"
        )
    stages = [parallel.stage_layers(s, format.num_layers) for s in range(parallel.pp_size)]
    ranges = [(n, n + 1) for a, b in stages for n in range(a, b)] if config.layerwise else stages
    profile = Profile(
        model=config.model,
        meaning=format.meaning,
        order=format.order,
        block_size=format.block_size,
        hash_tokens=hash_tokens,
        layer_ranges=tuple(ranges),
        head_groups=parallel.num_kv_head_groups,
        dcp_size=parallel.dcp_size,
        pcp_size=parallel.pcp_size,
    )
    if profile.num_kv_heads % parallel.num_kv_head_groups:
        raise ConfigError(
            f"the KV format says {profile.num_kv_heads} KV heads, which do not split over "
            f"{parallel.num_kv_head_groups} KV-head groups of {parallel}"
        )
    return profile


def _largest(config: PoolConfig, layout: KVLayout | None) -> int:
    """The bytes of the largest object: a block of every layer, or (layerwise) of one layer."""
    if layout is None:
        return 0
    units: list[int | None] = list(range(layout.num_layers)) if config.layerwise else [None]
    return max(sum(layout.plane_views[p].size(1) for p in layout.unit_planes(u)) for u in units)


def _total_kv_heads(layout: KVLayout, parallel: ParallelConfig) -> int:
    """The model's KV heads, checked against the heads the cache holds on this rank."""
    if layout.mla:
        if not parallel.use_mla and parallel.tp_size > 1:
            raise ConfigError(
                f"the KV caches are {layout.kind.value} (MLA) but ParallelConfig(use_mla=False): "
                "set use_mla=True so that every TP rank shares one copy"
            )
        return 1
    if parallel.use_mla:
        raise ConfigError(f"ParallelConfig(use_mla=True) but the KV caches are {layout.kind.value}, not MLA")
    total = parallel.num_kv_heads
    if total is None:
        return layout.heads
    expected = max(1, total // parallel.tp_size)
    if layout.heads != expected:
        raise ConfigError(
            f"num_kv_heads={total} over tp_size={parallel.tp_size} puts {expected} KV heads on each "
            f"rank, but the KV caches hold {layout.heads}; give the model's total KV heads"
        )
    return total
