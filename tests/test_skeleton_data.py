"""The skeleton tables (checkpoint/skeletons/*.json) against their oracle, transformers' own
skeleton (checkpoint.skeleton, built on the meta device): the same names, dtypes, shapes and
order for every corpus config of a covered model type and for variations of the keys that decide
each layer's kind; configs the tables do not cover answer None (transformers decides).

Layer and expert counts are cut to a few so that transformers builds each model in well under a
second; what a table repeats per layer or expert is the same at any count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4forge.checkpoint.skeleton import checkpoint_specs
from fp4forge.checkpoint.skeleton_data import expected_rows, model_types

CORPUS = Path(__file__).parent / "corpus"
DROP = object()  # a variation that removes the key
SMALL = {"num_hidden_layers": 5, "n_routed_experts": 3, "num_experts": 3, "num_local_experts": 3}

# Per model type: config changes that switch a layer kind or an optional tensor on or off.
VARIATIONS = {
    "deepseek_v3": [
        {},
        {"q_lora_rank": None},
        {"attention_bias": True},
        {"attention_bias": True, "q_lora_rank": None},
        {"tie_word_embeddings": True},
        {"first_k_dense_replace": 0},
        {"first_k_dense_replace": 7},
        {"n_shared_experts": 2},
        {"num_key_value_heads": None},
        {"moe_layer_freq": 2, "num_nextn_predict_layers": 3},
        {"torch_dtype": "float32"},
        {"dtype": "float16", "torch_dtype": None},
        {"v_head_dim": 96, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "kv_lora_rank": 256},
    ],
    "qwen3_moe": [
        {},
        {"mlp_only_layers": [1, 3]},
        {"mlp_only_layers": None},
        {"decoder_sparse_step": 2},
        {"num_experts": 0},
        {"attention_bias": True},
        {"head_dim": DROP},
        {"head_dim": 64},
        {"tie_word_embeddings": True},
        {"use_sliding_window": True, "sliding_window": 64},
    ],
    "gpt_oss": [
        {},
        {"attention_bias": False},
        {"layer_types": None},
        {"layer_types": DROP},
        {"head_dim": 128},
        {"tie_word_embeddings": True},
    ],
    "qwen3_next": [
        {},
        {"full_attention_interval": 2},
        {"full_attention_interval": DROP},
        {"layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"]},
        {"mlp_only_layers": [0, 4]},
        {"decoder_sparse_step": 2},
        {"num_experts": 0},
        {"attention_bias": True},
        {"tie_word_embeddings": True},
        {"linear_num_key_heads": 8, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 3},
    ],
    "qwen3_5_moe_text": [
        {},
        {"architectures": ["Qwen3_5MoeForCausalLM"]},  # the text model itself: `model.` names
        {"architectures": DROP},
        {"layer_types": DROP},
        {"layer_types": DROP, "full_attention_interval": 2},
        {"attention_bias": True},
        {"tie_word_embeddings": True},
        {"dtype": "bfloat16"},
        {"attn_output_gate": False, "mlp_only_layers": [1]},  # keys this model class does not read
    ],
    "granitemoe": [
        {},
        {"attention_bias": True},
        {"tie_word_embeddings": False},
        {"num_key_value_heads": None},
        {"head_dim": 32},
    ],
    "mixtral": [
        {},
        {"head_dim": 64},
        {"head_dim": None},
        {"tie_word_embeddings": True},
        {"torch_dtype": "float16"},
    ],
}


def _corpus_configs() -> list[tuple[str, dict]]:
    out = []
    for directory in sorted(CORPUS.iterdir()):
        path = directory / "config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            if config.get("model_type") in model_types():
                config.pop("quantization_config", None)
                out.append((directory.name, config))
    return out


def _small(config: dict) -> dict:
    out = {**config, **{k: v for k, v in SMALL.items() if k in config}}
    if isinstance(config.get("layer_types"), list):
        out["layer_types"] = config["layer_types"][: out["num_hidden_layers"]]
    return out


def _truth(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(s.name, s.dtype, tuple(s.shape)) for s in checkpoint_specs(config)]


def _varied(config: dict, change: dict) -> dict:
    out = {**config, **change}
    return {k: v for k, v in out.items() if v is not DROP}


CASES = [(f"{name}-{i}", _varied(_small(config), change)) for name, config in _corpus_configs() for i, change in enumerate(VARIATIONS.get(config["model_type"], [{}]))]


def test_every_table_has_corpus_configs_and_variations():
    covered = {config["model_type"] for _, config in _corpus_configs()}
    assert covered == set(model_types()) == set(VARIATIONS)


@pytest.mark.parametrize("config", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_table_expansion_equals_transformers_skeleton(config):
    rows = expected_rows(config)
    assert rows is not None, "the tables should cover this config"
    assert rows == _truth(config)


def test_full_size_corpus_config_expands_like_transformers():
    """One config at full size (61 layers x 256 experts): counts come from the config."""
    config = next(c for n, c in _corpus_configs() if n == "deepseek-r1-nvfp4-modelopt")
    rows = expected_rows(config)
    assert rows is not None and len(rows) == 45395  # transformers' count for this config (save_pretrained's names, built on the meta device)
    assert rows[:3] == _truth(_small(config))[:3]


@pytest.mark.parametrize(
    "change",
    [
        {"architectures": ["DeepseekV3ForSequenceClassification"]},  # another class: another skeleton
        {"some_new_key": 1},  # a key the table was not written for
        {"hidden_size": "7168"},  # a value of the wrong type: transformers' validation speaks
        {"num_hidden_layers": 0},
        {"n_routed_experts": 1 << 20},  # past MAX_COUNT: transformers' path refuses it
        {"torch_dtype": "int8"},
        {"dtype": "float16", "torch_dtype": "bfloat16"},
        {"first_k_dense_replace": None},
        {"model_type": "no_such_model"},
    ],
)
def test_configs_the_tables_do_not_cover_fall_back(change):
    _, config = next((n, c) for n, c in _corpus_configs() if n == "deepseek-r1-nvfp4-modelopt")
    assert expected_rows({**_small(config), **change}) is None


@pytest.mark.parametrize(
    ("entry", "change"),
    [
        ("mixtral-8x7b-instruct", {"num_key_value_heads": None}),  # transformers refuses None here
        ("qwen3-30b-a3b", {"head_dim": None}),  # not a field: transformers would build Linear(None)
        ("qwen3-30b-a3b", {"mlp_only_layers": "1,2"}),
        ("gpt-oss-20b", {"layer_types": ["full_attention"]}),  # one per layer or transformers refuses
        ("gpt-oss-20b", {"layer_types": ["chunked"] * 5}),
        ("gpt-oss-20b", {"head_dim": None}),
        ("qwen3.5-18b-reap-a3b", {"architectures": ["Qwen3NextForConditionalGeneration"]}),  # a wrapper the table does not name
        ("qwen3-next-80b-a3b", {"layer_types": ["mamba"] * 5}),  # a legacy spelling transformers renames: not in the table
        ("granite-3.1-1b-a400m", {"head_dim": None}),  # not a field: transformers would build Linear(None)
    ],
)
def test_values_transformers_refuses_fall_back(entry, change):
    _, config = next((n, c) for n, c in _corpus_configs() if n == entry)
    assert expected_rows({**_small(config), **change}) is None
