"""The Mooncake Store backend: objects in a Mooncake cluster.

:mod:`.backend` is the client kvflow's pools use; :mod:`.config` reads URLs and ``mooncake.json``;
:mod:`.native` loads and sets up Mooncake's own client; :mod:`.calls` and :mod:`.threads` run its
blocking batch calls; :mod:`.staging` copies memory Mooncake may not use directly; :mod:`.health`
gates calls while the master is down; :mod:`.absent` remembers keys just answered absent, so a
put after the pool's exists-skip asks no second time. Importing this package does not import
Mooncake. See docs/mooncake.md.
"""

from kvflow.backends.mooncake.backend import MooncakeBackend
from kvflow.backends.mooncake.config import MooncakeConfig

__all__ = ["MooncakeBackend", "MooncakeConfig"]
