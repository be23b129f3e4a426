"""NVFP4 block-scale choice, and the relative weight error ||W - Q(W)|| / ||W||
(docs/quantization.md#nvfp4-block-scale-search, docs/quantization.md#expected-reconstruction-error).

Methods (all keep the packed layout and formulas of :mod:`fp4forge.numerics.nvfp4`; only the
E4M3 block scales differ, so any NVFP4 loader reads the result):

* ``"minmax"`` (default): round-to-nearest block scale, block max -> 6. Exactly
  :func:`~fp4forge.numerics.nvfp4.nvfp4_quantize`, i.e. compressed-tensors.
* ``"four_over_six"``: per block, the better (lower block squared error) of block max -> 6 and
  block max -> 4 (raw scale x 1.5), Cook et al. arXiv:2512.02010. Default per-tensor headroom
  ``fp8_max=256`` (global = 1536/amax) as in the paper, llm-compressor and ModelOpt, so that even
  the largest blocks can take the x1.5 scale (256 * 1.5 = 384 <= 448).
* ``"mse"``: per block, every E4M3 value between ``round(lo * raw)`` and ``round(hi * raw)``
  (default 0.8x .. 1.8x, about ten E4M3 steps) is tried; the lowest block squared error wins.
  A wider window changes nothing on Gaussian-like weights (each block's optimum lies inside;
  the unit tests compare with a brute force over every E4M3 code). The per-tensor scalar is
  searched too (:func:`nvfp4_mse_global_scale`): the min-max scalar (amax -> 448 x 6) and fifteen
  smaller ones within an octave, keeping the one with the lowest total error.

A candidate replaces the minmax scale only when its block error is strictly lower, and a
searched scalar replaces the min-max one only when the total error is strictly lower, so "mse" is
never worse than "minmax". The error of each block is that of the real
quantize -> dequantize round trip (F32, the convention's own formulas).

Every method returns the error sums, so callers that quantize in row chunks add up ``err_sq``
and ``ref_sq`` over chunks and report ``sqrt(sum err_sq / sum ref_sq)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import _FORMATS, NumericsError, _round_in_place, block_absmax, row_chunks
from fp4forge.numerics.fp8 import FP8_E4M3_MAX
from fp4forge.numerics.conventions import convention_rule
from fp4forge.numerics.nvfp4 import (
    NVFP4_BLOCK,
    Convention,
    Nvfp4Weight,
    _blocks,
    _check_convention,
    _check_finite,
    _effective_scale,
    _finish_block_scales,
    _quantize_blocks,
    _resolve_scalar,
    kernel_minmax,
    nvfp4_raw_block_scales,
)

__all__ = [
    "FOUR_OVER_SIX_FP8_MAX",
    "ScaleMethod",
    "ScaleSearchResult",
    "MSE_GLOBAL_STEPS",
    "error_sums",
    "nvfp4_mse_global_scale",
    "relative_error",
    "search_nvfp4",
]

ScaleMethod = Literal["minmax", "four_over_six", "mse"]
FOUR_OVER_SIX_FP8_MAX = 256.0
DEFAULT_MSE_RANGE = (0.8, 1.8)
MSE_GLOBAL_STEPS = 16  # per-tensor scalars tried by "mse": 2**(-t/16), t = 0..15


def error_sums(w: Tensor, w_hat: Tensor) -> tuple[float, float]:
    """(sum (w - w_hat)^2, sum w^2): differences in F32, sums accumulated in F64 — add these
    over row chunks to get a whole tensor's error."""
    if w.shape != w_hat.shape:
        raise NumericsError(f"shapes differ: {list(w.shape)} vs {list(w_hat.shape)}")
    w2 = w.reshape(-1, w.shape[-1]) if w.ndim else w.reshape(1, 1)
    h2 = w_hat.reshape(w2.shape)
    err = ref = 0.0
    for rows in row_chunks(w2.shape[0], w2.shape[1]):
        x = w2[rows].to(torch.float32)
        d = x - h2[rows].to(torch.float32)
        err += float(torch.sum(d * d, dtype=torch.float64))
        ref += float(torch.sum(x * x, dtype=torch.float64))
    return err, ref


def relative_error(w: Tensor, w_hat: Tensor) -> float:
    """``||w - w_hat|| / ||w||`` (Frobenius). 0.0 when both are zero; inf when only w is."""
    err, ref = error_sums(w, w_hat)
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return math.sqrt(err / ref)


@dataclass(frozen=True)
class ScaleSearchResult:
    """The quantized weight, how it was chosen and how far it is from the input.

    ``relative_error`` = sqrt(err_sq / ref_sq) with the F32 dequantization of ``weight`` (None when
    the search ran with ``error=False``); ``blocks_changed`` = blocks whose scale differs from
    minmax (0 for "minmax").
    """

    weight: Nvfp4Weight
    method: ScaleMethod
    relative_error: float | None
    err_sq: float | None
    ref_sq: float | None
    blocks_changed: int


