"""`fp4forge bytes`: where a checkpoint's bytes are, from its headers only."""

from __future__ import annotations

import sys
from typing import Optional


def register(app) -> None:
    import typer

    from fp4forge.audit.options import ByteTableOptions

    def bytes_command(
        location: str = typer.Argument(..., metavar="PATH_OR_REPO", help="Checkpoint directory, .safetensors file, HF repo id, or https://…/resolve/<rev> URL."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object: total, components, dtypes."),
        markdown: bool = typer.Option(False, "--markdown", help="A Markdown table, for model cards."),
        layout: Optional[str] = typer.Option(ByteTableOptions.layout, "--layout", help="Architecture layout when config.json is absent or unknown."),
    ) -> None:
        """Where the bytes are: stored bytes, parameters and bits/param per component, from headers only."""
        show_byte_table(location, as_json=as_json, markdown=markdown, layout=layout)

    app.command("bytes")(bytes_command)


def show_byte_table(location: str, as_json: bool = False, markdown: bool = False, layout: str | None = None) -> None:
    """The command itself (also run without typer by ``fp4forge.cli.fast``): rich (and the
    report tables) load only for the text and Markdown forms."""
    from fp4forge.audit.byte_table import byte_table_of
    from fp4forge.audit.options import ByteTableOptions
    from fp4forge.cli.common import console, emit_json

    table = byte_table_of(location, ByteTableOptions(layout=layout))
    if as_json:
        emit_json(table.to_json())
    elif markdown:
        from fp4forge.report.tables import byte_table_markdown

        sys.stdout.write(byte_table_markdown(table))
    else:
        from fp4forge.report.tables import byte_table_rich, fit_table

        out = console()
        for rich_table in byte_table_rich(table):
            out.print(fit_table(rich_table, out))
        if table.not_understood:
            out.print(f"headline: [bold]not understood[/bold] ({table.not_understood}); params count stored elements")
        else:
            out.print(f"headline [bold]{table.bpp or 0:.3f}[/bold] bits/param" + (f"; routed experts [bold]{table.experts_bpp:.3f}[/bold]" if table.experts_bpp else ""))
    if table.unknown_tensors:
        console(stderr=True).print(f"[yellow]warning:[/yellow] {len(table.unknown_tensors)} tensors match no component of layout {table.layout!r}, e.g. {table.unknown_tensors[:3]}")
    if table.layout_inferred and not as_json:
        console(stderr=True).print(f"[yellow]note:[/yellow] no layout table for this architecture: components were inferred from tensor names ({table.layout})")
