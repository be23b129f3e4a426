"""The calibration-statistics file: what `fp4forge calibrate` writes and `quantize --stats` /
`kv calibrate` read. One schema, written and read here only.

A safetensors file of F32 tensors, named as on disk (per-expert 2-D module names, not
transformers' fused ones):

  ``<module>.input_amax``               [1]  running max |x| of the Linear's input over all
                                             calibration tokens (routed experts: the tokens the
                                             coverage policy gives them; an expert that saw none
                                             carries its layer peers' max)
  ``<layer>.self_attn.k_amax``          [1]  (and ``v_amax``) max |K| / |V| as written to the KV
                                             cache (after k-norm and RoPE)
  ``<layer>.self_attn.k_amax_per_head`` [num_kv_heads]  (and ``v_amax_per_head``) the same per
                                             KV head

plus ``__metadata__`` {"fp4forge_stats": "1", "calibration": "<JSON object>"}; the JSON holds the
MoE coverage policy ("routed" | "all-experts"), ``tokens_per_expert`` {experts module: [count
per expert]}, ``experts_without_tokens`` [expert modules], and the data (sample count, seq_len,
token count, sources, a digest of the token ids).

Reading validates all of it; a file that does not follow it raises ``StatsFileError``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4forge.errors import StatsFileError

STATS_MARKER = "fp4forge_stats"
STATS_VERSION = "1"
STATS_METADATA_KEY = "calibration"
INPUT_AMAX = "input_amax"
KV_ROLES = ("k", "v")
PER_HEAD = "_per_head"
# Name suffixes the schema knows: a scalar entry is [1], a per-head one [num_kv_heads].
SCALAR_SUFFIXES = (f".{INPUT_AMAX}",) + tuple(f".self_attn.{r}_amax" for r in KV_ROLES)
PER_HEAD_SUFFIXES = tuple(f".self_attn.{r}_amax{PER_HEAD}" for r in KV_ROLES)


def input_amax_name(module: str) -> str:
    return f"{module}.{INPUT_AMAX}"


def kv_amax_name(layer: str, role: str, *, per_head: bool = False) -> str:
    """``layer``: the decoder layer prefix (``model.layers.N``); ``role``: "k" or "v"."""
    return f"{layer}.self_attn.{role}_amax{PER_HEAD if per_head else ''}"


@dataclass(frozen=True)
class CalibrationStats:
    """A statistics file, read and validated: F32 amax tensors by name and the calibration record."""

    path: Path
    tensors: dict[str, Any]  # name -> torch float32 tensor, 1-D
    calibration: dict[str, Any]
    metadata: dict[str, str]  # the safetensors header metadata as stored

    def tensor(self, name: str):
        if name not in self.tensors:
            raise StatsFileError(f"statistics have no {name!r}; were they calibrated on this model?", file=str(self.path))
        return self.tensors[name]

    def amax(self, name: str) -> float:
        return float(self.tensor(name).max())

    def input_amax(self, module: str) -> float:
        return self.amax(input_amax_name(module))

    def kv_amax(self, layer: str) -> tuple[float, float]:
        return self.amax(kv_amax_name(layer, "k")), self.amax(kv_amax_name(layer, "v"))


def write_stats(path: str | Path, tensors: dict, metadata: dict) -> Path:
    """Write a statistics file atomically; ``metadata`` is the calibration record (JSON object)."""
    import torch

    from fp4forge.checkpoint.tensor_file import save_tensors

    path = Path(path)
    bad = sorted(n for n, t in tensors.items() if t.dtype != torch.float32)
    if bad:
        raise StatsFileError(f"statistics tensors must be F32, got others for {bad[:3]}")
    header = {STATS_MARKER: STATS_VERSION, STATS_METADATA_KEY: json.dumps(metadata, sort_keys=True)}
    return save_tensors(path, tensors, metadata=header)  # byte-reproducible: same calibration, same file


def read_stats(path: str | Path) -> CalibrationStats:
    """Read and validate a statistics file (schema above); StatsFileError says what is wrong."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    where = str(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # what safetensors raises for bad files
        raise StatsFileError(f"cannot read statistics file: {exc}", file=where) from None
    if metadata.get(STATS_MARKER) is None:
        raise StatsFileError(f"not an fp4forge statistics file (no {STATS_MARKER} metadata)", file=where)
    if metadata[STATS_MARKER] != STATS_VERSION:
        raise StatsFileError(f"statistics format {metadata[STATS_MARKER]!r}; this fp4forge reads {STATS_VERSION!r}", file=where)
    try:
        calibration = json.loads(metadata[STATS_METADATA_KEY])
    except KeyError:
        raise StatsFileError(f"statistics file has no {STATS_METADATA_KEY!r} metadata", file=where) from None
    except json.JSONDecodeError as exc:
        raise StatsFileError(f"{STATS_METADATA_KEY!r} metadata is not JSON: {exc}", file=where) from None
    if not isinstance(calibration, dict):
        raise StatsFileError(f"{STATS_METADATA_KEY!r} metadata is not a JSON object", file=where)
    for name, tensor in tensors.items():
        _check_entry(name, tensor, where)
    return CalibrationStats(path, tensors, calibration, metadata)


def _check_entry(name: str, tensor, where: str) -> None:
    import torch

    if tensor.dtype != torch.float32:
        raise StatsFileError(f"{name} is {tensor.dtype}; statistics are F32", file=where, tensor=name)
    if name.endswith(SCALAR_SUFFIXES):
        if tuple(tensor.shape) != (1,):
            raise StatsFileError(f"{name} has shape {list(tensor.shape)}, expected [1]", file=where, tensor=name)
    elif name.endswith(PER_HEAD_SUFFIXES):
        if tensor.dim() != 1 or tensor.numel() == 0:
            raise StatsFileError(f"{name} has shape {list(tensor.shape)}, expected [num_kv_heads]", file=where, tensor=name)
    else:
        raise StatsFileError(f"{name} is not a statistics entry (expected <module>.input_amax or <layer>.self_attn.k_amax / v_amax[_per_head])", file=where, tensor=name)
    values = tensor.tolist()
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise StatsFileError(f"{name} holds {values[:4]}: an amax is finite and >= 0", file=where, tensor=name)
