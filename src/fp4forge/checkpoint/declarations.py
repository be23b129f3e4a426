"""Read what a checkpoint *declares* about its quantization into one typed structure, whether it
is written compressed-tensors style (config.json ``quantization_config``, quant_method
``compressed-tensors``) or ModelOpt style (``quant_method: modelopt`` in config.json, or
``hf_quant_config.json``), and resolve it per Linear module: which scheme of
``checkpoint/layouts/_schemes.toml`` each module must carry, which are ignored, which targets
match nothing.

vLLM reads config.json's ``quantization_config`` first and falls back to hf_quant_config.json
only when it is absent (docs/formats.md#modelopt-declaration); so does this module. Problems vLLM would reject or
misread are collected as plain messages in ``QuantDeclaration.problems``.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from fp4forge.checkpoint import vllm_ct, vllm_params
from fp4forge.checkpoint.names import HF_QUANT_CONFIG_JSON as HF_QUANT_CONFIG

CT = "compressed-tensors"
MODELOPT = "modelopt"
FORMATS = (CT, MODELOPT)  # the layouts fp4forge writes
# Formats the world ships that fp4forge reads and audits but does not write: block-wise FP8 as
# DeepSeek-V3/R1 and Qwen's *-FP8 releases declare it (quant_method fp8 + weight_block_size,
# `<m>.weight_scale_inv`), and MXFP4 as GPT-OSS ships it (`<experts>.<proj>_blocks/_scales`).
FP8_BLOCK = "fp8"
MXFP4 = "mxfp4"
READ_FORMATS = FORMATS + (FP8_BLOCK, MXFP4)
# Formats whose per-Linear tensors come from vLLM's own quant methods (checkpoint/vllm_params.py),
# and bitsandbytes, which vLLM 0.32 does not load but whose packing is known (two 4-bit values
# per byte, bitsandbytes' Params4bit; 8-bit: one value per int8).
GPTQ, AWQ, BNB = "gptq", "awq", "bitsandbytes"
KEYED_FORMATS = (GPTQ, AWQ)
METHOD_ALIASES = {**{m: GPTQ for m in vllm_params.GPTQ_METHODS}, **{m: AWQ for m in vllm_params.AWQ_METHODS}}
NO_METHOD = "unknown"  # a quantization_config without quant_method
# layouts whose vLLM 0.32 loading fails on a fused shard's or routed expert's tensor that no
# parameter takes (compressed-tensors); ModelOpt's loader skips it (docs/audit.md#agreement-with-vllm)
FUSED_LOADING_REFUSES_EXTRA = frozenset({CT})
LINEAR_CLASS_TARGET = "Linear"

# compressed-tensors QuantizationArgs -> scheme key of _schemes.toml. Each row: the weights'
# (num_bits, type, strategy), then what the input activations must be for that scheme:
# "nvfp4" (4-bit float tensor_group), "static-tensor" (8-bit float, per tensor, dynamic false),
# "dynamic" (dynamic true) or None (no input_activations).
CT_SCHEMES: tuple[tuple[tuple[int, str, str], str | None, str], ...] = (
    ((4, "float", "tensor_group"), "nvfp4", "nvfp4"),
    ((4, "float", "tensor_group"), None, "nvfp4a16"),
    ((8, "float", "tensor"), "static-tensor", "fp8"),
    ((8, "float", "channel"), "dynamic", "fp8_dynamic"),
    ((8, "float", "channel"), None, "fp8_dynamic"),
    ((8, "float", "block"), "dynamic", "fp8_block"),
    ((8, "float", "block"), None, "fp8_block"),
)
# compressed-tensors `format` of a config group holding each scheme.
CT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "nvfp4a16": "nvfp4-pack-quantized", "fp8": "float-quantized", "fp8_dynamic": "float-quantized", "fp8_block": "float-quantized"}
# scheme key -> the ModelOpt quant_algo that spells it (what fp4forge writes); the one table.
MODELOPT_ALGOS = {"nvfp4": "NVFP4", "nvfp4a16": "W4A16_NVFP4", "fp8": "FP8"}
# ModelOpt quant_algo -> scheme key, for reading: the inverse, plus the alias ModelOpt also accepts.
SCHEME_OF_MODELOPT_ALGO = {algo: scheme for scheme, algo in MODELOPT_ALGOS.items()} | {"NVFP4_W4A16": "nvfp4a16"}
# ModelOpt's config.json form of a static FP8 KV cache (vLLM needs `dynamic: false` to honour it).
MODELOPT_FP8_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
# Keys vLLM requires, per form (docs/formats.md#compressed-tensors-declaration,
# docs/formats.md#modelopt-declaration).
CT_KV_REQUIRED = ("strategy", "symmetric")
HF_QUANT_REQUIRED = ("group_size", "kv_cache_quant_algo", "exclude_modules")
KV_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4"}
NVFP4_GROUP = 16  # values per NVFP4 block scale; vLLM creates NVFP4 weight scales for no other size
NVFP4_SCHEMES = ("nvfp4", "nvfp4a16")


@dataclass(frozen=True)
class SchemeGroup:
    """One config group (CT) or the single quant_algo (ModelOpt): a scheme and what it targets."""

    name: str
    scheme: str | None  # key in _schemes.toml; None: a scheme fp4forge has no tensor table for
    targets: tuple[str, ...]
    description: str  # how the declaration spells it, for messages
    block: tuple[int, int] | None = None  # FP8 block-wise: [out, in] values per weight scale
    key: str | None = None  # the scheme key of vLLM's parameter data (checkpoint/vllm_params.py)
    packing: int | None = None  # values per stored weight element, for a format vLLM's data lacks (bnb)
    expert_refusal: str | None = None  # why vLLM's FusedMoE refuses the group for routed experts

    @property
    def values_per_element(self) -> int | None:
        """Logical parameters per stored element of this group's weight tensor: from vLLM's
        parameter data (8 for 4-bit values in an int32), else the format's own packing."""
        if self.key is not None:
            return vllm_params.weight_values_per_element(self.key)
        return self.packing


