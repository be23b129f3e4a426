"""FP8 casts and FP8 (E4M3FN) W8A8 weight quantization (docs/formats.md#fp8-e4m3).

Formulas are those of compressed-tensors 0.17 as llm-compressor drives it (``calculate_qparams``
then the ``float-quantized`` compressor), computed in the *weight's own dtype* exactly as there:

    amax  = max |W| over the tensor / the row / the 128x128 block        (in W.dtype)
    scale = amax / 448                                                     (in W.dtype)
    scale = finfo(W.dtype).eps where scale == 0                            (CT ``_get_dtype_eps``)
    q     = e4m3fn(clamp(W / scale + 0, -448, 448))                        (division in W.dtype)
    W'    = q.to(scale.dtype) * scale                                      (CT decompress)

For a bf16 weight the division ``W / scale`` is rounded to bf16 before the cast to E4M3, as in
compressed-tensors. ``+ 0`` is the symmetric zero point llm-compressor registers and CT adds:
it turns an exact ``-0.0`` into ``+0`` (0x00), while tiny negative values still give 0x80.

Row chunks: per-channel results never depend on other rows; per-tensor results are identical
when every chunk gets the whole tensor's ``amax``; block results are identical when chunks start
at multiples of the block height.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fp4forge.numerics.e2m1 import NumericsError

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_E4M3_NAN_BITS",
    "FP8_E5M2_MAX",
    "E4M3_ROUNDINGS",
    "E4M3Rounding",
    "Fp8Strategy",
    "Fp8Weight",
    "e4m3_toward_zero",
    "fp8_activation_fake_quantizer",
    "fp8_amax_from_scale",
    "fp8_dequantize_weight",
    "fp8_dynamic_fake_quantize",
    "fp8_dynamic_scale",
    "fp8_fake_quantize",
    "fp8_fake_quantize_reciprocal",
    "fp8_quantize_activation",
    "fp8_quantize_weight",
    "fp8_scale_from_amax",
    "fp8_weight_amax",
    "to_e4m3fn",
    "to_e5m2",
]

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_E4M3_NAN_BITS = 0x7F  # E4M3FN: S.1111.111 is NaN (low seven bits all set); there is no Inf
FP8_E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max

Fp8Strategy = Literal["tensor", "channel", "block"]
DEFAULT_BLOCK = (128, 128)


def to_e4m3fn(x: Tensor, *, saturate: bool = True) -> Tensor:
    """Round to ``float8_e4m3fn`` (RNE). ``saturate`` clamps to +-448 first (so +-inf -> +-448).

    NaN stays NaN. Without saturation the cast is torch's own (which on CPU also saturates).
    """
    if saturate:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(torch.float8_e4m3fn)


def to_e5m2(x: Tensor, *, saturate: bool = True) -> Tensor:
    """Round to ``float8_e5m2`` (RNE). ``saturate`` clamps to +-57344 first; otherwise overflow
    gives +-inf (torch's cast). NaN stays NaN."""
    if saturate:
        x = x.clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX)
    return x.to(torch.float8_e5m2)


def _eps(dtype: torch.dtype) -> float:
    """compressed-tensors ``_get_dtype_eps``: what a zero scale is replaced with."""
    if dtype == torch.float8_e4m3fn:
        return 0.125
    return torch.finfo(dtype).eps


def fp8_amax_from_scale(scale: float) -> float:
    """The amax an FP8 per-tensor scale (``amax / 448``) stands for, in float64."""
    return scale * FP8_E4M3_MAX


