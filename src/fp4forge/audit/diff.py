"""`fp4forge diff A B`: which tensors two checkpoints share byte for byte.

Per tensor name: identical (same dtype, shape and blake2b digest of the raw bytes), different
(with the reason: dtype, shape or bytes), only in A, only in B; counted per component of the
architecture's layout. Streaming: each tensor is hashed in chunks straight from its shard (local
file or HTTP range), so memory holds one chunk, never a model.

``values=True`` also reports, for differing tensors of equal shape, the largest absolute
difference and the largest difference relative to A's largest magnitude
(max|a−b| / max|a|), computed in float32 chunk by chunk. Packed FP4 (U8) is compared as its
byte codes.

JSON document (``DiffReport.to_json()``)::

    {"a": "...", "b": "...",
     "summary": {"identical": n, "different": n, "only_in_a": n, "only_in_b": n},
     "components": {"<component>": {"identical": n, "different": n, "only_in_a": n, "only_in_b": n}},
     "tensors": [{"name": "...", "status": "different|only_in_a|only_in_b", "component": "...",
                  "reason": "bytes|dtype|shape|null", "max_abs": x|null, "max_rel": x|null}]}

Identical tensors are counted, not listed. Exit codes: 0 identical, 1 differences, 2 unreadable.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.audit.options import DiffOptions
from fp4forge.checkpoint.layout import UNKNOWN, Layout, layout_for_config
from fp4forge.checkpoint.raw import can_decode, iter_raw_chunks, iter_values, tensor_index
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.checkpoint.safetensors_format import TensorInfo
from fp4forge.errors import LayoutError

STATUSES = ("identical", "different", "only_in_a", "only_in_b")
DIGEST_BYTES = 32
VALUE_CHUNK_ELEMENTS = 1 << 22
Progress = Callable[[int, int, str], None] | None


@dataclass
class TensorDiff:
    name: str
    status: str
    component: str
    reason: str | None = None  # for "different": dtype | shape | bytes
    max_abs: float | None = None
    max_rel: float | None = None


@dataclass
class DiffReport:
    a: str
    b: str
    entries: list[TensorDiff] = field(default_factory=list)

    @property
    def summary(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for entry in self.entries:
            counts[entry.status] += 1
        return counts

    @property
    def components(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for entry in self.entries:
            out.setdefault(entry.component, dict.fromkeys(STATUSES, 0))[entry.status] += 1
        return out

    @property
    def exit_code(self) -> int:
        return 0 if all(e.status == "identical" for e in self.entries) else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "summary": self.summary,
            "components": self.components,
            "tensors": [_json_safe(asdict(e)) for e in self.entries if e.status != "identical"],
        }


def _json_safe(entry: dict[str, Any]) -> dict[str, Any]:
    """JSON has no Inf/NaN: write them as the strings "inf" / "nan"."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in entry.items()}


def digest(ckpt: Checkpoint, shard: str, info: TensorInfo) -> bytes:
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for chunk in iter_raw_chunks(ckpt, shard, info):
        hasher.update(chunk)
    return hasher.digest()


def _layout(*ckpts: Checkpoint) -> Layout | None:
    for ckpt in ckpts:
        try:
            return layout_for_config(ckpt.config)
        except LayoutError:
            continue
    return None


def diff_checkpoints(a: str | Path, b: str | Path, options: DiffOptions = DiffOptions(), *, progress: Progress = None) -> DiffReport:
    """Compare two checkpoints tensor by tensor (raises Fp4forgeError when one cannot be read)."""
    ckpt_a, ckpt_b = open_checkpoint(a), open_checkpoint(b)
    layout = _layout(ckpt_a, ckpt_b)
    tensors_a, tensors_b = tensor_index(ckpt_a), tensor_index(ckpt_b)
    names = sorted(tensors_a.keys() | tensors_b.keys())
    report = DiffReport(a=str(a), b=str(b))
    for done, name in enumerate(names):
        if progress is not None:
            progress(done, len(names), name)
        component = layout.classify(name).component if layout else UNKNOWN
        if name not in tensors_b:
            report.entries.append(TensorDiff(name, "only_in_a", component))
        elif name not in tensors_a:
            report.entries.append(TensorDiff(name, "only_in_b", component))
        else:
            report.entries.append(compare_tensor(ckpt_a, tensors_a[name], ckpt_b, tensors_b[name], component, options.values))
    for ckpt in (ckpt_a, ckpt_b):
        close = getattr(ckpt.source, "close", None)
        if close is not None:
            close()
    return report


def compare_tensor(ckpt_a: Checkpoint, entry_a: tuple[str, TensorInfo], ckpt_b: Checkpoint, entry_b: tuple[str, TensorInfo], component: str, values: bool) -> TensorDiff:
    (shard_a, info_a), (shard_b, info_b) = entry_a, entry_b
    result = TensorDiff(info_a.name, "different", component)
    if tuple(info_a.shape) != tuple(info_b.shape):
        result.reason = "shape"
        return result
    if info_a.dtype != info_b.dtype:
        result.reason = "dtype"
    elif digest(ckpt_a, shard_a, info_a) == digest(ckpt_b, shard_b, info_b):
        result.status = "identical"
        return result
    else:
        result.reason = "bytes"
    if values and can_decode(info_a.dtype) and can_decode(info_b.dtype):
        result.max_abs, result.max_rel = value_difference(ckpt_a, entry_a, ckpt_b, entry_b)
    return result


def _iter_values(ckpt: Checkpoint, shard: str, info: TensorInfo) -> Iterator[Any]:
    return iter_values(ckpt, shard, info, VALUE_CHUNK_ELEMENTS)


def value_difference(ckpt_a: Checkpoint, entry_a: tuple[str, TensorInfo], ckpt_b: Checkpoint, entry_b: tuple[str, TensorInfo]) -> tuple[float, float]:
    """(max |a−b|, max |a−b| / max |a|), in float32; NaN positions count as an infinite difference."""
    import numpy as np

    max_abs = 0.0
    max_a = 0.0
    for chunk_a, chunk_b in zip(_iter_values(ckpt_a, *entry_a), _iter_values(ckpt_b, *entry_b)):
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.abs(chunk_a - chunk_b)
        delta[np.isnan(delta)] = math.inf
        max_abs = max(max_abs, float(delta.max()) if delta.size else 0.0)
        finite_a = np.abs(chunk_a[np.isfinite(chunk_a)])
        max_a = max(max_a, float(finite_a.max()) if finite_a.size else 0.0)
    max_rel = max_abs / max_a if max_a > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, max_rel
