"""What one process found in the store, kept true by the store's journal of removed objects.

A lookup asks whether many objects exist; asking the directory costs one ``stat`` per object
(about 4 us). So a backend remembers the objects its lookups found, and answers those from memory
for as long as none of them has left the store since. Every process that removes an object
(an eviction, a ``remove``, a damaged object dropped) appends the hash of its file name to the
store's journal, inside its locked section; before answering from memory, a reader reads what was
appended since it last looked and forgets those names. Readers take no lock.

The journal lives in the lock file, after the usage counter::

    offset 16   u64   entries ever appended (the count)
    offset 24   u64   the count the append in progress (or the last one) ends at (the pending end)
    offset 64   u64 x RING   name hashes; entry n at 64 + 8 * (n % RING)

An append writes the pending end first, then its entries, then the count: like a seqlock, a
reader reads the count, the entries, then the pending end, and an entry it read may have been
overwritten only if that end is more than ``RING`` past where it started reading. A reader that
fell more than ``RING`` entries behind, or is overtaken so while it reads, forgets everything. (A
writer killed between the pending end and the count leaves the end ahead until the next append:
meanwhile a reader far enough behind forgets everything at each refresh, a hint lost, no more.) (A
writer from before the pending end publishes its count only: a reader then sees the count move.)
What it answers from memory is a hint, as every lookup is: an object may be evicted right after any
answer, and a get checks what it reads, so a stale "present" costs a miss, never wrong data. A
process killed between removing an object and appending its entry leaves others remembering that
object until they forget everything (the memory is bounded; a full memory starts afresh).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping, Sequence

import attrs

from kvflow.backends.local.format import name_hash

__all__ = ["RING", "PresenceMemory", "append_removed", "journal_end", "read_journal_count"]

logger = logging.getLogger(__name__)

RING = 4096
_COUNT_AT = 16
_PENDING_AT = 24  # right after the count: one read gets both
_RING_AT = 64
JOURNAL_END = _RING_AT + 8 * RING
_U64 = struct.Struct("<Q")
_ENDS = struct.Struct("<QQ")  # the count, then the pending end
_LIMIT = 1 << 17  # names remembered per backend instance


def read_journal_count(fd: int) -> int:
    """How many removals the journal has recorded (0 for a lock file written before it existed)."""
    data = os.pread(fd, 8, _COUNT_AT)
    return _U64.unpack(data)[0] if len(data) == 8 else 0


def journal_end(fd: int) -> int:
    """How far any writer has written the journal, or begun to: the larger of the count and the
    pending end (a lock file older than the pending end has zeros there)."""
    data = os.pread(fd, _ENDS.size, _COUNT_AT)
    if len(data) < _ENDS.size:
        return read_journal_count(fd)
    count, pending = _ENDS.unpack(data)
    return max(int(count), int(pending))


def append_removed(fd: int, count: int, names: Sequence[str]) -> int:
    """Record removed object files after ``count`` entries (under the store's lock); return the new
    count. The pending end is written first, so a reader that may have read an entry this append
    overwrote sees, after reading, that it was overtaken; the entries are written before the
    count, so a reader that sees the count sees them."""
    os.pwrite(fd, _U64.pack(count + len(names)), _PENDING_AT)
    hashes = [name_hash(n) for n in names[-RING:]]
    first = count + len(names) - len(hashes)
    while hashes:
        slot = first % RING
        run = hashes[: RING - slot]
        os.pwrite(fd, b"".join(_U64.pack(h) for h in run), _RING_AT + 8 * slot)
        hashes, first = hashes[len(run) :], first + len(run)
    count += len(names)
    os.pwrite(fd, _U64.pack(count), _COUNT_AT)
    return count


@attrs.define
class PresenceMemory:
    """Keys this backend instance found present, valid as of journal entry ``_seen``.

    Call :meth:`refresh` before answering from memory and before the ``stat``s whose answers
    :meth:`add` records: an answer recorded after a refresh is valid as of that refresh's count.
    """

    lock_fd: int
    limit: int = _LIMIT
    _seen: int = -1
    _keys: dict[str, int] = attrs.field(factory=dict)  # key -> hash of its file name
    _by_hash: dict[int, str] = attrs.field(factory=dict)

    @property
    def keys(self) -> Mapping[str, int]:
        """The keys remembered present (read it after :meth:`refresh`; do not keep it)."""
        return self._keys

    def add(self, found: Sequence[tuple[str, str]]) -> None:
        """Remember keys (with their file names) found present after the last refresh."""
        if len(self._keys) + len(found) > self.limit:
            self.forget()
        keys, by_hash = self._keys, self._by_hash
        for key, name in found[: self.limit]:
            h = name_hash(name)
            if h not in by_hash:  # two names, one hash: remember one, so that a removal forgets it
                keys[key] = h
                by_hash[h] = key

    def discard(self, key: str) -> None:
        """Forget ``key`` (a get found no object for it)."""
        h = self._keys.pop(key, None)
        if h is not None:
            del self._by_hash[h]

    def forget(self) -> None:
        self._keys.clear()
        self._by_hash.clear()

    def refresh(self) -> None:
        """Forget every remembered object the journal says was removed since the last refresh."""
        count = read_journal_count(self.lock_fd)
        seen, self._seen = self._seen, count
        if count == seen or not self._keys:
            return
        if seen < 0 or count < seen or count - seen > RING:
            self.forget()
            return
        hashes = self._read(seen, count)
        if journal_end(self.lock_fd) - seen > RING:  # a writer went round the ring while it was read
            self.forget()
            return
        for h in hashes:
            key = self._by_hash.pop(h, None)
            if key is not None:
                del self._keys[key]

    def _read(self, start: int, end: int) -> list[int]:
        out: list[int] = []
        while start < end:
            slot = start % RING
            n = min(end - start, RING - slot)
            data = os.pread(self.lock_fd, 8 * n, _RING_AT + 8 * slot)
            out += [h for (h,) in _U64.iter_unpack(data[: len(data) - len(data) % 8])]
            if len(data) < 8 * n:  # a journal shorter than its count: trust nothing
                logger.debug("the removal journal ends early; forgetting every remembered object")
                return list(self._by_hash)
            start += n
        return out
