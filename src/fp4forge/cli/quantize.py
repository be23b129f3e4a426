"""`fp4forge quantize`: a BF16 checkpoint to NVFP4 / FP8 by a recipe, streamed and resumable
(the quantize job, :mod:`fp4forge.quantize.job`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from fp4forge.cli.common import console, emit_json, progress_bar, spelled
from fp4forge.errors import option_path
from fp4forge.model.samples import SampleOptions
from fp4forge.quantize.job import GptqOptions, QuantizeJob

# The job's option paths whose flag is not the usual spelling (fp4forge.cli.common.flag_for).
FLAGS = {
    "gptq.calibration.samples": "--calib-samples",
    "gptq.calibration.seq_len": "--calib-seq-len",
    "gptq.calibration.text_files": "--calib-text",
    "gptq.calibration.builtin_corpus": "--calib-no-builtin",
    "gptq.calibration.tokenizer": "--calib-tokenizer",
    "gptq.min_expert_tokens": "--gptq-min-tokens",
    "max_shard_bytes": "--max-shard-gb",
}


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize_command)


def quantize_job(calibration: dict[str, Any], gptq: dict[str, Any], **job: Any) -> QuantizeJob:
    """The quantize job from the command line (the one place it makes one: quantize, pipeline):
    GPTQ's text and settings, then the job's own options, each named by its path when refused."""
    with option_path("gptq.calibration", SampleOptions):
        samples = SampleOptions(**calibration)
    with option_path("gptq", GptqOptions):
        settings = GptqOptions(calibration=samples, **gptq)
    return QuantizeJob(gptq=settings, **job)


def quantize_command(
    src: str = typer.Argument(..., metavar="SRC", help="BF16 checkpoint (directory, repo id or URL)."),
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create (appears only when complete)."),
    recipe: str = typer.Option(..., "--recipe", help="Built-in recipe name or a recipe .toml file."),
    layout_format: str = typer.Option(QuantizeJob.layout_format, "--format", help="compressed-tensors | modelopt"),
    stats: Optional[Path] = typer.Option(None, "--stats", help="Calibration statistics (fp4forge calibrate)."),
    act_scales: Optional[str] = typer.Option(None, "--act-scales", help="constant:AMAX — an explicit, uncalibrated activation amax."),
    block_scales: str = typer.Option(QuantizeJob.block_scales, "--block-scales", help="minmax (identical to the references) | four_over_six | mse"),
    max_shard_gb: float = typer.Option(QuantizeJob.max_shard_bytes / 2**30, "--max-shard-gb"),
    device: Optional[str] = typer.Option(None, "--device", help="auto (default: CUDA when available, else CPU) | cpu | cuda | cuda:N; the bytes written are the same."),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="Compute threads (default: every core); one more thread reads ahead. Output bytes do not depend on it."
    ),
    error_report: bool = typer.Option(
        QuantizeJob.error_report, "--error-report/--no-error-report", help="Per-Linear relative weight error in the summary and provenance (about a third of the NVFP4 arithmetic)."
    ),
    method: str = typer.Option(QuantizeJob.method, "--method", help="rtn (round to nearest by --block-scales) | gptq (calibrated rounding of the NVFP4 Linears)."),
    calib_samples: int = typer.Option(SampleOptions.samples, "--calib-samples", help="GPTQ: calibration samples (rows of --calib-seq-len tokens)."),
    calib_seq_len: int = typer.Option(SampleOptions.seq_len, "--calib-seq-len", help="GPTQ: tokens per calibration sample."),
    calib_text: list[Path] = typer.Option([], "--calib-text", help="GPTQ: calibration text (.jsonl or plain); repeatable."),
    calib_no_builtin: bool = typer.Option(False, "--calib-no-builtin", help="GPTQ: only --calib-text, not the built-in corpus."),
    calib_tokenizer: Optional[Path] = typer.Option(None, "--calib-tokenizer", help="GPTQ: tokenizer directory (default: the checkpoint's)."),
    gptq_expert_hessian: str = typer.Option(GptqOptions.expert_hessian, "--gptq-expert-hessian", help="routed (each expert's own routed tokens) | all (every token through every expert)."),
    gptq_min_tokens: int = typer.Option(GptqOptions.min_expert_tokens, "--gptq-min-tokens", help="Experts with fewer routed tokens take the fallback."),
    gptq_fallback: str = typer.Option(GptqOptions.fallback, "--gptq-fallback", help="pooled (the layer's pooled expert Hessian) | rtn (round to nearest)."),
    gptq_act_order: bool = typer.Option(GptqOptions.act_order, "--gptq-act-order", help="Quantize columns in decreasing Hessian diagonal."),
    gptq_damp: float = typer.Option(GptqOptions.damp, "--gptq-damp", help="Relative damping of the Hessian diagonal."),
    gptq_sequential: bool = typer.Option(GptqOptions.sequential, "--gptq-sequential", help="Calibrate each layer on the outputs of the already-rounded layers before it (two forwards per layer)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Quantize a BF16 MoE checkpoint by a recipe, streaming one fused group at a time (resumable)."""
    from fp4forge.quantize.job import run_quantize
    from fp4forge.report.tables import quantize_summary_rich

    with spelled(FLAGS):
        calibration = dict(samples=calib_samples, seq_len=calib_seq_len, text_files=tuple(calib_text), builtin_corpus=False if calib_no_builtin else None,
                           tokenizer=calib_tokenizer)
        gptq = dict(expert_hessian=gptq_expert_hessian, min_expert_tokens=gptq_min_tokens, fallback=gptq_fallback, act_order=gptq_act_order,
                    damp=gptq_damp, sequential=gptq_sequential)
        job = quantize_job(calibration, gptq, recipe=recipe, layout_format=layout_format, block_scales=block_scales, stats=stats,
                           act_scales=act_scales, max_shard_bytes=int(max_shard_gb * 2**30), device=device, threads=threads,
                           error_report=error_report, method=method)
        with progress_bar("quantizing", not as_json) as progress:
            result = run_quantize(src, out_dir, job, progress=progress)
    if as_json:
        emit_json(result.to_json())
    else:
        console().print(quantize_summary_rich(result.export))