def fp8_scale_from_amax(amax: Tensor) -> Tensor:
    """``amax / 448`` in ``amax``'s dtype, zeros replaced by that dtype's eps (CT ``calculate_qparams``).

    Also the formula for FP8 static ``input_scale`` and KV ``k_scale``/``v_scale`` (amax/448).
    """
    if not amax.is_floating_point():
        raise NumericsError(f"amax must be a float tensor, got {amax.dtype}")
    scale = amax.abs() / FP8_E4M3_MAX
    return torch.where(scale == 0, torch.tensor(_eps(scale.dtype), dtype=scale.dtype, device=scale.device), scale)


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 W8A8 weight as compressed-tensors ``float-quantized`` stores it.

    ``weight``: float8_e4m3fn, the input's shape. ``scale``: the input's dtype; shape ``[1]``
    (tensor), ``[out, 1]`` (channel) or ``[ceil(out/bh), ceil(in/bw)]`` (block).
    """

    weight: Tensor
    scale: Tensor
    strategy: Fp8Strategy
    block_size: tuple[int, int] | None = None

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return fp8_dequantize_weight(self, dtype)


def _check_weight(w: Tensor, strategy: str) -> None:
    if not w.is_floating_point():
        raise NumericsError(f"FP8 quantization needs a float weight, got {w.dtype}")
    if strategy in ("channel", "block") and w.ndim != 2:
        raise NumericsError(f"FP8 {strategy} quantization needs a 2-D [out, in] weight, got {list(w.shape)}")
    if strategy not in ("tensor", "channel", "block"):
        raise NumericsError(f"unknown FP8 strategy {strategy!r} (tensor | channel | block)")


def _pad_to_blocks(w: Tensor, block: tuple[int, int]) -> Tensor:
    bh, bw = block
    pad_r = (-w.shape[0]) % bh
    pad_c = (-w.shape[1]) % bw
    if pad_r or pad_c:
        w = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    return w


def _as_blocks(w: Tensor, block: tuple[int, int]) -> Tensor:
    """[R, C] (padded to multiples) -> [R/bh, C/bw, bh, bw] view-ish."""
    bh, bw = block
    r, c = w.shape
    return w.reshape(r // bh, bh, c // bw, bw).transpose(1, 2)


def fp8_weight_amax(w: Tensor, strategy: Fp8Strategy = "tensor", block_size: tuple[int, int] = DEFAULT_BLOCK) -> Tensor:
    """max |W| in ``w``'s dtype: ``[1]`` (tensor), ``[out, 1]`` (channel) or per block."""
    if strategy == "tensor":
        return w.abs().amax().reshape(1)
    if strategy == "channel":
        return w.abs().amax(dim=-1, keepdim=True)
    return _as_blocks(_pad_to_blocks(w, block_size), block_size).abs().amax(dim=(-2, -1))


def fp8_quantize_weight(
    w: Tensor,
    strategy: Fp8Strategy = "tensor",
    *,
    amax: Tensor | float | None = None,
    scale: Tensor | None = None,
    block_size: tuple[int, int] = DEFAULT_BLOCK,
) -> Fp8Weight:
    """Quantize a weight to FP8 E4M3FN with an ``amax/448`` scale (compressed-tensors formulas).

    ``amax`` (tensor strategy only) overrides the tensor's own max |W|: pass the whole tensor's
    amax when quantizing it in row chunks. ``scale`` overrides the scale entirely (it must have
    the strategy's shape). Arithmetic is in ``w.dtype`` (see the module docstring).
    """
    _check_weight(w, strategy)
    dtype = w.dtype
    own_amax = fp8_weight_amax(w, strategy, block_size)
    if not bool(torch.isfinite(own_amax).all()):  # NaN/Inf propagate into the maxima
        raise NumericsError("weight holds NaN or Inf; refusing to quantize it")
    if scale is None:
        if amax is not None:
            if strategy != "tensor":
                raise NumericsError("an explicit amax is only meaningful for the per-tensor strategy")
            amax_t = torch.as_tensor(amax, device=w.device).to(dtype).reshape(1)
        else:
            amax_t = own_amax
        scale = fp8_scale_from_amax(amax_t)
    else:
        scale = scale.to(dtype)

    if strategy == "block":
        rows, cols = w.shape
        blocks = _as_blocks(_pad_to_blocks(w, block_size), block_size)  # [nr, nc, bh, bw]
        scaled = blocks / scale[:, :, None, None]
        scaled = scaled + torch.zeros((), dtype=dtype, device=w.device)  # CT's symmetric zero point
        q = to_e4m3fn(scaled)
        nr, nc, bh, bw = q.shape
        q = q.transpose(1, 2).reshape(nr * bh, nc * bw)[:rows, :cols].contiguous()
        return Fp8Weight(q, scale, "block", tuple(block_size))

    scaled = w / scale  # [1] or [out, 1] broadcast
    scaled = scaled + torch.zeros((), dtype=dtype, device=w.device)  # CT's symmetric zero point
    return Fp8Weight(to_e4m3fn(scaled), scale, strategy, None)


