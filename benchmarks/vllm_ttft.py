"""Time to first token of a long shared document on vLLM (CPU): recompute, vLLM's ExampleConnector, kvflow.

    python benchmarks/vllm_ttft.py [--doc-tokens 4096] [--repeat 3] [--workdir /dev/shm/kvflow-vllm-ttft]

A random-weight Llama (hidden 1024, 4 layers, 16 heads, 4 KV heads of 64, float32: big enough that a
prefill of thousands of tokens takes seconds on a CPU, small enough to build in seconds) reads a
document of ``--doc-tokens`` tokens followed by a short question, and generates one token. Every case
runs in fresh processes, one after the other:

- ``recompute``: no connector. The engine computes the whole prompt. The same process then asks new
  questions without resetting its prefix cache: ``vllm-prefix-cache`` is vLLM's own in-engine hit on
  the document, the floor any external cache can approach;
- ``example``: vLLM's ExampleConnector (safetensors files per layer, keyed by the whole prompt
  but its last block). One process stores the document, a fresh one loads it;
- ``kvflow``: kvflow's connector with the local shared-memory backend. Same two processes.

The storing process asks one short question about the document. In each measuring process one
warm-up request runs first, then ``--repeat`` short questions (under one block) and ``--repeat``
long ones (several blocks), each after ``llm.reset_prefix_cache()`` so that it cannot hit vLLM's own
cache. A question's TTFT is the wall
time of ``LLM.generate`` with ``max_tokens=1`` (in-process engine core). The report gives the median
per case, the tokens each hit covered, and the ratios. The first generated token of every case must
agree (a load that changed the KV would show here). Stores go to ``--workdir`` (tmpfs by default),
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
VOCAB = 8192
#: A question under one block (every case can hit the whole document) and one of several blocks
#: (a store keyed by the whole prompt, as ExampleConnector is, finds nothing for it).
QUESTIONS = {"short": 24, "long": 200}


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def _question(seed: int, kind: str) -> list[int]:
    return _tokens(1000 * QUESTIONS[kind] + seed, QUESTIONS[kind])


# -- the child: one engine process ---------------------------------------------------------------


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["kv_transfer_config"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    doc = spec["doc"]
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        seed=0,
        block_size=BLOCK,
        max_model_len=len(doc) + 256,
        max_num_batched_tokens=len(doc) + 256,  # the whole prompt in one step (ExampleConnector needs it)
        kv_cache_memory_bytes=512 << 20,
        enforce_eager=True,
        skip_tokenizer_init=True,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def ask(question: list[int]) -> dict[str, Any]:
        prompt = TokensPrompt(prompt_token_ids=doc + question)
        started = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return {
            "ttft_s": time.perf_counter() - started,
            "cached": out.num_cached_tokens,
            "token": out.outputs[0].token_ids[0],
        }

    result: dict[str, Any] = {}
    if spec["role"] == "fill":
        result["fill"] = ask(_question(0, "short"))
    else:
        llm.generate([TokensPrompt(prompt_token_ids=_tokens(99, 64))], params, use_tqdm=False)  # warm-up
        for kind in QUESTIONS:
            asks = []
            for r in range(spec["repeat"]):
                llm.reset_prefix_cache()
                asks.append(ask(_question(1 + r, kind)))
            result[kind] = asks
            if spec["local_floor"]:  # new questions, the document in vLLM's own prefix cache
                result[f"{kind}-local"] = [ask(_question(100 + r, kind)) for r in range(spec["repeat"])]
    llm.llm_engine.engine_core.shutdown()
    return result


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "-"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{spec['case']} {spec['role']} failed:\n{proc.stderr[-5000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


# -- the parent ------------------------------------------------------------------------------------


def _write_model(path: Path) -> None:
    sys.path.insert(0, str(REPO_ROOT))  # the model writer of the vLLM tests
    from tests.integrations.vllm.tiny_model import TinyLlamaSpec, write_tiny_llama

    spec = TinyLlamaSpec(
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        weight_std=0.02,
        dtype="float32",
    )
    write_tiny_llama(path, spec)


def _transfer(case: str, workdir: Path) -> dict[str, Any] | None:
    if case == "recompute":
        return None
    if case == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
        }
    return {
        "kv_connector": "KVFlowConnector",
        "kv_connector_module_path": "kvflow.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": f"local://{workdir / 'kvflow'}?capacity=2GiB"},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, default=4096, help="a multiple of 32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(f"/dev/shm/kvflow-vllm-ttft-{os.getpid()}"))
    parser.add_argument("--model", type=Path, help="reuse a model directory written by an earlier run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        spec = json.loads(sys.stdin.read())
        result_fd = os.dup(1)
        os.dup2(2, 1)  # vLLM logs to stdout: keep the result alone on the real one
        result = _child(spec)
        with os.fdopen(result_fd, "w") as out:
            json.dump(result, out)
        return 0
    if args.doc_tokens % BLOCK:
        parser.error(f"--doc-tokens must be a multiple of {BLOCK}")

    args.workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvflow-vllm-ttft-model-"))
    try:
        model = args.model
        if model is None:
            model = scratch / "model"
            _write_model(model)
        doc = _tokens(0, args.doc_tokens)
        base = {"model": str(model), "doc": doc, "repeat": args.repeat}
        rows: dict[str, dict[str, Any]] = {}
        for case in ("recompute", "example", "kvflow"):
            transfer = _transfer(case, args.workdir)
            spec = {**base, "case": case, "kv_transfer_config": transfer, "local_floor": case == "recompute"}
            if transfer is not None:
                _run_child({**spec, "role": "fill"})
            rows[case] = _run_child({**spec, "role": "measure"})
            print(f"{case}: {json.dumps(rows[case])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(args.workdir, ignore_errors=True)

    print(
        f"document {args.doc_tokens} tokens, block {BLOCK}, float32; per question kind: median TTFT "
        f"of {args.repeat}, tokens cached, speed-up over recompute"
    )
    print(
        f"{'case':<20}" + "".join(f"{f'{kind} question ({n} tokens)':>36}" for kind, n in QUESTIONS.items())
    )
    firsts: dict[str, set[int]] = {kind: set() for kind in QUESTIONS}
    for case in (*rows, "vllm-prefix-cache"):
        cells = []
        for kind in QUESTIONS:
            if case == "vllm-prefix-cache":
                asks = rows["recompute"][f"{kind}-local"]
            else:
                asks = rows[case][kind]
                firsts[kind].add(asks[0]["token"])
            seconds = statistics.median(a["ttft_s"] for a in asks)
            recompute = statistics.median(a["ttft_s"] for a in rows["recompute"][kind])
            cells.append(f"{seconds:>14.3f} s{asks[0]['cached']:>10}{recompute / seconds:>10.1f}x")
        print(f"{case:<20}" + "".join(cells))
    for kind in QUESTIONS:
        ratio = statistics.median(a["ttft_s"] for a in rows["example"][kind]) / statistics.median(
            a["ttft_s"] for a in rows["kvflow"][kind]
        )
        print(f"{kind} question: kvflow TTFT is ExampleConnector's divided by {ratio:.2f}")
    if any(len(tokens) != 1 for tokens in firsts.values()):
        print(f"WARNING: the cases generated different first tokens {firsts}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
