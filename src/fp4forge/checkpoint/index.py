"""`model.safetensors.index.json`: strict parsing (no traversal, no absolute paths)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4forge.checkpoint.json_text import JsonTextError, load_json
from fp4forge.checkpoint.source import check_relpath
from fp4forge.errors import Fp4forgeError, IndexFileError


@dataclass(frozen=True)
class IndexFile:
    weight_map: dict[str, str]
    total_size: int | None
    metadata: dict[str, object] = field(default_factory=dict)

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def parse_index(raw: bytes, *, source: str) -> IndexFile:
    try:
        doc = load_json(raw)
    except JsonTextError as exc:
        if raw.startswith(b"version https://git-lfs"):
            raise IndexFileError("git-LFS pointer instead of the index JSON; use a /resolve/ URL, not /raw/", file=source) from None
        raise IndexFileError(f"index is {exc.reason}", file=source) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise IndexFileError("index has no weight_map object", file=source)
    weight_map = doc["weight_map"]
    try:
        shards = set(weight_map.values())  # a few distinct shard names, 10^5 entries
    except TypeError:  # an unhashable value (a list, an object): not a file name either
        shards = None
    if shards is None or not set(map(type, shards)) <= {str}:
        name, shard = next((n, s) for n, s in weight_map.items() if type(s) is not str)
        raise IndexFileError(f"weight_map value {shard!r} is not a file name", file=source, tensor=name)
    for shard in shards:
        try:
            check_relpath(shard)
        except Fp4forgeError as exc:
            name = next(n for n, s in weight_map.items() if s == shard)
            raise IndexFileError(exc.message, file=source, tensor=name) from None
    metadata = doc.get("metadata")
    if metadata is None:  # absent or null
        metadata = {}
    if not isinstance(metadata, dict):
        raise IndexFileError("index metadata is not an object", file=source)
    total = metadata.get("total_size")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise IndexFileError(f"total_size {total!r} is not a non-negative integer", file=source)
    return IndexFile(weight_map=weight_map, total_size=total, metadata=metadata)  # the parsed dict is ours: no copy
