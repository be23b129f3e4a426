"""NVFP4: E2M1 elements, one FP8 E4M3 scale per 16 consecutive elements of the last dim, and
one FP32 per-tensor scale (docs/formats.md#nvfp4).

Two conventions for the per-tensor scalar, same block scales and same packed bytes:

* ``"compressed-tensors"`` (llm-compressor writes it; CT 0.17):
  ``weight_global_scale = 2688 / amax`` (F32 ``[1]``), computed in **amax's dtype** (for a bf16
  weight llm-compressor's observer takes amax in bf16, so the quotient is rounded to bf16 before
  the cast to F32), NaN/Inf -> 1.0, amax clamped to ``finfo(dtype).tiny`` (CT ``generate_gparam``)::

      raw   = global_scale * (amax_blk / 6)          # amax_blk / 6 in W.dtype; product in F32
      scale = e4m3(clamp(raw, -448, 448)); scale == 0 -> 0.125      # CT calculate_qparams
      q     = e2m1(clamp(W / (scale / global_scale), -6, 6))        # CT _quantize
      W'    = e2m1_value * (scale / global_scale)                   # CT decompress ("divide")

  A raw block scale at or below 2^-10 rounds to E4M3 zero (2^-10 is the tie with the smallest
  subnormal 2^-9) and is then replaced by 0.125 (CT's eps), so such a block quantizes to all
  zeros; raw scales in (2^-10, 2^-6) become E4M3 subnormals (multiples of 2^-9).

  The scalar must keep the shape ``[1]``: a 0-dim F32 scalar does not promote CT's bf16
  ``scale / global_scale`` to F32, and CT's decompress then divides in bf16 (this is what happens
  to checkpoints made by CT's ``ModelOptNvfp4Converter``, which keeps ModelOpt's ``[]``).

* ``"modelopt"`` (ModelOpt ``NVFP4QTensor``): ``weight_scale_2 = amax / 2688`` (F32 scalar ``[]``)::

      scale = e4m3(clamp(amax_blk / (6 * scale_2), 2^-9, 448)); raw 0 -> 1.0
      q     = e2m1(W / (scale * scale_2))
      W'    = e2m1_value * (scale * scale_2)                        # ModelOpt / vLLM ("multiply")

Converting between them: ``weight_global_scale = 1 / weight_scale_2`` in F32 (what CT's
``ModelOptNvfp4Converter`` does); block scales and packed bytes are unchanged.

vLLM (0.32, emulation) dequantizes a CT weight with ``scale * fp32(1 / global_scale)``, i.e. the
"multiply" formula, and quantizes activations with :func:`nvfp4_quantize_activation`.

Everything is vectorised over the tensor and works on any leading shape; blocks run along the
last dim. Given the same global scale (pass ``global_amax`` or ``global_scale``), a row chunk gives
exactly the rows of the whole-tensor result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import (
    E2M1_MAX,
    NumericsError,
    block_absmax,
    decode_packed_blocks,
    e2m1_decode,
    e2m1_encode,
    encode_packed_blocks,
    encode_packed_blocks_with_error,
    encode_packed_rows,
    row_chunks,
    unpack_fp4,
)
from fp4forge.numerics.fp8 import FP8_E4M3_MAX
from fp4forge.numerics import nvfp4_kernel
from fp4forge.numerics.conventions import CONVENTIONS, Convention, DequantFormula, ct_global_scales, convention_rule

__all__ = [
    "NVFP4_BLOCK",
    "NVFP4_GLOBAL_NUMERATOR",
    "Convention",
    "DequantFormula",
    "Nvfp4Weight",
    "StackedNvfp4",
    "absmax",
    "amax_from_ct_global_scale",
    "amax_from_scale_2",
    "ct_global_to_modelopt_scale_2",
    "ct_global_scale_from_amax",
    "modelopt_scale_2_to_ct_global",
    "nvfp4_activation_fake_quantizer",
    "nvfp4_block_scales",
    "nvfp4_dequantize",
    "nvfp4_encode",
    "nvfp4_fake_quantize_activation",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "nvfp4_quantize_activation",
    "nvfp4_quantize_stacked",
    "nvfp4_raw_block_scales",
    "nvfp4_scale_2",
]

NVFP4_BLOCK = 16
NVFP4_GLOBAL_NUMERATOR = FP8_E4M3_MAX * E2M1_MAX  # 2688 = 448 * 6: the largest E4M3 block scale times the largest E2M1 value


# -- per-tensor scalars ---------------------------------------------------------------------------
def absmax(w: Tensor) -> Tensor:
    """``max |w|`` as a 0-dim tensor in ``w``'s dtype (exact; combine row chunks with ``torch.maximum``)."""
    if w.numel() == 0:
        return w.abs().amax()  # torch's own error for an empty tensor
    if nvfp4_kernel.usable_for(w):
        return nvfp4_kernel.absmax_bf16(w)
    return block_absmax(w.reshape(1, -1))[0]


