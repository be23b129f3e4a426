"""One exit-code table: fp4forge.errors.ExitCode, docs/exit-codes.md, every error class's code, and
what the command line really exits with."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from fp4forge import errors
from fp4forge.errors import ExitCode, Fp4forgeError

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "exit-codes.md"
SRC = REPO / "src" / "fp4forge"


def doc_rows(header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header``."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows


def error_classes() -> list[type[Fp4forgeError]]:
    found, todo = [], [Fp4forgeError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def test_the_doc_lists_exactly_the_codes() -> None:
    assert [(int(code), name) for code, name, _ in doc_rows("| code |")] == [(c.value, c.name) for c in ExitCode]


def test_every_error_class_lives_in_errors_py() -> None:
    """By source, so modules not imported here count too: no `class X(<an fp4forge error>)` elsewhere."""
    names = {cls.__name__ for cls in error_classes()}
    assert len(names) > 15  # the walk saw the hierarchy errors.py defines
    elsewhere = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & names:
                    elsewhere.append(f"{path.relative_to(SRC)}: {node.name}")
    assert elsewhere == []
    assert all(cls.__module__ == "fp4forge.errors" for cls in error_classes())


def test_every_error_code_is_in_the_table_and_the_doc_names_the_exceptions() -> None:
    special = {name: int(code) for name, code in doc_rows("| error |")}
    for cls in error_classes():
        assert cls.exit_code in set(ExitCode), cls
        assert cls.exit_code == special.get(cls.__name__, ExitCode.UNUSABLE), cls
    assert set(special) <= {cls.__name__ for cls in error_classes()}
    assert {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Exception)} == {
        cls.__name__ for cls in error_classes()
    }


def test_no_library_code_raises_a_bare_value_error() -> None:
    offenders = [
        f"{path.relative_to(SRC)}:{number}"
        for path in SRC.rglob("*.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"raise ValueError\b", line) and "cli" not in path.parts
    ]
    assert offenders == []


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], capture_output=True, text=True, timeout=120)


def test_the_command_line_exits_with_the_table_codes(tmp_path: Path) -> None:
    assert run_cli("--help").returncode == ExitCode.OK
    unreadable = run_cli("bytes", str(tmp_path / "nowhere"))
    assert unreadable.returncode == ExitCode.UNUSABLE and "error:" in unreadable.stderr and "Traceback" not in unreadable.stderr
    usage = run_cli("bytes", "--no-such-flag")
    assert usage.returncode == ExitCode.UNUSABLE and "Traceback" not in usage.stderr
    bad_option = run_cli("quantize", str(tmp_path), str(tmp_path / "out"), "--recipe", "fp8", "--format", "gguf")
    assert bad_option.returncode == ExitCode.UNUSABLE
    assert "(--format)" in bad_option.stderr and "layout_format" not in bad_option.stderr  # the flag as typed
    assert not (tmp_path / "out").exists()
