"""``poolside_v1_fixed``: vLLM's ``poolside_v1`` reasoning parser with thinking on by default.

vLLM's ``PoolsideV1ReasoningParser`` inherits ``DeepSeekV3ReasoningParser``, which separates
reasoning only when the request passes ``thinking``/``enable_thinking`` as true; otherwise it
becomes an identity parser and the chain of thought, ``</think>`` included, lands in
``content`` (vLLM #49379; fp4forge's docs/formats.md#reasoning-parser-identity-fallback).
Laguna's chat template thinks unless told not to, so this parser does the same:

* thinking is on unless the request explicitly turns it off (either key false);
* because the no-argument default is "on", ``reasoning_start_str``/``reasoning_end_str`` exist
  when vLLM initialises reasoning token ids at startup (no "Auto-initialization ... failed");
* the ``</think>`` search stays scoped to the current assistant turn (inherited from
  ``poolside_v1``), so a ``</think>`` in an earlier turn does not end this turn's reasoning.

Use it with ``--reasoning-parser-plugin fp4forge_vllm.reasoning --reasoning-parser
poolside_v1_fixed`` (the installed plugin also registers the name on its own).
"""

from __future__ import annotations

from vllm.reasoning import ReasoningParserManager
from vllm.reasoning.poolside_v1_reasoning_parser import PoolsideV1ReasoningParser

from fp4forge_vllm.reasoning_defaults import PARSER_NAME, THINKING_KEYS, thinking_requested


@ReasoningParserManager.register_module(PARSER_NAME)
class PoolsideV1FixedReasoningParser(PoolsideV1ReasoningParser):
    def __init__(self, tokenizer, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        # A copy: the caller's dict is also what the chat template was rendered with.
        chat_kwargs = dict(kwargs.get("chat_template_kwargs") or {})
        thinking = thinking_requested(chat_kwargs)
        chat_kwargs.update({key: thinking for key in THINKING_KEYS})
        kwargs["chat_template_kwargs"] = chat_kwargs
        super().__init__(tokenizer, *args, **kwargs)


__all__ = ["PARSER_NAME", "PoolsideV1FixedReasoningParser", "thinking_requested"]
