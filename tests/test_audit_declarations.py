"""`fp4forge audit`, declaration rules: quantization_config / hf_quant_config.json against the
tensors. Every defect is planted in a copy of a real llm-compressor export of the tiny Laguna
(NVFP4 W4A4 + FP8 KV, FP8_DYNAMIC) or of its ModelOpt conversion, and must give exactly its
finding; the clean exports must give no error at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_audit_integrity import (
    assert_exactly,
    audit,
    copy_checkpoint,
    finding,
    load_tensors,
    patch_json,
    rebuild,
    rules,
)

pytestmark = pytest.mark.slow

ATTN = "model.layers.1.self_attn"
EXPERT = "model.layers.2.mlp.experts"
# llm-compressor writes its export owner-only (measured: mode 0600; tests/test_audit_integrity.py):
# the raw exports carry that warning besides whatever a test is about
LC_OWNER_ONLY = {"file-not-world-readable"}
HF_QUANT_CONFIG = "hf_quant_config.json"


def qc(doc: dict) -> dict:
    return doc["quantization_config"]


@pytest.fixture()
def ct(lc_nvfp4_kv_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the llm-compressor NVFP4 W4A4 + FP8-KV export (compressed-tensors)."""
    return copy_checkpoint(lc_nvfp4_kv_dir, tmp_path / "ct")


