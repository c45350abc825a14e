"""The package map holds: no import cycles, integrations use public faces, documented API = __all__."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvflow

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvflow"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.Module) -> set[str]:
    """kvflow modules a module imports when it runs (``if TYPE_CHECKING:`` blocks excluded)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kvflow"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvflow"):
                found.add(node.module)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(tree.body)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = _runtime_imports(ast.parse(path.read_text()))
        # ``from kvflow.x import y`` may name a module ``kvflow.x.y``; an import of a package is an
        # import of its ``__init__``. The top-level package itself only re-exports lazily.
        graph[name] = {t for t in targets if t in modules and t != "kvflow"}
    return graph


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_vllm_integration_touches_no_private_attribute_of_another_module() -> None:
    offences: list[str] = []
    for path in (PACKAGE / "integrations").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvflow"):
                offences += [f"{path.name}: imports {a.name}" for a in node.names if a.name.startswith("_")]
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in {"self", "cls"}):
                    offences.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert offences == []


def test_docs_api_lists_exactly_the_public_names() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## The public names", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`kvflow\.(\w+)`", section))
    assert documented == set(kvflow.__all__)
    for name in kvflow.__all__:
        assert getattr(kvflow, name) is not None
    assert len(kvflow.__all__) <= 25


def test_every_kvflow_command_answers_help_without_importing_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from kvflow.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'kvflow --help imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: kvflow" in proc.stdout and proc.stderr == ""
