"""The plugin's switches: environment variables, read once per process.

Every vLLM process (API server, EngineCore, Worker) loads the plugin, so the switches travel as
environment variables, which all of them inherit. A value the plugin does not know is an error,
never a silent default: a typo must not serve other numerics than the ones asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

ENV_ENABLE = "FP4FORGE_VLLM_PLUGIN"
ENV_NUMERICS = "FP4FORGE_VLLM_NUMERICS"
ENV_MOE_INPUT_SCALE = "FP4FORGE_VLLM_MOE_INPUT_SCALE"
ENV_ALLOW_UNTESTED = "FP4FORGE_VLLM_ALLOW_UNTESTED"


class Numerics(str, Enum):
    """How the plugin computes the layers it takes over (NVFP4 linears, NVFP4 / FP8 experts)."""

    # Activations fake-quantised per 16-element block with the checkpoint's input global scale,
    # in linears and experts: what a fused W4A4 kernel (CUTLASS, FlashInfer) computes.
    W4A4 = "w4a4"
    # NVFP4 weights, activations left in the model dtype: what MARLIN and HUMMING compute for a
    # W4A4 checkpoint (they drop its activation scales). FP8 expert activations stay quantised.
    W4A16 = "w4a16"
    # Weights dequantised, no activation quantisation emulated anywhere the plugin computes.
    DEQUANT = "dequant"


class MoeInputScale(str, Enum):
    """How per-expert NVFP4 input scales become the scale that quantises an expert's input."""

    # Per expert, the larger of the gate/up amax: vLLM's own CUTLASS backend (VLLM_CUTLASS).
    PER_EXPERT = "per_expert"
    # One max over all experts: the FlashInfer backends (FLASHINFER_CUTLASS/TRTLLM/CUTEDSL).
    GLOBAL = "global"


class PluginSettingsError(ValueError):
    """An fp4forge-vllm environment variable holds a value the plugin cannot honour."""


@dataclass(frozen=True)
class Settings:
    enabled: bool
    numerics: Numerics
    moe_input_scale: MoeInputScale
    allow_untested: bool


def _choice(env: str, enum: type[Enum], default: Enum) -> Enum:
    raw = os.environ.get(env, "").strip().lower()
    if not raw:
        return default
    try:
        return enum(raw)
    except ValueError:
        allowed = ", ".join(member.value for member in enum)
        raise PluginSettingsError(f"fp4forge-vllm: {env}={raw!r} is not one of: {allowed}") from None


def _flag(env: str, default: bool) -> bool:
    raw = os.environ.get(env, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise PluginSettingsError(f"fp4forge-vllm: {env}={raw!r} is not a boolean (1/0)")


def read_settings() -> Settings:
    return Settings(
        enabled=_flag(ENV_ENABLE, True),
        numerics=_choice(ENV_NUMERICS, Numerics, Numerics.W4A4),  # type: ignore[arg-type]
        moe_input_scale=_choice(ENV_MOE_INPUT_SCALE, MoeInputScale, MoeInputScale.PER_EXPERT),  # type: ignore[arg-type]
        allow_untested=_flag(ENV_ALLOW_UNTESTED, False),
    )
