"""GPTQ: calibrated rounding of a Linear weight on a format's real grid
(docs/quantization.md#gptq).

For a Linear ``y = x W^T`` with calibration inputs ``X`` (``n`` rows of ``K`` features), GPTQ
(Frantar et al., arXiv:2210.17323) quantizes the columns of ``W`` ``[N, K]`` one at a time and
pushes each column's rounding error onto the columns not yet quantized, weighted by the inverse
of the Hessian ``H = X^T X / n``, so that the layer's *output* error ``||(W - Q) X^T||`` is small
rather than the weight error ``||W - Q||``::

    H    += damp * mean(diag H) * I                  # damping keeps the Cholesky factor stable
    U     = cholesky(H^-1, upper)                    # row i of U: how column i's error spreads
    for each column i (in blocks of ``block_size``, the "lazy batch" update):
        q_i   = grid(w_i)                            # the format's own round-to-nearest
        e_i   = (w_i - q_i) / U[i, i]
        w_j  -= e_i * U[i, j]   for j > i

The grid is the format's, with its scales fixed before the column sweep:

* ``"nvfp4"``: E2M1 values times an E4M3 block scale per 16 columns times one per-tensor scalar
  (compressed-tensors convention ``2688 / amax``). The per-tensor scalar comes from the
  *original* weight's amax (or ``global_amax``, e.g. a fused q/k/v group's), so every block scale
  lives on the same E4M3 grid the exporter writes.
* ``"mxfp4"``: E2M1 times an E8M0 power-of-two scale per 32 columns (OCP rule).
* ``"int2"`` .. ``"int8"``: symmetric signed integers, one F32 scale per ``group_size`` columns
  (``None``: one per row), compressed-tensors' symmetric formula.

Block scales are ``"static"`` (default; computed from the original weight before the sweep, as
llm-compressor does) or ``"dynamic"`` (computed from the error-updated weights when the sweep
reaches a group's first column, as the original GPTQ code does; not with ``act_order``, whose
permuted sweep would see a group's columns out of order). ``block_scale`` supplies precomputed
scales (e.g. an MSE search's) instead.

``act_order``: sweep the columns in decreasing ``diag(H)`` (most-used inputs first); the codes
and scales are stored in the original column order, so the layout is unchanged.

Oracle: with ``H = I`` the inverse Hessian's Cholesky factor is diagonal, no error moves, and the
result is bit-identical to the format's round-to-nearest quantizer (``tests/test_gptq.py``).

Input columns with ``diag(H) == 0`` (never active in calibration) keep their weights and are
rounded to nearest; llm-compressor zeroes them instead. A Hessian that stays indefinite after
damping (retried with 10x and 100x the damping) falls back to round-to-nearest, flagged in
:attr:`GptqResult.fallback`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import NumericsError, e2m1_decode, e2m1_encode, pack_fp4
from fp4forge.numerics.intn import IntWeight, intn_quantize, intn_range
from fp4forge.numerics.mxfp4 import (
    E8M0_BIAS,
    MXFP4_BLOCK,
    Mxfp4Weight,
    mxfp4_quantize,
    mxfp4_scale_exponents,
)
from fp4forge.numerics.nvfp4 import (
    NVFP4_BLOCK,
    Nvfp4Weight,
    absmax,
    nvfp4_block_scales,
    nvfp4_global_scale,
)

__all__ = [
    "GPTQ_FORMATS",
    "GptqResult",
    "HessianAccumulator",
    "ScaleMode",
    "gptq_format_group",
    "gptq_quantize",
    "gptq_quantize_batch",
    "output_error",
]

ScaleMode = Literal["static", "dynamic"]
#: Formats :func:`gptq_quantize` accepts (INT-N for N in 2..8).
GPTQ_FORMATS = ("nvfp4", "mxfp4", "int2", "int3", "int4", "int5", "int6", "int7", "int8")
_INT_FORMAT = re.compile(r"int([2-8])")
_FP4_BLOCKS = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}  # their block is fixed by the format
_DAMP_RETRIES = (1.0, 10.0, 100.0)


# -- the Hessian ------------------------------------------------------------------------------------
class HessianAccumulator:
    """Running ``H = X^T X / n`` of a Linear's inputs, fed batch by batch.

    ``add(x)`` takes ``[..., K]`` (any leading shape; rows are tokens). Sums are kept in F64 so a
    long calibration run does not lose small contributions; :meth:`hessian` returns F32 ``[K, K]``.
    ``count`` is the number of token rows seen (the MoE fallback rule reads it per expert).
    """

    def __init__(self, in_features: int, *, device: torch.device | str = "cpu"):
        if in_features <= 0:
            raise NumericsError(f"a Hessian needs a positive input width, got {in_features}")
        self.in_features = in_features
        self.count = 0
        self._sum = torch.zeros((in_features, in_features), dtype=torch.float64, device=device)

    def add(self, x: Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise NumericsError(f"input width {x.shape[-1]} does not match the Hessian's {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return
        r = rows.to(self._sum.device, torch.float32)
        # the product in F32 (fast), the running sum in F64
        self._sum += (r.T @ r).to(torch.float64)
        self.count += rows.shape[0]

    def merge(self, other: HessianAccumulator) -> None:
        """Add another accumulator's tokens (the pooled all-experts Hessian)."""
        if other.in_features != self.in_features:
            raise NumericsError("cannot merge Hessians of different widths")
        self._sum += other._sum.to(self._sum.device)
        self.count += other.count

    def hessian(self) -> Tensor:
        """``X^T X / n`` in F32 (all zeros before any token)."""
        return (self._sum / max(self.count, 1)).to(torch.float32)


