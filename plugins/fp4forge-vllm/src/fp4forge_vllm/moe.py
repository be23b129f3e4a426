"""NVFP4 routed experts where vLLM has no NVFP4 MoE backend.

vLLM's NVFP4 MoE methods pick a backend in ``__init__`` and raise ``NotImplementedError("No
NvFp4 MoE backend supports the deployment configuration.")`` on CPU. We subclass them
(compressed-tensors and ModelOpt), keep their ``create_weights`` so the checkpoint goes through
vLLM's own MoE weight loader under its own parameter names, and replace only backend selection,
post-load processing and the expert computation.

The subclass names keep "Compressed" / "ModelOpt": ``RoutedExperts.weight_loader`` branches on
those substrings of the method's class name.

The expert loop visits only the experts the batch routes to (``torch.unique(topk_ids)``): a
data-dependent loop that torch.compile cannot trace (``GuardOnDataDependentSymNode``). It is
therefore one opaque custom op, ``fp4forge::nvfp4_experts``, with a fake implementation for
tracing, so ``vllm serve`` works with and without ``--enforce-eager``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from fp4forge_vllm.settings import MoeInputScale, Numerics

NVFP4_BLOCK = 16


@dataclass(frozen=True)
class ConventionNames:
    """Where a convention keeps each tensor, and how its per-tensor scalars read."""

    w13_packed: str
    w2_packed: str
    w13_global: str
    w2_global: str
    w13_input: str
    w2_input: str
    # on-disk scalar -> dequantisation multiplier (amax/2688); also for input scales
    to_amax_over_2688: Callable[[torch.Tensor], torch.Tensor]


CONVENTIONS: dict[str, ConventionNames] = {
    # compressed-tensors stores 2688/amax ("global scale"); vLLM inverts it.
    "compressed-tensors": ConventionNames(
        "w13_weight_packed", "w2_weight_packed", "w13_weight_global_scale", "w2_weight_global_scale",
        "w13_input_global_scale", "w2_input_global_scale", lambda s: 1.0 / s.float(),
    ),
    # ModelOpt stores amax/2688 ("scale_2", "input_scale") directly.
    "modelopt": ConventionNames(
        "w13_weight", "w2_weight", "w13_weight_scale_2", "w2_weight_scale_2",
        "w13_input_scale", "w2_input_scale", lambda s: s.float(),
    ),
}

# Reduce per-expert input scales [E, shards] (amax/2688) to one per expert [E], as the backend
# whose behaviour we reproduce does (oracle/nvfp4.py, flashinfer_fp4_moe.py).
INPUT_SCALE_REDUCTIONS: dict[MoeInputScale, Callable[[torch.Tensor], torch.Tensor]] = {
    MoeInputScale.PER_EXPERT: lambda a: a.reshape(a.shape[0], -1).amax(dim=1),
    MoeInputScale.GLOBAL: lambda a: a.amax().expand(a.shape[0]).clone(),
}


def _model_dtype() -> torch.dtype:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return torch.get_default_dtype()
    return config.model_config.dtype


def _refuse_unsupported(moe, where: str) -> None:  # type: ignore[no-untyped-def]
    """What the plain expert loop below cannot honour."""
    reasons = {
        "tensor/expert/data parallel > 1": moe.moe_parallel_config.tp_size > 1
        or moe.moe_parallel_config.ep_size > 1
        or moe.moe_parallel_config.dp_size > 1,
        f"activation {moe.activation.value!r} (only gated silu)": moe.activation.value != "silu",
        "MoE bias terms": bool(moe.has_bias),
    }
    refused = [reason for reason, hit in reasons.items() if hit]
    if refused:
        raise NotImplementedError(f"fp4forge-vllm {where}: cannot serve {', '.join(refused)}")


@torch.library.custom_op("fp4forge::nvfp4_experts", mutates_args=())
def nvfp4_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_act_global_scale: Optional[torch.Tensor],
    w2_act_global_scale: Optional[torch.Tensor],
) -> torch.Tensor:
    """The routed experts of one MoE layer on dequantised weights; each GEMM input fake-quantised
    to NVFP4 with that expert's CT-convention global scale (2688/amax) when one is given."""
    scales = {"w13": w13_act_global_scale, "w2": w2_act_global_scale}

    def fake_quant(h: torch.Tensor, expert: int, gemm: str) -> torch.Tensor:
        scale = scales[gemm]
        if scale is None:
            return h
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant

        return ref_nvfp4_quant_dequant(h, scale[expert : expert + 1], NVFP4_BLOCK)

    return experts_forward(x, w13, w2, topk_weights, topk_ids, fake_quant)


