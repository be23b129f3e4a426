"""Packed formats other than fp4forge's own, judged as vLLM judges them: GPTQ, AWQ (every Linear of
an MoE model, the routed experts included, as vLLM's moe_wna16 / Marlin MoE methods load them),
compressed-tensors int (pack-quantized W4A16 symmetric and with zero points, W8A8), fp8 per tensor,
bitsandbytes 4-bit and 8-bit, and a quant_method fp4forge does not know.

Each checkpoint is header-only, written from the model class's own tensors (the skeleton of a
small Qwen3-MoE) with every projection replaced by the format's tensors, their shapes written out
here by hand from each format's packing (the oracle is that arithmetic, independent of vLLM's
parameter data the audit reads). `bytes` must count exactly the unquantized model's parameters
and the bits/param the arithmetic gives; the audit must be clean on the correct checkpoint and
name what vLLM does for each planted mismatch."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from fp4forge.audit.byte_table import byte_table_of
from fp4forge.audit.engine import audit_checkpoint
from fp4forge.checkpoint.skeleton import checkpoint_specs
from fp4forge.checkpoint.writer import TensorSpec
from fp4forge.testbed.moe_zoo import nvfp4_modules, zoo_config

GROUP = 128
ATTENTION = "model.layers.1.self_attn.q_proj"
EXPERT = "model.layers.2.mlp.experts.3.down_proj"


@pytest.fixture(scope="module")
def model():
    config = dict(zoo_config("qwen3_moe"), architectures=["Qwen3MoeForCausalLM"])
    specs = checkpoint_specs(config)
    return config, specs, set(nvfp4_modules(config, specs))


def gptq(module: str, out: int, inp: int, bits: int = 4, group: int = GROUP) -> list[TensorSpec]:
    """AutoGPTQ's tensors: 32 / bits values per int32 along the input, zero points packed along
    the output, one scale row per group, g_idx per input channel."""
    per = 32 // bits
    return [TensorSpec(f"{module}.qweight", "I32", (inp // per, out)), TensorSpec(f"{module}.qzeros", "I32", (inp // group, out // per)),
            TensorSpec(f"{module}.scales", "F16", (inp // group, out)), TensorSpec(f"{module}.g_idx", "I32", (inp,))]


def awq(module: str, out: int, inp: int) -> list[TensorSpec]:
    """AutoAWQ GEMM: eight 4-bit values per int32 along the output (its own packing order)."""
    return [TensorSpec(f"{module}.qweight", "I32", (inp, out // 8)), TensorSpec(f"{module}.qzeros", "I32", (inp // GROUP, out // 8)),
            TensorSpec(f"{module}.scales", "F16", (inp // GROUP, out))]


def ct_w4a16(module: str, out: int, inp: int, zero_points: bool = False) -> list[TensorSpec]:
    """compressed-tensors pack-quantized: eight 4-bit values per int32 along the input."""
    specs = [TensorSpec(f"{module}.weight_packed", "I32", (out, inp // 8)), TensorSpec(f"{module}.weight_scale", "BF16", (out, inp // GROUP)),
             TensorSpec(f"{module}.weight_shape", "I64", (2,))]
    if zero_points:
        specs.append(TensorSpec(f"{module}.weight_zero_point", "I32", (out // 8, inp // GROUP)))
    return specs


def ct_w8a8(module: str, out: int, inp: int) -> list[TensorSpec]:
    return [TensorSpec(f"{module}.weight", "I8", (out, inp)), TensorSpec(f"{module}.weight_scale", "BF16", (out, 1))]


def fp8_tensor(module: str, out: int, inp: int) -> list[TensorSpec]:
    return [TensorSpec(f"{module}.weight", "F8_E4M3", (out, inp)), TensorSpec(f"{module}.weight_scale", "F32", ())]


def bnb4(module: str, out: int, inp: int) -> list[TensorSpec]:
    """bitsandbytes Params4bit with double quantization: two values per byte, flat; 8-bit absmax
    per 64 values, their own absmax per 256 blocks, the code books and the serialized state."""
    n = out * inp
    return [TensorSpec(f"{module}.weight", "U8", (n // 2, 1)), TensorSpec(f"{module}.weight.absmax", "U8", (n // 64,)),
            TensorSpec(f"{module}.weight.quant_map", "F32", (16,)), TensorSpec(f"{module}.weight.nested_absmax", "F32", (n // 64 // 256,)),
            TensorSpec(f"{module}.weight.nested_quant_map", "F32", (256,)), TensorSpec(f"{module}.weight.quant_state.bitsandbytes__nf4", "U8", (120,))]


def bnb8(module: str, out: int, inp: int) -> list[TensorSpec]:
    return [TensorSpec(f"{module}.weight", "I8", (out, inp)), TensorSpec(f"{module}.SCB", "F32", (out,))]


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def ct(weights: dict, inputs: dict | None, fmt: str) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*mlp.gate$"]}


CT_W4A16 = ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}, None, "pack-quantized")
CT_W4A16_ASYM = ct({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": GROUP}, None, "pack-quantized")
CT_W8A8 = ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
             {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}, "int-quantized")
BNB4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
BNB8 = {"quant_method": "bitsandbytes", "load_in_8bit": True}


def build(tmp: Path, model, declaration: dict, per_linear, plant=None) -> Path:
    config, specs, modules = model
    out = []
    for spec in specs:
        module = spec.name.removesuffix(".weight")
        out += per_linear(module, *spec.shape) if module in modules else [spec]
    if plant is not None:
        out = plant(out)
    path = tmp / "ckpt"
    shutil.rmtree(path, ignore_errors=True)
    return write_with_unit_scales(path, out, dict(config, quantization_config=declaration))


def write_with_unit_scales(path: Path, specs: list[TensorSpec], config: dict) -> Path:
    """A header-only checkpoint whose float scales hold 1.0 (file holes would read as zero scales,
    a defect of its own)."""
    import torch

    from fp4forge.checkpoint.layout import split_suffix
    from fp4forge.checkpoint.writer import CheckpointWriter

    dtypes = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    with CheckpointWriter(path, specs, sparse=True) as writer:
        for spec in specs:
            if spec.dtype in dtypes and split_suffix(spec.name)[2] == "weight_scale":
                writer.write(spec.name, torch.ones(spec.shape, dtype=dtypes[spec.dtype]))
        writer.write_text("config.json", json.dumps(config, indent=2) + "\n")
    return path


def errors(path: Path) -> list[dict]:
    return [f for f in audit_checkpoint(str(path)).to_json()["findings"] if f["severity"] == "error"]


def unquantized_params(model) -> int:
    return sum(math.prod(s.shape) for s in model[1])


def hand_bpp(model, per_linear) -> float:
    """bits per parameter of the routed experts, from the tensors the format stores per Linear."""
    config, specs, modules = model
    nbytes = params = 0
    for spec in specs:
        module = spec.name.removesuffix(".weight")
        if module in modules and ".experts." in module:
            params += math.prod(spec.shape)
            nbytes += sum(math.prod(t.shape) * {"I32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F32": 4, "I8": 1, "F8_E4M3": 1}[t.dtype] for t in per_linear(module, *spec.shape))
    return nbytes * 8 / params


CLEAN = [("gptq", GPTQ, gptq), ("awq", AWQ, awq), ("ct-w4a16", CT_W4A16, ct_w4a16),
         ("ct-w4a16-zero-points", CT_W4A16_ASYM, lambda m, o, i: ct_w4a16(m, o, i, zero_points=True)), ("ct-w8a8-int", CT_W8A8, ct_w8a8),
         ("fp8-per-tensor", {"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_tensor)]


@pytest.mark.parametrize(("name", "declaration", "per_linear"), CLEAN, ids=[c[0] for c in CLEAN])
def test_packed_format_counts_and_audits_clean(tmp_path, model, name, declaration, per_linear):
    path = build(tmp_path, model, declaration, per_linear)
    table = byte_table_of(path)
    assert table.not_understood is None and table.unknown_tensors == []
    assert table.total_params == unquantized_params(model)
    assert table.experts_bpp == pytest.approx(hand_bpp(model, per_linear), rel=1e-12)
    assert errors(path) == []


@pytest.mark.parametrize(("declaration", "per_linear", "bpp_floor"), [(BNB4, bnb4, 4.0), (BNB8, bnb8, 8.0)], ids=["bnb-4bit-nf4-double-quant", "bnb-8bit"])
def test_bitsandbytes_counted_and_refused_by_vllm(tmp_path, model, declaration, per_linear, bpp_floor):
    """bitsandbytes: every parameter counted (two per byte at 4 bits), no false shape error for
    its flat packing, and vLLM 0.32's refusal named: it has no bitsandbytes config class."""
    path = build(tmp_path, model, declaration, per_linear)
    table = byte_table_of(path)
    assert table.total_params == unquantized_params(model)
    assert table.experts_bpp == pytest.approx(hand_bpp(model, per_linear), rel=1e-12) and table.experts_bpp > bpp_floor
    assert [f["rule"] for f in errors(path)] == ["quant-method-unknown-to-vllm"]


