"""The compressed-tensors scheme vLLM 0.32 builds for one config group, as its
``CompressedTensorsConfig`` chooses it (docs/audit.md#agreement-with-vllm).

vLLM validates each group's arguments with compressed-tensors' ``QuantizationArgs`` (its
validators are ``args_refusal``), keeps the input activations only where the group's format is an
activation format or the group declares them (``_quantization_scheme_map_from_config``), then
walks the ``_is_*`` predicates of ``_get_scheme_from_parts`` in order: the first that holds names
the scheme class, none raises ``NotImplementedError``. ``vllm_scheme`` is that walk on the
declaration's JSON (no torch, no compressed-tensors import: a warm audit imports neither). The
platform checks (``_check_scheme_supported``: an FP8-capable GPU, ``_is_fp8_w4a8_sm90``'s exact
SM 9.0) are taken as met: the audit judges the declaration, not the machine.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from fp4forge.checkpoint import vllm_params
from fp4forge.checkpoint.vllm_params import ct_args

# compressed_tensors/utils.py is_activation_quantization_format
ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized")
PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"
GROUP_STRATEGIES = ("group", "tensor_group")
DYNAMIC_STRATEGIES = ("token", "tensor", "tensor_group", "group")
W8A8_FP8 = "CompressedTensorsW8A8Fp8"
WNA16_BITS = tuple(range(2, 9))  # schemes/compressed_tensors_wNa16.py WNA16_SUPPORTED_TYPES_MAP


class Refused(Exception):
    """vLLM raises on the group (the message says where in its code)."""


def args_refusal(args: Any) -> str | None:
    """Why compressed-tensors' QuantizationArgs.validate_model_after rejects ``args``, or None."""
    if not isinstance(args, dict):
        return None
    group_size, strategy = args.get("group_size"), args.get("strategy")
    if strategy is None and isinstance(group_size, int) and (group_size == 0 or group_size < -1):
        return f"group_size {group_size} (> 0 for group, -1 for channel)"
    norm = ct_args(args)
    strategy, dynamic = norm["strategy"], norm["dynamic"]
    if strategy == "token" and not dynamic:
        return "static token quantization (token needs dynamic true)"
    if strategy in GROUP_STRATEGIES and not (isinstance(group_size, int) and group_size > 0):
        return f"strategy {strategy!r} without a positive group_size"
    if isinstance(group_size, int) and group_size > 0 and strategy not in GROUP_STRATEGIES:
        return f"group_size {group_size} with strategy {strategy!r} (a group size needs a group strategy)"
    if (strategy == "block") != (norm["block_structure"] is not None):
        return f"strategy {strategy!r} with block_structure {norm['block_structure']!r}"
    if norm["actorder"] == "group" and strategy not in GROUP_STRATEGIES:
        return f"actorder 'group' with strategy {strategy!r}"
    if dynamic and strategy not in DYNAMIC_STRATEGIES:
        return f"dynamic quantization with strategy {strategy!r}"
    if dynamic == "local" and strategy != "tensor_group":
        return f"dynamic 'local' with strategy {strategy!r}"
    if norm["type"] == "float" and norm["num_bits"] not in (4, 8):
        return f"float num_bits {norm['num_bits']!r} (only 4 and 8 exist)"
    return None


def group_refusal(group: dict[str, Any], top_format: str | None) -> str | None:
    """Why vLLM 0.32 refuses one config group (an argument validator, a weight actorder it no
    longer supports, no scheme for the arguments and format), or None."""
    try:
        vllm_scheme(group, top_format)
    except Refused as exc:
        return str(exc)
    return None


def moe_refusal(group: dict[str, Any], top_format: str | None) -> str | None:
    """Why vLLM 0.32 refuses the group for routed experts (FusedMoE layers choose their method by
    their own predicates, CompressedTensorsMoEMethod.get_moe_method), or None."""
    try:
        vllm_moe_scheme(group, top_format)
    except Refused as exc:
        return str(exc)
    return None


