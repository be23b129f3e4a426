"""Open a checkpoint (local directory or file, HF repo id, or an https `/resolve/` base URL),
resolve its shards through the index, read every shard's header, and read tensors lazily."""

from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from fp4forge.checkpoint.index import IndexFile, parse_index
from fp4forge.checkpoint.names import CONFIG_JSON, EXTRA_JSON, INDEX_JSON, SINGLE_SAFETENSORS
from fp4forge.checkpoint.json_text import JsonTextError, load_json
from fp4forge.checkpoint.safetensors_format import ShardHeader, TensorInfo
from fp4forge.checkpoint.source import LocalSource, Source, check_relpath
from fp4forge.errors import CheckpointError, IndexFileError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")

# safetensors dtype string -> torch dtype attribute name.
#: Makes an empty host tensor of a shape and torch dtype: a read-ahead slab's ``empty``
#: (model/host_memory.py), which read-ahead threads hand to a reader's ``read_host``.
HostAlloc = Callable[[tuple[int, ...], Any], Any]


def host_copy(value: Any, pin: bool, alloc: HostAlloc | None = None) -> Any:
    """``value`` (a host tensor) in memory made by ``alloc`` when given, else page-locked with
    ``pin``, else as it is."""
    if alloc is not None:
        return alloc(tuple(value.shape), value.dtype).copy_(value)
    return value.pin_memory() if pin else value


TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",
}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector over bulk work on 10^5 header entries: the parsed headers
    and the name tables built from them are millions of acyclic objects, and the collections their
    allocation triggers (each traversing everything alive) cost as much as the JSON parsing itself.
    Reference counting still frees everything; the collector resumes (if it ran before) on exit."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class Checkpoint:
    source: Source
    shard_names: list[str]
    headers: dict[str, ShardHeader]
    index: IndexFile | None = None
    config: dict[str, Any] | None = None
    extra_json: dict[str, Any] = field(default_factory=dict)  # EXTRA_JSON: hf_quant_config.json, fp4forge.json
    shard_errors: dict[str, CheckpointError] = field(default_factory=dict)

    @property
    def display(self) -> str:
        return self.source.display

    def tensors(self) -> Iterator[tuple[str, TensorInfo]]:
        """Every (shard, tensor) pair, shard by shard in name order."""
        for shard in self.shard_names:
            header = self.headers.get(shard)
            if header is not None:
                for info in header.tensors.values():
                    yield shard, info

    def locate(self, name: str) -> tuple[str, TensorInfo]:
        if self.index is not None and name in self.index.weight_map:
            shard = self.index.weight_map[name]
            header = self.headers.get(shard)
            if header is not None and name in header.tensors:
                return shard, header.tensors[name]
        for shard, header in self.headers.items():
            if name in header.tensors:
                return shard, header.tensors[name]
        raise CheckpointError("no such tensor in the checkpoint", file=self.display, tensor=name)

    def header_digest(self) -> str:
        """Hash of every shard's header and size: a cheap identity of the checkpoint's byte layout
        (names, dtypes, shapes, offsets), read from headers only."""
        import hashlib

        h = hashlib.blake2b(digest_size=16)
        for shard in self.shard_names:
            header = self.headers[shard]
            h.update(shard.encode())
            h.update(str(header.declared_file_size).encode())
            for info in header.tensors.values():
                h.update(f"{info.name}:{info.dtype}:{info.shape}:{info.begin}".encode())
        return h.hexdigest()

    def reads_as_stored(self, name: str) -> bool:
        """Whether ``name`` reads as its stored bytes (a converting subclass says no for the
        tensors it converts): then its bytes may be read straight from the file."""
        return True

    def read_raw(self, name: str) -> bytes:
        shard, info = self.locate(name)
        header = self.headers[shard]
        return self.source.read(shard, header.data_start + info.begin, info.nbytes)

    def read_tensor(self, name: str):
        """Read one tensor into a torch tensor (imports torch only here)."""
        import torch

        shard, info = self.locate(name)
        dtype = getattr(torch, TORCH_DTYPES[info.dtype], None)
        if dtype is None:
            raise CheckpointError(f"torch has no dtype for {info.dtype}", file=shard, tensor=name)
        shape = list(info.shape)
        if info.dtype == "F4":  # header holds logical elements; torch storage packs two per byte
            shape[-1] //= 2
        read_into = getattr(self.source, "read_into", None)
        if read_into is not None and info.nbytes:
            # straight into the tensor's memory: one copy instead of bytes + bytearray
            out = torch.empty(info.nbytes, dtype=torch.uint8)
            read_into(shard, self.headers[shard].data_start + info.begin, memoryview(out.numpy()))
            return out.view(dtype).reshape(shape)
        raw = bytearray(self.read_raw(name))
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def _read_json(source: Source, relpath: str) -> Any | None:
    if not source.exists(relpath):
        return None
    raw = source.read(relpath)
    try:
        doc = load_json(raw)
    except JsonTextError as exc:
        if raw.startswith(b"version https://git-lfs"):
            raise CheckpointError("git-LFS pointer instead of JSON; use a /resolve/ URL", file=source.describe(relpath)) from None
        raise CheckpointError(exc.reason, file=source.describe(relpath)) from None
    if not isinstance(doc, dict):  # config.json, hf_quant_config.json, fp4forge.json are all objects
        raise CheckpointError(f"not a JSON object (a {type(doc).__name__})", file=source.describe(relpath))
    return doc


