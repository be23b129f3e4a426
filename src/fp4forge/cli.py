"""`fp4forge` command line: a thin shell over library calls.

Every command prints a rich table for people and one JSON document with --json. Errors
fp4forge understands become one line on stderr and a non-zero exit code; heavy imports
(torch, transformers) happen inside the commands that need them.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fp4forge.cli_common import emit_json
from fp4forge.errors import Fp4forgeError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Make, prove and measure NVFP4 / FP8 MoE checkpoints.")
testbed_app = typer.Typer(no_args_is_help=True, help="Build local test models (no internet needed).")
app.add_typer(testbed_app, name="testbed")

out = Console()
err = Console(stderr=True, soft_wrap=True)




@contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator:
    """Yields a `progress(done, total, desc)` callback drawing a rich bar on stderr."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, desc: str = description) -> None:
            bar.update(task, completed=done, total=total, description=desc)

        yield update


# -- testbed ------------------------------------------------------------------------------
@testbed_app.command("tiny-laguna")
def testbed_tiny_laguna(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create."),
    seed: int = typer.Option(0, help="Seed: the same seed gives byte-identical files."),
    dense: bool = typer.Option(False, "--dense", help="Every layer a dense MLP (stock vLLM CPU can serve it)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """A tiny random LagunaForCausalLM: dense layer 0, sigmoid-routed MoE with shared expert, mixed attention."""
    from fp4forge.testbed import build_tiny_laguna

    with progress_bar("building tiny Laguna", not as_json) as progress:
        path = build_tiny_laguna(out_dir, seed=seed, dense=dense, progress=progress)
    _report_built(path, as_json)


@testbed_app.command("tiny-qwen3-moe")
def testbed_tiny_qwen3_moe(
    out_dir: Path = typer.Argument(..., metavar="OUT"),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A tiny random Qwen3MoeForCausalLM (softmax routing), same tokenizer as the tiny Laguna."""
    from fp4forge.testbed import build_tiny_qwen3_moe

    with progress_bar("building tiny Qwen3-MoE", not as_json) as progress:
        path = build_tiny_qwen3_moe(out_dir, seed=seed, progress=progress)
    _report_built(path, as_json)


@testbed_app.command("synth")
def testbed_synth(
    out_dir: Path = typer.Argument(..., metavar="OUT"),
    config: str = typer.Option(..., "--config", help="A config.json path or a preset name (e.g. laguna-s-2.1-like)."),
    layers: int = typer.Option(..., "--layers", min=1, help="Decoder layers to write (the first N)."),
    seed: int = typer.Option(0),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", help="Shard size limit in GiB."),
    sparse: bool = typer.Option(False, "--sparse", help="Headers only; data regions are file holes."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A shape-true synthetic checkpoint: real names, shapes and dtypes, seeded heavy-tailed values, streamed."""
    from fp4forge.testbed import synth_checkpoint

    with progress_bar("writing synthetic checkpoint", not as_json) as progress:
        path = synth_checkpoint(config, layers, out_dir, seed=seed, max_shard_bytes=int(max_shard_gb * 2**30), sparse=sparse, progress=progress)
    _report_built(path, as_json)


def _report_built(path: Path, as_json: bool) -> None:
    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    if as_json:
        emit_json({"path": str(path), "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files]})
    else:
        out.print(f"[green]wrote[/green] {path} ({len(files)} files, {sum(p.stat().st_size for p in files):,} bytes)")


# -- bytes ---------------------------------------------------------------------------------
@app.command("bytes")
def bytes_command(
    location: str = typer.Argument(..., metavar="PATH_OR_REPO", help="Checkpoint directory, .safetensors file, HF repo id, or https://…/resolve/<rev> URL."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: total, components, dtypes."),
    markdown: bool = typer.Option(False, "--markdown", help="A Markdown table, for model cards."),
    layout: Optional[str] = typer.Option(None, "--layout", help="Architecture layout when config.json is absent or unknown."),
) -> None:
    """Where the bytes are: stored bytes, parameters and bits/param per component, from headers only."""
    from fp4forge.audit.byte_table import compute_byte_table
    from fp4forge.checkpoint.layout import layout_by_name, layout_for_config
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.report.tables import byte_table_markdown, byte_table_rich

    ckpt = open_checkpoint(location)
    chosen = layout_by_name(layout) if layout else layout_for_config(ckpt.config)
    table = compute_byte_table(ckpt, chosen)
    if as_json:
        emit_json(table.to_json())
    elif markdown:
        sys.stdout.write(byte_table_markdown(table))
    else:
        for rich_table in byte_table_rich(table):
            out.print(rich_table)
        out.print(f"headline [bold]{table.bpp or 0:.3f}[/bold] bits/param" + (f"; routed experts [bold]{table.experts_bpp:.3f}[/bold]" if table.experts_bpp else ""))
    if table.unknown_tensors:
        err.print(f"[yellow]warning:[/yellow] {len(table.unknown_tensors)} tensors match no component of layout {chosen.name!r}, e.g. {table.unknown_tensors[:3]}")


# -- quantize --------------------------------------------------------------------------------
@app.command("quantize")
def quantize_command(
    src: str = typer.Argument(..., metavar="SRC", help="BF16 checkpoint (directory, repo id or URL)."),
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create (appears only when complete)."),
    recipe: str = typer.Option(..., "--recipe", help="Built-in recipe name or a recipe .toml file."),
    layout_format: str = typer.Option("compressed-tensors", "--format", help="compressed-tensors | modelopt"),
    stats: Optional[Path] = typer.Option(None, "--stats", help="Calibration statistics (fp4forge calibrate)."),
    act_scales: Optional[str] = typer.Option(None, "--act-scales", help="constant:AMAX — an explicit, uncalibrated activation amax."),
    block_scales: str = typer.Option("minmax", "--block-scales", help="minmax (identical to the references) | four_over_six | mse"),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Quantize a BF16 MoE checkpoint by a recipe, streaming one fused group at a time (resumable)."""
    from fp4forge.errors import ConfigError
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.report.tables import quantize_summary_rich

    if layout_format not in ("compressed-tensors", "modelopt"):
        raise ConfigError(f"--format must be compressed-tensors or modelopt, got {layout_format!r}")
    if block_scales not in ("minmax", "four_over_six", "mse"):
        raise ConfigError(f"--block-scales must be minmax, four_over_six or mse, got {block_scales!r}")
    options = QuantizeOptions(
        recipe=load_recipe(recipe),
        layout_format=layout_format,
        block_scales=block_scales,
        act_amax=parse_act_scales(act_scales, stats),
        max_shard_bytes=int(max_shard_gb * 2**30),
    )
    with progress_bar("quantizing", not as_json) as progress:
        summary = quantize_checkpoint(src, out_dir, options, progress=progress)
    if as_json:
        emit_json(summary.to_json())
    else:
        out.print(quantize_summary_rich(summary))


def _register_subcommands() -> None:
    """Commands that live beside their library layer (each module adds itself to the app)."""
    from fp4forge import cli_audit, cli_bench, cli_calibrate, cli_pipeline, cli_quality, cli_serve

    cli_audit.register(app)
    cli_calibrate.register(app)
    cli_serve.register(app)
    cli_bench.register(app)
    cli_quality.register(app)
    cli_pipeline.register(app)


_register_subcommands()


def _register_testbed_subcommands() -> None:
    from fp4forge import cli_trained

    cli_trained.register(testbed_app)


_register_testbed_subcommands()


def main() -> None:
    try:
        # With standalone_mode=False, typer turns Ctrl-C into a returned 130 and click returns
        # other `Exit` codes instead of raising them.
        code = app(standalone_mode=False)
        if code == 130:
            err.print("[red]interrupted[/red]: nothing half-written was left in place")
        if isinstance(code, int) and code:
            raise SystemExit(code)
    except Fp4forgeError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]: nothing half-written was left in place")
        raise SystemExit(130) from None
    except Exception as exc:  # click usage errors carry their own exit codes
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            raise SystemExit(exc.exit_code) from None
        if isinstance(exc, click.exceptions.Exit):
            raise SystemExit(exc.exit_code) from None
        if isinstance(exc, click.exceptions.Abort):
            err.print("[red]aborted[/red]")
            raise SystemExit(130) from None
        raise


if __name__ == "__main__":
    main()
