"""Writer profiles: how an engine splits a model into objects, and the store's book of them.

An engine writes each block as objects that each hold some layers, some KV heads and one context
shard of ``block_size`` tokens, in its own byte order (:mod:`kvflow.keys`). Its :class:`Profile`
lists that split: the objects' layer ranges (its pipeline stages, or one per layer), its KV-head
groups (its tensor-parallel split), its shards, tokens per object and byte order. From a profile
and a prompt's hashes anyone can name every object that engine wrote for the prompt, and decode
each object's bytes (:mod:`kvflow.parts`).

Every pool that stores announces its profile in the store (:class:`ProfileBook`): a few small
objects per model and meaning, ``SLOTS`` of them, written once each (a put never overwrites) and
announced again now and then, since a store may evict them. A pool that finds a block missing
under its own keys reads the book and looks for the block under the other profiles there
(:mod:`kvflow.transfer.reshape`); when writer and reader split the model the same way nothing of
this runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any
from urllib.parse import quote

import anyio
import attrs
import torch

from kvflow.backends.base import Backend, GetStatus, ObjectRef, PutStatus, cancelled_as_fault
from kvflow.errors import ConfigError, LayoutError, RequestError
from kvflow.keys import VERSION, KeyScope
from kvflow.layout import LayoutKind
from kvflow.parts import plane_shapes, plane_strides

__all__ = ["SLOTS", "Profile", "ProfileBook", "is_book_key"]

log = logging.getLogger(__name__)

#: Profiles one model and meaning can have in a store at once.
SLOTS = 16
#: Bytes of one announcement (the profile's JSON, padded with spaces): room for a layerwise profile
#: of over 400 layers (one range per layer).
SLOT_BYTES = 4096
#: How long a pool's lookups trust what it read of the book before reading it again.
READ_EVERY_S = 5.0
#: The same for a load that found blocks missing under its own keys.
LOAD_READ_EVERY_S = 0.5
#: How often a storing pool checks that its announcement is still in the store.
ANNOUNCE_EVERY_S = 60.0

_MEANING = re.compile(
    r"^(?P<dtype>[a-z0-9_]+)\.(?:kv(?P<heads>\d+)x(?P<size>\d+)|mla(?P<latent>\d+)(?:\+(?P<rope>\d+))?)$"
)


# The layout kinds that hold each meaning: (MLA?, number of part widths) -> kinds.
_KINDS_OF = {
    (False, 1): frozenset(
        {LayoutKind.VLLM_CPU, LayoutKind.FLASHINFER, LayoutKind.FLASH_ATTN, LayoutKind.KV_TUPLE}
    ),
    (True, 1): frozenset({LayoutKind.MLA}),
    (True, 2): frozenset({LayoutKind.MLA_TUPLE}),
}


def _ranges(value: object) -> tuple[tuple[int, int], ...]:
    ranges = tuple(tuple(r) for r in value)  # type: ignore[attr-defined]
    if not ranges or any(
        len(r) != 2 or not all(_is_int(n) for n in r) or not 0 <= r[0] < r[1] for r in ranges
    ):
        raise ConfigError(f"layer ranges must be (first, end) pairs of integers, got {value!r}")
    return ranges


def _is_int(value: object) -> bool:
    return type(value) is int  # (not a bool, not a float that JSON spelled 2.0)


def _positive(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ConfigError(f"a profile's {attribute.name} must be a positive integer, got {value!r}")


def _text(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"a profile's {attribute.name} must be text, got {value!r}")


@attrs.frozen
class Profile:
    """How one engine splits a model's KV into objects. Plain values: it travels as JSON."""

    model: str = attrs.field(validator=_text)
    meaning: str = attrs.field(validator=_text)
    order: str = attrs.field(validator=_text)
    block_size: int = attrs.field(validator=_positive)  # tokens per object
    hash_tokens: int = attrs.field(validator=_positive)  # tokens per hash of the prompt's hash chain
    layer_ranges: tuple[tuple[int, int], ...] = attrs.field(converter=_ranges)
    head_groups: int = attrs.field(default=1, validator=_positive)
    dcp_size: int = attrs.field(default=1, validator=_positive)
    pcp_size: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if _MEANING.match(self.meaning) is None:
            raise ConfigError(f"cannot read the meaning {self.meaning!r} of a profile")
        if self.block_size % self.hash_tokens:
            raise ConfigError(
                f"block_size={self.block_size} is not a multiple of hash_tokens={self.hash_tokens}"
            )
        if self.num_kv_heads % self.head_groups:
            raise ConfigError(f"{self.num_kv_heads} KV heads do not split into {self.head_groups} groups")
        if self.kind not in _KINDS_OF[(self.mla, len(self.widths))]:
            raise ConfigError(f"the order {self.order!r} cannot hold KV of the meaning {self.meaning!r}")
        if len(self.plane_orders) != len(self.shapes):
            raise ConfigError(f"the order {self.order!r} does not give {len(self.shapes)} plane orders")
        for shape, order in zip(self.shapes, self.plane_orders):
            try:
                plane_strides(shape, order)
            except LayoutError as exc:
                raise ConfigError(f"a profile of {self.model!r}: {exc}") from None
        try:  # every object it names must have a key (the order is key text, say)
            next(self.scopes())
        except RequestError as exc:
            raise ConfigError(f"a profile of {self.model!r} names objects no key can hold: {exc}") from None

    # -- what the bytes are ---------------------------------------------------------------------

    @cached_property
    def _parsed(self) -> dict[str, str | None]:
        match = _MEANING.match(self.meaning)
        assert match is not None
        return match.groupdict()

    @property
    def mla(self) -> bool:
        return self._parsed["latent"] is not None

    @property
    def num_kv_heads(self) -> int:
        """The model's KV heads (1 for MLA)."""
        heads = self._parsed["heads"]
        return 1 if heads is None else int(heads)

    @property
    def group_heads(self) -> int:
        """KV heads per object."""
        return self.num_kv_heads // self.head_groups

    @property
    def widths(self) -> tuple[int, ...]:
        p = self._parsed
        if p["latent"] is None:
            return (int(p["size"] or 0),)
        if p["rope"] is None:
            return (int(p["latent"]),)
        return int(p["latent"]), int(p["rope"])

    @cached_property
    def dtype(self) -> torch.dtype:
        name = self._parsed["dtype"] or ""
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"unknown dtype {name!r} in the profile of {self.model!r}")
        return dtype

    @cached_property
    def kind(self) -> LayoutKind:
        try:
            return LayoutKind(self.order.split(".")[0])
        except ValueError:
            raise ConfigError(f"unknown layout kind in the order {self.order!r}") from None

    @property
    def plane_orders(self) -> tuple[str, ...]:
        return tuple(self.order.split(".")[1:])

    @cached_property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each plane's per-block shape, for one layer."""
        return plane_shapes(self.kind, self.block_size, self.group_heads, self.widths)

    @cached_property
    def layer_nbytes(self) -> int:
        """Bytes of one layer of one object."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for shape in self.shapes:
            n = itemsize
            for d in shape:
                n *= d
            total += n
        return total

    def object_nbytes(self, layers: tuple[int, int]) -> int:
        return (layers[1] - layers[0]) * self.layer_nbytes

    @property
    def layer_span(self) -> tuple[int, int]:
        """The model layers the profile's objects hold, ``(first, end)``: the whole model's."""
        return min(r[0] for r in self.layer_ranges), max(r[1] for r in self.layer_ranges)

    # -- which objects --------------------------------------------------------------------------

    def heads_of(self, group: int) -> tuple[int, int]:
        n = self.group_heads
        return group * n, (group + 1) * n

    def covers(self, layers: tuple[int, int]) -> bool:
        """Whether the objects' layer ranges tile ``layers`` (and nothing overlaps)."""
        inside = sorted(r for r in self.layer_ranges if r[0] < layers[1] and layers[0] < r[1])
        at = layers[0]
        for first, end in inside:
            if first > at:
                return False
            at = max(at, end)
        return at >= layers[1] and all(a[1] <= b[0] for a, b in itertools.pairwise(inside))

    def scopes(
        self,
        *,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
        dcp_rank: int | None = None,
        pcp_rank: int | None = None,
    ) -> Iterator[KeyScope]:
        """The scopes of the objects that hold any of ``layers`` and ``heads`` (default: all) of
        the given shards (default: every shard)."""
        for first, end in self.layer_ranges:
            if layers is not None and not (first < layers[1] and layers[0] < end):
                continue
            for group in range(self.head_groups):
                h = self.heads_of(group)
                if heads is not None and not (h[0] < heads[1] and heads[0] < h[1]):
                    continue
                for d in range(self.dcp_size) if dcp_rank is None else (dcp_rank,):
                    for p in range(self.pcp_size) if pcp_rank is None else (pcp_rank,):
                        yield KeyScope(
                            self.model,
                            self.meaning,
                            self.order,
                            self.block_size,
                            (first, end),
                            h,
                            (d, self.dcp_size),
                            (p, self.pcp_size),
                        )

    # -- as text --------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self, recurse=True), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Parse an announcement; ConfigError (or ValueError/TypeError/RecursionError) for anything
        malformed."""
        data: dict[str, Any] = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError("a profile is a JSON object")
        return cls(**data)


def _slot_key(model: str, meaning: str, slot: int) -> str:
    return f"{VERSION}@{quote(model, safe='')}@{meaning}@profiles@{slot}"


def is_book_key(key: str) -> bool:
    """Whether ``key`` is an announcement of the profile book (not KV)."""
    fields = key.split("@")
    return len(fields) == 5 and fields[0] == VERSION and fields[3] == "profiles"


@attrs.define(eq=False)
class ProfileBook:
    """The profiles announced in a store for one model and meaning, read and written from a pool's
    loop. ``own`` is the pool's profile; :meth:`others` the rest."""

    backend: Backend
    own: Profile
    _buffer: torch.Tensor = attrs.field(init=False)
    _lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)
    _seen: tuple[Profile, ...] = attrs.field(default=(), init=False)
    _parsed: dict[bytes, Profile | None] = attrs.field(factory=dict, init=False)  # by announcement text
    _known: dict[int, Profile | None] = attrs.field(factory=dict, init=False)  # last read (or put), by slot
    _read_at: float = attrs.field(default=float("-inf"), init=False)
    _announced_at: float = attrs.field(default=float("-inf"), init=False)
    _warned: set[str] = attrs.field(factory=set, init=False)
    _announcement: bytes = attrs.field(init=False)  # the own profile as a slot holds it (unpadded)

    def __attrs_post_init__(self) -> None:
        # Not registered with the backend: 64 KiB read a few times a minute go through a backend's
        # own copy path, and a registration would have to outlive every pool sharing the backend.
        self._buffer = torch.zeros(SLOTS * SLOT_BYTES, dtype=torch.uint8)
        self._announcement = self.own.to_json().encode()

    @property
    def _fits(self) -> bool:
        """Whether the own profile fits an announcement."""
        return len(self._announcement) <= SLOT_BYTES

    def _objects(self) -> list[ObjectRef]:
        base = self._buffer.data_ptr()
        return [
            ObjectRef(
                _slot_key(self.own.model, self.own.meaning, i),
                [base + i * SLOT_BYTES],
                [SLOT_BYTES],
                SLOT_BYTES,
            )
            for i in range(SLOTS)
        ]

    async def _read(self, deadline: float) -> list[Profile | bool | None] | None:
        """Every slot's profile (``False``: empty; ``None``: taken by something unreadable), or None
        when the store failed. Reads every slot that exists: a slot written once may since have
        been evicted and taken by another profile. A slot that exists but could not be read now
        holds what it held when last read. What a text parses to is remembered, so a book that did
        not change costs a get, not a parse."""
        objects = self._objects()
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())), cancelled_as_fault():
                present = await self.backend.exists([o.key for o in objects])
                here = [i for i, there in enumerate(present) if there]
                got = await self.backend.get([objects[i] for i in here]) if here else []
        except Exception as exc:
            log.debug("reading the profile book failed: %r", exc)
            return None
        raw = self._buffer.numpy().tobytes()
        slots: list[Profile | bool | None] = [False] * SLOTS
        if len(self._parsed) > 4 * SLOTS:
            self._parsed.clear()
        for i, status in zip(here, got):
            if status is not GetStatus.HIT:
                slots[i] = self._known.get(i)  # not readable now (a fault): as last read
                continue
            text = raw[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]
            if text not in self._parsed:
                self._parsed[text] = _parse(i, text)
            slots[i] = self._known[i] = self._parsed[text]
        for i, there in enumerate(present):
            if not there:
                self._known.pop(i, None)
        return slots

    @property
    def due(self) -> bool:
        """Whether :meth:`announce` would look at the store now (at most every ``ANNOUNCE_EVERY_S``)."""
        return time.monotonic() - self._announced_at >= ANNOUNCE_EVERY_S

    async def announce(self, deadline: float) -> None:
        """Make sure the own profile is in the book (at most every ``ANNOUNCE_EVERY_S``). A slot
        another pool took first (racing for it) sends this one to the next free slot, in the same
        call: a pool that stores rarely must not stay out of the book until its next store."""
        if not self.due or not await self._acquire(deadline):
            return
        try:
            refused: set[int] = set()  # slots another pool took first, in this call
            for _ in range(SLOTS):
                if (
                    not self.due
                    or time.monotonic() >= deadline
                    or await self._announce_once(deadline, refused)
                ):
                    return
        finally:
            self._lock.release()

    async def _announce_once(self, deadline: float, refused: set[int]) -> bool:
        """One try: read the book and, where the own profile is not in it, put it in the first free
        slot not in ``refused``. Whether it is done (in the book, or not now: a full book, a failed
        store, every free slot refused, a slot stored and not there when read back); False when
        another pool took the slot first (added to ``refused``: a slot another pool is still
        writing reads as free, and is never tried twice in one call)."""
        slots = await self._read(deadline)
        if slots is None:
            return True
        self._remember(slots)
        if self.own in slots:
            self._announced_at = time.monotonic()
            return True
        free = [i for i, p in enumerate(slots) if p is False]
        if free and not set(free) - refused:
            return True  # each free slot refused in this call: the next store looks again
        free = [i for i in free if i not in refused]
        if not free:
            log.warning(
                "the store's book of profiles for %s is full (%d); engines with other layouts will "
                "not find this engine's KV until old ones are evicted",
                self.own.model,
                SLOTS,
            )
            self._announced_at = time.monotonic()
            return True
        slot = free[0]
        if not self._fits:
            log.warning("this engine's profile does not fit an announcement; others will not find its KV")
            self._announced_at = time.monotonic()
            return True
        payload = self._announcement.ljust(SLOT_BYTES)
        view = self._buffer[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]
        view.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())), cancelled_as_fault():
                (status,) = await self.backend.put([self._objects()[slot]])
        except Exception as exc:
            log.debug("announcing the profile failed: %r", exc)
            return True
        if status is PutStatus.PRESENT:
            refused.add(slot)  # another pool took the slot first: the next free one
            return False
        if status is not PutStatus.STORED:
            return True  # the store refused it: the next store looks again
        # Read back: a store whose put of a key another pool just wrote keeps that value and says
        # STORED (Mooncake), so two pools racing for a slot would both count it theirs.
        slots = await self._read(deadline)
        if slots is not None:
            self._remember(slots)
        if slots is None or slots[slot] is None:  # not readable now: taken as written
            self._known[slot] = self.own
        if slots is None or slots[slot] in (None, self.own):
            self._announced_at = time.monotonic()
            return True
        if slots[slot] is False:
            return True  # stored and not there now (evicted, or a store that keeps nothing): next store
        refused.add(slot)  # another pool's, kept by a store that keeps the first put (Mooncake)
        return False

    async def _acquire(self, deadline: float) -> bool:
        """Take the book's lock, unless ``deadline`` passes first (another call is reading the
        book from a slow store: this one goes on with what was read before)."""
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            await self._lock.acquire()
            return True
        return False

    async def others(self, deadline: float, max_age_s: float = READ_EVERY_S) -> tuple[Profile, ...]:
        """The other profiles in the book, read again when what was read is older than
        ``max_age_s`` (loads that found a block missing pass a shorter age than lookups: the
        engine's scheduler may have just seen a profile this pool has not)."""
        if time.monotonic() - self._read_at >= max_age_s and await self._acquire(deadline):
            try:
                if time.monotonic() - self._read_at >= max_age_s:
                    slots = await self._read(deadline)
                    if slots is not None:
                        self._remember(slots)
            finally:
                self._lock.release()
        return self._seen

    def _remember(self, slots: Sequence[Profile | bool | None]) -> None:
        if self.own not in slots and False in slots and self._fits:
            # Evicted, or removed by `kvflow store clear`: the next store announces it again (it
            # would wait for the minutely check otherwise). Not when the book is full, nor for a
            # profile too large to announce (it would read the book and warn at every store).
            self._announced_at = float("-inf")
        seen: list[Profile] = []
        for profile in slots:
            if not isinstance(profile, Profile) or profile == self.own or profile in seen:
                continue
            if profile.model != self.own.model or profile.meaning != self.own.meaning:
                continue
            if profile.layer_span != self.own.layer_span:
                log.debug("the profile book holds %s with other layers than this model's: ignored", profile)
                continue
            if profile.hash_tokens != self.own.hash_tokens:
                if profile.order not in self._warned:
                    self._warned.add(profile.order)
                    log.warning(
                        "the store holds KV of %s hashed every %d tokens, this engine hashes every %d: "
                        "they cannot share it (give both the same hash_tokens / block size)",
                        self.own.model,
                        profile.hash_tokens,
                        self.own.hash_tokens,
                    )
                continue
            if (profile.dcp_size, profile.pcp_size) != (self.own.dcp_size, self.own.pcp_size):
                continue  # context shards split tokens differently: not transformed
            if max(profile.dcp_size, profile.pcp_size) > 1 and profile.block_size != self.own.block_size:
                continue  # a shard's block need not hold consecutive tokens: no copy by token ranges
            seen.append(profile)
        self._seen = tuple(seen)
        self._read_at = time.monotonic()

    def forget(self) -> None:
        """Read the book again on the next use (tests, and after a store was cleared)."""
        self._read_at = float("-inf")
        self._announced_at = float("-inf")


def _parse(slot: int, raw: bytes) -> Profile | None:
    """The profile an announcement holds, or None for anything else."""
    try:
        return Profile.from_json(raw.decode(errors="replace").strip())
    except (ValueError, TypeError, RecursionError, ConfigError, LayoutError) as exc:
        log.debug("slot %d of the profile book holds no profile kvflow reads: %r", slot, exc)
        return None
