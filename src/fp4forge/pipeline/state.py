"""What a pipeline run remembers: content hashes of its inputs and artifacts, and a manifest.

A step is skipped when its *key* (a hash of the step's name, version, parameters and the content
hashes of its inputs) equals the key recorded for it last time and every artifact it recorded is
still there with the same content. Hashes are SHA-256 of file contents; a stat-keyed cache
(path, size, mtime_ns, inode) avoids re-reading unchanged multi-GB shards on every run.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.bench.host import usable_cores
from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.errors import ConfigError

CHUNK_BYTES = 1 << 20  # per read; one buffer per file being read, so at most cores × 1 MiB at once
MANIFEST_VERSION = 1


def write_json(path: Path, doc: Any) -> None:
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def digest_of(doc: Any) -> str:
    """SHA-256 of a JSON-serialisable value in canonical form."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class HashStopped(Exception):
    """A hash in progress was stopped (``Hasher.stop``): a Ctrl-C while a step key hashed beside the step."""


class Hasher:
    """Content hashes of files and directory trees, cached by stat in a JSON file.

    The files the cache lacks are read on a thread each, as many at once as there are cores:
    hashlib and ``readinto`` release the GIL, so a multi-shard tree is not held to one core's
    SHA-256 speed. The cache is shared by those threads (and by a step key hashed in the
    background, run.py), hence its lock."""

    def __init__(self, cache_path: Path | None, threads: int | None = None) -> None:
        self.cache_path = cache_path
        self.threads = threads or usable_cores() or 1  # at most this many files read at once
        self._cache: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._saving = threading.Lock()  # one save at a time, so the last file written is the latest snapshot
        self._stopped = threading.Event()
        if cache_path is not None and cache_path.is_file():
            try:
                self._cache = json.loads(cache_path.read_text())
            except (OSError, ValueError):
                self._cache = {}  # a damaged cache only costs re-hashing

    @staticmethod
    def stamp(path: Path) -> list[int]:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def file(self, path: Path) -> str:
        return self.files([path])[0]

    def files(self, paths: Sequence[Path]) -> list[str]:
        """The content hashes of ``paths``, in order; those not cached under their current stamp
        are read in parallel. The first error in file order is raised, after every read ended."""
        stamps = [self.stamp(p) for p in paths]
        keys = [str(p.resolve()) for p in paths]
        with self._lock:
            digests = [self._cached(key, stamp) for key, stamp in zip(keys, stamps)]
        todo = [i for i, digest in enumerate(digests) if digest is None]
        if not todo:
            return digests
        if len(todo) == 1 or self.threads == 1:
            outcomes = [self._hash_or_error(paths[i]) for i in todo]
        else:
            outcomes = self._read_in_parallel([paths[i] for i in todo])
        errors = []
        for i, outcome in zip(todo, outcomes):
            if isinstance(outcome, BaseException):
                errors.append(outcome)
                continue
            digests[i] = outcome
            with self._lock:
                self._cache[keys[i]] = [*stamps[i], outcome]
        if errors:
            raise errors[0]
        return digests

    def _cached(self, key: str, stamp: list[int]) -> str | None:
        cached = self._cache.get(key)
        return cached[3] if cached is not None and cached[:3] == stamp else None

    def _read_in_parallel(self, paths: list[Path]) -> list[str | BaseException]:
        """One thread per file, at most ``threads`` at once. A Ctrl-C in the waiting thread stops
        the reads at their next chunk, and the pool ends before the interrupt goes on."""
        halt = threading.Event()
        pool = ThreadPoolExecutor(min(len(paths), self.threads), thread_name_prefix="fp4forge-hash")
        try:
            return list(pool.map(lambda path: self._hash_or_error(path, halt), paths))
        except BaseException:
            halt.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _hash_or_error(self, path: Path, halt: threading.Event | None = None) -> str | BaseException:
        try:
            return self._read_sha256(path, halt)
        except Exception as error:  # noqa: BLE001 (handed back to files(), which raises the first in order)
            return error

    def _read_sha256(self, path: Path, halt: threading.Event | None = None) -> str:
        sha = hashlib.sha256()
        buffer = bytearray(CHUNK_BYTES)  # one per file, reused for all its reads
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                if self._stopped.is_set() or (halt is not None and halt.is_set()):
                    raise HashStopped(str(path))
                sha.update(view[:count])
        return sha.hexdigest()

    def stop(self) -> None:
        """Make every hash in progress, on any thread, raise ``HashStopped`` at its next read."""
        self._stopped.set()

    def resume(self) -> None:
        self._stopped.clear()

    def tree(self, root: Path, exclude: Iterable[str] = ()) -> str:
        """Hash of every file under ``root`` (relative names and contents); ``exclude`` are
        top-level entries to leave out (e.g. the reports directory inside a checkpoint)."""
        skip = set(exclude)
        files = [path for path in sorted(root.rglob("*")) if path.relative_to(root).parts[0] not in skip and path.is_file()]
        lines = [f"{path.relative_to(root).as_posix()}\0{digest}" for path, digest in zip(files, self.files(files))]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def path(self, path: Path, exclude: Iterable[str] = ()) -> str | None:
        """Hash of a file or a tree; None when it does not exist."""
        if path.is_dir():
            return self.tree(path, exclude)
        if path.is_file():
            return self.file(path)
        return None

    def save(self) -> None:
        if self.cache_path is None:
            return
        with self._saving:
            with self._lock:
                snapshot = dict(self._cache)
            write_json(self.cache_path, snapshot)


