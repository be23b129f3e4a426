"""The JSON files of a checkpoint (safetensors headers, the index, config.json) decoded with one
named reason for every way they can fail.

``json.loads`` fails in more ways than ``JSONDecodeError``: deep nesting raises ``RecursionError``,
an integer of more than 4,300 digits a plain ``ValueError``; and it accepts ``\\ud800``, a lone
surrogate that no UTF-8 writer can encode (the safetensors library refuses it; printing such a
tensor name crashes later). Hostile or damaged files hit all of these.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A \\u escape of a UTF-16 surrogate (D800-DFFF): only then can a decoded string hold a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


class JsonTextError(ValueError):
    """Why bytes are not a usable JSON document, in one line (``reason``)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def load_json(raw: bytes | str) -> Any:
    """Decode UTF-8 JSON text; raise :class:`JsonTextError` naming the first problem."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonTextError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    else:
        text = raw
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonTextError(f"not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise JsonTextError("not usable JSON (nested too deeply)") from None
    except ValueError as exc:  # int() of a number with more digits than Python converts
        raise JsonTextError(f"not usable JSON (a number too long to read: {str(exc).split(';')[0]})") from None
    if "\\" in text and _SURROGATE_ESCAPE.search(text) and _holds_lone_surrogate(doc):  # no backslash: no escape
        raise JsonTextError("not valid JSON text (a string holds a lone UTF-16 surrogate, which UTF-8 cannot encode)")
    return doc


def _holds_lone_surrogate(doc: Any) -> bool:
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False
