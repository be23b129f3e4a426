"""Integer INT-N weight quantization, symmetric or asymmetric, per group along the last dim.

compressed-tensors' formulas (``calculate_range`` / ``calculate_qparams`` / ``_quantize``),
computed in F32 here (CT computes in the weight's dtype; for an F32 weight the two agree
bit for bit)::

    qmin, qmax = -2^(N-1), 2^(N-1) - 1                     # signed codes in both modes
    lo, hi     = min(min(x), 0), max(max(x), 0)            # 0 is always representable

    symmetric:   scale = max(|lo|, |hi|) / ((qmax - qmin) / 2)   zero_point = 0
    asymmetric:  scale = (hi - lo) / (qmax - qmin)
                 zero_point = round(clamp(qmin - lo / scale, qmin, qmax))
    scale == 0 -> F32 eps (1.19e-7)

    q  = clamp(round_half_even(x / scale + zero_point), qmin, qmax)
    x' = (q - zero_point) * scale

Note the symmetric divisor is (2^N - 1)/2 (7.5 for INT4), not 2^(N-1) - 1: the positive max
lands on qmax + 0.5 and clips, the negative max lands exactly on qmin. An all-zero group in
asymmetric mode gets zero_point = qmin (CT would compute 0/0 there).

``group_size=None`` means one group per row (per-channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import NumericsError

__all__ = ["IntWeight", "intn_dequantize", "intn_quantize", "intn_range"]

_EPS32 = torch.finfo(torch.float32).eps


def intn_range(num_bits: int) -> tuple[int, int]:
    """(qmin, qmax) of signed N-bit codes."""
    if not 2 <= num_bits <= 8:
        raise NumericsError(f"INT-N supports 2..8 bits, got {num_bits}")
    return -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1


@dataclass(frozen=True)
class IntWeight:
    """``q``: int8 codes, the input's shape; ``scale``: F32 ``[..., groups]``;
    ``zero_point``: int8 ``[..., groups]`` (asymmetric) or None (symmetric)."""

    q: Tensor
    scale: Tensor
    zero_point: Tensor | None
    num_bits: int
    group_size: int

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return intn_dequantize(self, dtype)


def _groups(w: Tensor, group_size: int | None) -> tuple[Tensor, int]:
    if not w.is_floating_point():
        raise NumericsError(f"INT-N quantization needs a float tensor, got {w.dtype}")
    if w.ndim == 0:
        raise NumericsError("INT-N quantization needs at least a 1-D tensor")
    k = w.shape[-1]
    g = k if group_size is None else group_size
    if g <= 0 or k % g:
        raise NumericsError(f"group size {group_size} does not divide the last dim of shape {list(w.shape)}")
    return w.unflatten(-1, (k // g, g)), g


def intn_quantize(w: Tensor, num_bits: int = 4, *, group_size: int | None = 128, symmetric: bool = True) -> IntWeight:
    """Quantize ``w`` ``[..., K]`` to signed N-bit codes with one scale (and zero point) per group."""
    qmin, qmax = intn_range(num_bits)
    groups, g = _groups(w, group_size)
    if not bool(torch.isfinite(w).all()):
        raise NumericsError("weight holds NaN or Inf; refusing to quantize it")
    x = groups.to(torch.float32)
    lo = x.amin(dim=-1).clamp(max=0.0)
    hi = x.amax(dim=-1).clamp(min=0.0)
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / ((qmax - qmin) / 2)
        scale = torch.where(scale == 0, torch.full_like(scale, _EPS32), scale)
        q = torch.round(x / scale.unsqueeze(-1)).clamp(qmin, qmax)
        zp = None
    else:
        scale = (hi - lo) / float(qmax - qmin)
        scale = torch.where(scale == 0, torch.full_like(scale, _EPS32), scale)
        zp_f = torch.round((qmin - lo / scale).clamp(qmin, qmax))
        q = torch.round(x / scale.unsqueeze(-1) + zp_f.unsqueeze(-1)).clamp(qmin, qmax)
        zp = zp_f.to(torch.int8)
    return IntWeight(q.to(torch.int8).flatten(-2), scale, zp, num_bits, g)


def intn_dequantize(q: IntWeight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``(q - zero_point) * scale`` in F32, cast to ``dtype``."""
    x = q.q.to(torch.float32).unflatten(-1, (q.q.shape[-1] // q.group_size, q.group_size))
    if q.zero_point is not None:
        x = x - q.zero_point.to(torch.float32).unsqueeze(-1)
    return (x * q.scale.unsqueeze(-1)).flatten(-2).to(dtype)
