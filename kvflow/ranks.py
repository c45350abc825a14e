"""An engine's ranks agreeing on which of its steps failed on any of them: one collective.

A rank's KV depends on every rank's inputs (tensor parallelism all-reduces attention outputs), so a
load that failed on one rank makes what every rank computed from it wrong. Before the ranks store
what rests on some steps' loads, each says which of those steps failed on it, and all learn which
failed on any (:mod:`kvflow.integrations.vllm.agreement` calls it at the end of a vLLM step).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

import torch

__all__ = ["failed_on_any"]


def failed_on_any(steps: Sequence[int], failed_here: Set[int], group: Any) -> frozenset[int]:
    """The steps of ``steps`` that failed on some rank of ``group`` (a ``torch.distributed`` process
    group over the host: gloo), given those that failed on this one: one all-reduce (max) of a flag
    per step. A collective: every rank of the group calls it with the same ``steps``, or the group
    stalls until its own timeout."""
    flags = torch.tensor([step in failed_here for step in steps], dtype=torch.int32)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    return frozenset(step for step, failed in zip(steps, flags.tolist()) if failed)
