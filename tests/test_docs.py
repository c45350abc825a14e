"""The code in the README runs exactly as written and prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(markdown: str) -> list[str]:
    """The ```python blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def run_block(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "block.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_the_readme_program_runs_as_written(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    use_it = readme.split("## Use it", 1)[1]
    (program,) = python_blocks(use_it.split("\n## ", 1)[0])
    proc = run_block(program, tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.strip().splitlines()
    assert printed == ["stored 6 blocks, lookup hit 96 tokens, loaded 96 tokens", "recompute: ()"]
    for line in printed:  # the README quotes what it prints
        assert f"`{line}`" in use_it
