"""Shard and index facts a model card states as verified: each shard's declared end against its
file size, tensor counts, and whether the index and the shards agree. Headers only."""

from __future__ import annotations

from typing import Any

from fp4forge.checkpoint.reader import Checkpoint


def shard_facts(ckpt: Checkpoint) -> dict[str, Any]:
    shards = []
    for name in ckpt.shard_names:
        header = ckpt.headers.get(name)
        size = ckpt.source.size(name) if ckpt.source.exists(name) else None
        declared = header.declared_file_size if header is not None else None
        shards.append({
            "name": name,
            "file_bytes": size,
            "declared_end": declared,
            "end_equals_size": size is not None and declared == size,
            "tensors": len(header.tensors) if header is not None else None,
            "error": str(ckpt.shard_errors[name]) if name in ckpt.shard_errors else None,
        })
    in_shards = {info.name for _, info in ckpt.tensors()}
    index: dict[str, Any] = {"present": ckpt.index is not None}
    if ckpt.index is not None:
        mapped = ckpt.index.weight_map
        wrong = [n for n, s in mapped.items() if ckpt.headers.get(s) is None or n not in ckpt.headers[s].tensors]
        data_bytes = sum(h.data_len for h in ckpt.headers.values())
        index.update({
            "entries": len(mapped),
            "entries_not_in_their_shard": len(wrong),
            "tensors_not_in_index": len(in_shards - set(mapped)),
            "total_size": ckpt.index.total_size,
            "shard_data_bytes": data_bytes,
        })
    return {"shards": shards, "tensors": len(in_shards), "index": index}
