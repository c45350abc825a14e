"""Time to first token of a long shared document on vLLM (CPU): recompute, vLLM's ExampleConnector, kvflow.

    python benchmarks/vllm_ttft.py [--doc-tokens 4096] [--repeat 3] [--workdir /dev/shm/kvflow-vllm-ttft]
                                   [--cases kvflow-arena,example] [--flush]
    unshare -n bash -c 'ip link set lo up && python benchmarks/vllm_ttft.py --mooncake'

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
- ``kvflow-async``: the same with ``load_async=true`` (the request waits while its load runs).
- ``kvflow-arena``: kvflow's connector with the arena backend (one pre-allocated shared region of
  256 KiB slots, the size of this model's objects). Same two processes.
- ``kvflow-arena-async``: the same with ``load_async=true``.
- ``kvflow-arena-layerwise``: the same with ``layerwise=true``: each layer is stored and loaded as
  its own objects, and the load of layer l+1 runs while layer l computes. In a store of its own
  (sharing the other arena cases' store, it would load their whole-block objects layer by layer).
- with ``--mooncake`` (inside a private network namespace: it starts a Mooncake master and a
  segment holder on 127.0.0.1): ``mooncake-store`` (vLLM's MooncakeStoreConnector, which loads
  asynchronously only) and ``kvflow-mooncake`` (kvflow over the same master).

The storing process asks one short question about the document. In each measuring process one
warm-up request runs first, then ``--repeat`` short questions (under one block) and ``--repeat``
long ones (several blocks), each after vLLM's prefix cache was reset so that it cannot hit vLLM's
own cache (``llm.reset_prefix_cache()`` does nothing while a connector holds blocks: the harness
runs one-token requests until it succeeds, and stops with an error if it never does). For kvflow the
report breaks each question's time down by the connector's calls (lookup; the scheduler's other
calls; load; store; finish; the rest: the forward and vLLM itself), the time Python's garbage
collector ran, counts the engine steps it took (more than one: the request waited for its load),
and times the loading step from its hand-over to the worker (``handle_preemptions``) to the start
of its forward: vLLM's preparation of the step's inputs, and what of the load did not run beside it.
Right after each measured question every engine asks a new question of the same kind that its own
prefix cache answers (no reset): each case is also given as a ratio to that floor in its own
process, because two engine processes differ by more than the 10% the target allows, as the ratio of
the medians and question by question (the median of each question's ratio to the floor question
asked right after it: one engine's speed drifts by more than 10% within a run, and a pair shares the
drift). The report ends with the least any load can take: the document's KV copied once by the
backends' copy loop (the faster of memmove and the streamed copy), caches cold. With ``--flush``
every measured and floor question starts with the CPU's caches flushed (untimed), as ``kvflow
bench`` times its calls: a floor question otherwise finds the document's KV in the caches, where the
question before it left it, and a loaded one in memory, where a load writing with streaming stores
leaves it; an engine serving other requests between two of the same document finds it in memory
either way. A question's TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1`` (in-process
engine core). The report gives the median per case, the tokens each hit covered, and the ratios.
Each case asks questions of its own (cases sharing a store would otherwise hit the question blocks
an earlier case stored: engines store what they compute after a load), and every measured question
must find cached exactly what a hit of the document alone gives (the run stops otherwise). The
recompute engine also answers every other case's questions (the document in its prefix cache): the
first generated token of every measured question of every case must agree with it (a load that
changed the KV would show here). Stores go to ``--workdir`` (tmpfs by default), removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
VOCAB = 8192
#: A question under one block (every case can hit the whole document) and one of several blocks
#: (a store keyed by the whole prompt, as ExampleConnector is, finds nothing for it).
QUESTIONS = {"short": 24, "long": 200}
#: The model's KV geometry (float32): what a load of the document moves.
LAYERS, KV_HEADS, HEAD_DIM = 4, 4, 64
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def _question(seed: int, kind: str) -> list[int]:
    return _tokens(1000 * QUESTIONS[kind] + seed, QUESTIONS[kind])


# -- the child: one engine process ---------------------------------------------------------------


#: Where a kvflow question's time goes: the connector's calls, by the part of vLLM that makes them.
PHASES = {
    "lookup": ("get_num_new_matched_tokens",),
    "scheduler": ("update_state_after_alloc", "build_connector_meta", "update_connector_output"),
    "load": ("handle_preemptions", "start_load_kv", "wait_for_layer_load", "get_block_ids_with_load_errors"),
    "store": ("save_kv_layer", "wait_for_save", "request_finished"),
    "finish": ("get_finished",),
}


class _Phases:
    """Seconds spent in the kvflow connector's calls (the engine core runs in this process), the
    engine steps taken (one ``build_connector_meta`` per step), and the seconds Python's garbage
    collector ran, in any thread (:meth:`watch_gc`; a collection inside a connector call counts
    in that call's phase too)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.gc_s = 0.0
        self._gc_started = 0.0
        self.to_forward_s = 0.0  # from each step's hand-over to a worker to its forward's start
        self._handed = 0.0

    def watch_gc(self) -> None:
        import gc

        def timed(stage: str, _: dict[str, Any]) -> None:
            if stage == "start":
                self._gc_started = time.perf_counter()
            else:
                self.gc_s += time.perf_counter() - self._gc_started

        gc.callbacks.append(timed)

    def install(self) -> None:
        from kvflow.integrations.vllm.connector import KVFlowConnector

        for phase, names in PHASES.items():
            for name in names:
                setattr(KVFlowConnector, name, self._timed(phase, name, getattr(KVFlowConnector, name)))

    def _timed(self, phase: str, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            if name == "handle_preemptions" and getattr(args[1], "loads", ()):  # loads before the forward
                self._handed = started
            try:
                return method(*args, **kwargs)
            finally:
                ended = time.perf_counter()
                self.seconds[phase] += ended - started
                self.steps += name == "build_connector_meta"
                if name == "start_load_kv" and self._handed:
                    self.to_forward_s += ended - self._handed
                    self._handed = 0.0

        return timed

    def snapshot(self) -> tuple[dict[str, float], int, float, float]:
        return dict(self.seconds), self.steps, self.gc_s, self.to_forward_s


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvflow.tools.baselines import CacheFlush

    kwargs: dict[str, Any] = {}
    phases = _Phases()
    phases.watch_gc()
    if spec["case"].startswith("kvflow"):
        phases.install()
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
    flush = CacheFlush() if spec["flush"] else None

    def ask(seed: int, kind: str) -> dict[str, Any]:
        prompt = TokensPrompt(prompt_token_ids=doc + _question(seed, kind))
        if flush is not None:
            flush()
        before, steps, gc_before, to_forward = phases.snapshot()
        started = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        ttft = time.perf_counter() - started
        after, steps_after, gc_after, to_forward_after = phases.snapshot()
        spent = {phase: after[phase] - before[phase] for phase in PHASES}
        return {
            "seed": seed,
            "ttft_s": ttft,
            "cached": out.num_cached_tokens,
            "token": out.outputs[0].token_ids[0],
            "phases_s": {**spent, "rest": ttft - sum(spent.values())},
            "gc_s": gc_after - gc_before,
            "steps": steps_after - steps,
            "to_forward_s": to_forward_after - to_forward,
        }

    def reset() -> None:
        """Empty vLLM's prefix cache; a connector still holding blocks makes the reset fail until
        a later step lets them go, so step the engine with one-token requests until it succeeds."""
        for _ in range(50):
            if llm.reset_prefix_cache():
                return
            llm.generate([TokensPrompt(prompt_token_ids=[7])], params, use_tqdm=False)
        raise RuntimeError(
            "vLLM's prefix cache could not be reset: the question would measure it, not the connector"
        )

    result: dict[str, Any] = {}
    if spec["role"] == "fill":
        result["fill"] = ask(0, "short")
    else:
        llm.generate([TokensPrompt(prompt_token_ids=_tokens(99, 64))], params, use_tqdm=False)  # warm-up
        for kind in QUESTIONS:
            asks, local = [], []
            for r in range(spec["repeat"]):
                reset()
                # this case's own questions: cases sharing a store (kvflow and kvflow-async, the
                # arena cases) would otherwise hit the blocks another case stored of them
                asks.append(ask(spec["question_seed"] + r, kind))
                if spec["local_floor"]:  # right after it, a new question that finds the document
                    # in vLLM's own prefix cache: the floor beside each measured question, through
                    # the engine's drift (seeds no other case asks, for the same reason)
                    local.append(ask(spec["local_seed"] + r, kind))
            result[kind] = asks
            if spec["local_floor"]:
                result[f"{kind}-local"] = local
            # the first token of every other case's questions, from this engine (no connector; the
            # document in its prefix cache): what each case's load must reproduce
            result[f"{kind}-reference"] = [ask(seed, kind) for seed in spec.get("reference_seeds", [])]
    llm.llm_engine.engine_core.shutdown()
    return result


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    with tempfile.TemporaryDirectory(prefix="kvflow-vllm-ttft-") as tmp:  # vLLM's IPC sockets go there
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "-"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env={**env, "TMPDIR": tmp},
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
        num_layers=LAYERS,
        num_heads=16,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        weight_std=0.02,
        dtype="float32",
    )
    write_tiny_llama(path, spec)


def _transfer(case: str, workdir: Path, master: str | None) -> dict[str, Any] | None:
    if case == "recompute":
        return None
    if case == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
        }
    if case == "mooncake-store":  # configured by the MOONCAKE_CONFIG_PATH file only
        return {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {},
        }
    backend = f"local://{workdir / 'kvflow'}?capacity=2GiB"
    if case.startswith("kvflow-arena"):  # the layerwise case's own store: it would load the others'
        store = "kvflow-arena-layerwise" if case.endswith("-layerwise") else "kvflow-arena"
        backend = f"arena://{workdir / store}?capacity=1GiB&slot=256KiB"
    if case == "kvflow-mooncake":
        backend = f"mooncake://{master}?segment=0"  # the segment holder lends the memory
    return {
        "kv_connector": "KVFlowConnector",
        "kv_connector_module_path": "kvflow.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "backend": backend,
            "load_async": case.endswith("-async"),
            "layerwise": case.endswith("-layerwise"),
        },
    }


