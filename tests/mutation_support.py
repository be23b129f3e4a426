"""Generated defects for the audit's agreement with vLLM (docs/audit.md#agreement-with-vllm).

Product-independent test support, importable from both the project's interpreter and vLLM's
(only json, torch and safetensors): the oracle (`scripts/vllm_mutation_oracle.py`, in vLLM's
venv) and the test (`tests/test_mutation_corpus.py`, in the project's) generate the same
mutations from the same base checkpoints and apply them the same way.

A **base** is a correct tiny checkpoint of one scheme: the tiny Qwen3-MoE testbed (a
softmax-routed MoE vLLM's CPU build loads) quantized by fp4forge's own exporter for the schemes
it writes (attention and routed experts, static FP8 KV cache), and by hand-written tensors for
block-wise FP8 (`write_fp8_block`) and for 4-bit group-128 GPTQ (AutoGPTQ's packing, symmetric,
no act-order) and AWQ (AutoAWQ's GEMM packing, zero points) (`write_int4_packed`), which no
exporter here writes. Building needs fp4forge
(`build_bases`, project venv); generating and applying mutations needs only the base's files.

A **mutation** is one JSON object: ``{"id", "scheme", "edit"}``. ``edit`` is either a change of
the declaration (``{"file", "path", "op": "set"|"delete", "value"}``) or of one stored tensor
(``{"tensor", "op", "value"}``, op one of ``delete``, ``dtype``, ``shape``, ``reciprocal``,
``rename``, ``copy``). The generator walks every field of the declaration and every tensor of a
few representative Linears (a fused attention shard, a plain attention Linear, a fused and a
plain expert) and the KV scales of one layer, and proposes each alternative from the field's or
the role's domain below.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

CONFIG = "config.json"
HF_QUANT = "hf_quant_config.json"
SHARD = "model.safetensors"
QC = "quantization_config"

# name -> (layout, exporter scheme or None for a hand-written base)
SCHEMES: dict[str, tuple[str, str]] = {
    "ct-nvfp4": ("compressed-tensors", "nvfp4"),
    "ct-nvfp4a16": ("compressed-tensors", "nvfp4a16"),
    "ct-fp8": ("compressed-tensors", "fp8"),
    "ct-fp8-dynamic": ("compressed-tensors", "fp8_dynamic"),
    "ct-fp8-block": ("compressed-tensors", "fp8_block"),
    "modelopt-nvfp4": ("modelopt", "nvfp4"),
    "modelopt-fp8": ("modelopt", "fp8"),
    "fp8-block": ("fp8", "fp8_block"),
    "gptq-w4g128": ("gptq", "w4g128"),
    "awq-w4g128": ("awq", "w4g128"),
}
HAND_WRITTEN = {"ct-fp8-block", "fp8-block"}
# integer weight-only formats no exporter here writes: packed by hand (write_int4_packed)
INT_PACKED = {"gptq-w4g128", "awq-w4g128"}
BLOCK = 128
FP8_MAX = 448.0
# the Linears whose tensors are mutated: an attention shard vLLM fuses (q of q/k/v) and a routed
# expert (vLLM's FusedMoE w2)
PROBE_MODULES = ("model.layers.1.self_attn.q_proj", "model.layers.2.mlp.experts.3.down_proj")
KV_LAYER = "model.layers.1.self_attn"

# -- declaration domains: the alternatives each field is set to -----------------------------------
FIELD_DOMAINS: dict[str, list[Any]] = {
    "num_bits": [2, 4, 8, 16],
    "type": ["int", "float"],
    "strategy": ["tensor", "channel", "group", "tensor_group", "block"],
    "group_size": [None, 16, 32, 128],
    "symmetric": [True, False],
    "dynamic": [True, False, "local"],
    "block_structure": [None, [128, 128], [64, 64]],
    "actorder": [None, "group"],
    "format": ["float-quantized", "nvfp4-pack-quantized", "naive-quantized", "pack-quantized", "mixed-precision"],
    "quantization_status": ["frozen", "initialized", "compressed"],
    "quant_method": ["compressed-tensors", "modelopt", "fp8"],
    "quant_algo": ["FP8", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION", "INT4_AWQ"],
    "kv_cache_quant_algo": [None, "FP8", "NVFP4"],
    "weight_block_size": [None, [128, 128], [64, 64], [128]],
    "activation_scheme": ["dynamic", "static"],
    "fmt": ["e4m3", "e5m2"],
    "is_checkpoint_fp8_serialized": [True, False],
    # GPTQ (AutoGPTQ's quantize_config) and AWQ (AutoAWQ's quant_config)
    "bits": [3, 4, 8],
    "w_bit": [3, 4, 8],
    "desc_act": [True, False],
    "sym": [True, False],
    "zero_point": [True, False],
    "q_group_size": [-1, 32, 64],
    "lm_head": [True, False],
    "checkpoint_format": ["gptq", "gptq_v2"],
}
# where the declaration is GPTQ's or AWQ's: group_size an int (-1: one group per row), and the
# other integer format named instead
INT_METHODS = ("gptq", "awq")
INT_DOMAINS: dict[str, list[Any]] = {"group_size": [-1, 32, 64], "quant_method": ["gptq", "awq", "compressed-tensors"]}
# list-valued fields: whole replacements (built per base by _list_alternatives)
LIST_FIELDS = ("targets", "ignore", "exclude_modules", "ignored_layers", "modules_to_not_convert")
# objects whose removal is a mutation of its own
OBJECT_FIELDS = ("input_activations", "weights", "kv_cache_scheme", "output_activations")
# fields nothing reads the value of (recorded once each, deleted)
INERT_FIELDS = ("observer", "observer_kwargs", "producer", "version", "global_compression_ratio", "transform_config", "scale_dtype", "zp_dtype",
                "damp_percent", "true_sequential", "model_name_or_path", "model_file_base_name", "static_groups")

# -- tensor domains -------------------------------------------------------------------------------
FLOAT_DTYPES = ("F32", "BF16", "F16", "F8_E4M3")
INT_DTYPES = ("U8", "I8")
# each stored dtype's alternatives: a cast vLLM may take harmlessly, and a lossy or foreign one
DTYPE_ALTERNATIVES = {"F32": ("BF16", "F8_E4M3"), "BF16": ("F32", "F8_E4M3"), "F16": ("F32", "F8_E4M3"), "F8_E4M3": ("BF16", "U8"), "U8": ("I8", "BF16"), "I8": ("U8",),
                      "I32": ("F32", "I64")}
# another layout's or format's spelling of a suffix (the convention confusions)
RENAMES = {
    "weight_global_scale": ["weight_scale_2"],
    "weight_scale_2": ["weight_global_scale"],
    "input_global_scale": ["input_scale"],
    "input_scale": ["input_global_scale"],
    "weight_packed": ["weight"],
    "weight": ["weight_packed"],
    "weight_scale": ["weight_scale_inv"],
    "weight_scale_inv": ["weight_scale"],
    "k_scale": ["k_proj.k_scale", "attn.k_scale"],
    "v_scale": ["v_proj.v_scale", "attn.v_scale"],
    "k_proj.k_scale": ["k_scale"],
    "v_proj.v_scale": ["v_scale"],
    # GPTQ / AWQ: another format's name for the packed weight, its zero points and scales
    "qweight": ["weight", "weight_packed"],
    "qzeros": ["weight_zero_point"],
    "scales": ["weight_scale"],
    "g_idx": ["weight_g_idx"],
}
SHAPE_EDITS = ("transpose", "drop_row", "drop_col", "add_dim", "drop_dim", "widen")
# scales a layout stores that a weight-only Linear must not carry (copied onto one)
FOREIGN_SCALES = ("input_scale", "input_global_scale")


def _leaf_fields(doc: Any, path: list[Any]) -> list[tuple[list[Any], str, Any]]:
    """(path, field name, value) of every field of a declaration, objects included."""
    out = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.append((path + [key], key, value))
            if isinstance(value, dict) and key not in INERT_FIELDS:
                out += _leaf_fields(value, path + [key])
    return out


def _set(file: str, path: list[Any], value: Any) -> dict[str, Any]:
    return {"file": file, "path": path, "op": "set", "value": value}


def _delete(file: str, path: list[Any]) -> dict[str, Any]:
    return {"file": file, "path": path, "op": "delete"}


def _list_alternatives(key: str, value: Any) -> list[Any]:
    """Replacements of a target / ignore list: emptied, class-wide, a fused shard alone, a whole
    expert stack by its ancestor, a layer by a name that is a prefix of others, a name that
    matches nothing."""
    current = list(value or [])
    if key == "targets":
        options = [["Linear"], [t for t in current if "experts" not in t], [t for t in current if "experts" in t], ["re:.*nothing$"]]
    else:
        added = ["model.layers.1.self_attn.q_proj", "model.layers.2.mlp.experts", "model.layers.1", "model.layers.9.nothing"]
        options = [[]] + [current + [a] for a in added]
    return [o for o in options if o != current]


def declaration_mutations(base: Path) -> list[dict[str, Any]]:
    """Every field of the declaration vLLM reads (config.json's quantization_config) and of
    ModelOpt's sidecar, set to each alternative of its domain or deleted."""
    edits = []
    for file, root in ((CONFIG, [QC]), (HF_QUANT, ["quantization"])):
        path = base / file
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        node = doc
        for key in root:
            node = node[key]
        domains = FIELD_DOMAINS | (INT_DOMAINS if node.get("quant_method") in INT_METHODS else {})
        for field_path, key, value in _leaf_fields(node, list(root)):
            edits += _field_edits(file, field_path, key, value, domains)
        if file == HF_QUANT:
            edits.append({"file": file, "path": [], "op": "delete"})  # the sidecar removed
    return edits


def _field_edits(file: str, path: list[Any], key: str, value: Any, domains: dict[str, list[Any]]) -> list[dict[str, Any]]:
    if key in INERT_FIELDS:
        return [_delete(file, path)]
    if key in LIST_FIELDS:
        return [_set(file, path, v) for v in _list_alternatives(key, value)] + [_delete(file, path)]
    if key in OBJECT_FIELDS or isinstance(value, dict):
        return [_delete(file, path), _set(file, path, None)] if value is not None else []
    domain = domains.get(key)
    if domain is None:
        return [_delete(file, path)]
    return [_set(file, path, v) for v in domain if v != value] + [_delete(file, path)]


def tensor_mutations(tensors: dict[str, tuple[str, list[int]]]) -> list[dict[str, Any]]:
    """Every tensor of the probe Linears and the probe layer's KV scales: deleted, cast to each
    other dtype of its kind, reshaped, inverted (scales), renamed to another spelling, and a
    foreign activation scale added to a Linear that lacks one."""
    edits = []
    probes = [n for n in tensors if n.rpartition(".")[0] in PROBE_MODULES or _is_kv(n)]
    for name in sorted(probes):
        dtype, shape = tensors[name]
        edits.append({"tensor": name, "op": "delete"})
        edits += [{"tensor": name, "op": "dtype", "value": d} for d in DTYPE_ALTERNATIVES[dtype]]
        edits += [{"tensor": name, "op": "shape", "value": s} for s in SHAPE_EDITS if _reshaped(shape, s) is not None]
        if dtype in FLOAT_DTYPES and "scale" in name:
            edits.append({"tensor": name, "op": "reciprocal"})
        module, _, suffix = _split_probe(name)
        edits += [{"tensor": name, "op": "rename", "value": f"{module}.{alt}"} for alt in RENAMES.get(suffix, [])]
    for module in PROBE_MODULES:
        stored = {n.rpartition(".")[2] for n in tensors if n.rpartition(".")[0] == module}
        scale = next((f"{module}.{s}" for s in ("weight_scale_2", "weight_global_scale", "weight_scale", "weight_scale_inv") if s in stored), None)
        for foreign in FOREIGN_SCALES:
            if foreign not in stored and scale is not None and tensors[scale][1] in ([], [1]):
                edits.append({"tensor": scale, "op": "copy", "value": f"{module}.{foreign}"})
    return edits


def _is_kv(name: str) -> bool:
    return name.startswith(KV_LAYER + ".") and name.endswith(("k_scale", "v_scale"))


def _split_probe(name: str) -> tuple[str, str, str]:
    """(module, '.', suffix), a KV scale's suffix keeping the projection it hangs on."""
    if _is_kv(name):
        return KV_LAYER, ".", name[len(KV_LAYER) + 1:]
    return name.rpartition(".")


def _reshaped(shape: list[int], edit: str) -> list[int] | None:
    """The shape ``edit`` gives, or None where it does not apply (or changes nothing)."""
    rank = len(shape)
    new = {
        "transpose": shape[::-1] if rank == 2 and shape[0] != shape[1] else None,
        "drop_row": [shape[0] - 1] + shape[1:] if rank >= 1 and shape[0] > 1 else None,
        "drop_col": shape[:-1] + [shape[-1] - 1] if rank == 2 and shape[-1] > 1 else None,
        "add_dim": [1] + shape,
        "drop_dim": shape[:-1] if rank >= 1 and shape[-1] == 1 else None,
        "widen": [2] if shape in ([], [1]) else None,
    }[edit]
    return new


def mutations(scheme: str, base: Path) -> list[dict[str, Any]]:
    """The mutations of one base, each with a stable id."""
    out = []
    for edit in declaration_mutations(base) + tensor_mutations(stored_tensors(base)):
        out.append({"id": f"{scheme}:{mutation_key(edit)}", "scheme": scheme, "edit": edit})
    ids = [m["id"] for m in out]
    assert len(ids) == len(set(ids)), "mutation ids must be unique"
    return out


def mutation_key(edit: dict[str, Any]) -> str:
    if "tensor" in edit:
        what = edit["tensor"]
    else:
        what = edit["file"] + ("" if not edit["path"] else ":" + ".".join(map(str, edit["path"])))
    value = "" if edit["op"] == "delete" else "=" + json.dumps(edit.get("value"), sort_keys=True, separators=(",", ":"))
    return f"{what}:{edit['op']}{value}"


# -- applying -------------------------------------------------------------------------------------
def stored_tensors(base: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of the base's one shard, from its header."""
    raw = (base / SHARD).read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    return {n: (e["dtype"], e["shape"]) for n, e in header.items() if n != "__metadata__"}


def apply_mutation(base: Path, mutation: dict[str, Any], out: Path) -> Path:
    """``out``: the base with one edit (files the edit leaves alone are hard links)."""
    out.mkdir(parents=True)
    edit = mutation["edit"]
    changed = {edit.get("file", SHARD)}
    for item in base.iterdir():
        if item.is_file() and item.name not in changed:
            os.link(item, out / item.name)
    if "tensor" in edit:
        _edit_tensors(base / SHARD, out / SHARD, edit)
    else:
        _edit_json(base / edit["file"], out / edit["file"], edit)
    return out


def _edit_json(src: Path, dst: Path, edit: dict[str, Any]) -> None:
    if not edit["path"]:
        return  # the whole file deleted: it is simply not written
    doc = json.loads(src.read_text())
    node = doc
    for key in edit["path"][:-1]:
        node = node[key]
    if edit["op"] == "delete":
        node.pop(edit["path"][-1], None)
    else:
        node[edit["path"][-1]] = copy.deepcopy(edit["value"])
    dst.write_text(json.dumps(doc, indent=2))


def _edit_tensors(src: Path, dst: Path, edit: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    name, op = edit["tensor"], edit["op"]
    tensor = tensors.pop(name)
    if op == "copy":
        tensors[name] = tensor
        tensors[edit["value"]] = tensor.clone()
    elif op == "rename":
        tensors[edit["value"]] = tensor
    elif op != "delete":
        tensors[name] = _edited_tensor(tensor, op, edit.get("value"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst, metadata={"format": "pt"})


def _edited_tensor(tensor, op: str, value: Any):
    import torch

    if op == "dtype":
        target = getattr(torch, TORCH_DTYPES[value])
        same_width = tensor.dtype.itemsize == target.itemsize
        integer = not tensor.dtype.is_floating_point or not target.is_floating_point
        return tensor.view(target) if same_width and integer else tensor.to(target)  # int <-> int: the bytes
    if op == "reciprocal":
        return (1.0 / tensor.float()).to(tensor.dtype)
    new_shape = _reshaped(list(tensor.shape), value)
    if value == "transpose":
        return tensor.t().contiguous()
    if value in ("drop_row", "drop_col"):
        return tensor[:-1] if value == "drop_row" else tensor[..., :-1]
    if value == "widen":
        return tensor.reshape(1).repeat(2)
    return tensor.reshape(new_shape)


TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn", "U8": "uint8", "I8": "int8", "I32": "int32", "I64": "int64"}


# -- bases ----------------------------------------------------------------------------------------
RECIPE = """name = "mutation-base"
description = "attention and routed experts in one scheme, FP8 KV cache"
[[rules]]
components = ["routed_experts", "attention"]
scheme = "{scheme}"
[kv_cache]
scheme = "fp8"
"""
ACT_AMAX = "constant:8"  # any positive amax: the bases need well-formed scales, not calibrated ones
QUANTIZED_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_bases(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """The tiny Qwen3-MoE testbed and one correct base per scheme under ``root`` (project venv:
    needs fp4forge). Deterministic: the same bytes on every build."""
    from fp4forge.testbed import build_tiny_qwen3_moe

    bf16 = root / "bf16"
    if not bf16.is_dir():
        build_tiny_qwen3_moe(bf16, seed=0)
    bases = {}
    for name in names or list(SCHEMES):
        out = root / name
        if not out.is_dir():
            _writer(name)(bf16, out, *SCHEMES[name])
        bases[name] = out
    return bases


def _writer(name: str):
    return write_fp8_block if name in HAND_WRITTEN else write_int4_packed if name in INT_PACKED else _export


def _export(bf16: Path, out: Path, layout: str, scheme: str) -> None:
    import fp4forge
    from fp4forge.quantize.recipe import parse_recipe

    job = fp4forge.QuantizeJob(parse_recipe(RECIPE.format(scheme=scheme)), layout_format=layout, act_scales=ACT_AMAX, error_report=False, device="cpu")
    fp4forge.quantize_checkpoint(bf16, out, job)


def write_fp8_block(bf16: Path, out: Path, layout: str, scheme: str) -> None:
    """Block-wise FP8 by hand: every attention and expert Linear as E4M3 codes with one F32 scale
    (amax / 448) per 128x128 block, declared as compressed-tensors `block` or as `quant_method:
    fp8` + `weight_block_size` (DeepSeek-V3's spelling, `weight_scale_inv`)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: v for shard in sorted(bf16.glob("*.safetensors")) for k, v in load_file(shard).items()}
    suffix = "weight_scale" if layout == "compressed-tensors" else "weight_scale_inv"
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED_LEAVES and ".layers." in n]:
        weight = tensors[name].float()
        rows, cols = weight.shape
        blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(rows, cols)
        tensors[name] = codes.to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + suffix] = scale
    shutil.copytree(bf16, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, out / SHARD, metadata={"format": "pt"})
    config = json.loads((out / CONFIG).read_text())
    config[QC] = _ct_block_declaration() if layout == "compressed-tensors" else _fp8_block_declaration()
    (out / CONFIG).write_text(json.dumps(config, indent=2))


INT4_GROUP = 128
INT4_MAX = 15
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's nibble order within an int32 (its GEMM kernel's)


def write_int4_packed(bf16: Path, out: Path, layout: str, scheme: str) -> None:
    """4-bit group-128 weight-only by hand, every attention and expert Linear: GPTQ as AutoGPTQ
    stores it (symmetric, zero 8 stored as 7, `qweight` [in/8, out] packing eight input rows per
    int32, `qzeros` [groups, out/8], F16 `scales` [groups, out], `g_idx` [in]) or AWQ as AutoAWQ's
    GEMM layout (zero points, `qweight` [in, out/8] packing eight output columns in AWQ_ORDER)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: v for shard in sorted(bf16.glob("*.safetensors")) for k, v in load_file(shard).items()}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED_LEAVES and ".layers." in n]:
        module = name.removesuffix(".weight")
        weight = tensors.pop(name).float().t()  # [in, out]
        groups = weight.reshape(-1, INT4_GROUP, weight.shape[1])
        if layout == "gptq":
            scale = (groups.abs().amax(dim=1) / 7).clamp(min=1e-8)  # [groups, out]
            zero = torch.full_like(scale, 8, dtype=torch.int32)
        else:
            low, high = groups.amin(dim=1).clamp(max=0), groups.amax(dim=1).clamp(min=0)
            scale = ((high - low) / INT4_MAX).clamp(min=1e-8)
            zero = (-low / scale).round().clamp(0, INT4_MAX).to(torch.int32)
        codes = (groups / scale[:, None] + zero[:, None]).round().clamp(0, INT4_MAX).to(torch.int32).reshape(weight.shape)
        tensors[f"{module}.scales"] = scale.to(torch.float16)
        if layout == "gptq":
            tensors[f"{module}.qweight"] = _pack_int4(codes.t(), range(8)).t().contiguous()  # along the input rows
            tensors[f"{module}.qzeros"] = _pack_int4(zero - 1, range(8))
            tensors[f"{module}.g_idx"] = torch.arange(weight.shape[0], dtype=torch.int32) // INT4_GROUP
        else:
            tensors[f"{module}.qweight"] = _pack_int4(codes, AWQ_ORDER)
            tensors[f"{module}.qzeros"] = _pack_int4(zero, AWQ_ORDER)
    shutil.copytree(bf16, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, out / SHARD, metadata={"format": "pt"})
    config = json.loads((out / CONFIG).read_text())
    config[QC] = _gptq_declaration() if layout == "gptq" else _awq_declaration()
    (out / CONFIG).write_text(json.dumps(config, indent=2))


def _pack_int4(values, order) -> Any:
    """[rows, cols] 4-bit values -> [rows, cols / 8] int32, the value at column 8j + order[k]
    in bits 4k..4k+3 of element j."""
    import torch

    grouped = values.reshape(values.shape[0], -1, 8).to(torch.int64)
    packed = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for k, column in enumerate(order):
        packed |= (grouped[..., column] & 0xF) << (4 * k)
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # the same 32 bits, read as signed


def _gptq_declaration() -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": INT4_GROUP, "desc_act": False, "sym": True, "damp_percent": 0.01,
            "true_sequential": True, "static_groups": False}


def _awq_declaration() -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP, "zero_point": True, "version": "gemm", "modules_to_not_convert": None}


def _ct_block_declaration() -> dict[str, Any]:
    leaves = "|".join(QUANTIZED_LEAVES)
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [BLOCK, BLOCK], "symmetric": True, "dynamic": False, "group_size": None}
    inputs = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": BLOCK, "symmetric": True, "dynamic": True}
    group = {"targets": [rf"re:^model\.layers\.\d+\..*\.({leaves})$"], "weights": weights, "input_activations": inputs, "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def _fp8_block_declaration() -> dict[str, Any]:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}



# -- the audit's agreement --------------------------------------------------------------------------
CORPUS_DIR = Path(__file__).resolve().parent / "mutation_corpus"
DOC_BEGIN, DOC_END = "<!-- mutation-agreement:begin", "<!-- mutation-agreement:end -->"
# why the audit and vLLM disagree, by mutation id (a regex searched in the id); every disagreement
# must match one (tests/test_mutation_corpus.py), and docs/audit.md shows the reason beside it
EXPLANATIONS: dict[str, str] = {
    r"(input_scale|input_global_scale|k_scale|v_scale):reciprocal": (
        "an inverted KV scale, or one routed expert's inverted input scale among the experts' own calibrations (vLLM "
        "takes their max), is still a plausible value; the audit reads no activations. Fused shards share one input "
        "and are compared (`fused-input-scale-divergent`)"),
    r"weight_scale_2:dtype=\"BF16\"": (
        "one fused shard's ModelOpt weight_scale_2 rounded to BF16: vLLM takes the max over the shards, 0.4 % off; "
        "the audit holds fused global scales to exact equality (`fused-weight-scale-mismatch`)"),
    r"modules_to_not_convert:set=.*\"model\.layers\.1\"": (
        "vLLM's Fp8Config skips layers by exact name (is_layer_skipped, match_mode exact; an expert stack is one module "
        "there); the audit also lets an ancestor such as `model.layers.1` skip its Linears, as transformers' loader does"),
    r"quant_algo:set=\"(INT4_AWQ|MIXED_PRECISION)\"": (
        "a ModelOpt algorithm vLLM's ModelOptConfig refuses (not in its QUANT_ALGOS), or MIXED_PRECISION without "
        "quantized_layers: fp4forge's vLLM parameter data holds the algorithms it probed, not the list vLLM accepts, "
        "so the audit says `scheme-not-audited` (a warning)"),
    r"\.scales:reciprocal": "inverted GPTQ / AWQ group scales: the audit (default options) reads no values, and `--deep` has no scale-magnitude check for integer formats",
    r"experts\.\d+\.\w+\.qzeros:shape=\"add_dim\"": "a routed expert's GPTQ zero points with a leading dimension of 1: vLLM 0.32's expert loader copies them into the expert's slice as they are (the same values after loading); the audit holds the shape to vLLM's parameter",
}


def load_corpus(corpus: Path = CORPUS_DIR) -> list[dict[str, Any]]:
    """Every stored scheme's verdicts, in SCHEMES order."""
    return [json.loads((corpus / f"{name}.json").read_text()) for name in SCHEMES if (corpus / f"{name}.json").is_file()]


def audit_errors(checkpoint: Path, *, deep: bool = False) -> list[str]:
    """The error rules fp4forge's audit reports on ``checkpoint`` (``deep``: with --deep)."""
    from fp4forge.api import AuditOptions, audit_checkpoint

    return sorted({f.rule for f in audit_checkpoint(str(checkpoint), AuditOptions(deep=deep)).findings if f.severity == "error"})


def judged_by_audit(bases: dict[str, Path], corpus: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    """Each stored mutation with the audit's errors on it (``audit --deep``: what the values say
    is part of the verdict) and whether they agree with vLLM: an error where vLLM refuses or
    degrades, none where it is fine."""
    rows = []
    for scheme in corpus:
        base = bases[scheme["scheme"]]
        for number, mutation in enumerate(scheme["mutations"]):
            mutant = apply_mutation(base, mutation, work / f"{scheme['scheme']}-{number}")
            errors = audit_errors(mutant, deep=True)
            shutil.rmtree(mutant)
            broken = mutation["vllm"]["outcome"] != "fine"
            rows.append({"id": mutation["id"], "scheme": scheme["scheme"], "vllm": mutation["vllm"]["outcome"], "errors": errors, "agrees": broken == bool(errors)})
    return rows


def explanation(mutation_id: str) -> str | None:
    return next((why for pattern, why in EXPLANATIONS.items() if re.search(pattern, mutation_id)), None)


def agreement_markdown(rows: list[dict[str, Any]]) -> str:
    """The figures docs/audit.md states: per scheme, then every disagreement with its reason."""
    lines = ["| scheme | mutations | vLLM refuses | vLLM degrades | vLLM fine | audit agrees | agreement |", "|---|---|---|---|---|---|---|"]
    for scheme in list(dict.fromkeys(r["scheme"] for r in rows)) + ["all"]:
        mine = [r for r in rows if scheme in ("all", r["scheme"])]
        count = {o: sum(r["vllm"] == o for r in mine) for o in ("refuses", "degrades", "fine")}
        agree = sum(r["agrees"] for r in mine)
        label = "**all**" if scheme == "all" else f"`{scheme}`"
        lines.append(f"| {label} | {len(mine)} | {count['refuses']} | {count['degrades']} | {count['fine']} | {agree} | {100 * agree / len(mine):.1f} % |")
    lines += ["", "| mutation | vLLM | audit errors | why they disagree |", "|---|---|---|---|"]
    for r in rows:
        if not r["agrees"]:
            lines.append(f"| `{r['id']}` | {r['vllm']} | {', '.join(r['errors']) or 'none'} | {explanation(r['id']) or '?'} |")
    return "\n".join(lines)


def write_agreement_doc(doc: Path, table: str) -> None:
    text = doc.read_text(encoding="utf-8")
    head, _, rest = text.partition(DOC_BEGIN)
    _, _, tail = rest.partition(DOC_END)
    doc.write_text(f"{head}{DOC_BEGIN} (generated: python -m tests.mutation_support docs) -->\n{table}\n{DOC_END}{tail}", encoding="utf-8")



def main(argv: list[str]) -> None:
    """python -m tests.mutation_support build DIR | docs DIR (DIR: where the bases are built)."""
    if len(argv) != 2 or argv[0] not in ("build", "docs"):
        raise SystemExit("usage: python -m tests.mutation_support build|docs DIR")
    bases = build_bases(Path(argv[1]))
    if argv[0] == "docs":
        work = Path(argv[1]) / "mutants"
        rows = judged_by_audit(bases, load_corpus(), work)
        write_agreement_doc(Path(__file__).resolve().parents[1] / "docs" / "audit.md", agreement_markdown(rows))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
