from __future__ import annotations

import pytest

from kvflow import ConfigError, PoolConfig, open_backend
from kvflow.config import parse_size


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("1KiB", 1024),
        ("256MiB", 256 << 20),
        ("1GiB", 1 << 30),
        ("2GB", 2 * 10**9),
        ("1.5KiB", 1536),
        (7, 7),
        ("10 b", 10),
    ],
)
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "1XB", -5])
def test_bad_sizes_are_rejected(text: str | int) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_bad_urls_and_values() -> None:
    with pytest.raises(ConfigError, match="unknown backend URL"):
        open_backend("redis://localhost")
    with pytest.raises(ConfigError, match="unknown parameter"):
        open_backend("memory://?capcity=1GiB")
    with pytest.raises(ConfigError, match="capacity"):
        open_backend("memory://?capacity=0")
    with pytest.raises(ConfigError, match="timeout_s"):
        PoolConfig(timeout_s=0)