def vllm_moe_scheme(group: dict[str, Any], top_format: str | None) -> str:
    """The FusedMoE method vLLM builds for experts under ``group``; raises Refused where vLLM does."""
    w, i = _validated_parts(group, top_format)
    mx = _mx_scheme(w, i, group)
    if mx:
        return f"{mx}MoEMethod"
    if i is None and w["strategy"] in ("channel", "group") and not w["dynamic"]:
        if w["num_bits"] not in WNA16_BITS or (group.get("format") or top_format) != PACK_QUANTIZED:  # get_scheme_dict fills in the top one
            raise Refused(f"routed experts: weight-only {w['num_bits']}-bit needs format 'pack-quantized' and 2 to 8 bits (get_moe_method raises ValueError)")
        return "CompressedTensorsWNA16MoEMethod"
    if _is_nvfp4(w):
        if i is not None and not _is_nvfp4(i):
            raise Refused("routed experts: NVFP4 weights with non-NVFP4 input_activations (get_moe_method raises ValueError)")
        return "CompressedTensorsW4A4Nvfp4MoEMethod"
    if i is not None and _fp8_w8a8(w, i):
        _fp8_moe_layout(w, i)
        return "CompressedTensorsW8A8Fp8MoEMethod"
    if i is not None and _dynamic_token_w8a8(w, i):
        return "CompressedTensorsW8A8Int8MoEMethod"
    if i is not None and _w4a8_fp8(w, i):
        return "CompressedTensorsW4A8Fp8MoEMethod"
    if i is not None and _w4a8_int(w, i):
        return "CompressedTensorsW4A8Int8MoEMethod"
    raise Refused("routed experts: no FusedMoE method for these arguments (get_moe_method raises 'Unsupported FusedMoe scheme')")


def _fp8_moe_layout(w: dict, i: dict) -> None:
    """CompressedTensorsW8A8Fp8MoEMethod.__init__: per-tensor weights with per-tensor inputs,
    per-channel weights with dynamic per-token inputs, or blocks; anything else raises."""
    per_tensor = w["strategy"] == i["strategy"] == "tensor"
    per_channel = (w["strategy"], i["strategy"]) == ("channel", "token")
    if not (per_tensor or per_channel or w["strategy"] == "block"):
        raise Refused(f"routed experts: FP8 {w['strategy']} weights with {i['strategy']} inputs (an assertion in CompressedTensorsW8A8Fp8MoEMethod)")
    if per_channel and not i["dynamic"]:
        raise Refused("routed experts: per-channel FP8 weights need dynamic per-token inputs (CompressedTensorsW8A8Fp8MoEMethod raises ValueError)")


def vllm_scheme(group: dict[str, Any], top_format: str | None) -> str:
    """The scheme class vLLM builds for ``group``'s Linears; raises Refused where vLLM raises."""
    w, i = _validated_parts(group, top_format)
    fmt = group.get("format") or top_format
    scheme = _scheme_from_parts(w, i, ct_args(group.get("output_activations")), fmt, group)
    if scheme is None:
        raise Refused(f"no compressed-tensors scheme for these arguments with format {fmt!r} (_get_scheme_from_parts raises NotImplementedError)")
    return scheme


def _validated_parts(group: dict[str, Any], top_format: str | None) -> tuple[dict, dict | None]:
    """(weights, input activations) as vLLM's scheme map holds them, after the validators."""
    for role in ("weights", "input_activations", "output_activations"):
        if group.get(role) is not None and not isinstance(group.get(role), dict):
            raise Refused(f"{role} is {group.get(role)!r}, not an object")
        reason = args_refusal(group.get(role))
        if reason:
            raise Refused(f"{role}: {reason} (compressed-tensors' QuantizationArgs validator)")
    weights = ct_args(group.get("weights"))
    if weights is None:
        raise Refused("no weights arguments")
    if weights["actorder"] in ("group", "dynamic"):
        raise Refused(f"weights actorder {weights['actorder']!r} (vLLM: group/dynamic activation ordering is no longer supported)")
    fmt = group.get("format") or top_format
    inputs = ct_args(group.get("input_activations")) if (fmt in ACTIVATION_FORMATS or group.get("input_activations")) else None
    if fmt in ACTIVATION_FORMATS and inputs is None and weights["type"] != "float":
        raise Refused(f"format {fmt!r} without input_activations for {weights['type']} weights (an assertion in _quantization_scheme_map_from_config)")
    return weights, inputs


