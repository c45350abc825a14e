"""vLLM's real scheduler driving real kvflow connectors, with a fake forward that proves what every
request computed from.

:class:`Harness` builds vLLM's own ``Scheduler`` or ``AsyncScheduler`` (0.32) with ``KVFlowConnector``
on its scheduler side, one worker-side ``KVFlowConnector`` per TP rank over real CPU KV caches, and
runs engine steps the way vLLM's engine core does: schedule -> the workers' connector hooks around a
forward -> (for TP) vLLM's ``KVOutputAggregator`` -> ``update_from_output``. With asynchronous
scheduling step N+1 is scheduled and executed before step N's output is processed, as vLLM's batch
queue does.

The fake model: the KV of token position ``p`` is a value derived from the tokens up to ``p``
(``kv_value``), the same bytes on every run. Computing a step reads the cached KV of every earlier
position of the request on every rank (attention, then tensor parallelism's all-reduce) and checks
it. With correct inputs it writes correct KV and samples the clean model's token; with a wrong
input anywhere it writes poisoned KV (``POISON``) and samples a wrong token, so whatever was
computed from wrong KV stays recognisable wherever it goes: into vLLM's outputs or into the store.
Each layer runs as vLLM runs a batch: every scheduled request's new KV of the layer is written
before any request's attention reads (so a request reading, through the prefix cache, a block
another request of the step rewrites reads the new KV), and a request that read wrong KV at one
layer writes poison at every later one.

Faults come from :class:`Faults` (a backend wrapper, ``harness-local://``): gets that scribble over
their blocks and then fail, and delayed puts and gets (of KV objects: the profile book's small
announcements pass through untouched). The wrapper also records the memory every
transfer touches while it runs, and the forward fails a test that writes KV into a block a
transfer is still reading or writing.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import kvflow.integrations.vllm.connector as connector_module
from kvflow.backends import SCHEMES
from kvflow.backends.base import BackendCapabilities, BackendStats, GetStatus, ObjectRef, PutStatus
from kvflow.backends.local import LocalBackend
from kvflow.backends.local.format import object_file_name
from kvflow.errors import BackendError
from kvflow.integrations.vllm import KVFlowConnector
from kvflow.integrations.vllm.metadata import KVFlowConnectorMetadata
from kvflow.keys import decode_key
from kvflow.profiles import is_book_key
from tests.integrations.vllm.rank_agreement import RankAgreement

__all__ = ["POISON", "Faults", "Harness", "block_hashes", "kv_value"]

BLOCK = 4
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEAD_DIM = 8
VOCAB = 512
POISON = -1.0  # the KV a step computed from a wrong input writes; no correct KV value is negative

SCHEMES.setdefault("harness-local", f"{__name__}:FaultyLocalBackend")


# -- the fake model ---------------------------------------------------------------------------------


def prefix_digests(tokens: Sequence[int]) -> list[int]:
    """``d[p]``: a digest of ``tokens[: p + 1]`` (what the KV of position ``p`` depends on)."""
    digests, state = [], b"harness"
    for token in tokens:
        state = hashlib.blake2b(state + int(token).to_bytes(8, "little"), digest_size=8).digest()
        digests.append(int.from_bytes(state, "little"))
    return digests


def kv_value(digest: int, layer: int, rank: int) -> float:
    """The KV every element of a position's slot holds (exact in float32)."""
    return float(digest % (1 << 20)) + layer * 0.25 + rank * 0.125