def check_config_identity(config: dict[str, Any] | None, shown: str) -> None:
    """The two keys every consumer reads to pick the architecture must have their types:
    ``architectures`` a list of class names, ``model_type`` a string (transformers, vLLM and the
    layout lookup all assume so)."""
    if config is None:
        return
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise CheckpointError(f"architectures must be a list of class names, got {architectures!r}", file=shown)
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"model_type must be a string, got {model_type!r}", file=shown)


def resolve_source(location: str | Path) -> tuple[Source, list[str] | None]:
    """Turn a user's argument into a Source (and the shard list, for a single-file path)."""
    text = str(location)
    path = Path(text).expanduser()
    if path.is_dir():
        return LocalSource(path), None
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError("a file argument must be a .safetensors file (or pass the checkpoint directory)", file=text)
        return LocalSource(path.parent), [path.name]
    from fp4forge.checkpoint import remote  # network code only when asked for

    if text.startswith(("http://", "https://")):
        return remote.RemoteSource(text), None
    if REPO_ID.match(text) and not text.startswith((".", "/", "~")):
        repo, _, revision = text.partition("@")
        return remote.RemoteSource.for_repo(repo, revision or "main"), None
    raise CheckpointError("no such local path, and not a Hugging Face repo id or https URL", file=text)


def open_checkpoint(location: str | Path, *, strict: bool = True) -> Checkpoint:
    """Open and header-read a checkpoint.

    strict=True raises on the first unreadable shard; strict=False records per-shard errors in
    ``shard_errors`` (the audit reports them as findings instead).
    """
    source, single = resolve_source(location)
    index: IndexFile | None = None
    if single is not None:
        shard_names = single
    elif source.exists(INDEX_JSON):
        with gc_paused():
            index = parse_index(source.read(INDEX_JSON), source=source.describe(INDEX_JSON))
        shard_names = index.shard_names
    elif source.exists(SINGLE_SAFETENSORS):
        shard_names = [SINGLE_SAFETENSORS]
    else:
        listed = source.list_files() or []
        shard_names = [f for f in listed if f.endswith(".safetensors")]
        if not shard_names:
            raise CheckpointError(f"no {INDEX_JSON}, no {SINGLE_SAFETENSORS} and no .safetensors files", file=source.display)
    return _read_checkpoint(source, shard_names, index, strict=strict)


def _read_checkpoint(source: Source, shard_names: list[str], index: IndexFile | None, *, strict: bool) -> Checkpoint:
    """Every shard's header and the JSON files beside them."""
    with gc_paused():
        return _read_headers_and_json(source, shard_names, index, strict=strict)


