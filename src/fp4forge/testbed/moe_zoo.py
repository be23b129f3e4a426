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
    for key in EXPERT_COUNT_KEYS:
        if type(section.get(key)) is int and section[key] > ZOO_EXPERTS:
            out[key] = ZOO_EXPERTS
    for key in _TOP_K_KEYS:
        if type(section.get(key)) is int and section[key] > ZOO_EXPERTS // 2:
            out[key] = ZOO_EXPERTS // 2
    return out


def zoo_config(model_type: str) -> dict[str, Any] | None:
    """The small config of one MoE model type (first the shrunk one; the defaults when transformers
    refuses the shrunk one), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = default_config(model_type)
    if config is None:
        return None
    small = _shrunk(config)
    try:
        CONFIG_MAPPING[model_type].from_dict(small)
    except Exception:  # noqa: BLE001 - a layer pattern the cut broke: the defaults then
        return config
    return small
