"""`fp4forge calibrate`, `fp4forge kv calibrate|transplant|show` and `fp4forge fidelity`.

``register(app)`` adds them to the main Typer app. Like the other commands: a rich table for
people, one JSON document with --json, fp4forge errors as one line and an exit code; torch and
transformers are imported inside the commands.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import typer

from fp4forge.calibrate.options import CalibrationOptions
from fp4forge.cli.common import console, emit_json, parse_bytes, progress_bar
from fp4forge.errors import ConfigError, ExitCode
from fp4forge.fidelity.options import FidelityOptions
from fp4forge.model.samples import SampleOptions

# The flags' defaults are the options' own (a frozen dataclass's class attributes).

SAMPLES_OPT = typer.Option(SampleOptions.samples, "--samples", help="Calibration samples (rows of --seq-len tokens).")
SEQ_LEN_OPT = typer.Option(SampleOptions.seq_len, "--seq-len", help="Tokens per sample (texts are packed, never padded).")
BATCH_OPT = typer.Option(SampleOptions.batch_size, "--batch-size", help="Samples per forward.")
POLICY_OPT = typer.Option(CalibrationOptions.policy, "--policy", help="MoE coverage: routed (the router's tokens) | all-experts (every token through every expert).")
PORTABLE_OPT = typer.Option(CalibrationOptions.portable, "--portable", help="On a CPU: matmuls on kernels that give the same statistics on AVX2 and AVX-512 machines (slower: 3x on the testbed; pins MKL to one code path for the process).")
TEXT_OPT = typer.Option([], "--text", help="Extra text: .jsonl ({'messages': [...]} or {'text': ...}) or plain text; repeatable.")
NO_BUILTIN_OPT = typer.Option(False, "--no-builtin", help="Use only --text files, not the built-in stdlib corpus.")
BUILTIN_OPT = typer.Option(False, "--builtin", help="Use the built-in stdlib corpus when --text runs out, without the warning that it is not the model's own text.")
TOKENIZER_OPT = typer.Option(None, "--tokenizer", help="Tokenizer directory (default: the checkpoint's).")
RAM_OPT = typer.Option(SampleOptions.ram_budget_bytes / 2**30, "--ram-budget-gb", help="Activations kept in RAM up to this; the rest spills to disk.")
SPILL_OPT = typer.Option(None, "--spill-dir", help="Where spilled activations go (default: the temp dir).")
DEVICE_OPT = typer.Option(None, "--device", help="auto (default: CUDA when available, else CPU) | cpu | cuda | cuda:N.")
ACTIVATION_OPT = typer.Option(None, "--activation-budget", help="Activations kept on the device, e.g. 8GiB (default: 8GiB on CUDA, 0 on CPU); the rest moves to RAM.")


def register(app: typer.Typer) -> None:
    """Add calibrate, kv (calibrate / transplant / show) and fidelity to ``app``."""
    kv_app = typer.Typer(no_args_is_help=True, help="FP8 KV-cache scales: calibrate, transplant, show.")
    app.add_typer(kv_app, name="kv")
    app.command("calibrate")(calibrate_command)
    kv_app.command("calibrate")(kv_calibrate_command)
    kv_app.command("transplant")(kv_transplant_command)
    kv_app.command("show")(kv_show_command)
    app.command("fidelity")(fidelity_command)


def _sample_fields(text: Sequence[Path] = (), no_builtin: bool = False, tokenizer: Optional[Path] = None, ram_budget_gb: Optional[float] = None,
                   spill_dir: Optional[Path] = None, device: Optional[str] = None, activation_budget: Optional[str] = None,
                   builtin: bool = False) -> dict[str, Any]:
    """The shared flags as SampleOptions keywords (a flag left out keeps the options' default):
    ``--builtin`` asks for the built-in corpus, ``--no-builtin`` forbids it, neither leaves it to
    the job (model/samples.py)."""
    if builtin and no_builtin:
        raise ConfigError("ask for the built-in corpus or forbid it, not both", option="builtin_corpus")
    fields = dict(text_files=tuple(text), builtin_corpus=False if no_builtin else (True if builtin else None), tokenizer=tokenizer, spill_dir=spill_dir, device=device,
                  activation_budget_bytes=parse_bytes(activation_budget, "activation_budget_bytes"))
    if ram_budget_gb is not None:
        fields["ram_budget_bytes"] = int(ram_budget_gb * 2**30)
    return fields


def calibration_options(own: dict[str, Any], **flags: Any) -> CalibrationOptions:
    """Calibration's options from the command line: ``own`` as keywords, the shared flags by name
    (the one place the command line makes them: calibrate, kv calibrate, pipeline)."""
    return CalibrationOptions(**own, **_sample_fields(**flags))


def fidelity_options(own: dict[str, Any], **flags: Any) -> FidelityOptions:
    """Fidelity's options from the command line (fidelity, pipeline), as ``calibration_options``."""
    return FidelityOptions(**own, **_sample_fields(**flags))


def calibrate_command(
    src: str = typer.Argument(..., metavar="SRC", help="BF16 checkpoint directory."),
    stats_out: Path = typer.Option(..., "--out", help="Statistics file to write (.safetensors)."),
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    batch_size: int = BATCH_OPT,
    policy: str = POLICY_OPT,
    portable: bool = PORTABLE_OPT,
    text: list[Path] = TEXT_OPT,
    no_builtin: bool = NO_BUILTIN_OPT,
    builtin: bool = BUILTIN_OPT,
    tokenizer: Optional[Path] = TOKENIZER_OPT,
    ram_budget_gb: float = RAM_OPT,
    spill_dir: Optional[Path] = SPILL_OPT,
    device: Optional[str] = DEVICE_OPT,
    activation_budget: Optional[str] = ACTIVATION_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Activation and KV amax from data, one decoder layer in memory at a time (for quantize --stats)."""
    from fp4forge.calibrate.run import calibrate_to_file
    from fp4forge.report.calibrate_tables import calibration_rich

    options = calibration_options(dict(samples=samples, seq_len=seq_len, batch_size=batch_size, policy=policy, portable=portable), text=text, no_builtin=no_builtin,
                                  builtin=builtin, tokenizer=tokenizer, ram_budget_gb=ram_budget_gb, spill_dir=spill_dir, device=device, activation_budget=activation_budget)
    with progress_bar("calibrating", not as_json) as progress:
        summary = calibrate_to_file(src, stats_out, options, progress=progress)
    warn(summary.get("warnings", ()))
    if as_json:
        emit_json(summary)
    else:
        console().print(calibration_rich(summary, str(stats_out)))


def kv_calibrate_command(
    source: Path = typer.Argument(..., metavar="SRC_OR_STATS", help="A statistics file, or the BF16 checkpoint to calibrate now."),
    into: Path = typer.Option(..., "--into", help="Checkpoint directory that receives model-kvscales.safetensors (updated atomically)."),
    layout_format: Optional[str] = typer.Option(None, "--format", help="compressed-tensors | modelopt, for a checkpoint that declares no quantization yet."),
    per_head: bool = typer.Option(False, "--per-head", help="One scale per KV head (compressed-tensors attn_head)."),
    samples: int = SAMPLES_OPT,
    seq_len: int = SEQ_LEN_OPT,
    batch_size: int = BATCH_OPT,
    text: list[Path] = TEXT_OPT,
    no_builtin: bool = NO_BUILTIN_OPT,
    builtin: bool = BUILTIN_OPT,
    tokenizer: Optional[Path] = TOKENIZER_OPT,
    device: Optional[str] = DEVICE_OPT,
    activation_budget: Optional[str] = ACTIVATION_OPT,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """k_scale = k_amax / 448, v_scale = v_amax / 448, written into a checkpoint with its declaration."""
    from fp4forge.calibrate import kv

    calibration = calibration_options(dict(samples=samples, seq_len=seq_len, batch_size=batch_size), text=text, no_builtin=no_builtin,
                                      builtin=builtin, tokenizer=tokenizer, device=device, activation_budget=activation_budget)
    options = kv.KvOptions(layout_format=layout_format, per_head=per_head, calibration=calibration)
    with progress_bar("calibrating", not as_json and not kv.is_stats_file(source)) as progress:
        provenance = kv.calibrate_kv(source, into, options, progress=progress)
    if as_json:
        emit_json({"checkpoint": str(into), **provenance})
    else:
        console().print(f"[green]wrote[/green] {provenance['tensors']} KV scales for {provenance['layers']} layers into {into}/{kv.KV_SHARD} ({provenance['layout']})")


def kv_transplant_command(
    donor: Path = typer.Option(..., "--donor", help="Checkpoint of the same base model that carries KV scales."),
    into: Path = typer.Option(..., "--into", help="Checkpoint that lacks them."),
    out_dir: Path = typer.Option(..., "--out", help="New checkpoint directory to create."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Copy KV scales from a donor of the same model (names and dtypes converted; recorded as an approximation)."""
    from fp4forge.calibrate import kv

    provenance = kv.transplant(donor, into, out_dir)
    if as_json:
        emit_json({"checkpoint": str(out_dir), **provenance})
    else:
        console().print(f"[green]wrote[/green] {out_dir}: {provenance['tensors']} KV scales from {donor} ({provenance['donor_layout']} → {provenance['layout']}), recorded as an approximation")


def kv_show_command(
    location: str = typer.Argument(..., metavar="CKPT"),
    as_json: bool = typer.Option(False, "--json", help='{"layout", "layers": [{"layer", "k_scale", "v_scale", ...}], "findings": [...]}'),
) -> None:
    """Per-layer k/v scales and the amax they imply; flags constant 1.0, amax > 448, missing layers. Exit 1 on errors."""
    from fp4forge.calibrate import kv
    from fp4forge.report.calibrate_tables import kv_rich

    report = kv.show(location).to_json()
    if as_json:
        emit_json(report)
    else:
        for table in kv_rich(report):
            console().print(table)
    if any(f["severity"] == "error" for f in report["findings"]):
        raise typer.Exit(ExitCode.FINDINGS)


def fidelity_command(
    teacher: str = typer.Argument(..., metavar="TEACHER", help="The BF16 checkpoint."),
    student: str = typer.Argument(..., metavar="STUDENT", help="Its quantized checkpoint (compressed-tensors or ModelOpt)."),
    text: list[Path] = typer.Option([], "--text", help="Held-out text the model reads (.jsonl or plain); required unless --builtin."),
    numerics: str = typer.Option(FidelityOptions.numerics, "--numerics", help="w4a4 (activation scales honoured) | w4a16 (dropped, as MARLIN does)."),
    samples: int = typer.Option(FidelityOptions.samples, "--samples"),
    seq_len: int = typer.Option(FidelityOptions.seq_len, "--seq-len"),
    batch_size: int = typer.Option(FidelityOptions.batch_size, "--batch-size"),
    no_builtin: bool = typer.Option(False, "--no-builtin", help="Use only --text files."),
    builtin: bool = typer.Option(False, "--builtin", help="Score on the built-in corpus's held-out split (Python's stdlib) after any --text."),
    allow_unreadable: bool = typer.Option(FidelityOptions.allow_unreadable, "--allow-unreadable",
                                          help="Score even when the teacher cannot read the text (perplexity >= half its vocabulary), with a loud warning."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer"),
    teacher_cache: Optional[Path] = typer.Option(None, "--teacher-cache", help="Teacher logits cache: written if absent, reused (teacher not run) if present."),
    top_k: int = typer.Option(FidelityOptions.top_k, "--top-k", help="Teacher log-probs kept exactly per position in the cache."),
    tail_samples: int = typer.Option(FidelityOptions.tail_samples, "--tail-samples", help="Tail tokens sampled per position in the cache."),
    moe_input_scale: str = typer.Option(FidelityOptions.moe_input_scale, "--moe-input-scale", help="global-max (FlashInfer / emulation MoE) | per-expert (VLLM_CUTLASS)."),
    device: Optional[str] = DEVICE_OPT,
    activation_budget: Optional[str] = ACTIVATION_OPT,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """KL, top-1 agreement, perplexity and per-layer error of a quantized student against its teacher, layer-streamed."""
    from fp4forge.fidelity.evaluate import evaluate
    from fp4forge.report.calibrate_tables import fidelity_rich

    options = fidelity_options(dict(numerics=numerics, samples=samples, seq_len=seq_len, batch_size=batch_size, teacher_cache=teacher_cache,
                                    top_k=top_k, tail_samples=tail_samples, moe_input_scale=moe_input_scale, allow_unreadable=allow_unreadable),
                               text=text, no_builtin=no_builtin, builtin=builtin, tokenizer=tokenizer, device=device, activation_budget=activation_budget)
    with progress_bar("evaluating", not as_json) as progress:
        report = evaluate(teacher, student, options, progress=progress).to_json()
    warn([report["metrics"]["readability"]["warning"], *report["data"].get("warnings", ())])
    if as_json:
        emit_json(report)
    else:
        for table in fidelity_rich(report):
            console().print(table)


def warn(messages: Sequence[str | None]) -> None:
    """Warnings a result carries, loud on stderr (the JSON on stdout carries them too)."""
    for message in messages:
        if message:
            console(stderr=True).print(f"[bold yellow]warning:[/bold yellow] {message}")
