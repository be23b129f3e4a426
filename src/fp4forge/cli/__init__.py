"""`fp4forge` command line: a thin shell over library calls.

Every command prints a rich table for people and one JSON document with --json. Errors
fp4forge understands become one line on stderr and their exit code (fp4forge.errors.ExitCode).
Each command group lives in its own module, imported only when that command runs (or --help
lists it): ``import fp4forge.cli`` and ``fp4forge bytes`` never load the quality suite, the
benchmark stack or torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click
import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from fp4forge.cli.common import console, error_text
from fp4forge.errors import ExitCode, Fp4forgeError

# command name -> the module whose ``register(app)`` adds it, in the order --help lists them.
COMMAND_MODULES = {
    "testbed": "fp4forge.cli.testbed",
    "bytes": "fp4forge.cli.bytes",
    "quantize": "fp4forge.cli.quantize",
    "audit": "fp4forge.cli.audit",
    "diff": "fp4forge.cli.audit",
    "calibrate": "fp4forge.cli.calibrate",
    "kv": "fp4forge.cli.calibrate",
    "fidelity": "fp4forge.cli.calibrate",
    "pipeline": "fp4forge.cli.pipeline",
    "card": "fp4forge.cli.pipeline",
    "serve": "fp4forge.cli.serve",
    "bench": "fp4forge.cli.bench",
    "quality": "fp4forge.cli.quality",
    "frontier": "fp4forge.cli.study",
    "study": "fp4forge.cli.study",
}


class LazyCommands(TyperGroup):
    """The top-level group: a command's module is imported when the command is looked up."""

    _loaded: dict[str, click.Command] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(dict.fromkeys([*super().list_commands(ctx), *COMMAND_MODULES]))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None or name not in COMMAND_MODULES:
            return command
        if name not in self._loaded:
            holder = typer.Typer()
            importlib.import_module(COMMAND_MODULES[name]).register(holder)
            group = typer.main.get_group(holder)
            for sibling, module in COMMAND_MODULES.items():  # a module may register several commands
                if module == COMMAND_MODULES[name] and sibling in group.commands:
                    self._loaded[sibling] = group.commands[sibling]
        return self._loaded.get(name)


app = typer.Typer(cls=LazyCommands, no_args_is_help=True, add_completion=False, help="Make, prove and measure NVFP4 / FP8 MoE checkpoints.")


def _quiet_unless_rank0() -> None:
    """Under torchrun every rank runs the command; rank 0 alone prints its result
    (docs/distributed.md). Errors still reach stderr from every rank."""
    from fp4forge.model.distributed import speaks

    if not speaks():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


@app.callback()
def _root() -> None:
    """Make, prove and measure NVFP4 / FP8 MoE checkpoints."""


def main() -> None:
    err = console(stderr=True)
    try:
        _quiet_unless_rank0()
        # With standalone_mode=False, typer turns Ctrl-C into a returned 130 and click returns
        # other `Exit` codes instead of raising them.
        code: Any = app(standalone_mode=False)
        if code == ExitCode.INTERRUPTED:
            err.print("[red]interrupted[/red]: nothing half-written was left in place")
        if isinstance(code, int) and code:
            raise SystemExit(code)
    except Fp4forgeError as exc:
        err.print(f"[red]error:[/red] {error_text(exc)}", highlight=False)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]: nothing half-written was left in place")
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except (typer.Exit, click.exceptions.Exit) as exc:
        raise SystemExit(exc.exit_code) from None
    except (typer.Abort, click.exceptions.Abort):
        err.print("[red]aborted[/red]")
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except (TyperException, click.exceptions.ClickException) as exc:
        # Usage errors carry their own exit code (2). typer vendors its own click, whose
        # exceptions derive from TyperException, not from click's.
        exc.show()
        raise SystemExit(exc.exit_code) from None
