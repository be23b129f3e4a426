"""Every MoE model_type of the installed transformers, as a small config built on the meta device
(fp4forge.testbed.moe_zoo): its components derived from the model class place every tensor, the
routed experts hold what the module tree says they hold, and the audit's per-Linear declaration
checks run on it (a projection stored BF16 under an NVFP4 declaration is an error), whether
or not the architecture has a layout table."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from fp4forge.audit.byte_table import compute_byte_table
from fp4forge.audit.engine import audit_checkpoint
from fp4forge.checkpoint.layout import layout_or_inferred
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.skeleton import build_meta_model, checkpoint_specs
from fp4forge.errors import ConfigError
from fp4forge.testbed.corpus import write_header_only
from fp4forge.testbed.moe_zoo import ZOO_COMPLETIONS, build_zoo_nvfp4, default_config, moe_model_types, nvfp4_modules, zoo_config

REPO = Path(__file__).resolve().parent.parent

# Model types transformers 5.23 cannot build from a config of their own (each checked to still
# fail, so that a transformers that can build one puts it under test): sub-configs of wrappers no
# auto class takes alone, and defaults the model class itself rejects.
NOT_STANDALONE = {
    "deepseek_ocr2_text", "dots3_note_vision_encoder", "ernie4_5_vl_moe_text", "qwen3_omni_moe_talker_text",
    "qwen3_omni_moe_text", "step3p5", "unlimited_ocr_text", "qwen3_omni_moe",
}  # fmt: skip
DEFAULTS_UNBUILDABLE = {
    "qwen4_exp": "unsupported operand",  # the indexer's sizes have no default
    "qwen4_exp_text": "unsupported operand",
    "inkling_mm_model": "scipy",  # its vision tower imports scipy, not a dependency of fp4forge
    "nemotron_h_omni": None,  # builds, but its text model is not reachable as the wrapper's decoder (see below)
}
DENSE_BY_DEFAULT = {"doge"}  # states an expert count, but its default config builds the dense variant
SKIPPED = NOT_STANDALONE | set(DEFAULTS_UNBUILDABLE)
ZOO = [t for t in moe_model_types() if t not in SKIPPED]

# An independent count of the routed experts: by the parameter names of the built model (the
# derivation never looks at names), the spellings the model classes use for their experts
# (JetMoE's mixture of attention heads included), outside the shared experts, routers and towers.
EXPERT_NAME = re.compile(r"(^|\.)(\w*experts|input_linear|output_linear)(\.|$)|layers\.\d+\.mlp\.bias$")  # (JetMoE adds a bias to the experts' sum)
NOT_ROUTED_NAME = re.compile(r"shared|(^|\.)(router|gate)(\.|$)|(^|\.)(visual|vision_tower|vision_model|vision|audio_tower|audio_model|audio|sam_model|radio_model)\.")


def test_zoo_is_every_moe_model_type():
    """The zoo is what transformers defines (dozens of MoE model types), and every type left out
    is left out for a reason that still holds."""
    types = moe_model_types()
    assert len(types) >= 80 and {"deepseek_v3", "qwen3_moe", "mixtral", "olmoe", "dbrx", "jamba", "minimax_m2"} <= set(types)
    assert SKIPPED <= set(types)
    for model_type in sorted(NOT_STANDALONE):
        with pytest.raises(ConfigError, match="Unrecognized configuration class|cannot build"):
            checkpoint_specs(zoo_config(model_type))
    for model_type, reason in DEFAULTS_UNBUILDABLE.items():
        if reason is not None:
            with pytest.raises(ConfigError, match=reason):
                checkpoint_specs(zoo_config(model_type))


@pytest.mark.parametrize("model_type", sorted(ZOO_COMPLETIONS))
def test_completions_are_needed(model_type):
    """Each completion of a default config stands in for a value transformers' defaults lack."""
    with pytest.raises(ConfigError, match="cannot build"):
        checkpoint_specs(default_config(model_type))


def _routed_expert_params_by_name(config) -> int:
    _, state_dict, _ = build_meta_model(config)
    return sum(t.numel() for name, t in state_dict.items() if EXPERT_NAME.search(name) and not NOT_ROUTED_NAME.search(name))


