"""`model.safetensors.index.json`: strict parsing (no traversal, no absolute paths)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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


def _hashable(value: object) -> object:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def parse_index(raw: bytes, *, source: str) -> IndexFile:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        if raw.startswith(b"version https://git-lfs"):
            raise IndexFileError("git-LFS pointer instead of the index JSON; use a /resolve/ URL, not /raw/", file=source) from None
        raise IndexFileError(f"index is not valid JSON: {exc}", file=source) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise IndexFileError("index has no weight_map object", file=source)
    weight_map = doc["weight_map"]
    for shard in set(map(_hashable, weight_map.values())):  # a few distinct shard names, 10^5 entries
        if not isinstance(shard, str):
            name = next(n for n, s in weight_map.items() if _hashable(s) == shard)
            raise IndexFileError(f"weight_map value for {name!r} is not a file name", file=source, tensor=name)
        try:
            check_relpath(shard)
        except Fp4forgeError as exc:
            name = next(n for n, s in weight_map.items() if s == shard)
            raise IndexFileError(exc.message, file=source, tensor=name) from None
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise IndexFileError("index metadata is not an object", file=source)
    total = metadata.get("total_size")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise IndexFileError(f"total_size {total!r} is not a non-negative integer", file=source)
    return IndexFile(weight_map=dict(weight_map), total_size=total, metadata=metadata)
