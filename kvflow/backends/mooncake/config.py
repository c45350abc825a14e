"""Settings of the Mooncake backend, from a URL, a Mooncake JSON file or the environment.

``mooncake://127.0.0.1:50051?segment=1GiB&buffer=64MiB&protocol=tcp`` names the master and what this
client brings to the cluster. ``MooncakeConfig.from_file`` reads the ``mooncake.json`` that Mooncake
and vllm-ascend read through ``MOONCAKE_CONFIG_PATH``; a URL may point at one (``?config=PATH``) and
override any of its values. Pure values: nothing here imports Mooncake or opens a connection.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import attrs

from kvflow.config import (
    nonnegative_int,
    parse_seconds,
    parse_size,
    parse_url_query,
    positive_int,
    split_url,
)
from kvflow.errors import ConfigError

__all__ = ["MooncakeConfig", "parse_mooncake_size"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9003  # mooncake_master's --metrics_port default
MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments (INVALID_PARAMS at setup)
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
MIN_TIMEOUT_S = 0.01  # a shorter bound fails every call (a thread hand-off alone takes ~0.5 ms)
MAX_SECONDS = 86_400.0  # one day: any longer is a mistake (and overflows thread and socket timeouts)
#: Transports Mooncake's client accepts (mooncake/mooncake_config.py lists them; it matches lowercase).
PROTOCOLS = frozenset(
    {
        "tcp",
        "rdma",
        "efa",
        "nvmeof",
        "nvlink",
        "nvlink_intra",
        "musa",
        "hip",
        "barex",
        "cxl",
        "ascend",
        "ub",
        "ubshmem",
        "maca",
        "sunrise_link",
    }
)

# URL parameter -> attribute; each value is read by the converter named in _URL_READERS.
_URL_PARAMS = {
    "segment": "segment_bytes",
    "buffer": "buffer_bytes",
    "protocol": "protocol",
    "device": "device_name",
    "metadata": "metadata_server",
    "local_hostname": "local_hostname",
    "replicas": "replicas",
    "preferred_segment": "preferred_segment",
    "prefer_same_node": "prefer_same_node",
    "hard_pin": "hard_pin",
    "setup_retries": "setup_retries",
    "setup_timeout": "setup_timeout_s",
    "timeout": "timeout_s",
    "health_interval": "health_interval_s",
    "probe_timeout": "probe_timeout_s",
    "close_timeout": "close_timeout_s",
    "max_batch": "max_batch",
    "concurrency": "max_concurrency",
    "staging": "staging_bytes",
    "device_memory": "device_memory",
    "check_present": "check_present",
    "metrics_port": "metrics_port",
}

# Keys of Mooncake's own JSON config that kvflow uses, and the attribute each sets.
_JSON_KEYS = {
    "master_server_address": "master",
    "metadata_server": "metadata_server",
    "local_hostname": "local_hostname",
    "global_segment_size": "segment_bytes",
    "local_buffer_size": "buffer_bytes",
    "protocol": "protocol",
    "device_name": "device_name",
    "alloc_in_same_node": "prefer_same_node",
}
# Keys other tools put in the same file; accepted and not used by kvflow.
_JSON_IGNORED = {
    "use_ascend_direct",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
}

_MOONCAKE_SIZE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|k|m|g|t|kib|mib|gib|tib)?\s*$", re.IGNORECASE | re.ASCII
)
_BINARY = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_mooncake_size(value: object, *, name: str) -> int:
    """A size as Mooncake's own JSON files write it: ``"1GB"`` and ``"1GiB"`` both mean 2**30.

    Mooncake and vllm-ascend read KB/MB/GB as powers of 1024, so a file shared with them keeps
    its meaning here (unlike kvflow URLs, where ``GB`` is 10**9 and ``GiB`` is 2**30).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _MOONCAKE_SIZE.match(value)
        if match is not None:
            unit = (match.group(2) or "").lower()
            exact = Fraction(match.group(1)) * _BINARY[unit[:1]]
            if exact.denominator != 1:
                raise ConfigError(f"{name}={value!r} is not a whole number of bytes; write e.g. {int(exact)}")
            return int(exact)
    raise ConfigError(f'cannot read {name}={value!r} as a size; write e.g. 1073741824, "1GB" or "512MB"')