def _scheme_from_parts(w: dict, i: dict | None, o: dict | None, fmt: str | None, group: dict) -> str | None:
    """_get_scheme_from_parts' predicates in its order (vLLM 0.32 compressed_tensors.py)."""
    if _is_nvfp4(w):
        if i is not None and not _is_nvfp4(i):
            raise Refused("NVFP4 weights with non-NVFP4 input_activations ('input quantization must also be NVFP4 format')")
        return "CompressedTensorsW4A4Fp4"
    mx = _mx_scheme(w, i, group)
    if mx:
        return mx
    if i is not None and _w4a8_fp8(w, i):
        return "CompressedTensorsW4A8Fp8"
    static_int = w["type"] == "int" and not w["dynamic"] and w["strategy"] in ("channel", "group")
    if static_int and fmt in (PACK_QUANTIZED, INT_QUANTIZED) and _static_int8_tensor(i) and _static_int8_tensor(o):
        return "CompressedTensorsWNA8O8Int"
    if static_int and fmt == PACK_QUANTIZED and i is not None and i["type"] == "int" and i["symmetric"] and i["dynamic"] \
            and i["strategy"] in ("token", "group") and i["num_bits"] in (4, 8):
        return f"CompressedTensorsWNA{i['num_bits']}Int"
    if i is None and w["strategy"] in ("channel", "group") and not w["dynamic"] and fmt == PACK_QUANTIZED:
        return "CompressedTensorsWNA16"
    if fmt not in ACTIVATION_FORMATS:
        return None
    return _activation_scheme(w, i)


def _mx_scheme(w: dict, i: dict | None, group: dict) -> str | None:
    """The MX schemes, first among both the Linear and the FusedMoE predicates (their MoE
    methods are these names + 'MoEMethod')."""
    if _is_mx(w, 4) and i is not None and _mxfp4_fp8_input(w, i):
        return "CompressedTensorsW4A8Mxfp4"
    if _is_mx(w, 4):
        return "CompressedTensorsW4A4Mxfp4"
    if _is_mx(w, 8) and _uint8_scales(group):
        return "CompressedTensorsW8A8Mxfp8"
    return None


def _activation_scheme(w: dict, i: dict | None) -> str | None:
    if i is not None and _fp8_w8a8(w, i):
        return W8A8_FP8
    if _fp8_weights(w):
        return "CompressedTensorsW8A16Fp8"
    if i is None:
        raise Refused("weight arguments no activation-format scheme takes without input_activations (vLLM reads input_quant.num_bits of None)")
    static_tensor = w["num_bits"] == i["num_bits"] == 8 and w["strategy"] in ("tensor", "channel") and w["symmetric"] \
        and not w["dynamic"] and i["strategy"] == "tensor" and not i["dynamic"]
    if static_tensor or _dynamic_token_w8a8(w, i):
        return "CompressedTensorsW8A8Int8"
    if _w4a8_int(w, i):
        return "CompressedTensorsW4A8Int"
    return None


def _fp8_weights(w: dict) -> bool:
    """_is_fp8_w8a16's weight test (it reads no num_bits)."""
    return w["type"] == "float" and w["symmetric"] and not w["dynamic"] and w["strategy"] in ("tensor", "channel", "block")


def _fp8_w8a8(w: dict, i: dict) -> bool:
    """_is_fp8_w8a8: FP8 weights with float inputs, dynamic or static symmetric per tensor."""
    return _fp8_weights(w) and i["type"] == "float" and bool(i["dynamic"] or (i["symmetric"] and i["strategy"] == "tensor"))


