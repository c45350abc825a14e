"""Settings of the local backend, from a ``local://`` URL. Pure values: nothing here touches the disk.

``local://`` alone is the private default store ``/dev/shm/kvflow-<uid>``; ``local:///abs/dir`` names
another directory; ``?group=NAME`` shares the store with a group (see docs/security.md).
"""

from __future__ import annotations

import os
from urllib.parse import unquote

import attrs

from kvflow.config import (
    parse_seconds,
    parse_size,
    parse_url_query,
    positive_int,
    positive_seconds,
    split_url,
)
from kvflow.errors import ConfigError

__all__ = ["LocalConfig", "default_path", "parse_store_url", "store_group", "store_path"]

_DEFAULT_DIR = "/dev/shm/kvflow-{uid}"  # the default store: one private directory per user
_DEFAULT_CAPACITY = 4 << 30


def default_path() -> str:
    """The store directory of ``local://``: ``/dev/shm/kvflow-<uid>``, private to this user."""
    return _DEFAULT_DIR.format(uid=os.geteuid())


def store_path(_: object, __: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or "\x00" in value:
        raise ConfigError(f"the local store path must be text without NUL bytes, got {value!r}")
    if not os.path.isabs(value) or not os.path.normpath(value).strip("/"):  # ("//" is "/" too)
        raise ConfigError(
            f"the local store path must be an absolute directory below /, got {value!r}: write e.g. "
            "local:///dev/shm/my-store, or local:// for the private default"
        )


def store_group(_: object, __: attrs.Attribute[str | None], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value or "\x00" in value or "/" in value:
        raise ConfigError(f"group must be a group name or a numeric gid, got {value!r}")


@attrs.frozen
class LocalConfig:
    """``local:///dev/shm/my-store?capacity=8GiB&lock_timeout=10``; ``local://`` is the default store.

    ``path``: the store directory (absolute); by default ``/dev/shm/kvflow-<uid>``, private to this
    user. ``capacity_bytes`` is the budget of the whole directory, shared by every process using it
    (give them all the same value). ``lock_timeout_s`` bounds each wait for the directory lock.
    ``group``: share the store with every member of this group (a name or gid; ``?group=kvusers``),
    who are then trusted like this user; None keeps it private (see docs/security.md).
    """

    path: str = attrs.field(factory=default_path, validator=store_path)
    capacity_bytes: int = attrs.field(default=_DEFAULT_CAPACITY, validator=positive_int)
    lock_timeout_s: float = attrs.field(default=10.0, validator=positive_seconds)
    group: str | None = attrs.field(default=None, validator=store_group)

    @classmethod
    def from_url(cls, url: str) -> LocalConfig:
        path, params = parse_store_url(url, "local", {"capacity", "lock_timeout", "group"})
        capacity = parse_size(params["capacity"]) if "capacity" in params else _DEFAULT_CAPACITY
        timeout = parse_seconds(params.get("lock_timeout", "10"), f"lock_timeout in {url!r}")
        return cls(path or default_path(), capacity, timeout, params.get("group"))


def parse_store_url(url: str, scheme: str, allowed: set[str]) -> tuple[str, dict[str, str]]:
    """The directory (``""`` for the default) and the parameters of a store URL on this host.

    Shared by the stores in a directory (``local://``, ``arena://``): a host, a fragment, a relative
    path, a NUL byte or a group without a directory is a ConfigError saying what to write.
    """
    params = parse_url_query(url, scheme=scheme, allowed=allowed)
    parts = split_url(url)
    if parts.netloc:
        raise ConfigError(
            f"{url!r} names a host ({parts.netloc!r}); the {scheme} backend takes a directory: "
            f"write {scheme}:///absolute/path (three slashes)"
        )
    if parts.fragment:
        raise ConfigError(f"{url!r} has a fragment (#{parts.fragment}); {scheme} URLs take none: remove it")
    if parts.path and not parts.path.startswith("/"):
        raise ConfigError(
            f"{url!r} names a relative path ({parts.path!r}); the {scheme} backend takes an absolute "
            f"directory: write {scheme}:///absolute/path (three slashes), or {scheme}:// for the default"
        )
    path = unquote(parts.path)
    if "\x00" in path:
        raise ConfigError(f"the path in {url!r} contains a NUL byte (%00); remove it")
    if params.get("group") is not None and not path:
        raise ConfigError(
            f"{url!r} shares a store with a group but names no directory; give one that every member "
            f"uses, e.g. {scheme}:///dev/shm/kv-shared?group=kvusers"
        )
    return path, params
