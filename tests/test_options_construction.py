"""One construction site per options class: the command line, the Python API, the pipeline and the
study make a job's options through the same function, so an option is mapped from its source (a
flag, a pipeline option, a study setting) in one place. ``X()`` (every default) is no construction:
it is the options' own defaults, written where a default argument needs one."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fp4forge"
# Options classes whose name does not end in "Options": a job's options all the same.
OTHER_OPTIONS = {"QuantizeJob", "RunConfig"}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in node.decorator_list)


def options_classes(trees: dict[Path, ast.Module]) -> set[str]:
    return {node.name for tree in trees.values() for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and _is_dataclass(node) and (node.name.endswith("Options") or node.name in OTHER_OPTIONS)}


def construction_sites(trees: dict[Path, ast.Module], classes: set[str], root: Path = SRC) -> dict[str, list[str]]:
    """Every call of an options class with at least one argument, as ``file:line``."""
    sites: dict[str, list[str]] = defaultdict(list)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not (node.args or node.keywords):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in classes:
                sites[name].append(f"{path.relative_to(root)}:{node.lineno}")
    return sites


def _trees(root: Path) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(root.rglob("*.py"))}


def test_each_options_class_is_made_in_one_place() -> None:
    trees = _trees(SRC)
    classes = options_classes(trees)
    assert {"AuditOptions", "CalibrationOptions", "FidelityOptions", "GptqOptions", "QuantizeJob", "PerfOptions", "CompareOptions",
            "RunConfig", "FrontierOptions", "StudyOptions", "PipelineOptions"} <= classes
    repeated = {name: where for name, where in construction_sites(trees, classes).items() if len(where) > 1}
    assert not repeated, f"options made in more than one place (route them through one builder): {repeated}"


def test_the_scan_sees_a_second_construction(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from dataclasses import dataclass\n@dataclass(frozen=True)\nclass FooOptions:\n    x: int = 0\n"
                                   "def f():\n    return FooOptions(x=1), FooOptions()\n")
    (tmp_path / "b.py").write_text("import a\ndef g(v):\n    return a.FooOptions(v)\n")
    trees = {path: ast.parse(path.read_text()) for path in sorted(tmp_path.glob("*.py"))}
    assert options_classes(trees) == {"FooOptions"}
    assert construction_sites(trees, {"FooOptions"}, tmp_path) == {"FooOptions": ["a.py:6", "b.py:3"]}
