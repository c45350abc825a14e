"""Store lock files across ``fork``: a forked child gets an open file of its own for each one.

The embedded stores (``local://``, ``arena://``) guard their shared state with ``flock`` on a lock
file, and rely on the kernel releasing the lock of a process that dies. But an ``flock`` belongs
to an open file description, which ``fork`` shares with the child: a process killed inside a
section would leave the store locked for as long as any child it forked lives (a helper process
that never uses kvflow), and every other process's puts and opens would time out meanwhile. So
after a fork the child opens each lock file again (through ``/proc/self/fd``: the same file, a new
open file description, its status flags kept) onto the same descriptor number. A lock the parent
holds is then the parent's alone, and the kernel releases it when the parent dies.

A descriptor is reopened only while it still names the lock file it was registered with (its
device and inode): a child that closed what it inherited may hold another file under that number.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["closing", "opened"]

# descriptor -> (device, inode) of the store lock file it names; set operations hold the GIL, and
# no lock is taken (one held by another thread at a fork would stay held in the child for good)
_OPEN: dict[int, tuple[int, int]] = {}


def opened(fd: int) -> None:
    """``fd`` is a store's lock file, open from now until :func:`closing`."""
    st = os.fstat(fd)
    _OPEN[fd] = (st.st_dev, st.st_ino)


def closing(fd: int) -> None:
    """``fd`` is about to be closed (its number may then name another file)."""
    _OPEN.pop(fd, None)


def _after_fork_in_child() -> None:
    for fd, file in list(_OPEN.items()):
        with contextlib.suppress(OSError):  # not reopened: the child shares the parent's, as before
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != file:  # the number names another file now
                _OPEN.pop(fd, None)
                continue
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            new = os.open(f"/proc/self/fd/{fd}", (flags & os.O_ACCMODE) | os.O_CLOEXEC)
            try:
                fcntl.fcntl(new, fcntl.F_SETFL, flags)
                os.dup2(new, fd, inheritable=False)
            finally:
                os.close(new)


os.register_at_fork(after_in_child=_after_fork_in_child)