def _dynamic_token_w8a8(w: dict, i: dict) -> bool:
    return w["num_bits"] == i["num_bits"] == 8 and w["strategy"] in ("tensor", "channel") and i["strategy"] == "token" \
        and not w["dynamic"] and bool(i["dynamic"]) and w["symmetric"]


def _w4a8_int(w: dict, i: dict) -> bool:
    return (w["type"], i["type"], w["num_bits"], i["num_bits"]) == ("int", "int", 4, 8) and w["strategy"] in ("group", "channel") \
        and i["strategy"] == "token" and w["symmetric"] and bool(i["dynamic"]) and not w["dynamic"]


def _w4a8_fp8(w: dict, i: dict) -> bool:
    return (w["type"], i["type"], w["num_bits"], i["num_bits"], w["strategy"], i["strategy"]) == ("int", "float", 4, 8, "group", "token") \
        and bool(i["dynamic"]) and not w["dynamic"] and w["symmetric"] and i["symmetric"]


def _mxfp4_fp8_input(w: dict, i: dict) -> bool:
    return (i["type"], i["num_bits"], bool(i["dynamic"]), i["symmetric"]) == ("float", 8, True, True) and i["strategy"] in ("token", "group") and not w["dynamic"]


def _uint8_scales(group: dict) -> bool:
    return str((group.get("weights") or {}).get("scale_dtype")).removeprefix("torch.") == "uint8"


def _is_nvfp4(args: dict | None) -> bool:
    return args is not None and (args["strategy"], args["type"], args["num_bits"], args["group_size"], args["symmetric"]) == ("tensor_group", "float", 4, 16, True)


def _is_mx(args: dict, bits: int) -> bool:
    return (args["strategy"], args["type"], args["num_bits"], args["group_size"], args["symmetric"]) == ("group", "float", bits, 32, True)


def _static_int8_tensor(args: dict | None) -> bool:
    return args is not None and (args["type"], args["strategy"], args["num_bits"]) == ("int", "tensor", 8) and not args["dynamic"]


@lru_cache(maxsize=None)  # asked per group and per key of the data on every audit: each key's JSON parsed once
def is_ct_key(key: str) -> bool:
    """A key vllm_params.ct_key made: it holds a group's QuantizationArgs weights."""
    return "weights" in vllm_params.scheme_args(key)


def group_of_key(key: str) -> tuple[dict[str, Any], None]:
    """A compressed-tensors scheme key (vllm_params.ct_key) as a config group and top format."""
    args = vllm_params.scheme_args(key)
    return {"weights": args.get("weights"), "input_activations": args.get("inputs"), "format": args.get("format")}, None


@lru_cache(maxsize=256)
def weight_dtype_built(key: str, expert: bool = False) -> tuple[str, str] | None:
    """(vLLM's scheme class, the dtype of the weight parameter it creates) for a group's Linears
    (``expert``: its routed experts' FusedMoE method), taken from a key of vLLM's parameter data
    that vLLM builds the same class for with the same weight bits (the class decides the
    parameters). None where vLLM refuses the group or the data holds no such class."""
    choose = vllm_moe_scheme if expert else vllm_scheme
    try:
        built = choose(*group_of_key(key))
    except Refused:
        return None
    bits = (vllm_params.scheme_args(key).get("weights") or {}).get("num_bits")
    for other, entry in vllm_params.quant_params_data()["schemes"].items():
        args = vllm_params.scheme_args(other)
        if not is_ct_key(other) or "params" not in entry or (args.get("weights") or {}).get("num_bits") != bits:
            continue
        try:
            same = choose(*group_of_key(other)) == built
        except Refused:
            continue
        if same:
            weight = next(p for p in entry["params"] if p.get("weight"))
            experts = (entry.get("experts") or {}).get("params") if expert else None
            return built, next((p["dtype"] for p in experts or () if p["name"] == weight["name"]), weight["dtype"])
    return None
