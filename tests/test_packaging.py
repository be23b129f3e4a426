"""Every data file the package reads ships in a built wheel: each non-Python file under
src/fp4forge matches a `[tool.setuptools.package-data]` glob (setuptools matches them relative to
the package, one directory level per path part, as fnmatch does), so a `pip install .` (the GPU
machines install fp4forge that way) finds the same tables as the editable install."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "src" / "fp4forge"
COMPILED = {".so", ".pyc", ".pyd"}  # build products, made on first use


def _globs() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return project["tool"]["setuptools"]["package-data"]["fp4forge"]


def _matches(relative: str, pattern: str) -> bool:
    parts, wanted = relative.split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


def test_every_data_file_is_package_data() -> None:
    files = [p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix != ".py" and p.suffix not in COMPILED and "__pycache__" not in p.parts]
    assert files, "no data files found: wrong package path"
    globs = _globs()
    left_out = [str(p.relative_to(PACKAGE)) for p in files if not any(_matches(str(p.relative_to(PACKAGE)), g) for g in globs)]
    assert not left_out, f"data files a wheel would not carry (add a glob to pyproject.toml): {left_out}"


def test_every_glob_still_matches_a_file() -> None:
    relative = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.is_file()]
    stale = [g for g in _globs() if not any(_matches(r, g) for r in relative)]
    assert not stale, f"package-data globs that match nothing: {stale}"
