"""Who a local store is for, and how its directory is opened so that nobody else gets in.

A store is private to the user who opens it (the default), or shared with one group that the URL
names (``?group=kvusers``): every member of that group is then trusted like the user. See
``docs/security.md`` for the threat model.

:class:`Access` says who the store is for and which modes kvflow gives what it creates (``0700``
directories and ``0600`` files; shared: ``2770`` and ``0660``), whatever the umask.
:class:`StoreDirs` opens the store directory, its ``objects/`` and ``tmp/`` subdirectories and its
lock file, creating what is missing. It refuses, with a :class:`~kvflow.errors.ConfigError` naming
the path, owner and mode, anything that is a symlink, belongs to a user (or group) the access does
not trust, or can be written by users it does not trust. Every later operation goes through the
descriptors it holds (``dir_fd``), so a path swapped afterwards is never followed.

Everything here is synchronous and thread-agnostic.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import pwd
import stat
from collections.abc import Iterator

import attrs

from kvflow.backends import lockfiles
from kvflow.errors import ConfigError

__all__ = [
    "LOCK_NAME",
    "Access",
    "StoreDirs",
    "open_root",
    "open_store_file",
    "opening",
    "unusable_message",
    "user_name",
]

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_ONLY = getattr(os, "O_PATH", os.O_RDONLY)
LOCK_NAME = "kvflow.lock"


def user_name(uid: int) -> str:
    """``alice (uid 1000)``, or ``uid 1000`` when the user has no name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def group_name(gid: int) -> str:
    """``kvusers (gid 1234)``, or ``gid 1234`` when the group has no name."""
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _describe(st: os.stat_result) -> str:
    return f"owner {user_name(st.st_uid)}, group {group_name(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"


@attrs.frozen
class Access:
    """Who a store is for: the user ``uid`` alone (``gid`` None) or every member of group ``gid``."""

    uid: int
    gid: int | None = None

    @classmethod
    def of(cls, group: str | None) -> Access:
        """This process's user alone, or shared with ``group`` (a name or a numeric gid).

        Raises ConfigError for a group that does not exist or that this user is not a member of.
        """
        uid = os.geteuid()
        if group is None:
            return cls(uid)
        gid = _resolve_group(group)
        if gid != os.getegid() and gid not in os.getgroups():
            raise ConfigError(
                f"group={group} names {group_name(gid)}, but {user_name(uid)} is not a member of it; "
                "a store can only be shared with a group you belong to (add yourself with "
                "usermod -aG GROUP USER and log in again), or leave group= out for a private store"
            )
        return cls(uid, gid)

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o2770

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    def describe(self) -> str:
        if self.gid is None:
            return f"private to {user_name(self.uid)}"
        return f"shared with group {group_name(self.gid)}"

    def foreign(self, st: os.stat_result) -> str | None:
        """Why a file found in the store is not one of its objects or temp files; None when it is."""
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if self.gid is None and st.st_uid != self.uid:
            return f"owned by {user_name(st.st_uid)}"
        if self.gid is not None and st.st_gid != self.gid:
            return f"of group {group_name(st.st_gid)}"
        if st.st_mode & (0o002 if self.gid is not None else 0o022):
            return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        return None

    def verify(self, fd: int, path: str, *, directory: bool, created: bool, may_fix: bool) -> None:
        """Check (and, where allowed, correct) an opened directory or file of the store.

        ``created``: this process just made it; it gets exactly the access's group and mode.
        ``may_fix``: it is a part of a store this user owns: access bits beyond the modes are
        removed and missing group bits added. Otherwise those are refused. An owner or a group the
        access does not trust, write access for untrusted users, or the wrong file type always are.
        """
        st = os.fstat(fd)
        kind = "directory" if directory else "file"
        if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
            raise ConfigError(f"{path} is not a {kind} ({_describe(st)}); remove it or use another path")
        want = self.dir_mode if directory else self.file_mode
        if created and st.st_uid == self.uid:
            if self.gid is not None and st.st_gid != self.gid:
                os.fchown(fd, -1, self.gid)
            os.fchmod(fd, want)
            st = os.fstat(fd)
        self._check_trust(st, path)
        mode = stat.S_IMODE(st.st_mode)
        # User bits are the owner's business; group/other bits and (shared) setgid are kvflow's.
        required = want & 0o2070 if directory else want & 0o060
        extra = mode & 0o077 & ~want
        if not extra and mode & required == required:
            return
        fixed = (mode & 0o5700) | (want & 0o2077)
        if may_fix and st.st_uid == self.uid:
            os.fchmod(fd, fixed)
            logger.info("local backend: changed the mode of %s from %04o to %04o", path, mode, fixed)
            return
        raise ConfigError(
            f"refusing the local store {kind} {path}: its mode gives access kvflow does not expect for "
            f"a store {self.describe()} ({_describe(st)}). If it is yours, run chmod {fixed:o} {path}; "
            "if not, ask its owner to, or use another directory (see docs/security.md)"
        )

    def _check_trust(self, st: os.stat_result, path: str) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if self.gid is None and st.st_uid != self.uid:
            raise ConfigError(
                f"refusing the local store {path}: it belongs to another user ({_describe(st)}), so that "
                "user could read your KV objects or plant false ones. Give a path that does not exist "
                "yet (kvflow creates it, private to you), or ask an administrator to remove this one; "
                "to share a store on purpose, add ?group=NAME for a group you are both in "
                "(see docs/security.md)"
            )
        if self.gid is not None and st.st_gid != self.gid:
            raise ConfigError(
                f"refusing the local store {path}: it is not of group {group_name(self.gid)} that the "
                f"URL shares the store with ({_describe(st)}). Use a new directory, which kvflow creates "
                f"for the group, or have its owner run chgrp {self.gid} {path} and chmod 2770 {path}"
            )
        if mode & 0o002:
            raise ConfigError(
                f"refusing the local store {path}: every user of the host can write it ({_describe(st)}), "
                "so anyone could plant objects or swap its files. Remove it (if it is yours) and let "
                "kvflow create it, or use a directory of your own"
            )
        if self.gid is None and mode & 0o020:
            raise ConfigError(
                f"refusing the local store {path}: its group {group_name(st.st_gid)} can write it "
                f"({_describe(st)}), and the store is private. To share it with that group on purpose "
                f"add ?group={st.st_gid} to the URL; otherwise run chmod g-w,o-rwx {path}"
            )


