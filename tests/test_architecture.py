"""The package map of docs/architecture.md, enforced: imports go down the ranks, and the facts that
have one home (safetensors files, quantization declarations, quantization arithmetic, server URLs)
are touched nowhere else."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fp4forge"
DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# rank of each top-level unit of fp4forge, as docs/architecture.md's table states it
RANKS = {
    "errors": 0,
    "numerics": 1, "stats": 1,
    "checkpoint": 2,
    "model": 3,
    "quantize": 4, "calibrate": 4, "audit": 4, "fidelity": 4, "testbed": 4,
    "endpoint": 5,
    "serve": 6, "bench": 6, "quality": 6,
    "report": 7,
    "pipeline": 8,
    "api": 9, "cli": 9,
    "lab": 10,
}
# The lab (research: the study, the trained testbed, diagnostics) is the top rank: it may import
# anything, and the product never imports it. Its commands reach the CLI through the command table
# alone, which names their modules as data (strings imported by name when the command is typed).
LAB = "lab"
LAB_COMMAND_TABLE = "cli/commands.py"
# Same-rank imports that are allowed, each with why. Anything else across siblings is a defect:
# what two siblings share moves down a rank.
SIBLING_EDGES = {
    ("calibrate", "quantize"): "kv calibrate adds the FP8 KV declaration with the writer's tables (quantize/qconfig.py)",
    ("calibrate", "audit"): "kv show reports its findings as instances of the audit's rules: one rule table",
    ("serve", "audit"): "serve cmd warns about the audit's serving quirks for the target vLLM version",
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


def _lab_mentions() -> list[str]:
    """Product modules that import the lab, or name one of its modules in code (an import by name)
    anywhere but the command table."""
    bad = []
    for path in _sources():
        rel = path.relative_to(SRC).as_posix()
        if _unit(_module_name(path)) == LAB:
            continue
        bad += [f"{rel} imports {t}" for t in sorted(_imports(path)) if _unit(t) == LAB]
        if rel != LAB_COMMAND_TABLE:
            bad += [f"{rel}:{n} names the lab: {code.strip()}" for n, code in enumerate(_code_lines(path), 1) if "fp4forge.lab" in code]
    return bad


def test_the_product_does_not_import_the_lab() -> None:
    assert not _lab_mentions(), "\n".join(_lab_mentions())


@pytest.mark.parametrize("planted", ["from fp4forge.lab.study import run\n", "import importlib\nimportlib.import_module('fp4forge.lab.trained.cli')\n"])
def test_the_lab_check_catches_an_import_of_the_lab(planted: str) -> None:
    # both ways a product module could reach the lab: an import statement and an import by name
    fake = SRC / "cli" / "_probe_lab.py"
    fake.write_text(planted, encoding="utf-8")
    try:
        with pytest.raises(AssertionError, match="_probe_lab"):
            test_the_product_does_not_import_the_lab()
    finally:
        fake.unlink()


@pytest.mark.parametrize("command", [["study"], ["frontier"], ["testbed", "trained-laguna"]])
def test_the_lab_commands_keep_their_names(command: list[str]) -> None:
    # registered through the command table, the lab's commands answer where users type them
    from typer.testing import CliRunner

    from fp4forge.cli.typer_app import app

    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "--json" in result.output


def _code_lines(path: Path) -> list[str]:
    """The file's lines with comments and docstrings blanked: what the checks below look at."""
    source = path.read_text(encoding="utf-8")
    docstrings: set[tuple[int, int]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.add((node.lineno, node.col_offset))
    lines = source.splitlines()
    blank = [list(line) for line in lines]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        drop = tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in docstrings)
        if drop:
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = blank[r - 1]
                lo = c0 if r == r0 else 0
                hi = c1 if r == r1 else len(row)
                row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in blank]


def _grep(pattern: str, *, outside: tuple[str, ...]) -> list[str]:
    rx = re.compile(pattern)
    hits = []
    for path in _sources():
        rel = path.relative_to(SRC).as_posix()
        if any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in outside):
            continue
        for n, code in enumerate(_code_lines(path), 1):
            if rx.search(code):
                hits.append(f"{rel}:{n}: {code.strip()}")
    return hits


def test_only_checkpoint_opens_safetensors() -> None:
    assert not _grep(r"\bimport safetensors\b|from safetensors\b|safe_open\(", outside=("checkpoint",))


