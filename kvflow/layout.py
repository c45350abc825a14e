"""Planes, regions, meaning and byte order of registered KV caches.

An engine registers one entry per layer: a tensor or a tuple of tensors. kvflow derives, from shapes
and strides, each layer's *planes* (K and V, a fused [K|V] block, MLA nope and rope): views whose
first dimension indexes blocks and whose per-block slice is one dense span of memory. Block ``b`` of
a plane is then the region ``(base + b * block_stride, block_nbytes)``. A block of the whole cache is
the list of its regions over every layer and plane, in registration order.

Supported (``N`` blocks, ``B`` tokens per block, ``H`` KV heads, ``D`` head size):

=============  ============================================  ==========================
kind           per layer                                     planes
=============  ============================================  ==========================
vllm_cpu       one tensor ``[N, H, B, 2*D]``                 the whole block
flash_attn     one tensor ``[2, N, B, H, D]``                K, V
flashinfer     one tensor ``[N, 2, B, H, D]``                the whole block
kv_tuple       tuple ``(k, v)``, each ``[N, B, H, D]``       K, V
mla            one tensor ``[N, B, D]``                      the latent block
mla_tuple      tuple ``(nope, rope)``, ``[N, B, (1,) D_x]``  nope, rope
=============  ============================================  ==========================
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvflow.errors import LayoutError

__all__ = ["KVCacheEntry", "KVFormat", "KVLayout", "LayerLayout", "LayoutKind", "Plane"]

KVCacheEntry = torch.Tensor | Sequence[torch.Tensor]

SUPPORTED = (
    "vllm_cpu [num_blocks, H, block_size, 2*D]; flash_attn [2, num_blocks, block_size, H, D]; "
    "flashinfer [num_blocks, 2, block_size, H, D]; kv_tuple (k, v) each [num_blocks, block_size, H, D]; "
    "mla [num_blocks, block_size, D]; mla_tuple (nope, rope) each [num_blocks, block_size, (1,) D_x]"
)


class LayoutKind(enum.Enum):
    VLLM_CPU = "vllm_cpu"
    FLASH_ATTN = "flash_attn"
    FLASHINFER = "flashinfer"
    KV_TUPLE = "kv_tuple"
    MLA = "mla"
    MLA_TUPLE = "mla_tuple"


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{attribute.name} must be a positive integer, got {value!r}")


_KEY_TEXT = re.compile(r"^[A-Za-z0-9_.+\-]+$")


def _key_text(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _KEY_TEXT.match(value):
        raise LayoutError(f"{attribute.name} must be non-empty text of [A-Za-z0-9_.+-], got {value!r}")


@attrs.frozen
class KVFormat:
    """The facts about a KV cache that every pool over it must agree on, as one value.

    ``block_size`` tokens per block, ``num_layers`` layers (of this pipeline stage), ``meaning``:
    what the bytes mean (dtype, the model's KV heads and head size, or MLA's latent widths) and
    ``order``: how a block's bytes lie (layout kind, each plane's dimension order). Both are part
    of every key. A worker's pool derives them from its :class:`KVLayout` and parallel layout
    (:meth:`KVLayout.format`, ``pool.format``); a pool that only looks up (an engine's scheduler)
    is given them, e.g. in vLLM's handshake.
    """

    block_size: int = attrs.field(validator=_positive_int)
    num_layers: int = attrs.field(validator=_positive_int)
    meaning: str = attrs.field(validator=_key_text)
    order: str = attrs.field(validator=_key_text)


@attrs.frozen
class Plane:
    """One block-indexed memory plane of a layer."""

    base: int
    block_stride: int
    block_nbytes: int
    order: str  # the per-block dimension order in memory (part of every key: KVLayout.order)


@attrs.frozen
class LayerLayout:
    name: str
    planes: tuple[Plane, ...]

    @property
    def block_nbytes(self) -> int:
        return sum(p.block_nbytes for p in self.planes)


def _dense_order(plane: torch.Tensor, name: str) -> str:
    """Check that each block slice of ``plane`` (dims 1..) is one dense span; return its dim order."""
    dims = [(plane.stride(d), plane.size(d), d) for d in range(1, plane.dim()) if plane.size(d) > 1]
    expected = 1
    for stride, size, _ in sorted(dims):
        if stride != expected:
            raise LayoutError(
                f"layer {name!r}: a block of shape {tuple(plane.shape[1:])} with strides "
                f"{tuple(plane.stride()[1:])} is not one dense span of memory; make the KV cache "
                "contiguous within a block"
            )
        expected *= size
    return "".join(str(d) for _, _, d in sorted(dims, reverse=True))


def _plane(view: torch.Tensor, name: str) -> Plane:
    itemsize = view.element_size()
    order = _dense_order(view, name)
    block_nbytes = view[0].numel() * itemsize
    stride = view.stride(0) * itemsize
    if view.size(0) > 1 and stride < block_nbytes:
        raise LayoutError(f"layer {name!r}: blocks overlap (block stride {stride} < {block_nbytes} B)")
    return Plane(view.data_ptr(), stride, block_nbytes, order)


def _bytes_view(view: torch.Tensor, plane: Plane) -> torch.Tensor:
    """``view``'s plane as ``uint8 [num_blocks, block_nbytes]`` over the same memory."""
    storage = view.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=view.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    offset = plane.base - storage.data_ptr()
    return whole.as_strided((view.size(0), plane.block_nbytes), (plane.block_stride, 1), offset)


def _describe(entry: object) -> str:
    if isinstance(entry, torch.Tensor):
        return f"tensor{list(entry.shape)}"
    if isinstance(entry, (tuple, list)):
        return "(" + ", ".join(_describe(part) for part in entry) + ")"
    return f"a {type(entry).__name__}"


def _classify(name: str, entry: KVCacheEntry) -> tuple[LayoutKind, list[torch.Tensor], int]:
    """The layout kind, the plane views and the block size of one registered layer."""
    if isinstance(entry, torch.Tensor):
        shape = tuple(entry.shape)
        if entry.dim() == 4:
            if shape[3] % 2:
                raise LayoutError(
                    f"layer {name!r}: a vLLM CPU cache {list(shape)} holds K and V of one head size "
                    f"side by side in its last dimension, so it must be even, not {shape[3]}"
                )
            return LayoutKind.VLLM_CPU, [entry], shape[2]
        if entry.dim() == 5 and shape[0] == 2 and shape[1] != 2:
            return LayoutKind.FLASH_ATTN, [entry[0], entry[1]], shape[2]
        if entry.dim() == 5 and shape[1] == 2 and shape[0] != 2:
            return LayoutKind.FLASHINFER, [entry], shape[2]
        if entry.dim() == 3:
            return LayoutKind.MLA, [entry], shape[1]
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        first, second = entry
        if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
            a, b = tuple(first.shape), tuple(second.shape)
            if first.dim() == 4 and a == b and first.dtype == second.dtype:
                return LayoutKind.KV_TUPLE, [first, second], a[1]
            if (
                first.dim() == second.dim()
                and first.dim() in (3, 4)
                and a[:-1] == b[:-1]
                and a[-1] != b[-1]
                and (first.dim() == 3 or a[2] == 1)
            ):
                if first.dim() == 3:  # [N, B, D] holds a block as [N, B, 1, D] does: one order, one key
                    first, second = first.unsqueeze(2), second.unsqueeze(2)
                return LayoutKind.MLA_TUPLE, [first, second], a[1]
    raise LayoutError(f"layer {name!r}: unsupported KV cache {_describe(entry)}; supported: {SUPPORTED}")


def _geometry(kind: LayoutKind, view: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """The KV heads a plane holds and its part widths (head size, or MLA's latent widths)."""
    shape = tuple(view.shape)
    if kind is LayoutKind.VLLM_CPU:  # [N, H, B, 2*D]
        return shape[1], (shape[3] // 2,)
    if kind is LayoutKind.FLASHINFER:  # [N, 2, B, H, D]
        return shape[3], (shape[4],)
    if kind in (LayoutKind.FLASH_ATTN, LayoutKind.KV_TUPLE):  # [N, B, H, D]
        return shape[2], (shape[3],)
    return 1, (shape[-1],)  # MLA: [N, B, (1,) D]


def _meaning_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen(eq=False)
class KVLayout:
    """Where every block of every layer lives. Built once with :meth:`from_kv_caches`.

    Keeps a reference to the registered tensors so that the addresses stay valid while it lives.
    ``heads`` is the KV heads each layer holds here (1 for MLA) and ``widths`` the last dimension
    of each part: ``(head_size,)`` for K and V, ``(latent,)`` for MLA, ``(nope, rope)`` for MLA
    tuples.
    """

    kind: LayoutKind
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    device: torch.device
    heads: int
    widths: tuple[int, ...]
    layers: tuple[LayerLayout, ...]
    tensors: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    #: every plane as a ``uint8`` tensor ``[num_blocks, block_nbytes]`` over the cache's memory, in
    #: the order of :meth:`block_addrs` (layer by layer): the staging path copies these
    plane_views: tuple[torch.Tensor, ...] = attrs.field(repr=False)
    #: each layer's planes as registered (typed, ``[num_blocks, ...]``): transforms read these
    typed_views: tuple[tuple[torch.Tensor, ...], ...] = attrs.field(repr=False)
    _bases: list[int] = attrs.field(repr=False)
    _strides: list[int] = attrs.field(repr=False)
    _sizes: list[int] = attrs.field(repr=False)
    #: :meth:`addr_rows`'s bases and strides of each unit (every layer: None), made at its first use
    _columns: dict[int | None, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = attrs.field(
        factory=dict, init=False, repr=False
    )

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, KVCacheEntry], block_size: int | None = None) -> KVLayout:
        """Describe registered KV caches: ``{layer name: tensor or tuple of tensors}``, in layer order.

        ``block_size`` (tokens per block), when given, is checked against the shapes. Every layer
        must share one kind, block size, block count, dtype, device and per-block geometry.
        """
        if not isinstance(kv_caches, Mapping):  # (a tensor's truth value, a list's items: unclear)
            raise LayoutError(
                f"kv_caches must be a mapping of layer name to tensor (vLLM's registered caches), got "
                f"{type(kv_caches).__name__}; name a list's layers: {{f'layer.{{i}}': t for i, t in "
                "enumerate(caches)}"
            )
        if not kv_caches:
            raise LayoutError("no KV caches given; register at least one layer")
        kinds: set[LayoutKind] = set()
        layers: list[LayerLayout] = []
        tensors: list[torch.Tensor] = []
        views_u8: list[torch.Tensor] = []
        typed: list[tuple[torch.Tensor, ...]] = []
        sizes: set[int] = set()
        num_blocks: set[int] = set()
        dtypes: set[torch.dtype] = set()
        devices: set[torch.device] = set()
        geometry: set[tuple[int, tuple[int, ...], tuple[tuple[int, str], ...]]] = set()
        for name, entry in kv_caches.items():
            kind, views, layer_block_size = _classify(name, entry)
            if any(v.size(0) == 0 for v in views):
                raise LayoutError(f"layer {name!r} has a KV cache of 0 blocks; allocate at least one block")
            kinds.add(kind)
            sizes.add(layer_block_size)
            for view in views:
                num_blocks.add(view.size(0))
                dtypes.add(view.dtype)
                devices.add(view.device)
            tensors.extend([entry] if isinstance(entry, torch.Tensor) else entry)
            planes_of_layer = tuple(_plane(v, name) for v in views)
            layers.append(LayerLayout(name, planes_of_layer))
            views_u8.extend(_bytes_view(v, p) for v, p in zip(views, planes_of_layer))
            typed.append(tuple(views))
            heads, widths = _geometry(kind, views[0])
            if kind is LayoutKind.MLA_TUPLE:
                widths = (views[0].size(-1), views[1].size(-1))
            geometry.add((heads, widths, tuple((p.block_nbytes, p.order) for p in planes_of_layer)))
        for what, values in (
            ("layout kinds", kinds),
            ("block sizes", sizes),
            ("block counts", num_blocks),
            ("dtypes", dtypes),
            ("devices", devices),
            ("per-block shapes", geometry),
        ):
            if len(values) != 1:
                raise LayoutError(f"every layer must share one layout; got {what} {sorted(map(str, values))}")
        (size,) = sizes
        if block_size is not None and block_size != size:
            raise LayoutError(f"block_size={block_size} given, but the KV cache shapes say {size}")
        planes = [p for layer in layers for p in layer.planes]
        ((heads, widths, _),) = geometry
        return cls(
            kind=kinds.pop(),
            block_size=size,
            num_blocks=num_blocks.pop(),
            dtype=dtypes.pop(),
            device=devices.pop(),
            heads=heads,
            widths=widths,
            layers=tuple(layers),
            tensors=tuple(tensors),
            plane_views=tuple(views_u8),
            typed_views=tuple(typed),
            bases=[p.base for p in planes],
            strides=[p.block_stride for p in planes],
            sizes=[p.block_nbytes for p in planes],
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def mla(self) -> bool:
        return self.kind in (LayoutKind.MLA, LayoutKind.MLA_TUPLE)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over every layer and plane."""
        return sum(self._sizes)

    @property
    def block_sizes(self) -> list[int]:
        """The region sizes of one block over every layer (shared by every block: do not mutate)."""
        return self._sizes

    @property
    def order(self) -> str:
        """How a block's bytes lie: the layout kind and each plane's dimension order, e.g.
        ``flash_attn.123.213`` (part of every key: objects are kept in the writer's order)."""
        return ".".join([self.kind.value] + [p.order or "0" for p in self.layers[0].planes])

    def meaning(self, total_kv_heads: int) -> str:
        """What the bytes mean, given the model's KV heads (ignored for MLA): dtype and head shape,
        e.g. ``bfloat16.kv8x128``, ``bfloat16.mla576`` or ``bfloat16.mla512+64``."""
        dtype = _meaning_text(self.dtype)
        if self.kind is LayoutKind.MLA:
            return f"{dtype}.mla{self.widths[0]}"
        if self.kind is LayoutKind.MLA_TUPLE:
            return f"{dtype}.mla{self.widths[0]}+{self.widths[1]}"
        return f"{dtype}.kv{total_kv_heads}x{self.widths[0]}"

    def format(self, total_kv_heads: int | None = None) -> KVFormat:
        """The facts a pool over this layout shares with pools that only look up. ``total_kv_heads``:
        the model's KV heads (default: the heads held here, right for one rank or MLA)."""
        return KVFormat(
            self.block_size, self.num_layers, self.meaning(total_kv_heads or self.heads), self.order
        )

    def addrs_of(self, block_ids: Sequence[int], layer: int | None = None) -> list[list[int]]:
        """The region addresses of each block in ``block_ids``, over every layer or one ``layer``:
        :meth:`block_addrs` (or :meth:`layer_regions`) for many blocks in one vectorised step."""
        rows: list[list[int]] = self.addr_rows(block_ids, layer).tolist()
        return rows

    def addr_rows(self, block_ids: Sequence[int], layer: int | None = None) -> npt.NDArray[np.int64]:
        """:meth:`addrs_of` as an array: one row of region addresses per block."""
        columns = self._columns.get(layer)
        if columns is None:  # (kept: from cold caches each small numpy call costs 10-35 us)
            planes = self.unit_planes(layer)
            columns = self._columns[layer] = (
                np.asarray([self._bases[p] for p in planes], dtype=np.int64),
                np.asarray([self._strides[p] for p in planes], dtype=np.int64),
            )
        bases, strides = columns
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
        return ids * strides + bases

    def unit_sizes(self, layer: int | None) -> list[int]:
        """The region sizes of one block over every layer or one ``layer`` (shared: do not mutate)."""
        if layer is None:
            return self._sizes
        return [self._sizes[p] for p in self.unit_planes(layer)]

    def block_addrs(self, block_id: int) -> list[int]:
        """The region addresses of block ``block_id`` over every layer (sizes: :attr:`block_sizes`)."""
        return [base + block_id * stride for base, stride in zip(self._bases, self._strides)]

    def unit_planes(self, layer: int | None) -> list[int]:
        """Indices into :attr:`plane_views` of one layer's planes, or of every plane (``None``)."""
        if layer is None:
            return list(range(len(self.plane_views)))
        first = sum(len(lay.planes) for lay in self.layers[:layer])
        return list(range(first, first + len(self.layers[layer].planes)))

    def layer_regions(self, block_id: int, layer: int) -> tuple[list[int], list[int]]:
        """The region addresses and sizes of block ``block_id`` in layer ``layer`` only."""
        planes = self.layers[layer].planes
        return [p.base + block_id * p.block_stride for p in planes], [p.block_nbytes for p in planes]

    def allocations(self) -> list[tuple[int, int]]:
        """Each registered tensor's ``(address, nbytes)`` span, for zero-copy registration."""
        spans = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in self.tensors}
        return sorted(spans)
