"""Tiny Laguna / Qwen3-MoE testbeds and their tokenizer: layout, loading, determinism, chat format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4forge.errors import ConfigError
from fp4forge.testbed.tiny import build_tiny_laguna, build_tiny_qwen3_moe
from fp4forge.testbed.tokenizer import CONTROL_TOKENS, PARSER_TOKENS, _trained_tokenizer_json, build_tokenizer

LAGUNA_PATTERNS = {
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.N.input_layernorm.weight",
    "model.layers.N.post_attention_layernorm.weight",
    "model.layers.N.self_attn.q_proj.weight",
    "model.layers.N.self_attn.k_proj.weight",
    "model.layers.N.self_attn.v_proj.weight",
    "model.layers.N.self_attn.o_proj.weight",
    "model.layers.N.self_attn.g_proj.weight",
    "model.layers.N.self_attn.q_norm.weight",
    "model.layers.N.self_attn.k_norm.weight",
    "model.layers.N.mlp.gate_proj.weight",
    "model.layers.N.mlp.up_proj.weight",
    "model.layers.N.mlp.down_proj.weight",
    "model.layers.N.mlp.gate.weight",
    "model.layers.N.mlp.experts.e_score_correction_bias",
    "model.layers.N.mlp.experts.E.gate_proj.weight",
    "model.layers.N.mlp.experts.E.up_proj.weight",
    "model.layers.N.mlp.experts.E.down_proj.weight",
    "model.layers.N.mlp.shared_expert.gate_proj.weight",
    "model.layers.N.mlp.shared_expert.up_proj.weight",
    "model.layers.N.mlp.shared_expert.down_proj.weight",
}

# What vLLM's poolside_v1 tool parser matches (vllm/tool_parsers/poolside_v1_tool_parser.py, 0.32).
VLLM_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
VLLM_TOOL_DETAIL = re.compile(r"<tool_call>\s*([^\n<]+?)\s*\n?\s*(<arg_key>.*?)?</tool_call>", re.DOTALL)
VLLM_TOOL_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "21 C and sunny."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("testbed")
    steps: list[tuple[int, int, str]] = []
    dirs = {
        "laguna": build_tiny_laguna(root / "laguna", seed=0, progress=lambda d, t, s: steps.append((d, t, s))),
        "laguna_again": build_tiny_laguna(root / "laguna_again", seed=0),
        "laguna_seed1": build_tiny_laguna(root / "laguna_seed1", seed=1),
        "dense": build_tiny_laguna(root / "dense", seed=0, dense=True),
        "qwen": build_tiny_qwen3_moe(root / "qwen", seed=0),
        "qwen_again": build_tiny_qwen3_moe(root / "qwen_again", seed=0),
    }
    dirs["_steps"] = steps  # type: ignore[assignment]
    return dirs


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def name_pattern(name: str) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.N.", re.sub(r"\.experts\.\d+\.", ".experts.E.", name))


# -- layout ------------------------------------------------------------------------------------------
def test_laguna_on_disk_names_are_per_expert_2d(built):
    tensors = read_tensors(built["laguna"])
    assert {name_pattern(n) for n in tensors} == LAGUNA_PATTERNS
    config = json.loads((built["laguna"] / "config.json").read_text())
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert {"sliding_attention", "full_attention"} <= set(config["layer_types"])
    assert config["num_experts"] >= 16 and config["num_experts_per_tok"] >= 4
    assert config["shared_expert_intermediate_size"] > 0 and config["gating"] is True
    # Layer 0 dense, layers 1..3 sparse with every expert present as its own 2-D tensors.
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and "model.layers.0.mlp.gate.weight" not in tensors
    for layer in (1, 2, 3):
        for expert in range(config["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert tensors[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"].dim() == 2
        assert f"model.layers.{layer}.mlp.gate_proj.weight" not in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_laguna_router_bias_is_nonzero(built):
    tensors = read_tensors(built["laguna"])
    biases = [t for n, t in tensors.items() if n.endswith("e_score_correction_bias")]
    assert len(biases) == 3
    for bias in biases:
        assert bias.shape == (16,) and bias.float().abs().min() > 0 and bias.float().std() > 0.1


def test_every_linear_input_dim_is_multiple_of_64(built):
    for key in ("laguna", "dense", "qwen"):
        for name, tensor in read_tensors(built[key]).items():
            if tensor.dim() == 2:
                assert tensor.shape[1] % 64 == 0, (key, name, tuple(tensor.shape))


def test_weights_are_not_tiny(built):
    tensors = read_tensors(built["laguna"])
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].float().std() > 0.01
    assert tensors["model.embed_tokens.weight"].float().std() > 0.01


def test_sharded_with_index(built):
    for key in ("laguna", "dense", "qwen"):
        directory = built[key]
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
        assert len(shards) >= 2, key
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert set(index["weight_map"]) == set(read_tensors(directory))
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (directory / name).is_file(), (key, name)


def test_dense_variant_has_no_moe(built):
    names = read_tensors(built["dense"])
    assert not any(".experts." in n or ".mlp.gate.weight" in n or "shared_expert" in n for n in names)
    config = json.loads((built["dense"] / "config.json").read_text())
    assert config["mlp_layer_types"] == ["dense"] * 4


def test_qwen3_moe_names(built):
    config = json.loads((built["qwen"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    # transformers 5.23 serialises num_experts under its attribute_map name, num_local_experts.
    assert config.get("num_experts", config.get("num_local_experts")) == 16 and config["num_experts_per_tok"] == 4
    patterns = {name_pattern(n) for n in read_tensors(built["qwen"])}
    assert "model.layers.N.mlp.experts.E.gate_proj.weight" in patterns
    assert "model.layers.N.mlp.gate.weight" in patterns
    assert not any("e_score_correction_bias" in p or "shared_expert" in p for p in patterns)


# -- loading -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["laguna", "dense", "qwen"])
def test_loads_cleanly_and_generates(built, key):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(built[key], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(built[key])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert output.shape[1] == prompt["input_ids"].shape[1] + 4
    if key == "laguna":
        on_disk = read_tensors(built[key])["model.layers.2.mlp.experts.e_score_correction_bias"]
        assert torch.equal(model.model.layers[2].mlp.gate.e_score_correction_bias.data, on_disk)


# -- determinism -------------------------------------------------------------------------------------
def files_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("first,second", [("laguna", "laguna_again"), ("qwen", "qwen_again")])
def test_same_seed_gives_identical_files(built, first, second):
    assert files_bytes(built[first]) == files_bytes(built[second])


def test_other_seed_gives_other_weights(built):
    a, b = files_bytes(built["laguna"]), files_bytes(built["laguna_seed1"])
    assert a["tokenizer.json"] == b["tokenizer.json"] and a["config.json"] == b["config.json"]
    assert a["model-00001-of-00003.safetensors"] != b["model-00001-of-00003.safetensors"]


def test_tokenizer_training_is_deterministic():
    fresh = _trained_tokenizer_json.__wrapped__(4096)  # bypass the per-process cache
    assert fresh == _trained_tokenizer_json(4096)


def test_progress_reported(built):
    steps = built["_steps"]
    assert steps[-1][0] == steps[-1][1] and [d for d, _, _ in steps] == sorted(d for d, _, _ in steps)


# -- output handling ---------------------------------------------------------------------------------
def test_refuses_non_empty_output(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(ConfigError):
        build_tiny_laguna(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    def broken_save(self, directory, *args, **kwargs):
        (Path(directory) / "half-written").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", broken_save)
    with pytest.raises(RuntimeError, match="disk full"):
        build_tiny_qwen3_moe(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_empty_existing_output_is_fine(tmp_path, built):
    out = tmp_path / "empty"
    out.mkdir()
    assert build_tiny_laguna(out, dense=True) == out
    assert files_bytes(out) == files_bytes(built["dense"])


# -- tokenizer and chat template ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_control_tokens_are_single_ids(tokenizer):
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == 4096
    for token in CONTROL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False).input_ids
        assert ids == [vocab[token]], token
    assert tokenizer.bos_token == tokenizer.eos_token == "〈|EOS|〉"
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    assert tokenizer("def f(): pass").input_ids[0] == tokenizer.bos_token_id


def test_parser_tokens_survive_decoding(tokenizer):
    text = "<think>plan</think><tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    ids = tokenizer(text + "</assistant>", add_special_tokens=False).input_ids
    # vLLM decodes with skip_special_tokens=True unless told otherwise; the parsers must still see these.
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert set(PARSER_TOKENS) <= set(tokenizer.convert_ids_to_tokens(ids))


def test_chat_with_tools_renders_poolside_format(tokenizer):
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert text.startswith("〈|EOS|〉<system>You are terse.\n\n### Tools\n")
    assert '<available_tools>\n{"name": "get_weather"' in text and "</available_tools></system>\n" in text
    assert "<user>Weather in Paris?</user>\n" in text
    assert (
        "<assistant><think>I should call the tool.</think><tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
        "</tool_call></assistant>\n"
    ) in text
    assert '<tool_response>{"temp_c": 21}</tool_response>\n' in text
    assert "<assistant></think>21 C and sunny.</assistant>\n" in text
    assert text.endswith("<user>Thanks!</user>\n<assistant><think>")  # thinking on by default, as Laguna's template

    calls = VLLM_TOOL_CALL.findall(text)
    assert len(calls) == 1
    detail = VLLM_TOOL_DETAIL.search(calls[0])
    assert detail.group(1).strip() == "get_weather"
    assert VLLM_TOOL_ARG.findall(detail.group(2)) == [("city", "Paris"), ("days", "2")]

    ids = tokenizer.apply_chat_template(
        TOOL_CONVERSATION, tools=[WEATHER_TOOL], add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.decode(ids) == text
    vocab = tokenizer.get_vocab()
    assert ids[0] == tokenizer.bos_token_id
    for token in ("<assistant>", "</assistant>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>"):
        assert vocab[token] in ids, token


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"thinking": True}, {"enable_thinking": None}])
def test_thinking_is_on_by_default(tokenizer, kwargs):
    """Laguna's template thinks unless told not to: the prompt opens a <think> block for the model."""
    messages = [{"role": "user", "content": "Hi"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert on == "〈|EOS|〉<user>Hi</user>\n<assistant><think>"


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"thinking": False}, {"enable_thinking": True, "thinking": False}])
def test_thinking_off_when_a_key_is_false(tokenizer, kwargs):
    """Either key false turns thinking off, the rule poolside_v1_fixed's thinking_requested applies."""
    messages = [{"role": "user", "content": "Hi"}]
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert off == "〈|EOS|〉<user>Hi</user>\n<assistant></think>"


def test_string_arguments_and_content_parts(tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "run it"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "sh", "arguments": "ls -l"}}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<user>run it</user>\n" in text
    assert "<tool_call>sh<arg_key>arguments</arg_key><arg_value>ls -l</arg_value></tool_call></assistant>\n" in text


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"enable_thinking": True}, {"thinking": True}, {"enable_thinking": False}, {"thinking": False},
     {"enable_thinking": True, "thinking": False}, {"enable_thinking": None}, {"unrelated": 1}],
)
def test_template_and_fixed_parser_agree_on_thinking(tokenizer, kwargs):
    """The template opens <think> exactly when poolside_v1_fixed expects reasoning first."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "fp4forge-vllm" / "src"))
    try:
        from fp4forge_vllm.reasoning_defaults import thinking_requested
    finally:
        sys.path.pop(0)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, **kwargs)
    assert prompt.endswith("<assistant><think>") is thinking_requested(kwargs)
    assert prompt.endswith("<assistant></think>") is not thinking_requested(kwargs)
