"""The typer application behind ``fp4forge``: the top-level group, whose command modules are
imported only when a command is looked up (or --help lists them). Built on first use of
``fp4forge.cli.app`` or when ``fp4forge.cli.main`` needs it; the fast paths of
``fp4forge.cli.fast`` do not import it."""

from __future__ import annotations

import importlib

import click
import typer
from typer.core import TyperGroup

from fp4forge.cli.commands import COMMAND_MODULES


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


def _print_version(asked: bool) -> None:
    if asked:
        from fp4forge import __version__

        typer.echo(f"fp4forge {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True, help="Print fp4forge's version and exit."),
) -> None:
    """Make, prove and measure NVFP4 / FP8 MoE checkpoints."""
