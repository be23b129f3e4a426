"""What a pipeline run remembers: content hashes of its inputs and artifacts, and a manifest.

A step is skipped when its *key* (a hash of the step's name, version, parameters and the content
hashes of its inputs) equals the key recorded for it last time and every artifact it recorded is
still there with the same content. Hashes are SHA-256 of file contents; a stat-keyed cache
(path, size, mtime_ns, inode) avoids re-reading unchanged multi-GB shards on every run.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.errors import ConfigError

CHUNK_BYTES = 8 << 20
MANIFEST_VERSION = 1


def write_json(path: Path, doc: Any) -> None:
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def digest_of(doc: Any) -> str:
    """SHA-256 of a JSON-serialisable value in canonical form."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Hasher:
    """Content hashes of files and directory trees, cached by stat in a JSON file."""

    def __init__(self, cache_path: Path) -> None:
        self.cache_path = cache_path
        self._cache: dict[str, list[Any]] = {}
        if cache_path.is_file():
            try:
                self._cache = json.loads(cache_path.read_text())
            except (OSError, ValueError):
                self._cache = {}  # a damaged cache only costs re-hashing

    def file(self, path: Path) -> str:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        key = str(path.resolve())
        cached = self._cache.get(key)
        if cached is not None and cached[:3] == stamp:
            return cached[3]
        sha = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                sha.update(chunk)
        self._cache[key] = [*stamp, sha.hexdigest()]
        return sha.hexdigest()

    def tree(self, root: Path, exclude: Iterable[str] = ()) -> str:
        """Hash of every file under ``root`` (relative names and contents); ``exclude`` are
        top-level entries to leave out (e.g. the reports directory inside a checkpoint)."""
        skip = set(exclude)
        lines = []
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if rel.parts[0] in skip or not path.is_file():
                continue
            lines.append(f"{rel.as_posix()}\0{self.file(path)}")
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def path(self, path: Path, exclude: Iterable[str] = ()) -> str | None:
        """Hash of a file or a tree; None when it does not exist."""
        if path.is_dir():
            return self.tree(path, exclude)
        if path.is_file():
            return self.file(path)
        return None

    def save(self) -> None:
        write_json(self.cache_path, self._cache)


# Step statuses, as written to the manifest.
DONE, SKIPPED, FAILED, INTERRUPTED, PENDING, OFF = "done", "skipped", "failed", "interrupted", "pending", "off"
FINISHED = (DONE, SKIPPED)


@dataclass
class StepRecord:
    name: str
    title: str
    status: str = PENDING
    key: str | None = None
    artifacts: dict[str, str] = field(default_factory=dict)  # path relative to OUT -> sha256
    seconds: float | None = None
    message: str | None = None  # why it failed, or why it is off
    summary: dict[str, Any] = field(default_factory=dict)  # a few headline numbers for the progress view

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Manifest:
    """``OUT/reports/pipeline.json``: the run's parameters and every step's record."""

    path: Path
    source: str
    output: str
    params: dict[str, Any]
    steps: dict[str, StepRecord]
    status: str = PENDING
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def to_json(self) -> dict[str, Any]:
        from fp4forge import __version__

        return {
            "manifest_version": MANIFEST_VERSION,
            "fp4forge_version": __version__,
            "source": self.source,
            "output": self.output,
            "status": self.status,
            "started": self.started,
            "finished": self.finished,
            "params": self.params,
            "steps": [s.to_json() for s in self.steps.values()],
        }

    def save(self) -> None:
        write_json(self.path, self.to_json())


def previous_records(path: Path) -> dict[str, StepRecord]:
    """The step records of the last run, or nothing when there was none (or it is unreadable)."""
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
        if doc.get("manifest_version") != MANIFEST_VERSION:
            return {}
        return {s["name"]: StepRecord(**s) for s in doc["steps"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def still_valid(record: StepRecord | None, key: str, out: Path, hasher: Hasher, exclude: Iterable[str]) -> bool:
    """True when ``record`` finished with this ``key`` and its artifacts are unchanged."""
    if record is None or record.status not in FINISHED or record.key != key:
        return False
    return all(hasher.path(out / rel, exclude if rel == "." else ()) == sha for rel, sha in record.artifacts.items())


def require_empty_or_ours(out: Path, manifest_path: Path) -> None:
    """OUT must be new, empty, or a previous pipeline's output: never overwrite someone's files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not manifest_path.is_file():
        raise ConfigError(f"{out} is not empty and holds no {manifest_path.relative_to(out)}: choose a new output directory")
