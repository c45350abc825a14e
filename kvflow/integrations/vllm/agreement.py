"""Tensor-parallel ranks agreeing on which load steps failed on any of them, before a save.

A rank's KV depends on every rank's inputs (attention outputs are all-reduced), so a block computed
from a load that failed on one rank is wrong on all of them. A save the scheduler planned at once
after a load (``save_after`` in the step's metadata, :mod:`.scheduler`) is stored only if that load
arrived whole on every rank: each rank says which of the steps its saves wait for failed on it, and
all of them drop the saves that wait for a step some rank failed. One all-reduce (max) of a flag per
step over the tensor-parallel group's host (gloo) group, at the end of a step with such saves only.

Every rank of the group makes the call for the same steps, in the same step: the metadata the
scheduler sends them is one object, and the call depends on it and on the configuration alone. A
rank whose forward raised does not call it (it stores nothing of that step: its blocks may hold KV
half written); the others, waiting there or in the forward's own collectives, stall until the
group's timeout, as at any of vLLM's collectives, while the engine fails the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING

from kvflow.ranks import failed_on_any

if TYPE_CHECKING:
    from kvflow.integrations.vllm.topology import EngineShape

__all__ = ["FailedSteps", "plans_saves_after_loads", "ranks_must_agree", "tensor_parallel_agreement"]

#: ``(steps, failed_here) -> those of steps that failed on some rank``.
FailedSteps = Callable[[Sequence[int], Set[int]], frozenset[int]]


def plans_saves_after_loads(shape: EngineShape, layerwise: bool) -> bool:
    """Whether the workers of an engine of this shape learn, when a step's saves run, whether the
    loads those saves rest on arrived on every rank, so the scheduler may plan them at once: one
    worker knows its own loads; the ranks of a tensor-parallel engine of one pipeline stage agree
    through :func:`kvflow.ranks.failed_on_any`. Not across pipeline stages (they end a step at
    different times: a collective there would stall the pipeline), nor layer by layer (a layerwise
    step stores each layer during the forward, before the loads of the layers after it ended)."""
    return shape.pp_size == 1 and (shape.tp_size == 1 or not layerwise)


def ranks_must_agree(shape: EngineShape, layerwise: bool) -> bool:
    """Whether the workers of such an engine must agree on failed loads before they store: several
    ranks whose scheduler plans saves resting on loads not yet settled."""
    return shape.tp_size > 1 and plans_saves_after_loads(shape, layerwise)


def tensor_parallel_agreement() -> FailedSteps:
    """:func:`kvflow.ranks.failed_on_any` over vLLM's tensor-parallel group of this worker (call
    from a worker, after vLLM set up its groups)."""
    from vllm.distributed.parallel_state import get_tp_group

    def agree(steps: Sequence[int], failed_here: Set[int]) -> frozenset[int]:
        # The group of now: vLLM may build its groups again (elastic expert parallelism).
        return failed_on_any(steps, failed_here, get_tp_group().cpu_group)

    return agree
