"""Layout tables for the families real releases use, and the inferred fallback."""

from __future__ import annotations

import math

import pytest

from fp4forge.audit.byte_table import compute_byte_table
from fp4forge.checkpoint.layout import (
    layout_by_name,
    layout_for_config,
    layout_or_inferred,
    split_suffix,
)
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import LayoutError

DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_nextn_predict_layers": 1}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.3.mlp.experts.7.up_proj.weight_scale_inv", ("model.layers.3.mlp.experts.7.up_proj", "weight_scale_inv", "weight_scale")),
        ("model.layers.0.linear_attn.A_log", ("model.layers.0.linear_attn", "A_log", "weight")),
        ("model.layers.0.linear_attn.dt_bias", ("model.layers.0.linear_attn", "dt_bias", "bias")),
        ("model.layers.0.self_attn.sinks", ("model.layers.0.self_attn", "sinks", "weight")),
        ("model.layers.0.mlp.experts.gate_up_proj_blocks", ("model.layers.0.mlp.experts.gate_up_proj", "blocks", "packed_fp4")),
        ("model.layers.0.mlp.experts.down_proj_scales", ("model.layers.0.mlp.experts.down_proj", "scales", "weight_scale")),
        ("model.layers.0.mlp.experts.down_proj_bias", ("model.layers.0.mlp.experts.down_proj", "bias", "bias")),
        ("model.layers.0.mlp.experts.gate_up_proj", ("model.layers.0.mlp.experts", "gate_up_proj", "weight")),
        ("model.layers.0.mlp.gate.weight", ("model.layers.0.mlp.gate", "weight", "weight")),
        ("model.layers.0.something_odd", ("model.layers.0.something_odd", "", "unknown")),
    ],
)
def test_split_suffix_formats_the_world_ships(name, expected):
    assert split_suffix(name) == expected


def test_deepseek_mtp_layer_is_its_own_component():
    layout = layout_for_config(DEEPSEEK)
    assert layout.classify("model.layers.61.eh_proj.weight").component == "mtp"
    assert layout.classify("model.layers.61.shared_head.head.weight").component == "mtp"
    assert layout.classify("model.layers.61.mlp.experts.3.down_proj.weight").component == "mtp"
    assert layout.classify("model.layers.60.mlp.experts.3.down_proj.weight").component == "routed_experts"
    assert layout.classify("model.layers.6.self_attn.indexer.wq_b.weight").component == "attention"
    assert layout.fused["fused_qkv_a"] == ("q_a_proj", "kv_a_proj_with_mqa")
    # Without next-n layers in the config, layer 61 is an ordinary layer.
    plain = layout_for_config({**DEEPSEEK, "num_nextn_predict_layers": 0, "num_hidden_layers": 62})
    assert plain.classify("model.layers.61.mlp.experts.3.down_proj.weight").component == "routed_experts"
    assert layout_by_name("deepseek_v3").classify("model.layers.61.eh_proj.weight").component == "unknown"


