"""The streaming exporter behind `fp4forge quantize`.

One work unit at a time (a fused group of Linears sharing a global scale, one Linear, or one
pass-through tensor): read its BF16 tensors, quantize, write them at their planned offsets,
journal the unit, free it. Peak memory is one unit, whatever the model's depth. The output
appears only when complete; a killed run leaves `.OUT.partial/` with its journal, and the same
command continues from there and produces the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args

import torch

from fp4forge import __version__
from fp4forge.checkpoint.layout import Layout, layout_for_config
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.checkpoint.schemes import kv_role_names, role_suffixes
from fp4forge.checkpoint.names import CONFIG_JSON, HF_QUANT_CONFIG_JSON, INDEX_JSON, PROVENANCE_JSON
from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError, require_choice
from fp4forge.numerics.fp8 import FP8_E4M3_MAX, fp8_dequantize_weight, fp8_quantize_weight
from fp4forge.numerics.nvfp4 import nvfp4_global_scale, nvfp4_scale_2
from fp4forge.numerics.scale_search import relative_error, search_nvfp4
from fp4forge.quantize.act_scales import ConstantAmax, StatsAmax
from fp4forge.quantize.plan import ExportPlan, WorkUnit, plan_export
from fp4forge.quantize.qconfig import compressed_tensors_config, modelopt_configs
from fp4forge.quantize.recipe import Recipe

CONVENTION = {"compressed-tensors": "compressed-tensors", "modelopt": "modelopt"}
# Files the exporter writes itself; every other non-weight file of the source is copied.
REWRITTEN = {CONFIG_JSON, INDEX_JSON, PROVENANCE_JSON, HF_QUANT_CONFIG_JSON}

Progress = Callable[[int, int, str], None]
LayoutFormat = Literal["compressed-tensors", "modelopt"]
BlockScales = Literal["minmax", "four_over_six", "mse"]
LAYOUT_FORMATS: tuple[str, ...] = get_args(LayoutFormat)
BLOCK_SCALES: tuple[str, ...] = get_args(BlockScales)


@dataclass(frozen=True)
class QuantizeOptions:
    recipe: Recipe
    layout_format: LayoutFormat = "compressed-tensors"
    block_scales: BlockScales = "minmax"  # minmax is identical to the reference exporters
    act_amax: ConstantAmax | StatsAmax | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    workers: int = max(1, os.cpu_count() or 1)  # units quantized concurrently (bytes do not depend on it)
    # Precomputed NVFP4 weights (GPTQ: calibrate/gptq.py) written instead of the block-scale rule's;
    # anything with ``.weights: dict[module, Nvfp4Weight]`` and ``.provenance() -> dict``.
    precomputed: Any = None

    def __post_init__(self) -> None:
        require_choice(self.layout_format, LAYOUT_FORMATS, "layout_format")
        require_choice(self.block_scales, BLOCK_SCALES, "block_scales")


@dataclass
class LinearError:
    module: str
    component: str
    scheme: str
    relative_error: float


@dataclass
class ExportSummary:
    output: str
    layout_format: str
    recipe: str
    tensors_written: int
    bytes_read: int
    bytes_written: int
    seconds: float
    resumed_units: int
    weight_error: dict[str, Any] = field(default_factory=dict)

    @property
    def read_gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "read_gb_per_s": self.read_gb_per_s}


def _source_specs(ckpt: Checkpoint) -> list[TensorSpec]:
    return [TensorSpec(info.name, info.dtype, info.shape) for _, info in ckpt.tensors()]


def _check_source(ckpt: Checkpoint) -> None:
    if ckpt.config is None:
        raise ConfigError("source has no config.json", file=ckpt.display)
    if ckpt.config.get("quantization_config") or HF_QUANT_CONFIG_JSON in ckpt.extra_json:
        raise ConfigError("source is already quantized; fp4forge quantizes BF16/F16/F32 checkpoints", file=ckpt.display)


def linear_names(specs: list[TensorSpec], layout: Layout) -> list[str]:
    """Every 2-D `.weight` module that a layout component owns (the Linears a config can name)."""
    out = []
    for spec in specs:
        if spec.name.endswith(".weight") and len(spec.shape) == 2:
            module = spec.name[: -len(".weight")]
            if layout.component_of(module) not in ("unknown", "embeddings", "norms"):
                out.append(module)
    return out


def _needs_act_scales(plan: ExportPlan) -> bool:
    return any(t.scheme in ("nvfp4", "fp8") for t in plan.targets.values()) or bool(plan.kv_layers)


def resume_key(plan: ExportPlan, options: QuantizeOptions, source_digest: str) -> str:
    material = {
        "fp4forge": __version__,
        "specs": [(s.name, s.dtype, list(s.shape)) for s in plan.output_specs],
        "recipe": options.recipe.text,
        "layout": options.layout_format,
        "block_scales": options.block_scales,
        "act": options.act_amax.provenance() if options.act_amax else None,
        "source": source_digest,
        "max_shard_bytes": options.max_shard_bytes,
    }
    if options.precomputed is not None:
        # the codes themselves: a resumed run must use the same GPTQ result
        digest = hashlib.blake2b(digest_size=16)
        for module in sorted(options.precomputed.weights):
            q = options.precomputed.weights[module]
            digest.update(module.encode())
            digest.update(q.packed.numpy().tobytes())
            digest.update(q.block_scale.view(torch.uint8).numpy().tobytes())
            digest.update(q.global_scale.numpy().tobytes())
        material["precomputed"] = digest.hexdigest()
    return hashlib.blake2b(json.dumps(material, sort_keys=True).encode(), digest_size=16).hexdigest()


class UnitQuantizer:
    """Quantizes one work unit; pure apart from reading tensors through `read`."""

    def __init__(self, options: QuantizeOptions):
        self.options = options
        self.convention = CONVENTION[options.layout_format]

    def _input_amax(self, modules: list[str]) -> float:
        act = self.options.act_amax
        if act is None:
            raise ConfigError("W4A4 / static FP8 need activation scales: calibration statistics or an explicit constant amax", option="act_amax")
        return max(act.input_amax(m) for m in modules)  # fused shards share their input

    def _input_scale(self, scheme: str, amax: float) -> torch.Tensor:
        if scheme == "nvfp4":
            return nvfp4_global_scale(amax) if self.convention == "compressed-tensors" else nvfp4_scale_2(amax)
        # static FP8: amax / 448, stored like the weight scale (model dtype for CT, F32 [] for ModelOpt)
        value = torch.tensor([amax], dtype=torch.float32) / FP8_E4M3_MAX
        return value.to(torch.bfloat16) if self.convention == "compressed-tensors" else value.reshape(())

    def quantize(self, unit: WorkUnit, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[LinearError]]:
        scheme = unit.linears[0].scheme
        suffix = role_suffixes(self.options.layout_format, scheme)
        fused = len(unit.linears) > 1
        group_amax = max(float(weights[t.module].abs().max()) for t in unit.linears) if fused else None
        input_scale = None
        if scheme in ("nvfp4", "fp8"):
            input_scale = self._input_scale(scheme, self._input_amax([t.module for t in unit.linears]))
        out: dict[str, torch.Tensor] = {}
        errors: list[LinearError] = []
        for target in unit.linears:
            w = weights[target.module]
            m = target.module
            if scheme.startswith("nvfp4"):
                pre = self.options.precomputed.weights.get(m) if self.options.precomputed is not None else None
                if pre is not None:
                    q = pre.to_convention(self.convention)
                    rel = relative_error(w, q.dequantize(torch.float32))
                else:
                    amax = None if group_amax is None else torch.tensor(group_amax, dtype=w.dtype)
                    result = search_nvfp4(w, self.options.block_scales, convention=self.convention, global_amax=amax)
                    q = result.weight
                    rel = result.relative_error
                out[f"{m}.{suffix['packed']}"] = q.packed
                out[f"{m}.{suffix['block_scale']}"] = q.block_scale
                out[f"{m}.{suffix['global_scale']}"] = q.global_scale
            else:
                strategy = "channel" if scheme == "fp8_dynamic" else "tensor"
                amax = None if group_amax is None or strategy != "tensor" else group_amax
                q8 = fp8_quantize_weight(w, strategy, amax=amax)
                scale = q8.scale if self.convention == "compressed-tensors" else q8.scale.float().reshape(())
                out[f"{m}.{suffix['weight']}"] = q8.weight
                out[f"{m}.{suffix['weight_scale']}"] = scale
                rel = relative_error(w, fp8_dequantize_weight(q8, torch.float32))
            if input_scale is not None:
                out[f"{m}.{suffix['input_scale']}"] = input_scale
            errors.append(LinearError(m, target.component, scheme, rel))
        return out, errors

    def kv_scales(self, layer_prefix: str) -> dict[str, torch.Tensor]:
        act = self.options.act_amax
        if act is None:
            raise ConfigError("an FP8 KV cache needs k/v scales: calibration statistics or an explicit constant amax", option="act_amax")
        k_amax, v_amax = act.kv_amax(layer_prefix)
        names = kv_role_names(self.options.layout_format, layer_prefix)
        out = {}
        for role, amax in (("k_scale", k_amax), ("v_scale", v_amax)):
            spec = names[role]
            value = torch.tensor([amax], dtype=torch.float32) / FP8_E4M3_MAX
            dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[spec.dtype]
            out[spec.name] = value.to(dtype).reshape(spec.shape)
        return out


def _process_unit(unit: WorkUnit, ckpt: Checkpoint, quantizer: UnitQuantizer) -> tuple[WorkUnit, dict[str, Any], list[LinearError], int]:
    """Read and quantize one unit (pass-through tensors are carried as raw bytes)."""
    tensors: dict[str, Any] = {}
    unit_bytes = 0
    for name in unit.passthrough:
        tensors[name] = ckpt.read_raw(name)
        unit_bytes += len(tensors[name])
    errors: list[LinearError] = []
    if unit.linears:
        weights = {t.module: ckpt.read_tensor(f"{t.module}.weight") for t in unit.linears}
        unit_bytes += sum(w.numel() * w.element_size() for w in weights.values())
        quantized, errors = quantizer.quantize(unit, weights)
        tensors.update(quantized)
    return unit, tensors, errors, unit_bytes


def _process_units(units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, workers: int):
    """Yield processed units in plan order, `workers` of them computed at a time.

    Torch kernels release the GIL, so threads with one intra-op thread each keep every core
    busy without the oversubscription of nested OpenMP pools; the window of in-flight units
    (workers + 1) bounds memory to a few units whatever the model's size. Writing stays on the
    caller's thread."""
    if workers <= 1:
        for unit in units:
            yield _process_unit(unit, ckpt, quantizer)
        return
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            window: deque = deque()
            queue = iter(units)
            for unit in queue:
                window.append(pool.submit(_process_unit, unit, ckpt, quantizer))
                if len(window) > workers:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
    finally:
        torch.set_num_threads(previous_threads)