@pytest.fixture()
def modelopt(modelopt_nvfp4_kv_dir: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(modelopt_nvfp4_kv_dir, tmp_path / "modelopt")


def edited(src: Path, tmp_path: Path, edit) -> Path:
    return rebuild(src, tmp_path / "edited", edit)


# -- clean exports ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["lc_nvfp4_kv_dir", "lc_fp8_dynamic_dir", "modelopt_nvfp4_kv_dir"])
def test_clean_exports_have_no_errors(fixture: str, request: pytest.FixtureRequest) -> None:
    report = audit(request.getfixturevalue(fixture))
    # llm-compressor writes its files owner-only (measured: mode 0600), fp4forge's conversion does not
    assert_exactly(report, warnings=LC_OWNER_ONLY if fixture.startswith("lc_") else set())
    assert report.exit_code == 0


def test_clean_export_deep_reports_scale_statistics(lc_nvfp4_kv_dir: Path) -> None:
    report = audit(lc_nvfp4_kv_dir, deep=True)
    assert_exactly(report, warnings=LC_OWNER_ONLY)
    stats = [f for f in report.findings if f.rule == "scale-statistics"]
    assert any("routed-expert Linears" in f.message and "input_global_scale" in f.message for f in stats)


@pytest.mark.parametrize("fixture", ["lc_nvfp4_kv_dir", "lc_fp8_dynamic_dir", "modelopt_nvfp4_kv_dir"])
def test_clean_exports_deep_reach_their_scales(fixture: str, request: pytest.FixtureRequest) -> None:
    """The raw llm-compressor exports (and fp4forge's ModelOpt conversion of one): every weight's
    largest dequantized value reaches the amax its scales imply (no scale-magnitude finding)."""
    report = audit(request.getfixturevalue(fixture), deep=True)
    assert_exactly(report, warnings=LC_OWNER_ONLY if fixture.startswith("lc_") else set())
    assert not [f for f in report.findings if f.rule == "scale-magnitude"]


# -- the declaration itself -------------------------------------------------------------------------
def test_kv_cache_scheme_without_strategy(ct: Path) -> None:
    patch_json(ct / "config.json", lambda d: qc(d)["kv_cache_scheme"].pop("strategy"))
    report = audit(ct)
    assert_exactly(report, "quant-config-invalid")
    assert "strategy" in finding(report, "quant-config-invalid").message


def test_hf_quant_config_without_group_size(modelopt: Path) -> None:
    patch_json(modelopt / "config.json", lambda d: d.pop("quantization_config"))  # vLLM falls back to hf_quant_config.json
    patch_json(modelopt / HF_QUANT_CONFIG, lambda d: d["quantization"].pop("group_size"))
    report = audit(modelopt)
    assert_exactly(report, "quant-config-invalid")
    assert "group_size" in finding(report, "quant-config-invalid").message


def test_format_flag_disagreeing_with_the_declaration(lc_nvfp4_kv_dir: Path) -> None:
    report = audit(lc_nvfp4_kv_dir, fmt="modelopt")
    assert_exactly(report, "quant-format-conflict", warnings=LC_OWNER_ONLY)
    assert rules(audit(lc_nvfp4_kv_dir, fmt="compressed-tensors"), "error") == set()


def test_quantized_tensors_without_declaration(ct: Path) -> None:
    patch_json(ct / "config.json", lambda d: d.pop("quantization_config"))
    report = audit(ct)
    assert_exactly(report, "quantized-without-declaration", warnings={"kv-scale-undeclared"})


def test_int_declaration_over_fp8_codes_is_judged_by_the_scheme_vllm_builds(lc_fp8_dynamic_dir: Path, tmp_path: Path) -> None:
    # an INT8 channel group fp4forge has no tensor table for: vLLM builds W8A8 int8 for it (its
    # _is_dynamic_token_w8a8 reads no input type), and the stored FP8 codes would be cast into
    # its int8 weight parameter as numbers
    fp8 = copy_checkpoint(lc_fp8_dynamic_dir, tmp_path / "fp8")
    patch_json(fp8 / "config.json", lambda d: qc(d)["config_groups"]["group_0"]["weights"].update(type="int"))
    report = audit(fp8)
    assert_exactly(report, "scheme-tensor-dtype")
    assert "vLLM builds CompressedTensorsW8A8Int8" in finding(report, "scheme-tensor-dtype").message
    assert "scheme-not-audited" in rules(report, "info")


def test_block_declaration_over_channel_scales_is_a_shape_error(lc_fp8_dynamic_dir: Path, tmp_path: Path) -> None:
    # FP8 block is judged now: per-channel scales [out, 1] under a [128, 128] block declaration
    # would be read as block scales by vLLM
    fp8 = copy_checkpoint(lc_fp8_dynamic_dir, tmp_path / "fp8")
    patch_json(fp8 / "config.json", lambda d: qc(d)["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128]))
    report = audit(fp8)
    assert_exactly(report, "scheme-tensor-shape")
    assert "weight_scale" in finding(report, "scheme-tensor-shape").message


# -- KV cache scales --------------------------------------------------------------------------------
def test_kv_scale_absent(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t.pop(f"{ATTN}.v_scale")))
    assert_exactly(report, "kv-scale-absent")
    assert finding(report, "kv-scale-absent").tensors == [f"{ATTN}.v_scale"]


def test_kv_scales_all_absent_says_scale_one(ct: Path, tmp_path: Path) -> None:
    def drop_all(tensors):
        for name in [n for n in tensors if n.endswith(("k_scale", "v_scale"))]:
            del tensors[name]

    report = audit(edited(ct, tmp_path, drop_all))
    assert_exactly(report, "kv-scale-absent")
    assert finding(report, "kv-scale-absent").count == 4 and "1.0" in finding(report, "kv-scale-absent").message


def test_kv_scale_in_the_modelopt_spelling_inside_a_ct_checkpoint(ct: Path, tmp_path: Path) -> None:
    # vLLM's Laguna loader (AutoWeightsLoader) applies the cache-scale mapper: it lands either
    # spelling on the attention layer (checkpoint/layouts/_vllm_packed.json kv_scales_remapped)
    report = audit(edited(ct, tmp_path, lambda t: t.update({f"{ATTN}.k_proj.k_scale": t.pop(f"{ATTN}.k_scale")})))
    assert_exactly(report, warnings={"kv-scale-other-spelling"})
    assert finding(report, "kv-scale-other-spelling").tensors == [f"{ATTN}.k_proj.k_scale"]


def test_kv_scale_in_the_other_spelling_where_vllm_does_not_remap(ct: Path, tmp_path: Path) -> None:
    # an architecture whose vLLM loader the data does not list keeps the error
    def drop_remap(d):
        d["architectures"] = ["NoSuchRemappingForCausalLM"]

    out = edited(ct, tmp_path, lambda t: t.update({f"{ATTN}.k_proj.k_scale": t.pop(f"{ATTN}.k_scale")}))
    patch_json(out / "config.json", drop_remap)
    assert "kv-scale-misnamed" in rules(audit(out), "error")


def test_kv_scale_in_the_ct_spelling_inside_a_modelopt_checkpoint(modelopt: Path, tmp_path: Path) -> None:
    def respell(tensors):
        for layer in range(4):
            for kv in "kv":
                prefix = f"model.layers.{layer}.self_attn"
                tensors[f"{prefix}.{kv}_scale"] = tensors.pop(f"{prefix}.{kv}_proj.{kv}_scale")

    report = audit(edited(modelopt, tmp_path, respell))
    assert_exactly(report, warnings={"kv-scale-other-spelling"})
    assert finding(report, "kv-scale-other-spelling").count == 8


def test_kv_scale_under_a_name_vllm_drops(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t.update({"model.layers.1.mlp.k_scale": t.pop(f"{ATTN}.k_scale")})))
    assert_exactly(report, "kv-scale-misnamed")  # it stands in for layer 1's k_scale, which is absent
    assert "expected model.layers.1.self_attn.k_scale" in finding(report, "kv-scale-misnamed").message
    assert "dropped silently" in finding(report, "kv-scale-misnamed").message


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_kv_scale_not_finite_positive(bad: float, ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t[f"{ATTN}.k_scale"].fill_(bad)))
    assert_exactly(report, "kv-scale-invalid")


