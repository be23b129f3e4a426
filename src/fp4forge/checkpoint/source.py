"""Where checkpoint bytes come from: a local directory (here) or HTTP (``remote.py``).

A source answers byte-range reads by relative path and never lets a path escape its root:
``..``, absolute paths and symlinks that point outside the checkpoint are refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Protocol

from fp4forge.checkpoint.safetensors_format import (
    LENGTH_PREFIX_BYTES,
    ShardHeader,
    header_length,
    parse_header,
)
from fp4forge.errors import CheckpointError, IndexFileError

#: Buffers one ``preadv`` call takes (the kernel's limit; 1024 on Linux).
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


class Source(Protocol):
    """Byte access to the files of one checkpoint."""

    display: str
    is_remote: bool

    def exists(self, relpath: str) -> bool: ...

    def size(self, relpath: str) -> int: ...

    def read(self, relpath: str, start: int = 0, length: int | None = None) -> bytes: ...

    def list_files(self) -> list[str] | None:
        """Every file of the checkpoint, or None where the transport cannot list."""
        ...

    def read_header(self, relpath: str) -> ShardHeader: ...

    def describe(self, relpath: str) -> str: ...


def check_relpath(relpath: str) -> str:
    """A checkpoint-relative path must stay inside the checkpoint."""
    if not relpath or relpath.startswith(("/", "\\")) or os.path.isabs(relpath) or ":" in relpath.split("/")[0]:
        raise IndexFileError(f"absolute path {relpath!r} is not allowed inside a checkpoint")
    parts = relpath.replace("\\", "/").split("/")
    if any(p in ("..", "") for p in parts):
        raise IndexFileError(f"path {relpath!r} escapes or is malformed inside the checkpoint")
    return relpath


class LocalSource:
    is_remote = False

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self._real_root = self.root.resolve()
        self.display = str(self.root)

    def path(self, relpath: str) -> Path:
        check_relpath(relpath)
        candidate = self.root / relpath
        if "/" not in relpath and "\\" not in relpath:  # a direct child (163 shards): one lstat, not a
            try:  # realpath of every component; only a symbolic link can lead it out of the root
                if not stat.S_ISLNK(os.lstat(candidate).st_mode):
                    return candidate
            except OSError:
                pass  # missing or unreadable: the full check below, then the reader names it
        real = candidate.resolve()
        if real != self._real_root and self._real_root not in real.parents:
            raise CheckpointError(f"{relpath!r} resolves outside the checkpoint (to {real}); refusing to read it", file=str(candidate))
        return candidate

    def describe(self, relpath: str) -> str:
        return str(self.root / relpath)

    def exists(self, relpath: str) -> bool:
        return self.path(relpath).is_file()

    def size(self, relpath: str) -> int:
        return self.path(relpath).stat().st_size

    def read(self, relpath: str, start: int = 0, length: int | None = None) -> bytes:
        path = self.path(relpath)
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                return fh.read() if length is None else fh.read(length)
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", file=str(path)) from None

    def will_need(self, relpath: str, start: int, length: int) -> None:
        """Ask the kernel to start reading a byte range into the page cache now, asynchronously
        (``posix_fadvise WILLNEED``): a later read finds it there. A hint only: where the
        platform or the file refuses it, nothing happens (the read itself reports errors)."""
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            fd = os.open(self.path(relpath), os.O_RDONLY)
        except (OSError, CheckpointError):
            return
        try:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def read_into(self, relpath: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes from ``start`` on: one copy from the page cache straight
        into the caller's buffer (``read`` makes a bytes object first)."""
        path = self.path(relpath)
        try:
            with open(path, "rb", buffering=0) as fh:
                fh.seek(start)
                filled = 0
                while filled < len(out):
                    n = fh.readinto(out[filled:])
                    if not n:
                        raise CheckpointError(f"file ends {len(out) - filled} bytes early", file=str(path))
                    filled += n
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", file=str(path)) from None

    def read_scatter(self, relpath: str, start: int, views: list[memoryview]) -> None:
        """Fill ``views`` in order with the bytes from ``start`` on, as one request to the kernel
        per ``IOV_MAX`` views (``preadv``: the kernel copies from the page cache straight into
        each buffer, the GIL released meanwhile)."""
        path = self.path(relpath)
        pending = [v for v in views if v.nbytes]
        offset = start
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", file=str(path)) from None
        try:
            while pending:
                n = os.preadv(fd, pending[:IOV_MAX], offset)
                if n == 0:
                    raise CheckpointError(f"file ends {sum(v.nbytes for v in pending):,} bytes early", file=str(path))
                offset += n
                while pending and n >= pending[0].nbytes:  # drop the filled views; a short read leaves a partial one
                    n -= pending.pop(0).nbytes
                if n:
                    pending[0] = pending[0][n:]
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", file=str(path)) from None
        finally:
            os.close(fd)

    def list_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file() and ".cache" not in p.parts
        )

    def read_header(self, relpath: str) -> ShardHeader:
        path = self.path(relpath)
        shown = str(path)
        try:
            file_size = path.stat().st_size
            with open(path, "rb") as fh:
                prefix = fh.read(1024)  # enough to name a git-LFS pointer (< 200 bytes by spec) in full
                length = header_length(prefix, source=shown, file_size=file_size)
                fh.seek(LENGTH_PREFIX_BYTES)
                raw = fh.read(length)
        except FileNotFoundError:
            raise CheckpointError("shard file is missing", file=shown) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", file=shown) from None
        header = parse_header(raw, source=shown, header_len=length)
        check_file_size(header, file_size)
        return header


def check_file_size(header: ShardHeader, file_size: int) -> None:
    """The header must account for every byte of the file, no more and no less."""
    if header.declared_file_size != file_size:
        raise CheckpointError(
            f"header declares data ending at byte {header.declared_file_size:,} but the file has {file_size:,} bytes "
            + ("(truncated)" if file_size < header.declared_file_size else "(trailing bytes)"),
            file=header.source,
        )
