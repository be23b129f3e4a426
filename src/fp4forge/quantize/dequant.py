"""Dequantize one Linear of a quantized checkpoint (either layout), from its tensors on disk.

The inverse of the exporter, by role (see ``layouts/_schemes.toml``): the fidelity evaluator,
the serving plugin and the tests that compare against compressed-tensors' own dequantizer use it.
"""

from __future__ import annotations

import torch

from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.checkpoint.schemes import role_suffixes
from fp4forge.errors import CheckpointError
from fp4forge.numerics.fp8 import Fp8Weight, fp8_dequantize_weight
from fp4forge.numerics.nvfp4 import Nvfp4Weight, nvfp4_dequantize


def _has(ckpt: Checkpoint, name: str) -> bool:
    try:
        ckpt.locate(name)
        return True
    except CheckpointError:
        return False


def detect_scheme(ckpt: Checkpoint, module: str, layout_format: str) -> str | None:
    """The scheme a module's tensors on disk belong to (None when it is not quantized)."""
    packed = role_suffixes(layout_format, "nvfp4")["packed"]
    if _has(ckpt, f"{module}.{packed}") and ckpt.locate(f"{module}.{packed}")[1].dtype == "U8":
        return "nvfp4"
    if _has(ckpt, f"{module}.weight") and ckpt.locate(f"{module}.weight")[1].dtype == "F8_E4M3":
        scale = ckpt.locate(f"{module}.weight_scale")[1]
        return "fp8_dynamic" if len(scale.shape) == 2 and scale.shape[0] > 1 else "fp8"
    return None


def dequantize_linear(ckpt: Checkpoint, module: str, layout_format: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The module's weight as `dtype`: NVFP4 by its convention's formula, FP8 by scale multiply,
    unquantized weights as stored."""
    scheme = detect_scheme(ckpt, module, layout_format)
    if scheme is None:
        return ckpt.read_tensor(f"{module}.weight").to(dtype)
    suffix = role_suffixes(layout_format, scheme)
    if scheme == "nvfp4":
        q = Nvfp4Weight(
            packed=ckpt.read_tensor(f"{module}.{suffix['packed']}"),
            block_scale=ckpt.read_tensor(f"{module}.{suffix['block_scale']}"),
            global_scale=ckpt.read_tensor(f"{module}.{suffix['global_scale']}"),
            convention=layout_format,
        )
        return nvfp4_dequantize(q, dtype)
    weight = ckpt.read_tensor(f"{module}.{suffix['weight']}")
    scale = ckpt.read_tensor(f"{module}.{suffix['weight_scale']}")
    strategy = "channel" if scheme == "fp8_dynamic" else "tensor"
    return fp8_dequantize_weight(Fp8Weight(weight, scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1), strategy), dtype)
