"""Header-only rebuilds of real published checkpoints from their metadata files.

A corpus entry is a directory holding a release's real ``config.json``, its real
``model.safetensors.index.json`` (optionally gzipped) when one could be collected, any
``hf_quant_config.json``, and ``PROVENANCE.json`` (where each file came from, and what the model
card states). :func:`build_header_only` writes a checkpoint with every tensor the release holds:

- names: the real index when present; otherwise reconstructed from the config with the
  architecture's transformers naming (layer by layer, each layer copied from a built layer of the
  same kind), plus the next-n (MTP) layers a DeepSeek-style config declares;
- shapes and dtypes: from the transformers model class the config names, built on the meta
  device for the first few layers (one of each layer kind), then the quantization the config
  declares applied (FP8 block-wise: ``F8_E4M3`` weight + ``F32`` ``weight_scale_inv`` per block;
  FP8 per-tensor as AutoFP8 / AMD Quark store it; MXFP4 as GPT-OSS stores it; GPTQ as AutoGPTQ,
  AWQ as AutoAWQ, bitsandbytes 4-bit as transformers store them: the GPTQ / AWQ / compressed-tensors
  parameters from vLLM's parameter data, the bitsandbytes names from transformers' quantizers);
- data: file holes (sparse headers only), so a 600 B-parameter release costs a few MB of disk.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import re
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

from fp4forge.checkpoint.skeleton import checkpoint_specs
from fp4forge.numerics.nvfp4 import NVFP4_GLOBAL_NUMERATOR
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError
from fp4forge.testbed.synth import PER_LAYER_LIST_KEYS, truncated_config
from fp4forge.checkpoint.atomic import ensure_fresh_output
from fp4forge.checkpoint.declarations import match_ct, stored_quantization_config
from fp4forge.checkpoint.layout import bnb_serialized_names
from fp4forge.checkpoint.vllm_params import (MODEL_DTYPE, awq_key, ct_key, expected_tensors, gptq_key, quant_params_data,
                                             scheme_args, scheme_params, tensors_of)

PROVENANCE = "PROVENANCE.json"
INDEX = "model.safetensors.index.json"
QUANT_SIDECAR = "hf_quant_config.json"
# A decoder layer: `<stack>.layers.<i>.<rest>`, the stack being `model` for most causal LMs and
# `backbone` for others (Nemotron-H); the transformers class names it, never a list here.
_LAYER = re.compile(r"^(\w+\.)layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class CorpusEntry:
    name: str
    directory: Path
    config: dict[str, Any]
    index_names: tuple[str, ...] | None  # the real index's tensor names, when collected
    index_metadata: dict[str, Any]
    provenance: dict[str, Any]


def load_entry(directory: str | Path) -> CorpusEntry:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    index_names, index_metadata = None, {}
    for candidate in (directory / INDEX, directory / (INDEX + ".gz")):
        if candidate.is_file():
            raw = gzip.decompress(candidate.read_bytes()) if candidate.suffix == ".gz" else candidate.read_bytes()
            index = json.loads(raw)
            index_names, index_metadata = tuple(index["weight_map"]), index.get("metadata") or {}
    provenance_file = directory / PROVENANCE
    provenance = json.loads(provenance_file.read_text(encoding="utf-8")) if provenance_file.is_file() else {}
    return CorpusEntry(directory.name, directory, config, index_names, index_metadata, provenance)


def corpus_entries(root: str | Path) -> list[CorpusEntry]:
    return [load_entry(d) for d in sorted(Path(root).iterdir()) if (d / "config.json").is_file()]


# -- the text model and its layer kinds ----------------------------------------------------------
def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model (a wrapper's text_config, completed from the wrapper)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = config.get("text_config")
    if not isinstance(text, dict):
        return _with_derived_layer_lists(config)
    text = copy.deepcopy(text)
    if "model_type" not in text:
        text["model_type"] = f"{config['model_type']}_text"
    if text["model_type"] not in CONFIG_MAPPING:
        raise ConfigError(f"text model type {text['model_type']!r} is not known to this transformers version")
    for key in ("tie_word_embeddings", "torch_dtype", "dtype"):
        if key in config and key not in text:
            text[key] = config[key]
    return _with_derived_layer_lists(text)


def _with_derived_layer_lists(config: dict[str, Any]) -> dict[str, Any]:
    """Per-layer lists the config class derives when the file omits them (Qwen3-Next computes
    layer_types from full_attention_interval): layer kinds need them explicitly."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "layer_types" in config or config.get("model_type") not in CONFIG_MAPPING:
        return config
    config_class = CONFIG_MAPPING[config["model_type"]]
    declared = getattr(config_class, "layer_types", None)
    if isinstance(declared, property) and declared.fset is None:
        return config  # derived on read (Jamba): not a field config.json may set
    derived = getattr(config_class.from_dict(config), "layer_types", None)
    return {**config, "layer_types": list(derived)} if isinstance(derived, list) else config


