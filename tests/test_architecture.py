"""The package map of docs/architecture.md, enforced: imports go down the ranks, and the facts that
have one home (safetensors files, quantization declarations, quantization arithmetic, server URLs)
are touched nowhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fp4forge"
DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# rank of each top-level unit of fp4forge, as docs/architecture.md's table states it
RANKS = {
    "errors": 0,
    "numerics": 1,
    "checkpoint": 2,
    "model": 3,
    "quantize": 4, "calibrate": 4, "audit": 4, "fidelity": 4, "testbed": 4,
    "endpoint": 5,
    "serve": 6, "bench": 6, "quality": 6,
    "report": 7,
    "pipeline": 8,
    "api": 9, "cli": 9,
}
# Same-rank imports that are allowed, each with why. Anything else across siblings is a defect:
# what two siblings share moves down a rank.
SIBLING_EDGES = {
    ("calibrate", "quantize"): "calibration reads a recipe to know which Linears need activation scales",
    ("calibrate", "testbed"): "calibration data uses the testbed's chat template to render the built-in prompts",
    ("fidelity", "calibrate"): "fidelity's W4A4 numerics read the calibrated per-expert routing counts",
    ("serve", "audit"): "serve cmd reports the audit's serving quirks for the target vLLM version",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "fp4forge":
        return None
    return parts[1] if len(parts) > 1 else "fp4forge"


def _imports(path: Path) -> set[str]:
    """Every fp4forge module ``path`` imports, lazy imports inside functions included."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {t for t in found if t.startswith("fp4forge")}


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_unit_has_a_rank_and_the_doc_names_it() -> None:
    units = {_unit(_module_name(p)) for p in _sources()} - {"fp4forge"}
    assert units <= set(RANKS), f"units without a rank: {sorted(units - set(RANKS))}"
    doc = DOC.read_text(encoding="utf-8")
    for unit in units:
        assert f"`{unit}" in doc, f"docs/architecture.md does not name {unit}"


def test_imports_go_down_the_ranks() -> None:
    bad = []
    for path in _sources():
        src_unit = _unit(_module_name(path))
        if src_unit == "fp4forge":
            continue
        for target in _imports(path):
            dst_unit = _unit(target)
            if dst_unit in (None, "fp4forge", src_unit):
                continue
            if RANKS[dst_unit] > RANKS[src_unit]:
                bad.append(f"{_module_name(path)} -> {target} (rank {RANKS[src_unit]} imports rank {RANKS[dst_unit]})")
            elif RANKS[dst_unit] == RANKS[src_unit] and (src_unit, dst_unit) not in SIBLING_EDGES:
                bad.append(f"{_module_name(path)} -> {target} (siblings at rank {RANKS[src_unit]})")
    assert not bad, "\n".join(bad)


def test_the_direction_test_catches_an_upward_import(tmp_path: Path) -> None:
    # the check itself must be able to fail: a numerics module importing the audit is caught
    fake = SRC / "numerics" / "_probe_upward.py"
    fake.write_text("from fp4forge.audit import engine\n", encoding="utf-8")
    try:
        with pytest.raises(AssertionError, match="_probe_upward"):
            test_imports_go_down_the_ranks()
    finally:
        fake.unlink()


def _grep(pattern: str, *, outside: tuple[str, ...]) -> list[str]:
    rx = re.compile(pattern)
    hits = []
    for path in _sources():
        rel = path.relative_to(SRC).as_posix()
        if any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in outside):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if rx.search(code):
                hits.append(f"{rel}:{n}: {line.strip()}")
    return hits


def test_only_checkpoint_opens_safetensors() -> None:
    assert not _grep(r"\bimport safetensors\b|from safetensors\b|safe_open\(", outside=("checkpoint",))


def test_only_checkpoint_reads_quantization_declarations() -> None:
    # the writer (quantize/qconfig.py) builds declarations from checkpoint/declarations.py's tables
    assert not _grep(r"""\[["']quantization_config["']\]|\.get\(["']quantization_config["']""",
                     outside=("checkpoint", "quantize/qconfig.py"))


def test_quantization_arithmetic_only_in_numerics() -> None:
    assert not _grep(r"\b2688\b|\b448(\.0)?\b|float8_e4m3fn\)|\.to\(torch\.float8", outside=("numerics",))


def test_only_the_endpoint_builds_server_urls() -> None:
    # checkpoint/remote.py builds Hugging Face Hub URLs (a file host, not a model server)
    assert not _grep(r"/v1/|/tokenize\b|/health\b|\"http://|f\"http://", outside=("endpoint.py", "checkpoint/remote.py"))
