"""`fp4forge bench`: serving speed with its whole spread. Added to the main app by ``register(app)``.

    fp4forge bench perf --url URL --model NAME --out DIR [--workload default] [--mode sequential|concurrency|rate]
                        [--endpoint completions|chat] [--prefix-cache] [--prompt-tokens 81,633] [--output-tokens 128]
                        [--concurrency 1,2,4] [--rate 0.5,1] [--warmups 2] [--samples 7] [--json] [--no-plots]
    fp4forge bench analyze DIR [--json] [--markdown] [--no-plots]
    fp4forge bench compare RUN_A RUN_B [--json] [--markdown]
    fp4forge bench gemm --config CONFIG [--out DIR] [--m 1,16,128] [--kernels bf16,fp8] [--device cuda|cpu]

Exit codes. perf: 0 every request succeeded; 1 the run finished but some requests failed (counted
in the summary), or all of them (then nothing was measured, and it says so); 2 the run could not
start (bad options, no server, model not served); 3 the server stopped answering mid-run: every
finished sample is kept in DIR/samples.jsonl and summarised; 130 interrupted (Ctrl-C), also with
everything finished kept and summarised.
analyze / compare: 0, or 2 when a directory cannot be read. ``python -m fp4forge.cli.bench`` runs
the same commands standalone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from fp4forge.bench.perf import PerfOptions
from fp4forge.cli.common import console, error_text, fail
from fp4forge.cli.common import emit_json as _emit
from fp4forge import versioned
from fp4forge.errors import ConfigError, ExitCode, Fp4forgeError

EXIT_SOME_FAILED = ExitCode.FINDINGS
EXIT_UNUSABLE = ExitCode.UNUSABLE
EXIT_ABORTED = ExitCode.ABORTED
EXIT_INTERRUPTED = ExitCode.INTERRUPTED

bench_app = typer.Typer(no_args_is_help=True, help="Serving benchmarks: TTFT, prefill and decode with their whole spread.")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


def _out() -> Console:
    return console()


def _err() -> Console:
    return console(stderr=True)


_fail = fail


def _int_list(text: Optional[str], option: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(f"{option} takes comma-separated integers, got {text!r}") from error


def _float_list(text: Optional[str], option: str) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(f"{option} takes comma-separated numbers, got {text!r}") from error


# -- perf ---------------------------------------------------------------------------------------
@bench_app.command("perf")
def perf_command(
    url: str = typer.Option(..., "--url", help="Server root or its /v1 (e.g. http://127.0.0.1:8000)."),
    model: str = typer.Option(..., "--model", help="Served model name, as /v1/models lists it."),
    out_dir: Path = typer.Option(..., "--out", help="New directory for samples.jsonl, summary.json, summary.md and plots."),
    workload: str = typer.Option(PerfOptions.workload, "--workload", help="Workload from workloads.toml (default, decode, cpu-small, cpu-tiny)."),
    workloads_file: Optional[Path] = typer.Option(PerfOptions.workloads_file, "--workloads-file", help="A TOML file with [workload.NAME] tables."),
    mode: str = typer.Option(PerfOptions.mode, "--mode", help="sequential (concurrency 1), concurrency (sweep) or rate (Poisson sweep)."),
    endpoint: str = typer.Option(PerfOptions.endpoint, "--endpoint", help="completions (token-ID prompts) or chat."),
    prompt_tokens: Optional[str] = typer.Option(None, "--prompt-tokens", help="Override the ladder: comma-separated prompt lengths."),
    output_tokens: Optional[int] = typer.Option(None, "--output-tokens", min=1, help="Override generated tokens per request."),
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help="Override the concurrency sweep, e.g. 1,2,4,8."),
    rate: Optional[str] = typer.Option(None, "--rate", help="Override the arrival-rate sweep (requests/s), e.g. 0.5,1,2."),
    warmups: Optional[int] = typer.Option(None, "--warmups", min=0, help="Discarded requests per cell."),
    samples: Optional[int] = typer.Option(None, "--samples", min=1, help="Kept requests per cell."),
    prefix_cache: bool = typer.Option(False, "--prefix-cache", help="Share a prompt prefix within each shape on purpose."),
    prefix_fraction: float = typer.Option(0.5, "--prefix-fraction", help="Shared share of each prompt with --prefix-cache."),
    output_control: str = typer.Option(PerfOptions.output_control, "--output-control", help="How output length is fixed: ignore_eos, min_tokens or none."),
    extra_body: Optional[str] = typer.Option(None, "--extra-body", help='JSON merged into every request, e.g. \'{"chat_template_kwargs":{"enable_thinking":false}}\'.'),
    tokenizer: Optional[str] = typer.Option(PerfOptions.tokenizer, "--tokenizer", help="Count tokens with this tokenizer instead of the server's /tokenize."),
    timeout_s: float = typer.Option(PerfOptions.timeout_s, "--timeout", help="Seconds one request may take before it counts as failed."),
    seed: int = typer.Option(PerfOptions.seed, "--seed", help="Seed for prompt filler and Poisson gaps."),
    repeats: Optional[int] = typer.Option(PerfOptions.repeats, "--repeats", min=1, help="Rounds over the shapes, each in a fresh random order (default: one kept request per shape per round in sequential mode, else 1)."),
    order_seed: int = typer.Option(PerfOptions.order_seed, "--order-seed", help="Seed of the shapes' random order in each round."),
    server_log: Optional[Path] = typer.Option(PerfOptions.server_log, "--server-log", help="The server's log: its warnings are recorded in run.json."),
    as_json: bool = typer.Option(False, "--json", help="Print summary.json instead of tables."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
) -> None:
    """Measure TTFT, prefill and decode per prompt length, warmups discarded, every request kept."""
    from fp4forge.bench.perf import perf_options, run_perf
    from fp4forge.report.bench_plots import BENCH_PRESENTER

    try:
        options = perf_options(
            url=url, model=model, out_dir=out_dir, workload=workload, workloads_file=workloads_file, mode=mode,
            endpoint=endpoint, prompt_tokens=_int_list(prompt_tokens, "--prompt-tokens"), output_tokens=output_tokens,
            concurrency=_int_list(concurrency, "--concurrency"), rates_rps=_float_list(rate, "--rate"), warmups=warmups,
            samples=samples, prefix_cache_fraction=prefix_fraction if prefix_cache else 0.0, output_control=output_control,
            extra_body=_extra_body(extra_body), tokenizer=tokenizer, timeout_s=timeout_s, seed=seed,
            repeats=repeats, order_seed=order_seed, server_log=server_log,
        )
        with LiveCells(enabled=not as_json) as live:
            result = run_perf(options, on_event=live.update, presenter=BENCH_PRESENTER, plots=not no_plots)
    except Fp4forgeError as error:
        raise _fail(error, EXIT_UNUSABLE, as_json) from None

    _print_summary(result.summary, as_json)
    _exit_as_the_run_ended(result, out_dir, as_json)


def _exit_as_the_run_ended(result: Any, out_dir: Path, as_json: bool) -> None:
    """The exit code of a finished `bench perf` (docs/bench.md#exit-codes-of-bench-perf)."""
    from fp4forge.bench.runner import BenchAborted

    ending: tuple[int, str] | None = None
    if result.interrupted:
        ending = (EXIT_INTERRUPTED, f"interrupted; every finished sample is in {out_dir / 'samples.jsonl'}")
    elif result.stopped is not None:
        code = EXIT_ABORTED if isinstance(result.stopped, BenchAborted) else EXIT_UNUSABLE
        ending = (code, error_text(result.stopped))
    if ending is not None:
        if not as_json:
            _err().print(f"[red]error:[/red] {ending[1]}", highlight=False)
        raise typer.Exit(ending[0])
    if result.outcome is not None and result.outcome.kept == 0:  # every measured request failed
        _err().print(f"[red]error:[/red] no request succeeded, so nothing was measured; see failures in {out_dir / 'summary.md'}", highlight=False)
        raise typer.Exit(EXIT_SOME_FAILED)
    if result.failed:
        _err().print(f"[yellow]{result.failed} request(s) failed[/yellow]; see failures in {out_dir / 'summary.md'}")
        raise typer.Exit(EXIT_SOME_FAILED)


def _extra_body(text: Optional[str]) -> dict[str, Any]:
    if not text:
        return {}
    try:
        extra_body = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--extra-body is not JSON: {error}") from error
    if not isinstance(extra_body, dict):
        raise ConfigError("--extra-body must be a JSON object")
    return extra_body


def _print_summary(summary: dict[str, Any] | None, as_json: bool) -> None:
    from fp4forge.report.bench_tables import summary_rich

    if summary is None:
        return
    if as_json:
        _emit(summary)
        return
    out = _out()
    for block in summary_rich(summary):
        out.print(block)


class LiveCells:
    """A rich progress line per cell on stderr: phase, done/total, last and median TTFT, failures.
    Off a terminal: a plain line per finished cell and a heartbeat during a long one."""

    def __init__(self, enabled: bool, live: bool | None = None) -> None:
        from fp4forge.cli.common import interactive

        self.enabled = enabled
        self.live = interactive() if live is None else live
        self._progress: Any = None
        self._plain: Any = None
        self._tasks: dict[tuple[str, str], Any] = {}
        self._ttfts: dict[tuple[str, str], list[float]] = {}

    def __enter__(self) -> LiveCells:
        if self.enabled and not self.live:
            from fp4forge.cli.common import PlainProgress

            self._plain = PlainProgress("bench perf").__enter__()
        elif self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=_err(),
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._plain is not None:
            self._plain.__exit__(*exc)
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def update(self, event: Any) -> None:
        if self._plain is not None:
            self._plain_update(event)
        if self._progress is None:
            return
        import statistics

        key = (event.load, event.shape)
        description = f"{event.load} {event.shape} {event.phase}"
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(description, total=event.total or None, detail="")
        task = self._tasks[key]
        ttfts = self._ttfts.setdefault(key, [])
        if event.phase == "measure" and event.sample and event.sample.get("ttft_s") is not None and event.sample["ok"]:
            ttfts.append(event.sample["ttft_s"])
        detail = f"failed {event.failed}"
        if ttfts:
            detail = f"TTFT last {ttfts[-1] * 1000:,.1f} ms, median {statistics.median(ttfts) * 1000:,.1f} ms · " + detail
        if event.phase == "done":
            self._progress.update(task, description=f"{event.load} {event.shape} done", detail=detail)
        else:
            self._progress.update(task, description=description, completed=event.done, total=event.total or None, detail=detail)


    def _plain_update(self, event: Any) -> None:
        import statistics

        key = (event.load, event.shape)
        cell = f"{event.load} {event.shape}"
        ttfts = self._ttfts.setdefault(key, [])
        if key not in self._tasks:
            self._tasks[key] = cell
            self._plain.begin(cell, f"{cell}: {event.phase}, {event.total} request(s)")
        if event.phase == "measure" and event.sample and event.sample.get("ttft_s") is not None and event.sample["ok"]:
            ttfts.append(event.sample["ttft_s"])
        median = f", median TTFT {statistics.median(ttfts) * 1000:,.1f} ms" if ttfts else ""
        if event.phase == "done":
            self._plain.end(f"{cell}: done in {self._plain.task_elapsed():.1f} s, failed {event.failed}{median}")
        else:
            self._plain.update(event.done, event.total, f"{event.phase}{median}")


# -- analyze / compare --------------------------------------------------------------------------
@bench_app.command("analyze")
def analyze_command(
    run_dir: Path = typer.Argument(..., metavar="DIR", help="A `bench perf --out` directory (only samples.jsonl is required)."),
    as_json: bool = typer.Option(False, "--json", help="Print summary.json."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the Markdown table (also written to DIR/summary.md)."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
) -> None:
    """Recompute every statistic from DIR/samples.jsonl; write summary.json, summary.md and plots."""
    from fp4forge.bench.analyze import analyze_dir
    from fp4forge.report.bench_plots import BENCH_PRESENTER
    from fp4forge.report.bench_tables import summary_markdown

    try:
        summary = analyze_dir(run_dir, plots=not no_plots, presenter=BENCH_PRESENTER)
    except (Fp4forgeError, OSError) as error:
        raise _fail(str(error), EXIT_UNUSABLE, as_json) from None
    if markdown:
        sys.stdout.write(summary_markdown(summary))
    else:
        _print_summary(summary, as_json)


@bench_app.command("compare")
def compare_command(
    run_a: Path = typer.Argument(..., metavar="RUN_A"),
    run_b: Path = typer.Argument(..., metavar="RUN_B"),
    as_json: bool = typer.Option(False, "--json", help="One JSON document."),
    markdown: bool = typer.Option(False, "--markdown", help="A Markdown table."),
) -> None:
    """Per-cell ratios B/A of median TTFT and decode rate with bootstrap CIs; "no difference" when a CI covers 1."""
    from fp4forge.bench.analyze import compare_dirs
    from fp4forge.report.bench_tables import compare_markdown, compare_rich

    try:
        doc = compare_dirs(run_a, run_b)
    except (Fp4forgeError, OSError) as error:
        raise _fail(str(error), EXIT_UNUSABLE, as_json) from None
    if as_json:
        _emit(doc)
    elif markdown:
        sys.stdout.write(compare_markdown(doc))
    else:
        out = _out()
        for block in compare_rich(doc):
            out.print(block)


# -- gemm -------------------------------------------------------------------------------------------
@bench_app.command("gemm")
def gemm_command(
    config: str = typer.Option(..., "--config", metavar="CONFIG", help="config.json, a checkpoint directory, or a testbed preset (laguna-s-2.1-like)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Write gemm.json (every sample), gemm.md and gemm.png here."),
    m_values: Optional[str] = typer.Option(None, "--m", help="Token counts M, comma-separated (default 1,2,4,...,8192)."),
    kernels: Optional[str] = typer.Option(None, "--kernels", help="Comma-separated subset of bf16,fp8,fp8-static-act,fp8-dynamic-act,nvfp4-emulated."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (default when a GPU is present) or cpu."),
    samples: int = typer.Option(20, "--samples", help="Timed samples per cell."),
    inner: int = typer.Option(10, "--inner", help="Calls per sample (at least one per rotated weight copy)."),
    from_json: Optional[Path] = typer.Option(None, "--from-json", metavar="FILE", help="Render a saved gemm.json instead of measuring."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole report as JSON."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the Markdown table."),
) -> None:
    """GEMM precision microbench at every projection shape of a model: time per call and error against FP32, per kernel and M."""
    from fp4forge.bench.gemm import DEFAULT_M, KERNELS, load_model_config, projection_shapes, run_gemm_bench
    from fp4forge.cli.common import progress_bar
    from fp4forge.report.gemm_tables import gemm_markdown, gemm_plot, gemm_rich
    from fp4forge.report.plotting import pyplot

    try:
        if from_json is not None:
            data = json.loads(from_json.read_text(encoding="utf-8"))
        else:
            import torch

            shapes = projection_shapes(load_model_config(config))
            ms = _int_list(m_values, "m_values") or list(DEFAULT_M)
            ks = [k.strip() for k in kernels.split(",")] if kernels else list(KERNELS)
            dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
            with progress_bar("gemm", enabled=not as_json) as progress:
                report = run_gemm_bench(shapes, m_values=ms, kernels=ks, device=dev, samples=samples, inner=inner, progress=progress)
            data = versioned(report.to_json())
            data["config"] = config
    except (Fp4forgeError, OSError, json.JSONDecodeError) as error:
        raise _fail(error, EXIT_UNUSABLE, as_json) from None
    if out_dir is not None:
        from fp4forge.checkpoint.atomic import write_text_atomic

        write_text_atomic(out_dir / "gemm.json", json.dumps(data, indent=1))
        write_text_atomic(out_dir / "gemm.md", gemm_markdown(data))
        gemm_plot(data, out_dir / "gemm.png", pyplot())
    if as_json:
        _emit(data)
    elif markdown:
        sys.stdout.write(gemm_markdown(data))
    else:
        _out().print(gemm_rich(data))
        for note in data.get("not_run", []):
            _err().print(f"[yellow]not run:[/yellow] {note}")


def main() -> None:
    """Standalone entry point: ``python -m fp4forge.cli.bench bench perf ...``."""
    app = typer.Typer(no_args_is_help=True, add_completion=False)
    register(app)
    app()


if __name__ == "__main__":
    main()