def test_kv_scale_with_more_than_one_element(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t.update({f"{ATTN}.v_scale": torch.ones(2, dtype=torch.bfloat16)})))
    assert_exactly(report, "kv-scale-invalid")


@pytest.mark.parametrize("layout", ["ct", "modelopt"])
def test_nvfp4_weight_scale_in_the_other_convention(layout: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # one expert's per-tensor scale written as the other layout's reciprocal (2688/amax <-> amax/2688)
    suffix = "weight_global_scale" if layout == "ct" else "weight_scale_2"
    flipped = []

    def flip(tensors):
        name = next(n for n in sorted(tensors) if n.startswith(f"{EXPERT}.3.") and n.endswith("." + suffix))
        tensors[name] = 1.0 / tensors[name]
        flipped.append(name)

    report = audit(edited(request.getfixturevalue(layout), tmp_path, flip))
    assert_exactly(report, "scale-convention")
    assert finding(report, "scale-convention").tensors == flipped


def test_kv_scales_all_one_are_uncalibrated(ct: Path, tmp_path: Path) -> None:
    def ones(tensors):
        for name in tensors:
            if name.endswith(("k_scale", "v_scale")):
                tensors[name].fill_(1.0)

    report = audit(edited(ct, tmp_path, ones))
    assert_exactly(report, warnings={"kv-scale-uncalibrated"})
    assert report.exit_code == 0


def test_kv_scales_without_declaration(ct: Path) -> None:
    patch_json(ct / "config.json", lambda d: qc(d).update(kv_cache_scheme=None))
    report = audit(ct)
    assert_exactly(report, warnings={"kv-scale-undeclared"})


# -- targets and ignore ---------------------------------------------------------------------------
def test_target_and_ignore_that_match_nothing(ct: Path) -> None:
    def add(d):
        qc(d)["config_groups"]["group_0"]["targets"].append("re:.*mlp\\.shared_mlp\\..*")
        qc(d)["ignore"].append("model.layers.9.mlp.gate")

    patch_json(ct / "config.json", add)
    report = audit(ct)
    assert_exactly(report, warnings={"target-matches-nothing"})
    assert "shared_mlp" in finding(report, "target-matches-nothing").message


def test_modelopt_config_json_declaring_kv_only_as_kv_cache_quant_algo(modelopt: Path) -> None:
    # vLLM 0.32's ModelOpt configs give every attention layer the KV cache method whatever the
    # form, and the cache dtype comes from kv_cache_quant_algo: an FP8 cache with the calibrated
    # scales loaded (measured: tests/mutation_corpus/modelopt-*.json, kv_cache_scheme:delete)
    def algo_only(d):
        quant = qc(d)
        quant.pop("kv_cache_scheme", None)
        quant["kv_cache_quant_algo"] = "FP8"

    patch_json(modelopt / "config.json", algo_only)
    assert "quant-config-invalid" not in rules(audit(modelopt), "error")


def test_modelopt_sidecar_that_disagrees_with_config_json(modelopt: Path) -> None:
    # vLLM reads config.json's quantization_config, TensorRT-LLM hf_quant_config.json first
    patch_json(modelopt / "hf_quant_config.json", lambda d: d["quantization"].update(kv_cache_quant_algo=None))
    report = audit(modelopt)
    assert_exactly(report, warnings={"modelopt-sidecar-differs"})
    assert "different KV caches (fp8 vs none)" in finding(report, "modelopt-sidecar-differs").message


def test_modelopt_export_agrees_with_its_sidecar(modelopt: Path) -> None:
    # the control: fp4forge's and llm-compressor's ModelOpt exports write both forms alike
    assert "quant-config-invalid" not in rules(audit(modelopt), "error")


def _relabel_fp8(ct: Path, fmt: str) -> None:
    def relabel(d):
        group = qc(d)["config_groups"]["group_0"]
        group["weights"] = {**group["weights"], "num_bits": 8, "type": "float", "strategy": "tensor", "group_size": None}
        group["input_activations"] = {**(group.get("input_activations") or {}), "num_bits": 8, "type": "float", "strategy": "tensor", "group_size": None, "dynamic": False}
        group["format"] = fmt

    patch_json(ct / "config.json", relabel)


def test_group_format_string_that_disagrees_with_its_scheme(ct: Path) -> None:
    # FP8 arguments under nvfp4-pack-quantized: vLLM builds the same W8A8 FP8 scheme (the string
    # only tells it an activation format), compressed-tensors would pick the NVFP4 decompressor
    _relabel_fp8(ct, "nvfp4-pack-quantized")
    report = audit(ct)
    assert "quant-config-invalid" not in rules(report, "error")
    assert "ct-format-string-differs" in rules(report, "warning")
    assert "disagrees with its fp8 arguments" in finding(report, "ct-format-string-differs").message


def test_group_format_string_vllm_refuses(ct: Path) -> None:
    # under pack-quantized vLLM's _get_scheme_from_parts finds no scheme for FP8 W8A8 and raises
    _relabel_fp8(ct, "pack-quantized")
    report = audit(ct)
    assert "quant-config-invalid" in rules(report, "error")
    assert "NotImplementedError" in finding(report, "quant-config-invalid").message


def test_ignore_entries_naming_real_non_linear_modules_are_not_noise(ct: Path) -> None:
    # llm-compressor's data-free path ignores model.embed_tokens; ModelOpt exports exclude norms:
    # real modules that are not Linears. Only an entry naming no module at all is worth a warning.
    def add(d):
        qc(d)["ignore"] += ["model.embed_tokens", "model.norm", "re:.*input_layernorm$", "re:.*layers\\.1\\.self_attn$", "model.layers.9.mlp.gate"]

    patch_json(ct / "config.json", add)
    report = audit(ct)
    assert_exactly(report, warnings={"target-matches-nothing"})
    message = finding(report, "target-matches-nothing").message
    assert "model.layers.9.mlp.gate" in message
    assert not any(real in message for real in ("embed_tokens", "model.norm", "input_layernorm", "self_attn")), message  # (self_attn: the block holding Linears)


def test_fused_group_ignored_in_part(ct: Path) -> None:
    patch_json(ct / "config.json", lambda d: qc(d)["ignore"].append(f"{ATTN}.k_proj"))
    report = audit(ct)
    # The ignored shard also carries quantized tensors now, which vLLM would not load.
    assert_exactly(report, "fused-ignore-inconsistent", "quantized-but-not-targeted")


def test_bf16_experts_under_nvfp4(ct: Path, lc_source_dir: Path, tmp_path: Path) -> None:
    source = load_tensors(lc_source_dir)
    bf16 = {proj: source[f"{EXPERT}.7.{proj}_proj.weight"] for proj in ("gate", "up", "down")}

    def unquantize(tensors):
        for proj in ("gate", "up", "down"):
            module = f"{EXPERT}.7.{proj}_proj"
            for suffix in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
                del tensors[f"{module}.{suffix}"]
            tensors[f"{module}.weight"] = bf16[proj]

    report = audit(edited(ct, tmp_path, unquantize))
    assert_exactly(report, "module-not-quantized")
    found = finding(report, "module-not-quantized")
    assert found.count == 3 and "routed-expert Linears" in found.message and "BF16" in found.message


def test_router_targeted_but_stored_bf16(ct: Path) -> None:
    patch_json(ct / "config.json", lambda d: qc(d).update(ignore=[i for i in qc(d)["ignore"] if not i.endswith("mlp.gate")]))
    report = audit(ct)
    assert_exactly(report, "module-not-quantized")
    assert finding(report, "module-not-quantized").count == 3 and "router" in finding(report, "module-not-quantized").message


def test_quantized_tensors_on_an_ignored_module(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t.update({"lm_head.weight_scale": torch.ones(1, dtype=torch.bfloat16)})))
    assert_exactly(report, "quantized-but-not-targeted")


