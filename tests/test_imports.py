"""Core kvflow imports and works without vLLM, Mooncake or torch_npu installed."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"vllm", "mooncake", "torch_npu"}:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=120)


def test_core_and_embedded_backends_work_without_optional_packages() -> None:
    proc = run(
        "import anyio, torch, kvflow\n"
        "from kvflow.backends.local import LocalBackend\n"
        "from kvflow.events import make_event\n"
        "event = make_event('cpu')\n"
        "event.record()\n"
        "assert event.query()\n"
        "layout = kvflow.KVLayout.from_kv_caches({'l': torch.randn(4, 2, 16, 8)})\n"
        "async def go():\n"
        "    async with kvflow.KVPool.create(layout=layout) as pool:\n"
        "        await pool.store(kvflow.KVRequest(block_ids=[0, 1], tokens=list(range(32))))\n"
        "        return await pool.lookup(kvflow.KVRequest(tokens=list(range(32))))\n"
        "print(anyio.run(go))\n"
        "assert not {'vllm', 'mooncake', 'torch_npu'} & set(sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "32"


def test_missing_optional_packages_name_what_to_install() -> None:
    proc = run(
        "import kvflow\n"
        "for url in ('mooncake://127.0.0.1:1',):\n"
        "    try:\n"
        "        kvflow.open_backend(url)\n"
        "    except kvflow.MissingDependencyError as exc:\n"
        "        print(exc)\n"
        "try:\n"
        "    import kvflow.integrations.vllm\n"
        "except kvflow.MissingDependencyError as exc:\n"
        "    print(exc)\n"
        "try:\n"
        "    kvflow.events.make_event('npu')\n"
        "except kvflow.MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3
    assert "pip install 'kvflow[mooncake]'" in lines[0]
    assert "pip install vllm" in lines[1] and "pip install 'kvflow[vllm]'" in lines[1]
    assert "pip install 'kvflow[npu]'" in lines[2]