@contextlib.contextmanager
def _mooncake(workdir: Path) -> Iterator[str]:
    """A master and a 2 GB segment holder on 127.0.0.1 (private network namespace only), and the
    config file vLLM's MooncakeStoreConnector reads; yields the master's address."""
    from kvflow.tools.mooncake_master import start_master, start_segment_holder

    with (
        start_master(rpc_port=50051, metrics_port=9003, log_path=workdir / "master.log") as master,
        start_segment_holder(master.address),
    ):
        config = workdir / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    "protocol": "tcp",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "64MB",
                }
            )
        )
        os.environ["MOONCAKE_CONFIG_PATH"] = str(config)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        yield master.address


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, default=4096, help="a multiple of 32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(f"/dev/shm/kvflow-vllm-ttft-{os.getpid()}"))
    parser.add_argument("--model", type=Path, help="reuse a model directory written by an earlier run")
    parser.add_argument(
        "--mooncake",
        action="store_true",
        help="also vLLM's MooncakeStoreConnector and kvflow over Mooncake (private network namespace only)",
    )
    parser.add_argument("--cases", help="comma-separated subset of the cases (recompute always runs)")
    parser.add_argument(
        "--flush",
        action="store_true",
        help="flush the CPU's caches before every measured and floor question (untimed)",
    )
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
    if not 1 <= args.repeat < 100:
        parser.error("--repeat must be 1 to 99 (each case's questions are 100 seeds apart)")

    args.workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvflow-vllm-ttft-model-"))
    try:
        model = args.model
        if model is None:
            model = scratch / "model"
            _write_model(model)
        doc = _tokens(0, args.doc_tokens)
        base = {"model": str(model), "doc": doc, "repeat": args.repeat, "flush": args.flush}
        rows: dict[str, dict[str, Any]] = {}
        cases = ["recompute", "example", "kvflow", "kvflow-async", "kvflow-arena", "kvflow-arena-async"]
        cases += ["kvflow-arena-layerwise"]
        if args.mooncake:
            cases += ["mooncake-store", "kvflow-mooncake"]
        if args.cases:
            cases = ["recompute", *(c for c in args.cases.split(",") if c in cases and c != "recompute")]
        with _mooncake(args.workdir) if args.mooncake else contextlib.nullcontext("") as master:
            for case in cases:
                transfer = _transfer(case, args.workdir, master)
                # every engine also asks new questions its own prefix cache answers: the floor in
                # the same process (engine processes differ by more than the 10% asked for)
                spec = {
                    **base,
                    "case": case,
                    "kv_transfer_config": transfer,
                    "local_floor": True,
                    "local_seed": 100 + 100 * cases.index(case),
                    "question_seed": _question_seed(cases, case),
                }
                if case == "recompute":  # the reference tokens of every other case's questions
                    spec["reference_seeds"] = [
                        _question_seed(cases, other) + r for other in cases[1:] for r in range(args.repeat)
                    ]
                if transfer is not None:
                    _run_child({**spec, "role": "fill"})
                rows[case] = _run_child({**spec, "role": "measure"})
                print(f"{case}: {json.dumps(rows[case])}", file=sys.stderr, flush=True)
                _check_cached(case, rows[case], len(doc))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(args.workdir, ignore_errors=True)

    print(
        f"document {args.doc_tokens} tokens, block {BLOCK}, float32; per question kind: median TTFT "
        f"of {args.repeat}, tokens cached, speed-up over recompute"
        + ("; the CPU's caches flushed before every question" if args.flush else "")
    )
    print(
        f"{'case':<20}" + "".join(f"{f'{kind} question ({n} tokens)':>36}" for kind, n in QUESTIONS.items())
    )
    for case in (*rows, "vllm-prefix-cache"):
        cells = []
        for kind in QUESTIONS:
            asks = rows["recompute"][f"{kind}-local"] if case == "vllm-prefix-cache" else rows[case][kind]
            seconds = statistics.median(a["ttft_s"] for a in asks)
            recompute = statistics.median(a["ttft_s"] for a in rows["recompute"][kind])
            cells.append(f"{seconds:>14.3f} s{asks[0]['cached']:>10}{recompute / seconds:>10.1f}x")
        print(f"{case:<20}" + "".join(cells))
    floor = {
        kind: statistics.median(a["ttft_s"] for a in rows["recompute"][f"{kind}-local"]) for kind in QUESTIONS
    }
    for case in rows:
        if case == "recompute":
            continue
        ratios = ", ".join(
            f"{kind} {statistics.median(a['ttft_s'] for a in rows[case][kind]) / floor[kind]:.2f}x"
            for kind in QUESTIONS
        )
        own = ", ".join(
            f"{kind} {_median_ttft(rows[case][kind]) / _median_ttft(rows[case][f'{kind}-local']):.2f}x"
            for kind in QUESTIONS
        )
        paired = ", ".join(
            f"{kind} {_paired_ratio(rows[case][kind], rows[case][f'{kind}-local']):.2f}x"
            for kind in QUESTIONS
        )
        print(
            f"{case}: TTFT over vLLM's own prefix-cache hit: {ratios} (over its own engine's hit: {own}; "
            f"question by question, each over the floor question asked right after it: {paired})"
        )
    kv_bytes = args.doc_tokens * KV_BYTES_PER_TOKEN
    copy_ms = 1000 * _copy_s(kv_bytes)
    print(
        f"the document's KV ({kv_bytes >> 20} MiB) copied once, caches cold, by the copy loop: "
        f"{copy_ms:.1f} ms, {copy_ms / (10 * floor['short']):.1f}% of the short question's floor "
        "(the load's least; 1.10x the floor leaves 10% for the whole load)"
    )
    for case in (c for c in rows if c.startswith("kvflow")):
        for kind in QUESTIONS:
            asks = rows[case][kind]
            parts = ", ".join(
                f"{phase} {1000 * statistics.median(a['phases_s'][phase] for a in asks):.1f}"
                for phase in (*PHASES, "rest")
            )
            steps = statistics.median(a["steps"] for a in asks)
            gc_ms = 1000 * statistics.median(a["gc_s"] for a in asks)
            collector = f"collector {gc_ms:.1f} (any thread)"
            to_forward = 1000 * statistics.median(a.get("to_forward_s", 0.0) for a in asks)
            print(
                f"{case} {kind}: median ms in {parts}, {collector}; {steps:g} engine steps; "
                f"from the loading step's hand-over to its forward {to_forward:.1f}"
            )
    for kind in QUESTIONS:  # the floor's collector time, beside the connector cases'
        local = rows["recompute"].get(f"{kind}-local", [])
        if local:
            gc_ms = 1000 * statistics.median(a["gc_s"] for a in local)
            print(f"vllm-prefix-cache {kind}: garbage collector {gc_ms:.1f} ms (median)")
    differ = _differing_tokens(rows)
    if differ:
        print(
            "WARNING: these questions' first tokens differ from the recompute engine's for the same "
            "question (a load changed the KV): " + "; ".join(differ),
            file=sys.stderr,
        )
        return 1
    return 0