# -- per-module tensor sets -----------------------------------------------------------------------
def test_missing_block_scale(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t.pop(f"{ATTN}.q_proj.weight_scale")))
    assert_exactly(report, "scheme-tensor-missing")
    assert "weight_scale" in finding(report, "scheme-tensor-missing").message


def test_global_scale_in_bf16_is_cast_by_vllm(ct: Path, tmp_path: Path) -> None:
    # vLLM copies it into its F32 parameter: 8 significant bits, 0.4 % (a warning)
    name = f"{ATTN}.o_proj.weight_global_scale"
    report = audit(edited(ct, tmp_path, lambda t: t.update({name: t[name].to(torch.bfloat16)})))
    assert_exactly(report, warnings={"scheme-tensor-dtype-cast"})
    assert finding(report, "scheme-tensor-dtype-cast").tensors == [name]


def test_global_scale_in_fp8(ct: Path, tmp_path: Path) -> None:
    # 4 significant bits: the scale vLLM multiplies with is up to 6 % off
    name = f"{ATTN}.o_proj.weight_global_scale"
    report = audit(edited(ct, tmp_path, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)})))
    assert "scheme-tensor-dtype" in rules(report, "error")
    assert finding(report, "scheme-tensor-dtype").tensors == [name]


def test_fp8_codes_in_bf16_are_cleared_only_by_deep(lc_fp8_dynamic_dir: Path, tmp_path: Path) -> None:
    # a BF16 copy of FP8 codes: vLLM casts it back into its F8 parameter exactly, but only the
    # values tell a copy of codes from dequantized weights
    name = f"{ATTN}.o_proj.weight"
    out = edited(lc_fp8_dynamic_dir, tmp_path, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    assert "scheme-tensor-dtype" in rules(audit(out), "error")
    deep = audit(out, deep=True)
    assert "scheme-tensor-dtype" not in rules(deep, "error") and "scheme-tensor-dtype-cast" in rules(deep, "warning")
    out2 = edited(lc_fp8_dynamic_dir, tmp_path / "2", lambda t: t.update({name: (t[name].to(torch.bfloat16) * 1.01)}))
    assert "scheme-tensor-dtype" in rules(audit(out2, deep=True), "error")


def test_block_scale_with_the_wrong_shape(ct: Path, tmp_path: Path) -> None:
    name = f"{ATTN}.o_proj.weight_scale"
    report = audit(edited(ct, tmp_path, lambda t: t.update({name: t[name].reshape(16, -1).contiguous()})))
    assert_exactly(report, "scheme-tensor-shape")


def test_modelopt_name_inside_a_ct_module(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t.update({f"{ATTN}.o_proj.weight_scale_2": torch.ones((), dtype=torch.float32)})))
    assert_exactly(report, "scheme-tensor-foreign")


