"""The two conventions of NVFP4's per-tensor scalar, as objects (docs/formats.md#nvfp4).

Both store the same packed codes and E4M3 block scales; they differ only in the per-tensor
scalar and the formulas it enters:

* compressed-tensors: ``weight_global_scale = 2688 / amax`` (F32 ``[1]``), the block step is
  ``scale / global`` ("divide");
* ModelOpt: ``weight_scale_2 = amax / 2688`` (F32 ``[]``), the step is ``scale * scale_2``
  ("multiply").

Every NVFP4 function takes the convention by name and asks :func:`convention_rule` for its
object, so the difference lives here once instead of in an ``if`` per formula.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import E2M1_MAX, NumericsError
from fp4forge.numerics.fp8 import FP8_E4M3_MAX

Convention = Literal["compressed-tensors", "modelopt"]
DequantFormula = Literal["divide", "multiply"]

CT_ZERO_SCALE = 0.125  # compressed-tensors eps for an FP8 scale
_CT_ZERO_SCALE_BITS = int(torch.tensor(CT_ZERO_SCALE).to(torch.float8_e4m3fn).view(torch.uint8))  # 0x20
MODELOPT_ZERO_SCALE = 1.0  # ModelOpt: an all-zero block gets scale 1.0
MODELOPT_MIN_SCALE = 2.0**-9  # ModelOpt clamps block scales at the smallest E4M3 subnormal
_NUMERATOR = FP8_E4M3_MAX * E2M1_MAX  # 2688 (numerics/nvfp4.py's NVFP4_GLOBAL_NUMERATOR)


def ct_global_scales(a: Tensor, fp8_max: float) -> Tensor:
    """compressed-tensors ``generate_gparam`` elementwise, any shape: ``(fp8_max * 6) / amax`` in
    amax's dtype, amax clamped to that dtype's ``tiny``, NaN/Inf -> 1.0; F32, same shape."""
    if not a.is_floating_point():
        a = a.to(torch.float32)
    a = a.abs().clamp(min=torch.finfo(a.dtype).tiny)
    g = (fp8_max * E2M1_MAX) / a
    g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
    return g.to(torch.float32)


def modelopt_scales_2(a: Tensor, fp8_max: float) -> Tensor:
    """ModelOpt ``get_weights_scaling_factor_2`` elementwise: ``float32(amax) / (6 * fp8_max)``."""
    return a.float() / (E2M1_MAX * fp8_max)


class CompressedTensorsScalar:
    """``weight_global_scale = 2688 / amax``; step = ``scale / global``."""

    name: Convention = "compressed-tensors"
    scalar_shape: tuple[int, ...] = (1,)
    formula: DequantFormula = "divide"
    kernel_mode = 0  # the C kernel's convention switch (nvfp4_minmax.c)

    def scalars(self, amax: Tensor, fp8_max: float) -> Tensor:
        return ct_global_scales(amax, fp8_max)

    def input_scalar(self, amax: float) -> Tensor:
        """The activation's stored per-tensor scalar (``input_global_scale = 2688/amax``), F32."""
        return ct_global_scales(torch.as_tensor(amax), FP8_E4M3_MAX)

    def amax_of(self, scalar: float) -> float:
        """The amax a stored per-tensor scalar stands for, in float64."""
        return _NUMERATOR / scalar

    def step_multiplier(self, scalar: float) -> float:
        """What the per-tensor scalar multiplies a block step by, in float64."""
        return 1.0 / scalar if scalar != 0 else math.copysign(math.inf, scalar)  # 1/0 as IEEE says, not ZeroDivisionError

    def raw_block_scales(self, amax_blk: Tensor, g: Tensor) -> Tensor:
        # ``amax_blk / 6`` in amax_blk's dtype, as CT; ``g`` F32 and never 0-dim (a 0-dim F32
        # tensor would not promote a bf16 product to F32)
        return g * (amax_blk / E2M1_MAX)

    def finish_block_scales(self, raw: Tensor) -> Tensor:
        s = raw.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        # a scale that rounded to +-0 (E4M3 bits 0x00 / 0x80) becomes 0.125 (bits 0x20)
        return s.masked_fill_((s & 0x7F) == 0, _CT_ZERO_SCALE_BITS).view(torch.float8_e4m3fn)

    def step(self, block_scale_f32: Tensor, g: Tensor) -> Tensor:
        return block_scale_f32 / g

    def stretched(self, g: Tensor, factor: float) -> Tensor:
        """The scalar whose step is ``factor`` times ``g``'s (the global scale divides the step)."""
        return g / factor

    def kernel_divisor(self, g: Tensor) -> Tensor:
        """The C kernel's second scalar (unused by this convention)."""
        return g

    def ct_global(self, g: Tensor) -> Tensor:
        return g

    def scale_2(self, g: Tensor) -> Tensor:
        return (1.0 / g.to(torch.float32)).reshape(())

    def adopt(self, g: Tensor, source: ScalarRule) -> Tensor:
        """This convention's scalar for ``g``, a scalar of ``source``'s (1/x in F32 across)."""
        return source.ct_global(g)


