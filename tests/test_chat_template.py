"""fp4forge's chat-template render (``checkpoint/chat_template.py``, what the audit renders without
importing transformers) against transformers' ``apply_chat_template(..., tokenize=False)``, the
oracle: the same text for the template the testbeds write, the real templates vLLM ships, and
templates that use each thing transformers adds to Jinja; the same refusal where transformers
refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from fp4forge.checkpoint.chat_template import render_chat_template, special_tokens
from fp4forge.testbed import tokenizer as testbed_tokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "src/fp4forge/testbed/shipped/trained-laguna"

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"here\" — in °C",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATS: dict[str, dict[str, Any]] = {
    "one user turn": {"messages": [{"role": "user", "content": "Hello"}], "add_generation_prompt": True},
    "system, user, assistant with reasoning": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"}, {"role": "user", "content": "and 3+3?"}]},
    "reasoning under another name, a None content": {"messages": [
        {"role": "user", "content": "Hi <b>there</b> ünïcode"}, {"role": "assistant", "content": None, "reasoning": "think",
                                                                   "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"}], "tools": [TOOL], "add_generation_prompt": True, "enable_thinking": False},
    "content parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " two"}]}],
                      "add_generation_prompt": True},
}

# Templates that use what transformers adds to Jinja: its tojson options (indent, no HTML
# escaping, key order kept), strftime_now, raise_exception, the loop controls, the generation block,
# namespace, dict, and trim_blocks / lstrip_blocks on tags without '-'.
FEATURE_TEMPLATES = {
    "tojson options": (
        "{% for message in messages %}{{ message | tojson }}\n{{ message | tojson(indent=2) }}\n"
        "{{ message | tojson(sort_keys=true, ensure_ascii=true) }}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=4) }}{{ tools | tojson(separators=(',', ':')) }}{% endif %}"),
    "strftime_now and special tokens": "{{ bos_token }}[{{ strftime_now('%Y-%m') }}]{{ eos_token }}|{{ pad_token }}|{{ unk_token }}",
    "trim and lstrip blocks": (
        "{% for message in messages %}\n    {% if message.role == 'user' %}\n<u>{{ message.content }}</u>\n"
        "    {% else %}\n<o>{{ message.content }}</o>\n    {% endif %}\n{% endfor %}\n"
        "{% if add_generation_prompt %}\n<a>\n{% endif %}\n"),
    "loop controls, generation block, namespace, dict": (
        "{% set ns = namespace(n=0, seen=dict(a=1)) %}{% for message in messages %}"
        "{% if message.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{% if message.role == 'assistant' %}{% generation %}[{{ message.content }}]{% endgeneration %}"
        "{% else %}({{ message.content if message.content is string else message.content | map(attribute='text') | join }}){% endif %}"
        "{% if ns.n >= 3 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}{{ ns.seen | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}"),
    "reasoning aliases": ("{% for m in messages %}{{ m.role }}:{{ m.thinking | default('-') }}/{{ m.reasoning_content | default('-') }}"
                          "/{{ m.reasoning | default('-') }}/{{ 'content' in m }};{% endfor %}{{ enable_thinking | default('unset') }}"),
}


def _vllm_templates(venv: Path) -> dict[str, str]:
    found = sorted(venv.glob("lib/python3*/site-packages/vllm/transformers_utils/chat_templates/*.jinja"))
    assert found, f"vLLM's bundled chat templates not found under {venv}"
    return {f"vllm {path.stem}": path.read_text() for path in found}


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return SHIPPED  # the shipped testbed's tokenizer, read in place


@pytest.fixture(scope="module")
def oracle(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _tokens(directory: Path) -> dict[str, str]:
    maps = directory / "special_tokens_map.json"
    return special_tokens(json.loads((directory / "tokenizer_config.json").read_text()),
                          json.loads(maps.read_text()) if maps.exists() else None)


def _both(template: str, chat: dict[str, Any], tokenizer: Any, tokens: dict[str, str]) -> tuple[Any, Any]:
    """(transformers' outcome, ours): the text, or the exception's type and message."""
    chat = dict(chat)
    messages = chat.pop("messages")
    outcomes = []
    for render in (lambda: tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **chat),
                   lambda: render_chat_template(template, messages, special_tokens=tokens, **chat)):
        try:
            outcomes.append(render())
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # a template's own error, as the template raised it
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes[0], outcomes[1]


def test_the_testbed_template_renders_as_transformers_renders_it(oracle: Any, tokenizer_dir: Path) -> None:
    assert oracle.chat_template == testbed_tokenizer.chat_template()  # the template the testbeds write and ship
    for name, chat in CHATS.items():
        expected, ours = _both(testbed_tokenizer.chat_template(), chat, oracle, _tokens(tokenizer_dir))
        assert isinstance(expected, str) and ours == expected, name


@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_what_transformers_adds_to_jinja_renders_the_same(name: str, oracle: Any, tokenizer_dir: Path) -> None:
    for chat_name, chat in CHATS.items():
        expected, ours = _both(FEATURE_TEMPLATES[name], chat, oracle, _tokens(tokenizer_dir))
        assert isinstance(expected, str), (chat_name, expected)
        assert ours == expected, chat_name


def test_real_templates_vllm_ships_render_the_same(vllm_venv: Path, oracle: Any, tokenizer_dir: Path) -> None:
    compared = 0
    for name, template in _vllm_templates(vllm_venv).items():
        for chat_name, chat in CHATS.items():
            expected, ours = _both(template, chat, oracle, _tokens(tokenizer_dir))
            assert ours == expected, (name, chat_name)
            compared += isinstance(expected, str)
    assert compared >= 10  # most pairs render (some templates refuse a conversation, and must refuse alike)


@pytest.mark.parametrize("template, refusal", [
    ("{{ raise_exception('roles must alternate') }}", "TemplateError"),
    ("{% set ns = namespace(_private=1) %}{{ ns }}", "SecurityError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages[0].role.upper() }}{{ messages | length }}{{ undefined_name }}", None),  # safe methods run, undefined is empty
    ("{% for m in messages %}{{ m.content | tojson }}", "TemplateSyntaxError"),
    ("{{ 'x'.format_map({}) }}{{ messages.append(1) }}", "SecurityError"),
])
def test_a_template_transformers_refuses_is_refused_alike(template: str, refusal: str | None, oracle: Any, tokenizer_dir: Path) -> None:
    expected, ours = _both(template, CHATS["one user turn"], oracle, _tokens(tokenizer_dir))
    if refusal is None:
        assert isinstance(expected, str) and ours == expected
    else:  # the same exception; the template's own message word for word, fp4forge's own in its words
        assert isinstance(expected, tuple) and expected[0] == ours[0] == refusal
        assert ours[1] == expected[1] or refusal == "SecurityError"


def test_special_tokens_are_the_ones_transformers_hands_the_template(tmp_path: Path, oracle: Any, tokenizer_dir: Path) -> None:
    assert _tokens(tokenizer_dir) == oracle.special_tokens_map
    # A legacy directory: added-token objects and no added_tokens_decoder, special_tokens_map.json over them.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(tokenizer_dir / "tokenizer.json", legacy)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config["eos_token"] = {"__type": "AddedToken", "content": config["eos_token"], "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    (legacy / "tokenizer_config.json").write_text(json.dumps(config))
    (legacy / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "<|reserved_0|>", "special": True}}))
    tokenizer = AutoTokenizer.from_pretrained(legacy)
    assert _tokens(legacy) == tokenizer.special_tokens_map
    assert _tokens(legacy)["pad_token"] == "<|reserved_0|>"
    template = FEATURE_TEMPLATES["strftime_now and special tokens"]
    expected, ours = _both(template, CHATS["one user turn"], tokenizer, _tokens(legacy))
    assert ours == expected
