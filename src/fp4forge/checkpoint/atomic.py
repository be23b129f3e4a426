"""Outputs appear whole or not at all: the one home of fp4forge's temp-and-rename writing.

Everything is written under a temporary name in the destination's own directory (same
filesystem, so the final ``os.replace`` is atomic) and renamed into place only when complete; on
any error the temporary files are removed and the destination is untouched. What is renamed
into place gets the ordinary modes the umask gives (``mkstemp`` / ``mkdtemp`` would leave
0600 / 0700).

    write_text_atomic(path, text)            # reports, cards, caches, state files
    write_json_atomic(path, doc)
    with atomic_file(path) as tmp:           # a library that writes to a path (safetensors)
        save_file(tensors, str(tmp))
    with staged_files(directory) as stage:   # several files, renamed in the order staged
        save_file(tensors, str(stage.path("model-kvscales.safetensors")))
        stage.path("config.json").write_text(...)
    with atomic_output_dir(out) as staging:  # a whole new directory
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fp4forge.errors import ConfigError

PARTIAL_SUFFIX = ".partial"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


class StagedFiles:
    """Temporary files beside their final names in one directory; see :func:`staged_files`."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._staged: list[tuple[Path, str]] = []

    def path(self, name: str) -> Path:
        """A fresh temporary path that becomes ``directory / name`` on commit."""
        fd, tmp = tempfile.mkstemp(prefix=f".{Path(name).name}.", suffix=PARTIAL_SUFFIX, dir=self.directory)
        os.close(fd)
        self._staged.append((Path(tmp), name))
        return Path(tmp)

    def commit(self) -> None:
        """Rename every staged file into place, in the order it was staged."""
        umask = _umask()
        for tmp, _ in self._staged:
            os.chmod(tmp, 0o666 & ~umask)
        for tmp, name in self._staged:
            os.replace(tmp, self.directory / name)

    def discard(self) -> None:
        for tmp, _ in self._staged:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_files(directory: str | Path) -> Iterator[StagedFiles]:
    """Stage several files of ``directory``; all are renamed into place (in staging order, so a
    reader can be kept consistent at each step) when the block completes, none if it raises."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stage = StagedFiles(directory)
    try:
        yield stage
        stage.commit()
    finally:
        stage.discard()  # after a commit: nothing left to remove


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it becomes ``path`` when the block completes."""
    path = Path(path)
    with staged_files(path.parent) as stage:
        yield stage.path(path.name)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same directory and a rename. The
    rename is the last thing done: a Ctrl-C that lands after it finds the write complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_bytes(data)  # open() applies the umask: the ordinary mode, no chmod needed
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temp file in the same directory and a rename."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, doc: Any, *, indent: int | None = 2, sort_keys: bool = False) -> None:
    """``doc`` as JSON with a final newline."""
    write_text_atomic(path, json.dumps(doc, indent=indent, sort_keys=sort_keys) + "\n")


# -- whole directories ----------------------------------------------------------------------------
def ensure_fresh_output(out: Path) -> None:
    """Refuse to write into a directory that already holds something."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {out} exists and is not empty; choose a new path", file=str(out))


def apply_umask_modes(directory: Path) -> None:
    """mkdtemp makes 0700 and safetensors writes 0600; give the output ordinary umask modes."""
    umask = _umask()
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside ``out`` (which must be absent or empty); rename it to ``out`` on
    success, delete it on any error."""
    out = Path(out)
    ensure_fresh_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}{PARTIAL_SUFFIX}-", dir=out.parent))
    try:
        yield staging
        apply_umask_modes(staging)
        if out.exists():
            out.rmdir()  # empty: checked above
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def replace_dir(staged: Path, final: Path) -> None:
    """Move a finished directory into place over an older one (removed only after the move)."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)
