"""One small safetensors file of named tensors with string metadata, written and read whole.

For the side files fp4forge makes (the teacher-logit cache, a dense copy the reference oracle
loads, the KV-scale shard): written atomically (nothing visible at the destination until the file
is complete), read back with a named error instead of the safetensors library's own exceptions.
Sharded checkpoints go through ``checkpoint.writer`` / ``checkpoint.reader``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp4forge.checkpoint.atomic import atomic_file
from fp4forge.errors import CheckpointError


def save_tensors(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (torch tensors) to ``path`` with ``metadata``, atomically."""
    path = Path(path)
    with atomic_file(path) as tmp:
        write_tensors(tmp, tensors, metadata)
    return path


def write_tensors(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write the file in place: for a path some caller already stages (``checkpoint.atomic``)."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)


def load_tensors(path: str | Path, names: tuple[str, ...] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors (all, or ``names``) and the metadata of one safetensors file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
            wanted = names if names is not None else tuple(fh.keys())
            missing = [n for n in wanted if n not in fh.keys()]
            if missing:
                raise CheckpointError(f"tensor file lacks {missing[:3]}", file=str(path))
            return {name: fh.get_tensor(name) for name in wanted}, metadata
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read tensor file: {exc}", file=str(path)) from None