@pytest.mark.parametrize("model_type", ZOO)
def test_every_tensor_placed(model_type, tmp_path):
    config = zoo_config(model_type)
    specs = checkpoint_specs(config)
    write_header_only(tmp_path / "ckpt", specs, config, {})
    layout = layout_or_inferred(config)
    assert not layout.inferred
    table = compute_byte_table(open_checkpoint(tmp_path / "ckpt"), layout)
    assert table.unknown_tensors == []
    assert table.total_params == sum(math.prod(s.shape) for s in specs)
    components = {c.name: c.params for c in table.components}
    assert components.get("routed_experts", 0) == _routed_expert_params_by_name(config)
    assert (components.get("routed_experts", 0) > 0) == (model_type not in DENSE_BY_DEFAULT)


@pytest.mark.parametrize("model_type", ZOO)
def test_planted_bf16_projection_is_an_error(model_type, tmp_path):
    """A ModelOpt NVFP4 export of the model whose first attention projection (else first
    projection) was stored BF16: an error naming it; the same export without the defect: none."""
    config = zoo_config(model_type)
    quantized = nvfp4_modules(config, checkpoint_specs(config))
    layout = layout_or_inferred(config)
    target = next((m for m in quantized if layout.component_of(m) == "attention"), quantized[0])
    clean = audit_checkpoint(build_zoo_nvfp4(config, tmp_path / "clean"))
    assert [f.rule for f in clean.findings if f.severity == "error"] == []
    planted = audit_checkpoint(build_zoo_nvfp4(config, tmp_path / "planted", keep_bf16=target))
    errors = [f for f in planted.findings if f.severity == "error" and f.rule == "module-not-quantized"]
    assert errors and any(f"{target}.weight" in f.tensors for f in errors)


def test_remote_code_model_type_is_audited_on_an_inferred_layout(tmp_path):
    """A model type transformers does not know (remote code): the layout is inferred from names,
    the audit says so, and still finds the BF16 projection under the NVFP4 declaration."""
    config = zoo_config("olmoe")
    quantized = nvfp4_modules(config, checkpoint_specs(config))
    out = build_zoo_nvfp4(config, tmp_path / "planted", keep_bf16=quantized[0])
    config.update(model_type="some_remote_moe", architectures=["SomeRemoteMoeForCausalLM"])
    (out / "config.json").write_text(json.dumps(config))
    report = audit_checkpoint(out)
    assert report.layout == "inferred (SomeRemoteMoeForCausalLM)"
    assert "architecture-unknown" in {f.rule for f in report.findings if f.severity == "warning"}
    errors = [f for f in report.findings if f.rule == "module-not-quantized"]
    assert errors and f"{quantized[0]}.weight" in errors[0].tensors


