"""`fp4forge pipeline` and `fp4forge card`, added to the main Typer app by ``register(app)``.

    fp4forge pipeline SRC OUT --recipe R [--format F] [--calib-samples N] [--calib-text FILE]...
                      [--hardware gb10] [--sibling CKPT] [--serve [--vllm-venv DIR]] [--bench perf,quality]
                      [--base-model REPO_ID] [--json]
    fp4forge card CKPT [--reports DIR] [--out README.md] [--base-model REPO_ID] [--json]

Exit codes. pipeline: 0 every step finished (or was unchanged), 1 a step failed (the manifest
``OUT/reports/pipeline.json`` says which; a re-run resumes there), 2 bad options or input,
130 interrupted (a re-run resumes). card: 0 written, 2 the checkpoint directory does not exist.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer

from fp4forge.cli.common import console as _console
from fp4forge.cli.common import emit_json as _emit
from fp4forge.cli.common import error_text, fail, spelled
from fp4forge.errors import ExitCode, Fp4forgeError
from fp4forge.calibrate.options import CalibrationOptions
from fp4forge.fidelity.options import FidelityOptions
from fp4forge.pipeline.steps import PIPELINE_PERF_WORKLOAD, PIPELINE_QUALITY, PipelineOptions
from fp4forge.quantize.job import QuantizeJob

DEFAULT_VLLM_VENV = Path(".venv-vllm")
STATUS_STYLE = {"done": "green", "skipped": "cyan", "failed": "red", "interrupted": "red", "off": "dim", "running": "yellow", "pending": "dim"}


def register(app: typer.Typer) -> None:
    app.command("pipeline")(pipeline_command)
    app.command("card")(card_command)


_fail = fail


class StepsView:
    """One live table for the whole run: every step's status, time and headline, and a bar for
    the running step's own progress (a new bar per step: counts and clock start again). Off a
    terminal (CI, ``| tee``), plain lines instead: one per step, a heartbeat during long ones."""

    def __init__(self, enabled: bool, live: bool | None = None) -> None:
        from fp4forge.cli.common import interactive

        self.enabled = enabled
        self.live = interactive() if live is None else live
        self.rows: dict[str, list[str]] = {}
        self._live: Any = None
        self._bar: Any = None
        self._task: Any = None
        self._plain: Any = None
        self._running: str | None = None

    def __enter__(self) -> StepsView:
        return self

    def _start(self) -> None:
        """On the first event: options that fail validation print one error line, no table."""
        if not self.live:
            if self._plain is None:
                from fp4forge.cli.common import PlainProgress

                self._plain = PlainProgress("pipeline").__enter__()
            return
        if self._live is None:
            from rich.live import Live
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            from fp4forge.pipeline.steps import CARD_STEP, STEPS

            self.rows = {s.name: [s.name, "pending", s.title] for s in (*STEPS, CARD_STEP)}
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
            self._task = self._bar.add_task("", total=None, visible=False)
            self._live = Live(self._render(), console=_console(stderr=True), refresh_per_second=4, transient=False)
            self._live.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._plain is not None:
            self._plain.__exit__(*exc)
        if self._live is not None:
            self._bar.update(self._task, visible=False)
            self._live.update(self._render())
            self._live.__exit__(*exc)
            _console(stderr=True).print()

    def _render(self):  # type: ignore[no-untyped-def]
        from rich.console import Group
        from rich.table import Table

        view = Table(title="fp4forge pipeline", title_justify="left")
        for column in ("step", "status", "detail"):
            view.add_column(column)
        for name, status, detail in self.rows.values():
            style = STATUS_STYLE.get(status, "")
            view.add_row(name, f"[{style}]{status}[/{style}]", detail)
        return Group(view, self._bar)

    def update(self, event: Any) -> None:
        if not self.enabled:
            return
        self._start()
        if not self.live:
            self._plain_update(event)
            return
        row = self.rows.setdefault(event.step, [event.step, "", ""])
        row[1] = event.status
        if event.status == "running":
            if event.step != self._running:  # a new step: its own bar, from 0 and 0 s
                self._running = event.step
                self._bar.remove_task(self._task)
                self._task = self._bar.add_task("", total=None)
            self._bar.update(self._task, visible=True, description=f"{event.step}: {event.detail}",
                             completed=event.done, total=event.total or None)
        elif event.detail:
            row[2] = event.detail
        if event.status != "running":
            self._running = None
            self._bar.update(self._task, visible=False, completed=0, total=None)
        self._live.update(self._render())

    def _plain_update(self, event: Any) -> None:
        plain = self._plain
        if event.status == "running":
            if event.step != self._running:
                self._running = event.step
                plain.begin(event.step, f"{event.step}: running" + (f" ({event.detail})" if event.detail else ""))
            plain.update(event.done, event.total, event.detail)
            return
        took = ""
        if event.step == self._running:
            took = f" in {plain.task_elapsed():.1f} s"
            self._running = None
        plain.end(f"{event.step}: {event.status}{took}" + (f" — {event.detail}" if event.detail else ""))


def _csv(text: Optional[str]) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


# The nested options whose flags carry a prefix (``calibration.samples`` -> ``--calib-samples``).
PREFIXES = {"calibration": "--calib-", "fidelity": "--fidelity-", "perf": "--perf-", "quality": "--quality-", "quantize": "--"}
SHARED = {"tokenizer": "--tokenizer", "device": "--device", "activation_budget_bytes": "--activation-budget"}


def pipeline_flag(option: str) -> str:
    """How `fp4forge pipeline` spells an option path of ``PipelineOptions``."""
    from fp4forge.cli.common import flag_for

    group, dot, name = option.partition(".")
    if not dot or group not in PREFIXES:
        return flag_for(option)
    if name in SHARED:  # one flag sets it for every step
        return SHARED[name]
    if name == "text_files":
        return PREFIXES[group] + "text"
    if group == "quantize":
        return flag_for(name)
    return PREFIXES[group] + name.replace("_", "-")


def pipeline_command(
    src: Path = typer.Argument(..., metavar="SRC", help="BF16 checkpoint directory."),
    out: Path = typer.Argument(..., metavar="OUT", help="Output: the servable checkpoint, its reports/ and README.md (the card)."),
    recipe: str = typer.Option(..., "--recipe", help="Built-in recipe name or a recipe .toml file."),
    layout_format: str = typer.Option(QuantizeJob.layout_format, "--format", help="compressed-tensors | modelopt"),
    block_scales: str = typer.Option(QuantizeJob.block_scales, "--block-scales", help="minmax (identical to the references) | four_over_six | mse"),
    calib_samples: int = typer.Option(CalibrationOptions.samples, "--calib-samples", help="Calibration samples."),
    calib_seq_len: int = typer.Option(CalibrationOptions.seq_len, "--calib-seq-len", help="Tokens per calibration sample."),
    calib_text: list[Path] = typer.Option([], "--calib-text", help="Extra calibration text (.jsonl or plain); repeatable."),
    calib_portable: bool = typer.Option(CalibrationOptions.portable, "--calib-portable", help="Calibrate on CPU kernels that give the same statistics on AVX2 and AVX-512 machines (slower: 3x on the testbed; pins MKL to one code path for the process)."),
    fidelity_samples: int = typer.Option(FidelityOptions.samples, "--fidelity-samples", help="Held-out samples."),
    fidelity_seq_len: int = typer.Option(FidelityOptions.seq_len, "--fidelity-seq-len", help="Tokens per held-out sample."),
    fidelity_text: list[Path] = typer.Option([], "--fidelity-text", help="Held-out text for fidelity; repeatable."),
    fidelity_numerics: str = typer.Option(FidelityOptions.numerics, "--fidelity-numerics", help="w4a4 (activation scales honoured) | w4a16 (dropped, as MARLIN does)."),
    fidelity_builtin: bool = typer.Option(False, "--fidelity-builtin", help="Score fidelity on the built-in corpus's held-out split (Python's stdlib) after any --fidelity-text."),
    fidelity_allow_unreadable: bool = typer.Option(FidelityOptions.allow_unreadable, "--fidelity-allow-unreadable", help="Score fidelity even when the teacher cannot read its text (a loud warning on the card)."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="Tokenizer directory for calibration and fidelity (default: SRC's)."),
    device: Optional[str] = typer.Option(None, "--device", help="Calibrate, quantize and fidelity on: auto (CUDA when available, else CPU) | cpu | cuda | cuda:N."),
    activation_budget: Optional[str] = typer.Option(None, "--activation-budget", help="Activations kept on the device, e.g. 8GiB (default: 8GiB on CUDA, 0 on CPU)."),
    hardware: str = typer.Option(PipelineOptions.hardware, "--hardware", help="Target of the card's serve line: gb10 | b200 | h100 | h200 | cpu."),
    vllm_version: Optional[str] = typer.Option(None, "--vllm-version", help="Target vLLM version of the serve line and audit."),
    sibling: Optional[Path] = typer.Option(None, "--sibling", help="Another checkpoint of the same model to diff against."),
    serve: bool = typer.Option(PipelineOptions.serve, "--serve", help="Serve OUT here with vLLM (CPU: with the fp4forge-vllm plugin) and read its log."),
    serve_hardware: str = typer.Option(PipelineOptions.serve_hardware, "--serve-hardware", help="What --serve runs on here: cpu (vLLM CPU with the fp4forge-vllm plugin) | gb10 | b200 | h100 | h200."),
    vllm_venv: Optional[Path] = typer.Option(None, "--vllm-venv", help="vLLM venv (default $FP4FORGE_VLLM_VENV, else .venv-vllm)."),
    bench: Optional[str] = typer.Option(None, "--bench", help="With --serve: perf, quality or perf,quality."),
    perf_workload: Optional[str] = typer.Option(None, "--perf-workload", help=f"Workload of bench perf (workloads.toml; default {PIPELINE_PERF_WORKLOAD})."),
    quality_runs: int = typer.Option(PIPELINE_QUALITY["runs"], "--quality-runs", help="Suite runs; 2+ measures the noise floor."),
    quality_max_tokens: int = typer.Option(PIPELINE_QUALITY["max_tokens"], "--quality-max-tokens", help="Per turn: reasoning, then the answer."),
    quality_categories: Optional[str] = typer.Option(None, "--quality-categories", help="Comma-separated categories (default: all)."),
    quality_teacher: bool = typer.Option(PipelineOptions.quality_teacher, "--quality-teacher", help="Also run the suite on the BF16 teacher (SRC) and compare the arms with paired tests."),
    quality_allow_unreadable: bool = typer.Option(PipelineOptions.quality_allow_unreadable, "--quality-allow-unreadable", help="Score an arm even when most of its turns were cut at max tokens or held reasoning only (default: the card refuses and says why)."),
    base_model: Optional[str] = typer.Option(PipelineOptions.base_model, "--base-model", metavar="REPO_ID", help="The Hub repository SRC is, for the card's front matter (default: what SRC says)."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest (reports/pipeline.json) as JSON."),
) -> None:
    """calibrate → quantize → KV check → audit → bytes → fidelity → (serve → bench) → card; resumable."""
    flags = dict(locals())  # every option by name: the options objects are made from them below
    for positional_or_output in ("src", "out", "as_json"):
        del flags[positional_or_output]
    from fp4forge.pipeline import PipelineFailed, run_pipeline

    manifest_path = out / "reports" / "pipeline.json"
    try:
        with spelled(pipeline_flag):
            options = _pipeline_options(**flags)
            with StepsView(enabled=not as_json) as view:
                manifest = run_pipeline(src, out, options, on_event=view.update)
    except PipelineFailed as error:
        if as_json and manifest_path.is_file():
            _emit(json.loads(manifest_path.read_text()))
        raise _fail(f"{error_text(error)}\nfix it and re-run the same command: finished steps are skipped", ExitCode.FINDINGS, False) from None
    except KeyboardInterrupt:
        _console(stderr=True).print("[red]interrupted[/red]: finished steps are recorded; re-run the same command to resume")
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except Fp4forgeError as error:
        raise _fail(error, ExitCode.UNUSABLE, as_json) from None
    if as_json:
        _emit(manifest.to_json())
    else:
        _console().print(f"[green]done[/green]: {out} (card {out / 'README.md'}, artifacts {out / 'reports'})")


def _pipeline_options(*, recipe: str, layout_format: str, block_scales: str, calib_samples: int, calib_seq_len: int,
                      calib_text: list[Path], calib_portable: bool = False, fidelity_samples: int, fidelity_seq_len: int, fidelity_text: list[Path],
                      fidelity_numerics: str, fidelity_builtin: bool, fidelity_allow_unreadable: bool, tokenizer: Optional[Path], device: Optional[str], activation_budget: Optional[str],
                      vllm_venv: Optional[Path], serve: bool, bench: Optional[str], perf_workload: Optional[str],
                      quality_runs: int, quality_max_tokens: int, quality_categories: Optional[str], **pipeline: Any) -> Any:
    """The flags as the nested options (each job's options check themselves when made)."""
    from fp4forge.cli.calibrate import calibration_options, fidelity_options
    from fp4forge.cli.quantize import quantize_job
    from fp4forge.errors import option_path
    from fp4forge.pipeline.steps import _pipeline_perf, _pipeline_quality

    shared = dict(tokenizer=tokenizer, device=device, activation_budget=activation_budget)
    with option_path("calibration", CalibrationOptions):
        calibration = calibration_options(dict(samples=calib_samples, seq_len=calib_seq_len, portable=calib_portable), text=calib_text, **shared)
    with option_path("fidelity", FidelityOptions):
        fidelity = fidelity_options(dict(samples=fidelity_samples, seq_len=fidelity_seq_len, numerics=fidelity_numerics,
                                         allow_unreadable=fidelity_allow_unreadable), text=fidelity_text, builtin=fidelity_builtin, **shared)
    with option_path("quantize", QuantizeJob):
        quantize = quantize_job({}, {}, recipe=recipe, layout_format=layout_format, block_scales=block_scales, device=device)
    with option_path("perf", ("workload",)):
        perf = _pipeline_perf(**({} if perf_workload is None else {"workload": perf_workload}))
    with option_path("quality", ("runs", "max_tokens")):
        quality = _pipeline_quality(runs=quality_runs, max_tokens=quality_max_tokens)
    venv = vllm_venv or Path(os.environ.get("FP4FORGE_VLLM_VENV", DEFAULT_VLLM_VENV))
    return PipelineOptions(quantize=quantize, calibration=calibration, fidelity=fidelity, perf=perf, quality=quality, serve=serve,
                           vllm_venv=venv.absolute() if serve else None, bench=_csv(bench),
                           quality_categories=_csv(quality_categories), **pipeline)


def card_command(
    checkpoint: Path = typer.Argument(..., metavar="CKPT", help="Checkpoint directory."),
    reports: Optional[Path] = typer.Option(None, "--reports", help="Artifacts directory (default CKPT/reports)."),
    out_path: Optional[Path] = typer.Option(None, "--out", help="Card to write (default CKPT/README.md)."),
    base_model: Optional[str] = typer.Option(None, "--base-model", metavar="REPO_ID",
                                             help="The Hub repository the source is (front matter base_model); default: what the source says."),
    as_json: bool = typer.Option(False, "--json", help='{"card", "sections", "missing", "unusable", "verdict", "plots"}'),
) -> None:
    """Write the model card from measured artifacts only; a missing artifact is named, never invented."""
    from fp4forge.report.card import card_options, write_card

    if not checkpoint.is_dir():
        raise _fail(f"{checkpoint} is not a directory", ExitCode.UNUSABLE, as_json)
    target = out_path or checkpoint / "README.md"
    try:
        card = write_card(checkpoint, card_options(reports=reports, out=target, base_model=base_model))
    except Fp4forgeError as error:
        raise _fail(error, error.exit_code, as_json) from None
    if as_json:
        _emit({"card": str(target), "sections": card.sections, "missing": card.missing, "unusable": card.problems,
               "verdict": card.verdict.to_json() if card.verdict else None, "plots": card.plots})
    else:
        _console().print(f"[green]wrote[/green] {target} ({len(card.sections)} sections"
                         + (f"; not quoted: {', '.join(f'{n} ({why})' for n, why in card.problems.items())}" if card.problems else "") + ")")
        if card.verdict:
            _console().print(f"verdict: [bold]{card.verdict.decision}[/bold]", markup=True)
            for reason in card.verdict.reasons:
                _console().print(f"  {reason.topic}: {reason.state}", markup=False)