def _question_seed(cases: list[str], case: str) -> int:
    """The first seed of ``case``'s measured questions: each case asks its own (``--repeat`` under
    100), apart from every case's floor questions (seeds 100 + 100 * index)."""
    return 100_000 + 100 * cases.index(case)


def _expected_cached(case: str, kind: str, doc_tokens: int) -> set[int]:
    """The tokens a measured question may find cached: the whole document through kvflow, nothing
    without a connector, and at most the document through another project's connector (vLLM's
    ExampleConnector keys by the whole prompt: a long question misses). Never more than the
    document: a question's own blocks were stored by an earlier question, not by this case's fill."""
    if case == "recompute":
        return {0}
    if case.startswith("kvflow"):
        return {doc_tokens}
    return {0, doc_tokens}


def _check_cached(case: str, row: dict[str, Any], doc_tokens: int) -> None:
    """Stop the run unless every measured question of ``case`` found what a hit of the document
    alone gives, and every floor question the document in the engine's own prefix cache."""
    wrong = [
        f"{kind} question {i} (seed {a['seed']}): {a['cached']} tokens cached, expected "
        f"{sorted(_expected_cached(case, kind, doc_tokens))}"
        for kind in QUESTIONS
        for i, a in enumerate(row[kind])
        if a["cached"] not in _expected_cached(case, kind, doc_tokens)
    ]
    wrong += [
        f"{kind} floor question {i}: {a['cached']} tokens cached, expected {doc_tokens}"
        for kind in QUESTIONS
        for i, a in enumerate(row.get(f"{kind}-local", []))
        if a["cached"] != doc_tokens
    ]
    if wrong:
        raise SystemExit(
            f"{case}: a question's hit is not the document's alone, so its TTFT would not measure a "
            "load of the document (a store shared with another case answering its question blocks?): "
            + "; ".join(wrong)
        )


