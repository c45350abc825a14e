"""Configuration values: sizes, backend URLs and the pool's settings."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import attrs

from kvflow.errors import ConfigError

__all__ = ["PoolConfig", "nonnegative", "parse_size", "parse_url_query", "positive"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_size(text: str | int) -> int:
    """``"256MiB"`` -> 268435456; ``"1GB"`` -> 10**9; ``"4096"`` -> 4096. Raises ConfigError."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"a size must be >= 0, got {text}")
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 4096, 256MiB, 1GiB or 2GB")
    number, unit = match.group(1), (match.group(2) or "").lower()
    binary = "i" in unit
    letter = unit[:1] if unit[:1] != "b" else ""
    scale = 1024 ** "kmgt".index(letter) * 1024 if binary and letter else _UNITS[letter]
    return int(float(number) * scale)


def parse_url_query(url: str, *, scheme: str, allowed: set[str]) -> dict[str, str]:
    """The query parameters of a backend URL, checking its scheme and the parameter names."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ConfigError(f"expected a {scheme}:// URL, got {url!r}")
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(params) - allowed
    if unknown:
        raise ConfigError(f"unknown parameter(s) {sorted(unknown)} in {url!r}; allowed: {sorted(allowed)}")
    return params


def positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """attrs validator: the value must be > 0 (ConfigError naming the field otherwise)."""
    if value <= 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value}")


def nonnegative(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """attrs validator: the value must be >= 0 (ConfigError naming the field otherwise)."""
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class PoolConfig:
    """Settings of a :class:`kvflow.KVPool`.

    ``max_inflight_bytes`` bounds the bytes a pool has in backend calls at once (backpressure).
    ``timeout_s`` bounds each store, retrieve and lookup at the API edge.
    """

    backend: str = "memory://"
    model: str = "model"
    max_inflight_bytes: int = attrs.field(default=1 << 30, validator=positive)
    timeout_s: float = attrs.field(default=30.0, validator=positive)
    layerwise: bool = False