# -- the result ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GptqResult:
    """What GPTQ chose and what it costs.

    ``quantized``: the on-disk tensors (:class:`~fp4forge.numerics.nvfp4.Nvfp4Weight` in the
    compressed-tensors convention, :class:`~fp4forge.numerics.mxfp4.Mxfp4Weight` or symmetric
    :class:`~fp4forge.numerics.intn.IntWeight`), exactly what the exporter writes;
    ``dequantized``: F32 ``[N, K]``, the same values (``quantized.dequantize(torch.float32)``);
    ``loss``: GPTQ's proxy ``sum_i ||w_i - q_i||^2 / (2 U_ii^2)``; ``damp``: the relative damping
    finally used; ``fallback``: True when the Hessian could not be factorized and the weight was
    rounded to nearest instead.
    """

    quantized: Nvfp4Weight | Mxfp4Weight | IntWeight
    dequantized: Tensor
    fmt: str
    group_size: int
    loss: float
    damp: float
    act_order: bool
    scale_mode: ScaleMode
    fallback: bool = False


def gptq_format_group(fmt: str, group_size: int | None, in_features: int) -> int:
    """The group (block) size GPTQ uses for ``fmt``: 16 for NVFP4, 32 for MXFP4 (fixed by the
    format; any other ``group_size`` is an error), ``group_size`` or the whole row for INT-N."""
    fixed = _FP4_BLOCKS.get(fmt)
    if fixed is None:
        if not _INT_FORMAT.fullmatch(fmt):
            raise NumericsError(f"unknown GPTQ format {fmt!r} ({' | '.join(GPTQ_FORMATS)})")
        g = in_features if group_size is None else group_size
        if g <= 0 or in_features % g:
            raise NumericsError(f"group size {group_size} does not divide the input width {in_features}")
        return g
    if group_size not in (None, fixed):
        raise NumericsError(f"{fmt} has a fixed block of {fixed} columns, got group_size={group_size}")
    if in_features % fixed:
        raise NumericsError(f"{fmt} needs the input width to be a multiple of {fixed}, got {in_features}")
    return fixed


def output_error(weight: Tensor, approx: Tensor, hessian: Tensor) -> float:
    """``trace((W - Q) H (W - Q)^T)`` = mean over calibration tokens of ``||(W - Q) x||^2``."""
    d = (weight.to(torch.float64) - approx.to(torch.float64))
    return float(torch.einsum("ik,kl,il->", d, hessian.to(torch.float64), d))