def fp8_dequantize_weight(q: Fp8Weight, dtype: torch.dtype | None = None) -> Tensor:
    """``q.to(scale.dtype) * scale`` (compressed-tensors decompress), then cast to ``dtype``."""
    sdt = q.scale.dtype
    if q.strategy == "block":
        assert q.block_size is not None
        bh, bw = q.block_size
        rows, cols = q.weight.shape
        nr, nc = math.ceil(rows / bh), math.ceil(cols / bw)
        expanded = q.scale.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]
        if q.scale.shape != (nr, nc):
            raise NumericsError(f"block scale shape {list(q.scale.shape)} does not fit weight {list(q.weight.shape)}")
        out = q.weight.to(sdt) * expanded
    else:
        out = q.weight.to(sdt) * q.scale
    return out if dtype is None else out.to(dtype)


# -- activations and the KV cache (the runtime's rounding, emulated) ------------------------------
E4M3Rounding = Literal["nearest", "toward_zero"]


def e4m3_toward_zero(x: Tensor) -> Tensor:
    """E4M3 of ``x`` rounded toward zero (saturating at +-448): the nearest code, stepped down one
    where it overshot. vLLM's CPU KV-cache kernel rounds this way."""
    x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    bits = x.to(torch.float8_e4m3fn).view(torch.uint8)
    magnitude, sign = bits & 0x7F, bits & 0x80
    overshot = bits.view(torch.float8_e4m3fn).to(x.dtype).abs() > x.abs()
    return ((magnitude - overshot.to(torch.uint8)) | sign).view(torch.float8_e4m3fn)


E4M3_ROUNDINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "nearest": to_e4m3fn,
    "toward_zero": e4m3_toward_zero,
}


def fp8_fake_quantize(x: Tensor, scale: Tensor, *, rounding: E4M3Rounding = "nearest") -> Tensor:
    """``x`` through E4M3 with a static scale and back: ``e4m3(x / scale) * scale``, in F32, cast
    to ``x.dtype``. ``scale`` broadcasts (per tensor, per token, per KV head)."""
    if rounding not in E4M3_ROUNDINGS:
        raise NumericsError(f"unknown E4M3 rounding {rounding!r} ({' | '.join(E4M3_ROUNDINGS)})")
    q = E4M3_ROUNDINGS[rounding](x.to(torch.float32) / scale)
    return (q.to(torch.float32) * scale).to(x.dtype)


def fp8_fake_quantize_reciprocal(x: Tensor, scale: Tensor) -> Tensor:
    """As :func:`fp8_fake_quantize`, but ``x * (1/scale)`` as vLLM's ``QuantFP8`` computes it (not
    always the same float as ``x / scale``)."""
    q = to_e4m3fn(x.to(torch.float32) * scale.reciprocal())
    return (q.to(torch.float32) * scale).to(x.dtype)


def fp8_dynamic_scale(x: Tensor, *, per_token: bool = True) -> Tensor:
    """A dynamic FP8 activation scale: ``max |x| / 448`` per token (``[..., 1]``) or per tensor
    (``[]``), in F32 and at least ``tiny``. No host synchronisation, so a CUDA graph can hold it."""
    amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
    return (amax.to(torch.float32) / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def fp8_quantize_activation(x: Tensor, scale: Tensor) -> Tensor:
    """The E4M3 codes a W8A8 layer feeds its GEMM: ``e4m3(x / scale)`` in F32, saturating."""
    return to_e4m3fn(x.to(torch.float32) / scale)


def fp8_dynamic_fake_quantize(x: Tensor) -> Tensor:
    """Per-token dynamic FP8: each row's scale is ``max |row| / 448`` (F32, at least ``tiny``)."""
    return fp8_fake_quantize(x, fp8_dynamic_scale(x))


def fp8_activation_fake_quantizer(amax: float) -> Callable[[Tensor], Tensor]:
    """Static FP8 activation fake-quant for an input whose calibrated amax is ``amax``
    (scale ``amax / 448`` in F32)."""
    scale = torch.tensor(amax / FP8_E4M3_MAX, dtype=torch.float32)
    return lambda x: fp8_fake_quantize(x, scale)
