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
    method: str = typer.Option("rtn", "--method", help="rtn (round to nearest by --block-scales) | gptq (calibrated rounding of the NVFP4 Linears)."),
    calib_samples: int = typer.Option(64, "--calib-samples", min=1, help="GPTQ: calibration samples (rows of --calib-seq-len tokens)."),
    calib_seq_len: int = typer.Option(512, "--calib-seq-len", min=2, help="GPTQ: tokens per calibration sample."),
    calib_text: list[Path] = typer.Option([], "--calib-text", help="GPTQ: calibration text (.jsonl or plain); repeatable."),
    calib_no_builtin: bool = typer.Option(False, "--calib-no-builtin", help="GPTQ: only --calib-text, not the built-in corpus."),
    gptq_expert_hessian: str = typer.Option("routed", "--gptq-expert-hessian", help="routed (each expert's own routed tokens) | all (every token through every expert)."),
    gptq_min_tokens: int = typer.Option(64, "--gptq-min-tokens", min=0, help="Experts with fewer routed tokens take the fallback."),
    gptq_fallback: str = typer.Option("pooled", "--gptq-fallback", help="pooled (the layer's pooled expert Hessian) | rtn (round to nearest)."),
    gptq_act_order: bool = typer.Option(False, "--gptq-act-order", help="Quantize columns in decreasing Hessian diagonal."),
    gptq_damp: float = typer.Option(0.01, "--gptq-damp", help="Relative damping of the Hessian diagonal."),
    gptq_sequential: bool = typer.Option(False, "--gptq-sequential", help="Calibrate each layer on the outputs of the already-rounded layers before it (two forwards per layer)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Quantize a BF16 MoE checkpoint by a recipe, streaming one fused group at a time (resumable)."""
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.errors import ConfigError
    from fp4forge.report.tables import quantize_summary_rich

    if method not in ("rtn", "gptq"):
        raise ConfigError(f"must be rtn or gptq, got {method!r}", option="method")
    loaded_recipe = load_recipe(recipe)
    precomputed = None
    if method == "gptq":
        from fp4forge.calibrate.gptq import GptqOptions, gptq_weights
        from fp4forge.calibrate.run import CalibrationOptions

        gptq_options = GptqOptions(
            calibration=CalibrationOptions(samples=calib_samples, seq_len=calib_seq_len, text_files=tuple(calib_text), builtin_corpus=not calib_no_builtin),
            expert_hessian=gptq_expert_hessian,
            min_expert_tokens=gptq_min_tokens,
            fallback=gptq_fallback,
            act_order=gptq_act_order,
            damp=gptq_damp,
            sequential=gptq_sequential,
            block_scales=block_scales,  # type: ignore[arg-type]  # GPTQ fixes minmax or mse scales before its sweep
        )
        with progress_bar("GPTQ", not as_json) as progress:
            precomputed = gptq_weights(src, loaded_recipe, gptq_options, progress=progress)
    options = QuantizeOptions(
        recipe=loaded_recipe,
        layout_format=layout_format,
        block_scales=block_scales,
        act_amax=parse_act_scales(act_scales, stats),
        max_shard_bytes=int(max_shard_gb * 2**30),
        device=device,
        error_report=error_report,
        **({} if threads is None else {"workers": threads}),
        precomputed=precomputed,
    )
    with progress_bar("quantizing", not as_json) as progress:
        summary = quantize_checkpoint(src, out_dir, options, progress=progress)
    if as_json:
        emit_json({**summary.to_json(), **({"gptq": precomputed.summary()} if precomputed is not None else {})})
    else:
        console().print(quantize_summary_rich(summary))
