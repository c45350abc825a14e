"""The demo's verification is real: corrupted or missing data makes it fail."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from kvflow.backends import GetStatus, ObjectRef
from kvflow.backends.arena import ArenaBackend
from kvflow.profiles import is_book_key
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


async def test_demo_leaves_a_store_as_it_found_it_unless_kept(tmp_path: Path) -> None:
    """Without ``keep`` the demo removes the blocks it stored (its profile announcement stays: other
    engines of the model may share it); with ``keep`` the blocks stay too, and a later run finds
    them and leaves them."""
    url = f"arena://{tmp_path}/store?capacity=16MiB&slot=64KiB"

    async def held() -> list[str | None]:
        store = ArenaBackend.attach(url)
        try:
            return sorted(key or "" for key, _ in await store.list_objects())
        finally:
            await store.aclose()

    await run_demo(url, geometry=SMALL, progress=False)
    [announcement] = await held()
    assert is_book_key(announcement or "")
    await run_demo(url, geometry=SMALL, progress=False, keep=True)
    kept = await held()
    assert any(is_book_key(key or "") for key in kept) and len(kept) > 1
    again = await run_demo(url, geometry=SMALL, progress=False)
    assert again.blocks_found > 0
    assert await held() == kept  # (what it found stays; it stored nothing)


async def test_demo_fails_verification_on_corrupted_data() -> None:
    summary = await run_demo(geometry=SMALL, progress=False, backend=CorruptingBackend())  # type: ignore[arg-type]
    assert not summary.verified
    assert summary.blocks_mismatched == summary.blocks_retrieved > 0


async def test_demo_fails_verification_when_gets_fail() -> None:
    summary = await run_demo(geometry=SMALL, progress=False, backend=FaultyBackend(raise_on={"get"}))  # type: ignore[arg-type]
    assert not summary.verified
