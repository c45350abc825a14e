"""Store lock files across ``fork``: a forked child gets an open file of its own for each one.

The embedded stores (``local://``, ``arena://``) guard their shared state with ``flock`` on a lock
file, and rely on the kernel releasing the lock of a process that dies. But an ``flock`` belongs
to an open file description, which ``fork`` shares with the child: a process killed inside a
section would leave the store locked for as long as any child it forked lives (a helper process
that never uses kvflow), and every other process's puts and opens would time out meanwhile. So
after a fork the child opens each lock file again (through ``/proc/self/fd``: the same file, a new
open file description) onto the same descriptor number. A lock the parent holds is then the
parent's alone, and the kernel releases it when the parent dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading

__all__ = ["closing", "opened"]

_OPEN: set[int] = set()  # descriptors of store lock files open in this process
_LOCK = threading.Lock()


def opened(fd: int) -> None:
    """``fd`` is a store's lock file, open from now until :func:`closing`."""
    with _LOCK:
        _OPEN.add(fd)


def closing(fd: int) -> None:
    """``fd`` is about to be closed (its number may then name another file)."""
    with _LOCK:
        _OPEN.discard(fd)


def _after_fork_in_child() -> None:
    for fd in list(_OPEN):  # (one thread in the child: nothing else changes the set)
        with contextlib.suppress(OSError):  # not reopened: the child shares the parent's, as before
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
            new = os.open(f"/proc/self/fd/{fd}", mode | os.O_CLOEXEC)
            try:
                os.dup2(new, fd, inheritable=False)
            finally:
                os.close(new)


os.register_at_fork(after_in_child=_after_fork_in_child)
