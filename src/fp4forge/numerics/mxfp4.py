"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, one E8M0 power-of-two scale per 32 elements.

OCP MX rule for the shared scale of a block with ``amax = max |x|``::

    X     = floor(log2(amax)) - emax_elem          # emax_elem = 2 for E2M1 (6 = 1.5 * 2^2)
    scale = 2^X, stored as the biased E8M0 byte X + 127 (0..254; 255 is NaN)
    q     = e2m1(clamp(x / scale, -6, 6))          # values above 6 * scale saturate

``floor(log2(amax))`` is taken exactly from the float's exponent (``torch.frexp``), not from a
rounded ``log2``. An all-zero block gets the smallest scale, 2^-127 (byte 0); X is clamped to
[-127, 127]. Division and multiplication by 2^X are exact (``torch.ldexp``) unless they leave the
F32 range.

Note: compressed-tensors' MXFP4 observer (``generate_mx_scales``) first rounds amax to a power of
two *upwards* when its mantissa is >= 1.75 (not the OCP floor); this module follows OCP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import NumericsError, decode_packed_blocks, encode_packed_blocks

__all__ = [
    "E8M0_BIAS",
    "MXFP4_BLOCK",
    "Mxfp4Weight",
    "e8m0_to_float",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "mxfp4_scale_exponents",
]

MXFP4_BLOCK = 32
E8M0_BIAS = 127
E2M1_EMAX = 2  # exponent of the largest E2M1 normal (6 = 1.5 * 2^2)


@dataclass(frozen=True)
class Mxfp4Weight:
    """``packed``: uint8 ``[..., K/2]`` (element 2i low nibble); ``scale``: uint8 E8M0 ``[..., K/32]``."""

    packed: Tensor
    scale: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return mxfp4_dequantize(self, dtype)


def _blocks(w: Tensor) -> Tensor:
    if not w.is_floating_point():
        raise NumericsError(f"MXFP4 quantization needs a float tensor, got {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % MXFP4_BLOCK:
        raise NumericsError(f"MXFP4 needs the last dim to be a multiple of {MXFP4_BLOCK}, got shape {list(w.shape)}")
    return w.unflatten(-1, (w.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK))


def mxfp4_scale_exponents(amax: Tensor) -> Tensor:
    """Unbiased shared exponents X = floor(log2(amax)) - 2 (int32), amax == 0 -> -127, clamped."""
    _, e = torch.frexp(amax.to(torch.float32))  # amax = m * 2^e, m in [0.5, 1) -> floor(log2) = e - 1
    x = (e - 1 - E2M1_EMAX).to(torch.int32)
    x = torch.where(amax == 0, torch.full_like(x, -E8M0_BIAS), x)
    return x.clamp(-E8M0_BIAS, E8M0_BIAS)


def e8m0_to_float(scale: Tensor) -> Tensor:
    """E8M0 bytes -> F32 powers of two (2^(byte - 127)); byte 255 -> NaN."""
    b = scale.to(torch.int32)
    out = torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - E8M0_BIAS)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def mxfp4_quantize(w: Tensor) -> Mxfp4Weight:
    """Quantize ``w`` ``[..., K]`` (K a multiple of 32) to MXFP4 with the OCP scale rule."""
    blocks = _blocks(w)
    amax = blocks.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):  # NaN/Inf propagate into the block maxima
        raise NumericsError("weight holds NaN or Inf; refusing to quantize it")
    x = mxfp4_scale_exponents(amax)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), x)  # 2^X, exact
    packed = encode_packed_blocks(blocks, scale)  # w / 2^X is exact (a power-of-two division)
    return Mxfp4Weight(packed, (x + E8M0_BIAS).to(torch.uint8))


def mxfp4_dequantize(q: Mxfp4Weight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """E2M1 value * 2^X, in F32, cast to ``dtype``."""
    return decode_packed_blocks(q.packed, e8m0_to_float(q.scale), MXFP4_BLOCK, dtype)
