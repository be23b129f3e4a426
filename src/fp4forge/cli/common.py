"""What every `fp4forge` command module shares: the JSON document on stdout, rich consoles, the
progress bar, and the one-line error with its exit code. Kept free of heavy imports (rich only,
on use)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fp4forge.errors import Fp4forgeError

# Library option names (``Fp4forgeError.option``) whose flag is not ``--`` + the name with dashes.
FLAG_SPELLING = {
    "text_files": "--text",
    "builtin_corpus": "--no-builtin",
    "ram_budget_bytes": "--ram-budget-gb",
    "max_shard_bytes": "--max-shard-gb",
    "layout_format": "--format",
    "fmt": "--format",
    "ready_timeout_s": "--timeout",
    "workers": "--threads",
}


def flag_for(option: str) -> str:
    """How the command line spells the library option ``option`` (``stats`` -> ``--stats``)."""
    return FLAG_SPELLING.get(option, "--" + option.replace("_", "-"))


def error_text(error: object) -> str:
    """An error's one line, options spelled as flags."""
    return error.describe(flag_for) if isinstance(error, Fp4forgeError) else str(error)


def emit_json(doc: object) -> None:
    """The command's one JSON document on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True, highlight=False)


def fail(message: object, code: int, as_json: bool = False, **context: object) -> SystemExit:
    """An error fp4forge understands: one line on stderr (and ``{..., "error"}`` on stdout with
    --json); ``raise`` the returned SystemExit to exit with ``code``."""
    text = error_text(message)
    if as_json:
        emit_json({**context, "error": text})
    console(stderr=True).print(f"[red]error:[/red] {text}")
    return SystemExit(code)


@contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator:
    """Yields a `progress(done, total, desc)` callback drawing a rich bar on stderr (None when
    not ``enabled``, e.g. under --json)."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, desc: str = description) -> None:
            bar.update(task, completed=done, total=total, description=desc)

        yield update
