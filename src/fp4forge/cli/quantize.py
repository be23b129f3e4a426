"""`fp4forge quantize`: a BF16 checkpoint to NVFP4 / FP8 by a recipe, streamed and resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fp4forge.cli.common import console, emit_json, progress_bar


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize_command)


def quantize_command(
    src: str = typer.Argument(..., metavar="SRC", help="BF16 checkpoint (directory, repo id or URL)."),
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create (appears only when complete)."),
    recipe: str = typer.Option(..., "--recipe", help="Built-in recipe name or a recipe .toml file."),
    layout_format: str = typer.Option("compressed-tensors", "--format", help="compressed-tensors | modelopt"),
    stats: Optional[Path] = typer.Option(None, "--stats", help="Calibration statistics (fp4forge calibrate)."),
    act_scales: Optional[str] = typer.Option(None, "--act-scales", help="constant:AMAX — an explicit, uncalibrated activation amax."),
    block_scales: str = typer.Option("minmax", "--block-scales", help="minmax (identical to the references) | four_over_six | mse"),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb"),
    device: Optional[str] = typer.Option(None, "--device", help="auto (default: CUDA when available, else CPU) | cpu | cuda | cuda:N; the bytes written are the same."),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="Compute threads (default: every core); one more thread reads ahead. Output bytes do not depend on it."
    ),
    error_report: bool = typer.Option(
        True, "--error-report/--no-error-report", help="Per-Linear relative weight error in the summary and provenance (about a third of the NVFP4 arithmetic)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Quantize a BF16 MoE checkpoint by a recipe, streaming one fused group at a time (resumable)."""
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.report.tables import quantize_summary_rich

    options = QuantizeOptions(
        recipe=load_recipe(recipe),
        layout_format=layout_format,
        block_scales=block_scales,
        act_amax=parse_act_scales(act_scales, stats),
        max_shard_bytes=int(max_shard_gb * 2**30),
        device=device,
        error_report=error_report,
        **({} if threads is None else {"workers": threads}),
    )
    with progress_bar("quantizing", not as_json) as progress:
        summary = quantize_checkpoint(src, out_dir, options, progress=progress)
    if as_json:
        emit_json(summary.to_json())
    else:
        console().print(quantize_summary_rich(summary))
