"""Run real vLLM engines (CPU) in fresh subprocesses and read back what they generated.

Every engine runs in its own process (``run_engine.py``) so that no vLLM global state, prefix cache,
thread binding or connector singleton leaks from one run to the next; the harness itself never imports vLLM
(about 8 s) or torch into the test process. Each run costs about 12-15 s in-process mode and 25-70 s with
vLLM's multiprocessing on (measured on a 2-core CPU machine).

Children get the repository root on ``PYTHONPATH``, so a connector under test loads by its module
path (``kvflow.integrations.vllm`` or ``tests.integrations.vllm.probe_connector``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "HERE",
    "EngineError",
    "EngineRun",
    "EngineSpec",
    "RequestResult",
    "make_prompt",
    "probe_kv_transfer_config",
    "read_probe_log",
    "run_engine",
]

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
RUN_ENGINE = HERE / "run_engine.py"

#: Token ids below this are the tiny model's special tokens (pad 0, bos 1, eos 2); prompts avoid them.
FIRST_PLAIN_TOKEN = 3


class EngineError(RuntimeError):
    """An engine subprocess failed or timed out; the message ends with the tail of its stderr."""


def _tokens(batches: Sequence[Sequence[Sequence[int]]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(tuple(int(t) for t in prompt) for prompt in batch) for batch in batches)


def _env(env: Mapping[str, str]) -> dict[str, str]:
    return {str(k): str(v) for k, v in env.items()}


@attrs.frozen
class EngineSpec:
    """What one engine run does. ``batches[i]`` is one ``LLM.generate`` call, run in order.

    ``kv_transfer_config`` is the keyword dict of vLLM's ``KVTransferConfig`` (None: no connector).
    ``multiprocessing`` turns on ``VLLM_ENABLE_V1_MULTIPROCESSING`` (engine core and, with
    ``tensor_parallel_size > 1``, each worker in its own process). ``env`` is added to the child's
    environment last, so it can override anything. ``kv_events`` subscribes to vLLM's KV cache
    events (in-process mode) and ``prometheus`` returns the child's Prometheus registry at the end
    (``EngineRun.kv_events`` / ``EngineRun.prometheus``).
    """

    model: Path = attrs.field(converter=Path)
    batches: tuple[tuple[tuple[int, ...], ...], ...] = attrs.field(converter=_tokens)
    max_tokens: int = 8
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 2048
    kv_cache_memory_bytes: int = 16 << 20
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    kv_transfer_config: Mapping[str, Any] | None = None
    tensor_parallel_size: int = 1
    multiprocessing: bool = False
    seed: int = 0
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_env)
    between_batches: tuple[str, ...] = ()
    kv_events: bool = False
    prometheus: bool = False

    @classmethod
    def of_prompts(cls, model: Path, prompts: Sequence[Sequence[int]], **kwargs: Any) -> EngineSpec:
        """A spec that generates for ``prompts`` in one batch."""
        return cls(model, (tuple(tuple(p) for p in prompts),), **kwargs)

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": str(self.model),
                "batches": [[list(p) for p in batch] for batch in self.batches],
                "max_tokens": self.max_tokens,
                "dtype": self.dtype,
                "block_size": self.block_size,
                "max_model_len": self.max_model_len,
                "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "enable_prefix_caching": self.enable_prefix_caching,
                "kv_transfer_config": (
                    None if self.kv_transfer_config is None else dict(self.kv_transfer_config)
                ),
                "tensor_parallel_size": self.tensor_parallel_size,
                "multiprocessing": self.multiprocessing,
                "seed": self.seed,
                "between_batches": list(self.between_batches),
                "env": dict(self.env),
                "kv_events": self.kv_events,
                "prometheus": self.prometheus,
            }
        )


@attrs.frozen
class RequestResult:
    """What one request produced: its greedy tokens and how many prompt tokens were cached.

    ``num_cached_tokens`` counts both vLLM's own prefix cache and a connector's external hit.
    """

    token_ids: tuple[int, ...]
    num_cached_tokens: int


@attrs.frozen
class EngineRun:
    """The outcome of one engine run: ``batches[i][j]`` answers prompt ``j`` of batch ``i``."""

    batches: tuple[tuple[RequestResult, ...], ...]
    timings: Mapping[str, Any]
    stderr: str = attrs.field(repr=False)
    kv_events: tuple[tuple[Mapping[str, Any], ...], ...] = ()  # per batch, in publishing order
    prometheus: str = attrs.field(default="", repr=False)

    @property
    def outputs(self) -> tuple[tuple[int, ...], ...]:
        """Every request's generated tokens, batches flattened in order."""
        return tuple(r.token_ids for batch in self.batches for r in batch)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """Every request's ``num_cached_tokens``, batches flattened in order."""
        return tuple(r.num_cached_tokens for batch in self.batches for r in batch)


