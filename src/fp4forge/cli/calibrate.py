"""`fp4forge calibrate`, `fp4forge kv calibrate|transplant|show` and `fp4forge fidelity`.

``register(app)`` adds them to the main Typer app. Like the other commands: a rich table for
people, one JSON document with --json, fp4forge errors as one line and an exit code; torch and
transformers are imported inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fp4forge.cli.common import console, emit_json, progress_bar
from fp4forge.errors import ExitCode

CALIBRATION_DEFAULTS = {"samples": 64, "seq_len": 512, "batch_size": 4}


def _calibration_options(samples: int, seq_len: int, batch_size: int, policy: str, text: list[Path], no_builtin: bool, tokenizer: Optional[Path], ram_budget_gb: float, spill_dir: Optional[Path],
                         device: Optional[str] = None, activation_budget: Optional[str] = None):
    """The flags as the library's options (which validate themselves)."""
    from fp4forge.calibrate.run import CalibrationOptions
    from fp4forge.cli.common import parse_bytes

    return CalibrationOptions(
        samples=samples,
        seq_len=seq_len,
        batch_size=batch_size,
        policy=policy,
        text_files=tuple(text),
        builtin_corpus=not no_builtin,
        tokenizer=tokenizer,
        ram_budget_bytes=int(ram_budget_gb * 2**30),
        spill_dir=spill_dir,
        device=device,
        activation_budget_bytes=parse_bytes(activation_budget, "activation_budget_bytes"),
    )


def _ui():
    """(emit_json, console for stdout, progress_bar)."""
    return emit_json, console(), progress_bar


def register(app: typer.Typer) -> None:
    """Add calibrate, kv (calibrate / transplant / show) and fidelity to ``app``."""
    kv_app = typer.Typer(no_args_is_help=True, help="FP8 KV-cache scales: calibrate, transplant, show.")
    app.add_typer(kv_app, name="kv")

    samples_opt = typer.Option(CALIBRATION_DEFAULTS["samples"], "--samples", min=1, help="Calibration samples (rows of --seq-len tokens).")
    seq_len_opt = typer.Option(CALIBRATION_DEFAULTS["seq_len"], "--seq-len", min=2, help="Tokens per sample (texts are packed, never padded).")
    batch_opt = typer.Option(CALIBRATION_DEFAULTS["batch_size"], "--batch-size", min=1, help="Samples per forward.")
    policy_opt = typer.Option("routed", "--policy", help="MoE coverage: routed (the router's tokens) | all-experts (every token through every expert).")
    text_opt = typer.Option([], "--text", help="Extra text: .jsonl ({'messages': [...]} or {'text': ...}) or plain text; repeatable.")
    no_builtin_opt = typer.Option(False, "--no-builtin", help="Use only --text files, not the built-in stdlib corpus.")
    tokenizer_opt = typer.Option(None, "--tokenizer", help="Tokenizer directory (default: the checkpoint's).")
    ram_opt = typer.Option(4.0, "--ram-budget-gb", help="Activations kept in RAM up to this; the rest spills to disk.")
    spill_opt = typer.Option(None, "--spill-dir", help="Where spilled activations go (default: the temp dir).")
    device_opt = typer.Option(None, "--device", help="auto (default: CUDA when available, else CPU) | cpu | cuda | cuda:N.")
    activation_opt = typer.Option(None, "--activation-budget", help="Activations kept on the device, e.g. 8GiB (default: 8GiB on CUDA, 0 on CPU); the rest moves to RAM.")

    @app.command("calibrate")
    def calibrate_command(
        src: str = typer.Argument(..., metavar="SRC", help="BF16 checkpoint directory."),
        stats_out: Path = typer.Option(..., "--out", help="Statistics file to write (.safetensors)."),
        samples: int = samples_opt,
        seq_len: int = seq_len_opt,
        batch_size: int = batch_opt,
        policy: str = policy_opt,
        text: list[Path] = text_opt,
        no_builtin: bool = no_builtin_opt,
        tokenizer: Optional[Path] = tokenizer_opt,
        ram_budget_gb: float = ram_opt,
        spill_dir: Optional[Path] = spill_opt,
        device: Optional[str] = device_opt,
        activation_budget: Optional[str] = activation_opt,
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Activation and KV amax from data, one decoder layer in memory at a time (for quantize --stats)."""
        emit_json, out, progress_bar = _ui()
        from fp4forge.calibrate.run import calibrate_to_file
        from fp4forge.report.calibrate_tables import calibration_rich

        options = _calibration_options(samples, seq_len, batch_size, policy, text, no_builtin, tokenizer, ram_budget_gb, spill_dir, device, activation_budget)
        with progress_bar("calibrating", not as_json) as progress:
            summary = calibrate_to_file(src, stats_out, options, progress=progress)
        if as_json:
            emit_json(summary)
        else:
            out.print(calibration_rich(summary, str(stats_out)))

    @kv_app.command("calibrate")
    def kv_calibrate_command(
        source: Path = typer.Argument(..., metavar="SRC_OR_STATS", help="A statistics file, or the BF16 checkpoint to calibrate now."),
        into: Path = typer.Option(..., "--into", help="Checkpoint directory that receives model-kvscales.safetensors (updated atomically)."),
        layout_format: Optional[str] = typer.Option(None, "--format", help="compressed-tensors | modelopt, for a checkpoint that declares no quantization yet."),
        per_head: bool = typer.Option(False, "--per-head", help="One scale per KV head (compressed-tensors attn_head)."),
        samples: int = samples_opt,
        seq_len: int = seq_len_opt,
        batch_size: int = batch_opt,
        text: list[Path] = text_opt,
        no_builtin: bool = no_builtin_opt,
        tokenizer: Optional[Path] = tokenizer_opt,
        device: Optional[str] = device_opt,
        activation_budget: Optional[str] = activation_opt,
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """k_scale = k_amax / 448, v_scale = v_amax / 448, written into a checkpoint with its declaration."""
        emit_json, out, progress_bar = _ui()
        from fp4forge.calibrate import kv

        calibration = _calibration_options(samples, seq_len, batch_size, "routed", text, no_builtin, tokenizer, 4.0, None, device, activation_budget)
        with progress_bar("calibrating", not as_json and not kv.is_stats_file(source)) as progress:
            provenance = kv.calibrate_kv(source, into, layout_format=layout_format, per_head=per_head, calibration=calibration, progress=progress)
        if as_json:
            emit_json({"checkpoint": str(into), **provenance})
        else:
            out.print(f"[green]wrote[/green] {provenance['tensors']} KV scales for {provenance['layers']} layers into {into}/{kv.KV_SHARD} ({provenance['layout']})")

    @kv_app.command("transplant")
    def kv_transplant_command(
        donor: Path = typer.Option(..., "--donor", help="Checkpoint of the same base model that carries KV scales."),
        into: Path = typer.Option(..., "--into", help="Checkpoint that lacks them."),
        out_dir: Path = typer.Option(..., "--out", help="New checkpoint directory to create."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Copy KV scales from a donor of the same model (names and dtypes converted; recorded as an approximation)."""
        emit_json, out, progress_bar = _ui()
        from fp4forge.calibrate import kv

        provenance = kv.transplant(donor, into, out_dir)
        if as_json:
            emit_json({"checkpoint": str(out_dir), **provenance})
        else:
            out.print(f"[green]wrote[/green] {out_dir}: {provenance['tensors']} KV scales from {donor} ({provenance['donor_layout']} → {provenance['layout']}), recorded as an approximation")

    @kv_app.command("show")
    def kv_show_command(
        location: str = typer.Argument(..., metavar="CKPT"),
        as_json: bool = typer.Option(False, "--json", help='{"layout", "layers": [{"layer", "k_scale", "v_scale", ...}], "findings": [...]}'),
    ) -> None:
        """Per-layer k/v scales and the amax they imply; flags constant 1.0, amax > 448, missing layers. Exit 1 on errors."""
        emit_json, out, progress_bar = _ui()
        from fp4forge.calibrate import kv
        from fp4forge.report.calibrate_tables import kv_rich

        report = kv.show(location).to_json()
        if as_json:
            emit_json(report)
        else:
            for table in kv_rich(report):
                out.print(table)
        if any(f["severity"] == "error" for f in report["findings"]):
            raise typer.Exit(ExitCode.FINDINGS)

    @app.command("fidelity")
    def fidelity_command(
        teacher: str = typer.Argument(..., metavar="TEACHER", help="The BF16 checkpoint."),
        student: str = typer.Argument(..., metavar="STUDENT", help="Its quantized checkpoint (compressed-tensors or ModelOpt)."),
        text: list[Path] = typer.Option([], "--text", help="Held-out text (.jsonl or plain); default: the built-in corpus's held-out split."),
        numerics: str = typer.Option("w4a4", "--numerics", help="w4a4 (activation scales honoured) | w4a16 (dropped, as MARLIN does)."),
        samples: int = typer.Option(16, "--samples", min=1),
        seq_len: int = typer.Option(256, "--seq-len", min=2),
        batch_size: int = typer.Option(4, "--batch-size", min=1),
        no_builtin: bool = typer.Option(False, "--no-builtin", help="Use only --text files."),
        tokenizer: Optional[Path] = typer.Option(None, "--tokenizer"),
        teacher_cache: Optional[Path] = typer.Option(None, "--teacher-cache", help="Teacher logits cache: written if absent, reused (teacher not run) if present."),
        top_k: int = typer.Option(32, "--top-k", min=1, help="Teacher log-probs kept exactly per position in the cache."),
        tail_samples: int = typer.Option(32, "--tail-samples", min=1, help="Tail tokens sampled per position in the cache."),
        moe_input_scale: str = typer.Option("global-max", "--moe-input-scale", help="global-max (FlashInfer / emulation MoE) | per-expert (VLLM_CUTLASS)."),
        device: Optional[str] = device_opt,
        activation_budget: Optional[str] = activation_opt,
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """KL, top-1 agreement, perplexity and per-layer error of a quantized student against its teacher, layer-streamed."""
        emit_json, out, progress_bar = _ui()
        from fp4forge.cli.common import parse_bytes
        from fp4forge.fidelity.evaluate import FidelityOptions, evaluate
        from fp4forge.report.calibrate_tables import fidelity_rich

        options = FidelityOptions(
            numerics=numerics,
            samples=samples,
            seq_len=seq_len,
            batch_size=batch_size,
            text_files=tuple(text),
            builtin_corpus=not no_builtin,
            tokenizer=tokenizer,
            teacher_cache=teacher_cache,
            top_k=top_k,
            tail_samples=tail_samples,
            moe_input_scale=moe_input_scale,
            device=device,
            activation_budget_bytes=parse_bytes(activation_budget, "activation_budget_bytes"),
        )
        with progress_bar("evaluating", not as_json) as progress:
            report = evaluate(teacher, student, options, progress=progress).to_json()
        if as_json:
            emit_json(report)
        else:
            for table in fidelity_rich(report):
                out.print(table)