def test_ct_name_inside_a_modelopt_module(modelopt: Path, tmp_path: Path) -> None:
    name = f"{EXPERT}.4.down_proj"
    report = audit(edited(modelopt, tmp_path, lambda t: t.update({f"{name}.weight_global_scale": 1 / t[f"{name}.weight_scale_2"].reshape(1)})))
    assert_exactly(report, "scheme-tensor-foreign")


# -- activation scales ------------------------------------------------------------------------------
def test_experts_beyond_expert_zero_lack_input_scales(ct: Path, tmp_path: Path) -> None:
    def drop(tensors):
        for expert in range(5, 16):
            del tensors[f"{EXPERT}.{expert}.up_proj.input_global_scale"]

    report = audit(edited(ct, tmp_path, drop))
    assert_exactly(report, "moe-input-scale-invalid")
    found = finding(report, "moe-input-scale-invalid")
    assert found.count == 11 and "(+8 more)" in found.message


def test_expert_input_scale_zero(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t[f"{EXPERT}.9.gate_proj.input_global_scale"].zero_()))
    # gate and up of expert 9 now disagree too, but a zero is its own finding, not a ratio.
    assert_exactly(report, "moe-input-scale-invalid")
    assert "(0)" in finding(report, "moe-input-scale-invalid").message


