"""INT-N with searched clipping: per group, the range that minimises the squared weight error.

Min-max INT-N (:func:`~fp4forge.numerics.intn.intn_quantize`) stretches each group's grid over
the group's extremes, so one outlier coarsens every other value. Here each group's range is
shrunk by a factor ``c`` from ``clip_grid`` (1.0 = min-max, always a candidate) and the factor
with the lowest group squared error wins; ties keep the larger range. The grid, the codes and
the formulas (scale, zero point, rounding) are exactly :func:`intn_quantize`'s applied to the
clipped range, so the result is an ordinary :class:`~fp4forge.numerics.intn.IntWeight` that any
INT-N loader reads.

This is the data-free counterpart of GPTQ (:mod:`fp4forge.numerics.gptq`): it needs no
calibration inputs and lowers the *weight* error; GPTQ lowers the layer's *output* error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import NumericsError
from fp4forge.numerics.intn import IntWeight, intn_range

__all__ = ["DEFAULT_CLIP_GRID", "intn_quantize_mse"]

_EPS32 = torch.finfo(torch.float32).eps
# 1.00, 0.97, ..., 0.31: the optimum of a Gaussian-like group lies in this range at 2-4 bits.
DEFAULT_CLIP_GRID = tuple(round(1.0 - 0.03 * i, 2) for i in range(24))


def _quantize(x: Tensor, lo: Tensor, hi: Tensor, qmin: int, qmax: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """intn_quantize's formulas on the range [lo, hi] per group: (codes, scale, zero point)."""
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / ((qmax - qmin) / 2)
        scale = torch.where(scale == 0, torch.full_like(scale, _EPS32), scale)
        return torch.round(x / scale.unsqueeze(-1)).clamp(qmin, qmax), scale, None
    scale = (hi - lo) / float(qmax - qmin)
    scale = torch.where(scale == 0, torch.full_like(scale, _EPS32), scale)
    zp = torch.round((qmin - lo / scale).clamp(qmin, qmax))
    return torch.round(x / scale.unsqueeze(-1) + zp.unsqueeze(-1)).clamp(qmin, qmax), scale, zp


def _dequantize(q: Tensor, scale: Tensor, zp: Tensor | None) -> Tensor:
    return ((q - zp.unsqueeze(-1)) if zp is not None else q) * scale.unsqueeze(-1)


def intn_quantize_mse(
    w: Tensor,
    num_bits: int = 4,
    *,
    group_size: int | None = 128,
    symmetric: bool = True,
    clip_grid: tuple[float, ...] = DEFAULT_CLIP_GRID,
) -> IntWeight:
    """Quantize ``w`` ``[..., K]`` to signed N-bit codes, each group's range clipped by the factor
    of ``clip_grid`` with the lowest squared error (1.0, min-max, is always tried)."""
    qmin, qmax = intn_range(num_bits)
    if not w.is_floating_point() or w.ndim == 0:
        raise NumericsError(f"INT-N quantization needs a float tensor of at least 1 dim, got {w.dtype} {list(w.shape)}")
    k = w.shape[-1]
    g = k if group_size is None else group_size
    if g <= 0 or k % g:
        raise NumericsError(f"group size {group_size} does not divide the last dim of shape {list(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise NumericsError("weight holds NaN or Inf; refusing to quantize it")
    if any(not 0.0 < c <= 1.0 for c in clip_grid):
        raise NumericsError(f"clip factors must lie in (0, 1], got {clip_grid}")
    x = w.to(torch.float32).unflatten(-1, (k // g, g))
    lo0 = x.amin(dim=-1).clamp(max=0.0)
    hi0 = x.amax(dim=-1).clamp(min=0.0)
    best_q, best_scale, best_zp = _quantize(x, lo0, hi0, qmin, qmax, symmetric)
    best_err = (_dequantize(best_q, best_scale, best_zp) - x).pow(2).sum(dim=-1)
    for factor in sorted(set(clip_grid) - {1.0}, reverse=True):
        q, scale, zp = _quantize(x, lo0 * factor, hi0 * factor, qmin, qmax, symmetric)
        err = (_dequantize(q, scale, zp) - x).pow(2).sum(dim=-1)
        better = err < best_err  # strictly lower: ties keep the wider range
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(better.unsqueeze(-1), q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        if zp is not None and best_zp is not None:
            best_zp = torch.where(better, zp, best_zp)
    zero_point = best_zp.to(torch.int8) if best_zp is not None else None
    return IntWeight(best_q.to(torch.int8).flatten(-2), best_scale, zero_point, num_bits, g)
