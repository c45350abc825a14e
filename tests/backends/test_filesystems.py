"""An arena opened on a filesystem that is not in memory is allowed, and says so once, in the log."""

from __future__ import annotations

import logging
import os

import pytest

from kvflow.backends import filesystems
from kvflow.backends.arena import ArenaBackend, ArenaConfig
from tests.helpers import bounded_shm

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime shared:4 - tmpfs tmpfs rw,size=24683792k
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
40 27 254:0 /srv /mnt/with\\040space rw master:1 - ext4 /dev/vda rw
41 27 0:99 / /broken rw
"""


@pytest.mark.parametrize(
    ("device", "kind"),
    [("0:23", "tmpfs"), ("254:0", "ext4"), ("0:21", "proc"), ("0:99", None), ("8:1", None)],
)
def test_the_mount_table_names_the_type_of_a_device(device: str, kind: str | None) -> None:
    """Optional fields before the separator and escaped mount points do not shift the type; a line
    without the separator names nothing."""
    assert filesystems.type_of_device(device, MOUNTINFO) == kind


def test_a_directory_on_tmpfs_is_in_memory() -> None:
    with bounded_shm("16m") as path:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert filesystems.filesystem_type(fd) in filesystems.IN_MEMORY
        finally:
            os.close(fd)


@pytest.mark.parametrize("kind", ["ext4", "tmpfs"])
async def test_an_arena_on_a_disk_filesystem_is_opened_with_a_warning(
    kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(filesystems, "filesystem_type", lambda fd: kind)
    with bounded_shm("64m") as path, caplog.at_level(logging.WARNING, logger="kvflow.backends.filesystems"):
        root = str(path / "store")
        backend = ArenaBackend(ArenaConfig(root, capacity_bytes=1 << 20, slot_bytes=64 << 10))
        await backend.aclose()
    warned = [r.getMessage() for r in caplog.records if r.name == "kvflow.backends.filesystems"]
    if kind == "ext4":
        assert len(warned) == 1 and f"arena:// store {root} is on a filesystem of type ext4" in warned[0]
    else:
        assert warned == []
