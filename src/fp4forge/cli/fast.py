"""Fast paths: a plain command line of a header-only command, run without building the typer
application (typer coerces option values through pydantic; importing both costs more than
reading the headers of a large checkpoint).

A fast path takes only the unambiguous spellings: its positional arguments, each flag at most
once, each value option at most once as ``--opt VALUE`` with a value not starting with ``-``.
Anything else (``--help``, ``--opt=VALUE``, a repeated or unknown option, a missing argument)
returns None and goes through typer, which prints its usual help or usage error; a fast path
calls the same function with the same values the typer command would.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FastCommand:
    module: str  # imported only when the command runs
    function: str  # called with the positionals, then the options as keywords
    positionals: int
    flags: dict[str, str] = field(default_factory=dict)  # --flag -> keyword (True when given, else False)
    values: dict[str, str] = field(default_factory=dict)  # --option -> keyword (its value, else None)


FAST_COMMANDS = {
    "bytes": FastCommand("fp4forge.cli.bytes", "show_byte_table", 1, flags={"--json": "as_json", "--markdown": "markdown"}, values={"--layout": "layout"}),
    "audit": FastCommand(
        "fp4forge.cli.audit_run", "run_audit", 1,
        flags={"--json": "as_json", "--markdown": "markdown", "--deep": "deep", "--trust-remote-code": "trust_remote_code", "--list-rules": "list_rules"},
        values={"--format": "fmt", "--vllm-version": "vllm_version", "--device": "device"},
    ),
}


def fast_call(argv: list[str]) -> Callable[[], None] | None:
    """The call a command line maps to, when it is one a fast path takes; else None."""
    command = FAST_COMMANDS.get(argv[0]) if argv else None
    if command is None:
        return None
    keywords: dict[str, object] = {**dict.fromkeys(command.flags.values(), False), **dict.fromkeys(command.values.values())}
    positionals: list[str] = []
    seen: set[str] = set()
    rest = iter(argv[1:])
    for token in rest:
        if token in seen:
            return None
        if token in command.flags:
            keywords[command.flags[token]] = True
        elif token in command.values:
            value = next(rest, None)
            if value is None or value.startswith("-"):
                return None
            keywords[command.values[token]] = value
        elif token and not token.startswith("-"):
            positionals.append(token)
            continue
        else:
            return None
        seen.add(token)
    if len(positionals) != command.positionals:
        return None
    function = getattr(importlib.import_module(command.module), command.function)
    return lambda: function(*positionals, **keywords)