def test_only_checkpoint_reads_quantization_declarations() -> None:
    # reading: checkpoint/declarations.py; writing one (quantize/) is the writer's job
    read = r"""\.get\(["']quantization_config["']|\[["']quantization_config["']\](?!\s*=)"""
    assert not _grep(read, outside=("checkpoint", "quantize"))


def test_quantization_arithmetic_only_in_numerics() -> None:
    # the FP8 / NVFP4 constants as numbers in code (prose and messages may name them), and casts
    constants = {"448", "448.0", "2688", "2688.0"}
    hits = []
    for path in _sources():
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("numerics/"):
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
            if tok.type == tokenize.NUMBER and tok.string in constants:
                hits.append(f"{rel}:{tok.start[0]}: {tok.line.strip()}")
    hits += _grep(r"\.to\(torch\.float8|float8_e4m3fn\)", outside=("numerics",))
    assert not hits, "\n".join(hits)


def test_only_the_endpoint_builds_server_urls() -> None:
    # a string literal that starts with a server path or a URL scheme; checkpoint/ owns the Hugging
    # Face Hub's file URLs (a file host, not a model server)
    assert not _grep(r"""[rbfRBF]*["'](/v1/|/tokenize|/health|/metrics|/version|https?://)""", outside=("endpoint.py", "checkpoint"))


# -- scheme and layout names: dispatched through the codec registry, never compared -----------------
# A "scheme dispatch by string" is a comparison (==, !=, in, not in) with a scheme or layout name of
# checkpoint/layouts/_schemes.toml as a string literal (alone or in a tuple/list/set), with the
# layout constants CT / MODELOPT, or a .startswith / .endswith of such a name or of a prefix of one.
# Callers look the codec up instead (checkpoint/codecs.py: codec(scheme).has_input_scale(layout),
# isinstance(codec(scheme), Nvfp4Codec), numerics/conventions.py for the NVFP4 scalar convention).
# The modules that ARE the registry may spell the names:
SCHEME_REGISTRY = ("checkpoint/codecs.py", "checkpoint/schemes.py", "checkpoint/declarations.py", "numerics/conventions.py")
# (module, code on the line): the same words meaning something else, each with what it is
OTHER_MEANINGS = {
    ("serve/recommend.py", 'kv_cache_dtype.startswith("fp8")'): "vLLM's --kv-cache-dtype values (fp8, fp8_e4m3), not a weight scheme",
    ("serve/doctor.py", 'dtype.startswith("fp8")'): "the KV cache dtype a vLLM log reports (fp8, fp8_e4m3), not a weight scheme",
    ("bench/gemm.py", 'kernel.startswith("fp8")'): "the GEMM benchmark's kernel names",
    ("bench/gemm.py", 'kernel == "fp8"'): "the GEMM benchmark's kernel names",
    ("serve/recommend.py", 'facts.kv_declared == "fp8"'): "the KV cache's declared dtype",
    ("fidelity/evaluate.py", 'declaration.kv.algo != "fp8"'): "the KV cache's declared algorithm",
    ("checkpoint/convert.py", 'qc.get("quant_method")'): "a declaration's quant_method field, read where block-FP8 sources are detected",
}
# (module, code on the line): dispatches still to move onto the codecs, with what replaces each
TO_MOVE = {
    ("calibrate/kv.py", "layout == CT"): "a table keyed by layout, as quantize/qconfig.py's declarers",
    ("calibrate/kv.py", "layout == MODELOPT"): "a table keyed by layout, as quantize/qconfig.py's declarers",
    ("fidelity/reference.py", 'q.family == "nvfp4"'): "q.packs_fp4",
    ("fidelity/reference.py", "layout not in (CT, MODELOPT)"): "QuantizedCheckpoint's own check of the layout",
    ("fidelity/reference.py", '"nvfp4" in QUANTIZED_ACTIVATIONS'): "the codecs' static_inputs / dynamic_activations",
    # the study's fake-quant formats (nvfp4, fp8, mxfp4, int-n): a format registry in numerics/
    ("lab/study/frontier.py", 'fmt == "nvfp4"'): "a fake-quant format registry in numerics/",
    ("lab/study/frontier.py", 'fmt == "fp8"'): "a fake-quant format registry in numerics/",
    ("lab/study/frontier.py", 'arm.format == "nvfp4"'): "a fake-quant format registry in numerics/",
    ("lab/study/frontier.py", 'arm.format == "fp8"'): "a fake-quant format registry in numerics/",
    ("lab/study/run.py", 'name == "fp8"'): "a fake-quant format registry in numerics/",
}
LAYOUT_CONSTANTS = {"CT", "MODELOPT"}


