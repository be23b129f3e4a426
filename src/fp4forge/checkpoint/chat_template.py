"""A checkpoint's chat template rendered the way transformers' ``apply_chat_template(...,
tokenize=False)`` renders it, and so the way vLLM renders every chat request, without importing
transformers (seconds of start-up the audit would otherwise pay for one small file).

What transformers gives a chat template, mirrored here and compared with transformers itself by
``tests/test_chat_template.py``:

* an immutable Jinja sandbox with ``trim_blocks`` and ``lstrip_blocks`` on and the loop controls
  (``break``, ``continue``), plus the ``{% generation %}`` block, which renders its body unchanged
  (transformers uses it to find the assistant's tokens);
* ``raise_exception(message)`` (a ``TemplateError``), ``strftime_now(format)`` (local time now),
  ``dict`` and ``namespace`` (a namespace refuses names that begin with ``_``);
* a ``tojson`` filter that is ``json.dumps`` with its keyword options, not Jinja's own (which
  escapes HTML characters and sorts keys);
* the tokenizer's named special tokens (``bos_token`` ...) as variables, then the caller's
  keyword arguments over them;
* messages without their ``None``-valued keys, and a message's reasoning under every name
  templates read it by (``reasoning_content`` and ``thinking``, from ``reasoning`` too).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

# The special tokens transformers names (its tokenizers' SPECIAL_TOKENS_ATTRIBUTES): each one the
# tokenizer has is a template variable of that name.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Where a message's reasoning may be passed; the first present one fills the names templates read.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> Any:
    """The template compiled in the sandbox transformers renders chat templates in; a syntax error
    raises jinja2's ``TemplateSyntaxError``."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_block_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_template_namespace_class())
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                         documents: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
                         special_tokens: dict[str, str] | None = None, **template_kwargs: Any) -> str:
    """One conversation rendered to text; jinja2's exceptions (and the template's own
    ``raise_exception``) propagate as they do from transformers."""
    variables = {**(special_tokens or {}), **template_kwargs}
    chat = [_with_reasoning_aliases({key: value for key, value in message.items() if value is not None}) for message in messages]
    return compile_chat_template(template).render(messages=chat, tools=tools, documents=documents,
                                                  add_generation_prompt=add_generation_prompt, **variables)


def special_tokens(tokenizer_config: Any, special_tokens_map: Any = None) -> dict[str, str]:
    """The special tokens a tokenizer directory names, as transformers hands them to the template:
    ``tokenizer_config.json``'s (a string, or an added-token object's ``content``), its
    model-specific ones (``extra_special_tokens`` given as an object), and, for a legacy
    configuration without ``added_tokens_decoder``, ``special_tokens_map.json``'s over them.
    Either document may be absent or not a JSON object (it then names nothing)."""
    config = tokenizer_config if isinstance(tokenizer_config, dict) else {}
    extra = config.get("extra_special_tokens")
    names = NAMED_SPECIAL_TOKENS + tuple(extra) if isinstance(extra, dict) else NAMED_SPECIAL_TOKENS
    sources = [config, extra if isinstance(extra, dict) else {}]
    if "added_tokens_decoder" not in config and isinstance(special_tokens_map, dict):
        sources.append(special_tokens_map)
    tokens: dict[str, str] = {}
    for source in sources:
        for name in names:
            value = source.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens[name] = value
    return tokens


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """``dict`` for templates: builds dictionaries, exposes nothing of the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _template_namespace_class() -> type:
    """Jinja's ``namespace`` that refuses attribute names beginning with ``_`` (a template could
    otherwise reach the interpreter's internals through them)."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not set {name!r} (a name beginning with '_') on a namespace")

    class TemplateNamespace(Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature, so namespace(self=...) works
            namespace, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                refuse_private(name)
            Namespace.__init__(namespace, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            refuse_private(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


@lru_cache(maxsize=1)
def _generation_block_extension() -> type:
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's part of a
    template with it; rendering keeps the body as it is (a call block, so its scope is the same)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationBlock
