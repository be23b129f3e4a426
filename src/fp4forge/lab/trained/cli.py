"""`fp4forge testbed trained-laguna`: the tiny Laguna trained from scratch on a generated corpus."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from fp4forge.cli.common import console, emit_json


def register(testbed_app: typer.Typer) -> None:
    testbed_app.command("trained-laguna")(testbed_trained_laguna)


def testbed_trained_laguna(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create."),
    seed: int = typer.Option(0, help="Seed: the same seed (and code, torch build, threads) gives byte-identical weights."),
    steps: int = typer.Option(None, "--steps", help="Optimizer steps (default 440, the ten-minute CPU build; part of the cache key). 0 writes the untrained init of the same seed: the control arm."),
    threads: int = typer.Option(None, "--threads", help="Torch CPU threads, fixed for determinism (default 2; part of the cache key)."),
    device: str = typer.Option("cpu", "--device", help="cpu (default: the deterministic reference build) | cuda | cuda:N: a GPU trains longer recipes in minutes, but its bytes are not the CPU build's and it is never cached."),
    cache: bool = typer.Option(False, "--cache", help="Copy the build cached for these settings (building it into the cache first if missing)."),
    as_json: bool = typer.Option(False, "--json", help="Print the training report as one JSON object."),
) -> None:
    """The tiny Laguna (sigmoid routing + learned router bias, shared expert, mixed attention, output gate)
    trained from scratch on agentic transcripts fp4forge generates; reports perplexity and heavy tails."""
    from dataclasses import replace

    from fp4forge.errors import ConfigError
    from fp4forge.model.device import resolve_device
    from fp4forge.lab.trained.build import build_trained_laguna, copy_cached_trained_laguna
    from fp4forge.lab.trained.tables import tail_stats_rich, training_summary_rich
    from fp4forge.lab.trained.training import TrainingConfig

    overrides = {k: v for k, v in (("steps", steps), ("threads", threads)) if v is not None}
    config = replace(TrainingConfig(), **overrides)
    if cache and device.strip().lower() != "cpu":
        # The cache promises the same bytes for the same key; GPU arithmetic does not reproduce them.
        raise ConfigError(f"--cache holds CPU builds only; --device {device} builds into OUT without it", option="device")
    train_device = resolve_device(device)
    progress = None if as_json else _line_progress()
    if cache:
        result = copy_cached_trained_laguna(out_dir, seed=seed, config=config, progress=progress)
    else:
        result = build_trained_laguna(out_dir, seed=seed, config=config, progress=progress, device=str(train_device))
    shipped = _against_shipped(result.path, result.report)
    if as_json:
        emit_json({"path": str(result.path), **result.report, "shipped_comparison": shipped})
        return
    out = console()
    out.print(training_summary_rich(result.report))
    for table in tail_stats_rich(result.report):
        out.print(table)
    out.print(f"[green]wrote[/green] {result.path} (report: fp4forge-training.json)")
    out.print(shipped_comparison_text(shipped), highlight=False)


def _against_shipped(path: Path, report: dict) -> dict:  # type: ignore[type-arg]
    from fp4forge.errors import Fp4forgeError
    from fp4forge.lab.trained.ship import compare_with_shipped

    try:
        return compare_with_shipped(path, report)
    except Fp4forgeError as error:  # the build stands; only the comparison is missing
        return {"error": error.describe()}


def shipped_comparison_text(shipped: dict) -> str:  # type: ignore[type-arg]
    if "error" in shipped:
        return f"not compared with the shipped testbed: {shipped['error']}"
    label = f"{shipped['shipped']['name']} v{shipped['shipped']['version']}"
    if shipped["same_bytes"]:
        return f"the same model bytes as the shipped testbed {label} (sha256 {shipped['shipped']['sha256'][:16]}…)"
    return (f"differs from the shipped testbed {label} (`fp4forge testbed shipped`) in {len(shipped['differing_files'])} files; why: "
            + "; ".join(shipped["reasons"]))


def _line_progress():  # type: ignore[no-untyped-def]
    """One stderr line per phase and every ~10 s while training: readable on a TTY and in CI logs."""
    err = console(stderr=True)
    state = {"last": 0.0, "desc": ""}
    started = time.monotonic()

    def update(done: int, total: int, desc: str) -> None:
        now = time.monotonic()
        phase = desc.split(":")[0]
        if phase != state["desc"] or now - state["last"] >= 10 or done == total:
            state["last"], state["desc"] = now, phase
            err.print(f"[{now - started:6.0f}s] {desc} ({done}/{total})", highlight=False)
            sys.stderr.flush()

    return update
