"""The package's import graph has no cycle, lazy (function-level) imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import kvarn_mla

ROOT = Path(kvarn_mla.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> kvarn_mla modules it imports`` (every import statement, wherever it stands in the file)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
                targets = [name if name in modules else base for name in names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def test_import_graph_is_acyclic():
    graph = import_graph()
    assert "kvarn_mla.cache" in graph["kvarn_mla.patch"]  # the parser sees relative imports
    assert "kvarn_mla.kernels.store" in graph["kvarn_mla.backends"]  # ... and function-level ones
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [node, target])}"
            if target not in state:
                visit(target, path + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
