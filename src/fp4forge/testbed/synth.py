"""Shape-true synthetic checkpoints at real scale, written shard by shard.

``synth_checkpoint`` writes exactly the tensor names, shapes and dtypes that ``save_pretrained``
of the configured architecture would write, for the first N decoder layers (plus embeddings,
final norm and lm_head), filled with seeded heavy-tailed values (Student-t, 4 degrees of freedom,
std 0.02; RMSNorm weights centred on 1). Names come from the real model class built on the meta
device with N layers, run through the same steps ``save_pretrained`` uses (ignored keys, tied
weights, and transformers' reverse weight conversion, which turns the fused 3-D expert tensors into
per-expert 2-D ones), so no full model is ever materialised. Only one tensor is in memory at a time;
``sparse=True`` writes the headers only and leaves the data as file holes.

A source without a tokenizer of its own (every preset, a bare config.json) gets the testbed's:
the tiny testbeds' BPE with the config's vocabulary size, its chat template, a
``generation_config.json`` with its ids (the config's bos/eos/pad ids are set to them), the
testbed's own calibration and held-out text, and a card saying what the model is. ``shrink``
divides the widths, head counts, expert counts and vocabulary (docs/testbed.md#synth-shrink), so
the same presets also run at test size.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4forge.checkpoint.skeleton import (
    TORCH_TO_SAFETENSORS,
    checkpoint_specs,
    count_parameters,
    model_config_dict,
)
from fp4forge.checkpoint.names import CALIBRATION_TEXT_FILE, CONFIG_JSON, HELDOUT_TEXT_FILE, TOKENIZER_FILES
from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError
from fp4forge.checkpoint.atomic import ensure_fresh_output
from fp4forge.testbed.tiny import Progress

PRESETS: dict[str, str] = {
    name: f"{name}.json" for name in ("laguna-s-2.1-like", "laguna-xs.2-like", "deepseek-v3-like", "qwen3-235b-like")
}

# Keys holding one entry per decoder layer: cut to the first N with the layer count.
PER_LAYER_LIST_KEYS = ("layer_types", "mlp_layer_types", "num_attention_heads_per_layer")
# Keys holding layer *indices*: keep the indices below N.
LAYER_INDEX_LIST_KEYS = ("mlp_only_layers",)
# Files beside a source config.json that still describe the truncated model.
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# --shrink: the keys it divides (docs/testbed.md#synth-shrink). Widths stay multiples of 64, so
# NVFP4's 16-element blocks and vLLM's MoE kernels still divide evenly; per-head dims, top-k, the
# layer pattern and every other key are kept.
SHRINK_WIDTH_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "q_lora_rank", "kv_lora_rank", "vocab_size")
SHRINK_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "num_attention_heads_per_layer")
SHRINK_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
WIDTH_MULTIPLE = 64

SAFETENSORS_TO_TORCH = {v: k for k, v in TORCH_TO_SAFETENSORS.items()}

WEIGHT_STD = 0.02
STUDENT_T_DOF = 4  # finite variance, but outliers far heavier than a Gaussian's: what quantizers meet
GENERATION_CHUNK = 1 << 21  # elements generated at a time (fp32 scratch ~24 MB per thread)
GENERATION_THREADS = min(8, os.cpu_count() or 1)


# -- presets and config sources -------------------------------------------------------------------
def load_preset(name: str) -> dict[str, Any]:
    """The preset's config.json contents, including its ``_fp4forge_preset_notes``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    text = resources.files("fp4forge.testbed").joinpath("presets").joinpath(PRESETS[name]).read_text(encoding="utf-8")
    return json.loads(text)


