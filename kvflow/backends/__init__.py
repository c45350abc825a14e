"""Backends: where KV objects live. ``open_backend(url)`` picks one by URL scheme.

- ``memory://?capacity=4GiB``: in-process (:mod:`kvflow.backends.memory`);
- ``local://``: shared memory for every process of this user on the host (:mod:`kvflow.backends.local`);
- ``arena://?slot=256KiB``: the same, in one pre-allocated region of fixed-size slots, at memory speed
  (:mod:`kvflow.backends.arena`);
- ``mooncake://127.0.0.1:50051``: a Mooncake Store cluster (:mod:`kvflow.backends.mooncake`).

Backends other than memory load lazily, so ``import kvflow`` needs none of their packages.
"""

from __future__ import annotations

import importlib

from kvflow.backends.base import (
    Backend,
    BackendCapabilities,
    BackendStats,
    GetStatus,
    ObjectBatch,
    ObjectRef,
    PutStatus,
    Touching,
)
from kvflow.config import split_url
from kvflow.errors import ConfigError

__all__ = [
    "SCHEMES",
    "Backend",
    "BackendCapabilities",
    "BackendStats",
    "GetStatus",
    "ObjectBatch",
    "ObjectRef",
    "PutStatus",
    "Touching",
    "open_backend",
]

SCHEMES: dict[str, str] = {
    "memory": "kvflow.backends.memory:MemoryBackend",
    "local": "kvflow.backends.local:LocalBackend",
    "arena": "kvflow.backends.arena:ArenaBackend",
    "mooncake": "kvflow.backends.mooncake:MooncakeBackend",
}


def open_backend(url: str) -> Backend:
    """Create the backend a URL names. Raises ConfigError for an unknown scheme or bad parameter."""
    if not isinstance(url, str):
        raise ConfigError(f"a backend URL must be text, got {url!r}")
    scheme = split_url(url).scheme
    target = SCHEMES.get(scheme)
    if target is None:
        raise ConfigError(
            f"unknown backend URL {url!r}; use one of: " + ", ".join(f"{name}://..." for name in SCHEMES)
        )
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: Backend = cls.from_url(url)
    return backend
