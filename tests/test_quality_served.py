"""The quality runner and the reasoning parser on a real vLLM CPU server with the plugin (issue 19,
finding 1): ``plugin_bf16_moe`` of tests/fixtures_vllm_plugin.py (tiny Laguna MoE, the testbed's
think-by-default template, ``poolside_v1`` tool parser, ``poolside_v1_fixed`` reasoning parser,
structured outputs applied from the first token).

The random model is made to write an exact answer with a regex; a logit bias makes it spell the
markup (``</think>``, ``<tool_call>``, ``<arg_key>``...) with the single tokens a real model emits
(the streaming parsers look for token ids). Two prompts:

* the template's generation prompt (``<assistant><think>``): thinking is open;
* the reasoning already closed in the prompt (the request continues an assistant turn
  ``<think>…</think>``): what a template that does not think renders, while the parser, given no
  ``chat_template_kwargs``, assumes thinking. This is the mismatch of finding 1.

The right behaviour, decided here and asserted against vLLM's real parser code:
* thinking open, no ``</think>`` written: everything is reasoning, on both paths (an unfinished
  thought is no answer; a ``<tool_call>`` inside it is not a call);
* thinking open, ``</think>`` then a call: the call is parsed, on both paths;
* reasoning closed by the prompt: the answer is the call. The streamed path gets it right; vLLM
  0.32's plain path does not (it never consults the prompt) and hides the call in ``reasoning``.
  That is why the runner streams; the plain-path assertion documents the engine's behaviour and
  fails when a vLLM release changes it (then docs/quality.md#reading-the-answer needs updating).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from fp4forge.quality.evaluate import run_and_score
from fp4forge.quality.runner import RunConfig, read_stream
from fp4forge.quality.suite import load_suite
from fp4forge.serve import VllmServer
from tests import fixtures_vllm_plugin

pytestmark = pytest.mark.slow

SCENARIO = "opt-weather-stated"  # expects get_weather(city="Denver", unit="fahrenheit", days=5): 4 points
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Denver</arg_value><arg_key>unit</arg_key>"
        "<arg_value>fahrenheit</arg_value><arg_key>days</arg_key><arg_value>5</arg_value></tool_call>")
REASONING = "Checking the forecast."
MARKUP = ("</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
CLOSED = [{"role": "assistant", "content": f"<think>{REASONING}</think>"}]


def regex(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch for ch in text)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> VllmServer:
    """The shared ``plugin_bf16_moe`` (one start per session with the parser and plugin tests)."""
    return fixtures_vllm_plugin.registry(request).ready("plugin_bf16_moe")


@pytest.fixture(scope="module")
def markup_bias(request: pytest.FixtureRequest, server: VllmServer) -> dict[str, int]:
    tokenizer = AutoTokenizer.from_pretrained(fixtures_vllm_plugin.registry(request).models.get("bf16_moe"))
    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in MARKUP}
    assert all(tokenizer.decode([i]) == tag for tag, i in ids.items())
    return {str(i): 100 for i in ids.values()}


def ask(server: VllmServer, forced: str, bias: dict[str, int], *, stream: bool, closed: bool) -> dict[str, Any]:
    scenario = load_suite().by_id()[SCENARIO]
    extra: dict[str, Any] = {"structured_outputs": {"regex": regex(forced)}, "logit_bias": bias}
    messages = list(scenario.initial_messages())
    if closed:
        extra.update(continue_final_message=True, add_generation_prompt=False)
        messages += CLOSED
    body = {"model": server.served_model_name, "messages": messages, "tools": scenario.request_tools(), "tool_choice": "auto",
            "temperature": 0, "max_tokens": 96, **extra}
    url = f"{server.openai_base_url}/chat/completions"
    with httpx.Client(timeout=600, trust_env=False) as client:
        if not stream:  # no chat_template_kwargs: the parser's own default decides
            response = client.post(url, json=body)
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
        else:
            with client.stream("POST", url, json={**body, "stream": True}) as response:
                assert response.status_code == 200, response.read()
                message, _, _, error = read_stream(response.iter_lines())
            assert error is None, error
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return {"reasoning": message.get("reasoning") or "", "content": message.get("content") or "", "calls": calls}


DENVER = [("get_weather", {"city": "Denver", "unit": "fahrenheit", "days": 5})]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_no_closing_think_keeps_everything_in_reasoning_on_both_paths(
    server: VllmServer, markup_bias: dict[str, int], stream: bool
) -> None:
    """Non-streaming (and streaming), no chat_template_kwargs, no </think> emitted."""
    result = ask(server, REASONING + CALL, markup_bias, stream=stream, closed=False)
    assert result == {"reasoning": REASONING + CALL, "content": "", "calls": []}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_call_after_closing_think_is_parsed_on_both_paths(
    server: VllmServer, markup_bias: dict[str, int], stream: bool
) -> None:
    result = ask(server, REASONING + "</think>" + CALL, markup_bias, stream=stream, closed=False)
    assert result == {"reasoning": REASONING, "content": "", "calls": DENVER}


def test_reasoning_closed_by_the_prompt_only_the_streamed_path_finds_the_call(
    server: VllmServer, markup_bias: dict[str, int]
) -> None:
    streamed = ask(server, CALL, markup_bias, stream=True, closed=True)
    assert streamed == {"reasoning": "", "content": "", "calls": DENVER}
    plain = ask(server, CALL, markup_bias, stream=False, closed=True)
    assert plain == {"reasoning": CALL, "content": "", "calls": []}  # vLLM 0.32: the call hidden in reasoning


# -- the runner ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_runner_scores_a_forced_correct_call_full_marks(
    server: VllmServer, markup_bias: dict[str, int], stream: bool, tmp_path: Path
) -> None:
    forced = {"structured_outputs": {"regex": regex(REASONING + "</think>" + CALL)}, "logit_bias": markup_bias}
    config = RunConfig(base_url=server.base_url, model=server.served_model_name, arm="forced", max_tokens=96, stream=stream,
                       extra_body=forced)
    outcome = run_and_score(config, tmp_path, only=[SCENARIO])
    [result] = outcome.results
    assert (result.earned, result.max) == (4, 4)
    assert result.answers.with_calls == 1 and result.answers.unread == 0 and outcome.refusal is None
    assert result.header["request"]["stream"] is stream


def test_runner_refuses_the_untrained_models_own_answers(server: VllmServer, tmp_path: Path) -> None:
    config = RunConfig(base_url=server.base_url, model=server.served_model_name, arm="random", max_tokens=32)
    outcome = run_and_score(config, tmp_path, only=[SCENARIO, "sel-stock-quote", "rest-general-knowledge"])
    assert outcome.refusal is not None and "cut at max_tokens" in str(outcome.refusal)
    assert outcome.document["answers"]["arms"]["random"]["truncated"] == 3
