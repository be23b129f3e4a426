"""An NVFP4 linear kernel for platforms where vLLM has none (its CPU build lists no NVFP4 kernel).

Both compressed-tensors (``CompressedTensorsW4A4Fp4``) and ModelOpt (``ModelOptLinearMethod``)
obtain their kernel from ``init_nvfp4_linear_kernel``; we replace that factory in every module
that imported it by name. By the time the kernel sees the layer, both schemes have normalised it:
``weight`` (packed uint8), ``weight_scale`` (E4M3 per 16), ``weight_global_scale`` (the
multiplier: CT ``1/weight_global_scale``, ModelOpt ``weight_scale_2``) and, for W4A4,
``input_global_scale_inv`` (CT convention, 2688/amax). The numerics are vLLM's own emulation
functions, so this computes what ``EmulationNvFp4LinearKernel`` would, minus the per-call weight
dequantisation.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from fp4forge_vllm.settings import Numerics

NVFP4_BLOCK = 16
# Modules that bind ``init_nvfp4_linear_kernel`` by name at import time.
FACTORY_MODULES = (
    "vllm.model_executor.kernels.linear",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4",
    "vllm.model_executor.layers.quantization.modelopt",
)


def _model_dtype() -> torch.dtype:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return torch.get_default_dtype()
    return config.model_config.dtype


def make_kernel_class(numerics: Numerics) -> type:
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
        ref_nvfp4_quant_dequant,
    )

    class Fp4forgeNvFp4LinearKernel(NvFp4LinearKernel):
        """Dequantises the weight once at load; fake-quantises activations per call in ``w4a4``."""

        def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
            super().__init__(config)
            self.dtype = _model_dtype()

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        @classmethod
        def can_implement(cls, config) -> tuple[bool, str | None]:  # type: ignore[no-untyped-def]
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            weight = dequantize_to_dtype(
                layer.weight.data, layer.weight_scale.data, layer.weight_global_scale.data, self.dtype,
                NVFP4_BLOCK, swizzle=False,
            )
            del layer.weight
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            del layer.weight_scale
            # On the layer, not the kernel: nothing promises one kernel object per layer.
            # W4A16 checkpoints carry no input scale: there is nothing to emulate for them.
            layer.fp4forge_act_global_scale = (
                layer.input_global_scale_inv.data.float().reshape(1).clone()
                if numerics is Numerics.W4A4 and hasattr(layer, "input_global_scale_inv")
                else None
            )

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            act_global_scale = layer.fp4forge_act_global_scale
            if act_global_scale is not None:
                shape = x.shape
                x = ref_nvfp4_quant_dequant(x.reshape(-1, shape[-1]), act_global_scale, NVFP4_BLOCK).reshape(shape)
            return F.linear(x, layer.weight, bias)

    return Fp4forgeNvFp4LinearKernel


def patch_nvfp4_linear(numerics: Numerics) -> None:
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

    kernel_class = make_kernel_class(numerics)

    def init_nvfp4_linear_kernel(use_a16: bool = False):  # type: ignore[no-untyped-def]
        return kernel_class(NvFp4LinearLayerConfig())

    init_nvfp4_linear_kernel._fp4forge = True  # type: ignore[attr-defined]
    for module_name in FACTORY_MODULES:
        module = importlib.import_module(module_name)
        if not getattr(module.init_nvfp4_linear_kernel, "_fp4forge", False):
            module.init_nvfp4_linear_kernel = init_nvfp4_linear_kernel
