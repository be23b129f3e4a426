"""One small safetensors file of named tensors with string metadata, written and read whole.

For the side files fp4forge makes (the teacher-logit cache, a dense copy the reference oracle
loads, the KV-scale shard): written atomically (nothing visible at the destination until the file
is complete), read back with a named error instead of the safetensors library's own exceptions.
Sharded checkpoints go through ``checkpoint.writer`` / ``checkpoint.reader``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fp4forge.checkpoint.atomic import atomic_file
from fp4forge.errors import CheckpointError


def save_tensors(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> Path:
    """Write ``tensors`` (torch tensors) to ``path`` with ``metadata``, atomically."""
    path = Path(path)
    with atomic_file(path) as tmp:
        write_tensors(tmp, tensors, metadata)
    return path


def write_tensors(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write the file in place: for a path some caller already stages (``checkpoint.atomic``).

    Encoded by fp4forge's own header writer in safetensors' tensor order, not by safetensors'
    ``save_file``: that orders a metadata map of two or more keys by a per-process random hash,
    so two identical runs would write different bytes."""
    from fp4forge.checkpoint.reader import TORCH_DTYPES
    from fp4forge.checkpoint.safetensors_format import encode_header, reference_order

    code_of = {name: code for code, name in TORCH_DTYPES.items()}
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    entries = reference_order([(name, code_of[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for name, t in tensors.items()])
    prefix, _ = encode_header(entries, metadata)
    with open(path, "wb") as fh:
        fh.write(prefix)
        for name, _, _ in entries:
            fh.write(tensors[name].view(-1).view(torch.uint8).numpy().tobytes() if tensors[name].numel() else b"")


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