def _flag(text: str, *, name: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={text!r} is not a boolean; write {name}=true or {name}=false")


def _is_loopback(host: str) -> bool:
    """``localhost`` (any case), 127.0.0.0/8 in any form ``inet_aton`` reads (``127.1``), ``::1``,
    and IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not (host.isascii() and host.replace(".", "").isalnum()):
            return False
        try:  # the short IPv4 forms C resolvers accept (127.1), as Mooncake's does
            return socket.inet_aton(host)[0] == 127
        except OSError:
            return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def _ascii_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _check_master(_: object, __: attrs.Attribute[str], value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not _ascii_digits(port) or not 0 < int(port) < 65536:
        raise ConfigError(f"master address {value!r} must be HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT}")
    bracketed = host.startswith("[") and host.endswith("]")
    if not _is_ipv6(host[1:-1]) if bracketed else any(c in host for c in ":[]"):
        raise ConfigError(
            f"master address {value!r}: write an IPv6 host in brackets and nothing else there, "
            f"[HOST]:PORT, e.g. [::1]:{DEFAULT_PORT}"
        )


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def _port(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 < value < 65536:
        raise ConfigError(f"{attribute.name} must be a TCP port (1-65535), got {value}")


def _device_memory(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in ("auto", "true", "false"):
        raise ConfigError(f"device_memory must be auto, true or false, got {value!r}")


def _protocol(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in PROTOCOLS:
        raise ConfigError(
            f"protocol {value!r} is not one Mooncake knows; use tcp (any host) or rdma, or one of "
            f"{', '.join(sorted(PROTOCOLS - {'tcp', 'rdma'}))} (lowercase, no spaces)"
        )


def _seconds(low: float) -> Any:
    """attrs validator: a number of seconds, at least ``low`` (more than 0 when ``low`` is 0) and
    at most a day."""
    accepted = f"from {low:g} to {MAX_SECONDS:g}" if low else f"more than 0 and at most {MAX_SECONDS:g}"

    def check(_: object, attribute: attrs.Attribute[float], value: object) -> None:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not (value > 0 and low <= value <= MAX_SECONDS):  # type: ignore[operator]
            raise ConfigError(
                f"{attribute.name} must be a number of seconds {accepted} (a day), got {value!r}"
            )

    return check


@attrs.frozen
class MooncakeConfig:
    """How to reach a Mooncake master and what this client brings to the cluster.

    - ``segment_bytes``: memory this client contributes to the cluster (0: a pure client). Objects
      in it vanish when this client closes.
    - ``buffer_bytes``: Mooncake's client-side transfer buffer (not used by zero-copy calls).
    - ``replicas``, ``preferred_segment``, ``prefer_same_node``, ``hard_pin``: Mooncake's
      ``ReplicateConfig`` for every put.
    - ``protocol``: one of :data:`PROTOCOLS` (``tcp`` anywhere, ``rdma`` with a ``device_name``).
    - ``setup_retries``: Mooncake's ``MC_STORE_CLIENT_SETUP_RETRIES`` (about 4.4 s per retry when
      the master is down); ``setup_timeout_s`` bounds the whole setup. Timeouts lie between
      ``MIN_TIMEOUT_S`` and a day.
    - ``timeout_s``: bound of ``exists`` and the overrun alarm of ``put``/``get`` (see the backend).
    - ``health_interval_s``: after a failure, how often one call may check whether the master is
      back; other calls fail fast meanwhile. ``probe_timeout_s`` bounds that check.
    - ``max_batch``: objects per Mooncake call; ``max_concurrency``: Mooncake calls at once.
    - ``staging_bytes``: registered bounce buffer for objects whose memory was never registered.
    - ``check_present``: before a put, ask which keys exist, to report them ``PRESENT`` and skip
      their copy. Off, a put reports ``STORED`` for a key that existed (Mooncake still keeps the
      old value and copies nothing): one RPC less. Keys that ``exists`` answered absent just before
      are not asked again either way (the pool's exists-skip; :mod:`.absent`).
    - ``metrics_port``: the master's HTTP port (its ``--metrics_port``), where ``kvflow store``
      reads the cluster's keys and usage (``/get_all_keys``, ``/metrics``). Puts and gets never use it.
    - ``device_memory``: whether puts and gets may name GPU/NPU memory directly (zero copy):
      ``auto`` (yes for the ``ascend`` protocol, which moves NPU memory), ``true`` (a build whose
      transport reaches device memory, e.g. RDMA with GPUDirect), ``false`` (device caches go
      through kvflow's pinned host staging; docs/device.md).
    """

    master: str = attrs.field(default=f"127.0.0.1:{DEFAULT_PORT}", validator=_check_master)
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = ""
    segment_bytes: int = attrs.field(default=1 << 30, validator=nonnegative_int)
    buffer_bytes: int = attrs.field(default=64 << 20, validator=nonnegative_int)
    protocol: str = attrs.field(default="tcp", validator=_protocol)
    device_name: str = ""
    replicas: int = attrs.field(default=1, validator=positive_int)
    preferred_segment: str = ""
    prefer_same_node: bool = False
    hard_pin: bool = False
    setup_retries: int = attrs.field(default=3, validator=positive_int)
    setup_timeout_s: float = attrs.field(default=30.0, validator=_seconds(MIN_TIMEOUT_S))
    timeout_s: float = attrs.field(default=10.0, validator=_seconds(MIN_TIMEOUT_S))
    health_interval_s: float = attrs.field(default=1.0, validator=_seconds(0))
    probe_timeout_s: float = attrs.field(default=2.0, validator=_seconds(MIN_TIMEOUT_S))
    close_timeout_s: float = attrs.field(default=10.0, validator=_seconds(MIN_TIMEOUT_S))
    max_batch: int = attrs.field(default=256, validator=positive_int)
    max_concurrency: int = attrs.field(default=4, validator=positive_int)
    staging_bytes: int = attrs.field(default=64 << 20, validator=nonnegative_int)
    check_present: bool = True
    device_memory: str = attrs.field(default="auto", validator=_device_memory)
    metrics_port: int = attrs.field(default=DEFAULT_METRICS_PORT, validator=_port)

    @property
    def reaches_device_memory(self) -> bool:
        """Whether KV caches on a device are handed to Mooncake as they are (no staging)."""
        if self.device_memory == "auto":
            return self.protocol == "ascend"
        return self.device_memory == "true"

    def __attrs_post_init__(self) -> None:
        if 0 < self.segment_bytes < MIN_SEGMENT:
            raise ConfigError(
                f"Mooncake needs segment=0 (a pure client) or at least 16MiB, got {self.segment_bytes} bytes"
            )
        if not self.local_hostname and not _is_loopback(self.master_host):
            raise ConfigError(
                f"the master {self.master} is not on this host, so peers must reach this client: "
                "set local_hostname to this node's address that other nodes can connect to"
            )

    @property
    def master_host(self) -> str:
        return self.master.rpartition(":")[0].strip("[]")

    @property
    def master_port(self) -> int:
        return int(self.master.rpartition(":")[2])

    @property
    def client_hostname(self) -> str:
        """The address this client announces: ``local_hostname``, or loopback for a local master."""
        return self.local_hostname or "127.0.0.1"

    # -- named constructors ---------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str) -> MooncakeConfig:
        """``mooncake://HOST:PORT?segment=1GiB&...``; ``?config=PATH`` starts from a JSON file."""
        params = parse_url_query(url, scheme="mooncake", allowed={*_URL_PARAMS, "config"})
        parts = split_url(url)
        _check_url_parts(url, parts.path, parts.fragment, parts.netloc, params)
        netloc = parts.netloc
        base = cls.from_file(params.pop("config")) if "config" in params else None
        values: dict[str, object] = {}
        if netloc:
            values["master"] = netloc if ":" in netloc.rsplit("]", 1)[-1] else f"{netloc}:{DEFAULT_PORT}"
        for param, text in params.items():
            values[_URL_PARAMS[param]] = _read_url_value(param, text)
        if base is None:
            return cls(**values)  # type: ignore[arg-type]
        return attrs.evolve(base, **values)  # type: ignore[arg-type]

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], *, source: str = "config") -> MooncakeConfig:
        """From the keys of Mooncake's JSON config (``master_server_address``, ``global_segment_size``...)."""
        unknown = set(data) - set(_JSON_KEYS) - _JSON_IGNORED
        if unknown:
            raise ConfigError(
                f"unknown key(s) {sorted(unknown)} in {source}; kvflow reads {sorted(_JSON_KEYS)} "
                f"and ignores {sorted(_JSON_IGNORED)}"
            )
        if data.get("master_server_address") is None:
            raise ConfigError(f"{source} has no master_server_address (HOST:PORT of mooncake_master)")
        values: dict[str, object] = {}
        for key, attribute in _JSON_KEYS.items():
            if key not in data or data[key] is None:
                continue
            value = data[key]
            if attribute.endswith("_bytes"):
                values[attribute] = parse_mooncake_size(value, name=key)
            elif attribute == "prefer_same_node":
                values[attribute] = value if isinstance(value, bool) else _flag(str(value), name=key)
            elif isinstance(value, str):
                values[attribute] = value
            else:
                raise ConfigError(f"{key} in {source} must be a string, got {value!r}")
        ignored = sorted(set(data) & _JSON_IGNORED)
        if ignored:
            log.debug("ignoring Mooncake config keys %s from %s", ignored, source)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeConfig:
        """From a ``mooncake.json`` file as Mooncake and vllm-ascend read it."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read the Mooncake config file {os.fspath(path)!r}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the Mooncake config file {os.fspath(path)!r} is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"the Mooncake config file {os.fspath(path)!r} must hold a JSON object")
        return cls.from_mapping(data, source=os.fspath(path))

    @classmethod
    def from_env(cls) -> MooncakeConfig:
        """From the file ``MOONCAKE_CONFIG_PATH`` names."""
        path = os.environ.get(CONFIG_PATH_ENV)
        if not path:
            raise ConfigError(f"{CONFIG_PATH_ENV} is not set; point it at a mooncake.json file")
        return cls.from_file(path)


def _check_url_parts(url: str, path: str, fragment: str, netloc: str, params: Mapping[str, str]) -> None:
    """Refuse what a mooncake:// URL does not take: a path, a fragment, a user, NUL bytes."""
    if path not in ("", "/"):
        raise ConfigError(
            f"{url!r} has a path ({path!r}); a mooncake:// URL names only the master: write "
            "mooncake://HOST:PORT?param=value"
        )
    if fragment:
        raise ConfigError(f"{url!r} has a fragment (#{fragment}); mooncake:// URLs take none: remove it")
    if "@" in netloc:
        raise ConfigError(
            f"{url!r} names a user before the master; Mooncake has no logins: write mooncake://HOST:PORT"
        )
    for param, text in params.items():
        if "\x00" in text:
            raise ConfigError(f"{param} in {url!r} contains a NUL byte (%00); remove it")


def _read_url_value(param: str, text: str) -> object:
    attribute = _URL_PARAMS[param]
    if attribute.endswith("_s"):
        return parse_seconds(text, f"{param} in a mooncake:// URL")
    if attribute.endswith("_bytes"):
        if not text.isascii():
            raise ConfigError(
                f"{param}={text!r} in a mooncake:// URL is not a size; write e.g. {param}=64MiB"
            )
        return parse_size(text)
    if attribute in {"replicas", "setup_retries", "max_batch", "max_concurrency", "metrics_port"}:
        if not _ascii_digits(text):
            raise ConfigError(
                f"{param}={text!r} in a mooncake:// URL is not a whole number: write only the digits 0-9, "
                f"e.g. {param}=8"
            )
        return int(text)
    if attribute in {"prefer_same_node", "hard_pin", "check_present"}:
        return _flag(text, name=param)
    return text