def _differing_tokens(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Every measured question of every case whose first token differs from the one the recompute
    engine generated for the same question (its own measured questions, and every other case's
    asked with the document in its prefix cache)."""
    reference = {
        kind: {
            a["seed"]: a["token"] for a in (*rows["recompute"][kind], *rows["recompute"][f"{kind}-reference"])
        }
        for kind in QUESTIONS
    }
    return [
        f"{case} {kind} question {i} (seed {a['seed']}): {a['token']}, recompute {want}"
        for case, row in rows.items()
        for kind in QUESTIONS
        for i, a in enumerate(row[kind])
        if a["token"] != (want := reference[kind].get(a["seed"]))
    ]


def _median_ttft(asks: list[dict[str, Any]]) -> float:
    return statistics.median(a["ttft_s"] for a in asks)


def _paired_ratio(asks: list[dict[str, Any]], floor: list[dict[str, Any]]) -> float:
    """The median over repeats of a question's TTFT over its floor question's, asked right after
    it in the same engine: the engine's speed drifts by more than 10% within a run, and a pair
    shares the drift."""
    return statistics.median(a["ttft_s"] / f["ttft_s"] for a, f in zip(asks, floor, strict=True))


def _copy_s(nbytes: int, repeat: int = 5) -> float:
    """Best of ``repeat`` copies of ``nbytes`` between two buffers by the backends' compiled copy
    loop (one thread, as a load copies), by memmove and streamed (as a load writes), whichever is
    faster, each from flushed caches (a load reads a store's memory and writes the engine's), as
    ``kvflow bench`` times its calls."""
    from kvflow.tools.baselines import CacheFlush, plain_and_streamed_gbps

    best_gbps = max(plain_and_streamed_gbps(nbytes, nbytes, repeat=repeat, before=CacheFlush()))
    return nbytes / (best_gbps * 1e9)


if __name__ == "__main__":
    sys.exit(main())