def summarize_errors(errors: list[LinearError]) -> dict[str, Any]:
    by_component: dict[str, list[float]] = {}
    for e in errors:
        by_component.setdefault(f"{e.component}:{e.scheme}", []).append(e.relative_error)
    worst = sorted(errors, key=lambda e: -e.relative_error)[:10]
    return {
        "by_component": {
            k: {"linears": len(v), "mean": statistics.fmean(v), "median": statistics.median(v), "max": max(v)} for k, v in sorted(by_component.items())
        },
        "worst": [{"module": e.module, "relative_error": e.relative_error} for e in worst],
    }


def quantize_checkpoint(src: str | Path, out: str | Path, options: QuantizeOptions, progress: Progress | None = None) -> ExportSummary:
    started = time.perf_counter()
    ckpt = open_checkpoint(src)
    _check_source(ckpt)
    layout = layout_for_config(ckpt.config)
    specs = _source_specs(ckpt)
    plan = plan_export(specs, layout, options.recipe, options.layout_format)
    if _needs_act_scales(plan) and options.act_amax is None:
        raise ConfigError(
            f"recipe {options.recipe.name} quantizes activations (W4A4 / static FP8 / FP8 KV): it needs calibration "
            "statistics (from `fp4forge calibrate`) or an explicit constant amax (recorded as uncalibrated)",
            option="act_amax",
        )
    all_linears = linear_names(specs, layout)
    source_digest = ckpt.header_digest()
    key = resume_key(plan, options, source_digest)
    out = Path(out)
    quantizer = UnitQuantizer(options)
    bytes_read = 0
    total_units = len(plan.units) + (1 if plan.kv_layers else 0)
    with CheckpointWriter(out, plan.output_specs, max_shard_bytes=options.max_shard_bytes, resume_key=key) as writer:
        resumed = len(writer.completed_units)
        pending = [u for u in plan.units if u.key not in writer.completed_units]
        finished: dict[str, list[LinearError]] = {
            u.key: [LinearError(**e) for e in writer.completed_payloads.get(u.key) or []] for u in plan.units if u.key in writer.completed_units
        }
        done = resumed
        for unit, tensors, unit_errors, unit_bytes in _process_units(pending, ckpt, quantizer, options.workers):
            for name, tensor in tensors.items():
                writer.write(name, tensor)
            writer.commit_unit(unit.key, list(tensors), [e.__dict__ for e in unit_errors])
            finished[unit.key] = unit_errors
            bytes_read += unit_bytes
            done += 1
            if progress:
                progress(done, total_units, f"{unit.key} · {bytes_read / 1e9 / max(time.perf_counter() - started, 1e-9):.3f} GB/s")
        errors = [e for u in plan.units for e in finished.get(u.key, [])]  # plan order, resumed or not
        if plan.kv_layers and "kv_scales" not in writer.completed_units:
            kv = {}
            for prefix in plan.kv_layers:
                kv.update(quantizer.kv_scales(prefix))
            for name, tensor in kv.items():
                writer.write(name, tensor)
            writer.commit_unit("kv_scales", list(kv))
        _write_companions(writer, ckpt, plan, options, all_linears, errors, source_digest)
    summary = ExportSummary(
        output=str(out),
        layout_format=options.layout_format,
        recipe=options.recipe.name,
        tensors_written=len(plan.output_specs),
        bytes_read=bytes_read,
        bytes_written=sum(s.nbytes for s in plan.output_specs),
        seconds=time.perf_counter() - started,
        resumed_units=resumed,
        weight_error=summarize_errors(errors) if errors else {},
    )
    return summary


