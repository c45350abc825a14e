"""One exception hierarchy for kvflow.

Every error says what happened and what the caller can do about it.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "ClearStoppedError",
    "ConfigError",
    "KVFlowError",
    "LayoutError",
    "MissingDependencyError",
    "PoolClosedError",
    "RequestError",
]


class KVFlowError(Exception):
    """Base class of every error kvflow raises on purpose."""


class ConfigError(KVFlowError, ValueError):
    """A configuration value is invalid (a URL, a size, a rank)."""


class LayoutError(KVFlowError, ValueError):
    """Registered KV caches have a shape, dtype or stride kvflow cannot describe."""


class RequestError(KVFlowError, ValueError):
    """A store, retrieve or lookup request is malformed (block ids, hashes, tokens)."""


class PoolClosedError(KVFlowError, RuntimeError):
    """The pool or runtime was closed; create a new one."""


class BackendError(KVFlowError, RuntimeError):
    """A backend failed in a way that is a programming or set-up error, not a per-key result."""


class BackendUnavailableError(BackendError):
    """The backend cannot be reached (a server is down); operations report failures meanwhile."""


class ClearStoppedError(BackendUnavailableError):
    """Clearing a store stopped part-way (it stopped answering: a local store's lock held by a
    stopped engine, say): ``removed`` of the ``listed`` objects were removed, the rest are still
    there."""

    def __init__(self, message: str, removed: int, listed: int) -> None:
        super().__init__(message)
        self.removed = removed
        self.listed = listed


class MissingDependencyError(KVFlowError, ImportError):
    """A package a feature needs is not installed; the message says what to install."""

    def __init__(self, package: str, feature: str, install: str) -> None:
        super().__init__(
            f"{feature} needs the {package!r} package, which is not installed. Install it with: {install}"
        )
        self.package = package
        self.install = install