def nvfp4_global_scale(amax: Tensor | float, *, fp8_max: float = FP8_E4M3_MAX, dtype: torch.dtype | None = None) -> Tensor:
    """compressed-tensors ``generate_gparam``: ``(fp8_max * 6) / amax`` -> F32 ``[1]``.

    The division runs in ``amax``'s dtype (or ``dtype`` if given, amax is cast first), as CT does;
    amax is clamped to that dtype's ``tiny``; NaN/Inf results become 1.0 (so amax = 0, a tiny amax
    whose quotient overflows, and NaN all give 1.0). The same formula gives the activation
    ``input_global_scale`` from a calibrated activation amax. ``fp8_max=256`` is Four-Over-Six's.
    """
    a = torch.as_tensor(amax)
    if dtype is not None:
        a = a.to(dtype)
    return ct_global_scales(a, fp8_max).reshape(1)


def nvfp4_scale_2(amax: Tensor | float, *, fp8_max: float = FP8_E4M3_MAX) -> Tensor:
    """ModelOpt ``get_weights_scaling_factor_2``: ``float32(amax) / (6 * fp8_max)`` -> F32 ``[]``.

    Also ModelOpt's activation ``input_scale`` (amax / 2688) from a calibrated activation amax."""
    return (torch.as_tensor(amax).float() / (E2M1_MAX * fp8_max)).reshape(())


def ct_global_to_modelopt_scale_2(global_scale: Tensor) -> Tensor:
    """CT ``weight_global_scale`` (F32 ``[1]``) -> ModelOpt ``weight_scale_2`` (F32 ``[]``): ``1 / x``
    in F32, correctly rounded (what CT's ``ModelOptNvfp4Converter`` does in the other direction)."""
    return CONVENTIONS["compressed-tensors"].scale_2(global_scale)


def modelopt_scale_2_to_ct_global(scale_2: Tensor) -> Tensor:
    """ModelOpt ``weight_scale_2`` -> CT ``weight_global_scale`` (F32 ``[1]``): ``1 / x`` in F32."""
    return CONVENTIONS["modelopt"].ct_global(scale_2)


def amax_from_ct_global_scale(global_scale: float) -> float:
    """The amax a compressed-tensors per-tensor scale (``2688 / amax``) stands for, in float64."""
    return NVFP4_GLOBAL_NUMERATOR / global_scale


def amax_from_scale_2(scale_2: float) -> float:
    """The amax a ModelOpt per-tensor scale (``amax / 2688``) stands for, in float64."""
    return scale_2 * NVFP4_GLOBAL_NUMERATOR


def ct_global_scale_from_amax(amax: float) -> Tensor:
    """``2688 / amax`` computed in float64, as F32 ``[1]``; 1.0 for a non-positive amax. (The
    float64 quotient of a plain number; :func:`nvfp4_global_scale` is CT's, in amax's dtype.)"""
    if amax > 0:
        return torch.tensor([NVFP4_GLOBAL_NUMERATOR / amax], dtype=torch.float32)
    return torch.ones(1)