@nvfp4_experts.register_fake
def _nvfp4_experts_fake(x, w13, w2, topk_weights, topk_ids, w13_act_global_scale, w2_act_global_scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fake_quant: Callable[[torch.Tensor, int, str], torch.Tensor],
) -> torch.Tensor:
    """Per expert: ``down(fq(silu(gate(fq(x))) * up(fq(x))))``, weighted and summed per token.

    ``fake_quant(h, expert, "w13" | "w2")`` returns ``h`` or its fake-quantised copy.
    """
    out = torch.zeros_like(x)
    intermediate = w13.shape[1] // 2
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.where(topk_ids == expert)
        h = fake_quant(x[tokens], expert, "w13")
        gate_up = F.linear(h, w13[expert])
        h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        h = F.linear(fake_quant(h, expert, "w2"), w2[expert])
        out.index_add_(0, tokens, (h * topk_weights[tokens, slots, None]).to(out.dtype))
    return out


class DequantExpertsMixin:
    """Shared body of the compressed-tensors and ModelOpt NVFP4 MoE methods."""

    convention: str
    numerics: Numerics
    moe_input_scale: MoeInputScale

    def _init_plugin(self, moe, use_a16: bool) -> None:  # type: ignore[no-untyped-def]
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

        FusedMoEMethodBase.__init__(self, moe)  # type: ignore[arg-type]
        _refuse_unsupported(moe, type(self).__name__)
        self.group_size = NVFP4_BLOCK
        self.use_a16 = use_a16
        self.use_global_sf = False  # one input-scale slot per local expert, as create_weights expects
        self.dtype = _model_dtype()

    @property
    def is_monolithic(self) -> bool:
        return False

    @property
    def supports_eplb(self) -> bool:
        return False

    def get_fused_moe_quant_config(self, layer):  # type: ignore[no-untyped-def]
        return None

    def process_weights_after_loading(self, layer) -> None:  # type: ignore[no-untyped-def]
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

        names = CONVENTIONS[self.convention]
        w13_mult = names.to_amax_over_2688(getattr(layer, names.w13_global).data)
        if w13_mult.ndim == 2 and not torch.equal(w13_mult[:, 0], w13_mult[:, -1]):
            # vLLM warns and uses w1's scale for the fused w13; so do we (fp4forge's docs/formats.md#fused-shards).
            from vllm.logger import init_logger

            init_logger(__name__).warning_once(
                "fp4forge-vllm: w1 and w3 NVFP4 global scales differ; using w1's for both, as vLLM does."
            )
        w13_mult = w13_mult.reshape(w13_mult.shape[0], -1)[:, 0].contiguous()
        w2_mult = names.to_amax_over_2688(getattr(layer, names.w2_global).data).reshape(-1)

        def dequant(packed: str, block_scale: str, mult: torch.Tensor) -> torch.Tensor:
            return dequantize_to_dtype(
                getattr(layer, packed).data, getattr(layer, block_scale).data, mult, self.dtype, NVFP4_BLOCK,
                swizzle=False,
            )

        # Both conventions name the E4M3 block scales w13_weight_scale / w2_weight_scale.
        w13 = dequant(names.w13_packed, "w13_weight_scale", w13_mult)
        w2 = dequant(names.w2_packed, "w2_weight_scale", w2_mult)
        act_scales = self._activation_scales(layer, names)
        for name in {names.w13_packed, names.w2_packed, names.w13_global, names.w2_global, names.w13_input,
                     names.w2_input, "w13_weight_scale", "w2_weight_scale"}:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        layer.fp4forge_act_global_scales = act_scales

    def _activation_scales(self, layer, names: ConventionNames) -> dict[str, torch.Tensor] | None:  # type: ignore[no-untyped-def]
        """Per-expert CT-convention global scales (2688/amax) for each GEMM input, or None."""
        if self.numerics is not Numerics.W4A4 or self.use_a16 or not hasattr(layer, names.w13_input):
            return None
        reduce = INPUT_SCALE_REDUCTIONS[self.moe_input_scale]
        # 1/amax-ratio computed in F32 as the fused kernels do (a1_gscale = 1 / a13_scale).
        return {
            "w13": 1.0 / reduce(names.to_amax_over_2688(getattr(layer, names.w13_input).data)),
            "w2": 1.0 / reduce(names.to_amax_over_2688(getattr(layer, names.w2_input).data)),
        }

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):  # type: ignore[no-untyped-def]
        # Shared experts (if any) were already run by the runner: moe_kernel is None here.
        if layer.apply_router_weight_on_input:
            raise NotImplementedError("fp4forge-vllm: apply_router_weight_on_input is not supported")
        scales = layer.fp4forge_act_global_scales or {}
        return nvfp4_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, scales.get("w13"), scales.get("w2")
        )


