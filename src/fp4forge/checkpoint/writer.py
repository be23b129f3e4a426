"""Streaming, atomic, sharded safetensors writer.

The caller declares every tensor up front (name, dtype, shape); the writer assigns shards,
writes each shard's header immediately and then accepts tensor data in any order, writing
each at its planned offset. Only the tensor being written is ever in memory.

Everything is built in a temporary directory beside the destination and renamed into place
when complete, so an interrupted write leaves no half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4forge.checkpoint.names import INDEX_JSON, JOURNAL_FILE, SINGLE_SAFETENSORS
from fp4forge.checkpoint.safetensors_format import DTYPE_BITS, encode_header, reference_order
from fp4forge.errors import WriteError

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "U8", "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * DTYPE_BITS[self.dtype] // 8


def shard_file_name(index: int, count: int) -> str:
    return SINGLE_SAFETENSORS if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in declaration order, as huggingface_hub does: start a new shard when
    the next tensor would overflow this one (a tensor larger than the limit gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards if shards[0] else []


def _tensor_bytes(data: Any) -> memoryview:
    """Raw little-endian bytes of a torch tensor, numpy array or bytes-like."""
    if hasattr(data, "untyped_storage"):  # torch.Tensor: reinterpret as bytes without copies where possible
        import torch

        tensor = data.detach().contiguous().cpu()
        return memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    if hasattr(data, "tobytes") and not isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data.tobytes())
    return memoryview(data)


class CheckpointWriter:
    """Write a sharded safetensors checkpoint into ``out_dir``, atomically.

    Use as a context manager; on a clean exit the index is written (for > 1 shard), every
    tensor is checked to have been written (unless ``sparse``), and the directory appears.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        specs: list[TensorSpec],
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: dict[str, str] | None = None,
        sparse: bool = False,
        index_metadata: dict[str, Any] | None = None,
        resume_key: str | None = None,
        part: int = 0,
    ):
        self.out_dir = Path(out_dir)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise WriteError(f"tensor names declared twice: {dupes[:5]}")
        self.specs = {s.name: s for s in specs}
        self.sparse = sparse
        self.metadata = {"format": "pt"} if metadata is None else metadata
        self.index_metadata = index_metadata or {}
        self.shards = plan_shards(specs, max_shard_bytes)
        self._tmp: Path | None = None
        self._placement: dict[str, tuple[int, int, int]] = {}  # name -> (shard, file offset, nbytes)
        self._handles: list[Any] = []
        self._pending: list[set[str]] = []
        # Resumable writes: a fixed staging dir and a journal of finished work units. The key
        # names everything that determines the bytes (plan, options); a mismatch starts over.
        self.resume_key = resume_key
        self.completed_units: set[str] = set()
        self.completed_payloads: dict[str, Any] = {}
        self._journal: Any = None
        # Several processes writing one output (model/distributed.py): part 0 creates the resumable
        # staging dir and alone finishes it; part N > 0 joins it after part 0 has entered, writes
        # its own units at their planned offsets and journals them in its own file.
        self.part = part
        if part and resume_key is None:
            raise WriteError("only a resumable writer (resume_key) can be written in parts")

    # -- lifecycle -----------------------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise WriteError(f"output directory {self.out_dir} exists and is not empty; choose a new path")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        resuming = self._open_staging()
        count = len(self.shards)
        for shard_no, shard in enumerate(self.shards):
            ordered = reference_order([(s.name, s.dtype, s.shape) for s in shard])
            prefix, offsets = encode_header(ordered, self.metadata)
            path = self._tmp / shard_file_name(shard_no, count)
            handle = open(path, "rb+" if resuming and path.exists() else "wb+")
            handle.write(prefix)
            data_len = max((end for _, end in offsets.values()), default=0)
            handle.truncate(len(prefix) + data_len)  # holes until written; sparse mode keeps them
            self._handles.append(handle)
            self._pending.append(set(offsets))
            for name, (begin, end) in offsets.items():
                self._placement[name] = (shard_no, len(prefix) + begin, end - begin)
        if resuming:
            self._replay_journal()
        return self

    def _open_staging(self) -> bool:
        """Create (or, when resumable and matching, reopen) the staging dir; True if resuming."""
        umask = os.umask(0)
        os.umask(umask)
        if self.resume_key is None:
            self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))
            os.chmod(self._tmp, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the output's mode
            return False
        self._tmp = self.out_dir.parent / f".{self.out_dir.name}.partial"
        journal = self._tmp / JOURNAL_FILE
        if self.part:
            if not (journal.is_file() and journal.read_text().split("\n", 1)[0] == self.resume_key):
                raise WriteError(f"part {self.part} found no staging directory of this run at {self._tmp}")
            own = self._tmp / f"{JOURNAL_FILE}.{self.part}"
            fresh = not own.is_file() or own.read_text().split("\n", 1)[0] != self.resume_key
            self._journal = open(own, "w" if fresh else "a")
            if fresh:
                self._journal.write(self.resume_key + "\n")
                self._journal.flush()
            return True
        if journal.is_file() and journal.read_text().split("\n", 1)[0] == self.resume_key:
            self._journal = open(journal, "a")
            return True
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir(mode=0o777 & ~umask)
        self._journal = open(journal, "w")
        self._journal.write(self.resume_key + "\n")
        self._journal.flush()
        return False

    def _journals(self) -> list[Path]:
        assert self._tmp is not None
        return [self._tmp / JOURNAL_FILE, *sorted(self._tmp.glob(f"{JOURNAL_FILE}.*"))]

    def _replay_journal(self) -> None:
        lines = []
        for journal in self._journals():  # every part's (a part's from another run was replaced on entry)
            text = journal.read_text().split("\n")
            if text[0] == self.resume_key:
                lines += text[1:]
        for line in lines:
            if not line.endswith("\t."):  # a line cut by a kill is not a finished unit
                continue
            unit, names, payload, _ = line.split("\t")
            self.completed_units.add(unit)
            self.completed_payloads[unit] = json.loads(payload)
            for name in filter(None, names.split(",")):
                shard_no = self._placement[name][0]
                self._pending[shard_no].discard(name)

    def refresh(self) -> None:
        """Take in the units the other parts journaled since entry (part 0, before finishing)."""
        self._replay_journal()

    def sync(self) -> None:
        """Everything written so far reaches the disk (a part, before part 0 finishes: on a
        shared filesystem another node renames the directory)."""
        for handle in self._handles:
            handle.flush()
            os.fsync(handle.fileno())
        if self._journal is not None:
            self._journal.flush()
            os.fsync(self._journal.fileno())

    def flush_data(self) -> None:
        """``fdatasync`` every shard: what this writer already handed to the OS goes to the disk
        now, so the fsync when the output is finished has little left. Safe to call from another
        thread while this one writes (no Python-level buffer is touched)."""
        for handle in list(self._handles):
            try:
                os.fdatasync(handle.fileno())
            except (OSError, ValueError):  # closed meanwhile: the final fsync covers it
                pass

    def commit_unit(self, unit: str, names: list[str], payload: Any = None) -> None:
        """Record a finished work unit whose tensors were all written (resumable writers).
        ``payload`` (JSON-able) comes back in ``completed_payloads`` when a later run resumes."""
        if self._journal is None:
            return
        for handle in self._handles:
            handle.flush()  # bytes reach the OS before the journal says they are there
        self._journal.write(f"{unit}\t{','.join(names)}\t{json.dumps(payload)}\t.\n")
        self._journal.flush()
        self.completed_units.add(unit)

    def __exit__(self, exc_type, exc, tb) -> None:
        keep_for_resume = self.resume_key is not None and exc_type is not None
        try:
            for handle in self._handles:
                handle.close()
            if self._journal is not None:
                self._journal.close()
            if exc_type is None and not self.part:
                self._finish()
        finally:
            if self._tmp is not None and self._tmp.exists() and not keep_for_resume and not self.part:
                shutil.rmtree(self._tmp, ignore_errors=True)

    # -- writing ---------------------------------------------------------------------
    def write(self, name: str, data: Any) -> None:
        if name not in self._placement:
            raise WriteError(f"tensor {name!r} was not declared to this writer")
        shard_no, offset, nbytes = self._placement[name]
        if name not in self._pending[shard_no]:
            raise WriteError(f"tensor {name!r} written twice")
        raw = _tensor_bytes(data)
        if raw.nbytes != nbytes:
            spec = self.specs[name]
            raise WriteError(f"tensor {name!r}: got {raw.nbytes} bytes, {spec.dtype}{list(spec.shape)} needs {nbytes}")
        handle = self._handles[shard_no]
        handle.seek(offset)
        handle.write(raw)
        self._pending[shard_no].discard(name)

    def write_text(self, relpath: str, text: str) -> None:
        assert self._tmp is not None, "use CheckpointWriter as a context manager"
        target = self._tmp / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")

    def write_json(self, relpath: str, obj: Any) -> None:
        self.write_text(relpath, json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def copy_file(self, src: str | os.PathLike[str], relpath: str | None = None) -> None:
        assert self._tmp is not None, "use CheckpointWriter as a context manager"
        target = self._tmp / (relpath or Path(src).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)

    def _finish(self) -> None:
        assert self._tmp is not None
        missing = sorted(n for pending in self._pending for n in pending)
        if missing and not self.sparse:
            raise WriteError(f"{len(missing)} declared tensors were never written, e.g. {missing[:3]}")
        count = len(self.shards)
        if count > 1:
            weight_map = {
                s.name: shard_file_name(shard_no, count) for shard_no, shard in enumerate(self.shards) for s in shard
            }
            total = sum(s.nbytes for s in self.specs.values())
            index = {"metadata": {"total_size": total, **self.index_metadata}, "weight_map": dict(sorted(weight_map.items()))}
            (self._tmp / INDEX_JSON).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        for shard_file in self._tmp.glob("*.safetensors"):
            if not self.sparse:
                with open(shard_file, "rb+") as fh:
                    os.fsync(fh.fileno())
        for journal in self._journals():
            journal.unlink(missing_ok=True)
        if self.out_dir.exists():
            self.out_dir.rmdir()  # empty (checked on enter)
        os.replace(self._tmp, self.out_dir)
        self._tmp = None
