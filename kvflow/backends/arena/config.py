"""Settings of the arena backend, from an ``arena://`` URL. Pure values: nothing here touches memory.

``arena://`` alone is the private default store ``/dev/shm/kvflow-arena-<uid>``; ``arena:///abs/dir``
names another directory; ``?group=NAME`` shares it with a group (docs/security.md), as for
``local://``.
"""

from __future__ import annotations

import os

import attrs

from kvflow.backends.local.config import parse_store_url, store_group, store_path
from kvflow.config import parse_seconds, parse_size, positive_seconds
from kvflow.errors import ConfigError

__all__ = ["MAX_SLOT", "ArenaConfig", "default_arena_path"]

_DEFAULT_DIR = "/dev/shm/kvflow-arena-{uid}"
_MAX_CAPACITY = 1 << 60  # 1 EiB: a larger arena is a mistake
_DEFAULT_CAPACITY = 1 << 30
_DEFAULT_SLOT = 1 << 20
_PAGE = 4096
#: The largest slot: a get or put copies a whole object while it holds the event loop (and the lock).
MAX_SLOT = 64 << 20


def default_arena_path() -> str:
    """The directory of ``arena://``: ``/dev/shm/kvflow-arena-<uid>``, private to this user."""
    return _DEFAULT_DIR.format(uid=os.geteuid())


def _slot(_: object, __: attrs.Attribute[int], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not _PAGE <= value <= MAX_SLOT
        or value % _PAGE
    ):
        raise ConfigError(
            f"slot must be a multiple of 4KiB from 4KiB to {MAX_SLOT >> 20}MiB, got {value!r}: give the "
            "size of the pool's objects rounded up, e.g. slot=256KiB"
        )


@attrs.frozen
class ArenaConfig:
    """``arena:///dev/shm/my-arena?capacity=8GiB&slot=256KiB``; ``arena://`` is the default store.

    ``capacity_bytes`` of memory is taken (allocated and touched) when the store is created, cut into
    slots of ``slot_bytes``; each object takes one slot, so an object larger than a slot cannot be
    stored. Every process must give the same capacity and slot. ``lock_timeout_s`` bounds each wait
    for the store's lock; ``group`` shares the store as in ``local://``.
    """

    path: str = attrs.field(factory=default_arena_path, validator=store_path)
    capacity_bytes: int = attrs.field(default=_DEFAULT_CAPACITY)
    slot_bytes: int = attrs.field(default=_DEFAULT_SLOT, validator=_slot)
    lock_timeout_s: float = attrs.field(default=10.0, validator=positive_seconds)
    group: str | None = attrs.field(default=None, validator=store_group)

    @capacity_bytes.validator
    def _capacity(self, _: attrs.Attribute[int], value: object) -> None:
        slot = self.slot_bytes if isinstance(self.slot_bytes, int) else _PAGE  # checked next
        if isinstance(value, bool) or not isinstance(value, int) or value < slot:
            raise ConfigError(
                f"capacity must be at least one slot ({self.slot_bytes} bytes), got {value!r}: e.g. "
                "capacity=4GiB"
            )
        if value > _MAX_CAPACITY:
            raise ConfigError(f"capacity {value} is more than any filesystem holds; e.g. capacity=4GiB")

    @classmethod
    def from_url(cls, url: str) -> ArenaConfig:
        path, params = parse_store_url(url, "arena", {"capacity", "slot", "lock_timeout", "group"})
        slot = parse_size(params["slot"]) if "slot" in params else _DEFAULT_SLOT
        capacity = parse_size(params["capacity"]) if "capacity" in params else _DEFAULT_CAPACITY
        timeout = parse_seconds(params.get("lock_timeout", "10"), f"lock_timeout in {url!r}")
        return cls(path or default_arena_path(), capacity, slot, timeout, params.get("group"))
