"""What a Mooncake master says over its HTTP port: every key it holds, and the cluster's usage.

Mooncake's Python client cannot list keys. Its master can: the HTTP server on ``--metrics_port``
(``metrics_port`` in a ``mooncake://`` URL, default 9003) answers ``/get_all_keys`` (one key per
line) and ``/metrics`` (Prometheus text: ``master_total_capacity_bytes``,
``master_allocated_bytes``, ``master_key_count``). For ``kvflow store``; transfers never use it.

:func:`fetch` blocks (urllib, bounded by its timeout); the backend runs it in a worker thread.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import attrs

from kvflow.errors import BackendUnavailableError

__all__ = ["ClusterUsage", "fetch", "parse_keys", "parse_usage"]


@attrs.frozen
class ClusterUsage:
    """The master's totals: memory every mounted segment offers, memory objects hold, keys."""

    capacity_bytes: int
    used_bytes: int
    keys: int


def fetch(host: str, port: int, path: str, timeout_s: float) -> str:
    """GET ``http://host:port/path`` and return the body. Blocks at most about twice
    ``timeout_s``: the whole body must have come by ``timeout_s`` (each read waits at most that
    long), else BackendUnavailableError."""
    url = f"http://{host}:{port}{path}"
    deadline = time.monotonic() + timeout_s
    parts: list[bytes] = []
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            while part := response.read1(_READ_BYTES):
                parts.append(part)
                if time.monotonic() > deadline:
                    raise BackendUnavailableError(
                        f"{url} of the Mooncake master did not answer whole within {timeout_s:g} s; "
                        "give it longer with timeout=N in the mooncake:// URL"
                    )
    except (urllib.error.URLError, OSError) as exc:
        raise BackendUnavailableError(
            f"cannot read {url} from the Mooncake master ({exc}); is mooncake_master running with "
            f"--metrics_port={port}? Give its port as metrics_port=N in the mooncake:// URL"
        ) from exc
    return b"".join(parts).decode("utf-8", errors="replace")


_READ_BYTES = 1 << 20  # the most one read of an answer takes


def parse_keys(text: str) -> list[str]:
    """The keys of a ``/get_all_keys`` answer (one per line)."""
    return [line for line in text.split("\n") if line]


def parse_usage(text: str) -> ClusterUsage:
    """The totals of a ``/metrics`` answer; a missing sample counts 0."""
    wanted = {"master_total_capacity_bytes": 0, "master_allocated_bytes": 0, "master_key_count": 0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            try:
                wanted[name] = int(float(value.split()[0]))
            except (ValueError, IndexError):
                continue
    return ClusterUsage(
        wanted["master_total_capacity_bytes"], wanted["master_allocated_bytes"], wanted["master_key_count"]
    )
