"""vLLM checks that exist for GPU kernels and that the plugin's CPU computation does not need.

ModelOpt configs accept only bfloat16/float16 activations (their GPU kernels' limit). On CPU the
plugin computes the NVFP4 layers itself and FP8 Linears through a float GEMM, so float32 works and
is what makes vLLM's tokens exactly comparable with a float32 reference.
"""

from __future__ import annotations

import torch

MODELOPT_CONFIGS = ("ModelOptFp8Config", "ModelOptNvFp4Config", "ModelOptMixedPrecisionConfig")


def allow_float32_modelopt() -> None:
    from vllm.model_executor.layers.quantization import modelopt

    for name in MODELOPT_CONFIGS:
        config_class = getattr(modelopt, name)
        original = config_class.get_supported_act_dtypes
        if getattr(original, "_fp4forge", False):
            continue

        def get_supported_act_dtypes(self, _original=original) -> list[torch.dtype]:  # type: ignore[no-untyped-def]
            dtypes = list(_original(self))
            return dtypes if torch.float32 in dtypes else [*dtypes, torch.float32]

        get_supported_act_dtypes._fp4forge = True  # type: ignore[attr-defined]
        config_class.get_supported_act_dtypes = get_supported_act_dtypes