def block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """vLLM's hash of each full block of ``tokens`` (what the keys of their objects end in)."""
    request = Request(
        "probe",
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    return [bytes(h) for h in request.block_hashes]


def clean_token(digest: int) -> int:
    """The token the clean model samples after a prefix with this digest."""
    return 3 + digest % (VOCAB - 3)


# -- faults -------------------------------------------------------------------------------------------


@attrs.define
class InFlight:
    """Memory that some transfer reads or writes right now (any thread)."""

    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _regions: dict[int, list[tuple[int, int]]] = attrs.field(factory=dict)
    _puts: set[int] = attrs.field(factory=set)
    _next: int = 0

    def enter(self, objects: Sequence[ObjectRef], *, put: bool = False) -> int:
        with self._lock:
            self._next += 1
            self._regions[self._next] = [(a, a + n) for o in objects for a, n in zip(o.addrs, o.sizes) if n]
            if put:
                self._puts.add(self._next)
            return self._next

    def leave(self, token: int) -> None:
        with self._lock:
            del self._regions[token]
            self._puts.discard(token)

    @property
    def puts(self) -> int:
        """Puts running now."""
        with self._lock:
            return len(self._puts)

    def overlaps(self, start: int, end: int) -> bool:
        with self._lock:
            return any(a < end and start < b for regions in self._regions.values() for a, b in regions)


@attrs.define
class Faults:
    """What the ``harness-local://`` backends do wrong. Change it from the test at any time."""

    fail_gets: bool = False  # every get scribbles over its regions, then reports FAILED
    fail_gets_matching: str = ""  # only gets of keys containing this (e.g. "@h0-1@": KV head 0)
    fail_gets_left: int = -1  # fail only this many more get calls (-1: no limit)
    evict_gets_left: int = 0  # this many get calls first remove their objects (evicted meanwhile)
    raise_calls: str = ""  # "gets" or "puts": those calls raise BackendError (a store that cannot answer)
    get_delay_s: float = 0.0
    put_delay_s: float = 0.0
    in_flight: InFlight = attrs.field(factory=InFlight)
    #: the key of every object put, by its file name (long keys are stored under a digest name)
    keys: dict[str, str] = attrs.field(factory=dict)

    def stored_block_hashes(self) -> set[bytes]:
        """The block hash of every KV object put (profile announcements left out)."""
        return {decode_key(key).block_hash for key in self.keys.values() if not is_book_key(key)}


FAULTS = Faults()


def _book(objects: Sequence[ObjectRef]) -> bool:
    return bool(objects) and all(is_book_key(o.key) for o in objects)


@attrs.define(eq=False)
class FaultyLocalBackend:
    """The local backend under :data:`FAULTS`."""

    inner: LocalBackend

    @classmethod
    def from_url(cls, url: str) -> FaultyLocalBackend:
        return cls(LocalBackend.from_url("local" + url[len("harness-local") :]))

    @property
    def max_batch(self) -> int:
        return self.inner.max_batch

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.inner.capabilities

    async def put(self, objects: Sequence[ObjectRef]) -> list[PutStatus]:
        FAULTS.keys.update((object_file_name(o.key), o.key) for o in objects)
        if _book(objects):  # the profile book's announcements are not KV: no faults
            return await self.inner.put(objects)
        if FAULTS.raise_calls == "puts":  # at once, before any await: calls beside it raise too
            raise BackendError("the harness's store cannot answer (puts)")
        token = FAULTS.in_flight.enter(objects, put=True)
        try:
            await anyio.sleep(FAULTS.put_delay_s)
            return await self.inner.put(objects)
        finally:
            FAULTS.in_flight.leave(token)

    async def get(self, objects: Sequence[ObjectRef]) -> list[GetStatus]:
        if _book(objects):
            return await self.inner.get(objects)
        if FAULTS.raise_calls == "gets":
            raise BackendError("the harness's store cannot answer (gets)")
        token = FAULTS.in_flight.enter(objects)
        try:
            await anyio.sleep(FAULTS.get_delay_s)
            if FAULTS.evict_gets_left > 0:
                FAULTS.evict_gets_left -= 1
                await self.inner.remove([o.key for o in objects])
            failing = FAULTS.fail_gets and FAULTS.fail_gets_left != 0
            if failing and any(FAULTS.fail_gets_matching in o.key for o in objects):
                FAULTS.fail_gets_left -= 1
                results = await self.inner.get(objects)
                for obj in objects:
                    if FAULTS.fail_gets_matching in obj.key:
                        for addr, size in zip(obj.addrs, obj.sizes):
                            ctypes.memset(addr, 0x7F, size)  # the get wrote junk, then failed
                return [
                    GetStatus.FAILED if FAULTS.fail_gets_matching in o.key else r
                    for o, r in zip(objects, results)
                ]
            return await self.inner.get(objects)
        finally:
            FAULTS.in_flight.leave(token)

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


# -- the engine ---------------------------------------------------------------------------------------


@attrs.define(eq=False)
class Tracked:
    """What the harness knows of a request besides vLLM's own view of it."""

    request: Request
    sampled: dict[int, int] = attrs.field(factory=dict)  # position -> the token sampled for it
    outputs: list[int] = attrs.field(factory=list)  # tokens vLLM returned
    finished: bool = False

    def tokens(self, end: int) -> list[int]:
        """The first ``end`` tokens as the workers see them: vLLM's accepted tokens, then tokens
        sampled but not yet accepted (asynchronous scheduling runs a step ahead)."""
        known = list(self.request.all_token_ids[:end])
        return known + [self.sampled[p] for p in range(len(known), end)]


@attrs.define(eq=False)
class Harness:
    """One engine: vLLM's scheduler, ``tp`` worker-side connectors and their KV caches."""

    store: Path
    model: Path
    tp: int = 1
    num_kv_heads: int = 2
    async_scheduling: bool = False
    policy: str = "recompute"
    num_blocks: int = 48
    max_num_batched_tokens: int = 64
    extra: dict[str, Any] = attrs.field(factory=dict)
    #: > 0: vLLM's order with speculative decoding (its model runner's deferred finalize): the step's
    #: output (finished, load errors, worker meta) is taken before ``wait_for_save``, and between
    #: them the drafter runs this many passes, each over an attention layer (here the last one)
    draft_passes: int = 0
    #: vLLM's order: ``handle_preemptions`` first in every step, where kvflow's workers start the
    #: step's loads early (False: a runner that never calls it; they start in ``start_load_kv``)
    early_loads: bool = True
    scheduler: Scheduler = attrs.field(init=False)
    workers: list[KVFlowConnector] = attrs.field(init=False, factory=list)
    caches: list[dict[str, torch.Tensor]] = attrs.field(init=False, factory=list)
    requests: dict[str, Tracked] = attrs.field(init=False, factory=dict)
    wrong_inputs: list[tuple[str, int]] = attrs.field(init=False, factory=list)  # (request, position)
    writes_under_transfer: list[tuple[str, int]] = attrs.field(init=False, factory=list)
    _aggregator: KVOutputAggregator = attrs.field(init=False)
    _queued: list[tuple[SchedulerOutput, ModelRunnerOutput]] = attrs.field(init=False, factory=list)
    _serial: int = attrs.field(init=False, default=0)
    free_blocks_at_start: int = attrs.field(init=False, default=0)
    preempted: set[str] = attrs.field(init=False, factory=set)  # requests vLLM ever preempted
    #: every load the scheduler sent, in order: (step, request, first block, blocks, asynchronous)
    loads: list[tuple[int, str, int, int, bool]] = attrs.field(init=False, factory=list)
    #: every save the scheduler sent, in order: (step, request, first block, blocks)
    saves: list[tuple[int, str, int, int]] = attrs.field(init=False, factory=list)
    #: what every step computed, in order: (request, first position, one past the last)
    computed: list[tuple[str, int, int]] = attrs.field(init=False, factory=list)
    #: steps that ended with a put still running (stores must end inside their step)
    puts_after_step: list[int] = attrs.field(init=False, factory=list)
    #: how the ranks agree on failed loads before storing what rests on them (TP > 1)
    agreement: RankAgreement = attrs.field(init=False, factory=RankAgreement)

    def __attrs_post_init__(self) -> None:
        init_none_hash(sha256)
        transfer = KVTransferConfig(
            kv_connector="KVFlowConnector",
            kv_connector_module_path="kvflow.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=self.policy,
            kv_connector_extra_config={"backend": f"harness-local://{self.store}", **self.extra},
        )
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(self.model), dtype="float32", seed=0, skip_tokenizer_init=True
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=self.async_scheduling,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=transfer,
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp),
        )
        heads = max(1, self.num_kv_heads // self.tp)
        kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    list(LAYERS),
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32
                    ),
                )
            ],
        )
        config.cache_config.num_gpu_blocks = self.num_blocks
        # vLLM's CPU platform turns asynchronous scheduling off; this engine runs vLLM's
        # AsyncScheduler as a GPU engine would, and the connector reads the setting
        config.scheduler_config.async_scheduling = self.async_scheduling
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        for rank in range(self.tp):
            self.workers.append(_worker_connector(config, kv_cache_config, rank, self.agreement))
            cache = {name: torch.zeros(self.num_blocks, heads, BLOCK, 2 * HEAD_DIM) for name in LAYERS}
            self.workers[-1].register_kv_caches(cache)  # type: ignore[arg-type]
            self.caches.append(cache)
        handshakes = {(0, rank): w.get_handshake_metadata() for rank, w in enumerate(self.workers)}
        assert self.scheduler.connector is not None
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(handshakes)  # type: ignore[arg-type]
        self._aggregator = KVOutputAggregator(self.tp)
        self.free_blocks_at_start = self.free_blocks()

    # -- requests ---------------------------------------------------------------------------------

    def add(self, prompt: Sequence[int], max_tokens: int = 2, request_id: str | None = None) -> str:
        self._serial += 1
        req_id = request_id or f"r{self._serial}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.requests[req_id] = Tracked(request)
        self.scheduler.add_request(request)
        return req_id

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.requests[req_id].finished = True

    def connector_state(self) -> dict[str, object]:
        """What the scheduler-side connector still keeps per request (empty on an idle engine)."""
        side = self.scheduler.connector._scheduler  # type: ignore[union-attr]
        kept = {
            name: getattr(side, f"_{name}")
            for name in (
                "requests",
                "local_hits",
                "answered",
                "pending_loads",
                "pending_async",
                "async_loads",
                "async_bad",
                "load_failed",
            )
        }
        kept["lookups"] = dict(side._lookups._lookups) if side._lookups is not None else {}
        return {name: value for name, value in kept.items() if value}

    def expected_outputs(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(clean_token(prefix_digests(tokens)[-1]))
        return tokens[len(prompt) :]

    # -- steps ------------------------------------------------------------------------------------

    def step(self) -> None:
        """One engine-core step (with asynchronous scheduling: schedule and run one more step, then
        process the oldest output, as vLLM's batch queue of two does)."""
        output = self.scheduler.schedule()
        self.preempted |= set(output.preempted_req_ids or ())
        self._queued.append((output, self._execute(output)))
        if self.async_scheduling and len(self._queued) < 2:
            return
        done, result = self._queued.pop(0)
        self._apply(self.scheduler.update_from_output(done, result))

    def flush(self) -> None:
        while self._queued:
            done, result = self._queued.pop(0)
            self._apply(self.scheduler.update_from_output(done, result))

    def run(self, timeout_s: float = 60.0) -> None:
        """Step until every request finished and nothing is queued, as vLLM's engine core does
        (it keeps stepping while finished requests remain to be reported or loads to end)."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_requests() or self._queued:
            if time.monotonic() > deadline:
                running = list(self.scheduler.requests)
                raise AssertionError(f"requests still running after {timeout_s} s: {running}")
            self.step()
            if not self.scheduler.has_unfinished_requests():
                self.flush()
                time.sleep(0.001)  # waiting for loads to end: let the loop threads run

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        assert self.scheduler.connector is not None
        self.scheduler.connector.shutdown()

    # -- the workers and the fake forward -----------------------------------------------------------

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        meta = output.kv_connector_metadata
        assert isinstance(meta, KVFlowConnectorMetadata)
        for asynchronous, spans in ((False, meta.loads), (True, meta.async_loads)):
            for span in spans:
                self.loads.append(
                    (meta.step, span.request_id, span.block_offset, len(span.block_ids), asynchronous)
                )
        for span in meta.saves:
            self.saves.append((meta.step, span.request_id, span.block_offset, len(span.block_ids)))
        if self.early_loads:
            for worker in self.workers:
                worker.handle_preemptions(meta)
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            if output.has_sync_kv_loads:
                worker.start_load_kv(None)  # type: ignore[arg-type]
        work = self._work(output)
        self.computed.extend(work)
        inputs_ok = {req_id: True for req_id, _, _ in work}
        for layer, name in enumerate(LAYERS):
            for worker in self.workers:
                worker.wait_for_layer_load(name)
            inputs_ok = self._compute_layer(work, layer, inputs_ok)
            for worker, cache in zip(self.workers, self.caches):
                worker.save_kv_layer(name, cache[name], None)  # type: ignore[arg-type]
        sampled = {req_id: self._sample(req_id, end, inputs_ok[req_id]) for req_id, _, end in work}
        outputs = []
        for worker in self.workers:
            if not output.has_sync_kv_loads:
                worker.start_load_kv(None)  # type: ignore[arg-type]
            if not self.draft_passes:
                worker.wait_for_save()
            sending, recving = worker.get_finished(output.finished_req_ids)
            kv = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            if not self.draft_passes:
                worker.clear_connector_metadata()
            req_ids = [req_id for req_id, _, _ in work]
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[sampled[r] for r in req_ids],
                    kv_connector_output=None if kv.is_empty() else kv,
                )
            )
        if self.draft_passes:
            for _ in range(self.draft_passes):  # the drafter's passes, the step's metadata still bound
                for worker, cache in zip(self.workers, self.caches):
                    worker.wait_for_layer_load(LAYERS[-1])
                    worker.save_kv_layer(LAYERS[-1], cache[LAYERS[-1]], None)  # type: ignore[arg-type]
            for worker in self.workers:  # the deferred finalize
                worker.wait_for_save()
                worker.clear_connector_metadata()
        if FAULTS.in_flight.puts:
            self.puts_after_step.append(meta.step)
        if self.tp == 1:
            return outputs[0]
        aggregated = self._aggregator.aggregate(outputs)  # type: ignore[arg-type]
        assert aggregated is not None
        return aggregated

    def _work(self, output: SchedulerOutput) -> list[tuple[str, int, int]]:
        """(request, first position computed, one past the last) of every scheduled request."""
        work = []
        for new in output.scheduled_new_reqs:
            work.append(
                (
                    new.req_id,
                    new.num_computed_tokens,
                    new.num_computed_tokens + output.num_scheduled_tokens[new.req_id],
                )
            )
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            start = cached.num_computed_tokens[i]
            work.append((req_id, start, start + output.num_scheduled_tokens[req_id]))
        return work

    def _slots(self, req_id: str, positions: range) -> Iterator[tuple[int, int, int]]:
        """(position, block id, slot) of ``positions`` in the request's block table."""
        (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        for p in positions:
            yield p, block_ids[p // BLOCK], p % BLOCK

    def group(self, rank: int) -> int:
        """The KV-head group of a rank: ranks of one group hold the same KV."""
        return rank * min(self.tp, self.num_kv_heads) // self.tp

    def _compute_layer(
        self, work: list[tuple[str, int, int]], layer: int, inputs_ok: dict[str, bool]
    ) -> dict[str, bool]:
        """Layer ``layer`` of the step's batch: every request writes its positions' KV (poison when
        its inputs were already wrong), then each request's reads are checked on every rank; one
        that read a wrong value writes poison instead, which may spoil another's reads, so the
        checks repeat until no verdict changes. Whether each request's inputs are still right."""
        digests = {req_id: prefix_digests(self.requests[req_id].tokens(end)) for req_id, _, end in work}
        ok = dict(inputs_ok)
        for req_id, start, end in work:
            self._write(req_id, range(start, end), layer, digests[req_id], ok[req_id])
        changed = True
        while changed:
            changed = False
            for req_id, start, end in work:
                if ok[req_id] and not self._reads_right(req_id, start, layer, digests[req_id]):
                    ok[req_id], changed = False, True
                    self._write(req_id, range(start, end), layer, digests[req_id], False)
                    if (req_id, start) not in self.wrong_inputs:
                        self.wrong_inputs.append((req_id, start))
        return ok

    def _reads_right(self, req_id: str, start: int, layer: int, digests: list[int]) -> bool:
        """Whether every position before ``start`` holds the request's correct KV on every rank."""
        name = LAYERS[layer]
        return all(
            bool((cache[name][block, :, slot] == kv_value(digests[p], layer, self.group(rank))).all())
            for p, block, slot in self._slots(req_id, range(start))
            for rank, cache in enumerate(self.caches)
        )

    def _write(self, req_id: str, positions: range, layer: int, digests: list[int], good: bool) -> None:
        """The KV of ``positions`` at ``layer`` on every rank: correct, or poison."""
        name = LAYERS[layer]
        for p, block, slot in self._slots(req_id, positions):
            for rank, cache in enumerate(self.caches):
                target = cache[name][block, :, slot]
                if FAULTS.in_flight.overlaps(target.data_ptr(), target.data_ptr() + target.nbytes):
                    self.writes_under_transfer.append((req_id, p))
                target.fill_(kv_value(digests[p], layer, self.group(rank)) if good else POISON)

    def _sample(self, req_id: str, end: int, inputs_ok: bool) -> list[int]:
        """A token once the step computed every token vLLM knows of the request (a chunk of a
        prompt samples none); a wrong one when the step read wrong KV."""
        tracked = self.requests[req_id]
        if end < tracked.request.num_tokens:
            return []
        token = clean_token(prefix_digests(tracked.tokens(end))[-1])
        if not inputs_ok:
            token = (token + 1) % VOCAB
        tracked.sampled[end] = token
        return [token]

    def _apply(self, engine_outputs: dict[int, Any]) -> None:
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                tracked = self.requests[out.request_id]
                tracked.outputs.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    tracked.finished = True

    # -- checks -----------------------------------------------------------------------------------

    def stored_objects_are_correct(self, prompts: Sequence[Sequence[int]]) -> int:
        """Check every object in the store against the KV the clean model computes for the blocks
        of ``prompts`` (and the tokens they generated); return how many were checked."""
        from kvflow.backends.local.format import HEADER_SIZE, Header

        by_hash: dict[bytes, tuple[list[int], int]] = {}
        for tokens in prompts:
            for i, block_hash in enumerate(block_hashes(tokens)):
                by_hash[block_hash] = (list(tokens), i)
        checked = 0
        for path in sorted((self.store / "objects").iterdir()):
            key = FAULTS.keys.get(path.name)
            assert key is not None, f"{path.name}: no put of this test wrote it"
            if is_book_key(key):
                continue  # a profile announcement, not KV
            data = path.read_bytes()
            header = Header.unpack(data)
            assert header is not None, path.name
            decoded = decode_key(key)
            tokens, index = by_hash[decoded.block_hash]
            first, end = decoded.scope.heads
            group = first // (end - first)  # the harness's KV-head group of the ranks holding them
            layers = list(range(*decoded.scope.layers))
            digests = prefix_digests(tokens[: (index + 1) * BLOCK])
            raw = data[HEADER_SIZE : HEADER_SIZE + header.payload_len]  # (a long key may follow it)
            payload = torch.frombuffer(bytearray(raw), dtype=torch.float32)
            payload = payload.view(len(layers), -1, BLOCK, 2 * HEAD_DIM)
            for i, layer in enumerate(layers):
                for slot in range(BLOCK):
                    value = kv_value(digests[index * BLOCK + slot], layer, group)
                    assert bool((payload[i, :, slot] == value).all()), f"object {path.name} holds wrong KV"
            checked += 1
        return checked


def _worker_connector(
    config: VllmConfig, kv_cache_config: KVCacheConfig, rank: int, agreement: RankAgreement
) -> KVFlowConnector:
    """A worker-side KVFlowConnector for TP rank ``rank`` (vLLM's process groups are not set up
    here: its ranks agree through ``agreement``)."""
    ranks, agree = connector_module.worker_ranks, connector_module.tensor_parallel_agreement
    connector_module.worker_ranks = lambda: (rank, 0)  # type: ignore[assignment]
    connector_module.tensor_parallel_agreement = lambda: agreement.for_rank(rank)  # type: ignore[assignment]
    try:
        connector = KVFlowConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    finally:
        connector_module.worker_ranks = ranks  # type: ignore[assignment]
        connector_module.tensor_parallel_agreement = agree  # type: ignore[assignment]
    agreement.sides[rank] = connector._worker_side()
    return connector
