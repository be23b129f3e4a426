"""Synthetic checkpoints: the same names/shapes/dtypes as a real save, valid files, real-scale preset."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4forge.errors import ConfigError
from fp4forge.testbed.synth import (
    PRESETS,
    checkpoint_specs,
    count_parameters,
    load_preset,
    synth_checkpoint,
    truncated_config,
)
from fp4forge.testbed.tiny import build_tiny_laguna, build_tiny_qwen3_moe

SMALL_SHARDS = 6 * 10**6


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real")
    return {"laguna": build_tiny_laguna(root / "laguna"), "qwen": build_tiny_qwen3_moe(root / "qwen")}


def layout(directory: Path) -> set[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, read with safetensors' own reader."""
    entries = set()
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                entries.add((name, tensor_slice.get_dtype(), tuple(tensor_slice.get_shape())))
    return entries


def layer_of(name: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("arch", ["laguna", "qwen"])
def test_all_layers_match_real_save(real, tmp_path, arch):
    out = synth_checkpoint(real[arch], 4, tmp_path / "synth", max_shard_bytes=SMALL_SHARDS)
    assert layout(out) == layout(real[arch])
    real_config = json.loads((real[arch] / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == real_config


@pytest.mark.parametrize("layers", [1, 2])
def test_prefix_of_layers(real, tmp_path, layers):
    out = synth_checkpoint(real["laguna"], layers, tmp_path / "synth", max_shard_bytes=SMALL_SHARDS)
    expected = {entry for entry in layout(real["laguna"]) if (layer_of(entry[0]) is None or layer_of(entry[0]) < layers)}
    assert layout(out) == expected
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == layers
    for key in ("layer_types", "mlp_layer_types", "num_attention_heads_per_layer"):
        assert len(config[key]) == layers, key


def test_prefix_loads_in_transformers(real, tmp_path):
    from transformers import AutoModelForCausalLM

    out = synth_checkpoint(real["laguna"], 2, tmp_path / "synth")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert len(model.model.layers) == 2
    logits = model(torch.tensor([[0, 5, 9, 300]])).logits
    assert torch.isfinite(logits).all()


def test_values_are_valid_heavy_tailed_and_seeded(real, tmp_path):
    first = synth_checkpoint(real["laguna"], 2, tmp_path / "a", max_shard_bytes=SMALL_SHARDS, seed=3)
    again = synth_checkpoint(real["laguna"], 2, tmp_path / "b", max_shard_bytes=SMALL_SHARDS, seed=3)
    other = synth_checkpoint(real["laguna"], 2, tmp_path / "c", max_shard_bytes=SMALL_SHARDS, seed=4)
    shards = sorted(p.name for p in first.glob("*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((first / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    for name in shards:
        assert (first / name).read_bytes() == (again / name).read_bytes()
        assert (first / name).read_bytes() != (other / name).read_bytes()

    tensors = {}
    for name in shards:
        with safe_open(str(first / name), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for key in handle.keys():
                assert index["weight_map"][key] == name
                tensors[key] = handle.get_tensor(key).float()
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in tensors.values())
    embed = tensors["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002
    # Heavy tails: a Gaussian's 1M samples almost never pass 5.5 sigma; Student-t(4) does often.
    assert embed.abs().max().item() > 5.5 * 0.02
    assert abs(tensors["model.norm.weight"].mean().item() - 1.0) < 0.01


def test_preset_totals_117_6_billion():
    preset = load_preset("laguna-s-2.1-like")
    assert "laguna-s-2.1-like" in PRESETS
    total = count_parameters(preset)
    assert abs(total / 117.6e9 - 1) < 0.005
    assert preset["_fp4forge_preset_notes"]["total_parameters"] == total
    assert preset["num_hidden_layers"] == 48 and preset["num_experts"] == 256 and preset["num_experts_per_tok"] == 10
    assert preset["vocab_size"] == 100352 and preset["shared_expert_intermediate_size"] > 0
    assert preset["mlp_layer_types"][0] == "dense" and set(preset["mlp_layer_types"][1:]) == {"sparse"}
    assert set(preset["layer_types"]) == {"full_attention", "sliding_attention"}


def test_preset_specs_are_per_expert_and_divisible():
    specs = checkpoint_specs(truncated_config(load_preset("laguna-s-2.1-like"), 2))
    names = {s.name for s in specs}
    assert "model.layers.1.mlp.experts.255.down_proj.weight" in names
    assert "model.layers.1.mlp.experts.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in names
    assert all(len(s.shape) != 2 or s.shape[1] % 64 == 0 for s in specs)


def declared_file_size(path: Path) -> int:
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    data_end = max(entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__")
    return 8 + header_len + data_end


def test_sparse_mode_writes_headers_with_declared_sizes(tmp_path):
    out = synth_checkpoint("laguna-s-2.1-like", 1, tmp_path / "sparse", sparse=True, max_shard_bytes=400 * 2**20)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 3
    declared = 0
    for shard in shards:
        assert shard.stat().st_size == declared_file_size(shard)
        with safe_open(str(shard), "pt") as handle:  # headers readable by an independent reader
            declared += sum(math.prod(handle.get_slice(k).get_shape()) * 2 for k in handle.keys())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == declared
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_truncation_of_layer_index_lists():
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [0, 3]}
    assert truncated_config(config, 2)["mlp_only_layers"] == [0]


@pytest.mark.parametrize("layers", [0, 5])
def test_layer_count_out_of_range(real, tmp_path, layers):
    with pytest.raises(ConfigError):
        synth_checkpoint(real["laguna"], layers, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_bad_sources_and_outputs(real, tmp_path):
    with pytest.raises(ConfigError):
        synth_checkpoint("no-such-preset", 1, tmp_path / "out")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    with pytest.raises(ConfigError):
        synth_checkpoint(real["laguna"], 1, taken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_failure_midway_leaves_nothing(real, tmp_path, monkeypatch):
    import fp4forge.testbed.synth as synth

    def broken(spec, seed):
        raise RuntimeError("out of entropy")

    monkeypatch.setattr(synth, "synthetic_tensor", broken)
    with pytest.raises(RuntimeError):
        synth_checkpoint(real["laguna"], 2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_count_parameters_matches_model(real):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(real["laguna"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert count_parameters(json.loads((real["laguna"] / "config.json").read_text())) == model.num_parameters()


# -- the testbed tokenizer, text and presets ------------------------------------------------------
def test_preset_gets_a_tokenizer_consistent_with_its_vocabulary(tmp_path):
    """transformers' own loaders read what synth wrote: as many tokens as the config's vocabulary,
    special ids inside it, a chat template that renders and encodes to ids the embedding has."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = synth_checkpoint("qwen3-235b-like", 1, tmp_path / "synth", shrink=16, sparse=True)
    config = AutoConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == config.vocab_size == 9472  # 151,936 / 16 rounded to a multiple of 64
    generation = GenerationConfig.from_pretrained(out)
    ids = [generation.bos_token_id, generation.pad_token_id, *generation.eos_token_id]
    assert ids == [config.bos_token_id, config.pad_token_id, *config.eos_token_id]
    assert all(0 <= i < config.vocab_size for i in ids)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "def f(x): return x"}], tokenize=False)
    encoded = tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert encoded and max(encoded) < config.vocab_size and tokenizer.decode(encoded) == chat
    from fp4forge.model.samples import file_documents

    for name in ("fp4forge-calibration.jsonl", "fp4forge-heldout.jsonl"):
        assert len(file_documents([out / name])) > 100, name


def test_real_vocabulary_is_filled_to_the_config_size():
    from fp4forge.testbed.tokenizer import RESERVED_TOKEN, build_tokenizer

    tokenizer = build_tokenizer(100352)  # laguna's; the stdlib's merges stop near 26k
    assert len(tokenizer) == 100352
    assert tokenizer.convert_ids_to_tokens(100351).startswith(RESERVED_TOKEN.split("{")[0])
    assert max(tokenizer("<|reserved_0|> import os")["input_ids"]) < 30000  # never produced by encoding


def test_source_with_a_tokenizer_keeps_its_own(real, tmp_path):
    out = synth_checkpoint(real["laguna"], 1, tmp_path / "synth")
    assert (out / "tokenizer.json").read_bytes() == (real["laguna"] / "tokenizer.json").read_bytes()
    assert not (out / "fp4forge-calibration.jsonl").exists()


def _corpus_config(name: str) -> dict:
    return json.loads((Path(__file__).parent / "corpus" / name / "config.json").read_text())


@pytest.mark.parametrize(("preset", "corpus", "dropped"), [
    ("deepseek-v3-like", "deepseek-v3-fp8", {"quantization_config", "auto_map", "transformers_version"}),
    ("qwen3-235b-like", "qwen3-235b-a22b", {"transformers_version"}),
])
def test_presets_are_the_published_configs(preset, corpus, dropped):
    config = load_preset(preset)
    notes = config.pop("_fp4forge_preset_notes")
    assert config == {k: v for k, v in _corpus_config(corpus).items() if k not in dropped}
    assert notes["total_parameters"] == count_parameters(config)


def test_published_totals():
    """Within 0.5 % of the published totals (DeepSeek-V3: 671 B without its next-n layer)."""
    for preset, published in (("deepseek-v3-like", 671e9), ("qwen3-235b-like", 235e9)):
        total = count_parameters(load_preset(preset))
        assert abs(total / published - 1) < 0.005, (preset, total)
        assert load_preset(preset)["_fp4forge_preset_notes"]["total_parameters"] == total


def test_laguna_xs2_preset_is_transformers_laguna_default():
    """transformers documents LagunaConfig's defaults as poolside/laguna-XS.2."""
    from transformers import LagunaConfig

    preset, default = load_preset("laguna-xs.2-like"), LagunaConfig()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "sliding_window", "max_position_embeddings"):
        assert preset[key] == getattr(default, key), key


def test_shrink_divides_widths_heads_and_experts():
    from fp4forge.testbed.synth import shrunk_config

    small = shrunk_config(load_preset("deepseek-v3-like"), 16)
    assert (small["hidden_size"], small["intermediate_size"], small["moe_intermediate_size"]) == (448, 1152, 128)
    assert (small["q_lora_rank"], small["kv_lora_rank"], small["vocab_size"]) == (128, 64, 8064)  # 96 -> 128, 32 -> 64
    assert (small["num_attention_heads"], small["n_routed_experts"], small["num_experts_per_tok"]) == (8, 16, 8)
    assert small["qk_rope_head_dim"] == 64 and small["num_hidden_layers"] == 61  # per-head dims and layers kept
    laguna = shrunk_config(load_preset("laguna-s-2.1-like"), 16)
    assert set(laguna["num_attention_heads_per_layer"]) == {3, 4} and laguna["num_key_value_heads"] == 1
    assert shrunk_config(load_preset("laguna-s-2.1-like"), 1) == load_preset("laguna-s-2.1-like")


@pytest.mark.parametrize("divisor", [0, 3])
def test_shrink_refuses_what_the_model_cannot_be(divisor):
    from fp4forge.testbed.synth import shrunk_config

    with pytest.raises(ConfigError) as caught:
        shrunk_config(load_preset("laguna-s-2.1-like"), divisor)  # 3: 16 query heads on 2 KV heads is fine, 21 on 2 is not
    assert caught.value.option == "shrink"