def _child_env(spec: EngineSpec) -> dict[str, str]:
    env = dict(os.environ)
    pythonpath = [str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        pythonpath.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if spec.tensor_parallel_size > 1:
        # vLLM's automatic binding wants one NUMA node per local worker; pin ranks to cores instead.
        cores = os.cpu_count() or 1
        env.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(rank % cores) for rank in range(spec.tensor_parallel_size)),
        )
    env.update(spec.env)
    return env


def run_engine(spec: EngineSpec, *, timeout_s: float = 300.0) -> EngineRun:
    """Run ``spec`` in a fresh Python process and return what it generated.

    Blocks the calling thread for the whole run. Raises :class:`EngineError` when the process
    fails, times out or prints something that is not the expected JSON.
    """
    shm_before = _vllm_shm()
    try:
        # TMPDIR: vLLM's IPC sockets go there, and a killed or crashed engine leaves them behind
        with tempfile.TemporaryDirectory(prefix="kvflow-engine-") as tmp, _removing_new_vllm_shm(shm_before):
            env = _child_env(spec)
            if "TMPDIR" not in spec.env:
                env["TMPDIR"] = tmp
            proc = subprocess.run(
                [sys.executable, str(RUN_ENGINE), "-"],
                input=spec.to_json(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                cwd=str(REPO_ROOT),
                check=False,
            )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise EngineError(f"vLLM engine run timed out after {timeout_s} s:\n{text}") from exc
    if proc.returncode != 0:
        raise EngineError(
            f"vLLM engine run failed with exit status {proc.returncode}:\n{proc.stderr[-6000:]}"
        )
    try:
        payload = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise EngineError(
            f"vLLM engine run printed no JSON result: {proc.stdout[-2000:]!r}\n{proc.stderr[-4000:]}"
        ) from exc
    batches = tuple(
        tuple(RequestResult(tuple(r["token_ids"]), int(r["num_cached_tokens"] or 0)) for r in batch)
        for batch in payload["batches"]
    )
    events = tuple(tuple(batch) for batch in payload.get("kv_events", ()))
    return EngineRun(batches, payload["timings"], proc.stderr, events, payload.get("prometheus", ""))


def _vllm_shm() -> set[str]:
    """The shared-memory segments of vLLM's CPU tensor-parallel communicator (``vllm_dist_*``)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("vllm_dist_")}
    except FileNotFoundError:
        return set()


@contextlib.contextmanager
def _removing_new_vllm_shm(before: set[str]) -> Iterator[None]:
    """Remove the ``vllm_dist_*`` segments that appeared while the body ran (an engine process of
    this test's: vLLM unlinks them as it shuts down, but one killed on a busy machine leaves
    them, 8 MiB a TP=2 engine)."""
    try:
        yield
    finally:
        for name in _vllm_shm() - before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


def make_prompt(seed: int, length: int, *, vocab_size: int = 512) -> tuple[int, ...]:
    """``length`` pseudo-random plain token ids, the same for the same ``seed`` everywhere."""
    rng = random.Random(seed)
    return tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length))


def probe_kv_transfer_config(log_path: Path) -> dict[str, Any]:
    """A ``kv_transfer_config`` that loads :class:`ProbeConnector` logging to ``log_path``."""
    return {
        "kv_connector": "ProbeConnector",
        "kv_connector_module_path": "tests.integrations.vllm.probe_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"probe_log": str(log_path)},
    }


def read_probe_log(log_path: Path) -> list[dict[str, Any]]:
    """The calls ``ProbeConnector`` recorded, in order."""
    with open(log_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