def test_derived_layout_marked_in_bytes_json(tmp_path):
    from typer.testing import CliRunner

    from fp4forge.cli import app

    config = zoo_config("minimax_m2")
    write_header_only(tmp_path / "ckpt", checkpoint_specs(config), config, {})
    result = CliRunner().invoke(app, ["bytes", str(tmp_path / "ckpt"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["layout"].startswith("derived (") and doc["layout_derived"] is True and doc["layout_inferred"] is False
    assert doc["unknown_tensors"] == []


@pytest.mark.slow
def test_vllm_groups_shipped_equal_installed_vllm(vllm_venv):
    """The shipped fused-group table is what the installed vLLM's model classes say."""
    from fp4forge.checkpoint.layout import LAYOUTS_DIR, VLLM_PACKED

    result = subprocess.run([str(vllm_venv / "bin" / "python"), str(REPO / "scripts" / "vllm_packed_modules.py")], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == json.loads((LAYOUTS_DIR / VLLM_PACKED).read_text())


def test_vllm_groups_reach_derived_layouts():
    """A derived layout's fused groups are vLLM's for its architecture (MLA's q_a/kv_a, Mixtral's w1/w3)."""
    from fp4forge.checkpoint.layout import derived_layout

    mixtral = dict(zoo_config("mixtral"), architectures=["MixtralForCausalLM"])
    assert derived_layout(mixtral).fused["experts_w13"] == ("w1", "w3")
    mla = dict(zoo_config("glm4_moe_lite"), architectures=["Glm4MoeLiteForCausalLM"])
    assert derived_layout(mla).fused["fused_qkv_a_proj"] == ("q_a_proj", "kv_a_proj_with_mqa")


# Every layout table against the derivation, on the zoo config of each family it covers: the
# components agree tensor for tensor. The tables stay as overrides for what the model class does
# not hold (next-n layers transformers does not build, Linears vLLM keeps unquantized, fused
# groups of classes whose vLLM module needs packages absent here), and so that a family with a
# table is read without building a model on the first run (bytes imports no torch).
TABLE_FAMILIES = ["deepseek_v3", "deepseek_v32", "deepseek_v2", "glm4_moe", "gpt_oss", "granitemoe", "laguna", "llama4", "mixtral", "qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe"]


@pytest.mark.parametrize("model_type", TABLE_FAMILIES)
def test_tables_agree_with_the_derivation(model_type):
    from fp4forge.checkpoint.layout import derived_layout, layout_for_config

    config = zoo_config(model_type)
    table, derived = layout_for_config(config), derived_layout(config)
    assert not table.derived and derived.derived
    disagreements = [(s.name, table.classify(s.name).component, derived.classify(s.name).component) for s in checkpoint_specs(config)]
    assert [d for d in disagreements if d[1] != d[2]] == []


def test_table_facts_the_derivation_lacks():
    """Why the tables are kept: DeepSeek-V3.2's indexer weights_proj is built unquantized by vLLM
    (no model class says so), and a DeepSeek next-n layer is placed by the config's layer count
    in both (the derived layout matches it before its trunk templates)."""
    from fp4forge.checkpoint.layout import derived_layout, layout_for_config

    config = dict(zoo_config("deepseek_v32"), num_nextn_predict_layers=1)
    table, derived = layout_for_config(config), derived_layout(config)
    assert table.is_engine_unquantized("model.layers.0.self_attn.indexer.weights_proj")
    assert not derived.is_engine_unquantized("model.layers.0.self_attn.indexer.weights_proj")
    mtp = f"model.layers.{config['num_hidden_layers']}.mlp.experts.0.up_proj"
    assert table.component_of(mtp) == derived.component_of(mtp) == "mtp"


def test_inferred_layout_places_by_shape_and_says_why_not(tmp_path):
    """A remote-code model whose expert and router modules have names no pattern knows: 3-D
    tensors with the config's expert count first are routed experts, a [E, H] weight or [E] bias
    the router; what neither names nor shapes place is unknown, with the reason."""
    from fp4forge.checkpoint.writer import TensorSpec

    experts, hidden = 12, 64
    config = {"architectures": ["BankMoeForCausalLM"], "model_type": "bank_moe", "moe_num_experts": experts, "hidden_size": hidden}
    specs = [
        TensorSpec("model.layers.0.moe.bank.gate_up", "BF16", (experts, 2 * 32, hidden)),
        TensorSpec("model.layers.0.moe.selector.weight", "BF16", (experts, hidden)),
        TensorSpec("model.layers.0.moe.selector.bias", "BF16", (experts,)),
        TensorSpec("model.layers.0.moe.mystery.weight", "BF16", (7, 3)),
        TensorSpec("model.embed_tokens.weight", "BF16", (100, hidden)),
    ]
    write_header_only(tmp_path / "ckpt", specs, config, {})
    layout = layout_or_inferred(config)
    assert layout.inferred
    table = compute_byte_table(open_checkpoint(tmp_path / "ckpt"), layout)
    params = {c.name: c.params for c in table.components}
    assert params["routed_experts"] == experts * 64 * hidden and params["router"] == experts * hidden + experts
    assert table.unknown_tensors == ["model.layers.0.moe.mystery.weight"]
    assert "no shape against the config's expert count" in table.unknown_reasons["model.layers.0.moe.mystery.weight"]