def _resolve_group(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        pass
    if group.isascii() and group.isdigit():  # (str.isdigit takes "²" too, which int refuses)
        return int(group)
    raise ConfigError(f"group={group!r}: there is no such group; give a group name or a numeric gid")


@attrs.define
class StoreDirs:
    """Descriptors of a store's directory (``root_fd``), ``objects/``, ``tmp/`` and lock file.

    Owned by one backend instance, which closes them with :meth:`close`.
    """

    root: str
    access: Access
    root_fd: int
    objects_fd: int
    tmp_fd: int
    lock_fd: int

    @classmethod
    def open(cls, path: str, access: Access) -> StoreDirs:
        """Open (creating what is missing) and verify the store at the absolute ``path``.

        Raises ConfigError naming the path and what to do when it cannot be used safely.
        """
        root = os.path.normpath(path)
        with opening(root) as fds:
            fds.append(open_root(root, access))
            for name in ("objects", "tmp"):
                fds.append(_open_dir(fds[0], name, f"{root}/{name}", access, may_fix=True))
            fds.append(_open_lock(fds[0], f"{root}/{LOCK_NAME}", access))
        lockfiles.opened(fds[-1])  # a forked child gets its own (kvflow.backends.lockfiles)
        return cls(root, access, *fds)

    def close(self) -> None:
        lockfiles.closing(self.lock_fd)
        for fd in (self.lock_fd, self.tmp_fd, self.objects_fd, self.root_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def opening(root: str, *, backend: str = "local") -> Iterator[list[int]]:
    """A list for the descriptors a store at ``root`` opens: if opening fails they are all closed,
    and an OSError becomes a ConfigError saying what to do (``backend``: whose store it is, as its
    URL scheme: ``local`` or ``arena``)."""
    fds: list[int] = []
    try:
        yield fds
    except BaseException as exc:
        for fd in fds:
            os.close(fd)
        if isinstance(exc, OSError):
            raise ConfigError(unusable_message(root, exc, backend=backend)) from exc
        raise


def unusable_message(root: str, exc: OSError, *, backend: str = "local") -> str:
    """What to tell the user when ``exc`` stops kvflow from using the store at ``root`` (the
    ``backend`` one: its URL scheme, ``local`` or ``arena``)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"the {backend} backend cannot use {root}: the filesystem holding it is full "
            f"({exc.strerror}); free space (or inodes) there, or give a directory on another "
            "filesystem"
        )
    if exc.errno == errno.ENOMEM:  # mapping an arena: more than this process's address space
        return (
            f"the {backend} backend cannot use {root}: there is no memory or address space left for "
            f"it ({exc.strerror}); raise this process's address-space limit (ulimit -v), give a "
            "smaller capacity, or free memory"
        )
    return (
        f"the {backend} backend cannot use {root}: {exc.strerror or exc}; give a directory this process "
        f"can create and write, e.g. {backend}:// (a private directory in /dev/shm)"
    )


def open_root(root: str, access: Access, *, create: bool = True) -> int:
    """Open (creating it and its parents if missing) and verify the store directory ``root``.

    ``create`` False: nothing is made; FileNotFoundError when ``root`` or a parent is missing (for
    tools that look at a store, which check it before they read anything in it).
    """
    parent, name = os.path.split(root)
    if not name or not parent:
        raise ConfigError(f"the local backend needs a directory of its own, not {root!r}")
    if create:
        _make_parents(parent, access)
    parent_fd = os.open(parent, _PATH_ONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # search access is enough
    try:
        return _open_dir(parent_fd, name, root, access, may_fix=None, create=create)
    finally:
        os.close(parent_fd)


def _make_parents(parent: str, access: Access) -> None:
    """Create the missing directories above a store: private, or searchable by the group."""
    missing: list[str] = []
    path = parent
    while not os.path.isdir(path) and not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        fd = os.open(path, _DIR_FLAGS)
        try:
            if access.gid is not None:
                os.fchown(fd, -1, access.gid)
            os.fchmod(fd, 0o700 if access.gid is None else 0o710)
        finally:
            os.close(fd)


def _open_dir(
    dir_fd: int, name: str, path: str, access: Access, *, may_fix: bool | None, create: bool = True
) -> int:
    """Open (creating it if missing and ``create``) directory ``name`` in ``dir_fd``, never through
    a symlink.

    ``may_fix`` None: fix modes only when it is a kvflow store of this user (it holds our lock file).
    """
    created = False
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            created = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse_if_symlink(dir_fd, name, path, directory=True)
        raise
    try:
        if may_fix is None:
            may_fix = created or _holds_own_lock(fd, access)
        access.verify(fd, path, directory=True, created=created, may_fix=may_fix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(root_fd: int, path: str, access: Access) -> int:
    return open_store_file(root_fd, LOCK_NAME, path, access)


def open_store_file(root_fd: int, name: str, path: str, access: Access, *, create: bool = True) -> int:
    """Open (read-write; creating it, empty, if ``create``) the store's file ``name`` in ``root_fd``.

    Never through a symlink, and never blocking: what is there is opened ``O_NONBLOCK`` (a FIFO
    never hangs the caller) and checked through the descriptor before anything is read; a file
    kvflow did not make (not a regular file, another user's), or one open to users the access does
    not trust, is refused with a ConfigError (its modes are corrected when it is this user's). The
    descriptor returned is blocking again. Raises FileNotFoundError when it is missing and
    ``create`` is False.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    created = False
    if create:
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, access.file_mode, dir_fd=root_fd)
            created = True
        except FileExistsError:
            pass
    if not created:
        try:
            fd = os.open(name, flags, dir_fd=root_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                _refuse_if_symlink(root_fd, name, path, directory=False)
            raise
    try:
        access.verify(fd, path, directory=False, created=created, may_fix=True)
        os.set_blocking(fd, True)  # a regular file: the flag changes nothing, but none is left set
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_if_symlink(dir_fd: int, name: str, path: str, *, directory: bool) -> None:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=dir_fd)
        raise ConfigError(
            f"refusing the local store path {path}: it is a symbolic link (to {target!r}, owner "
            f"{user_name(st.st_uid)}); kvflow opens nothing through a symlink, which could point it at "
            "files it must not touch. Give the real directory's path, or remove the link"
        )
    if directory and not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} is not a directory ({_describe(st)}); remove it or use another path")


def _holds_own_lock(fd: int, access: Access) -> bool:
    try:
        st = os.stat(LOCK_NAME, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == access.uid
