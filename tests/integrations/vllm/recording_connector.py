"""KVFlowConnector as the tests load it: it writes each worker's counters to a file, and it knows a
backend whose gets fail.

- ``RecordingKVFlowConnector`` (``kv_connector="RecordingKVFlowConnector",
  kv_connector_module_path="tests.integrations.vllm.recording_connector"``) is the product's
  connector plus one thing: when ``KVFLOW_TEST_COUNTERS_DIR`` is set, every worker writes its running
  :class:`~kvflow.integrations.vllm.stats.TransferCounters` to
  ``<dir>/worker-tp<rank>-pp<rank>.json`` after each step that changed them and at shutdown, with
  ``early_load_steps``: the steps whose loads it started when vLLM handed it the step.
  A test reads them with ``connector_helpers.read_counters`` (which does not import vLLM).
- ``failing-local:///path`` is the local backend at ``path`` whose every get first writes junk into
  the engine blocks it was given, then reports ``FAILED``. Lookups and puts work. A connector that
  ignored the failure would compute with the junk; vLLM with ``kv_load_failure_policy="recompute"``
  must recompute those blocks instead.
- ``failonce-local:///path`` is the local backend whose first get of objects whose keys contain
  ``$KVFLOW_TEST_FAIL_MATCHING`` (in any process of the engine: the file
  ``$KVFLOW_TEST_FAIL_ONCE_FLAG`` marks it done) writes junk into those objects' blocks and reports
  them ``FAILED``, the rest of it as the local backend answered; every later get works. With
  ``@h0-1@`` at TP=2 over two KV heads, rank 0's load fails once and rank 1's arrives.
- ``slow-local:///path`` is the local backend at ``path`` whose every put first waits
  ``$KVFLOW_TEST_PUT_DELAY_S`` seconds (default 1): a store that outlives the step unless the
  connector waits for it; and every get ``$KVFLOW_TEST_GET_DELAY_S`` seconds (default 0).

Importing this module registers the ``failing-local`` and ``slow-local`` schemes with
:func:`kvflow.backends.open_backend` in the importing process (vLLM imports it in every process
that creates a connector).
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvflow.backends import SCHEMES
from kvflow.backends.base import BackendCapabilities, BackendStats, GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend
from kvflow.integrations.vllm import KVFlowConnector
from kvflow.integrations.vllm.stats import TransferCounters
from kvflow.profiles import is_book_key
from tests.integrations.vllm.connector_helpers import FAIL_MATCHING_ENV, FAIL_ONCE_FLAG_ENV

__all__ = [
    "FailOnceBackend",
    "FailingGetsBackend",
    "FailingPutsBackend",
    "RecordingKVFlowConnector",
    "SlowPutsBackend",
]

COUNTERS_ENV = "KVFLOW_TEST_COUNTERS_DIR"  # the same name as connector_helpers.COUNTERS_ENV
PUT_DELAY_ENV = "KVFLOW_TEST_PUT_DELAY_S"
GET_DELAY_ENV = "KVFLOW_TEST_GET_DELAY_S"

SCHEMES.setdefault("failing-local", f"{__name__}:FailingGetsBackend")
SCHEMES.setdefault("slow-local", f"{__name__}:SlowPutsBackend")
SCHEMES.setdefault("noput-local", f"{__name__}:FailingPutsBackend")
SCHEMES.setdefault("failonce-local", f"{__name__}:FailOnceBackend")


@attrs.define(eq=False)
class FailingGetsBackend:
    """The local backend with gets that scribble over their regions and then fail."""

    inner: LocalBackend

    @classmethod
    def from_url(cls, url: str) -> FailingGetsBackend:
        return cls(LocalBackend.from_url("local" + url[len("failing-local") :]))

    @property
    def max_batch(self) -> int:
        return self.inner.max_batch

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.inner.capabilities

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        return await self.inner.put(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        for obj in objects:
            for addr, size in zip(obj.addrs, obj.sizes):
                ctypes.memset(addr, 0x7F, size)  # 0x7f7f7f7f: a huge float, never a real KV value
        return [GetStatus.FAILED] * len(objects)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    async def remove(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.remove(keys)

    def register_memory(self, addr: int, nbytes: int) -> None:
        self.inner.register_memory(addr, nbytes)

    def stats(self) -> BackendStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()


@attrs.define(eq=False)
class SlowPutsBackend(FailingGetsBackend):
    """The local backend with puts that wait first (gets work)."""

    @classmethod
    def from_url(cls, url: str) -> SlowPutsBackend:
        return cls(LocalBackend.from_url("local" + url[len("slow-local") :]))

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        await anyio.sleep(float(os.environ.get(PUT_DELAY_ENV, "1")))
        return await self.inner.put(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        await anyio.sleep(float(os.environ.get(GET_DELAY_ENV, "0")))
        return await self.inner.get(objects)


@attrs.define(eq=False)
class FailingPutsBackend(FailingGetsBackend):
    """The local backend whose puts of KV fail (the profile book's announcements and gets work)."""

    @classmethod
    def from_url(cls, url: str) -> FailingPutsBackend:
        return cls(LocalBackend.from_url("local" + url[len("noput-local") :]))

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        if objects and all(is_book_key(obj.key) for obj in objects):
            return await self.inner.put(objects)
        return [PutStatus.FAILED] * len(objects)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        return await self.inner.get(objects)


@attrs.define(eq=False)
class FailOnceBackend(FailingGetsBackend):
    """The local backend whose first get of matching objects fails after scribbling on them."""

    @classmethod
    def from_url(cls, url: str) -> FailOnceBackend:
        return cls(LocalBackend.from_url("local" + url[len("failonce-local") :]))

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        results = await self.inner.get(objects)
        matching, flag = os.environ[FAIL_MATCHING_ENV], Path(os.environ[FAIL_ONCE_FLAG_ENV])
        failing = [i for i, obj in enumerate(objects) if matching in obj.key and not is_book_key(obj.key)]
        if not failing:
            return results
        try:
            flag.touch(exist_ok=False)  # the first such get of the engine's processes, only
        except FileExistsError:
            return results
        for i in failing:
            for addr, size in zip(objects[i].addrs, objects[i].sizes):
                ctypes.memset(addr, 0x7F, size)  # 0x7f7f7f7f: a huge float, never a real KV value
            results[i] = GetStatus.FAILED
        return results


class RecordingKVFlowConnector(KVFlowConnector):
    """KVFlowConnector that leaves its workers' counters in ``$KVFLOW_TEST_COUNTERS_DIR``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._written: tuple[TransferCounters, int] | None = None
        self._early_load_steps = 0

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Counts the steps whose loads the worker started here (``early_load_steps``)."""
        super().handle_preemptions(kv_connector_metadata)
        steps = self._worker._steps if self._worker is not None else None
        self._early_load_steps += steps is not None and steps._early is not None

    def _write_counters(self) -> None:
        folder = os.environ.get(COUNTERS_ENV)
        worker = self._worker
        if not folder or worker is None or (worker.counters, self._early_load_steps) == self._written:
            return
        self._written = worker.counters, self._early_load_steps
        path = Path(folder) / f"worker-tp{worker.tp_rank}-pp{worker.pp_rank}.json"
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        written = {**worker.counters.as_dict(), "early_load_steps": self._early_load_steps}
        temp.write_text(json.dumps(written), encoding="utf-8")
        temp.replace(path)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        finished = super().get_finished(finished_req_ids)
        self._write_counters()
        return finished

    def shutdown(self) -> None:
        super().shutdown()
        self._write_counters()