def _block_sq_error(a: Tensor, bits: Tensor, g: Tensor, convention: Convention) -> Tensor:
    """Per-block sum of squared error of quantize -> dequantize, from ``a = |w|`` (F32
    ``[rows, nb, 16]``) and E4M3 scale bits ``[rows, nb]``: the sign never changes the error."""
    eff = _effective_scale(bits.view(torch.float8_e4m3fn), g, convention).unsqueeze(-1)
    s = a / eff
    d = torch.empty_like(s)
    _round_in_place(s, torch.empty_like(s, dtype=torch.int32), _FORMATS[torch.float32], d)  # e2m1_encode's rounding
    d.mul_(eff).sub_(a)
    return (d * d).sum(dim=-1)


def _candidates(method: str, raw: Tensor, convention: Convention, mse_range: tuple[float, float]):
    """E4M3 bit patterns ``[rows, nb]`` to try against the minmax scale."""
    if method == "four_over_six":
        yield _finish_block_scales(raw * 1.5, convention).view(torch.uint8)
        return
    lo, hi = mse_range
    # Bit patterns of positive E4M3 values increase with the value: sweep every code in range.
    c_lo = _finish_block_scales(raw * lo, convention).view(torch.uint8).to(torch.int16)
    c_hi = _finish_block_scales(raw * hi, convention).view(torch.uint8).to(torch.int16)
    span = int((c_hi - c_lo).max()) + 1 if c_lo.numel() else 0
    for k in range(span):
        yield torch.minimum(c_lo + k, c_hi).to(torch.uint8)


def _search_block_scales(
    blocks: Tensor, raw: Tensor, minmax_scale: Tensor, g: Tensor, method: str, convention: Convention, mse_range: tuple[float, float]
) -> tuple[Tensor, float]:
    """Per block, the candidate E4M3 scale with the lowest block squared error (ties keep minmax);
    returns the chosen scales and the summed squared error of all blocks under them."""
    nb = blocks.shape[-2]
    b2 = blocks.reshape(-1, nb, NVFP4_BLOCK)
    raw2 = raw.reshape(-1, nb)
    best_bits = minmax_scale.view(torch.uint8).reshape(-1, nb).clone()
    total = 0.0
    # Row chunks outside, candidates inside: a chunk's |w| stays in cache for all candidates.
    for rows in row_chunks(b2.shape[0], nb * NVFP4_BLOCK):
        a = b2[rows].to(torch.float32).abs()
        best = best_bits[rows]
        best_err = _block_sq_error(a, best, g, convention)
        for bits in _candidates(method, raw2[rows], convention, mse_range):
            err = _block_sq_error(a, bits, g, convention)
            better = err < best_err  # strictly lower: ties keep the minmax scale
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, bits, best)
        best_bits[rows] = best
        total += float(best_err.sum(dtype=torch.float64))
    return best_bits.view(torch.float8_e4m3fn).reshape(minmax_scale.shape), total


def _shifted_scalar(g0: Tensor, step: int, steps: int, convention: Convention) -> Tensor:
    """The per-tensor scalar whose effective block step is ``2**(step/steps)`` times ``g0``'s:
    CT's global scale divides the step (so it shrinks), ModelOpt's scale_2 multiplies it."""
    factor = 2.0 ** (step / steps)
    return convention_rule(convention).stretched(g0, factor).to(torch.float32)


def nvfp4_mse_global_scale(
    weights: Sequence[Tensor],
    *,
    convention: Convention = "compressed-tensors",
    global_amax: Tensor | float | None = None,
    steps: int = MSE_GLOBAL_STEPS,
    mse_range: tuple[float, float] = DEFAULT_MSE_RANGE,
) -> Tensor:
    """The per-tensor scalar for the "mse" block-scale search, shared by ``weights`` (a fused
    group must share one).

    The E4M3 codes of a block scale are a fixed relative grid (3 mantissa bits); the scalar only
    slides that grid against the blocks' optimal scales, and gives the largest blocks headroom
    above the min-max scale (with the min-max scalar their scale already sits at 448, E4M3's top,
    so the search cannot raise it). Candidates: the min-max scalar (amax -> 448 x 6) times
    ``2**(-t/steps)``, t = 0 .. steps-1 (one octave: a whole factor of 2 only renames exponents).
    The first one with the lowest summed error wins, so the min-max scalar is kept unless another
    is strictly better. ``global_amax`` as in :func:`search_nvfp4` (default: the group's max).
    """
    if not weights:
        raise NumericsError("no weights to choose a global scale for")
    if steps < 1:
        raise NumericsError(f"steps must be >= 1, got {steps}")
    blocks = [_blocks(w) for w in weights]
    amaxes = [block_absmax(b) for b in blocks]
    for a in amaxes:
        _check_finite(a)
    if global_amax is None:
        global_amax = max((a.amax() for a in amaxes if a.numel()), key=float, default=torch.zeros((), dtype=weights[0].dtype))
    g0 = _resolve_scalar(weights[0], amaxes[0], convention, global_amax, None, FP8_E4M3_MAX)
    best_g, best_err = g0, math.inf
    for step in range(steps):
        g = g0 if step == 0 else _shifted_scalar(g0, step, steps, convention)
        err = 0.0
        for b, a in zip(blocks, amaxes):
            raw = nvfp4_raw_block_scales(a, g, convention)
            err += _search_block_scales(b, raw, _finish_block_scales(raw, convention), g, "mse", convention, mse_range)[1]
        if err < best_err:
            best_g, best_err = g, err
    return best_g


