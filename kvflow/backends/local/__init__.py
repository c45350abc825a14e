"""The local backend: objects in files of one directory, shared by every process of a host.

:mod:`.backend` puts and gets objects, :mod:`.space` keeps the shared byte budget and evicts,
:mod:`.format` is the on-disk format. See docs/local-backend.md.
"""

from kvflow.backends.local.backend import LocalBackend, LocalConfig

__all__ = ["LocalBackend", "LocalConfig"]
