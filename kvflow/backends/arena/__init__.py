"""The arena backend: objects in the slots of one pre-allocated shared-memory region (``arena://``).

Like ``local://``, a store for the processes of one host, private to its user unless the URL names
a group; unlike it, the memory is allocated once, when the store is created, and cut into slots of
one size, so puts and gets copy at memory speed. :mod:`.backend` puts and gets objects, :mod:`.store`
is the mapped region and its table, :mod:`.lock` the lock, :mod:`.config` the URL. See
docs/arena-backend.md.
"""

from kvflow.backends.arena.backend import ArenaBackend, ArenaConfig

__all__ = ["ArenaBackend", "ArenaConfig"]