# -- the quantized weight ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Nvfp4Weight:
    """An NVFP4 weight as it lies on disk.

    ``packed``: uint8 ``[..., K/2]`` (element 2i in the low nibble); ``block_scale``:
    float8_e4m3fn ``[..., K/16]``, row-major, not swizzled; ``global_scale``: F32, the convention's
    own scalar: CT ``weight_global_scale`` ``[1]`` (2688/amax) or ModelOpt ``weight_scale_2`` ``[]``
    (amax/2688).
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor
    convention: Convention = "compressed-tensors"

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the unpacked weight."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def weight_global_scale(self) -> Tensor:
        """The CT scalar (F32 ``[1]``), converted if this weight is in ModelOpt convention."""
        return convention_rule(self.convention).ct_global(self.global_scale)

    @property
    def weight_scale_2(self) -> Tensor:
        """The ModelOpt scalar (F32 ``[]``), converted if this weight is in CT convention."""
        return convention_rule(self.convention).scale_2(self.global_scale)

    def codes(self) -> Tensor:
        """Unpacked E2M1 codes, uint8 ``[..., K]``."""
        return unpack_fp4(self.packed)

    def to_convention(self, convention: Convention) -> Nvfp4Weight:
        """Same bytes and block scales, the per-tensor scalar converted by ``1/x`` in F32."""
        target = convention_rule(convention)
        if convention == self.convention:
            return self
        return replace(self, global_scale=target.adopt(self.global_scale, convention_rule(self.convention)), convention=convention)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, *, formula: DequantFormula | None = None) -> Tensor:
        """See :func:`nvfp4_dequantize`."""
        return nvfp4_dequantize(self, dtype, formula=formula)


def _check_convention(convention: str) -> None:
    convention_rule(convention)


def _blocks(w: Tensor) -> Tensor:
    if not w.is_floating_point():
        raise NumericsError(f"NVFP4 quantization needs a float tensor, got {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % NVFP4_BLOCK:
        raise NumericsError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got shape {list(w.shape)}")
    return w.unflatten(-1, (w.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))


def _check_finite(amax_blk: Tensor) -> None:
    """NaN and Inf propagate into the block maxima and from there into their max, so checking
    that one number suffices."""
    if amax_blk.numel() and not bool(torch.isfinite(amax_blk.amax())):
        raise NumericsError("weight holds NaN or Inf; refusing to quantize it")


def _resolve_scalar(
    w: Tensor,
    amax_blk: Tensor,
    convention: Convention,
    global_amax: Tensor | float | None,
    global_scale: Tensor | None,
    fp8_max: float,
) -> Tensor:
    rule = convention_rule(convention)
    if global_scale is not None:
        if global_amax is not None:
            raise NumericsError("pass global_amax or global_scale, not both")
        return global_scale.to(torch.float32).reshape(rule.scalar_shape)
    if global_amax is None:
        amax = amax_blk.amax() if amax_blk.numel() else torch.zeros((), dtype=w.dtype)
    else:
        # CT computes the quotient in the weight's dtype; a bf16 max is exact in bf16.
        amax = torch.as_tensor(global_amax, device=w.device).to(w.dtype).reshape(())
    return rule.scalars(amax, fp8_max).reshape(rule.scalar_shape)


# -- block scales -------------------------------------------------------------------------------------
def nvfp4_raw_block_scales(amax_blk: Tensor, global_scale: Tensor, convention: Convention = "compressed-tensors") -> Tensor:
    """Block scales before the E4M3 rounding, F32 ``[..., K/16]``.

    CT: ``global_scale * (amax_blk / 6)`` with ``amax_blk / 6`` in amax_blk's dtype (as CT);
    ModelOpt: ``float32(amax_blk) / (6 * scale_2)``.
    """
    rule = convention_rule(convention)
    return rule.raw_block_scales(amax_blk, global_scale.to(torch.float32).reshape(rule.scalar_shape))


def _finish_block_scales(raw: Tensor, convention: Convention) -> Tensor:
    """Round raw F32 block scales to E4M3 with the convention's clamps and zero rule."""
    return convention_rule(convention).finish_block_scales(raw)