class ModelOptScalar:
    """``weight_scale_2 = amax / 2688``; step = ``scale * scale_2``."""

    name: Convention = "modelopt"
    scalar_shape: tuple[int, ...] = ()
    formula: DequantFormula = "multiply"
    kernel_mode = 1

    def input_scalar(self, amax: float) -> Tensor:
        """``input_scale = amax / 2688``, F32 (no zero rule: ModelOpt's own formula)."""
        return modelopt_scales_2(torch.as_tensor(amax), FP8_E4M3_MAX)

    def amax_of(self, scalar: float) -> float:
        return scalar * _NUMERATOR

    def step_multiplier(self, scalar: float) -> float:
        return scalar

    def scalars(self, amax: Tensor, fp8_max: float) -> Tensor:
        s2 = modelopt_scales_2(amax, fp8_max)
        # ModelOpt would divide 0/0 for an all-zero weight (NaN scales): the CT fallback 1.0 instead
        return torch.where(s2 == 0.0, torch.ones_like(s2), s2)

    def raw_block_scales(self, amax_blk: Tensor, g: Tensor) -> Tensor:
        return amax_blk.float() / (E2M1_MAX * g)

    def finish_block_scales(self, raw: Tensor) -> Tensor:
        # (the 448 clamp is ours: ModelOpt has none, which only matters when a supplied global
        # amax is below a block's amax; torch's CPU cast saturates there too, others may give NaN)
        s = torch.where(raw == 0, torch.full_like(raw, MODELOPT_ZERO_SCALE), raw)
        return s.clamp(MODELOPT_MIN_SCALE, FP8_E4M3_MAX).to(torch.float8_e4m3fn)

    def step(self, block_scale_f32: Tensor, g: Tensor) -> Tensor:
        return block_scale_f32 * g

    def stretched(self, g: Tensor, factor: float) -> Tensor:
        return g * factor

    def kernel_divisor(self, g: Tensor) -> Tensor:
        """ModelOpt's divisor ``6 * scale_2``, computed by torch exactly as the eager path does."""
        return (6.0 * g).reshape(())

    def ct_global(self, g: Tensor) -> Tensor:
        return (1.0 / g.to(torch.float32)).reshape(1)

    def scale_2(self, g: Tensor) -> Tensor:
        return g

    def adopt(self, g: Tensor, source: ScalarRule) -> Tensor:
        return source.scale_2(g)


ScalarRule = CompressedTensorsScalar | ModelOptScalar
CONVENTIONS: dict[str, ScalarRule] = {rule.name: rule for rule in (CompressedTensorsScalar(), ModelOptScalar())}


def convention_rule(convention: str) -> ScalarRule:
    """The object of a convention name; a named error for any other name."""
    rule = CONVENTIONS.get(convention)
    if rule is None:
        raise NumericsError(f"unknown NVFP4 convention {convention!r} ({' | '.join(CONVENTIONS)})")
    return rule