def make_method_classes(numerics: Numerics, moe_input_scale: MoeInputScale) -> dict[str, type]:
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4,
    )

    class Fp4forgeCompressedTensorsNvfp4MoEMethod(DequantExpertsMixin, ct_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod):
        convention = "compressed-tensors"

        def __init__(self, moe, layer_name=None, use_a16: bool = False) -> None:  # type: ignore[no-untyped-def]
            self._init_plugin(moe, use_a16)

    class Fp4forgeModelOptNvFp4FusedMoE(DequantExpertsMixin, modelopt.ModelOptNvFp4FusedMoE):
        convention = "modelopt"

        def __init__(self, quant_config, moe_config) -> None:  # type: ignore[no-untyped-def]
            if quant_config.moe_activation_override is not None:
                raise NotImplementedError(
                    "fp4forge-vllm: ModelOpt per-token NVFP4 MoE activations "
                    f"({quant_config.moe_activation_override}) are not emulated"
                )
            self.quant_config = quant_config
            self.per_token_activation = False
            self._init_plugin(moe_config, use_a16=quant_config.quant_method == "W4A16_NVFP4")

    classes: dict[str, type] = {
        "compressed-tensors": Fp4forgeCompressedTensorsNvfp4MoEMethod,
        "modelopt": Fp4forgeModelOptNvFp4FusedMoE,
    }
    for cls in classes.values():
        cls.numerics = numerics
        cls.moe_input_scale = moe_input_scale
    return classes


def patch_nvfp4_moe(numerics: Numerics, moe_input_scale: MoeInputScale) -> None:
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4,
    )

    if getattr(ct_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod, "fp4forge_plugin", False):
        return
    classes = make_method_classes(numerics, moe_input_scale)
    for cls in classes.values():
        cls.fp4forge_plugin = True
    # get_moe_method imports the CT class from its module at call time; ModelOpt's mixed-precision
    # config looks its class up as a module global, the single-algo config via FusedMoEMethodCls.
    ct_nvfp4.CompressedTensorsW4A4Nvfp4MoEMethod = classes["compressed-tensors"]
    modelopt.ModelOptNvFp4FusedMoE = classes["modelopt"]
    modelopt.ModelOptNvFp4Config.FusedMoEMethodCls = classes["modelopt"]
