"""The `quantization_config` (and ModelOpt's `hf_quant_config.json`) an export declares.

compressed-tensors: one config group per scheme, targets as anchored regexes over the
targeted module names (every layer/expert index generalised to `\\d+`), with any module a
pattern would over-match listed in `ignore` — so what vLLM matches is exactly what was
quantized. Fields follow compressed-tensors' pydantic models (`extra="forbid"`), see
docs/formats.md#compressed-tensors-declaration. ModelOpt: `quant_algo` NVFP4/FP8 for one scheme, or
`MIXED_PRECISION` with per-module `quantized_layers` (vLLM's ModelOptMixedPrecisionConfig),
docs/formats.md#modelopt-declaration.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from fp4forge import __version__
from fp4forge.checkpoint.codecs import Nvfp4Codec, codec, codecs
from fp4forge.checkpoint.declarations import CT, CT_FORMATS, MODELOPT, MODELOPT_ALGOS, MODELOPT_FP8_KV_SCHEME
from fp4forge.checkpoint.names import HF_QUANT_CONFIG_JSON, natural_key
from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.errors import ConfigError
from fp4forge.numerics.nvfp4 import NVFP4_BLOCK
from fp4forge.quantize.plan import ExportPlan

COMPRESSED_TENSORS_VERSION = "0.17.0"  # the version vLLM 0.32/0.33 pin; our fields are that model's


def _float_args(num_bits: int, strategy: str, *, group_size: int | None, dynamic: bool | str, scale_dtype: str | None, observer: str | None) -> dict[str, Any]:
    return {
        "num_bits": num_bits,
        "type": "float",
        "symmetric": True,
        "group_size": group_size,
        "strategy": strategy,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "scale_dtype": scale_dtype,
        "zp_dtype": None,
        "observer": observer,
        "observer_kwargs": {},
    }


def _nvfp4_args(dynamic: bool | str) -> dict[str, Any]:
    return _float_args(4, "tensor_group", group_size=NVFP4_BLOCK, dynamic=dynamic, scale_dtype="torch.float8_e4m3fn", observer="static_minmax")


def ct_scheme_args(scheme: str) -> dict[str, Any]:
    """`weights` / `input_activations` of one config group, as llm-compressor's presets write them:
    the weights by the scheme's codec, static input activations where the scheme stores an input
    scale (``_schemes.toml``), dynamic ones otherwise (none for weight-only NVFP4)."""
    scheme_codec = codecs().get(scheme)
    if scheme_codec is None or not scheme_codec.writable:
        raise ConfigError(f"unknown scheme {scheme!r}", option="scheme")
    static_inputs = scheme_codec.has_input_scale(CT)
    if isinstance(scheme_codec, Nvfp4Codec):
        weights = _nvfp4_args(dynamic=False)
        inputs = _nvfp4_args(dynamic="local") if static_inputs else None
    else:
        weights = _float_args(8, scheme_codec.strategy, group_size=None, dynamic=False, scale_dtype=None, observer="minmax")
        if static_inputs:
            inputs = _float_args(8, "tensor", group_size=None, dynamic=False, scale_dtype=None, observer="static_minmax")
        else:
            inputs = _float_args(8, "token", group_size=None, dynamic=True, scale_dtype=None, observer=None)
    return {"weights": weights, "input_activations": inputs, "output_activations": None}


def generalise(module: str) -> str:
    """`model.layers.7.mlp.experts.12.up_proj` -> anchored regex with every index as \\d+."""
    return "^" + r"\d+".join(re.escape(part) for part in re.split(r"\d+", module)) + "$"


def targets_and_overmatches(modules: list[str], all_linears: list[str]) -> tuple[list[str], list[str]]:
    """Generalised patterns for `modules`, and linears they match that are not in `modules`."""
    patterns = sorted({generalise(m) for m in modules})
    compiled = [re.compile(p) for p in patterns]
    chosen = set(modules)
    over = sorted(m for m in all_linears if m not in chosen and any(c.match(m) for c in compiled))
    return [f"re:{p}" for p in patterns], over


def kv_cache_scheme_ct() -> dict[str, Any]:
    return _float_args(8, "tensor", group_size=None, dynamic=False, scale_dtype=None, observer="minmax")


def compressed_tensors_config(plan: ExportPlan, all_linears: list[str]) -> dict[str, Any]:
    by_scheme: dict[str, list[str]] = defaultdict(list)
    for target in plan.targets.values():
        by_scheme[target.scheme].append(target.module)
    groups: dict[str, Any] = {}
    ignore: set[str] = set()
    for number, (scheme, modules) in enumerate(sorted(by_scheme.items())):
        targets, over = targets_and_overmatches(modules, all_linears)
        ignore.update(over)
        groups[f"group_{number}"] = {"targets": targets, "format": CT_FORMATS[scheme], **ct_scheme_args(scheme)}
    formats = {CT_FORMATS[s] for s in by_scheme}
    return {
        "config_groups": groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "kv_cache_scheme": kv_cache_scheme_ct() if plan.kv_layers else None,
        "quant_method": CT,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def modelopt_configs(plan: ExportPlan, all_linears: list[str], producer_version: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`quantization_config` for config.json, `hf_quant_config.json`)."""
    schemes = {t.scheme for t in plan.targets.values()}
    unsupported = schemes - MODELOPT_ALGOS.keys()
    if unsupported:
        from fp4forge.errors import ConfigError

        raise ConfigError(f"the ModelOpt layout has no form for schemes {sorted(unsupported)}; use compressed-tensors")
    exclude = sorted(set(all_linears) - set(plan.targets))
    kv_algo = "FP8" if plan.kv_layers else None
    producer = {"name": "fp4forge", "version": producer_version}
    quantization: dict[str, Any] = {"kv_cache_quant_algo": kv_algo, "exclude_modules": exclude}
    if len(schemes) == 1:
        algo = MODELOPT_ALGOS[next(iter(schemes))]
        quantization["quant_algo"] = algo
        if isinstance(codec(next(iter(schemes))), Nvfp4Codec):
            quantization["group_size"] = NVFP4_BLOCK
    else:
        quantization["quant_algo"] = "MIXED_PRECISION"
        quantization["quantized_layers"] = {
            t.module: {"quant_algo": MODELOPT_ALGOS[t.scheme]} | ({"group_size": NVFP4_BLOCK} if isinstance(codec(t.scheme), Nvfp4Codec) else {})
            for t in sorted(plan.targets.values(), key=lambda t: t.module)
        }
    hf_quant_config = {"producer": producer, "quantization": quantization}
    config_form: dict[str, Any] = {
        "quant_method": MODELOPT,
        "producer": producer,
        **{k: v for k, v in quantization.items() if k != "exclude_modules"},
        "ignore": exclude,
    }
    if kv_algo:
        config_form["kv_cache_scheme"] = dict(MODELOPT_FP8_KV_SCHEME)
    return config_form, hf_quant_config


