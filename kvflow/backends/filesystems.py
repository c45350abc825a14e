"""Which kind of filesystem holds a store's directory: an arena belongs in memory.

``arena://`` maps one file and writes objects into it; on tmpfs (``/dev/shm``) that is memory,
but on a disk's filesystem the kernel also writes every stored object back to the disk, which is
slower, wears the disk, and keeps nothing a cache needs after a reboot. Opening an arena there is
allowed and logs one warning. (``local://`` on a disk is a documented choice: its files are read
back through the page cache, docs/local-backend.md.)
"""

from __future__ import annotations

import logging
import os

__all__ = ["IN_MEMORY", "filesystem_type", "type_of_device", "warn_unless_in_memory"]

logger = logging.getLogger(__name__)

#: Filesystems whose files live in memory only.
IN_MEMORY = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_MOUNTS = "/proc/self/mountinfo"


def type_of_device(device: str, mountinfo: str) -> str | None:
    """The filesystem type that ``mountinfo`` (the text of ``/proc/self/mountinfo``) gives for the
    device ``"major:minor"``; None when no line names it."""
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        columns, after = fields.split(), rest.split()
        if len(columns) > 2 and columns[2] == device and after:
            return after[0]
    return None


def filesystem_type(fd: int) -> str | None:
    """The type of the filesystem holding the open file or directory ``fd`` (``"tmpfs"``,
    ``"ext4"``...); None where the mount table cannot be read (not Linux)."""
    dev = os.fstat(fd).st_dev
    try:
        with open(_MOUNTS, encoding="utf-8", errors="replace") as f:
            mountinfo = f.read()
    except OSError:
        return None
    return type_of_device(f"{os.major(dev)}:{os.minor(dev)}", mountinfo)


def warn_unless_in_memory(fd: int, root: str, scheme: str) -> None:
    """Log a warning when the store directory ``root`` (open as ``fd``) is not on a filesystem in
    memory."""
    kind = filesystem_type(fd)
    if kind is not None and kind not in IN_MEMORY:
        logger.warning(
            "the %s:// store %s is on a filesystem of type %s, not in memory: every object it stores is "
            "also written to the disk, which is slower and wears it. Give a directory on tmpfs, such as "
            "%s:///dev/shm/kvflow-store",
            scheme,
            root,
            kind,
            scheme,
        )