def _read_headers_and_json(source: Source, shard_names: list[str], index: IndexFile | None, *, strict: bool) -> Checkpoint:
    headers: dict[str, ShardHeader] = {}
    errors: dict[str, CheckpointError] = {}

    def load(shard: str) -> tuple[str, ShardHeader | CheckpointError]:
        try:
            return shard, source.read_header(shard)
        except CheckpointError as exc:
            return shard, exc

    if source.is_remote:  # latency-bound: overlap the requests
        from concurrent.futures import ThreadPoolExecutor  # (its import, with logging's, only when needed)

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(load, shard_names))
    else:
        results = [load(shard) for shard in shard_names]
    for shard, result in results:
        if isinstance(result, CheckpointError):
            if strict:
                raise result
            errors[shard] = result
        else:
            headers[shard] = result

    config = _read_json(source, CONFIG_JSON)
    check_config_identity(config, source.describe(CONFIG_JSON))
    extra = {}
    for name in EXTRA_JSON:
        doc = _read_json(source, name)
        if doc is not None:
            extra[name] = doc
    return Checkpoint(
        source=source,
        shard_names=shard_names,
        headers=headers,
        index=index,
        config=config,
        extra_json=extra,
        shard_errors=errors,
    )


# -- a damaged checkpoint, opened for inspection --------------------------------------------------
@dataclass(frozen=True)
class RejectedIndexEntry:
    """A weight_map entry the lenient open dropped: its shard path is not a safe relative path."""

    tensor: str  # the weight_map key, or "metadata" for a malformed metadata object / total_size
    shard: Any  # the value as written (a string leaving the checkpoint, or not a string at all)
    reason: str = "unsafe-path"  # "unsafe-path" | "total-size"


def open_checkpoint_lenient(location: str | Path) -> tuple[Checkpoint, list[RejectedIndexEntry]]:
    """Open a possibly damaged checkpoint so that it can be inspected rather than refused.

    Per-shard errors are recorded in ``shard_errors`` (as ``strict=False``); a weight_map entry
    with a ``..`` or absolute path is dropped and returned, and the rest of the index is used.
    An index that is not JSON at all, or has no weight_map object, or a path that is neither a
    checkpoint nor a repo, still raises the reader's error: there is nothing to inspect past it.
    """
    try:
        return open_checkpoint(location, strict=False), []
    except IndexFileError as exc:
        source, _ = resolve_source(location)
        index, rejected = _safe_index(_index_document(source, exc))
        return _read_checkpoint(source, index.shard_names, index, strict=False), rejected


def _index_document(source: Source, original: IndexFileError) -> dict:
    """The index as JSON; anything short of an object with a weight_map (not JSON, an LFS
    pointer) re-raises the reader's own error, which says why."""
    try:
        doc = load_json(source.read(INDEX_JSON))
    except JsonTextError:
        raise original from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise original
    return doc


def _safe_index(doc: dict) -> tuple[IndexFile, list[RejectedIndexEntry]]:
    """The index without its unsafe entries, and those entries."""
    safe: dict[str, str] = {}
    rejected = []
    for name, shard in doc["weight_map"].items():
        try:
            if not isinstance(shard, str):
                raise IndexFileError(f"weight_map value {shard!r} is not a file name")
            safe[name] = check_relpath(shard)
        except IndexFileError:
            rejected.append(RejectedIndexEntry(name, shard))
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    total = metadata.get("total_size")
    valid_total = type(total) is int and total >= 0
    if doc.get("metadata") is not None and not isinstance(doc.get("metadata"), dict):
        rejected.append(RejectedIndexEntry("metadata", doc["metadata"], "total-size"))
    elif total is not None and not valid_total:
        rejected.append(RejectedIndexEntry("metadata.total_size", total, "total-size"))
    return IndexFile(weight_map=safe, total_size=total if valid_total else None, metadata=metadata), rejected
