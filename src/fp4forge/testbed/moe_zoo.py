"""Every MoE architecture transformers defines, as a small config: its config class's defaults
with few layers and few routed experts (sizes stay the defaults: the models are built on the meta
device, where a size costs nothing, so no dimension has to be re-derived by hand).

A model type is a MoE when its config (or a nested config) states a routed-expert count under
one of the spellings :data:`fp4forge.checkpoint.layout.EXPERT_COUNT_KEYS` lists.
"""

from __future__ import annotations

import json
from typing import Any

from fp4forge.checkpoint.layout import EXPERT_COUNT_KEYS, expert_counts

ZOO_EXPERTS = 16  # above every default top-k (at most 10 in transformers 5.23), a multiple of every n_group
ZOO_LAYERS = 4
_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "top_k", "num_experts_per_token", "moe_topk")


def default_config(model_type: str) -> dict[str, Any] | None:
    """The config class's defaults as config.json holds them, or None when they cannot be made."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        # to_dict, not to_json_string: the latter spells infinity as an object config.json never holds
        return json.loads(json.dumps(CONFIG_MAPPING[model_type]().to_dict(), default=str))
    except Exception:  # noqa: BLE001 - a config class that needs arguments: not a zoo member
        return None


def moe_model_types() -> list[str]:
    """Every model_type of the installed transformers whose default config states an expert count."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(t for t in CONFIG_MAPPING_NAMES if expert_counts(default_config(t) or {}))


def _shrunk(section: dict[str, Any]) -> dict[str, Any]:
    """One (sub-)config with ZOO_LAYERS layers (per-layer lists cut to match) and ZOO_EXPERTS experts."""
    out = dict(section)
    for key, value in section.items():
        if isinstance(value, dict):
            out[key] = _shrunk(value)
    layers = next((section[k] for k in _LAYER_COUNT_KEYS if type(section.get(k)) is int), None)
    if layers is not None and layers > ZOO_LAYERS:
        for key, value in section.items():
            if key in _LAYER_COUNT_KEYS and type(value) is int:
                out[key] = ZOO_LAYERS
            elif isinstance(value, list) and len(value) == layers:
                out[key] = value[:ZOO_LAYERS]
            elif isinstance(value, dict) and value and all(k.isdigit() for k in value):  # per-layer settings by index
                out[key] = {k: v for k, v in out[key].items() if int(k) < ZOO_LAYERS}
    for key in EXPERT_COUNT_KEYS:  # (never the layer count: a derivation must not rely on telling them apart by size)
        if type(section.get(key)) is int and (section[key] > ZOO_EXPERTS or section[key] == ZOO_LAYERS):
            out[key] = ZOO_EXPERTS
    for key in _TOP_K_KEYS:
        if type(section.get(key)) is int and section[key] > ZOO_EXPERTS // 2:
            out[key] = ZOO_EXPERTS // 2
    return out


# Values a config class leaves unset by default but its model class needs (real releases carry
# them in config.json): (path of nested keys, value). Each entry is here because transformers'
# own defaults cannot build the model (tests/test_moe_zoo.py checks that they still cannot).
ZOO_COMPLETIONS: dict[str, tuple[tuple[tuple[str, ...], Any], ...]] = {
    "dbrx": ((("attn_config", "rope_theta"), 500000.0),),
    "lfm2_moe": ((("layer_types",), ["conv", "full_attention", "conv", "full_attention"]), (("num_hidden_layers",), 4)),
    "deepseek_ocr2": ((("text_config", "mlp_layer_types"), ["dense", "sparse", "sparse", "sparse"]),),
}


def _completed(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    for path, value in ZOO_COMPLETIONS.get(model_type, ()):
        section = config
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = value
    return config


def zoo_config(model_type: str) -> dict[str, Any] | None:
    """The small config of one MoE model type (first the shrunk one; the defaults when transformers
    refuses the shrunk one), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = default_config(model_type)
    if config is None:
        return None
    small = _completed(model_type, _shrunk(config))
    config = _completed(model_type, config)
    try:
        CONFIG_MAPPING[model_type].from_dict(small)
    except Exception:  # noqa: BLE001 - a layer pattern the cut broke: the defaults then
        return config
    return small


# -- header-only checkpoints ---------------------------------------------------------------------
QUANTIZED_COMPONENTS = ("attention", "routed_experts", "shared_expert", "dense_mlp")


def modelopt_nvfp4_sidecar(exclude_modules: list[str]) -> str:
    """The hf_quant_config.json a ModelOpt NVFP4 export writes."""
    doc = {
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude_modules},
    }
    return json.dumps(doc, indent=4) + "\n"


def nvfp4_modules(config: dict[str, Any], specs) -> list[str]:
    """The Linears an NVFP4 export of ``config`` quantizes: 2-D weights of the projection
    components whose input size NVFP4's 16-value blocks divide, except the leaves releases keep
    BF16 (indexer weights, MTP eh_proj, ...: testbed.corpus.UNQUANTIZED_LEAVES)."""
    from fp4forge.checkpoint.layout import layout_or_inferred
    from fp4forge.testbed.corpus import NVFP4_GROUP, UNQUANTIZED_LEAVES

    layout = layout_or_inferred(config)
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")]
        if spec.name.endswith(".weight") and len(spec.shape) == 2 and spec.shape[1] % NVFP4_GROUP == 0 and module.rpartition(".")[2] not in UNQUANTIZED_LEAVES and layout.component_of(module) in QUANTIZED_COMPONENTS:
            out.append(module)
    # a group vLLM fuses into one GEMM takes one scheme: all its shards quantized, or none
    chosen = set(out)
    linears = {s.name[: -len(".weight")] for s in specs if s.name.endswith(".weight")}
    for members in layout.fused.values():
        for module in list(chosen):
            parent, _, leaf = module.rpartition(".")
            shards = {f"{parent}.{m}" for m in members} & linears if leaf in members else set()
            if shards and not shards <= chosen:
                chosen -= shards
    return [m for m in out if m in chosen]


def build_zoo_nvfp4(config: dict[str, Any], out, *, keep_bf16: str | None = None):
    """``config``'s checkpoint as a header-only ModelOpt NVFP4 export (see :func:`write_nvfp4_export`)."""
    from fp4forge.checkpoint.skeleton import checkpoint_specs

    return write_nvfp4_export(checkpoint_specs(config), config, out, keep_bf16=keep_bf16)


def write_nvfp4_export(specs, config: dict[str, Any], out, *, keep_bf16: str | None = None):
    """``specs`` (a model's unquantized tensors) as a header-only ModelOpt NVFP4 export: the 2-D
    Linears of the projection components (by the layout fp4forge uses for ``config``) in NVFP4,
    everything else excluded and kept as it is. ``keep_bf16``: one module stored unquantized all
    the same while the declaration says NVFP4 (the defect the audit must find)."""
    from pathlib import Path

    from fp4forge.testbed.corpus import modelopt_nvfp4_specs, write_header_only

    quantizable = set(nvfp4_modules(config, specs))
    excluded = sorted(s.name[: -len(".weight")] for s in specs if s.name.endswith(".weight") and s.name[: -len(".weight")] not in quantizable)
    quantized = modelopt_nvfp4_specs(specs, excluded)
    if keep_bf16 is not None:
        original = next(s for s in specs if s.name == f"{keep_bf16}.weight")
        quantized = [s for s in quantized if not s.name.startswith(f"{keep_bf16}.")]
        quantized.append(original)
    return write_header_only(Path(out), quantized, config, {"hf_quant_config.json": modelopt_nvfp4_sidecar(excluded)})