# -- the grids ---------------------------------------------------------------------------------------
# Every grid holds a batch of B weights [B, N, K] (B experts of one shape are swept together: the
# per-column loop is the cost, and it is the same for 1 or 64 weights).
class _Grid:
    """A format's scales for a batch of weights, and the round-to-nearest of one column under them."""

    group: int
    step: Tensor  # F32 [B, N, groups]: the value of one grid unit (per block)

    def set_group(self, g: int, block: Tensor) -> None:  # dynamic scales for group g from [B, N, group]
        raise NotImplementedError

    def codes(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(codes, grid values in units of the step) of ``x`` already divided by its step."""
        raise NotImplementedError

    def round_column(self, col: Tensor, groups: Tensor) -> tuple[Tensor, Tensor]:
        """(codes, dequantized F32) of column ``col`` ``[B, N]``; ``groups`` ``[B]``: its group per weight."""
        s = self.step[torch.arange(col.shape[0]), :, groups]  # [B, N]
        codes, units = self.codes(col / s)
        return codes, units * s

    def finish(self, codes: Tensor) -> list:  # codes [B, N, K] -> on-disk weights
        raise NotImplementedError


class _Fp4Codes:
    @staticmethod
    def codes(x: Tensor) -> tuple[Tensor, Tensor]:
        c = e2m1_encode(x)
        return c, e2m1_decode(c, torch.float32)


class _Nvfp4Grid(_Fp4Codes, _Grid):
    group = NVFP4_BLOCK

    def __init__(self, w: Tensor, global_amax: list[Tensor | float | None], block_scale: list[Tensor | None], global_scale: list[Tensor | None]):
        self.global_scale = []
        scales = []
        for b in range(w.shape[0]):
            if global_scale[b] is not None:
                g = torch.as_tensor(global_scale[b]).to(torch.float32).reshape(1)
            else:
                amax = absmax(w[b]) if global_amax[b] is None else torch.as_tensor(global_amax[b]).to(w.dtype)
                g = nvfp4_global_scale(amax)
            self.global_scale.append(g)
            given = block_scale[b]
            if given is None:
                given = nvfp4_block_scales(w[b], g)
            elif given.dtype != torch.float8_e4m3fn or given.shape != (w.shape[1], w.shape[2] // NVFP4_BLOCK):
                raise NumericsError(f"block_scale must be float8_e4m3fn [{w.shape[1]}, {w.shape[2] // NVFP4_BLOCK}]")
            scales.append(given)
        self.block_scale = torch.stack(scales)
        self._g = torch.cat(self.global_scale).reshape(-1, 1, 1)
        # compressed-tensors' step: scale / global_scale in F32 (what nvfp4_quantize divides by)
        self.step = self.block_scale.to(torch.float32) / self._g

    def set_group(self, g: int, block: Tensor) -> None:
        for b in range(block.shape[0]):
            self.block_scale[b, :, g : g + 1] = nvfp4_block_scales(block[b], self.global_scale[b])
        self.step[:, :, g] = self.block_scale[:, :, g].to(torch.float32) / self._g[:, :, 0]

    def finish(self, codes: Tensor) -> list[Nvfp4Weight]:
        return [Nvfp4Weight(pack_fp4(codes[b]), self.block_scale[b], self.global_scale[b], "compressed-tensors") for b in range(codes.shape[0])]


class _Mxfp4Grid(_Fp4Codes, _Grid):
    group = MXFP4_BLOCK

    def __init__(self, w: Tensor):
        self.exponent = mxfp4_quantize(w).scale.to(torch.int32) - E8M0_BIAS
        self.step = torch.ldexp(torch.ones_like(self.exponent, dtype=torch.float32), self.exponent)

    def set_group(self, g: int, block: Tensor) -> None:
        x = mxfp4_scale_exponents(block.abs().amax(dim=-1))
        self.exponent[:, :, g] = x
        self.step[:, :, g] = torch.ldexp(torch.ones_like(x, dtype=torch.float32), x)

    def finish(self, codes: Tensor) -> list[Mxfp4Weight]:
        return [Mxfp4Weight(pack_fp4(codes[b]), (self.exponent[b] + E8M0_BIAS).to(torch.uint8)) for b in range(codes.shape[0])]


class _IntGrid(_Grid):
    def __init__(self, w: Tensor, bits: int, group: int):
        self.bits, self.group = bits, group
        self.qmin, self.qmax = intn_range(bits)
        self.step = intn_quantize(w, bits, group_size=group, symmetric=True).scale.clone()

    def set_group(self, g: int, block: Tensor) -> None:
        self.step[:, :, g] = intn_quantize(block, self.bits, group_size=self.group, symmetric=True).scale[..., 0]

    def codes(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.round(x).clamp(self.qmin, self.qmax)
        return q, q

    def finish(self, codes: Tensor) -> list[IntWeight]:
        return [IntWeight(codes[b].to(torch.int8), self.step[b], None, self.bits, self.group) for b in range(codes.shape[0])]


_NVFP4_GRIDS, _MXFP4_GRIDS = frozenset({"nvfp4"}), frozenset({"mxfp4"})


def _make_grid(w: Tensor, fmt: str, group: int, global_amax: list, block_scale: list, global_scale: list) -> _Grid:
    if fmt in _NVFP4_GRIDS:
        return _Nvfp4Grid(w, global_amax, block_scale, global_scale)
    if any(x is not None for x in (*block_scale, *global_amax, *global_scale)):
        raise NumericsError("block_scale, global_amax and global_scale apply to nvfp4 only")
    if fmt in _MXFP4_GRIDS:
        return _Mxfp4Grid(w)
    return _IntGrid(w, int(fmt[3:]), group)


# -- the algorithm -----------------------------------------------------------------------------------
def _upper_inverse_factor(h: Tensor, damp: float) -> Tensor | None:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, or None if indefinite."""
    h = h.clone()
    mean_diag = float(torch.diagonal(h).mean())
    torch.diagonal(h).add_(damp * (mean_diag if mean_diag > 0 else 1.0))
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        return None
    inv = torch.cholesky_inverse(lower)
    upper, info = torch.linalg.cholesky_ex(inv, upper=True)
    if int(info) != 0 or not bool(torch.isfinite(upper).all()):
        return None
    return upper


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    fmt: str,
    *,
    global_amax: Tensor | float | None = None,
    block_scale: Tensor | None = None,
    global_scale: Tensor | None = None,
    **settings: Any,
) -> GptqResult:
    """GPTQ-quantize one ``weight`` ``[N, K]`` with the input Hessian ``hessian`` ``[K, K]`` to ``fmt``:
    :func:`gptq_quantize_batch` of a batch of one. ``settings`` are that function's keywords
    (``group_size``, ``block_size``, ``damp``, ``act_order``, ``scale_mode``), documented there."""
    if weight.ndim != 2:
        raise NumericsError(f"GPTQ needs a 2-D weight, got shape {list(weight.shape)} (gptq_quantize_batch takes [B, N, K])")
    return gptq_quantize_batch(
        weight.unsqueeze(0), hessian.unsqueeze(0), fmt, global_amax=[global_amax], block_scale=[block_scale], global_scale=[global_scale], **settings,
    )[0]


