"""Keys this client has just been told are absent, so that a put right after needs no second check.

The pool asks ``exists`` before it stores (to skip what is there) and then puts the rest; a put
that asked again (``check_present``) would pay one more round trip to the master for an answer it
just had. A put skips its own check for keys ``exists`` answered absent within ``fresh_s``. If
another client stored one of them meanwhile, the put reports it ``STORED`` instead of ``PRESENT``;
Mooncake keeps the object that was there either way.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import attrs

__all__ = ["RecentAbsence"]


@attrs.define
class RecentAbsence:
    """Keys answered absent, with when; at most ``limit`` (the oldest are dropped)."""

    fresh_s: float = 10.0
    limit: int = 1 << 16
    _since: dict[str, float] = attrs.field(factory=dict)

    def note(self, keys: Sequence[str], found: Sequence[bool]) -> None:
        """Record an ``exists`` answer."""
        now, since = time.monotonic(), self._since
        for key, present in zip(keys, found):
            since.pop(key, None)  # (re-)inserted last: the dict stays oldest first
            if not present:
                since[key] = now
        excess = len(since) - self.limit
        if excess > 0:
            for key in list(itertools.islice(since, excess)):
                del since[key]

    def take(self, keys: Sequence[str]) -> list[bool]:
        """Which keys were answered absent within ``fresh_s``; each answer is used once."""
        oldest = time.monotonic() - self.fresh_s
        since = self._since
        return [since.pop(key, oldest - 1.0) >= oldest for key in keys]
