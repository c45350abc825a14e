"""A synthetic engine for the demo and the benchmark: KV caches of a model geometry, requests that
share prefixes, and KV contents derived from block hashes (identical prefixes give identical KV,
as a real model's would)."""

from __future__ import annotations

import importlib
import random

import attrs
import torch

from kvflow.errors import ConfigError, MissingDependencyError
from kvflow.keys import hash_blocks

__all__ = [
    "Geometry",
    "chat_workload",
    "check_device",
    "expected_block",
    "fill_block",
    "make_kv_caches",
]


@attrs.frozen
class Geometry:
    """A model's KV geometry as vLLM's CPU backend lays it out: ``[N, H, block_size, 2*D]`` per layer."""

    num_layers: int = 8
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def block_nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * self.block_size * 2 * self.head_dim * itemsize


def check_device(device: str) -> None:
    """Refuse, before anything runs, a device the tools cannot put KV caches on: ConfigError for a
    name that is not ``cpu``, ``cuda[:N]`` or ``npu[:N]`` or a device this machine does not have,
    MissingDependencyError for ``npu`` without ``torch_npu``."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda", "npu"):
        raise ConfigError(f"--device {device!r}: the KV caches live on cpu, cuda[:N] or npu[:N]")
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")  # registers the "npu" device type with torch
        except ImportError:
            raise MissingDependencyError(
                "torch_npu", f"--device {device}", "pip install 'kvflow[npu]' (Ascend's torch_npu)"
            ) from None
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device name: use cpu, cuda[:N] or npu[:N]") from None
    if parsed.type == "cpu":
        return
    module = torch.cuda if parsed.type == "cuda" else torch.npu  # type: ignore[attr-defined]
    count = module.device_count() if module.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"--device {device}: this machine's torch sees no {parsed.type} device (a CPU-only build, "
            "or none visible): use --device cpu"
        )
    if parsed.index is not None and parsed.index >= count:
        raise ConfigError(f"--device {device}: there are {count} {parsed.type} device(s), 0 to {count - 1}")


def make_kv_caches(geometry: Geometry, num_blocks: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed KV caches, one view per layer into one allocation (as vLLM CPU allocates them)."""
    g = geometry
    shape = (g.num_layers, num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)
    whole = torch.zeros(shape, dtype=g.dtype, device=device)
    return {f"model.layers.{i}.self_attn": whole[i] for i in range(g.num_layers)}


def expected_block(geometry: Geometry, block_hash: bytes, layer: int) -> torch.Tensor:
    """The KV a block of ``block_hash`` holds in ``layer``: random bits seeded by the hash."""
    g = geometry
    gen = torch.Generator().manual_seed(int.from_bytes(block_hash[:6], "little") * 1024 + layer)
    shape = (g.num_kv_heads, g.block_size, 2 * g.head_dim)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    return bits.view(g.dtype) if g.dtype.itemsize == 2 else bits.to(g.dtype)


def fill_block(
    kv_caches: dict[str, torch.Tensor], geometry: Geometry, block_id: int, block_hash: bytes
) -> None:
    """ "Compute" a block: write its expected KV into every layer."""
    for layer, cache in enumerate(kv_caches.values()):
        cache[block_id].copy_(expected_block(geometry, block_hash, layer).to(cache.device))


def block_matches(
    kv_caches: dict[str, torch.Tensor], geometry: Geometry, block_id: int, block_hash: bytes
) -> bool:
    """Bit-exact comparison (random bits include NaN patterns, so compare the raw bytes)."""
    return all(
        torch.equal(
            cache[block_id].cpu().contiguous().view(torch.uint8),
            expected_block(geometry, block_hash, layer).contiguous().view(torch.uint8),
        )
        for layer, cache in enumerate(kv_caches.values())
    )


def chat_workload(
    block_size: int, *, sessions: int = 6, turns: int = 4, documents: int = 3, seed: int = 0
) -> list[list[int]]:
    """Requests that share prefixes: a system prompt shared by all, multi-turn chats whose every turn
    extends the previous one, and questions about a few shared documents."""
    rng = random.Random(seed)

    def text(blocks: float) -> list[int]:
        return [rng.randrange(32000) for _ in range(int(blocks * block_size))]

    system = text(4)
    requests: list[list[int]] = []
    for _ in range(sessions):
        history = system + text(2.5)
        for _ in range(turns):
            history = history + text(3.25)
            requests.append(list(history))
    docs = [system + text(24) for _ in range(documents)]
    for i in range(documents * 3):
        requests.append(docs[i % documents] + text(1.5))
    return requests


def request_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    return hash_blocks(tokens, block_size)