def test_w4a4_declared_without_any_activation_scale(ct: Path, tmp_path: Path) -> None:
    def drop(tensors):
        for name in [n for n in tensors if n.endswith("input_global_scale")]:
            del tensors[name]

    report = audit(edited(ct, tmp_path, drop))
    assert_exactly(report, "w4a4-without-activation-scales")


def test_weight_only_declared_while_activation_scales_ship(ct: Path) -> None:
    # vLLM 0.32's compressed-tensors loading fails on the fused shards' and experts' scales, skips
    # those of plain Linears (o_proj)
    patch_json(ct / "config.json", lambda d: qc(d)["config_groups"]["group_0"].update(input_activations=None))
    report = audit(ct)
    assert rules(report, "error") == {"weight-only-scales-refused"}
    assert "weight-only-with-activation-scales" in rules(report, "warning")
    assert all(".o_proj" not in t for t in finding(report, "weight-only-scales-refused").tensors)


# -- fused groups -----------------------------------------------------------------------------------
def test_qkv_weight_global_scales_differ(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t[f"{ATTN}.k_proj.weight_global_scale"].mul_(1.5)))
    assert_exactly(report, "fused-weight-scale-mismatch")
    assert "ratio 1.5×" in finding(report, "fused-weight-scale-mismatch").message


def test_expert_gate_up_weight_global_scales_differ(modelopt: Path, tmp_path: Path) -> None:
    report = audit(edited(modelopt, tmp_path, lambda t: t[f"{EXPERT}.11.up_proj.weight_scale_2"].mul_(2.0)))
    assert_exactly(report, "fused-weight-scale-mismatch")
    assert f"{EXPERT}.11" in finding(report, "fused-weight-scale-mismatch").message


def test_qkv_input_scales_differ(ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t[f"{ATTN}.v_proj.input_global_scale"].mul_(1.25)))
    assert_exactly(report, warnings={"fused-input-scale-mismatch"})


def test_qkv_input_scale_inverted(ct: Path, tmp_path: Path) -> None:
    # vLLM quantizes the fused input with the max of the shards' scales: one inverted moves all
    report = audit(edited(ct, tmp_path, lambda t: t[f"{ATTN}.v_proj.input_global_scale"].reciprocal_()))
    assert "fused-input-scale-divergent" in rules(report, "error")


