"""Configuration values: sizes, durations, backend URLs, attrs validators and the pool's settings.

Every value is checked when it is built: a size or count is an ``int`` (never a ``bool``), a
duration a finite number of seconds; each error names the field and says what to write instead.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

import attrs

from kvflow.errors import ConfigError

__all__ = [
    "PoolConfig",
    "nonnegative_int",
    "parse_seconds",
    "parse_size",
    "parse_url_query",
    "positive_int",
    "positive_seconds",
    "split_url",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*((?:[kmgt]i?)?b?)\s*$", re.IGNORECASE)
_MAX_SIZE = 1 << 62  # more than any store holds: a larger size is a mistake
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_size(text: str | int) -> int:
    """``"256MiB"`` -> 268435456; ``"1GB"`` -> 10**9; ``"4096"`` -> 4096. Raises ConfigError."""
    if _is_int(text):
        assert isinstance(text, int)
        if not 0 <= text <= _MAX_SIZE:
            raise ConfigError(f"a size must be >= 0 and at most 4 EiB, got {text}")
        return text
    if not isinstance(text, str):
        raise ConfigError(f"a size must be an integer or text like 256MiB, got {text!r}")
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 4096, 256MiB, 1GiB or 2GB")
    number, unit = match.group(1), (match.group(2) or "").lower()
    binary = "i" in unit
    letter = unit[:1] if unit[:1] != "b" else ""
    scale = 1024 ** "kmgt".index(letter) * 1024 if binary and letter else _UNITS[letter]
    exact = Fraction(number) * scale  # (a float would lose the low bits of a large integer)
    if exact.denominator != 1:
        raise ConfigError(f"{text!r} is not a whole number of bytes; write e.g. {math.ceil(exact)}")
    if exact > _MAX_SIZE:
        raise ConfigError(f"{text!r} is larger than any store (at most 4 EiB)")
    return int(exact)


def parse_seconds(text: str | float, what: str) -> float:
    """A finite, positive number of seconds from text or a number; ConfigError naming ``what``."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be a number of seconds, got {text!r}")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a finite number of seconds > 0, got {text!r}")
    return value


def split_url(url: str) -> SplitResult:
    """``urllib.parse.urlsplit``, with ConfigError for a URL it cannot read (brackets around
    something that is not an IPv6 address, say)."""
    try:
        return urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"cannot read the URL {url!r}: {exc}; an IPv6 host is written [ADDRESS]") from None


def parse_url_query(url: str, *, scheme: str, allowed: set[str]) -> dict[str, str]:
    """The query parameters of a backend URL, checking its scheme and the parameter names.

    Refuses a URL that is not text, contains a NUL byte, a tab or a newline, repeats a parameter
    or names one the scheme does not take.
    """
    if not isinstance(url, str):
        raise ConfigError(f"a backend URL must be text, got {url!r}")
    if any(c in url for c in "\x00\t\r\n"):  # (urlsplit drops tabs and newlines without a word)
        raise ConfigError(f"the backend URL {url!r} contains a NUL, tab or newline; remove it")
    parts = split_url(url)
    if parts.scheme != scheme:
        raise ConfigError(f"expected a {scheme}:// URL, got {url!r}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    params = dict(pairs)
    if len(params) != len(pairs):
        raise ConfigError(f"a parameter appears twice in {url!r}; give each once")
    unknown = set(params) - allowed
    if unknown:
        hint = f"allowed: {sorted(allowed)}" if allowed else f"{scheme}:// takes no parameters"
        raise ConfigError(f"unknown parameter(s) {sorted(unknown)} in {url!r}; {hint}")
    return params


def positive_int(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """attrs validator: an ``int`` (not a bool) > 0."""
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(f"{attribute.name} must be an integer > 0, got {value!r}")


def nonnegative_int(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """attrs validator: an ``int`` (not a bool) >= 0."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ConfigError(f"{attribute.name} must be an integer >= 0, got {value!r}")


def positive_seconds(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """attrs validator: a finite number of seconds > 0 (not a bool)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value <= 0:  # type: ignore[operator]
        raise ConfigError(f"{attribute.name} must be a finite number of seconds > 0, got {value!r}")


def _text(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigError(f"{attribute.name} must be non-empty text without NUL bytes, got {value!r}")


def _one_of(*choices: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ConfigError(
                f"{attribute.name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
            )

    return check


def _flag(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False, got {value!r}")


@attrs.frozen
class PoolConfig:
    """Settings of a pool (:class:`kvflow.KVPool` and the synchronous faces).

    ``backend``: the store's URL (``memory://``, ``local:///dev/shm/...``, ``mooncake://host:port``).
    ``model``: the model name in every key; pools share objects only under the same name.
    ``max_inflight_bytes`` bounds the bytes a pool has in backend calls at once (backpressure).
    ``timeout_s`` bounds each store, retrieve and lookup, counted from the call.
    ``layerwise``: one object per block and layer instead of one per block.
    ``staging``: move blocks through host staging buffers: ``"auto"`` (when the KV cache is on a
    device the backend cannot read or write), ``"always"`` (also host caches: how the device path is
    tested on a CPU), ``"never"`` (a device cache the backend cannot reach is then refused).
    ``staging_bytes``: the staging buffers, allocated once per pool (pinned when on a device).
    ``hash_tokens``: tokens per hash of a prompt's hash chain (default: the block size). A block's
    key uses the chain's hash at its last token, so pools with different block sizes and the same
    ``hash_tokens`` find each other's blocks (docs/topology.md); ``KVRequest.block_hashes`` then
    holds one hash per ``hash_tokens`` tokens.
    """

    backend: str = attrs.field(default="memory://", validator=_text)
    model: str = attrs.field(default="model", validator=_text)
    max_inflight_bytes: int = attrs.field(default=1 << 30, validator=positive_int)
    timeout_s: float = attrs.field(default=30.0, validator=positive_seconds)
    layerwise: bool = attrs.field(default=False, validator=_flag)
    staging: str = attrs.field(default="auto", validator=_one_of("auto", "always", "never"))
    staging_bytes: int = attrs.field(default=256 << 20, validator=positive_int)
    hash_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive_int))