def _write_companions(
    writer: CheckpointWriter,
    ckpt: Checkpoint,
    plan: ExportPlan,
    options: QuantizeOptions,
    all_linears: list[str],
    errors: list[LinearError],
    source_digest: str,
) -> None:
    """config.json with the declaration, tokenizer and other files copied, provenance (no
    timestamps or durations: a resumed run writes the same bytes as an uninterrupted one)."""
    config = dict(ckpt.config or {})
    if options.layout_format == "compressed-tensors":
        config["quantization_config"] = compressed_tensors_config(plan, all_linears)
    else:
        config_form, hf_quant = modelopt_configs(plan, all_linears, __version__)
        config["quantization_config"] = config_form
        writer.write_json(HF_QUANT_CONFIG_JSON, hf_quant)
    writer.write_json(CONFIG_JSON, config)
    source_root = getattr(ckpt.source, "root", None)
    if source_root is not None:
        for path in sorted(Path(source_root).iterdir()):
            if path.is_file() and not path.name.endswith(".safetensors") and path.name not in REWRITTEN:
                writer.copy_file(path, path.name)
    provenance = {
        "fp4forge_version": __version__,
        "recipe": {"name": options.recipe.name, "source": options.recipe.source, "text": options.recipe.text},
        "layout": options.layout_format,
        "options": {"block_scales": options.block_scales, "max_shard_bytes": options.max_shard_bytes},
        "method": options.precomputed.provenance() if options.precomputed is not None else {"method": "rtn", "block_scales": options.block_scales},
        "activation_scales": options.act_amax.provenance() if options.act_amax else None,
        "source": {"location": ckpt.display, "header_digest": source_digest, "shards": ckpt.shard_names},
        "fused_groups": {"count": len(plan.fused_groups), "rule": "one weight global scale per group, from the group's max amax"},
        "ignored_modules": plan.ignored,
        "kv_cache": {"scheme": options.recipe.kv_cache_scheme, "layers": len(plan.kv_layers)} if plan.kv_layers else None,
        "weight_error": summarize_errors(errors) if errors else None,
    }
    writer.write_json(PROVENANCE_JSON, provenance)
