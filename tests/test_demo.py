"""The demo's verification is real: corrupted or missing data makes it fail."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kvflow.backends import GetStatus, ObjectRef
from kvflow.regions import scatter
from kvflow.tools.demo import run_demo
from kvflow.tools.workload import Geometry
from tests.helpers import FaultyBackend

SMALL = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)


@attrs.define
class CorruptingBackend(FaultyBackend):
    """Returns hits whose bytes were altered after the copy."""

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        results = await self.inner.get(objects)
        for obj, status in zip(objects, results):
            if status is GetStatus.HIT:
                ones = torch.ones(obj.sizes[0], dtype=torch.uint8)
                scatter(ones.data_ptr(), obj.addrs[:1], obj.sizes[:1])
        return results


async def test_demo_verifies_on_a_healthy_backend() -> None:
    summary = await run_demo(geometry=SMALL, progress=False)
    assert summary.verified and summary.blocks_verified == summary.blocks_retrieved > 0


async def test_demo_fails_verification_on_corrupted_data() -> None:
    summary = await run_demo(geometry=SMALL, progress=False, backend=CorruptingBackend())  # type: ignore[arg-type]
    assert not summary.verified
    assert summary.blocks_mismatched == summary.blocks_retrieved > 0


async def test_demo_fails_verification_when_gets_fail() -> None:
    summary = await run_demo(geometry=SMALL, progress=False, backend=FaultyBackend(raise_on={"get"}))  # type: ignore[arg-type]
    assert not summary.verified
