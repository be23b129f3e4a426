"""`fp4forge` command line: a thin shell over library calls.

Every command prints a rich table for people and one JSON document with --json. Errors
fp4forge understands become one line on stderr and their exit code (fp4forge.errors.ExitCode).
Each command group lives in its own module, imported only when that command runs (or --help
lists it): ``import fp4forge.cli`` and ``fp4forge bytes`` never load the quality suite, the
benchmark stack or torch. A plain ``fp4forge bytes`` command line does not even load typer or
rich (``fp4forge.cli.fast``); anything else (``--help``, a mistyped option) goes through the
typer application (``fp4forge.cli.typer_app``, also reachable as ``fp4forge.cli.app``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fp4forge.cli.commands import COMMAND_MODULES
from fp4forge.cli.common import console, error_text
from fp4forge.errors import ExitCode, Fp4forgeError

__all__ = ["COMMAND_MODULES", "main"]


def __getattr__(name: str) -> Any:
    # PEP 562: the typer application is built on first use (a fast path never builds it).
    if name == "app":
        from fp4forge.cli.typer_app import app

        globals()["app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _quiet_unless_rank0() -> None:
    """Under torchrun every rank runs the command; rank 0 alone prints its result
    (docs/distributed.md). Errors still reach stderr from every rank."""
    if "WORLD_SIZE" not in os.environ:  # not launched: spares importing the launcher's module
        return
    from fp4forge.model.distributed import speaks

    if not speaks():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def main() -> None:
    try:
        _quiet_unless_rank0()
        from fp4forge.cli.fast import fast_call

        call = fast_call(sys.argv[1:])
        if call is not None:
            call()
        else:
            _run_app()
    except Fp4forgeError as exc:
        console(stderr=True).print(f"[red]error:[/red] {error_text(exc)}", highlight=False)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        console(stderr=True).print("[red]interrupted[/red]: nothing half-written was left in place")
        raise SystemExit(ExitCode.INTERRUPTED) from None


def _run_app() -> None:
    """The command line through the typer application; its own exceptions become exit codes."""
    import click
    import typer
    from typer.exceptions import TyperException

    application = __getattr__("app") if "app" not in globals() else globals()["app"]
    try:
        # With standalone_mode=False, typer turns Ctrl-C into a returned 130 and click returns
        # other `Exit` codes instead of raising them.
        code: Any = application(standalone_mode=False)
        if code == ExitCode.INTERRUPTED:
            console(stderr=True).print("[red]interrupted[/red]: nothing half-written was left in place")
        if isinstance(code, int) and code:
            raise SystemExit(code)
    except (typer.Exit, click.exceptions.Exit) as exc:
        raise SystemExit(exc.exit_code) from None
    except (typer.Abort, click.exceptions.Abort):
        console(stderr=True).print("[red]aborted[/red]")
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except (TyperException, click.exceptions.ClickException) as exc:
        # Usage errors carry their own exit code (2). typer vendors its own click, whose
        # exceptions derive from TyperException, not from click's.
        exc.show()
        raise SystemExit(exc.exit_code) from None
