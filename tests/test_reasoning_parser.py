"""``poolside_v1_fixed`` (fp4forge-vllm) against vLLM's stock ``poolside_v1`` on real servers.

The chat template thinks unless the request turns it off (as Laguna-S-2.1's does). The random
model is made to answer ``REASONING</think>ANSWER`` with a structured-output regex applied from the
first token (``enable_in_reasoning``); a logit bias makes it spell ``</think>`` with the single
``</think>`` token a real model emits (left alone, the grammar lets it spell the tag in pieces,
which no token-id based streaming parser can see). In this testbed ``<think>``/``</think>`` are not
special tokens, so they survive detokenisation and the non-streaming parser sees them.

The fixed parser must put the reasoning in ``reasoning`` and only the answer in ``content``,
streaming or not, with or without ``chat_template_kwargs``, and with a ``</think>`` in an
earlier turn. The stock parser, asked the same without ``chat_template_kwargs``, leaks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from fp4forge.serve import VllmServer
from fp4forge.serve.doctor import diagnose, iter_lines
from tests.fixtures_vllm_plugin import Registry, plugin_bf16_moe, plugin_modelopt_w4a16, server_log, servers  # noqa: F401 (shared fixtures)

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 600.0
REASONING = "Let me think step by step."
ANSWER = "The answer is 42."
FORCED = r"Let me think step by step\.</think>The answer is 42\."
FORCED_NO_THINKING = r"The answer is 42\."

QUESTION = [{"role": "user", "content": "What is six times seven?"}]
EARLIER_THINK = [
    {"role": "user", "content": "Say hi."},
    # An earlier assistant turn whose reasoning (and thus a </think>) is in the prompt.
    {"role": "assistant", "content": "Hi.", "reasoning": "A greeting deserves a greeting."},
    {"role": "user", "content": "What does </think> mean here? Also, what is six times seven?"},
]
HISTORIES = {"single-turn": QUESTION, "earlier-think": EARLIER_THINK}
THINKING_KWARGS = {"absent": None, "on": {"enable_thinking": True}}


# -- pure: the default itself (no vLLM needed) ---------------------------------------------------
def _defaults():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO_ROOT / "plugins" / "fp4forge-vllm" / "src"))
    try:
        from fp4forge_vllm import reasoning_defaults
    finally:
        sys.path.pop(0)
    return reasoning_defaults


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (None, True),
        ({}, True),
        ({"enable_thinking": True}, True),
        ({"thinking": True}, True),
        ({"enable_thinking": False}, False),
        ({"thinking": False}, False),
        ({"enable_thinking": True, "thinking": False}, False),
        ({"enable_thinking": None}, True),
        ({"unrelated": 1}, True),
    ],
)
def test_thinking_is_on_unless_turned_off(kwargs: dict[str, Any] | None, expected: bool) -> None:
    assert _defaults().thinking_requested(kwargs) is expected


# -- real servers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def think_end_id(servers: Registry) -> int:
    tokenizer = AutoTokenizer.from_pretrained(servers.models.get("bf16_moe"))
    token_id = tokenizer.convert_tokens_to_ids("</think>")
    assert tokenizer.decode([token_id]) == "</think>"
    return token_id


def chat(
    server: VllmServer,
    messages: list[dict[str, Any]],
    *,
    stream: bool,
    kwargs: dict[str, Any] | None,
    regex: str,
    think_end_id: int,
) -> dict[str, str]:
    body: dict[str, Any] = {
        "model": server.served_model_name,
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
        "structured_outputs": {"regex": regex},
        "logit_bias": {str(think_end_id): 100},
        "stream": stream,
    }
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    url = f"{server.openai_base_url}/chat/completions"
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        if not stream:
            response = client.post(url, json=body)
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            return {"reasoning": message.get("reasoning") or "", "content": message.get("content") or ""}
        parts = {"reasoning": "", "content": ""}
        with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: "):])["choices"]:
                    for key in parts:
                        parts[key] += choice["delta"].get(key) or ""
        return parts


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("thinking", list(THINKING_KWARGS))
def test_fixed_parser_keeps_reasoning_out_of_content(
    plugin_bf16_moe: VllmServer, think_end_id: int, stream: bool, history: str, thinking: str
) -> None:
    result = chat(
        plugin_bf16_moe, HISTORIES[history], stream=stream, kwargs=THINKING_KWARGS[thinking],
        regex=FORCED, think_end_id=think_end_id,
    )
    assert result == {"reasoning": REASONING, "content": ANSWER}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_fixed_parser_thinking_off_is_all_content(plugin_bf16_moe: VllmServer, think_end_id: int, stream: bool) -> None:
    result = chat(
        plugin_bf16_moe, QUESTION, stream=stream, kwargs={"enable_thinking": False},
        regex=FORCED_NO_THINKING, think_end_id=think_end_id,
    )
    assert result == {"reasoning": "", "content": ANSWER}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("history", list(HISTORIES))
def test_stock_poolside_v1_leaks_reasoning_into_content(
    plugin_modelopt_w4a16: VllmServer, think_end_id: int, stream: bool, history: str
) -> None:
    """The same request, no chat_template_kwargs: the identity parser passes everything through."""
    result = chat(
        plugin_modelopt_w4a16, HISTORIES[history], stream=stream, kwargs=None, regex=FORCED, think_end_id=think_end_id
    )
    assert result["reasoning"] == ""
    assert result["content"] == f"{REASONING}</think>{ANSWER}"


@pytest.mark.slow
def test_fixed_parser_initialises_reasoning_token_ids_at_startup(
    plugin_bf16_moe: VllmServer, plugin_modelopt_w4a16: VllmServer
) -> None:
    fixed = {f.id for f in diagnose(iter_lines(server_log(plugin_bf16_moe))).findings}
    stock = {f.id for f in diagnose(iter_lines(server_log(plugin_modelopt_w4a16))).findings}
    assert "reasoning-autoinit-failed" not in fixed
    assert "reasoning-autoinit-failed" in stock
