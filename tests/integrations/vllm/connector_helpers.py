"""Helpers of the connector tests that run in the test process (which never imports vLLM or torch).

- :func:`kvflow_transfer_config`: the ``kv_transfer_config`` of an engine spec that loads
  kvflow's connector (the product class, or the recording one of ``recording_connector.py``);
- :func:`read_counters`: what each worker of a finished engine moved;
- :func:`local_objects` / :func:`corrupt_local_store`: the objects of a local store, and a way to
  change their KV while keeping them valid objects (checksum and all), so a load takes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvflow.backends.local.format import HEADER_SIZE, Header, payload_checksum
from kvflow.profiles import is_book_key

__all__ = [
    "COUNTERS_ENV",
    "FAIL_MATCHING_ENV",
    "FAIL_ONCE_FLAG_ENV",
    "corrupt_local_store",
    "kvflow_transfer_config",
    "local_objects",
    "read_counters",
]

COUNTERS_ENV = "KVFLOW_TEST_COUNTERS_DIR"
FAIL_MATCHING_ENV = "KVFLOW_TEST_FAIL_MATCHING"  # failonce-local://: the keys whose first get fails
FAIL_ONCE_FLAG_ENV = "KVFLOW_TEST_FAIL_ONCE_FLAG"  # ... and the file that marks it done


def kvflow_transfer_config(backend: str, *, recording: bool = True, **extra: Any) -> dict[str, Any]:
    """``KVTransferConfig`` keywords for kvflow's connector over ``backend``.

    ``recording`` loads the test subclass (counters written to ``$KVFLOW_TEST_COUNTERS_DIR``, and the
    ``failing-local://`` backend known); otherwise the product class by its documented path.
    """
    module, name = (
        ("tests.integrations.vllm.recording_connector", "RecordingKVFlowConnector")
        if recording
        else ("kvflow.integrations.vllm", "KVFlowConnector")
    )
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": backend, **extra},
    }


def read_counters(folder: Path) -> dict[int, Mapping[str, int]]:
    """Each worker's last counters (``TransferCounters`` as a dict), by TP rank."""
    counters: dict[int, Mapping[str, int]] = {}
    for path in sorted(folder.glob("worker-tp*-pp0.json")):
        rank = int(path.name[len("worker-tp") :].split("-")[0])
        counters[rank] = json.loads(path.read_text(encoding="utf-8"))
    return counters


def local_objects(store: Path) -> list[Path]:
    """The KV object files of a local store directory (not the profile book's announcements)."""
    return sorted(p for p in (store / "objects").iterdir() if not is_book_key(p.name))


def corrupt_local_store(store: Path) -> int:
    """Reverse the order of the float32 values in every object's payload and reseal it with a valid
    checksum: the objects still load (no checksum error), but hold the wrong KV. Returns how many."""
    paths = local_objects(store)
    for path in paths:
        data = path.read_bytes()
        header = Header.unpack(data)
        assert header is not None and len(data) == header.file_size, path
        count = header.payload_len // 4
        payload = np.frombuffer(data, dtype=np.float32, count=count, offset=HEADER_SIZE)[::-1].copy()
        view = memoryview(payload).cast("B")
        sealed = attrs.evolve(header, checksum=0)
        sealed = attrs.evolve(sealed, checksum=payload_checksum([view], sealed))
        path.write_bytes(sealed.pack() + payload.tobytes() + data[HEADER_SIZE + header.payload_len :])
    return len(paths)
