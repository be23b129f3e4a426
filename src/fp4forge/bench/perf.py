"""`bench perf` as one library function: options checked once, the run, the analysis, the directory.

``PerfOptions`` holds what a user chooses (a workload from ``workloads.toml`` plus overrides) and
checks it when it is made; ``run_perf`` runs it, keeps every finished sample, analyses whatever the
run left (also after the server went away or Ctrl-C) and returns a ``PerfResult``. The CLI
(``fp4forge bench perf``) and the pipeline's perf step both call ``run_perf``; they differ only in
how they show progress and what they do with the result. Errors name the option they are about
(``option="workload"``), never a CLI flag.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.bench.analyze import SummaryPresenter, analyze_dir
from fp4forge.bench.runner import (
    SAMPLES_FILE,
    BenchAborted,
    BenchConfig,
    EventCallback,
    RunOutcome,
    Shape,
    load_points,
    load_workloads,
    run_bench,
)
from fp4forge.errors import ConfigError, Fp4forgeError


@dataclass(frozen=True)
class PerfOptions:
    """One benchmark: a workload (shapes, sweeps, sample counts) and what overrides it.

    ``None`` overrides keep the workload's value. Checked when made (here, in ``load_points`` and
    in ``BenchConfig``): an unknown workload, mode, endpoint kind or output control, an empty
    sweep or an impossible count raises ``ConfigError`` naming the option.
    """

    url: str
    model: str
    out_dir: Path
    workload: str = "default"
    workloads_file: Path | None = None
    mode: str = "sequential"
    endpoint: str = "completions"
    prompt_tokens: Sequence[int] | None = None
    output_tokens: int | None = None
    concurrency: Sequence[int] | None = None
    rates_rps: Sequence[float] | None = None
    warmups: int | None = None
    samples: int | None = None
    prefix_cache_fraction: float = 0.0
    output_control: str = "ignore_eos"
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    repeats: int | None = None  # rounds over the shapes, each in a random order (None: the runner's default)
    order_seed: int = 0  # seeds the shapes' order in each round
    server_log: Path | None = None  # the server's log: its WARNING lines go into run.json
    _config: BenchConfig | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_config", self._build_config())

    @property
    def bench_config(self) -> BenchConfig:
        assert self._config is not None
        return self._config

    def _build_config(self) -> BenchConfig:
        try:
            workloads = load_workloads(self.workloads_file)
        except OSError as error:  # a missing or unreadable file: the option's error, not a traceback
            raise ConfigError(f"cannot read the workloads file: {error.strerror or error}", option="workloads_file") from None
        except ConfigError as error:
            error.option = error.option or "workloads_file"
            raise
        if self.workload not in workloads:
            raise ConfigError(f"unknown workload {self.workload!r}; known: {sorted(workloads)}", option="workload")
        chosen = workloads[self.workload]
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ConfigError(f"output tokens must be >= 1, not {self.output_tokens}", option="output_tokens")
        output = self.output_tokens or chosen.shapes[0].output_tokens
        prompts = list(self.prompt_tokens or [s.prompt_tokens for s in chosen.shapes])
        points = load_points(
            self.mode,  # type: ignore[arg-type]  # checked by load_points
            list(self.concurrency or chosen.concurrency),
            list(self.rates_rps or chosen.rates_rps),
        )
        return BenchConfig(
            base_url=self.url,
            model=self.model,
            out_dir=Path(self.out_dir),
            shapes=[Shape(p, output) for p in prompts],
            points=points,
            warmups=chosen.warmups if self.warmups is None else self.warmups,
            samples=chosen.samples if self.samples is None else self.samples,
            endpoint=self.endpoint,  # type: ignore[arg-type]  # checked by BenchConfig
            request_timeout_s=self.timeout_s,
            seed=self.seed,
            prefix_cache_fraction=self.prefix_cache_fraction,
            output_control=self.output_control,  # type: ignore[arg-type]  # checked by BenchConfig
            extra_body=dict(self.extra_body),
            tokenizer_path=self.tokenizer,
            workload=chosen.name,
            workloads_file=self.workloads_file,
            repeats=self.repeats,
            order_seed=self.order_seed,
            server_log=None if self.server_log is None else Path(self.server_log),
        )


def perf_options(**given: Any) -> PerfOptions:
    """The perf job's options, from `fp4forge bench perf` or the pipeline: the one place either
    makes them (``given``: the fields by name)."""
    return PerfOptions(**given)


@dataclass
class PerfResult:
    """What a run left: its summary (None when no sample was written) and how it ended.

    ``stopped``: the error that ended the run early with samples on disk (``BenchAborted`` when
    the server went away); ``interrupted``: Ctrl-C. Either way the finished samples are analysed.
    """

    out_dir: Path
    summary: dict[str, Any] | None
    outcome: RunOutcome | None
    stopped: Fp4forgeError | None = None
    interrupted: bool = False

    @property
    def failed(self) -> int:
        """Failed requests of a run that ran to its end (0 when it did not)."""
        return self.outcome.failed if self.outcome is not None else 0


def run_perf(options: PerfOptions, *, on_event: EventCallback | None = None, presenter: SummaryPresenter | None = None,
             plots: bool = True) -> PerfResult:
    """Run the benchmark into ``options.out_dir`` and analyse it there (``summary.json``; with a
    ``presenter`` also ``summary.md`` and plots).

    Raises the run's error when it could not start (bad options, no server, model not served, a
    workload too long for the server, ``out_dir`` already holds samples): nothing is analysed then,
    an old run is never summarised as if it were this one, and no ``out_dir`` is left behind when
    the run made it. Samples stream into ``out_dir`` as they finish (a killed run keeps them), so
    the directory is made only after the server's checks passed, not staged and renamed.
    """
    config = options.bench_config
    out_dir = Path(config.out_dir)
    samples_path = out_dir / SAMPLES_FILE
    had_samples = samples_path.exists()  # then the run refuses to start
    created = not out_dir.exists()  # the runner makes it only once the server checks passed
    outcome: RunOutcome | None = None
    stopped: Fp4forgeError | None = None
    interrupted = False
    try:
        outcome = asyncio.run(run_bench(config, on_event))
    except BenchAborted as error:
        stopped = error
    except KeyboardInterrupt:
        interrupted = True
    except Fp4forgeError as error:
        if had_samples or not samples_path.is_file():
            _remove_if_unused(out_dir, created)
            raise
        stopped = error
    if not samples_path.is_file() or samples_path.stat().st_size == 0:
        _remove_if_unused(out_dir, created)
    summary = analyze_dir(out_dir, plots=plots, presenter=presenter) if samples_path.is_file() else None
    return PerfResult(out_dir, summary, outcome, stopped, interrupted)


def _remove_if_unused(out_dir: Path, created: bool) -> None:
    """A run that ended before its first sample leaves no directory it made (only its own files
    can be in it: run.json, an empty samples file)."""
    if created and out_dir.is_dir() and not any(p.stat().st_size for p in (out_dir / SAMPLES_FILE,) if p.exists()):
        shutil.rmtree(out_dir, ignore_errors=True)
