"""The file names a checkpoint directory is made of: one spelling each, used by every reader and
writer (the loaders — transformers, vLLM, ModelOpt — look for exactly these)."""

from __future__ import annotations

CONFIG_JSON = "config.json"
INDEX_JSON = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"  # the one shard of an unsharded checkpoint
HF_QUANT_CONFIG_JSON = "hf_quant_config.json"  # ModelOpt's quantization declaration
PROVENANCE_JSON = "fp4forge.json"  # what fp4forge did to the checkpoint (recipe, sources, scales)
KV_SCALES_SAFETENSORS = "model-kvscales.safetensors"  # the extra shard `kv calibrate` installs
JOURNAL_FILE = ".fp4forge-journal"  # the writer's resume journal inside a partial output

# What open_checkpoint reads besides config.json (into Checkpoint.extra_json).
EXTRA_JSON = (HF_QUANT_CONFIG_JSON, PROVENANCE_JSON)


def natural_key(name: str) -> list:
    """How fp4forge orders tensor, module and layer names: `experts.10` after `experts.9`."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
