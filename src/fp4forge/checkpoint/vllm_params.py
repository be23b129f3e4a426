"""The parameters vLLM creates for one quantized Linear, per quantization method and scheme, as
data: ``layouts/_vllm_quant_params.json``, written by ``scripts/vllm_quant_params.py`` from the
installed vLLM's own quant methods (each method's ``create_weights`` called on a meta-device
Linear at three sizes; every dimension solved as ``a * in + b * out + c``). This module reads that
data without vLLM: a declaration is turned into a *scheme key* (the same function the script keys
the data by), and the key into the tensors vLLM will create for a Linear of a given size.

A key the data does not hold (a bit width or group size vLLM was not asked about) is answered
with None: the caller says it cannot judge, never guesses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from fp4forge.checkpoint.layout import LAYOUTS_DIR
from fp4forge.checkpoint.safetensors_format import INTEGER_DTYPES

VLLM_QUANT_PARAMS = "_vllm_quant_params.json"
VLLM_LOADER_IGNORES = "_vllm_loader_ignores.json"  # written by scripts/vllm_loader_ignores.py
# the suffix whose unexpected tensors the loader data judges per architecture (AutoGPTQ's zero biases)
UNEXPECTED_BIAS = "bias"
# the dtype a parameter takes from the model (vLLM's params_dtype): any float the checkpoint
# stores is cast into it on load
MODEL_DTYPE = "model"
GPTQ_METHODS = ("gptq", "gptq_marlin", "auto_gptq")
AWQ_METHODS = ("awq", "awq_marlin", "auto_awq")


@dataclass(frozen=True)
class ExpectedTensor:
    suffix: str  # the parameter's name under its module (`qweight`, `weight_scale`, ...)
    dtype: str  # safetensors dtype, or MODEL_DTYPE
    shape: tuple[int, ...] | None  # None: not a whole number at this size (vLLM would refuse)
    values_per_element: int  # >1 for a packed weight: logical parameters per stored element
    is_weight: bool  # the tensor that holds the Linear's parameters (packed or not)


def _canonical(args: dict[str, Any]) -> str:
    return json.dumps(args, sort_keys=True, separators=(",", ":"))


def gptq_key(qc: dict[str, Any]) -> str:
    """A GPTQ declaration's key (vLLM's AutoGPTQConfig reads these four; `gptq_marlin`,
    `auto_gptq` and moe_wna16's Linears are the same method)."""
    return _canonical({"method": "gptq", "bits": qc.get("bits"), "group_size": qc.get("group_size"),
                       "desc_act": qc.get("desc_act"), "sym": qc.get("sym")})


def awq_key(qc: dict[str, Any]) -> str:
    """An AWQ declaration's key (vLLM's AutoAWQConfig: `w_bit` or `bits`, `q_group_size` or
    `group_size`, `zero_point`)."""
    bits = qc.get("w_bit", qc.get("bits"))
    group = qc.get("q_group_size", qc.get("group_size"))
    return _canonical({"method": "awq", "bits": bits, "group_size": group, "zero_point": qc.get("zero_point")})


# compressed-tensors QuantizationArgs fields that decide the parameters, with the model's defaults
CT_ARG_DEFAULTS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": None,
                   "block_structure": None, "dynamic": False, "actorder": None}


def ct_args(args: Any) -> dict[str, Any] | None:
    """A compressed-tensors QuantizationArgs object as its pydantic model normalises it: defaults
    filled, the strategy inferred from group_size (None -> tensor, >0 -> group, -1 -> channel),
    a boolean actorder as `group`, names lower-cased. None for no arguments."""
    if args is None:
        return None
    if not isinstance(args, dict):
        raise TypeError(f"quantization arguments {args!r} are not an object")
    out = {key: args.get(key, default) for key, default in CT_ARG_DEFAULTS.items()}
    for key in ("type", "strategy", "actorder", "dynamic"):
        if isinstance(out[key], str):
            out[key] = out[key].lower()
    if out["actorder"] is True:
        out["actorder"] = "group"
    elif out["actorder"] is False:
        out["actorder"] = None
    if out["strategy"] is None:
        group = out["group_size"]
        out["strategy"] = "tensor" if group is None else "group" if group > 0 else "channel" if group == -1 else None
    if out["block_structure"] is not None:
        out["block_structure"] = list(out["block_structure"])
    return out