def search_nvfp4(
    w: Tensor,
    method: ScaleMethod = "minmax",
    *,
    convention: Convention = "compressed-tensors",
    global_amax: Tensor | float | None = None,
    global_scale: Tensor | None = None,
    fp8_max: float | None = None,
    mse_range: tuple[float, float] = DEFAULT_MSE_RANGE,
    mse_global_steps: int = MSE_GLOBAL_STEPS,
    error: bool = True,
) -> ScaleSearchResult:
    """Quantize ``w`` ``[..., K]`` to NVFP4 choosing block scales by ``method``; report the error.

    ``global_amax`` / ``global_scale`` as in :func:`~fp4forge.numerics.nvfp4.nvfp4_quantize` (a
    fused group must use one method, so that it shares one scalar). ``fp8_max`` defaults to 256
    for "four_over_six" and 448 otherwise. For "mse" without ``global_scale`` and without
    ``fp8_max``, the scalar itself is searched too (:func:`nvfp4_mse_global_scale`, over
    ``mse_global_steps`` candidates; 1 = the min-max scalar only); a fused group passes the
    group's chosen ``global_scale`` to each member instead. ``error=False`` skips the error sums
    (about a third of the minmax path's arithmetic): ``relative_error``, ``err_sq`` and ``ref_sq``
    are then None.
    """
    _check_convention(convention)
    if method not in ("minmax", "four_over_six", "mse"):
        raise NumericsError(f"unknown block-scale method {method!r} (minmax | four_over_six | mse)")
    lo, hi = mse_range
    if not 0.0 < lo <= 1.0 <= hi:
        raise NumericsError(f"mse_range must satisfy 0 < lo <= 1 <= hi, got {mse_range}")
    if method == "mse" and global_scale is None and fp8_max is None and mse_global_steps > 1:
        global_scale = nvfp4_mse_global_scale([w], convention=convention, global_amax=global_amax, steps=mse_global_steps, mse_range=mse_range)
        global_amax = None
    if fp8_max is None:
        fp8_max = FOUR_OVER_SIX_FP8_MAX if method == "four_over_six" else FP8_E4M3_MAX

    if method == "minmax":
        fast = kernel_minmax(w, convention, global_amax, global_scale, fp8_max, error=error)
        if fast is not None:
            q, err_sq, ref_sq = fast
            if not error:
                return ScaleSearchResult(q, method, None, None, None, 0)
            return ScaleSearchResult(q, method, 0.0 if ref_sq == 0.0 else math.sqrt(err_sq / ref_sq), err_sq, ref_sq, 0)

    blocks = _blocks(w)
    amax_blk = block_absmax(blocks)
    _check_finite(amax_blk)
    g = _resolve_scalar(w, amax_blk, convention, global_amax, global_scale, fp8_max)
    raw = nvfp4_raw_block_scales(amax_blk, g, convention)
    minmax_scale = _finish_block_scales(raw, convention)
    chosen = minmax_scale
    if method != "minmax":
        chosen, _ = _search_block_scales(blocks, raw, minmax_scale, g, method, convention, mse_range)

    # the quantize pass also sums the error of its own rounded values (no separate dequantization)
    q, err_sq, ref_sq = _quantize_blocks(blocks, chosen, g, convention, error=error)
    changed = int((chosen.view(torch.uint8) != minmax_scale.view(torch.uint8)).sum())
    if not error:
        return ScaleSearchResult(q, method, None, None, None, changed)
    rel = 0.0 if ref_sq == 0.0 else math.sqrt(err_sq / ref_sq)
    return ScaleSearchResult(q, method, rel, err_sq, ref_sq, changed)
