"""The audit's modules import each other in one direction (engine -> checks -> context), at module
level: no cycle hidden behind a function-level import."""

from __future__ import annotations

import ast
from pathlib import Path

import fp4forge.audit

AUDIT = Path(fp4forge.audit.__file__).parent


def _audit_imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported fp4forge.audit module, imported inside a function)]."""
    graph: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(AUDIT.glob("*.py")):
        tree = ast.parse(path.read_text())
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{a.name}" if node.module == "fp4forge.audit" else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges += [(t.removeprefix("fp4forge.audit."), id(node) in nested) for t in targets if t.startswith("fp4forge.audit.")]
        graph[path.stem] = edges
    return graph


def test_no_function_level_imports_between_audit_modules() -> None:
    lazy = {m: [t for t, inner in edges if inner] for m, edges in _audit_imports().items()}
    assert {m: t for m, t in lazy.items() if t} == {}


def test_audit_imports_are_acyclic() -> None:
    graph = {m: {t for t, _ in edges} for m, edges in _audit_imports().items()}
    assert {"checks_integrity", "checks_declarations", "checks_names"} <= graph["engine"]
    assert all("engine" not in graph[c] for c in ("checks_integrity", "checks_declarations", "checks_names", "context"))
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module in done:
            return
        for target in graph.get(module, ()):
            visit(target, path + (module,))
        done.add(module)

    for module in graph:
        visit(module, ())
