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
# A testbed's own text, shipped beside its weights (JSONL, ``{"text": ...}`` per line, as
# ``--calib-text`` / ``--fidelity-text`` read them): calibration documents and held-out documents.
CALIBRATION_TEXT_FILE = "fp4forge-calibration.jsonl"
HELDOUT_TEXT_FILE = "fp4forge-heldout.jsonl"

# The files a server reads beside the weights (what the audit's server-file checks look at).
GENERATION_CONFIG_JSON = "generation_config.json"
TOKENIZER_JSON = "tokenizer.json"  # the fast tokenizer transformers and vLLM load first
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_JSON = "special_tokens_map.json"  # legacy: special tokens beside tokenizer_config.json
# Any of these is a tokenizer transformers can load (tokenizer_config.json alone is not).
TOKENIZER_FILES = (TOKENIZER_JSON, "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")

# What open_checkpoint reads besides config.json (into Checkpoint.extra_json).
EXTRA_JSON = (HF_QUANT_CONFIG_JSON, PROVENANCE_JSON)


def natural_key(name: str) -> list:
    """How fp4forge orders tensor, module and layer names: `experts.10` after `experts.9`."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# The files besides weights, index and config that a model repository holds, and so the only ones
# an export copies from its source: what transformers' from_pretrained and vLLM read (generation
# settings, tokenizer, chat template, processor, remote code) and the terms the weights ship under.
# Anything else beside the source's weights (its model card, training reports, data, scripts) is
# the source's own and stays behind; the exported model gets its own card (`fp4forge card`).
MODEL_REPO_FILES = (
    "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "*.tiktoken", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "configuration_*.py", "modeling_*.py", "tokenization_*.py", "processing_*.py",
    "LICENSE", "LICENSE.*", "NOTICE", "NOTICE.*", "USE_POLICY.md",
)


def is_model_repo_file(name: str) -> bool:
    """Whether a file of this name belongs in a model repository beside the weights."""
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pattern) for pattern in MODEL_REPO_FILES)