def _scheme_names() -> set[str]:
    import tomllib

    table = tomllib.loads((SRC / "checkpoint" / "layouts" / "_schemes.toml").read_text(encoding="utf-8"))
    return set(table) | {scheme for schemes in table.values() for scheme in schemes if scheme != "kv"}


def _names_a_scheme(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_scheme(e, names) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in LAYOUT_CONSTANTS
    return isinstance(node, ast.Attribute) and node.attr in LAYOUT_CONSTANTS


def _prefixes_a_scheme(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 3:
        return any(name.startswith(node.value) for name in names)
    return isinstance(node, ast.Tuple) and any(_prefixes_a_scheme(e, names) for e in node.elts)


def _scheme_dispatches(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every comparison with a scheme or layout name in one source file."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            hit = any(_names_a_scheme(operand, names) for operand in [node.left, *node.comparators])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith"):
            hit = any(_prefixes_a_scheme(arg, names) for arg in node.args)
        else:
            continue
        if hit:
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def _unexplained_scheme_dispatches(sources: list[Path]) -> list[str]:
    names = _scheme_names()
    explained = {**OTHER_MEANINGS, **TO_MOVE}
    hits = []
    for path in sources:
        rel = path.relative_to(SRC).as_posix()
        if rel in SCHEME_REGISTRY or rel.startswith("plugins/"):  # the vLLM plugin keeps its own copies by design
            continue
        for line, code in _scheme_dispatches(path, names):
            if not any(rel == module and snippet in code for module, snippet in explained):
                hits.append(f"{rel}:{line}: {code}")
    return hits


def test_no_scheme_dispatch_by_string_outside_the_registry() -> None:
    hits = _unexplained_scheme_dispatches(_sources())
    assert not hits, "compare codecs, not names (checkpoint/codecs.py):\n" + "\n".join(hits)


def test_every_listed_exception_still_exists() -> None:
    # an entry whose line is gone (fixed or moved) must leave the lists: they only shrink
    names = _scheme_names()
    for module, snippet in [*OTHER_MEANINGS, *TO_MOVE]:
        codes = [code for _, code in _scheme_dispatches(SRC / module, names)]
        assert any(snippet in code for code in codes), f"{module}: {snippet!r} is no longer there"


def test_the_scheme_dispatch_test_catches_a_planted_comparison() -> None:
    fake = SRC / "serve" / "_probe_scheme_dispatch.py"
    fake.write_text(
        "from fp4forge.checkpoint.declarations import CT\n"
        "def f(scheme, layout, t):\n"
        "    a = scheme == 'nvfp4a16'\n"
        "    b = scheme in ('nvfp4', 'fp8')\n"
        "    c = t.scheme.startswith('nvfp')\n"
        "    d = layout != 'modelopt'\n"
        "    e = layout == CT\n"
        "    g = 'nvfp4' in t.schemes\n"
        "    return scheme == 'other' or layout.startswith('re:')  # not a scheme: not a hit\n",
        encoding="utf-8",
    )
    try:
        hits = [h for h in _unexplained_scheme_dispatches(_sources()) if "_probe_scheme_dispatch" in h]
    finally:
        fake.unlink()
    assert [int(h.split(":")[1]) for h in hits] == [3, 4, 5, 6, 7, 8], hits


def test_the_torch_free_nvfp4_block_agrees_with_numerics() -> None:
    """checkpoint/schemes.py repeats NVFP4's block size: it must import without torch (the deep
    audit plans its reads first), and numerics, a lower rank, imports torch on any import."""
    import subprocess
    import sys

    code = "import sys\nfrom fp4forge.checkpoint.schemes import NVFP4_BLOCK\nprint(NVFP4_BLOCK, 'torch' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    from fp4forge.numerics.nvfp4 import NVFP4_BLOCK

    assert done.stdout.split() == [str(NVFP4_BLOCK), "False"]
