"""The loader data (`layouts/_vllm_loader_ignores.json`, which scripts/vllm_loader_ignores.py
derives by reading vLLM's `load_weights` sources) against what vLLM's loaders do when a tensor
no parameter takes arrives: tiny models built and loaded by vLLM on the CPU
(tests/vllm_loader_probe.py, in the vLLM environment)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fp4forge.checkpoint import vllm_params

PROBE = Path(__file__).resolve().parent / "vllm_loader_probe.py"
_LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 256, "torch_dtype": "float32"}
# One architecture per way the derivation reaches its verdict, each with a Linear that has no bias.
CASES = {
    # AutoWeightsLoader over LlamaModel's hand-written loader, which skips an unexpected bias itself
    "LlamaForCausalLM": {"config": {**_LLAMA_LIKE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                         "module": "model.layers.0.self_attn.o_proj"},
    # vLLM's Transformers backend: the causal LM's loader passes its tensors to super().load_weights
    "OlmoForCausalLM": {"config": {**_LLAMA_LIKE, "architectures": ["OlmoForCausalLM"], "model_type": "olmo"},
                        "module": "model.layers.0.self_attn.o_proj"},
    # a hand-written loader without the skip: `params_dict[name]` raises
    "DbrxForCausalLM": {"config": {"architectures": ["DbrxForCausalLM"], "model_type": "dbrx", "d_model": 64, "n_heads": 4,
                                   "n_layers": 1, "max_seq_len": 256, "vocab_size": 256, "torch_dtype": "float32",
                                   "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
                                   "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 64}},
                        "module": "transformer.blocks.0.norm_attn_norm.attn.out_proj"},
}


@pytest.mark.slow
def test_bias_verdict_is_what_vllms_loader_does(vllm_venv, tmp_path):
    """For architectures the data says skip an unexpected `.bias` and one it says raises on it,
    vLLM's own load_weights does just that (the weight alone loads in every case, so a raise is
    the bias's); suffixes_skipped_by_loader says `bias` exactly where the loader skips it."""
    verdicts = vllm_params.loader_ignores_data()["skips_unexpected_bias"]
    assert {verdicts[a] for a in CASES} == {True, False}
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(CASES))
    result = subprocess.run([str(vllm_venv / "bin" / "python"), str(PROBE), str(cases)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loads = json.loads(result.stdout)
    for architecture in CASES:
        assert loads[architecture]["control"] == "loaded", (architecture, loads[architecture])
        assert (loads[architecture]["bias"] == "skipped") == verdicts[architecture], (architecture, loads[architecture])
        expected = (vllm_params.UNEXPECTED_BIAS,) if verdicts[architecture] else ()
        assert vllm_params.suffixes_skipped_by_loader([architecture]) == expected
    assert "bias" in loads["DbrxForCausalLM"]["bias"]  # the raise names the tensor it could not place