def nvfp4_block_scales(
    w: Tensor, global_scale: Tensor, convention: Convention = "compressed-tensors", *, multiplier: float = 1.0
) -> Tensor:
    """The round-to-nearest ("minmax") E4M3 block scales of ``w`` ``[..., K]`` -> ``[..., K/16]``.

    ``multiplier`` scales the raw block scale before rounding (1.5 maps the block max to 4 instead
    of 6); 1.0 is compressed-tensors' / ModelOpt's own rule.
    """
    _check_convention(convention)
    amax_blk = block_absmax(_blocks(w))
    raw = nvfp4_raw_block_scales(amax_blk, global_scale, convention)
    if multiplier != 1.0:
        raw = raw * multiplier
    return _finish_block_scales(raw, convention)


_E4M3_TABLE: dict[torch.device, Tensor] = {}


def e4m3_to_f32(scale: Tensor) -> Tensor:
    """``scale.to(torch.float32)`` for float8_e4m3fn, by a 256-entry table built with that very
    cast (the direct cast is a per-element function call on CPU, ~4x slower)."""
    table = _E4M3_TABLE.get(scale.device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32, device=scale.device).to(torch.uint8)
        table = _E4M3_TABLE[scale.device] = codes.view(torch.float8_e4m3fn).to(torch.float32)
    index = scale.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, index).reshape(scale.shape)


def _effective_scale(block_scale: Tensor, global_scale: Tensor, convention: Convention) -> Tensor:
    """F32 per-block step multiplier: CT ``scale / global_scale``; ModelOpt ``scale * scale_2``."""
    return convention_rule(convention).step(e4m3_to_f32(block_scale), global_scale.to(torch.float32))


def nvfp4_encode(
    w: Tensor, block_scale: Tensor, global_scale: Tensor, convention: Convention = "compressed-tensors"
) -> Tensor:
    """E2M1 codes (uint8 ``[..., K]``) of ``w`` under the given scales.

    CT: ``e2m1(clamp(w / (scale / global_scale), -6, 6))``; ModelOpt: ``e2m1(w / (scale * scale_2))``
    (the clamp is implied: anything above 5 rounds to 6). The division is in F32.
    """
    _check_convention(convention)
    blocks = _blocks(w)
    eff = _effective_scale(block_scale, global_scale, convention)
    scaled = blocks / eff.unsqueeze(-1)  # bf16 / F32 promotes: the division runs in F32
    return e2m1_encode(scaled).flatten(-2)


def nvfp4_quantize(
    w: Tensor,
    *,
    convention: Convention = "compressed-tensors",
    global_amax: Tensor | float | None = None,
    global_scale: Tensor | None = None,
    block_scale: Tensor | None = None,
    fp8_max: float = FP8_E4M3_MAX,
) -> Nvfp4Weight:
    """Quantize ``w`` ``[..., K]`` (K a multiple of 16) to NVFP4, round-to-nearest block scales.

    * ``global_amax``: use this amax for the per-tensor scalar instead of ``max |w|`` — the max over
      a fused group (q/k/v, gate/up) so they share one scalar, or the whole tensor's amax when
      quantizing it in row chunks. Cast to ``w.dtype`` first, as CT's observer has it.
    * ``global_scale``: give the convention's scalar directly (CT ``[1]`` / ModelOpt ``[]``).
    * ``block_scale``: give E4M3 block scales (from a scale search) instead of the minmax ones.
    * ``fp8_max``: 448 (standard); 256 for Four-Over-Six's headroom.

    With the defaults this is bit-identical to compressed-tensors 0.17 as llm-compressor runs it
    (``generate_gparam`` + ``calculate_qparams`` + ``NVFP4PackedCompressor.compress``).
    """
    _check_convention(convention)
    if block_scale is None:
        fast = kernel_minmax(w, convention, global_amax, global_scale, fp8_max, error=False)
        if fast is not None:
            return fast[0]
    return _eager_quantize(w, convention, global_amax, global_scale, block_scale, fp8_max, error=False)[0]