def _drop(name):
    return lambda specs: [s for s in specs if s.name != name]


def _reshape(name, shape):
    return lambda specs: [TensorSpec(s.name, s.dtype, shape) if s.name == name else s for s in specs]


def _retype(name, dtype):
    return lambda specs: [TensorSpec(s.name, dtype, s.shape) if s.name == name else s for s in specs]


PLANTED = [
    ("gptq-qzeros-missing", GPTQ, gptq, _drop(f"{ATTENTION}.qzeros"), "vllm-param-missing"),
    ("gptq-expert-scales-wrong-group", GPTQ, gptq, _reshape(f"{EXPERT}.scales", (768 // 64, 2048)), "vllm-param-shape"),
    ("gptq-qweight-as-float", GPTQ, gptq, _retype(f"{ATTENTION}.qweight", "F16"), "vllm-param-dtype"),
    ("gptq-qweight-narrowed", GPTQ, gptq, _retype(f"{ATTENTION}.qweight", "I16"), "vllm-param-dtype"),
    ("gptq-foreign-tensor", GPTQ, gptq, lambda s: s + [TensorSpec(f"{ATTENTION}.weight_packed", "I32", (4096, 256))], "vllm-param-unexpected"),
    ("gptq-desc-act-groups", dict(GPTQ, desc_act=True), gptq, None, "scheme-refused-by-vllm"),
    ("gptq-asymmetric", dict(GPTQ, sym=False), gptq, None, "scheme-refused-by-vllm"),
    ("gptq-declared-8bit-stored-4bit", dict(GPTQ, bits=8), gptq, None, "vllm-param-shape"),
    ("awq-packed-along-input", AWQ, awq, _reshape(f"{ATTENTION}.qweight", (2048 // 8, 4096)), "vllm-param-shape"),
    ("ct-zero-points-declared-symmetric", CT_W4A16, lambda m, o, i: ct_w4a16(m, o, i, zero_points=True), None, "vllm-param-unexpected"),
    ("ct-asymmetric-without-zero-points", CT_W4A16_ASYM, ct_w4a16, None, "vllm-param-missing"),
    ("ct-weight-shape-missing", CT_W4A16, ct_w4a16, _drop(f"{EXPERT}.weight_shape"), "vllm-param-missing"),
    ("ct-w8a8-static-declared-dynamic-stored", ct(CT_W8A8["config_groups"]["group_0"]["weights"], {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}, "int-quantized"),
     ct_w8a8, None, "vllm-param-missing"),
    ("fp8-int8-weight", {"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_tensor, _retype(f"{ATTENTION}.weight", "I8"), "vllm-param-dtype"),
]


@pytest.mark.parametrize(("name", "declaration", "per_linear", "plant", "rule"), PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_mismatch_is_an_error_naming_what_vllm_does(tmp_path, model, name, declaration, per_linear, plant, rule):
    found = errors(build(tmp_path, model, declaration, per_linear, plant))
    assert rule in {f["rule"] for f in found}, found


def test_unknown_quant_method_is_not_judged_and_not_misnamed(tmp_path, model):
    """A quant_method fp4forge does not know: no headline, an explicit reason, no name checks
    (GPTQ-style names would otherwise be `tensor-misnamed`)."""
    path = build(tmp_path, model, {"quant_method": "hqq", "nbits": 4}, gptq)
    table = byte_table_of(path)
    assert table.bpp is None and "hqq" in table.not_understood and table.to_json()["total"]["bpp"] is None
    rules = {f["rule"] for f in audit_checkpoint(str(path)).to_json()["findings"]}
    assert "format-not-judged" in rules and "quant-method-unknown-to-vllm" in rules
    assert not rules & {"tensor-misnamed", "tensor-unexpected", "parameter-missing"}


CT_ARGS = [
    {"num_bits": 4, "type": "int", "group_size": 128},
    {"num_bits": 8, "type": "int", "group_size": -1, "symmetric": False},
    {"num_bits": 8, "type": "float", "strategy": "TENSOR", "dynamic": True},
    {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
    {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
    {"num_bits": 4, "type": "int", "group_size": 32, "actorder": "weight"},
    {"num_bits": 4, "group_size": 64, "actorder": True},
    {},
]


@pytest.mark.parametrize("args", CT_ARGS)
def test_ct_args_read_as_compressed_tensors_reads_them(args):
    """The fields fp4forge keys vLLM's data by are those compressed-tensors' own QuantizationArgs
    model produces from the same object (defaults, strategy inference, enum spellings)."""
    from compressed_tensors.quantization import QuantizationArgs

    from fp4forge.checkpoint.vllm_params import CT_ARG_DEFAULTS, ct_args

    model = QuantizationArgs.model_validate(args)
    expected = {}
    for key in CT_ARG_DEFAULTS:
        value = getattr(model, key)
        expected[key] = getattr(value, "value", value)
    assert ct_args(args) == expected


@pytest.mark.slow
@pytest.mark.parametrize(("script_name", "data_name"), [("vllm_quant_params.py", "VLLM_QUANT_PARAMS"), ("vllm_loader_ignores.py", "VLLM_LOADER_IGNORES")])
def test_vllm_data_shipped_equal_installed_vllm(vllm_venv, script_name, data_name):
    """The shipped data is what the installed vLLM says: the parameters its quant methods create
    (and the keys their config classes require), and what its weight loaders skip."""
    import subprocess

    from fp4forge.checkpoint import vllm_params
    from fp4forge.checkpoint.layout import LAYOUTS_DIR

    script = Path(__file__).resolve().parent.parent / "scripts" / script_name
    result = subprocess.run([str(vllm_venv / "bin" / "python"), str(script)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == json.loads((LAYOUTS_DIR / getattr(vllm_params, data_name)).read_text())


def test_awq_modules_to_not_convert_match_by_substring(tmp_path, model):
    """vLLM's AWQ skips every Linear whose name contains an entry: attention kept BF16 under
    `self_attn` is clean; attention quantized all the same is quantized-but-not-targeted. (A list
    is all vLLM skips: the BF16 router must be in it, `mlp.gate`.)"""
    keep = dict(AWQ, modules_to_not_convert=["self_attn", "mlp.gate"])

    def attention_bf16(module, out, inp):
        return [TensorSpec(f"{module}.weight", "BF16", (out, inp))] if "self_attn" in module else awq(module, out, inp)

    assert errors(build(tmp_path, model, keep, attention_bf16)) == []
    assert "quantized-but-not-targeted" in {f["rule"] for f in errors(build(tmp_path, model, keep, awq))}


def fp8_channel(module: str, out: int, inp: int) -> list[TensorSpec]:
    return [TensorSpec(f"{module}.weight", "F8_E4M3", (out, inp)), TensorSpec(f"{module}.weight_scale", "F32", (out,))]


def test_modelopt_fp8_per_channel_judged_by_vllms_parameters(tmp_path, model):
    """ModelOpt FP8_PER_CHANNEL_PER_TOKEN (no tensor table of fp4forge's own): one F32 scale per
    output channel, as vLLM's Linear method creates it; a per-tensor scale instead is a shape vLLM
    rejects. (The routed experts stay BF16 here: vLLM 0.32's ModelOpt FP8 MoE method creates
    per-tensor scales and an input scale whatever the algo, and the audit says so for them.)"""
    declaration = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": ["lm_head", "*.mlp.gate", "*.mlp.experts.*"]}

    def experts_bf16(module, out, inp):
        return [TensorSpec(f"{module}.weight", "BF16", (out, inp))] if ".experts." in module else fp8_channel(module, out, inp)

    path = build(tmp_path, model, declaration, experts_bf16)
    assert errors(path) == [] and byte_table_of(path).total_params == unquantized_params(model)
    planted = build(tmp_path, model, declaration, experts_bf16, _reshape(f"{ATTENTION}.weight_scale", ()))
    assert "vllm-param-shape" in {f["rule"] for f in errors(planted)}


def test_group_size_not_probed_is_counted_and_said_not_audited(tmp_path, model):
    """GPTQ with a group size vLLM's data was not measured at: its packing (bits alone) still
    counts every parameter, and the audit says the Linears were not compared instead of guessing."""
    def gptq_256(module, out, inp):
        return gptq(module, out, inp, group=256)

    path = build(tmp_path, model, dict(GPTQ, group_size=256), gptq_256)
    table = byte_table_of(path)
    assert table.total_params == unquantized_params(model) and table.experts_bpp == pytest.approx(hand_bpp(model, gptq_256), rel=1e-12)
    found = audit_checkpoint(str(path)).to_json()["findings"]
    # a header-only test checkpoint has no tokenizer: the files a server reads are "not checked" (info)
    assert [f["rule"] for f in found if f["rule"] != "server-file-absent"] == ["scheme-not-audited"]


@pytest.mark.parametrize(("declaration", "per_linear"), [(GPTQ, gptq), ({"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_tensor)], ids=["gptq", "fp8-per-tensor"])
def test_linear_left_bf16_under_a_packed_declaration(tmp_path, model, declaration, per_linear):
    """One attention projection stored BF16 while the declaration quantizes every Linear: vLLM
    has only the scheme's parameters for it (module-not-quantized)."""
    def one_bf16(module, out, inp):
        return [TensorSpec(f"{module}.weight", "BF16", (out, inp))] if module == ATTENTION else per_linear(module, out, inp)

    found = errors(build(tmp_path, model, declaration, one_bf16))
    assert [f["rule"] for f in found] == ["module-not-quantized"] and found[0]["tensors"] == [f"{ATTENTION}.weight"]


def _with_zero_biases(specs: list[TensorSpec]) -> list[TensorSpec]:
    """AutoGPTQ's QuantLinear layout: an F16 bias [out] beside every packed Linear."""
    return specs + [TensorSpec(s.name.removesuffix(".scales") + ".bias", "F16", (s.shape[1],)) for s in specs if s.name.endswith(".scales")]


def test_zero_biases_vllms_loader_skips_are_information(tmp_path, model):
    """AutoGPTQ's zero biases on an architecture whose vLLM loader skips an unexpected `.bias`
    (Qwen3-MoE: AutoWeightsLoader): named once as information, counted, no error; under an
    architecture vLLM's data says raises on them (GPT-OSS's hand-written loader), unexpected."""
    from fp4forge.checkpoint import vllm_params

    assert vllm_params.suffixes_skipped_by_loader(["Qwen3MoeForCausalLM"]) == ("bias",)
    assert vllm_params.suffixes_skipped_by_loader(["GptOssForCausalLM"]) == ()
    path = build(tmp_path, model, GPTQ, gptq, _with_zero_biases)
    findings = audit_checkpoint(str(path)).to_json()["findings"]
    assert [f for f in findings if f["severity"] == "error"] == []
    skipped = [f for f in findings if f["rule"] == "tensor-skipped-by-vllm"]
    assert len(skipped) == 1 and skipped[0]["severity"] == "info" and all(t.endswith(".bias") for t in skipped[0]["tensors"])
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, architectures=["GptOssForCausalLM"])))
    assert "tensor-unexpected" in {f["rule"] for f in errors(path)}


@pytest.mark.parametrize(("declaration", "missing"), [(GPTQ, "desc_act"), (GPTQ, "sym"), (AWQ, "zero_point"), (AWQ, "group_size")])
def test_a_key_vllms_config_class_requires_is_missing(tmp_path, model, declaration, missing):
    """vLLM's AutoGPTQConfig / AutoAWQConfig read these with get_from_keys (no default): without
    them vLLM does not start; the audit says which (the keys read from vLLM's from_config)."""
    per_linear = gptq if declaration is GPTQ else awq
    found = errors(build(tmp_path, model, {k: v for k, v in declaration.items() if k != missing}, per_linear))
    assert any(f["rule"] == "quant-config-invalid" and missing in f["message"] for f in found), found


def test_awq_named_skips_leave_the_router_targeted(tmp_path, model):
    """Without modules_to_not_convert vLLM's AWQ leaves every Linear stored in floats unquantized
    (the router included); with a list it skips exactly those names, so the BF16 router is
    targeted and vLLM cannot load it."""
    assert errors(build(tmp_path, model, dict(AWQ, modules_to_not_convert=None), awq)) == []
    found = errors(build(tmp_path, model, dict(AWQ, modules_to_not_convert=["model.layers.9.nothing"]), awq))
    assert any(f["rule"] == "module-not-quantized" and any(".mlp.gate." in t for t in f["tensors"]) for f in found), found


def test_gptq_3bit_counts_every_parameter(tmp_path, model):
    """3-bit GPTQ packs 32 values into three int32s ([in * 3 / 32, out]); vLLM 0.32 accepts no
    3-bit GPTQ, so the packing comes from the width its int32 holds at the bits it accepts."""
    def gptq3(module, out, inp):
        return [TensorSpec(f"{module}.qweight", "I32", (inp * 3 // 32, out)), TensorSpec(f"{module}.qzeros", "I32", (inp // GROUP, out * 3 // 32)),
                TensorSpec(f"{module}.scales", "F16", (inp // GROUP, out)), TensorSpec(f"{module}.g_idx", "I32", (inp,))]

    path = build(tmp_path, model, dict(GPTQ, bits=3), gptq3)
    table = byte_table_of(path)
    assert table.total_params == unquantized_params(model)
    assert table.experts_bpp == pytest.approx(hand_bpp(model, gptq3), rel=1e-12)
    assert [f["rule"] for f in errors(path)] == ["scheme-refused-by-vllm"]


def test_packed_words_widened_to_int64_load_as_stored(tmp_path, model):
    """vLLM copies an I64 `qweight` / `qzeros` into its I32 parameter with a truncating cast: the
    low 32 bits, the packed word, survive (the mutation oracle measures the same values after
    loading), so the audit reports no dtype error for them."""
    words = (f"{ATTENTION}.qweight", f"{ATTENTION}.qzeros")
    assert errors(build(tmp_path, model, GPTQ, gptq, lambda specs: [TensorSpec(s.name, "I64", s.shape) if s.name in words else s for s in specs])) == []