def resolve_config_source(config_path_or_preset: str | Path) -> tuple[dict[str, Any], Path | None]:
    """(config dict, directory holding it or None for a preset) from a preset name, a config.json
    or a checkpoint directory."""
    if isinstance(config_path_or_preset, str) and config_path_or_preset in PRESETS:
        return load_preset(config_path_or_preset), None
    path = Path(config_path_or_preset)
    config_file = path / CONFIG_JSON if path.is_dir() else path
    if not config_file.is_file():
        raise ConfigError(
            f"{config_path_or_preset!s} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json "
            "or a directory with one",
            file=str(config_file),
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read config: {exc}", file=str(config_file)) from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError("config.json has no model_type", file=str(config_file))
    return config, config_file.parent


def truncated_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config of the first ``layers`` decoder layers of ``config``."""
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or total < 1:
        raise ConfigError("config has no positive integer num_hidden_layers")
    if not 1 <= layers <= total:
        raise ConfigError(f"layers must be between 1 and {total} (the config's num_hidden_layers), got {layers}")
    out = copy.deepcopy(model_config_dict(config))
    out["num_hidden_layers"] = layers
    for key in PER_LAYER_LIST_KEYS:
        if isinstance(out.get(key), list):
            if len(out[key]) != total:
                raise ConfigError(f"config {key} has {len(out[key])} entries for {total} layers")
            out[key] = out[key][:layers]
    for key in LAYER_INDEX_LIST_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [index for index in out[key] if index < layers]
    return out


# -- values ---------------------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed from the tensor's name, so values do not depend on write order or N."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _fill_chunk(flat: torch.Tensor, tensor_seed: int, chunk: int, scale: float, centre: float) -> None:
    """One chunk of Student-t (4 dof) values: normal / sqrt(chi2_4 / 4), chi2_4 = 2 (E1 + E2).

    Each chunk has its own generator (seeded by tensor and chunk index), so chunks can be filled
    by several threads and the values never depend on scheduling; numpy releases the GIL here.
    """
    start = chunk * GENERATION_CHUNK
    count = min(GENERATION_CHUNK, flat.numel() - start)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([tensor_seed, chunk])))
    values = rng.standard_normal(count, dtype=np.float32)
    exponentials = rng.standard_exponential(2 * count, dtype=np.float32)
    chi2_over_dof = exponentials[:count]
    chi2_over_dof += exponentials[count:]
    chi2_over_dof *= 2.0 / STUDENT_T_DOF
    values /= np.sqrt(chi2_over_dof)
    values *= scale
    values += centre
    flat[start : start + count].copy_(torch.from_numpy(values))


def synthetic_tensor(spec: TensorSpec, seed: int, *, threads: int = GENERATION_THREADS) -> torch.Tensor:
    """Seeded heavy-tailed values for ``spec``, generated chunk by chunk into the output dtype."""
    tensor_seed = _tensor_seed(seed, spec.name)
    flat = torch.empty(math.prod(spec.shape), dtype=SAFETENSORS_TO_TORCH[spec.dtype])
    scale = WEIGHT_STD / math.sqrt(STUDENT_T_DOF / (STUDENT_T_DOF - 2))  # t_4 has variance 2
    centre = 1.0 if spec.name.endswith("norm.weight") else 0.0  # RMSNorm gains sit near 1
    chunks = range(-(-flat.numel() // GENERATION_CHUNK))
    if threads <= 1 or len(chunks) <= 1:
        for chunk in chunks:
            _fill_chunk(flat, tensor_seed, chunk, scale, centre)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda chunk: _fill_chunk(flat, tensor_seed, chunk, scale, centre), chunks))
    return flat.view(spec.shape)


# -- shrinking ------------------------------------------------------------------------------------
def _rounded_width(value: int, divisor: int) -> int:
    return max(WIDTH_MULTIPLE, int(value / divisor / WIDTH_MULTIPLE + 0.5) * WIDTH_MULTIPLE)


def shrunk_config(config: dict[str, Any], divisor: int) -> dict[str, Any]:
    """``config`` with its widths, head counts, expert counts and vocabulary divided by ``divisor``
    (widths rounded to a multiple of 64, counts at least 1 and experts at least top-k)."""
    if type(divisor) is not int or divisor < 1:
        raise ConfigError(f"shrink must be a positive integer, got {divisor!r}", option="shrink")
    out = copy.deepcopy(config)
    if divisor == 1:
        return out
    if isinstance(out.get("text_config"), dict):
        raise ConfigError("shrink divides a config's top-level keys; a wrapper's text_config is not shrunk", option="shrink")
    for key in SHRINK_WIDTH_KEYS:
        if type(out.get(key)) is int:
            out[key] = _rounded_width(out[key], divisor)
    for key in SHRINK_HEAD_KEYS:
        if type(out.get(key)) is int:
            out[key] = max(1, out[key] // divisor)
        elif isinstance(out.get(key), list):
            out[key] = [max(1, heads // divisor) for heads in out[key]]
    top_k = out.get("num_experts_per_tok") if type(out.get("num_experts_per_tok")) is int else 1
    for key in SHRINK_EXPERT_KEYS:
        if type(out.get(key)) is int:
            out[key] = max(top_k, out[key] // divisor)
    _check_shrunk(out, divisor)
    return out


def _check_shrunk(config: dict[str, Any], divisor: int) -> None:
    """What a divisor can break and the model classes need: whole query groups per KV head, whole
    expert groups (DeepSeek's grouped routing)."""
    kv_heads = config.get("num_key_value_heads")
    heads = config.get("num_attention_heads_per_layer") or [config.get("num_attention_heads")]
    if type(kv_heads) is int and any(type(h) is int and h % kv_heads for h in heads):
        raise ConfigError(f"shrink {divisor} leaves query heads {sorted(set(heads))} that {kv_heads} KV heads do not divide; choose another divisor", option="shrink")
    groups = config.get("n_group")
    experts = next((config[k] for k in SHRINK_EXPERT_KEYS if type(config.get(k)) is int), None)
    if type(groups) is int and experts is not None and experts % groups:
        raise ConfigError(f"shrink {divisor} leaves {experts} experts in {groups} routing groups; choose another divisor", option="shrink")


# -- the testbed's tokenizer, text and card -------------------------------------------------------
def _has_tokenizer(source_dir: Path | None) -> bool:
    """A source that has a tokenizer keeps it."""
    return source_dir is not None and any((source_dir / name).is_file() for name in TOKENIZER_FILES)


@functools.lru_cache(maxsize=2)
def own_text_jsonl(split: str) -> str:
    """The built-in corpus's ``split`` rendered through the testbed chat template, as JSONL. The
    template is the same at every vocabulary size, so one rendering serves every synth build."""
    from fp4forge.model.samples import builtin_documents, render, text_jsonl
    from fp4forge.testbed.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    return text_jsonl(render(tokenizer, document) for document in builtin_documents(split))


def testbed_files(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(config with the tokenizer's special ids, {file name: text}) for a source without a tokenizer:
    the testbed tokenizer at the config's vocabulary size, the generation config, own text, card."""
    import tempfile

    from transformers import GenerationConfig

    from fp4forge.testbed.card import SYNTH_BODY, testbed_card
    from fp4forge.testbed.tiny import quiet_transformers_progress
    from fp4forge.testbed.tokenizer import build_tokenizer, generation_stop_ids

    vocab_size = config.get("vocab_size")
    if type(vocab_size) is not int:
        raise ConfigError("the config has no top-level integer vocab_size to build the testbed tokenizer for; give a source with a tokenizer")
    tokenizer = build_tokenizer(vocab_size)
    if len(tokenizer) != vocab_size:  # below the byte alphabet and control tokens
        raise ConfigError(f"vocab_size {vocab_size:,} is smaller than the testbed tokenizer's {len(tokenizer):,} base tokens", option="shrink")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": generation_stop_ids(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    files: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch, quiet_transformers_progress():
        tokenizer.save_pretrained(scratch)
        GenerationConfig(**ids).save_pretrained(scratch)
        for path in sorted(Path(scratch).iterdir()):
            files[path.name] = path.read_text(encoding="utf-8")
    for name, split in ((CALIBRATION_TEXT_FILE, "calibration"), (HELDOUT_TEXT_FILE, "heldout")):
        files[name] = own_text_jsonl(split)
    architecture = (config.get("architectures") or [config["model_type"]])[0]
    body = SYNTH_BODY.format(architecture=architecture, layers=config["num_hidden_layers"], vocab_size=vocab_size)
    files["README.md"] = testbed_card(body=body)
    return {**config, **ids}, files


# -- writing --------------------------------------------------------------------------------------
def synth_checkpoint(
    config_path_or_preset: str | Path,
    layers: int,
    out: Path,
    *,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    sparse: bool = False,
    shrink: int = 1,
    progress: Progress = None,
) -> Path:
    """Write a synthetic checkpoint of the first ``layers`` layers of a config or preset to ``out``,
    every width divided by ``shrink``."""
    out = Path(out)
    ensure_fresh_output(out)
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    source, source_dir = resolve_config_source(config_path_or_preset)
    config = truncated_config(shrunk_config(source, shrink), layers)
    texts: dict[str, str] = {}
    if not _has_tokenizer(source_dir):
        if progress is not None:
            progress(0, 1, "testbed tokenizer, chat template and own text")
        config, texts = testbed_files(config)
    specs = checkpoint_specs(config)
    companions = [name for name in COMPANION_FILES if source_dir is not None and (source_dir / name).is_file() and name not in texts]
    with CheckpointWriter(out, specs, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"}, sparse=sparse,
                          index_metadata={"total_parameters": sum(math.prod(spec.shape) for spec in specs)}) as writer:
        writer.write_text(CONFIG_JSON, json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        for name in companions:
            writer.copy_file(source_dir / name, name)
        for name, text in texts.items():
            writer.write_text(name, text)
        _write_values(writer, specs, seed, sparse, progress)
    return out


def _write_values(writer: CheckpointWriter, specs: list[TensorSpec], seed: int, sparse: bool, progress: Progress) -> None:
    total_bytes = sum(spec.nbytes for spec in specs)
    if sparse:
        if progress is not None:
            progress(total_bytes, total_bytes, "headers written (sparse)")
        return
    done = 0
    for spec in specs:
        writer.write(spec.name, synthetic_tensor(spec, seed))
        done += spec.nbytes
        if progress is not None:
            progress(done, total_bytes, spec.name)


__all__ = [
    "PRESETS",
    "checkpoint_specs",
    "count_parameters",
    "load_preset",
    "shrunk_config",
    "synth_checkpoint",
    "synthetic_tensor",
    "truncated_config",
]