def _eager_quantize(
    w: Tensor, convention: Convention, global_amax: Tensor | float | None, global_scale: Tensor | None,
    block_scale: Tensor | None, fp8_max: float, *, error: bool,
) -> tuple[Nvfp4Weight, float, float]:
    """nvfp4_quantize's torch path (min-max block scales unless given), with error sums on request."""
    blocks = _blocks(w)
    amax_blk = block_absmax(blocks)
    _check_finite(amax_blk)
    g = _resolve_scalar(w, amax_blk, convention, global_amax, global_scale, fp8_max)
    if block_scale is None:
        block_scale = _finish_block_scales(nvfp4_raw_block_scales(amax_blk, g, convention), convention)
    return _quantize_blocks(blocks, block_scale, g, convention, error=error)


def eager_minmax(w: Tensor, convention: Convention = "compressed-tensors") -> tuple[Nvfp4Weight, float, float]:
    """Min-max NVFP4 of ``w`` by the eager torch path alone (never the kernel), with its error sums
    (err_sq, ref_sq): the reference the compiled kernel is held to."""
    _check_convention(convention)
    return _eager_quantize(w, convention, None, None, None, FP8_E4M3_MAX, error=True)


def kernel_minmax(
    w: Tensor,
    convention: Convention,
    global_amax: Tensor | float | None,
    global_scale: Tensor | None,
    fp8_max: float,
    *,
    error: bool,
) -> tuple[Nvfp4Weight, float, float] | None:
    """Min-max NVFP4 of ``w`` by the fused CPU kernel (:mod:`~fp4forge.numerics.nvfp4_kernel`):
    the bytes of the eager path, and with ``error`` its (err_sq, ref_sq) up to summation order.
    None when the kernel does not apply (not a contiguous bf16 CPU tensor, no kernel, or a zero
    or non-finite step): the caller runs the eager path."""
    if not nvfp4_kernel.usable_for(w):
        return None
    amax = nvfp4_kernel.absmax_bf16(w)
    _check_finite(amax)
    g = _resolve_scalar(w, amax.reshape(1), convention, global_amax, global_scale, fp8_max)
    result = nvfp4_kernel.minmax_bf16(w, convention, g, error)
    if result is None:
        return None
    packed, block_scale, err_sq, ref_sq = result
    return Nvfp4Weight(packed, block_scale, g, convention), err_sq, ref_sq


def _quantize_blocks(
    blocks: Tensor, block_scale: Tensor, g: Tensor, convention: Convention, *, error: bool
) -> tuple[Nvfp4Weight, float, float]:
    """Encode finite ``blocks`` ``[..., K/16, 16]`` under given scales; with ``error``, also the
    sums of the squared F32 dequantization error and of ``w^2`` (from the same pass)."""
    if block_scale.dtype != torch.float8_e4m3fn or block_scale.shape != blocks.shape[:-1]:
        raise NumericsError(
            f"block_scale must be float8_e4m3fn {list(blocks.shape[:-1])}, got {block_scale.dtype} {list(block_scale.shape)}"
        )
    step = _effective_scale(block_scale, g, convention)
    if error:
        packed, err_sq, ref_sq = encode_packed_blocks_with_error(blocks, step)
    else:
        packed, err_sq, ref_sq = encode_packed_blocks(blocks, step), 0.0, 0.0
    return Nvfp4Weight(packed, block_scale, g, convention), err_sq, ref_sq


@dataclass(frozen=True)
class StackedNvfp4:
    """``B`` NVFP4 weights quantized in one pass (:func:`nvfp4_quantize_stacked`), still where
    they were computed; nothing here has waited for the device.

    ``packed`` uint8 ``[B, ..., K/2]``; ``block_scale`` E4M3 ``[B, ..., K/16]``; ``global_scale``
    F32 ``[B, 1]`` (CT) or ``[B]`` (ModelOpt); ``err_sq`` / ``ref_sq`` F64 ``[B]`` (with ``error``)
    as in :func:`~fp4forge.numerics.scale_search.search_nvfp4`; ``finite`` bool ``[B]``: the
    slice held no NaN/Inf; ``regular`` bool ``[B]``: every step of the slice was positive and
    finite. A slice that is not regular (possible only for ModelOpt scalars of denormal-sized
    weights) must be quantized again by :func:`nvfp4_quantize`, which handles it; one that is not
    finite must be refused.
    """

    packed: Tensor
    block_scale: Tensor
    global_scale: Tensor
    finite: Tensor
    regular: Tensor
    err_sq: Tensor | None = None
    ref_sq: Tensor | None = None
    convention: Convention = "compressed-tensors"

    def to(self, device: torch.device | str, *, non_blocking: bool = False, pin_memory: bool = False) -> StackedNvfp4:
        """Every tensor copied to ``device`` (into page-locked memory with ``pin_memory``, which
        lets a CUDA copy run ``non_blocking``)."""

        def move(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            target = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin_memory)
            return target.copy_(t, non_blocking=non_blocking)

        return replace(
            self,
            **{name: move(getattr(self, name)) for name in ("packed", "block_scale", "global_scale", "finite", "regular", "err_sq", "ref_sq")},
        )

    def weight(self, index: int) -> Nvfp4Weight:
        """Slice ``index`` as an :class:`Nvfp4Weight` (views, no copy)."""
        return Nvfp4Weight(self.packed[index], self.block_scale[index], self.global_scale[index], self.convention)


