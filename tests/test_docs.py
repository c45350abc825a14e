"""Every Python block in README.md and docs/*.md runs as written; the README prints what it says.

Each ```python block runs alone in a fresh interpreter (a subprocess in a temporary directory, with
a timeout), as a reader who copies it would run it. As root, the subprocess also gets a private,
empty /dev/shm (its own mount namespace), so that blocks using ``local://`` leave nothing in the
machine's shared memory; elsewhere a default store a block created is removed afterwards.

A block may be marked by an HTML comment on the line right before its fence:

- ``<!-- doc-test: skip REASON -->``: not run. Only for blocks that need a GPU or a service this
  machine cannot have (a model hub, a remote cluster); the reason is shown in the test report.
- ``<!-- doc-test: import-only REASON -->``: run with ``__name__`` other than ``"__main__"``, so
  a block's ``if __name__ == "__main__":`` part (an engine run on a real model) is left out and the
  rest (imports, configuration) still runs.

Blocks that use Mooncake run where the Mooncake tests run (a private network namespace; they fail
instead of skipping with KVFLOW_REQUIRE_MOONCAKE=1); blocks that use vLLM need vLLM installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from kvflow.backends.arena.config import default_arena_path
from kvflow.backends.local.config import default_path
from tests.backends.conftest import REQUIRE_ENV, mooncake_unusable_reason

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 300
_BLOCK = re.compile(r"^```python\n(.*?)^```$", flags=re.MULTILINE | re.DOTALL)
_MARK = re.compile(r"<!--\s*doc-test:\s*(skip|import-only)\s+(.+?)\s*-->")


@attrs.frozen
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    mark: str | None = None  # "skip" or "import-only"
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(markdown: str) -> list[str]:
    """The ```python blocks of a markdown text, in order."""
    return [m.group(1) for m in _BLOCK.finditer(markdown)]


def doc_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        blocks.append(
            Block(
                path,
                text.count("\n", 0, match.start()) + 1,
                match.group(1),
                mark.group(1) if mark else None,
                mark.group(2) if mark else "",
            )
        )
    return blocks


BLOCKS = [block for path in DOCS for block in doc_blocks(path)]


def _isolated_shm() -> list[str]:
    """A command prefix that gives the child a private, empty /dev/shm (as root), else none."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        return []
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
        "sh",
    ]


def run_block(code: str, tmp_path: Path, *, main: bool = True) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "block.py"
    script.write_text(code)
    if main:
        command = [sys.executable, str(script)]
    else:
        command = [
            sys.executable,
            "-c",
            f"import runpy; runpy.run_path({str(script)!r}, run_name='doc_block')",
        ]
    stores = [Path(default_path()), Path(default_arena_path())]
    existed = [store.exists() for store in stores]
    # TMPDIR: vLLM leaves its IPC sockets in the temp dir when a block exits without shutting it down
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    try:
        return subprocess.run(
            [*_isolated_shm(), *command],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=tmp_path,
            env=env,
        )
    finally:
        for store, was in zip(stores, existed):
            if not was and store.exists():  # not isolated: the block made a default store
                shutil.rmtree(store, ignore_errors=True)


def _needs(block: Block) -> None:
    """Skip (or fail, where the suite requires it) a block whose dependencies are not here."""
    if "mooncake" in block.code:
        reason = mooncake_unusable_reason()
        if reason is not None:
            if os.environ.get(REQUIRE_ENV) == "1":
                pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
            pytest.skip(reason)
    uses_vllm = re.search(r"^\s*(from|import) vllm", block.code, flags=re.MULTILINE) is not None
    if uses_vllm and importlib.util.find_spec("vllm") is None:
        if os.environ.get("KVFLOW_REQUIRE_VLLM") == "1":
            pytest.fail("KVFLOW_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed (pip install 'kvflow[vllm]')")


def test_every_doc_has_been_searched_and_markers_are_rare() -> None:
    assert len(BLOCKS) >= 10
    assert {b.path.name for b in BLOCKS} >= {"README.md", "device.md", "layerwise.md", "local-backend.md"}
    marked = [b for b in BLOCKS if b.mark is not None]
    assert len(marked) <= 3, [b.name for b in marked]  # markers are for GPUs and remote services only
    assert all(b.reason for b in marked)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_the_docs_python_blocks_run_as_written(block: Block, tmp_path: Path) -> None:
    if block.mark == "skip":
        pytest.skip(f"{block.name}: {block.reason}")
    _needs(block)
    proc = run_block(block.code, tmp_path, main=block.mark != "import-only")
    assert proc.returncode == 0, f"{block.name} failed:\n{proc.stdout}\n{proc.stderr}"


def test_the_readme_program_runs_as_written_and_prints_what_the_readme_says(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    use_it = readme.split("## Use it", 1)[1]
    (program,) = python_blocks(use_it.split("\n## ", 1)[0])
    proc = run_block(program, tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.strip().splitlines()
    assert printed == ["stored 6 blocks, lookup hit 96 tokens, loaded 96 tokens", "recompute: ()"]
    for line in printed:  # the README quotes what it prints
        assert f"`{line}`" in use_it