@dataclass(frozen=True)
class KvDeclaration:
    algo: str  # "fp8" | "nvfp4"
    strategy: str  # "tensor" | "attn_head"
    dynamic: bool
    where: str


@dataclass
class QuantDeclaration:
    format: str  # CT | MODELOPT
    where: str  # "config.json quantization_config" | "hf_quant_config.json"
    groups: list[SchemeGroup]
    ignore: tuple[str, ...]
    kv: KvDeclaration | None
    problems: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # schemes declared but not audited
    literal_ignore: bool = False  # the engine skips exactly `ignore`, its own unquantized Linears (routers) not added
    sidecar_differences: list[str] = field(default_factory=list)  # hf_quant_config.json vs the config.json vLLM reads
    loader_differences: list[str] = field(default_factory=list)  # what vLLM accepts and other loaders read otherwise

    @property
    def matcher(self) -> Callable[[str, str], bool]:
        return {CT: match_ct, MODELOPT: match_modelopt, AWQ: match_substring}.get(self.format, match_skip_list)


# -- matching -------------------------------------------------------------------------------------
def match_ct(pattern: str, module: str) -> bool:
    """compressed-tensors target / ignore matching as vLLM does it: `re:` + re.match, else the
    exact name. An ancestor (`model.layers.1`, an expert stack `...mlp.experts`) matches nothing:
    vLLM asks per Linear, an expert by its own name (measured: docs/audit.md#agreement-with-vllm)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern


def match_modelopt(pattern: str, module: str) -> bool:
    """ModelOpt exclude_modules / quantized_layers as vLLM's ModelOpt config matches them: the
    exact name, then any substring of the module name (also with a leading `language_model.`
    dropped), then an fnmatch wildcard over the whole name. A substring match is wider than a
    dotted ancestor: `model.layers.1` also excludes `model.layers.12.*`, as it does in vLLM."""
    if pattern == module or pattern in module:
        return True
    if module.startswith("language_model.") and pattern in module.removeprefix("language_model."):
        return True
    return fnmatch.fnmatchcase(module, pattern)


def match_skip_list(pattern: str, module: str) -> bool:
    """`modules_to_not_convert` / `ignored_layers` of an fp8 or mxfp4 declaration: the exact module
    or an ancestor of it (vLLM's is_layer_skipped), or an fnmatch wildcard (transformers' own
    loader, e.g. GPT-OSS's `model.layers.*.self_attn`)."""
    if module == pattern or module.startswith(pattern + "."):
        return True
    return any(c in pattern for c in "*?[") and any(fnmatch.fnmatchcase(p, pattern) for p in _self_and_parents(module))


def match_substring(pattern: str, module: str) -> bool:
    """AWQ's `modules_to_not_convert` as vLLM's AutoAWQConfig matches it (is_layer_skipped,
    match_mode "substring"): any entry contained in the module name."""
    return pattern in module


def is_class_name(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


# -- parsing --------------------------------------------------------------------------------------
def _ct_input_kind(inputs: Any) -> str | None:
    if inputs is None:
        return None
    if not isinstance(inputs, dict):
        return "invalid"
    if (inputs.get("num_bits"), inputs.get("type"), inputs.get("strategy"), inputs.get("group_size")) == (4, "float", "tensor_group", NVFP4_GROUP) and inputs.get("symmetric", True) is not False:
        return "nvfp4"  # vLLM's _is_nvfp4_format: 16-value groups, symmetric, whatever `dynamic` says
    if inputs.get("dynamic") is True:
        return "dynamic"
    if (inputs.get("num_bits"), inputs.get("type"), inputs.get("strategy"), inputs.get("dynamic")) == (8, "float", "tensor", False):
        return "static-tensor"
    return "other"


def _ct_scheme(weights: dict[str, Any], inputs: Any) -> str | None:
    key = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"))
    kind = _ct_input_kind(inputs)
    for weight_key, input_kind, scheme in CT_SCHEMES:
        if weight_key == key and input_kind == kind:
            return scheme
    return None


def _ct_group_problems(name: str, group: dict[str, Any], top_format: str | None) -> list[str]:
    """vLLM's own refusal of the group: its scheme choice mirrored (checkpoint/vllm_ct.py)."""
    refusal = vllm_ct.group_refusal(group, top_format)
    return [f"config group {name!r}: {refusal}; vLLM refuses it"] if refusal else []


def _ct_format_judgement(name: str, group: dict[str, Any], top_format: str | None, scheme: str | None) -> tuple[str, str] | None:
    """A group `format` string other than compressed-tensors' own for its arguments, as
    ("problem" | "difference", message). vLLM picks the scheme from the arguments and reads the
    string only to tell activation formats from others (_get_scheme_from_parts): where the
    canonical string gives vLLM the same scheme, the string matters only to compressed-tensors'
    decompressor (transformers, llm-compressor), a difference; where vLLM builds another scheme,
    a problem (a refusal is _ct_group_problems')."""
    fmt = group.get("format") or top_format
    if scheme is None or fmt in (None, "mixed-precision", CT_FORMATS[scheme]) or vllm_ct.group_refusal(group, top_format):
        return None
    said = f"config group {name!r}: format {fmt!r} disagrees with its {scheme} arguments (compressed-tensors decompresses {scheme} as {CT_FORMATS[scheme]!r})"
    built, canonical = vllm_ct.vllm_scheme(group, top_format), vllm_ct.vllm_scheme({**group, "format": CT_FORMATS[scheme]}, None)
    if built != canonical:
        return "problem", f"{said}; vLLM builds {built} instead of {canonical}"
    return "difference", f"{said}; vLLM builds {built} either way"


def parse_compressed_tensors(qc: dict[str, Any]) -> QuantDeclaration:
    where = "config.json quantization_config"
    problems: list[str] = []
    groups: list[SchemeGroup] = []
    unsupported: list[str] = []
    loader_differences: list[str] = []
    raw_groups = qc.get("config_groups")
    # A KV-cache-only declaration (empty config_groups + kv_cache_scheme) is valid: vLLM 0.32
    # serves it with an FP8 cache and BF16 weights (what `fp4forge kv calibrate` writes).
    kv_only = raw_groups == {} and isinstance(qc.get("kv_cache_scheme"), dict)
    if not isinstance(raw_groups, dict) or (not raw_groups and not kv_only):
        problems.append("quantization_config has no config_groups")
        raw_groups = {}
    for name, group in raw_groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            problems.append(f"config group {name!r} has no weights arguments")
            continue
        targets = group.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        problems.extend(_ct_group_problems(name, group, qc.get("format")))
        scheme = _ct_scheme(group["weights"], group.get("input_activations"))
        fmt = group.get("format") or qc.get("format")
        judged = _ct_format_judgement(name, group, qc.get("format"), scheme)
        if judged:
            (problems if judged[0] == "problem" else loader_differences).append(judged[1])
        description = f"{name} ({fmt or 'format?'})"
        key = vllm_params.ct_key(group, qc.get("format"))
        if scheme is None and vllm_params.scheme_entry(key) is None:
            unsupported.append(description)
        block = _block_size(group["weights"].get("block_structure"), problems, f"config group {name!r} block_structure") if scheme == "fp8_block" else None
        expert_refusal = None if vllm_ct.group_refusal(group, qc.get("format")) else vllm_ct.moe_refusal(group, qc.get("format"))
        groups.append(SchemeGroup(name=name, scheme=scheme, targets=tuple(targets), description=description, block=block, key=key, expert_refusal=expert_refusal))
    ignore = qc.get("ignore") or []
    kv = _ct_kv(qc.get("kv_cache_scheme"), problems)
    if qc.get("sparsity_config"):
        problems.append("sparsity_config is not empty; vLLM raises DeprecationWarning for sparse compressed-tensors")
    return QuantDeclaration(CT, where, groups, tuple(ignore), kv, problems, unsupported, loader_differences=loader_differences)


def _ct_kv(scheme: Any, problems: list[str]) -> KvDeclaration | None:
    if scheme is None:
        return None
    where = "config.json quantization_config.kv_cache_scheme"
    if not isinstance(scheme, dict):
        problems.append(f"kv_cache_scheme is {scheme!r}, not an object")
        return None
    missing = [key for key in CT_KV_REQUIRED if key not in scheme or scheme[key] is None]
    if missing:
        problems.append(f"kv_cache_scheme lacks {', '.join(missing)}; vLLM's validate_kv_cache_scheme raises on it")
    if scheme.get("symmetric") is False:
        problems.append("kv_cache_scheme is asymmetric; vLLM supports symmetric FP8 KV only")
    if (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
        problems.append(f"kv_cache_scheme {scheme.get('type')}/{scheme.get('num_bits')} bits; vLLM supports 8-bit float only")
        return None
    strategy = scheme.get("strategy") or "tensor"
    if strategy not in ("tensor", "attn_head"):
        problems.append(f"kv_cache_scheme strategy {strategy!r}; vLLM supports tensor and attn_head")
    return KvDeclaration("fp8", strategy, scheme.get("dynamic") is True, where)


def parse_modelopt(doc: dict[str, Any], *, where: str) -> QuantDeclaration:
    """config.json's ModelOpt quantization_config, or hf_quant_config.json's `quantization`."""
    problems: list[str] = []
    unsupported: list[str] = []
    quant = doc.get("quantization") if where == HF_QUANT_CONFIG else doc
    if not isinstance(quant, dict):
        return QuantDeclaration(MODELOPT, where, [], (), None, [f"{where} has no `quantization` object"])
    algo = quant.get("quant_algo")
    if where == HF_QUANT_CONFIG and isinstance(algo, str) and "FP4" in algo.upper():
        missing = [key for key in HF_QUANT_REQUIRED if key not in quant]
        if missing:
            problems.append(f"{where} lacks {', '.join(missing)}; vLLM's ModelOptNvFp4Config requires them")
    exclude = quant.get("exclude_modules", quant.get("ignore")) or []
    groups: list[SchemeGroup] = []
    if algo == "MIXED_PRECISION":
        groups = _mixed_precision_groups(quant, unsupported)
    elif algo is not None:
        scheme = SCHEME_OF_MODELOPT_ALGO.get(algo)
        if scheme == "nvfp4" and _all_groups_weight_only(quant):
            scheme = "nvfp4a16"  # vLLM reroutes it (PR #54427)
        if scheme is None and vllm_params.scheme_entry(vllm_params.modelopt_key(algo, quant.get("group_size"))) is None:
            unsupported.append(f"quant_algo {algo}")
        if scheme in NVFP4_SCHEMES and quant.get("group_size", NVFP4_GROUP) not in (None, NVFP4_GROUP):
            problems.append(f"{where}: {algo} with group_size {quant.get('group_size')!r}; vLLM creates the weight scales of that "
                            f"group size, and the {NVFP4_GROUP}-value NVFP4 block scales do not load into them")
        groups = [SchemeGroup(f"quant_algo {algo}", scheme, ("*",), f"quant_algo {algo}", key=vllm_params.modelopt_key(algo, quant.get("group_size")))]
    kv = _modelopt_kv(quant, where, problems)
    return QuantDeclaration(MODELOPT, where, groups, tuple(exclude), kv, problems, unsupported)


def _mixed_precision_groups(quant: dict[str, Any], unsupported: list[str]) -> list[SchemeGroup]:
    """MIXED_PRECISION's `quantized_layers`: one group per (quant_algo, group_size), keyed in vLLM's
    parameter data by the layer's own group size, else the checkpoint's."""
    by_algo: dict[tuple[Any, Any], list[str]] = {}
    for module, entry in (quant.get("quantized_layers") or {}).items():
        entry = entry or {}
        by_algo.setdefault((entry.get("quant_algo"), entry.get("group_size", quant.get("group_size"))), []).append(module)
    groups = []
    for (layer_algo, group_size), modules in by_algo.items():
        scheme = SCHEME_OF_MODELOPT_ALGO.get(layer_algo)
        key = vllm_params.modelopt_key(layer_algo, group_size)
        if scheme is None and vllm_params.scheme_entry(key) is None and f"quantized_layers {layer_algo}" not in unsupported:
            unsupported.append(f"quantized_layers {layer_algo}")
        groups.append(SchemeGroup(f"quantized_layers {layer_algo}", scheme, tuple(modules), f"MIXED_PRECISION {layer_algo}", key=key))
    return groups


def _all_groups_weight_only(quant: dict[str, Any]) -> bool:
    groups = quant.get("config_groups")
    return isinstance(groups, dict) and bool(groups) and all(
        isinstance(g, dict) and g.get("input_activations") is None for g in groups.values()
    )


def _modelopt_kv(quant: dict[str, Any], where: str, problems: list[str]) -> KvDeclaration | None:
    """vLLM checks kv_cache_scheme before kv_cache_quant_algo (docs/formats.md#kv-cache-dtype-resolution)."""
    scheme = quant.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        if scheme.get("dynamic") is not False:
            problems.append(
                "ModelOpt kv_cache_scheme lacks `dynamic: false`; vLLM then resolves the KV dtype to auto "
                "(BF16) and ignores the declaration"
            )
            return None
        if (scheme.get("type"), scheme.get("num_bits")) == ("float", 8):
            return KvDeclaration("fp8", "tensor", False, f"{where} kv_cache_scheme")
        if (scheme.get("type"), scheme.get("num_bits")) == ("float", 4):
            return KvDeclaration("nvfp4", "tensor", False, f"{where} kv_cache_scheme")
        problems.append(f"ModelOpt kv_cache_scheme {scheme} is neither FP8 nor NVFP4")
        return None
    algo = scheme if isinstance(scheme, str) else quant.get("kv_cache_quant_algo")
    if algo is None:
        return None
    kv = KV_ALGOS.get(str(algo).upper())
    if kv is None:
        problems.append(f"kv_cache_quant_algo {algo!r} is unknown to vLLM (it falls back to auto, a BF16 cache)")
        return None
    # vLLM's ModelOpt configs give every attention layer their KV cache method whatever the form,
    # so a config.json declaring the cache only as kv_cache_quant_algo loads its k/v scales too
    # (docs/formats.md#kv-cache-dtype-resolution)
    return KvDeclaration(kv, "tensor", False, f"{where} kv_cache_quant_algo")


def _block_size(value: Any, problems: list[str], where: str) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int and v > 0 for v in value):
        return int(value[0]), int(value[1])
    problems.append(f"{where} is {value!r}, not two positive integers [out, in]")
    return None


def parse_fp8(qc: dict[str, Any]) -> QuantDeclaration:
    """`quant_method: fp8` (transformers' FineGrainedFP8, vLLM's Fp8Config): every Linear but the
    ignored ones stores an F8_E4M3 weight; with `weight_block_size` one F32 `weight_scale_inv` per
    [out, in] block (DeepSeek-V3/R1, Qwen *-FP8). vLLM reads `ignored_layers`, else
    `modules_to_not_convert`."""
    where = "config.json quantization_config"
    problems: list[str] = []
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    key = vllm_params.fp8_key(qc)
    if qc.get("weight_block_size") is None:  # per tensor: judged by vLLM's parameter data alone
        groups = [SchemeGroup("quant_method fp8", None, (LINEAR_CLASS_TARGET,), "fp8 per-tensor", key=key)]
        unsupported = [f"fp8 per-tensor, activation_scheme {qc.get('activation_scheme')!r}"] if vllm_params.scheme_entry(key) is None else []
        return QuantDeclaration(FP8_BLOCK, where, groups, tuple(ignore), None, problems, unsupported)
    block = _block_size(qc["weight_block_size"], problems, "weight_block_size")
    if "activation_scheme" not in qc:  # vLLM's Fp8Config.from_config reads the key unconditionally
        problems.append("quant_method fp8 without activation_scheme; vLLM refuses it")
    elif qc.get("activation_scheme") != "dynamic":
        problems.append(f"block-wise FP8 with activation_scheme {qc.get('activation_scheme')!r}; vLLM supports only dynamic activations with weight_block_size")
    groups = [SchemeGroup("quant_method fp8", "fp8_block", (LINEAR_CLASS_TARGET,), f"fp8 block {block[0]}x{block[1]}" if block else "fp8 block", block=block, key=key)] if block else []
    return QuantDeclaration(FP8_BLOCK, where, groups, tuple(ignore), None, problems)


def parse_mxfp4(qc: dict[str, Any]) -> QuantDeclaration:
    """`quant_method: mxfp4` (GPT-OSS): only the routed experts are MXFP4 (`<proj>_blocks` codes and
    `<proj>_scales` E8M0 exponents); vLLM runs every Linear unquantized."""
    ignore = qc.get("modules_to_not_convert") or []
    groups = [SchemeGroup("quant_method mxfp4", "mxfp4", ("experts",), "mxfp4 experts")]
    return QuantDeclaration(MXFP4, "config.json quantization_config", groups, tuple(ignore), None)


def parse_gptq_awq(fmt: str, qc: dict[str, Any]) -> QuantDeclaration:
    """GPTQ (`gptq`, `gptq_marlin`, `auto_gptq`) and AWQ (`awq`, `awq_marlin`, `auto_awq`): every
    Linear of the decoder layers carries the parameters vLLM's method creates for the declared
    bits / group size / desc_act / sym (AWQ: zero_point), keyed in vLLM's parameter data. vLLM
    quantizes lm_head only with `lm_head: true`; AWQ skips `modules_to_not_convert`; GPTQ's
    per-module `dynamic` overrides are not resolved (a problem says so)."""
    key = vllm_params.gptq_key(qc) if fmt == GPTQ else vllm_params.awq_key(qc)
    problems = []
    if fmt == GPTQ and qc.get("dynamic"):
        problems.append("GPTQ `dynamic` per-module overrides are not resolved: modules they change are judged by the base scheme")
    problems += [f"none of {', '.join(f'`{k}`' for k in keys)}: vLLM {vllm_params.vllm_version()}'s {fmt} config class requires it and refuses to start"
                 for keys in vllm_params.required_keys(fmt) if not any(k in qc for k in keys)]
    ignore = list(qc.get("modules_to_not_convert") or []) if fmt == AWQ else []
    if not qc.get("lm_head"):
        ignore.append("lm_head")
    description = f"{fmt} " + ", ".join(f"{k}={v}" for k, v in sorted(vllm_params.scheme_args(key).items()) if k != "method")
    groups = [SchemeGroup(f"quant_method {fmt}", None, (LINEAR_CLASS_TARGET,), description, key=key)]
    unsupported = [description] if vllm_params.scheme_entry(key) is None else []
    # vLLM derives the Linears it leaves unquantized from the stored dtypes (routers stored BF16
    # included), except where AWQ names them: then it skips exactly those
    literal = fmt == AWQ and bool(qc.get("modules_to_not_convert"))
    return QuantDeclaration(fmt, "config.json quantization_config", groups, tuple(ignore), None, problems, unsupported, literal_ignore=literal)


def parse_bitsandbytes(qc: dict[str, Any]) -> QuantDeclaration:
    """transformers' BitsAndBytesConfig: 4-bit (nf4/fp4, two values per U8 byte, the quantization
    state in `<m>.weight.absmax` / `quant_map` / `nested_*` / `quant_state.*`) or 8-bit (int8
    `<m>.weight`, `<m>.SCB`); `llm_int8_skip_modules` stay unquantized."""
    four = bool(qc.get("load_in_4bit")) or qc.get("_load_in_4bit") is True
    description = f"bitsandbytes 4-bit {qc.get('bnb_4bit_quant_type', 'fp4')}" if four else "bitsandbytes 8-bit"
    if four and qc.get("bnb_4bit_use_double_quant"):
        description += ", double quant"
    groups = [SchemeGroup("quant_method bitsandbytes", None, (LINEAR_CLASS_TARGET,), description, packing=2 if four else 1)]
    ignore = tuple(qc.get("llm_int8_skip_modules") or ())
    return QuantDeclaration(BNB, "config.json quantization_config", groups, ignore, None)


def stored_quantization_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` as stored (None when absent): for code that rebuilds
    what a declaration describes rather than auditing it."""
    qc = (config or {}).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def detect_format(config: dict[str, Any] | None, extra_json: dict[str, Any]) -> str | None:
    """The format vLLM will read: config.json's quantization_config first, then hf_quant_config.json."""
    qc = (config or {}).get("quantization_config")
    if isinstance(qc, dict):
        method = str(qc.get("quant_method") or "")
        if method == CT:
            return CT
        if method.startswith(MODELOPT):
            return MODELOPT
        return method or NO_METHOD
    if HF_QUANT_CONFIG in extra_json:
        return MODELOPT
    return None


def read_declaration(config: dict[str, Any] | None, extra_json: dict[str, Any]) -> QuantDeclaration | None:
    """The declaration vLLM would act on, or None when the checkpoint declares no quantization.
    A declaration whose parts have the wrong JSON types (a list where a name belongs, ...) is one
    problem (a quant-config-invalid finding) with nothing declared, never an exception."""
    try:
        return _read_declaration(config, extra_json)
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        detected = str(detect_format(config, extra_json))
        where = "config.json quantization_config" if isinstance((config or {}).get("quantization_config"), dict) else HF_QUANT_CONFIG
        return QuantDeclaration(detected, where, [], (), None, [f"{where} is malformed ({type(exc).__name__}: {exc})"])


def _read_declaration(config: dict[str, Any] | None, extra_json: dict[str, Any]) -> QuantDeclaration | None:
    detected = detect_format(config, extra_json)
    qc = (config or {}).get("quantization_config")
    if detected == CT:
        return parse_compressed_tensors(qc)
    if detected == MODELOPT and isinstance(qc, dict):
        decl = parse_modelopt(qc, where="config.json quantization_config")
        sidecar = extra_json.get(HF_QUANT_CONFIG)
        if isinstance(sidecar, dict):
            decl.sidecar_differences.extend(_modelopt_disagreements(decl, parse_modelopt(sidecar, where=HF_QUANT_CONFIG)))
        return decl
    if detected == MODELOPT:
        doc = extra_json[HF_QUANT_CONFIG]
        return parse_modelopt(doc if isinstance(doc, dict) else {}, where=HF_QUANT_CONFIG)
    if detected == FP8_BLOCK:
        return parse_fp8(qc)
    if detected == MXFP4:
        return parse_mxfp4(qc)
    if METHOD_ALIASES.get(str(detected)) in KEYED_FORMATS:
        return parse_gptq_awq(METHOD_ALIASES[detected], qc)
    if detected == BNB:
        return parse_bitsandbytes(qc)
    if detected == NO_METHOD:  # vLLM's ModelConfig reads quant_cfg["quant_method"]: a KeyError at start-up
        return QuantDeclaration(detected, "config.json quantization_config", [], (), None, ["quantization_config has no quant_method; vLLM cannot start"])
    if detected is not None:
        return QuantDeclaration(detected, "config.json quantization_config", [], (), None)  # not_understood() says so
    return None


def _modelopt_disagreements(config_form: QuantDeclaration, sidecar: QuantDeclaration) -> list[str]:
    """What config.json's ModelOpt declaration and hf_quant_config.json say differently: vLLM reads
    the former, TensorRT-LLM the latter, so one checkpoint would be served two ways."""
    def schemes(d: QuantDeclaration) -> list[tuple[str | None, tuple[str, ...]]]:
        return sorted((g.scheme, tuple(sorted(g.targets))) for g in d.groups)

    out = []
    if schemes(config_form) != schemes(sidecar):
        out.append(f"config.json and {HF_QUANT_CONFIG} declare different schemes "
                   f"({[g.description for g in config_form.groups]} vs {[g.description for g in sidecar.groups]}); "
                   "vLLM reads config.json, TensorRT-LLM the sidecar")
    if set(config_form.ignore) != set(sidecar.ignore):
        only = sorted(set(config_form.ignore) ^ set(sidecar.ignore))
        out.append(f"config.json's ignore and {HF_QUANT_CONFIG}'s exclude_modules differ ({len(only)} entries, e.g. {only[:3]})")
    if (config_form.kv.algo if config_form.kv else None) != (sidecar.kv.algo if sidecar.kv else None):
        out.append(f"config.json and {HF_QUANT_CONFIG} declare different KV caches "
                   f"({config_form.kv.algo if config_form.kv else 'none'} vs {sidecar.kv.algo if sidecar.kv else 'none'})")
    return out


def not_understood(decl: QuantDeclaration | None) -> str | None:
    """Why fp4forge cannot say what this declaration's tensors hold (None: it can): a
    quant_method it does not read, or a declared scheme whose packing neither its tables nor
    vLLM's parameter data give."""
    if decl is None:
        return None
    if decl.format not in READ_FORMATS + KEYED_FORMATS + (BNB,):
        return f"quant_method {decl.format}: a format fp4forge cannot judge"
    unknown = [g.description for g in decl.groups if g.scheme is None and g.values_per_element is None]
    return f"declared schemes fp4forge cannot judge: {', '.join(unknown)}" if unknown else None


# -- resolution per module ------------------------------------------------------------------------
@dataclass
class Resolution:
    """Which scheme each Linear must carry under a declaration."""

    scheme_of: dict[str, SchemeGroup]  # targeted and not ignored
    ignored: set[str]
    untargeted: set[str]
    unmatched_targets: list[tuple[str, str]]  # (group name, target)
    unmatched_ignores: list[str]


def resolve(decl: QuantDeclaration, linears: list[str], *, engine_unquantized: set[str] = frozenset()) -> Resolution:
    """Apply targets and ignore to every Linear module name.

    Precedence as vLLM's compressed-tensors `find_matched_target`: an exact name beats a
    regex, which beats the class target `Linear`; ignore always wins. ``engine_unquantized``:
    Linears the serving engine builds without a quantization method whatever the declaration
    says (routers, DeepSeek-V3.2's indexer weights_proj; the layout's data), counted as ignored
    for the formats whose class-wide target would otherwise reach them (fp8, mxfp4, GPTQ, AWQ,
    bitsandbytes)."""
    names = NameSet(linears)
    engine_skips = decl.format in (FP8_BLOCK, MXFP4) + KEYED_FORMATS + (BNB,) and not decl.literal_ignore
    ignored: set[str] = set(engine_unquantized) & set(linears) if engine_skips else set()
    unmatched_ignores = []
    for pattern in decl.ignore:
        hits = names.matching(pattern, decl.matcher)
        ignored.update(hits)
        if not hits:
            unmatched_ignores.append(pattern)
    scheme_of: dict[str, tuple[int, SchemeGroup]] = {}
    unmatched_targets = []
    for group in decl.groups:
        for target in group.targets:
            rank = _target_rank(target)
            hits = names.matching(target, decl.matcher)
            if not hits and not target.endswith("Attention"):  # vLLM drops attention targets: KV only
                unmatched_targets.append((group.name, target))
            for module in hits:
                if module not in scheme_of or rank < scheme_of[module][0]:
                    scheme_of[module] = (rank, group)
    return Resolution(
        scheme_of={m: g for m, (_, g) in scheme_of.items() if m not in ignored},
        ignored=ignored,
        untargeted={m for m in linears if m not in scheme_of and m not in ignored},
        unmatched_targets=unmatched_targets,
        unmatched_ignores=unmatched_ignores,
    )


class NameSet:
    """Module names, indexed for the three ways declarations name modules: exact or dotted
    ancestor, substring (ModelOpt in vLLM), pattern. Built once per audit: real declarations hold
    hundreds of entries and checkpoints 10^5 modules, so no pattern is tried name by name unless
    it is a wildcard or regex."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self._by_ancestor: dict[str, list[str]] | None = None
        self._joined: str | None = None
        self._starts: list[int] = []
        self._scans = 0  # full scans so far: the layer buckets are built after LAYER_BUCKETS_AFTER
        self._buckets: dict[str | None, tuple[list[int], str, list[int]]] | None = None

    @property
    def by_ancestor(self) -> dict[str, list[str]]:
        if self._by_ancestor is None:
            self._by_ancestor = _by_ancestor(self.names)
        return self._by_ancestor

    def containing(self, text: str) -> list[str]:
        """Names holding ``text`` as a substring, in ``names`` order.

        By one scan of all names joined; once many texts have been looked up (ModelOpt's
        exclude_modules lists hundreds, one or more per layer), a text holding a layer index
        (``layers.<digits>.``) scans only the names with that one layer index (see
        ``_layer_buckets``) and the names with no single ``layers.`` (which could hold it anywhere)."""
        key = None
        if self._buckets is None and self._scans >= LAYER_BUCKETS_AFTER:
            self._buckets = _layer_buckets(self.names)
        if self._buckets is not None and "\n" not in text:  # (a newline may match across two joined names)
            found = _LAYER_KEY.search(text)
            key = found.group(1) if found is not None else None
        if key is None:
            self._scans += 1
            if self._joined is None:
                self._joined, self._starts = _joined_with_starts(self.names)
            return [self.names[i] for i in _positions_holding(self._joined, self._starts, text)]
        hits: list[int] = []
        for bucket in (key, None):
            members = self._buckets.get(bucket)
            if members is not None:
                indices, joined, starts = members
                hits += [indices[i] for i in _positions_holding(joined, starts, text)]
        return [self.names[i] for i in sorted(hits)]

    def matching(self, pattern: str, match: Callable[[str, str], bool]) -> list[str]:
        if pattern in (LINEAR_CLASS_TARGET, "*"):
            return list(self.names)  # callers pass Linear modules only
        if is_class_name(pattern) and match is not match_skip_list:
            return []  # other class names cannot be resolved from headers
        if match is match_substring:
            return self.containing(pattern)
        if match is match_modelopt:
            hits = self.containing(pattern)
            if _is_pattern(pattern):
                wildcard = re.compile(fnmatch.translate(pattern))
                seen = set(hits)
                hits += [m for m in self.names if m not in seen and wildcard.match(m)]
            return hits
        if not _is_pattern(pattern):
            hits = self.by_ancestor.get(pattern, [])  # an exact name, or an ancestor such as an expert stack
            return ([pattern] if pattern in hits else []) if match is match_ct else list(hits)
        if match is match_ct and pattern.startswith("re:"):
            regex = re.compile(pattern[3:])
            return [m for m in self.names if regex.match(m)]
        if match is match_skip_list:
            wildcard = re.compile(fnmatch.translate(pattern))
            return [m for m in self.names if any(wildcard.match(prefix) for prefix in _self_and_parents(m))]
        return [m for m in self.names if match(pattern, m)]


LAYER_BUCKETS_AFTER = 64  # full scans first: building the buckets costs about as much as 60-70 full scans (measured)
# A layer index in a name: "layers." and a whole run of digits followed by a dot.
_LAYER_KEY = re.compile(r"layers\.(\d+)\.")


def _joined_with_starts(names: list[str]) -> tuple[str, list[int]]:
    """The names joined by newlines, and where each one starts."""
    starts = []
    position = 0
    for name in names:
        starts.append(position)
        position += len(name) + 1
    return "\n".join(names), starts


def _positions_holding(joined: str, starts: list[int], text: str) -> list[int]:
    """Positions (in the joined list) of the names holding ``text``, one scan of ``joined``. A text
    holding a newline may match across two names: the name it starts in is reported, as before.
    (The scan stops after the last name: ``find`` of an empty text past the end still answers the
    end, which made an empty exclude entry loop forever.)"""
    out: list[int] = []
    at = joined.find(text)
    while at >= 0:
        index = bisect.bisect_right(starts, at) - 1
        out.append(index)
        if index + 1 >= len(starts):
            break
        at = joined.find(text, starts[index + 1])
    return out


def _layer_buckets(names: list[str]) -> dict[str | None, tuple[list[int], str, list[int]]]:
    """Names by layer index: a name holding "layers." exactly once, followed by a digit run and a
    dot, goes under that run; every other name under None. A text holding ``layers.K.`` (K a whole
    digit run) can only be a substring of a name under K or under None: a name with one "layers."
    holding the text holds "layers.K." at that one place, so its run there is K."""
    grouped: dict[str | None, list[int]] = {}
    search = _LAYER_KEY.match
    for i, name in enumerate(names):
        at = name.find("layers.")
        key = None
        if at >= 0 and name.find("layers.", at + 1) < 0:
            found = search(name, at)
            if found is not None:
                key = found.group(1)
        members = grouped.get(key)
        if members is None:
            grouped[key] = [i]
        else:
            members.append(i)
    return {key: (indices, *_joined_with_starts([names[i] for i in indices])) for key, indices in grouped.items()}


def _by_ancestor(linears: list[str]) -> dict[str, list[str]]:
    """Every module and each of its ancestors -> the Linears at or below it."""
    index: dict[str, list[str]] = {}
    for module in linears:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            index.setdefault(".".join(parts[:i]), []).append(module)
    return index


def _is_pattern(text: str) -> bool:
    return text.startswith("re:") or any(c in text for c in "*?[")


def _self_and_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _target_rank(target: str) -> int:
    if target in (LINEAR_CLASS_TARGET, "*"):
        return 2
    return 1 if _is_pattern(target) else 0