def test_glm_and_kimi_configs_find_their_tables():
    glm = layout_for_config({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_hidden_layers": 92, "num_nextn_predict_layers": 1})
    assert glm.classify("model.layers.92.enorm.weight").component == "mtp"
    assert glm.classify("model.layers.5.self_attn.q_proj.bias").component == "attention"
    kimi = layout_for_config({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"})
    assert kimi.name == "deepseek_v3"


def test_qwen35_wrapper_prefix_vision_and_mtp():
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}
    layout = layout_for_config(config)
    assert layout.name == "qwen3_next"
    cases = {
        "model.language_model.layers.0.linear_attn.A_log": "linear_attention",
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": "linear_attention",
        "model.language_model.layers.0.linear_attn.norm.weight": "norms",
        "model.language_model.layers.3.self_attn.q_proj.weight": "attention",
        "model.language_model.layers.3.mlp.experts.17.down_proj.weight": "routed_experts",
        "model.language_model.layers.3.mlp.shared_expert_gate.weight": "router",
        "model.language_model.embed_tokens.weight": "embeddings",
        "model.visual.blocks.0.attn.qkv.weight": "vision",
        "mtp.layers.0.mlp.experts.3.up_proj.weight": "mtp",
        "lm_head.weight": "lm_head",
    }
    for name, component in cases.items():
        assert layout.classify(name).component == component, name


def test_llama4_released_and_transformers5_names():
    layout = layout_for_config({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4"})
    for name in ("language_model.model.layers.1.feed_forward.experts.gate_up_proj", "model.language_model.layers.1.feed_forward.experts.5.down_proj.weight"):
        assert layout.classify(name).component == "routed_experts", name
    assert layout.classify("language_model.model.layers.0.feed_forward.router.weight").component == "router"
    assert layout.classify("vision_model.model.layers.0.mlp.fc1.weight").component == "vision"


def test_unknown_architecture_gets_an_inferred_layout_not_a_refusal():
    config = {"architectures": ["BrandNewMoeForCausalLM"], "model_type": "brand_new_moe"}
    with pytest.raises(LayoutError):
        layout_for_config(config)  # writers still refuse to guess
    layout = layout_or_inferred(config)
    assert layout.inferred and layout.name == "inferred (BrandNewMoeForCausalLM)"
    cases = {
        "model.layers.2.block_sparse_moe.experts.3.w2.weight": "routed_experts",
        "model.layers.2.mlp.experts.3.up_proj.weight": "routed_experts",
        "model.layers.2.mlp.gate.weight": "router",
        "model.layers.2.self_attn.q_norm.weight": "norms",
        "model.layers.2.self_attn.o_proj.weight": "attention",
        "model.embed_tokens.weight": "embeddings",
        "lm_head.weight": "lm_head",
    }
    for name, component in cases.items():
        assert layout.classify(name).component == component, name
    assert not layout_or_inferred(DEEPSEEK).inferred


def test_fp8_block_scales_of_any_block_size_are_overhead(tmp_path):
    """weight_scale_inv of a [64, 32]-block FP8 Linear whose dims are not multiples of the block:
    the weight's 100 x 70 bytes are parameters, ceil(100/64) x ceil(70/32) F32 scales overhead."""
    scales = (math.ceil(100 / 64), math.ceil(70 / 32))
    specs = [
        TensorSpec("model.layers.0.mlp.experts.0.up_proj.weight", "F8_E4M3", (100, 70)),
        TensorSpec("model.layers.0.mlp.experts.0.up_proj.weight_scale_inv", "F32", scales),
    ]
    with CheckpointWriter(tmp_path / "ckpt", specs, sparse=True) as writer:
        writer.write_text("config.json", '{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}')
    table = compute_byte_table(open_checkpoint(str(tmp_path / "ckpt")), layout_by_name("deepseek_v3"))
    assert table.total_params == 7000
    assert table.total_bytes == 7000 + 4 * scales[0] * scales[1]
    assert table.experts_bpp == pytest.approx(8 * (7000 + 4 * 2 * 3) / 7000)


def test_quantizable_components_are_the_tables_linear_components(monkeypatch):
    from fp4forge.checkpoint import layout
    from fp4forge.errors import ConfigError
    from fp4forge.quantize.recipe import parse_recipe

    names = layout.quantizable_components()
    laguna = layout.layout_by_name("laguna").component_names
    # the tiny testbed's table holds every one of them, beside the components that are not Linears
    assert set(names) <= set(laguna) and set(laguna) - set(names) == {"norms", "embeddings"}
    with pytest.raises(ConfigError, match="cannot be quantized"):
        parse_recipe('name = "x"\n[[rules]]\ncomponents = ["norms"]\nscheme = "fp8"\n', source="test")
    # a name no table defines is refused where the list is read
    common = layout._load_toml("_common.toml")
    monkeypatch.setattr(layout, "_load_toml", lambda name: {**common, "quantizable_components": ["expertz"]})
    layout.quantizable_components.cache_clear()
    try:
        with pytest.raises(LayoutError, match="expertz"):
            layout.quantizable_components()
    finally:
        monkeypatch.undo()
        layout.quantizable_components.cache_clear()


# `_common.toml` entries that differ from what the authorities say, and why each stays.
SUFFIX_OVERRIDES = {
    "SCB": "bitsandbytes 8-bit's per-row F32 scale: transformers serializes it among the weight's state, "
           "but it scales the weight's rows as every weight_scale does",
}


def test_packed_int_and_bitsandbytes_suffixes_are_derived():
    """GPTQ / AWQ suffixes come from the parameters vLLM's methods create and discard, the
    bitsandbytes state from transformers' quantizers, not from a list here; the derivation gives
    what those formats store."""
    from fp4forge.checkpoint.layout import derived_suffix_kinds

    suffixes, tails = derived_suffix_kinds()
    assert {k: suffixes[k] for k in ("qweight", "qzeros", "scales", "g_idx")} == {
        "qweight": "packed_weight", "qzeros": "zero_point", "scales": "weight_scale", "g_idx": "g_idx"}
    assert suffixes["weight_format"] == "quant_state"
    assert set(tails) == {"weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
                          "weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4"}
    assert set(tails.values()) == {"quant_state"}


def test_common_toml_overrides_the_derivation_only_with_a_reason():
    """A hand entry that repeats the derivation has no reason to exist; one that differs is an
    override SUFFIX_OVERRIDES explains."""
    import tomllib

    from fp4forge.checkpoint.layout import LAYOUTS_DIR, derived_suffix_kinds

    doc = tomllib.loads((LAYOUTS_DIR / "_common.toml").read_text(encoding="utf-8"))
    suffixes, tails = derived_suffix_kinds()
    hand = {e["suffix"]: e["kind"] for e in doc["suffixes"]} | {e["tail"]: e["kind"] for e in doc.get("tails", ())}
    derived = suffixes | tails
    overlapping = {name for name in hand if name in derived}
    assert overlapping == set(SUFFIX_OVERRIDES)
    assert all(hand[name] != derived[name] for name in overlapping)
    assert split_suffix("model.layers.0.mlp.down_proj.SCB")[2] == "weight_scale"


def test_bitsandbytes_names_shipped_equal_installed_transformers():
    """The shipped bitsandbytes names are what the installed transformers' quantizers serialize."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from fp4forge.checkpoint.layout import BNB_SERIALIZED, LAYOUTS_DIR

    script = Path(__file__).resolve().parent.parent / "scripts" / "bnb_serialized_names.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == json.loads((LAYOUTS_DIR / BNB_SERIALIZED).read_text())