def gptq_quantize_batch(
    weights: Tensor,
    hessians: Tensor,
    fmt: str,
    *,
    group_size: int | None = None,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    scale_mode: ScaleMode = "static",
    global_amax: list[Tensor | float | None] | None = None,
    block_scale: list[Tensor | None] | None = None,
    global_scale: list[Tensor | None] | None = None,
) -> list[GptqResult]:
    """GPTQ-quantize ``B`` weights of one shape at once: ``weights`` ``[B, N, K]`` with their input
    Hessians ``hessians`` ``[B, K, K]``; each result is what a batch of that weight alone gives.

    ``fmt``: ``"nvfp4"`` | ``"mxfp4"`` | ``"int2"`` .. ``"int8"`` (symmetric). ``group_size``: INT-N
    only (None = one group per row); NVFP4/MXFP4 blocks are fixed (16 / 32). ``block_size``: columns
    per lazy-batch update (rounded up to a multiple of the group). ``damp``: relative diagonal
    damping. Per weight (one entry each, or None): ``global_amax``, NVFP4's per-tensor amax
    (default the weight's own; pass a fused group's max so q/k/v or gate/up share one scalar);
    ``block_scale``, NVFP4 E4M3 block scales to use instead of the min-max ones (implies static
    scales); ``global_scale``, NVFP4's per-tensor scale itself (instead of ``global_amax``).
    """
    fmt = fmt.lower()
    nb, n, k = _check_shapes(weights, hessians)
    group = gptq_format_group(fmt, group_size, k)
    global_amax, block_scale, global_scale = _per_weight(nb, global_amax, block_scale, global_scale)
    _check_settings(scale_mode, act_order, block_scale, damp, block_size)
    if not bool(torch.isfinite(weights).all()) or not bool(torch.isfinite(hessians).all()):
        raise NumericsError("weight or Hessian holds NaN or Inf; refusing to quantize it")
    block_size = int(math.ceil(block_size / group) * group)

    w = weights.to(torch.float32).clone()
    grid = _make_grid(w, fmt, group, global_amax, block_scale, global_scale)
    h = hessians.to(torch.float32).clone()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag[diag == 0] = 1.0  # an unused input: no coupling, so its columns round to nearest
    w, h, perm, cols = _act_order(w, h, act_order)
    u, used_damp, fallback = _inverse_factors(h, damp)
    codes, loss = _sweep(w, u, grid, cols // group, block_size, scale_mode)
    if perm is not None:
        codes = codes.gather(2, torch.argsort(perm, dim=-1).unsqueeze(1).expand(nb, n, k))
    quantized = grid.finish(codes.to(torch.uint8) if isinstance(grid, _Fp4Codes) else codes)
    return [
        GptqResult(q, q.dequantize(torch.float32), fmt, group, float(loss[b]), used_damp[b], act_order, scale_mode, fallback[b])
        for b, q in enumerate(quantized)
    ]


def _check_shapes(weights: Tensor, hessians: Tensor) -> tuple[int, int, int]:
    """(B, N, K) of a batch whose Hessians fit its weights."""
    if weights.ndim != 3 or not weights.is_floating_point():
        raise NumericsError(f"GPTQ needs float weights [B, N, K], got {weights.dtype} {list(weights.shape)}")
    nb, n, k = weights.shape
    if hessians.shape != (nb, k, k):
        raise NumericsError(f"Hessian shape {list(hessians.shape[-2:])} does not match the weight's input width {k}")
    return nb, n, k


def _per_weight(nb: int, global_amax: list | None, block_scale: list | None, global_scale: list | None) -> tuple[list, list, list]:
    """The per-weight NVFP4 overrides as lists of ``nb`` entries (None where not given)."""
    amaxes, blocks, scalars = (list(x) if x is not None else [None] * nb for x in (global_amax, block_scale, global_scale))
    if len(amaxes) != nb or len(blocks) != nb or len(scalars) != nb:
        raise NumericsError("global_amax, block_scale and global_scale need one entry per weight")
    if any(a is not None and g is not None for a, g in zip(amaxes, scalars)):
        raise NumericsError("pass global_amax or global_scale for a weight, not both")
    return amaxes, blocks, scalars


def _check_settings(scale_mode: str, act_order: bool, block_scale: list, damp: float, block_size: int) -> None:
    if scale_mode not in ("static", "dynamic"):
        raise NumericsError(f"unknown scale mode {scale_mode!r} (static | dynamic)")
    if scale_mode == "dynamic" and (act_order or any(b is not None for b in block_scale)):
        raise NumericsError("dynamic block scales need the natural column order and no given block_scale")
    if not damp > 0 or block_size <= 0:
        raise NumericsError(f"damp must be > 0 and block_size positive, got damp={damp}, block_size={block_size}")


def _act_order(w: Tensor, h: Tensor, act_order: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """(weights, Hessians, permutation or None, each swept column's stored index ``[B, K]``):
    with ``act_order`` the columns by decreasing Hessian diagonal, else as stored."""
    nb, n, k = w.shape
    if not act_order:
        return w, h, None, torch.arange(k).expand(nb, k)
    perm = torch.argsort(torch.diagonal(h, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
    w = w.gather(2, perm.unsqueeze(1).expand(nb, n, k))
    h = h.gather(1, perm.unsqueeze(2).expand(nb, k, k)).gather(2, perm.unsqueeze(1).expand(nb, k, k))
    return w, h, perm, perm


def _inverse_factors(h: Tensor, damp: float) -> tuple[Tensor, list[float], list[bool]]:
    """Per weight: the upper factor of the damped inverse Hessian, the damping that made it
    positive definite, and whether none did (then the identity: plain round-to-nearest)."""
    nb, k = h.shape[0], h.shape[-1]
    u = torch.empty_like(h)
    used_damp, fallback = [damp] * nb, [False] * nb
    for b in range(nb):
        for factor in _DAMP_RETRIES:
            ub = _upper_inverse_factor(h[b], damp * factor)
            if ub is not None:
                u[b], used_damp[b] = ub, damp * factor
                break
        else:
            u[b], fallback[b] = torch.eye(k), True  # no coupling: plain round-to-nearest
    return u, used_damp, fallback


def _sweep(w: Tensor, u: Tensor, grid: _Grid, col_group: Tensor, block_size: int, scale_mode: str) -> tuple[Tensor, Tensor]:
    """GPTQ's column sweep in lazy batches of ``block_size`` columns: each column rounded on the
    grid, its error spread over the columns not yet rounded. (codes F32 [B, N, K], loss [B])."""
    nb, n, k = w.shape
    group = grid.group
    codes = torch.empty((nb, n, k), dtype=torch.float32)
    loss = torch.zeros(nb, dtype=torch.float64)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if scale_mode == "dynamic" and col % group == 0:
                grid.set_group(col // group, w1[:, :, i : i + group])
            c, q = grid.round_column(w1[:, :, i], col_group[:, col])
            codes[:, :, col] = c.to(torch.float32)
            e = (w1[:, :, i] - q) / u1[:, i, i].unsqueeze(1)
            loss += (e * e).sum(dim=1).to(torch.float64) / 2
            w1[:, :, i:] -= e.unsqueeze(2) * u1[:, i, i:].unsqueeze(1)
            err1[:, :, i] = e
        w[:, :, i2:] -= torch.bmm(err1, u[:, i1:i2, i2:])
    return codes, loss
