"""Backend URLs: what each scheme takes, and a ConfigError that says what to write for the rest."""

from __future__ import annotations

import os

import pytest

from kvflow.backends import open_backend
from kvflow.backends.local import LocalConfig
from kvflow.backends.memory import MemoryBackend, MemoryConfig
from kvflow.backends.mooncake.config import MooncakeConfig
from kvflow.errors import ConfigError


def test_the_bare_local_url_is_a_private_directory_of_this_user() -> None:
    uid = os.geteuid()
    assert LocalConfig.from_url("local://").path == f"/dev/shm/kvflow-{uid}"
    assert LocalConfig.from_url("local://?capacity=1GiB") == LocalConfig(capacity_bytes=1 << 30)
    assert LocalConfig.from_url("local:///srv/kv?group=kvusers").group == "kvusers"
    assert LocalConfig.from_url("local:///srv/kv").group is None


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("local:///x?lock_timeout=nan", "lock_timeout in 'local:///x.*finite"),
        ("local:///x?lock_timeout=inf", "finite"),
        ("local:///x?lock_timeout=-1", "> 0"),
        ("local:relative_dir", "absolute"),
        ("local:relative/dir?capacity=1GiB", "local:///absolute/path"),
        ("local:///x%00y", "NUL"),
        ("local:///x\x00y", "NUL"),
        ("local:///x#part", "fragment"),
        ("local://dev/shm/kvflow", "three slashes"),
        ("local:///x?group=", "group"),
        ("local://?group=kvusers", "every member"),
        ("local:///x?capacity=1GiB&capacity=2GiB", "twice"),
        ("local:///x?segment=1GiB", "allowed"),
        ("local:///", "below /"),
    ],
)
def test_bad_local_urls_say_what_to_write(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        LocalConfig.from_url(url)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"path": "relative"}, "absolute"),
        ({"path": "/x\x00y"}, "NUL"),
        ({"path": "/"}, "below /"),
        ({"lock_timeout_s": float("nan")}, "finite"),
        ({"lock_timeout_s": float("inf")}, "finite"),
        ({"group": ""}, "group"),
        ({"group": "kv/users"}, "group"),
        ({"group": "kv\x00users"}, "group"),
    ],
)
def test_bad_local_configs_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        LocalConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    ["memory://host:1", "memory://host", "memory:///some/path", "memory://#part", "memory://?size=1GiB"],
)
def test_the_memory_backend_takes_only_a_capacity(url: str) -> None:
    with pytest.raises(ConfigError, match="memory://"):
        MemoryConfig.from_url(url)


def test_good_memory_urls() -> None:
    assert MemoryConfig.from_url("memory://") == MemoryConfig()
    backend = open_backend("memory://?capacity=2MiB")
    assert isinstance(backend, MemoryBackend) and backend.config.capacity_bytes == 2 << 20
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="capacity"):
            MemoryConfig(capacity_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mooncake://127.0.0.1:1/some/path", "path"),
        ("mooncake://127.0.0.1:1#part", "fragment"),
        ("mooncake://user@127.0.0.1:1", "user"),
        ("mooncake://127.0.0.1:1?timeout=nan", "timeout in"),
        ("mooncake://127.0.0.1:1?setup_timeout=inf", "setup_timeout in"),
        ("mooncake://127.0.0.1:1?probe_timeout=0", "probe_timeout in"),
        ("mooncake://127.0.0.1:1?local_hostname=a%00b", "NUL"),
        ("mooncake://127.0.0.1:1?config=/x%00y", "NUL"),
    ],
)
def test_bad_mooncake_urls_say_what_to_write(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        MooncakeConfig.from_url(url)


@pytest.mark.parametrize(
    ("query", "reaches"),
    [
        ("", False),  # tcp: host memory only, device caches are staged
        ("?protocol=rdma", False),  # RDMA without a build known to reach GPU memory
        ("?protocol=ascend", True),  # Ascend's transport moves NPU memory itself
        ("?device_memory=true", True),
        ("?protocol=ascend&device_memory=false", False),
    ],
)
def test_mooncake_says_whether_it_reaches_device_memory(query: str, reaches: bool) -> None:
    """What the pool reads to decide between zero copy and host staging for a device cache."""
    from kvflow.backends.mooncake import MooncakeBackend

    backend = MooncakeBackend.from_url(f"mooncake://127.0.0.1:50051{query}")
    assert backend.capabilities.device_memory is reaches
    with pytest.raises(ConfigError, match="auto, true or false"):
        MooncakeConfig.from_url("mooncake://127.0.0.1:50051?device_memory=yes")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "local://host/x",
            "'local://host/x' names a host ('host'); the local backend takes a directory: write "
            "local:///absolute/path (three slashes)",
        ),
        (
            "local:x/y",
            "'local:x/y' names a relative path ('x/y'); the local backend takes an absolute directory: "
            "write local:///absolute/path (three slashes), or local:// for the default",
        ),
        ("local:///a%00b", "the path in 'local:///a%00b' contains a NUL byte (%00); remove it"),
        (
            "local://?group=kv",
            "'local://?group=kv' shares a store with a group but names no directory; give one that every "
            "member uses, e.g. local:///dev/shm/kv-shared?group=kvusers",
        ),
        (
            "local:///a/b?lock_timeout=-1",
            "lock_timeout in 'local:///a/b?lock_timeout=-1' must be a finite number of seconds > 0, got '-1'",
        ),
        (
            "local:///",
            "the local store path must be an absolute directory below /, got '/': write e.g. "
            "local:///dev/shm/my-store, or local:// for the private default",
        ),
    ],
)
def test_bad_local_urls_are_refused_word_for_word(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        LocalConfig.from_url(url)
    assert str(info.value) == message


@pytest.mark.parametrize("group", ["a/b", "a\x00b", ""])
def test_a_group_that_is_not_a_name_or_gid_is_refused(group: str) -> None:
    with pytest.raises(ConfigError) as info:
        LocalConfig("/dev/shm/x", group=group)
    assert str(info.value) == f"group must be a group name or a numeric gid, got {group!r}"
