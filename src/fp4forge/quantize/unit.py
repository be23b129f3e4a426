"""One work unit's arithmetic: read its tensors, encode its Linears by their scheme's codec.

A work unit is a fused group of Linears sharing a global scale, one Linear, or a pass-through
tensor (``quantize/plan.py``). Both schedules (``schedule_cpu.py``, ``schedule_device.py``) hand
units here or, for stacked NVFP4, use :meth:`UnitQuantizer.named` / :meth:`UnitQuantizer.input_scale`
for the same names and input scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp4forge.checkpoint.codecs import EncodeOptions, codec, torch_dtypes
from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.checkpoint.schemes import kv_role_names
from fp4forge.errors import ConfigError
from fp4forge.model.device import resolve_device
from fp4forge.numerics.fp8 import FP8_E4M3_MAX
from fp4forge.numerics.nvfp4_kernel import kernel_status
from fp4forge.quantize.options import QuantizeOptions
from fp4forge.quantize.plan import WorkUnit


@dataclass
class LinearError:
    module: str
    component: str
    scheme: str
    relative_error: float


@dataclass
class ReadUnit:
    unit: WorkUnit
    passthrough: dict[str, bytes]
    weights: dict[str, torch.Tensor]
    nbytes: int


#: What a schedule yields per unit: the unit, its tensors by name, its Linears' errors, bytes read.
UnitResult = tuple[WorkUnit, dict[str, Any], list[LinearError], int]


class UnitQuantizer:
    """Quantizes one work unit; pure apart from reading tensors through `read`."""

    def __init__(self, options: QuantizeOptions):
        self.options = options
        self.layout = options.layout_format
        self.device = resolve_device(options.device)
        self.encoding = EncodeOptions(options.block_scales, options.error_report)

    def _input_amax(self, modules: list[str]) -> float:
        act = self.options.act_amax
        if act is None:
            raise ConfigError("W4A4 / static FP8 need activation scales: calibration statistics or an explicit constant amax", option="act_amax")
        return max(act.input_amax(m) for m in modules)  # fused shards share their input

    def input_scale(self, unit: WorkUnit) -> torch.Tensor | None:
        """The unit's shared input scale where its scheme stores one in this layout."""
        scheme_codec = codec(unit.linears[0].scheme)
        if not scheme_codec.has_input_scale(self.layout):
            return None
        return scheme_codec.input_scale(self._input_amax([t.module for t in unit.linears]), self.layout)

    def named(self, scheme: str, module: str, by_role: dict[str, torch.Tensor], input_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """A Linear's tensors by role -> by their names in this layout (input scale last)."""
        roles = codec(scheme).roles(self.layout)
        out = {f"{module}.{roles[role]['suffix']}": tensor for role, tensor in by_role.items()}
        if input_scale is not None:
            out[f"{module}.{roles['input_scale']['suffix']}"] = input_scale
        return out

    def quantize(self, unit: WorkUnit, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[LinearError]]:
        scheme = unit.linears[0].scheme
        modules = [t.module for t in unit.linears]
        input_scale = self.input_scale(unit)
        pre = self.options.precomputed
        precomputed = [pre.weights.get(m) for m in modules] if pre is not None else None
        encoded = codec(scheme).encode([weights[m] for m in modules], self.layout, self.encoding, precomputed)
        out: dict[str, torch.Tensor] = {}
        errors: list[LinearError] = []
        for target, linear in zip(unit.linears, encoded):
            out.update(self.named(scheme, target.module, linear.tensors, input_scale))
            if linear.relative_error is not None:
                errors.append(LinearError(target.module, target.component, scheme, linear.relative_error))
        return out, errors

    def kv_scales(self, layer_prefix: str) -> dict[str, torch.Tensor]:
        act = self.options.act_amax
        if act is None:
            raise ConfigError("an FP8 KV cache needs k/v scales: calibration statistics or an explicit constant amax", option="act_amax")
        k_amax, v_amax = act.kv_amax(layer_prefix)
        names = kv_role_names(self.layout, layer_prefix)
        out = {}
        for role, amax in (("k_scale", k_amax), ("v_scale", v_amax)):
            spec = names[role]
            value = torch.tensor([amax], dtype=torch.float32) / FP8_E4M3_MAX
            out[spec.name] = value.to(torch_dtypes()[spec.dtype]).reshape(spec.shape)
        return out


def read_unit(unit: WorkUnit, ckpt: Checkpoint, pin: bool = False) -> ReadUnit:
    """Read one unit's tensors (pass-through tensors as raw bytes, Linears as tensors; in
    page-locked host memory with ``pin``, for a fast copy to a CUDA device)."""
    passthrough = {name: ckpt.read_raw(name) for name in unit.passthrough}
    if pin:
        from fp4forge.model.streaming import CheckpointTensors

        reader = CheckpointTensors(ckpt)
        weights = {t.module: reader.read_host(f"{t.module}.weight", True) for t in unit.linears}
    else:
        weights = {t.module: ckpt.read_tensor(f"{t.module}.weight") for t in unit.linears}
    nbytes = sum(len(b) for b in passthrough.values()) + sum(w.numel() * w.element_size() for w in weights.values())
    return ReadUnit(unit, passthrough, weights, nbytes)


def quantize_unit(read: ReadUnit, quantizer: UnitQuantizer, device: torch.device | None = None) -> UnitResult:
    tensors: dict[str, Any] = dict(read.passthrough)
    errors: list[LinearError] = []
    if read.unit.linears:
        device = device or quantizer.device
        pin = device.type == "cuda"
        weights = {m: w.to(device, non_blocking=pin) for m, w in read.weights.items()}
        quantized, errors = quantizer.quantize(read.unit, weights)
        tensors.update({name: value.cpu() for name, value in quantized.items()})  # the writer takes host tensors
    return read.unit, tensors, errors, read.nbytes


def element_kernel(quantizer: UnitQuantizer) -> str:
    """The CPU path's NVFP4 min-max element kernel, for the summary (the bytes do not depend on it)."""
    if quantizer.device.type != "cpu":
        return ""
    status = kernel_status()
    return f"{status.name}: {status.detail}"
