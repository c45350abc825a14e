"""Run one offline vLLM engine on CPU from a JSON spec and print the results as JSON on stdout.

Usage: ``python run_engine.py SPEC.json`` (or ``-`` to read the spec from stdin).

The spec (every key but ``model`` and ``batches`` optional)::

    {"model": "/tmp/tiny", "batches": [[[1, 2, 3], [1, 2, 4]], [[5, 6]]],
     "max_tokens": 8, "dtype": "float32", "block_size": 32, "max_model_len": 2048,
     "kv_cache_memory_bytes": 16777216, "max_num_batched_tokens": null,
     "enable_prefix_caching": true, "kv_transfer_config": null,
     "tensor_parallel_size": 1, "multiprocessing": false, "seed": 0, "env": {},
     "between_batches": ["reset", "sleep"], "kv_events": false, "prometheus": false}

Each batch is one ``LLM.generate`` call on the same engine, in order, so a later batch can hit what an
earlier one cached. ``between_batches`` runs engine calls after every batch but the last: ``reset``
(``llm.reset_prefix_cache()``, its answer recorded) and ``sleep`` (``llm.sleep(level=1)`` then
``llm.wake_up()``, which reset the connector's cache too) and ``ls:DIR`` (the sorted names in
``DIR``, recorded as ``{"ls": [...]}``, at the moment the previous ``generate`` returned).
``kv_events`` turns on vLLM's KV cache events, published on an in-process ZMQ endpoint (in-process
mode only) that this script subscribes to; ``prometheus`` turns on vLLM's stats loggers and returns
the Prometheus text of this process's registry at the end. Prompts are token ids (no tokenizer is
loaded); sampling is greedy and ignores EOS, so every request produces exactly ``max_tokens``
tokens. The result::

    {"batches": [[{"token_ids": [...], "num_cached_tokens": 0}, ...], ...],
     "timings": {"import_s": ..., "init_s": ..., "generate_s": [...], "shutdown_s": ...,
                 "between": [{"reset": true, "slept": true}, ...]},
     "kv_events": [[{"type": "BlockStored", "medium": "CPU", "block_hashes": ["hex"], ...}], ...],
     "prometheus": "# HELP ..."}

Everything vLLM logs goes to stderr: the script moves file descriptor 1 onto stderr before importing
vLLM and writes the result alone to the original stdout. Run it in a fresh process for every engine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _read_spec(arg: str) -> dict[str, Any]:
    text = sys.stdin.read() if arg == "-" else Path(arg).read_text(encoding="utf-8")
    spec = json.loads(text)
    if not isinstance(spec, dict) or "model" not in spec or "batches" not in spec:
        raise SystemExit("the spec must be a JSON object with at least 'model' and 'batches'")
    return spec


def _apply_env(spec: dict[str, Any]) -> None:
    """Set the environment before vLLM is imported (it reads most variables at import)."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing") else "0"
    for key, value in (spec.get("env") or {}).items():
        os.environ[str(key)] = str(value)


EVENTS_ENDPOINT = "inproc://kvflow-test-kv-events"


def _hash_text(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else value


def _event_json(event: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"type": type(event).__name__}
    for name in ("medium", "block_size", "token_ids"):
        if hasattr(event, name):
            data[name] = getattr(event, name)
    if hasattr(event, "block_hashes"):
        data["block_hashes"] = [_hash_text(h) for h in event.block_hashes]
    if hasattr(event, "parent_block_hash"):
        data["parent_block_hash"] = _hash_text(event.parent_block_hash)
    return data


class _EventReader:
    """A ZMQ subscriber of vLLM's KV event publisher (same process: an inproc endpoint)."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(EVENTS_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def drain(self, quiet_s: float = 1.0) -> list[dict[str, Any]]:
        """Events published so far: reads until nothing came for ``quiet_s``."""
        events: list[dict[str, Any]] = []
        while self._socket.poll(int(quiet_s * 1000)):
            _topic, _seq, payload = self._socket.recv_multipart()
            events += [_event_json(e) for e in self._decoder.decode(payload).events]
        return events

    def close(self) -> None:
        self._socket.close(linger=0)


def _run(spec: dict[str, Any], timings: dict[str, Any], extras: dict[str, Any]) -> list[list[dict[str, Any]]]:
    started = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    timings["import_s"] = time.perf_counter() - started

    kwargs: dict[str, Any] = {}
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("max_num_batched_tokens") is not None:
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=EVENTS_ENDPOINT
        )
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
        kwargs["distributed_executor_backend"] = spec.get("distributed_executor_backend", "mp")

    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        seed=int(spec.get("seed", 0)),
        block_size=int(spec.get("block_size", 32)),
        max_model_len=int(spec.get("max_model_len", 2048)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_memory_bytes", 16 << 20)),
        enable_prefix_caching=bool(spec.get("enable_prefix_caching", True)),
        enforce_eager=True,
        skip_tokenizer_init=True,
        disable_log_stats=not spec.get("prometheus") and bool(spec.get("disable_log_stats", True)),
        **kwargs,
    )
    timings["init_s"] = time.perf_counter() - started
    reader = _EventReader() if spec.get("kv_events") else None
    if reader is not None:
        extras["kv_events"] = []

    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(spec.get("max_tokens", 8)),
        ignore_eos=True,
        detokenize=False,
    )
    results: list[list[dict[str, Any]]] = []
    timings["generate_s"] = []
    timings["between"] = []
    for index, batch in enumerate(spec["batches"]):
        if index:
            done: dict[str, Any] = {}
            for action in spec.get("between_batches") or ():
                if action == "reset":
                    done["reset"] = bool(llm.reset_prefix_cache())
                elif action == "sleep":
                    llm.sleep(level=1)
                    llm.wake_up()
                    done["slept"] = True
                elif action.startswith("ls:"):
                    done["ls"] = sorted(os.listdir(action[3:]))
                else:
                    raise SystemExit(f"unknown between_batches action {action!r}")
            timings["between"].append(done)
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in batch]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        timings["generate_s"].append(time.perf_counter() - started)
        results.append(
            [
                {
                    "token_ids": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                }
                for out in outputs
            ]
        )
        if reader is not None:
            extras["kv_events"].append(reader.drain())

    if reader is not None:
        reader.close()
    if spec.get("prometheus"):
        import prometheus_client

        extras["prometheus"] = prometheus_client.generate_latest().decode()
    started = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    timings["shutdown_s"] = time.perf_counter() - started
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = _read_spec(argv[1])
    _apply_env(spec)
    result_fd = os.dup(1)
    os.dup2(2, 1)  # vLLM (and its worker processes) log to stdout: send all of that to stderr
    timings: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    started = time.perf_counter()
    batches = _run(spec, timings, extras)
    timings["total_s"] = time.perf_counter() - started
    sys.stdout.flush()
    with os.fdopen(result_fd, "w", encoding="utf-8") as out:
        json.dump({"batches": batches, "timings": timings, **extras}, out)
        out.write("\n")
    return 0


if __name__ == "__main__":  # required: vLLM's multiprocessing mode spawns this module again
    sys.exit(main(sys.argv))