def _derived_layer_settings(config: dict[str, Any]) -> list[tuple]:
    """For each layer, the per-layer settings the config class derives as lists with one entry per
    layer (Jamba's layers_block_type and layers_num_experts from its periods and offsets): two
    layers differing in any of them are layers of different kinds."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    total = config["num_hidden_layers"]
    if config.get("model_type") not in CONFIG_MAPPING:
        return [()] * total
    instance = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    lists = []
    for name in dir(instance):
        try:
            value = None if name.startswith("_") else getattr(instance, name)
        except Exception:  # noqa: BLE001 - a property that cannot be computed for this config
            continue
        if isinstance(value, list) and len(value) == total:
            lists.append([json.dumps(v, sort_keys=True, default=str) for v in value])
    return [tuple(values[i] for values in lists) for i in range(total)]


def _layer_kind(config: dict[str, Any], i: int) -> tuple:
    kind: list[Any] = [config[key][i] for key in PER_LAYER_LIST_KEYS if isinstance(config.get(key), list)]
    if isinstance(config.get("first_k_dense_replace"), int):
        kind.append(i < config["first_k_dense_replace"])
    if isinstance(config.get("mlp_only_layers"), list):
        kind.append(i in config["mlp_only_layers"])
    for key in ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step"):
        step = config.get(key)
        if isinstance(step, int) and step > 1:
            kind.append((i + 1) % step == 0)
    return tuple(kind)


def _template(text: dict[str, Any], wrapper: dict[str, Any]) -> tuple[list[TensorSpec], dict[int, list[TensorSpec]], list[int], str]:
    """Specs of a model of the first K layers (one of each kind); for each layer of the full model,
    the index of the built layer it copies; and the stack the layers are named under."""
    total = text["num_hidden_layers"]
    derived = _derived_layer_settings(text)
    kinds = [_layer_kind(text, i) + derived[i] for i in range(total)]
    first_of: dict[tuple, int] = {}
    for i, kind in enumerate(kinds):
        first_of.setdefault(kind, i)
    built = max(first_of.values()) + 1
    # The text model alone, named as its causal LM (`model.`); the wrapper's prefix is applied after.
    specs = checkpoint_specs({k: v for k, v in truncated_config(text, built).items() if k != "architectures"})
    if not any(_LAYER.match(spec.name) for spec in specs) and isinstance(wrapper.get("text_config"), dict):
        specs = _language_model_specs(wrapper, truncated_config(text, built))
    per_layer: dict[int, list[TensorSpec]] = {}
    globals_: list[TensorSpec] = []
    stacks = set()
    for spec in specs:
        match = _LAYER.match(spec.name)
        if match:
            stacks.add(match.group(1))
            per_layer.setdefault(int(match.group(2)), []).append(TensorSpec(match.group(3), spec.dtype, spec.shape))
        else:
            globals_.append(spec)
    if len(stacks) != 1:
        raise ConfigError(f"{text.get('model_type')}: decoder layers under {sorted(stacks)}, expected one `<stack>.layers.<i>`")
    return globals_, per_layer, [first_of[k] for k in kinds], stacks.pop()


def _language_model_specs(wrapper: dict[str, Any], text: dict[str, Any]) -> list[TensorSpec]:
    """A text config whose model type has no causal LM of its own (GLM-4.5V's glm4v_moe_text
    builds a bare decoder): the wrapper class built with ``text``, its language model's tensors
    named as a causal LM's (`model.language_model.` to `model.`), the head kept, the towers left
    to :func:`_naming`."""
    small = {**unquantized_config(wrapper), "text_config": text}
    out = []
    for spec in checkpoint_specs(small):
        if spec.name.startswith("model.language_model."):
            out.append(TensorSpec("model." + spec.name[len("model.language_model.") :], spec.dtype, spec.shape))
        elif not spec.name.startswith("model."):
            out.append(spec)
    return out


def _mtp_specs(text: dict[str, Any], per_layer: dict[int, list[TensorSpec]], copy_of: list[int], stack: str) -> list[TensorSpec]:
    """DeepSeek-style next-n layers after the trunk: a full decoder layer plus enorm, hnorm,
    eh_proj, shared_head.{norm,head} and an embed_tokens copy (DeepSeek-V3's published layout)."""
    count = text.get("num_nextn_predict_layers") or 0
    hidden, vocab, dtype = text["hidden_size"], text["vocab_size"], per_layer[copy_of[-1]][0].dtype
    extra = [
        ("embed_tokens.weight", (vocab, hidden)),
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.norm.weight", (hidden,)),
        ("shared_head.head.weight", (vocab, hidden)),
    ]
    specs = []
    for k in range(count):
        layer = text["num_hidden_layers"] + k
        specs += [TensorSpec(f"{stack}layers.{layer}.{s.name}", s.dtype, s.shape) for s in per_layer[copy_of[-1]]]
        specs += [TensorSpec(f"{stack}layers.{layer}.{name}", dtype, shape) for name, shape in extra]
    return specs


@dataclass(frozen=True)
class _Naming:
    """Where the text model's tensors sit on disk: its `model.` tensors under ``prefix``, its
    `lm_head.weight` as ``head``; ``towers`` are the wrapper's other tensors (vision tower,
    projector)."""

    prefix: str = "model."
    head: str = "lm_head.weight"
    towers: tuple[TensorSpec, ...] = ()

    def name(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.head
        return self.prefix + name[len("model.") :] if name.startswith("model.") else name


def _naming(config: dict[str, Any]) -> _Naming:
    """The naming of a release's wrapper class, read off the class itself built with a one-layer
    text model (the towers do not depend on the text model's depth): Qwen3.5 and GLM-4.5V keep
    their language model under `model.language_model.`, Llama 4 under `language_model.model.`
    with the head at `language_model.lm_head.weight`."""
    if not isinstance(config.get("text_config"), dict):
        # A wrapper saved flat (the Qwen3.5 REAP prunes): transformers 5's wrapper prefix.
        architectures = config.get("architectures") or [""]
        return _Naming("model.language_model." if architectures[0].endswith("ForConditionalGeneration") else "model.")
    small = {**unquantized_config(config), "text_config": truncated_config(_with_derived_layer_lists(config["text_config"]), 1)}
    specs = checkpoint_specs(small)
    embed = next(s.name for s in specs if s.name.endswith(".embed_tokens.weight"))
    prefix = embed[: -len("embed_tokens.weight")]
    head = next((s.name for s in specs if s.name.endswith("lm_head.weight")), "lm_head.weight")
    return _Naming(prefix, head, tuple(s for s in specs if not s.name.startswith(prefix) and s.name != head))


def bf16_specs(entry: CorpusEntry) -> list[TensorSpec]:
    """Every tensor of the release before any declared quantization, with real or reconstructed names."""
    text = _text_config(entry.config)
    naming = _naming(entry.config)
    globals_, per_layer, copy_of, stack = _template(text, entry.config)
    if entry.index_names is None:
        specs = [TensorSpec(naming.name(s.name), s.dtype, s.shape) for s in globals_]
        for i, j in enumerate(copy_of):
            specs += [TensorSpec(naming.name(f"{stack}layers.{i}.{s.name}"), s.dtype, s.shape) for s in per_layer[j]]
        return specs + list(naming.towers) + _mtp_specs(text, per_layer, copy_of, stack)
    # Real names: look each up in the built template (same layer kind, same suffix).
    by_suffix = {j: {s.name: s for s in layer} for j, layer in per_layer.items()}
    global_by_name = {naming.name(s.name): s for s in globals_}
    layer_re = re.compile(r"^" + re.escape(naming.name(stack)) + r"layers\.(\d+)\.(.+)$")
    # A release stored packed names the packed tensors (GPT-OSS MXFP4: `<param>_blocks` and
    # `<param>_scales`); the template holds the parameter itself, which quantized_specs packs again.
    packed = MXFP4_PACKED_SUFFIXES if (stored_quantization_config(entry.config) or {}).get("quant_method") == "mxfp4" else ()
    specs, unresolved, emitted = [], [], set()
    for name in entry.index_names:
        stem = next((name[: -len(suffix)] for suffix in packed if name.endswith(suffix)), name)
        if stem in emitted:
            continue
        match = layer_re.match(stem)
        spec = None
        if match and int(match.group(1)) < len(copy_of):
            spec = by_suffix[copy_of[int(match.group(1))]].get(match.group(2))
        elif stem in global_by_name:
            spec = global_by_name[stem]
        if spec is None:
            unresolved.append(name)
        else:
            specs.append(TensorSpec(stem, spec.dtype, spec.shape))
            emitted.add(stem)
    if unresolved:
        raise ConfigError(f"{entry.name}: {len(unresolved)} index names have no counterpart in the model class, e.g. {unresolved[:3]}")
    return specs


# -- declared quantization ---------------------------------------------------------------------
def _exclusion_regex(patterns: list[str]) -> re.Pattern[str]:
    """One regex for a declaration's exclusion list: exact module names, dotted-suffix matches
    and `*` globs (compiled once: real lists hold thousands of entries)."""
    alternatives = [re.escape(p).replace(r"\*", ".*") for p in patterns]
    return re.compile(r"^(?:.*\.)?(?:" + "|".join(alternatives) + r")$") if alternatives else re.compile("(?!)")


def quantized_specs(entry: CorpusEntry, specs: list[TensorSpec]) -> list[TensorSpec]:
    """Apply the quantization the config declares. Only the formats this corpus holds are built;
    another declaration is refused by name rather than silently left in BF16."""
    sidecar = entry.directory / QUANT_SIDECAR
    if sidecar.is_file():
        return _modelopt_specs(entry, json.loads(sidecar.read_text(encoding="utf-8")), specs)
    declaration = stored_quantization_config(entry.config)
    if not declaration:
        return specs
    method = declaration.get("quant_method")
    build = _BUILDERS.get(method)
    if build is None or (method == "bitsandbytes" and not declaration.get("load_in_4bit")):
        raise ConfigError(f"{entry.name}: building quant_method {method!r} is not implemented")
    return build(entry, specs, declaration)


def _fp8_block_specs(specs: list[TensorSpec], declaration: dict[str, Any]) -> list[TensorSpec]:
    """Block-FP8 releases quantize every Linear (attention incl. kv_a_proj_with_mqa, MLPs,
    experts, MTP eh_proj) outside their exclusions and keep embeddings, norms, routers and heads
    in BF16: an F8_E4M3 `weight` and one F32 `weight_scale_inv` per block."""
    block_out, block_in = declaration["weight_block_size"]
    skip = _exclusion_regex(list(declaration.get("modules_to_not_convert") or []) + list(declaration.get("ignored_layers") or []))
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        if module and _quantizable(module, spec) and not skip.match(module):
            rows, cols = spec.shape
            out.append(TensorSpec(spec.name, "F8_E4M3", spec.shape))
            out.append(TensorSpec(module + ".weight_scale_inv", "F32", (math.ceil(rows / block_out), math.ceil(cols / block_in))))
        else:
            out.append(spec)
    return out


# Leaves of 2-D weights no released FP8/NVFP4 checkpoint quantizes: embeddings (a vision tower's
# position table `pos_embed` too: an nn.Embedding, which no `Linear` target reaches), routers, heads
# (incl. DeepSeek's MTP shared_head.head), DeepSeek-V3.2's indexer weights_proj, and the MTP
# layer's eh_proj (vLLM builds it as a plain nn.Linear; DeepSeek-R1's shard sizes agree, see the
# deepseek-r1-fp8 corpus entry).
UNQUANTIZED_LEAVES = frozenset({"embed_tokens", "pos_embed", "gate", "shared_expert_gate", "lm_head", "head", "weights_proj", "eh_proj"})


def _quantizable(module: str, spec: TensorSpec) -> bool:
    return len(spec.shape) == 2 and module.rpartition(".")[2] not in UNQUANTIZED_LEAVES


MXFP4_BLOCK = 32  # values per E8M0 scale
MXFP4_PACKED_SUFFIXES = ("_blocks", "_scales")
NVFP4_GROUP = 16  # values per FP8 block scale


def _modelopt_specs(entry: CorpusEntry, sidecar: dict[str, Any], specs: list[TensorSpec]) -> list[TensorSpec]:
    """A ModelOpt NVFP4 export as its hf_quant_config.json declares it: every projection Linear
    outside exclude_modules stores U8 `weight` [out, in/2], F8 `weight_scale` [out, in/16], and
    F32 scalars `weight_scale_2` and `input_scale`; excluded modules keep the model dtype."""
    quantization = sidecar.get("quantization") or {}
    algo = quantization.get("quant_algo")
    if algo != "NVFP4":
        raise ConfigError(f"{entry.name}: building ModelOpt quant_algo {algo!r} is not implemented")
    return modelopt_nvfp4_specs(specs, list(quantization.get("exclude_modules") or []), quantization.get("group_size") or NVFP4_GROUP)


def modelopt_nvfp4_specs(specs: list[TensorSpec], exclude_modules: list[str], group: int = NVFP4_GROUP) -> list[TensorSpec]:
    """``specs`` as a ModelOpt NVFP4 export stores them (see :func:`_modelopt_specs`)."""
    skip = _exclusion_regex(exclude_modules)
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        if module and _quantizable(module, spec) and not skip.match(module):
            rows, cols = spec.shape
            out += [
                TensorSpec(spec.name, "U8", (rows, cols // 2)),
                TensorSpec(module + ".weight_scale", "F8_E4M3", (rows, cols // group)),
                TensorSpec(module + ".weight_scale_2", "F32", ()),
                TensorSpec(module + ".input_scale", "F32", ()),
            ]
        else:
            out.append(spec)
    return out


def _mxfp4_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """GPT-OSS as released: each fused 3-D expert tensor (transformers shape [E, in, out]) becomes
    `<name>_blocks` U8 [E, out, in/32, 16] (two E2M1 codes per byte) and `<name>_scales` U8
    [E, out, in/32] (E8M0 exponents); biases and everything else stay BF16."""
    out = []
    for spec in specs:
        if spec.name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and len(spec.shape) == 3:
            experts, rows_in, cols_out = spec.shape
            blocks = rows_in // MXFP4_BLOCK
            out.append(TensorSpec(spec.name + "_blocks", "U8", (experts, cols_out, blocks, MXFP4_BLOCK // 2)))
            out.append(TensorSpec(spec.name + "_scales", "U8", (experts, cols_out, blocks)))
        else:
            out.append(spec)
    return out


def _packed_int_params(name: str, key: str) -> list[dict[str, Any]]:
    """The parameter records (vLLM's data) a GPTQ / AWQ release stores per Linear: the
    declaration's own where vLLM accepts it; else those of an accepted declaration of the same
    method and group size (act order and symmetry change the values, not the shapes: vLLM
    refuses GPTQ act order with groups, which AutoGPTQ released), the same bit width first, else
    another with its int32-packed dimensions rescaled to the declared bits (vLLM refuses 3-bit
    GPTQ; AutoGPTQ packs 32 such values into 3 words). Checked on the data: tests/test_corpus.py."""
    own = scheme_params(key)
    if own is not None:
        return own
    wanted = scheme_args(key)
    accepted = [(args, entry["params"]) for other, entry in quant_params_data()["schemes"].items()
                if "params" in entry and _same_method_and_group(args := scheme_args(other), wanted)]
    if not accepted:
        raise ConfigError(f"{name}: vLLM's data has no {wanted['method']} parameters with group size {wanted['group_size']}")
    args, params = min(accepted, key=lambda item: item[0]["bits"] != wanted["bits"])
    return _rescaled_packing(params, Fraction(wanted["bits"], args["bits"]))


def _same_method_and_group(args: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return (args.get("method"), args.get("group_size")) == (wanted["method"], wanted["group_size"])


def _rescaled_packing(params: list[dict[str, Any]], ratio: Fraction) -> list[dict[str, Any]]:
    """``params`` at ``ratio`` times their bit width: every dimension's coefficient of one word
    per packed value count (1/8 at 4 bits) scaled by ``ratio``."""
    if ratio == 1:
        return params
    word = Fraction(1, next(p.get("values_per_element", 1) for p in params if p.get("weight")))

    def scaled(pair: list[int]) -> list[int]:
        value = Fraction(*pair) * (ratio if Fraction(*pair) == word else 1)
        return [value.numerator, value.denominator]

    return [{**p, "shape": [[scaled(a), scaled(b), c] for a, b, c in p["shape"]]} for p in params]


def _packed_int_specs(name: str, specs: list[TensorSpec], key: str, keep: Callable[[str], bool],
                      stored_beside: Callable[[str, TensorSpec], list[TensorSpec]]) -> list[TensorSpec]:
    """Each decoder Linear [out, in] not kept (``keep`` of its module) as the parameters of
    :func:`_packed_int_params` (by name; a parameter of the model's dtype takes the Linear's),
    then what the release's quantizer stores beside them that vLLM creates no parameter for
    (``stored_beside``)."""
    params = _packed_int_params(name, key)
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        if not (module and _quantizable(module, spec)) or keep(module):
            out.append(spec)
            continue
        rows, cols = spec.shape
        tensors = sorted(tensors_of(params, cols, rows), key=lambda t: t.suffix)
        if any(t.shape is None for t in tensors):
            raise ConfigError(f"{name}: {module} [{rows}, {cols}] does not divide into {key}'s parameters")
        out += [TensorSpec(f"{module}.{t.suffix}", spec.dtype if t.dtype == MODEL_DTYPE else t.dtype, t.shape) for t in tensors]
        out += stored_beside(module, spec)
    return out


def _gptq_specs(name: str, specs: list[TensorSpec], declaration: dict[str, Any], *, with_bias: bool) -> list[TensorSpec]:
    """A GPTQ release as AutoGPTQ stores it: the parameters vLLM's GPTQ method creates (`qweight`,
    `qzeros`, `scales`; see :func:`_packed_int_specs`) and two AutoGPTQ stores that vLLM has no
    parameter for: `g_idx` I32 [in] (the act-order index, which vLLM's loader drops) and, in
    AutoGPTQ versions that gave every QuantLinear a `bias` buffer, F16 [out] (``with_bias``: known
    from the release's shard sizes, see its PROVENANCE.json; vLLM's loader skips it)."""

    def stored_beside(module: str, spec: TensorSpec) -> list[TensorSpec]:
        rows, cols = spec.shape
        beside = [TensorSpec(module + ".g_idx", "I32", (cols,))]
        return beside + ([TensorSpec(module + ".bias", "F16", (rows,))] if with_bias else [])

    return _packed_int_specs(name, specs, gptq_key(declaration), lambda module: False, stored_beside)


def _awq_specs(name: str, specs: list[TensorSpec], declaration: dict[str, Any]) -> list[TensorSpec]:
    """An AutoAWQ (GEMM) release: the parameters vLLM's AWQ method creates (see
    :func:`_packed_int_specs`); a module whose name contains an entry of `modules_to_not_convert`
    keeps its weight (vLLM's is_layer_skipped_awq matches substrings)."""
    skip = list(declaration.get("modules_to_not_convert") or [])
    return _packed_int_specs(name, specs, awq_key(declaration), lambda module: any(s in module for s in skip), lambda module, spec: [])


BNB_BLOCK = 64  # values per absmax of bitsandbytes' 4-bit blockwise quantization
BNB_NESTED_BLOCK = 256  # absmax values per nested absmax (double quantization)


def _bnb4_specs(specs: list[TensorSpec], declaration: dict[str, Any]) -> list[TensorSpec]:
    """A transformers bitsandbytes 4-bit save: every Linear (routers included: transformers
    replaces each nn.Linear whose name contains no `llm_int8_skip_modules` entry) stores its
    codes flat as U8 [n/2, 1] and, by the names transformers' quantizer serializes
    (:func:`_bnb4_state_names`), its Params4bit quantization state (:func:`_bnb4_state_spec`)."""
    skip = declaration.get("llm_int8_skip_modules")
    skip = ["lm_head"] if skip is None else list(skip)  # transformers' default: keep the output head (get_keys_to_not_convert)
    quant_type, double = declaration.get("bnb_4bit_quant_type", "fp4"), bool(declaration.get("bnb_4bit_use_double_quant"))
    tails = _bnb4_state_names(quant_type, double)
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        if not module or len(spec.shape) != 2 or module.endswith("embed_tokens") or any(s in module for s in skip):
            out.append(spec)
            continue
        out.append(TensorSpec(spec.name, "U8", ((math.prod(spec.shape) + 1) // 2, 1)))
        out += [_bnb4_state_spec(module, tail, spec, quant_type, double) for tail in tails]
    return out


def _bnb4_state_names(quant_type: str, double: bool) -> list[str]:
    """The tails beside `weight` that transformers' 4-bit quantizer serializes (its data), those
    one save holds: `nested_*` only with double quantization, the packed state of its own quant
    type only; sorted, so the order does not follow the data's listing."""
    names = bnb_serialized_names()["4bit"]["weight"]
    return sorted(n for n in names if n != "weight" and (double or ".nested_" not in n)
                  and (BNB_PACKED_STATE not in n or n.endswith(BNB_PACKED_STATE + quant_type)))


BNB_PACKED_STATE = "quant_state.bitsandbytes__"  # + quant type: the QuantState's non-tensor part


def _bnb4_state_spec(module: str, tail: str, spec: TensorSpec, quant_type: str, double: bool) -> TensorSpec:
    """One serialized tensor of a Params4bit's QuantState: the data names it, bitsandbytes'
    QuantState.as_dict(packed=True) gives it its dtype and shape (`absmax` F32 per 64 values, or
    U8 with double quantization, whose `nested_absmax` has one F32 per 256 of those and
    `nested_quant_map` 256 entries; `quant_map` F32 [16]; the packed JSON state as U8)."""
    blocks = math.ceil(math.prod(spec.shape) / BNB_BLOCK)
    shapes = {
        "weight.absmax": ("U8" if double else "F32", (blocks,)),
        "weight.nested_absmax": ("F32", (math.ceil(blocks / BNB_NESTED_BLOCK),)),
        "weight.nested_quant_map": ("F32", (256,)),
        "weight.quant_map": ("F32", (16,)),
        "weight." + BNB_PACKED_STATE + quant_type: ("U8", (len(_bnb_packed_state(quant_type, double, spec)),)),
    }
    if tail not in shapes:
        raise ConfigError(f"transformers serializes `{tail}` beside a 4-bit weight, which this builder cannot size")
    dtype, shape = shapes[tail]
    return TensorSpec(f"{module}.{tail}", dtype, shape)


def _bnb_packed_state(quant_type: str, double: bool, spec: TensorSpec) -> bytes:
    """The non-tensor part of a Params4bit's QuantState as bitsandbytes packs it (json.dumps of
    as_dict(packed=True)'s plain values, UTF-8): its length is the stored tensor's."""
    dtype = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[spec.dtype]
    state: dict[str, Any] = {"quant_type": quant_type, "blocksize": BNB_BLOCK, "dtype": dtype, "shape": list(spec.shape)}
    if double:
        state.update(nested_blocksize=BNB_NESTED_BLOCK, nested_dtype="float32", nested_offset=0.0)
    return json.dumps(state).encode()


def _fp8_tensor_specs(specs: list[TensorSpec], declaration: dict[str, Any], kv_scale_name: str | None) -> list[TensorSpec]:
    """An FP8 per-tensor release (`quant_method: fp8` without a block size, as AutoFP8 and AMD
    Quark's vLLM export write it): each Linear outside `ignored_layers` stores an F8_E4M3
    `weight` and F32 scalars `weight_scale` and, with static activations, `input_scale`. A
    `kv_cache_scheme` adds one KV scale per attention layer under ``kv_scale_name`` (the
    release's naming, from its PROVENANCE.json)."""
    skip = _exclusion_regex(list(declaration.get("ignored_layers") or []) + list(declaration.get("modules_to_not_convert") or []))
    static = declaration.get("activation_scheme") == "static"
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        if not (module and _quantizable(module, spec)) or skip.match(module):
            out.append(spec)
            continue
        out += [TensorSpec(spec.name, "F8_E4M3", spec.shape), TensorSpec(module + ".weight_scale", "F32", ())]
        if static:
            out.append(TensorSpec(module + ".input_scale", "F32", ()))
        if declaration.get("kv_cache_scheme") and kv_scale_name and module.endswith(".self_attn.k_proj"):
            out.append(TensorSpec(module[: -len("self_attn.k_proj")] + kv_scale_name, "F32", ()))
    return out


def _compressed_tensors_specs(name: str, specs: list[TensorSpec], declaration: dict[str, Any]) -> list[TensorSpec]:
    """A compressed-tensors release with one config group targeting every `Linear`: each Linear
    outside `ignore` stored as the parameters vLLM's scheme for that group creates (the data
    :mod:`fp4forge.checkpoint.vllm_params` took from vLLM's own ``create_weights``); a parameter
    of the model's dtype takes the Linear's stored dtype."""
    groups = list((declaration.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        raise ConfigError(f"{name}: building compressed-tensors groups other than one `Linear` target is not implemented")
    key = ct_key(groups[0], declaration.get("format"))
    ignore = list(declaration.get("ignore") or [])
    out = []
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        if not (module and _quantizable(module, spec)) or any(match_ct(p, module) for p in ignore):
            out.append(spec)
            continue
        rows, cols = spec.shape
        params = expected_tensors(key, cols, rows)
        if params is None or any(p.shape is None for p in params):
            raise ConfigError(f"{name}: vLLM's data has no parameters for {module} [{rows}, {cols}] under {key}")
        out += [TensorSpec(f"{module}.{p.suffix}", spec.dtype if p.dtype == MODEL_DTYPE else p.dtype, p.shape) for p in params]
    return out


# The stored layouts the corpus rebuilds, by the declaration's quant_method (a table, not a chain
# of name comparisons: a method not in it is refused by name).
_BUILDERS: dict[str, Callable[[CorpusEntry, list[TensorSpec], dict[str, Any]], list[TensorSpec]]] = {
    "mxfp4": lambda entry, specs, declaration: _mxfp4_specs(specs),
    "gptq": lambda entry, specs, declaration: _gptq_specs(entry.name, specs, declaration, with_bias=bool(entry.provenance.get("gptq_zero_bias"))),
    "awq": lambda entry, specs, declaration: _awq_specs(entry.name, specs, declaration),
    "bitsandbytes": lambda entry, specs, declaration: _bnb4_specs(specs, declaration),
    "compressed-tensors": lambda entry, specs, declaration: _compressed_tensors_specs(entry.name, specs, declaration),
    "fp8": lambda entry, specs, declaration: (_fp8_block_specs(specs, declaration) if declaration.get("weight_block_size")
                                              else _fp8_tensor_specs(specs, declaration, entry.provenance.get("kv_scale_name"))),
}


def entry_specs(entry: CorpusEntry) -> list[TensorSpec]:
    return quantized_specs(entry, bf16_specs(entry))


def family(entry: CorpusEntry) -> str:
    """The architecture family of a release: the model_type of its text model."""
    return _text_config(entry.config)["model_type"]


def build_nvfp4_export(entry: CorpusEntry | str | Path, out: str | Path, *, keep_bf16: str | None = None) -> Path:
    """The release's tensors, before its own quantization, written header-only as a ModelOpt NVFP4
    export of its projection Linears (:func:`fp4forge.testbed.moe_zoo.write_nvfp4_export`);
    ``keep_bf16`` names one module left unquantized under that declaration."""
    from fp4forge.testbed.moe_zoo import write_nvfp4_export

    entry = entry if isinstance(entry, CorpusEntry) else load_entry(entry)
    out = Path(out)
    ensure_fresh_output(out)
    return write_nvfp4_export(bf16_specs(entry), unquantized_config(entry.config), out, keep_bf16=keep_bf16)


def unquantized_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without its quantization declaration (top level and text config)."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


# Per-tensor scales (F32 scalars: NVFP4 global and input scales, FP8 per-tensor weight scales, a
# layer's KV scale) are written with a value, everything else is a hole: the real values are not
# in the metadata, and a hole reads as 0.0, which the audit rightly calls an invalid scale. The
# placeholder is amax/(6*448) for an amax of 1.0 (ModelOpt's convention); nothing checks it
# against the (absent) weights.
PER_TENSOR_SCALES = (".weight_scale_2", ".input_scale", ".weight_scale", ".kv_scale")
PLACEHOLDER_SCALE = struct.pack("<f", 1.0 / NVFP4_GLOBAL_NUMERATOR)


def build_header_only(entry: CorpusEntry | str | Path, out: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``entry`` as a header-only checkpoint (data regions are file holes) to ``out``."""
    entry = entry if isinstance(entry, CorpusEntry) else load_entry(entry)
    out = Path(out)
    ensure_fresh_output(out)
    sidecar = entry.directory / QUANT_SIDECAR
    extra = {QUANT_SIDECAR: sidecar.read_text(encoding="utf-8")} if sidecar.is_file() else {}
    return write_header_only(out, entry_specs(entry), entry.config, extra, max_shard_bytes=max_shard_bytes)


def write_header_only(out: Path, specs: list[TensorSpec], config: dict[str, Any], files: dict[str, str], *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """``specs`` as a checkpoint whose data are file holes (per-tensor scales hold a placeholder),
    with its config.json and the other small ``files`` (name -> text)."""
    with CheckpointWriter(out, specs, max_shard_bytes=max_shard_bytes, sparse=True) as writer:
        for spec in specs:
            if spec.name.endswith(PER_TENSOR_SCALES) and spec.dtype == "F32" and math.prod(spec.shape) == 1:
                writer.write(spec.name, PLACEHOLDER_SCALE)
        writer.write_text("config.json", json.dumps(config, indent=2) + "\n")
        for name, text in files.items():
            writer.write_text(name, text)
    return out


__all__ = ["CorpusEntry", "build_header_only", "build_nvfp4_export", "corpus_entries", "entry_specs", "family", "load_entry", "unquantized_config"]
