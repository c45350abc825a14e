"""The local backend: objects in files of one directory, shared by the processes of a host.

The directory is private to its user (``/dev/shm/kvflow-<uid>`` by default) unless the URL shares it
with a group. :mod:`.backend` puts and gets objects, :mod:`.safety` opens and checks the directory
(who it is for, modes, no symlinks), :mod:`.space` keeps the shared byte budget and evicts,
:mod:`.format` is the on-disk format. See docs/local-backend.md and docs/security.md.
"""

from kvflow.backends.local.backend import LocalBackend, LocalConfig

__all__ = ["LocalBackend", "LocalConfig"]