class StampHasher(Hasher):
    """A ``Hasher`` whose "hash" of a file is its stat stamp (size, mtime, inode): reads nothing and
    caches nothing. A key taken with it changes when any file the real key reads changes."""

    def __init__(self) -> None:
        super().__init__(None)

    def files(self, paths: Sequence[Path]) -> list[str]:
        return [":".join(map(str, self.stamp(path))) for path in paths]


class KeyFailed(Exception):
    """A step key hashed in the background failed; ``error`` is what its hash raised."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class BackgroundKey:
    """A step key computed on its own thread (``start``) while the step runs on the caller's, which
    keeps Ctrl-C (Python delivers signals to the main thread). ``settle`` waits for the key;
    ``stop`` ends the hash early, so that an interrupted run leaves no thread behind.

    The waits are on an Event, not ``Thread.join``: a Ctrl-C that interrupts ``join`` can mark the
    still running thread as ended (python/cpython#90882), and a second join then returns at once
    with the hash still reading."""

    def __init__(self, compute: Callable[[], str], hasher: Hasher) -> None:
        self._hasher = hasher
        self._key: str | None = None
        self._error: BaseException | None = None
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._compute, args=(compute,), name="fp4forge-step-key", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _compute(self, compute: Callable[[], str]) -> None:
        try:
            self._key = compute()
        except BaseException as error:  # noqa: BLE001 (handed to the caller by settle)
            self._error = error
        finally:
            self._ended.set()

    def settle(self) -> str:
        """The key, once hashed; ``KeyFailed`` when its hash failed. A Ctrl-C while waiting stops it."""
        try:
            self._ended.wait()
        except KeyboardInterrupt:
            self.stop()
            raise
        self._thread.join()  # its last instruction: returns at once
        if self._error is not None:
            raise KeyFailed(self._error)
        assert self._key is not None
        return self._key

    def stop(self) -> None:
        """Stop the hash at its next read and wait for the thread to end."""
        self._hasher.stop()
        interrupted = False
        while self._thread.ident is not None and not self._ended.is_set():  # one read at most (none if never started)
            try:
                self._ended.wait()
            except KeyboardInterrupt:  # a second Ctrl-C waits for that read too
                interrupted = True
        if self._ended.is_set():
            try:
                self._thread.join()  # its last instruction: returns at once
            except KeyboardInterrupt:
                interrupted = True
        self._hasher.resume()
        if interrupted:
            raise KeyboardInterrupt


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


def could_be_valid(record: StepRecord | None, out: Path) -> bool:
    """False when ``still_valid`` is False for ``record`` whatever the key: no record, not finished,
    or an artifact it recorded is gone (its hash would be None). Costs a stat per artifact."""
    if record is None or record.status not in FINISHED:
        return False
    return all((out / rel).is_dir() or (out / rel).is_file() for rel in record.artifacts)


def require_empty_or_ours(out: Path, manifest_path: Path) -> None:
    """OUT must be new, empty, or a previous pipeline's output: never overwrite someone's files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not manifest_path.is_file():
        raise ConfigError(f"{out} is not empty and holds no {manifest_path.relative_to(out)}: choose a new output directory")