def ct_key(group: dict[str, Any], top_format: str | None) -> str:
    """A compressed-tensors config group's key: its weights and input activations as the
    QuantizationArgs model reads them, and its format (the group's own, else the top one)."""
    inputs = ct_args(group.get("input_activations"))
    if inputs is not None:  # the input arguments vLLM's scheme choice reads
        inputs = {k: inputs[k] for k in ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size")}
    return _canonical({"method": "compressed-tensors", "weights": ct_args(group.get("weights")), "inputs": inputs,
                       "format": group.get("format") or top_format})


def fp8_key(qc: dict[str, Any]) -> str:
    """`quant_method: fp8` (vLLM's Fp8Config): per-tensor, or block-wise with weight_block_size."""
    block = qc.get("weight_block_size")
    return _canonical({"method": "fp8", "activation_scheme": qc.get("activation_scheme", "dynamic"),
                       "weight_block_size": list(block) if isinstance(block, (list, tuple)) else block})


def modelopt_key(algo: str | None, group_size: Any) -> str:
    """One ModelOpt quant_algo (the whole checkpoint's, or one `quantized_layers` entry's)."""
    return _canonical({"method": "modelopt", "quant_algo": algo, "group_size": group_size})


def scheme_args(key: str) -> dict[str, Any]:
    """The declaration's arguments a key holds (for messages)."""
    return json.loads(key)


def vllm_knows_method(method: str) -> bool:
    """Whether the vLLM the data was taken from has a config class for this quant_method (vLLM
    refuses to start on any other)."""
    return method in quant_params_data()["methods"]


def packed_int_suffix_kinds() -> dict[str, str]:
    """What each tensor suffix of the GPTQ and AWQ parameters vLLM creates is (the layouts' kinds,
    ``layouts/_common.toml``), from the data: the weight holding several values per element is
    ``packed_weight`` (`qweight`), another integer parameter a ``zero_point`` (`qzeros`), a float
    one a ``weight_scale`` (`scales`), and a suffix vLLM discards before loading the ``g_idx``
    kind (GPTQ's act-order index)."""
    kinds: dict[str, str] = {}
    for key, entry in quant_params_data()["schemes"].items():
        if scheme_args(key).get("method") not in (GPTQ_METHODS[0], AWQ_METHODS[0]) or "params" not in entry:
            continue
        for param in entry["params"]:
            if param.get("weight"):
                kind = "packed_weight" if param.get("values_per_element", 1) != 1 else "weight"
            else:
                kind = "zero_point" if param["dtype"] in INTEGER_DTYPES else "weight_scale"
            kinds.setdefault(param["name"], kind)
        for suffix in entry.get("discarded", ()):
            kinds.setdefault(suffix, "g_idx")
    return kinds


def required_keys(method: str) -> list[list[str]]:
    """The declaration keys vLLM's config class for ``method`` (`gptq`, `awq`) refuses to start
    without: one list of alternative spellings each (AWQ: `w_bit` or `bits`); [] for a method the
    data does not hold."""
    return quant_params_data().get("required_keys", {}).get(method, [])


def config_built_params() -> frozenset[str]:
    """Parameters vLLM fills from the quantization config rather than the checkpoint."""
    return frozenset(quant_params_data()["config_built"])


def vllm_version() -> str:
    return quant_params_data()["vllm"]


@lru_cache(maxsize=1)
def quant_params_data() -> dict[str, Any]:
    return json.loads((LAYOUTS_DIR / VLLM_QUANT_PARAMS).read_text(encoding="utf-8"))


def scheme_entry(key: str) -> dict[str, Any] | None:
    """What vLLM did with one scheme key: ``{"params": [...]}`` or ``{"refused": why}``; None
    when the data does not hold the key."""
    return quant_params_data()["schemes"].get(key)


def _dimension(formula: list, in_features: int, out_features: int) -> int | None:
    (a_num, a_den), (b_num, b_den), constant = formula
    value = Fraction(a_num, a_den) * in_features + Fraction(b_num, b_den) * out_features + constant
    return int(value) if value.denominator == 1 and value > 0 else None


def scheme_params(key: str, *, expert: bool = False) -> list[dict[str, Any]] | None:
    """The parameter records of a scheme: for a routed expert's Linear, those vLLM's MoE method
    creates per expert (its stacked w13 / w2 parameters read per Linear) where the data holds
    them, else the Linear method's; None when the data holds no parameters for the key."""
    entry = scheme_entry(key)
    if entry is None or "params" not in entry:
        return None
    experts = entry.get("experts") or {}
    return experts["params"] if expert and "params" in experts else entry["params"]


def expected_tensors(key: str, in_features: int, out_features: int, *, expert: bool = False) -> list[ExpectedTensor] | None:
    """The tensors vLLM creates for a Linear of ``in_features`` -> ``out_features`` (a routed
    expert's, with ``expert``) under the scheme ``key``; None when the data holds no parameters."""
    params = scheme_params(key, expert=expert)
    return None if params is None else tensors_of(params, in_features, out_features)


def tensors_of(params: list[dict[str, Any]], in_features: int, out_features: int) -> list[ExpectedTensor]:
    """Parameter records of the data (each dimension's ``a * in + b * out + c``) at one size."""
    out = []
    for param in params:
        dims = [_dimension(f, in_features, out_features) for f in param["shape"]] if param["shape"] is not None else [None]
        shape = None if any(d is None for d in dims) else tuple(dims)
        out.append(ExpectedTensor(param["name"], param["dtype"], shape, param.get("values_per_element", 1),
                                  bool(param.get("weight"))))
    return out


def weight_values_per_element(key: str) -> int | Fraction | None:
    """Logical parameters per stored element of the scheme's weight tensor (8 for 4-bit values in
    an int32), from the data; for a scheme vLLM refuses or the data lacks (a group size not
    probed), from a scheme of the same method, bit width, type and format it accepts (the packing
    depends on nothing else); for a bit width vLLM accepts in no scheme of the method (GPTQ's 3
    bits), the element's width an accepted width of the method packs (values × bits: 32 for an
    int32) over the declared bits, a Fraction where values straddle elements (32 / 3); None when
    the data holds none of these."""
    entry = scheme_entry(key)
    if entry is None or "params" not in entry:
        entry = _accepted_sibling(key)
        if entry is None:
            return _packed_at_other_width(key)
    return _weight_packing(entry)


def _weight_packing(entry: dict[str, Any]) -> int | None:
    return next((p.get("values_per_element", 1) for p in entry["params"] if p.get("weight")), None)


def _packed_at_other_width(key: str) -> int | Fraction | None:
    method, bits, kind, fmt = _bits(scheme_args(key))
    if not isinstance(bits, int) or bits <= 0:
        return None
    for other, entry in quant_params_data()["schemes"].items():
        other_method, other_bits, other_kind, other_fmt = _bits(scheme_args(other))
        packing = _weight_packing(entry) if "params" in entry else None
        if (other_method, other_kind, other_fmt) == (method, kind, fmt) and isinstance(packing, int) and packing > 1:
            value = Fraction(packing * other_bits, bits)
            return int(value) if value.denominator == 1 else value
    return None


def _bits(args: dict[str, Any]) -> tuple:
    weights = args.get("weights") or {}
    return (args.get("method"), args.get("bits", weights.get("num_bits")), weights.get("type"), args.get("format"))


def _accepted_sibling(key: str) -> dict[str, Any] | None:
    wanted = _bits(scheme_args(key))
    for other, entry in quant_params_data()["schemes"].items():
        if "params" in entry and _bits(scheme_args(other)) == wanted:
            return entry
    return None


@lru_cache(maxsize=1)
def loader_ignores_data() -> dict[str, Any]:
    return json.loads((LAYOUTS_DIR / VLLM_LOADER_IGNORES).read_text(encoding="utf-8"))


def suffixes_skipped_by_loader(architectures: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Suffixes of checkpoint tensors vLLM's weight loader for these architectures skips instead
    of refusing where no parameter takes them: `bias` where every loader the model class runs
    skips an unexpected one (AutoWeightsLoader adds it to its ignore list; hand-written loaders
    skip it themselves); nothing for an architecture the data does not hold or whose loader
    raises on it. Only `bias`: the data's verdict is about that suffix alone, whatever else
    AutoWeightsLoader ignores (a hand-written loader ignores nothing else)."""
    by_architecture = loader_ignores_data()["skips_unexpected_bias"]
    if not architectures or not all(by_architecture.get(a) for a in architectures):
        return ()
    return (UNEXPECTED_BIAS,)