def nvfp4_quantize_stacked(
    w: Tensor,
    *,
    convention: Convention = "compressed-tensors",
    group: int = 1,
    error: bool = False,
    fp8_max: float = FP8_E4M3_MAX,
    chunk_elements: int | None = None,
) -> StackedNvfp4:
    """Quantize the ``B`` weights stacked in ``w`` ``[B, ..., K]`` (e.g. a layer's expert
    projections) with round-to-nearest ("minmax") block scales, in one pass and with no host
    sync: a few dozen kernels for the whole stack instead of that many per weight (on a GPU the
    per-weight path is launch-bound).

    Slice ``i`` gets exactly the bytes of ``nvfp4_quantize(w[i], global_amax=...)`` where the
    global amax is the max over its ``group`` (``group`` consecutive slices share one per-tensor
    scalar, as a fused gate/up pair does; ``group=1``: each slice its own ``max |w[i]|``). Every
    operation is elementwise or a max, so stacking changes no bit; the error sums are summed in
    another order than :func:`~fp4forge.numerics.scale_search.search_nvfp4`'s (equal to ~1e-6).
    Nothing is checked here (that would wait for the device): read ``finite`` and ``regular``.
    """
    _check_convention(convention)
    if w.ndim < 2 or w.shape[0] % max(1, group):
        raise NumericsError(f"nvfp4_quantize_stacked needs [B, ..., K] with B a multiple of group={group}, got shape {list(w.shape)}")
    n = w.shape[0]
    blocks = _blocks(w).contiguous()
    amax_blk = block_absmax(blocks)
    slice_amax = amax_blk.reshape(n, -1).amax(dim=1)  # exact: a max of maxima
    finite = torch.isfinite(slice_amax)  # NaN and Inf propagate into the max (as _check_finite)
    if group > 1:
        slice_amax = slice_amax.view(-1, group).amax(dim=1).repeat_interleave(group)
    rule = convention_rule(convention)
    g = rule.scalars(slice_amax, fp8_max).reshape(n, *rule.scalar_shape)  # as _resolve_scalar, per slice
    bshape = (n,) + (1,) * (amax_blk.ndim - 1)
    block_scale = rule.finish_block_scales(rule.raw_block_scales(amax_blk, g.reshape(bshape)))
    step = rule.step(e4m3_to_f32(block_scale), g.reshape(bshape))
    regular = ((step > 0) & (step < math.inf)).reshape(n, -1).all(dim=1)
    nb = blocks.shape[-2]
    packed, err_rows, ref_rows = encode_packed_rows(
        blocks.reshape(-1, nb, NVFP4_BLOCK), step.reshape(-1, nb), error=error, chunk_elements=chunk_elements
    )
    err_sq = ref_sq = None
    if err_rows is not None and ref_rows is not None:
        err_sq = err_rows.reshape(n, -1).sum(dim=1)
        ref_sq = ref_rows.reshape(n, -1).sum(dim=1)
    return StackedNvfp4(
        packed.reshape(*w.shape[:-1], w.shape[-1] // 2), block_scale, g, finite, regular, err_sq, ref_sq, convention
    )


def nvfp4_dequantize(
    q: Nvfp4Weight, dtype: torch.dtype = torch.bfloat16, *, formula: DequantFormula | None = None
) -> Tensor:
    """E2M1 values times the per-block step, computed in F32, cast to ``dtype``.

    ``formula``: ``"divide"`` = ``value * (scale / weight_global_scale)`` (compressed-tensors
    decompress); ``"multiply"`` = ``value * (scale * weight_scale_2)`` (ModelOpt dequantize and
    vLLM's emulation, which uses ``weight_scale_2 = fp32(1 / weight_global_scale)`` for a CT
    checkpoint). Default: the weight's own convention's formula.
    """
    if formula is None:
        formula = convention_rule(q.convention).formula
    s = q.block_scale.to(torch.float32)
    if formula == "divide":
        step = s / q.weight_global_scale.to(torch.float32)
    elif formula == "multiply":
        step = s * q.weight_scale_2.to(torch.float32)
    else:
        raise NumericsError(f"unknown dequantization formula {formula!r} (divide | multiply)")
    return decode_packed_blocks(q.packed, step, NVFP4_BLOCK, dtype)


# -- activations (vLLM's runtime quantization, emulated) --------------------------------------------
def _reciprocal_vllm(x: Tensor) -> Tensor:
    """vLLM ``get_reciprocal``: ``1 / (x + (x == 0) * 1e8)`` (so 0 -> 1e-8, not inf)."""
    return 1.0 / (x + (x == 0) * 1e8)


def nvfp4_quantize_activation(x: Tensor, input_global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM ``ref_nvfp4_quant``: per-16 block quantization of activations ``x`` ``[..., K]``.

    ``input_global_scale`` is the CT ``input_global_scale`` (2688/amax; = 1/ModelOpt
    ``input_scale``), F32. Returns (E2M1 values as F32 ``[..., K]``, block scales as F32
    ``[..., K/16]`` holding E4M3 values)::

        s   = e4m3(clamp(gs * (amax_blk * (1/6)), -448, 448))       # no zero replacement
        inv = 1 / (s * (1/gs))                                      # vLLM get_reciprocal twice
        q   = e2m1(clamp(x * inv, -6, 6))

    (``get_reciprocal(0)`` is 1e-8, so an all-zero block gives zeros.)
    """
    gs = input_global_scale.to(torch.float32)
    blocks = _blocks(x)
    amax_blk = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = gs * (amax_blk * (1.0 / E2M1_MAX))
    scale = scale.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    inv = _reciprocal_vllm(scale * _reciprocal_vllm(gs))
    nb = blocks.shape[-2]
    b2, i2 = blocks.reshape(-1, nb, NVFP4_BLOCK), inv.reshape(-1, nb, 1)
    values = torch.empty(b2.shape, dtype=torch.float32, device=x.device)
    for rows in row_chunks(b2.shape[0], nb * NVFP4_BLOCK):
        scaled = (b2[rows].to(torch.float32) * i2[rows]).clamp(-E2M1_MAX, E2M1_MAX)
        values[rows] = e2m1_decode(e2m1_encode(scaled), torch.float32)
    return values.reshape(x.shape), scale.squeeze(-1)


def nvfp4_fake_quantize_activation(x: Tensor, input_global_scale: Tensor) -> Tensor:
    """vLLM ``ref_nvfp4_quant_dequant`` (its CPU path): quantize, then ``value * (scale / gs)``,
    cast back to ``x.dtype``. For W4A4 emulation of activations."""
    values, scale = nvfp4_quantize_activation(x, input_global_scale)
    step = scale.unsqueeze(-1) / input_global_scale.to(torch.float32)
    values = values.unflatten(-1, (values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))
    return (values * step).flatten(-2).to(x.dtype)


def nvfp4_activation_fake_quantizer(amax: float) -> Callable[[Tensor], Tensor]:
    """W4A4 activation fake-quant for an input whose per-tensor amax is ``amax``: the CT input
    global scale :func:`ct_global_scale_from_amax`, then :func:`nvfp4_fake_quantize_activation`."""
    gs = ct_global_scale_from_amax(amax)
    return lambda x: nvfp4_fake_quantize_activation(x, gs)