# -- scale values -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_global_scale_not_finite_positive(bad: float, ct: Path, tmp_path: Path) -> None:
    report = audit(edited(ct, tmp_path, lambda t: t[f"{ATTN}.o_proj.weight_global_scale"].fill_(bad)))
    assert_exactly(report, "scale-invalid")


def test_fp8_channel_scale_zero(lc_fp8_dynamic_dir: Path, tmp_path: Path) -> None:
    def zero_row(tensors):
        tensors["model.layers.0.mlp.down_proj.weight_scale"][3] = 0

    report = audit(rebuild(lc_fp8_dynamic_dir, tmp_path / "fp8", zero_row))
    assert_exactly(report, "scale-invalid")
    assert "1 of 256" in finding(report, "scale-invalid").message


def test_deep_finds_nan_block_scales(ct: Path, tmp_path: Path) -> None:
    def plant(tensors):
        scale = tensors[f"{EXPERT}.2.down_proj.weight_scale"]
        scale.view(torch.uint8)[0, 0] = 0x7F  # E4M3FN NaN

    damaged = edited(ct, tmp_path, plant)
    assert rules(audit(damaged), "error") == set()
    report = audit(damaged, deep=True)
    assert_exactly(report, "block-scale-invalid")


def test_json_lists_every_tensor_of_a_grouped_finding(ct: Path, tmp_path: Path) -> None:
    def drop(tensors):
        for expert in range(16):
            del tensors[f"{EXPERT}.{expert}.down_proj.input_global_scale"]

    doc = audit(edited(ct, tmp_path, drop)).to_json()
    (entry,) = [f for f in doc["findings"] if f["rule"] == "moe-input-scale-invalid"]
    assert len(entry["tensors"]) == 16 and json.dumps(doc)


def test_fp4forge_export_with_constant_activation_scales_is_flagged(lc_source_dir: Path, tmp_path: Path) -> None:
    """`--act-scales constant:AMAX` is legal but never silent: the provenance says so and the
    audit warns; the export is otherwise clean."""
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    out = tmp_path / "constant"
    quantize_checkpoint(lc_source_dir, out, QuantizeOptions(load_recipe("nvfp4-experts-fp8-attn"), act_amax=ConstantAmax(8.0)))
    report = audit(out)
    assert finding(report, "activation-scales-constant")
    assert report.exit_code == 0


def test_kv_show_reports_the_audit_kv_rules(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`fp4forge kv show` and `fp4forge audit` share one KV rule table: the same defect gets the
    same rule id and severity from both; kv show's own "kv-amax-over-448" comes from rules.toml too."""
    import shutil

    from fp4forge.audit.findings import rule
    from fp4forge.calibrate import kv
    from fp4forge.checkpoint.reader import open_checkpoint
    from tests.calibration_fixtures import tiny

    laguna = tiny(tmp_path_factory, "laguna")
    layers = kv.attention_layers(open_checkpoint(laguna))
    cases = {"ones": 1.0, "large": 2.0}
    expected = {"ones": {"kv-scale-uncalibrated"}, "large": {"kv-amax-over-448"}}
    for case, value in cases.items():
        target = tmp_path_factory.mktemp("kv-rules") / case
        shutil.copytree(laguna, target)
        kv.install_kv_scales(target, kv.KvScales({layer: {"k_scale": torch.tensor(value), "v_scale": torch.tensor(value)} for layer in layers}), "compressed-tensors")
        shown = kv.show(target).findings
        assert {f["rule"] for f in shown} == expected[case]
        assert all(f["severity"] == rule(f["rule"]).severity and f["fix"] == rule(f["rule"]).fix for f in shown)
        audited = {f["rule"]: f["severity"] for f in audit(target).to_json()["findings"] if f["rule"].startswith("kv-")}
        if case == "ones":
            assert audited == {"kv-scale-uncalibrated": "warning"}  # the audit names the same defect the same way
        else:
            assert audited == {} and rule("kv-amax-over-448").severity == "info"