# -- the FP8 KV-cache declaration (kv calibrate / transplant add it to a checkpoint) --------------------------------------------------------------------------------
def _linear_modules(ckpt: Checkpoint) -> list[str]:
    """Every module with a 2-D weight except embeddings (the Linears a declaration can exclude)."""
    modules = []
    for _, info in ckpt.tensors():
        if info.name.endswith(".weight") and len(info.shape) == 2 and not info.name.endswith("embed_tokens.weight"):
            modules.append(info.name[: -len(".weight")])
    return sorted(set(modules), key=natural_key)


def quantization_configs(layout: str, plan: ExportPlan, all_linears: list[str], producer_version: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(`quantization_config` for config.json, `hf_quant_config.json` or None) of an export in ``layout``."""
    if layout not in _DECLARERS:
        raise ConfigError(f"no declaration for layout {layout!r}", option="layout_format")
    return _DECLARERS[layout](plan, all_linears, producer_version)


_DECLARERS = {
    CT: lambda plan, all_linears, _version: (compressed_tensors_config(plan, all_linears), None),
    MODELOPT: modelopt_configs,
}


def declare_kv(ckpt: Checkpoint, layout: str, *, per_head: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, hf_quant_config.json or None) with the FP8 KV declaration added."""
    config = json.loads(json.dumps(ckpt.config or {}))
    if layout not in _KV_DECLARERS:
        raise ConfigError(f"no KV declaration for layout {layout!r}", option="layout")
    return _KV_DECLARERS[layout](ckpt, config, config.get("quantization_config"), per_head)


def _declare_kv_ct(ckpt: Checkpoint, config: dict[str, Any], qc: dict[str, Any] | None, per_head: bool) -> tuple[dict[str, Any], None]:
    scheme = kv_cache_scheme_ct()
    if per_head:
        scheme["strategy"] = "attn_head"
    if qc is None:  # KV-only: no Linear is quantized
        qc = {
            "config_groups": {},
            "format": "dense",
            "global_compression_ratio": None,
            "ignore": [],
            "quant_method": CT,
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION,
        }
    qc["kv_cache_scheme"] = scheme
    config["quantization_config"] = qc
    return config, None


def _declare_kv_modelopt(ckpt: Checkpoint, config: dict[str, Any], qc: dict[str, Any] | None, per_head: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if per_head:
        raise ConfigError("the ModelOpt layout has per-tensor KV scales only", option="per_head")
    hf_quant = json.loads(json.dumps(ckpt.extra_json.get(HF_QUANT_CONFIG_JSON) or {}))
    if not hf_quant and qc is None:  # KV-only: vLLM needs a quant_algo, so FP8 with every Linear excluded
        exclude = _linear_modules(ckpt)
        hf_quant = {"producer": {"name": "fp4forge", "version": __version__}, "quantization": {"quant_algo": "FP8", "exclude_modules": exclude, "kv_cache_quant_algo": "FP8"}}
        qc = {"quant_method": MODELOPT, "producer": hf_quant["producer"], "quant_algo": "FP8", "ignore": exclude}
    if hf_quant:
        hf_quant.setdefault("quantization", {})["kv_cache_quant_algo"] = "FP8"
    if qc is not None:
        qc["kv_cache_quant_algo"] = "FP8"
        qc["kv_cache_scheme"] = dict(MODELOPT_FP8_KV_SCHEME)
        config["quantization_config"] = qc
    return config, (hf_quant or None)


_KV_DECLARERS = {CT: _declare_kv_ct, MODELOPT: _declare_kv_modelopt}
