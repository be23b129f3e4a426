"""What every `fp4forge` command module shares: the JSON document on stdout, rich consoles, and the
one-line error with its exit code. Kept free of heavy imports (rich only, on use)."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(doc: object) -> None:
    """The command's one JSON document on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True, highlight=False)


def error_text(error: BaseException) -> str:
    """A library error's message, followed by the flag of the option it is about (``option="out"``
    is ``--out`` here: library errors name options, never this CLI's spelling)."""
    option = getattr(error, "option", None)
    return f"{error} (--{option.replace('_', '-')})" if option else str(error)


def fail(message: object, code: int, as_json: bool = False, **context: object) -> SystemExit:
    """An error fp4forge understands: one line on stderr (and ``{..., "error"}`` on stdout with
    --json); ``raise`` the returned SystemExit to exit with ``code``. An exception as ``message``
    is shown with ``error_text``."""
    if isinstance(message, BaseException):
        message = error_text(message)
    if as_json:
        emit_json({**context, "error": str(message)})
    console(stderr=True).print(f"[red]error:[/red] {message}")
    return SystemExit(code)
