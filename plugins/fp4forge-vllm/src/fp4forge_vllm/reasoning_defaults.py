"""The fixed parser's name and its thinking default, importable without vLLM (the plugin
registers the parser lazily by name; fp4forge's tests check the default without a vLLM venv)."""

from __future__ import annotations

from typing import Any

PARSER_NAME = "poolside_v1_fixed"
PARSER_MODULE = "fp4forge_vllm.reasoning"
PARSER_CLASS = "PoolsideV1FixedReasoningParser"
THINKING_KEYS = ("enable_thinking", "thinking")


def thinking_requested(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """On unless the request sets one of the thinking keys to a false value."""
    kwargs = chat_template_kwargs or {}
    return all(bool(kwargs[key]) for key in THINKING_KEYS if kwargs.get(key) is not None)
