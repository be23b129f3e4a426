"""Run the pipeline: each step in order, skipped when its key and artifacts are unchanged,
recorded in ``OUT/reports/pipeline.json`` after every step so a failure or Ctrl-C resumes there.

The orchestrator knows nothing about what a step does; presentation goes through ``on_event``.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from subprocess import SubprocessError
from typing import Any

from fp4forge.checkpoint.names import CONFIG_JSON
from fp4forge.model.distributed import launched
from fp4forge.errors import ConfigError, Fp4forgeError, PipelineFailed, option_path
from fp4forge.pipeline.state import (
    DONE, FAILED, FINISHED, INTERRUPTED, OFF, PENDING, SKIPPED, BackgroundKey, Hasher, KeyFailed, Manifest, StampHasher, StepRecord,
    could_be_valid, digest_of, previous_records, require_empty_or_ours, still_valid,
)
from fp4forge.pipeline.steps import CARD_STEP, NOT_CHECKPOINT, REPORTS, STAGING, STEPS, Context, PipelineOptions, Step

MANIFEST = "pipeline.json"
HASH_CACHE = ".hashes.json"
# A new pipeline.json status: the run as a whole.
COMPLETE = "complete"
TEXT_FILES = ("calibration.text_files", "fidelity.text_files")  # options naming text files


@dataclass(frozen=True)
class StepEvent:
    """What the progress view is told: a step started / progressed / ended."""

    step: str
    status: str  # running | done | skipped | failed | interrupted | off
    done: int = 0
    total: int = 0
    detail: str = ""


EventCallback = Callable[[StepEvent], None]


def _vllm_identity(venv: Path | None) -> str | None:
    if venv is None:
        return None
    from fp4forge.serve.recommend import installed_vllm_version

    return f"{installed_vllm_version(str(venv))}@{venv.resolve()}"


def step_key(step: Step, ctx: Context, hasher: Hasher, manifest: Manifest | None = None) -> str:
    """Hash of everything the step's result depends on. ``steps`` (the card's input): which of the
    steps before it finished in this run, so that a step turned off re-renders the card."""
    o = ctx.options
    inputs: dict[str, Any] = {}
    for name in step.inputs:
        if name == "steps":
            records = manifest.steps.values() if manifest is not None else ()
            inputs[name] = {r.name: r.status in FINISHED for r in records if r.name != step.name}
        elif name == "src":
            inputs[name] = hasher.tree(ctx.src)
        elif name == "checkpoint":
            inputs[name] = hasher.tree(ctx.out, NOT_CHECKPOINT)
        elif name == "recipe":
            inputs[name] = o.recipe_spec.text  # the content: an edited recipe file re-runs quantize
        elif name == "sibling":
            inputs[name] = hasher.path(o.sibling) if o.sibling else None
        elif name == "vllm":
            inputs[name] = _vllm_identity(o.vllm_venv)
        elif name == "reports":
            inputs[name] = hasher.tree(ctx.reports, (MANIFEST, HASH_CACHE, "plots"))
        else:
            inputs[name] = hasher.path(ctx.reports / name)
    params = {name: o.value(name) for name in step.params}
    for name in TEXT_FILES:  # the text files' contents, not their names
        if name in params:
            params[name] = [hasher.file(Path(p)) for p in params[name]]
    return digest_of({"step": step.name, "version": step.version, "inputs": inputs, "params": params})


def _artifact_hashes(step: Step, ctx: Context, hasher: Hasher) -> dict[str, str]:
    hashes = {}
    for rel in step.artifacts:
        sha = hasher.path(ctx.out / rel, NOT_CHECKPOINT if rel == "." else ())
        if sha is None:
            raise ConfigError(f"step {step.name} finished without writing {rel}")
        hashes[rel] = sha
    return hashes


def validate(src: Path, out: Path, options: PipelineOptions) -> None:
    """What depends on the file system (the options checked themselves when constructed)."""
    if not (src / CONFIG_JSON).is_file():
        raise ConfigError(f"{src} is not a checkpoint directory (no config.json)")
    if launched():  # its audit, serve and card steps are one process's work
        raise ConfigError("the pipeline runs as one process; under torchrun launch `fp4forge calibrate`, `quantize` and `fidelity` one by one (docs/distributed.md#the-pipeline)")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ConfigError("OUT must not be SRC or inside it")
    if options.serve and (options.vllm_venv is None or not (options.vllm_venv / "bin" / "vllm").exists()):
        raise ConfigError(f"serving needs a vLLM venv with bin/vllm; {options.vllm_venv} has none (scripts/setup-vllm-venv.sh)", option="vllm_venv")
    for option in TEXT_FILES:
        for path in options.value(option):
            if not Path(path).is_file():
                raise ConfigError(f"text file {path} does not exist", option=option)


def run_pipeline(src: Path, out: Path, options: PipelineOptions, on_event: EventCallback = lambda e: None) -> Manifest:
    """Run (or resume) the pipeline; returns the manifest. Raises PipelineFailed on a failed step
    and re-raises KeyboardInterrupt after recording it."""
    src, out = Path(src), Path(out)
    validate(src, out, options)
    reports = out / REPORTS
    manifest_path = reports / MANIFEST
    require_empty_or_ours(out, manifest_path)
    reports.mkdir(parents=True, exist_ok=True)
    hasher = Hasher(reports / HASH_CACHE)
    previous = previous_records(manifest_path)
    steps = (*STEPS, CARD_STEP)
    manifest = Manifest(manifest_path, str(src), str(out), options.to_json(),
                        {s.name: StepRecord(s.name, s.title) for s in steps})
    manifest.status = "running"
    manifest.save()
    ctx = Context(src, out, options)
    ctx.progress = lambda done, total, detail="": on_event(StepEvent(ctx.step, "running", done, total, detail))
    try:
        for step in steps:
            if step is CARD_STEP:
                ctx.stop_servers()  # the card reads each server's whole log, kept when it stops
            _run_step(step, ctx, manifest, previous.get(step.name), hasher, on_event)
        manifest.status = COMPLETE
        manifest.finished = time.time()
        return manifest
    except KeyboardInterrupt:
        # A Ctrl-C between a step's "running" record reaching disk and its handler (or in
        # on_event) interrupts that step all the same: the manifest must say so, not "pending".
        for record in manifest.steps.values():
            if record.status == "running":
                record.status, record.message = INTERRUPTED, "interrupted (Ctrl-C); a re-run resumes here"
        manifest.status = INTERRUPTED
        raise
    finally:
        _close_run(ctx, manifest, hasher)


def _run_step(step: Step, ctx: Context, manifest: Manifest, old: StepRecord | None, hasher: Hasher, on_event: EventCallback) -> None:
    """One step: off, skipped (unchanged), or run and recorded. When the previous record cannot be
    reused whatever the key (``could_be_valid``), the key hashes beside the step (``_run_beside_key``):
    a cold source is read once, by both, instead of twice in a row."""
    record = manifest.steps[step.name]
    reason = step.off(ctx.options)
    if reason is not None:
        record.status, record.message = OFF, reason
        on_event(StepEvent(step.name, OFF, detail=reason))
        return
    key = None
    if could_be_valid(old, ctx.out):
        key = step_key(step, ctx, hasher, manifest)
        if still_valid(old, key, ctx.out, hasher, NOT_CHECKPOINT):
            record.status, record.key, record.artifacts, record.summary = SKIPPED, key, old.artifacts, old.summary
            record.seconds = old.seconds
            on_event(StepEvent(step.name, SKIPPED, detail="unchanged"))
            manifest.save()
            return
    ctx.step = step.name
    record.status, record.key = "running", key
    manifest.save()
    on_event(StepEvent(step.name, "running"))
    started = time.time()
    try:
        if key is None:
            _run_beside_key(step, ctx, record, lambda use: step_key(step, ctx, use, manifest), hasher)
        else:
            _run_timed(step, ctx, record)
    except KeyFailed as failed:
        # Taken first, the key's error stopped the run before the step: its record is as if it never ran.
        record.key, record.seconds, record.summary = None, None, {}
        raise failed.error from None
    except KeyboardInterrupt:
        record.status, record.message = INTERRUPTED, "interrupted (Ctrl-C); a re-run resumes here"
        manifest.status = INTERRUPTED
        on_event(StepEvent(step.name, INTERRUPTED))
        raise
    except Fp4forgeError as error:
        record.status, record.message = FAILED, str(error)
        manifest.status = FAILED
        on_event(StepEvent(step.name, FAILED, detail=str(error)))
        # Whatever the failed step managed to write stays in reports/ for inspection, recorded so
        # that the card quotes it as this run's (an audit with errors); its record is not finished,
        # so the next run redoes it.
        record.artifacts = _written_since(step, ctx, hasher, started)
        raise _step_failed(step, error, ctx.options) from error
    record.artifacts = _artifact_hashes(step, ctx, hasher)
    record.status = DONE
    hasher.save()
    manifest.save()
    on_event(StepEvent(step.name, DONE, detail=_summary_text(record.summary)))


def _run_timed(step: Step, ctx: Context, record: StepRecord) -> None:
    """The step itself; ``record.seconds`` is its own time, however it ends."""
    started = time.monotonic()
    try:
        with _named_by_path(step, ctx.options):
            record.summary = step.run(ctx) or {}
    finally:
        record.seconds = time.monotonic() - started


def _run_beside_key(step: Step, ctx: Context, record: StepRecord, key_with: Callable[[Hasher], str], hasher: Hasher) -> None:
    """The step, while ``key_with(hasher)`` hashes its inputs on a thread; ``record.key`` is set
    when both are done (a failed step waits for it too: its record is then as when the key came
    first). Ctrl-C stops the hash: an interrupted record has no key (a re-run redoes the step
    whatever it says). A failed hash raises ``KeyFailed``, after the step ended.

    Inputs that change while the step runs: the key may then hash content the step never read. So
    the inputs' stat stamps (size, mtime, inode: what the hash cache trusts too) are taken before
    the step and after both; when they differ the key is not recorded, and the next run redoes the
    step, as it would have had the key been taken first (its inputs' key changed since)."""
    stamps = key_with(StampHasher())
    keying = BackgroundKey(lambda: key_with(hasher), hasher)
    try:
        keying.start()
        _run_timed(step, ctx, record)
    except KeyboardInterrupt:
        keying.stop()
        raise
    except BaseException:
        record.key = keying.settle()
        raise
    key = keying.settle()
    try:
        unchanged = key_with(StampHasher()) == stamps
    except (OSError, SubprocessError):  # an input went away while the step ran (or vLLM's venv did not answer)
        unchanged = False
    record.key = key if unchanged else None


def _written_since(step: Step, ctx: Context, hasher: Hasher, since: float) -> dict[str, str]:
    """The hashes of the step's report artifacts written since ``since`` (a failed step's output,
    not an earlier run's file it never reached)."""
    written = {}
    for rel in step.artifacts:
        path = ctx.out / rel
        if rel != "." and path.exists() and path.stat().st_mtime >= since:
            written[rel] = hasher.path(path) or ""
    return written


def _named_by_path(step: Step, options: PipelineOptions) -> Any:
    """Errors of a step about its own job's options name them by their path (``calibration.tokenizer``)."""
    if not step.options:
        return contextlib.nullcontext()
    return option_path(step.options, type(getattr(options, step.options)))


def _step_failed(step: Step, error: Fp4forgeError, options: PipelineOptions) -> PipelineFailed:
    # The option travels only when it is one of the pipeline's own (a front end spells it).
    own = error.option if options.has_option(error.option) else None
    return PipelineFailed(f"step {step.name} failed: {error.message if own else error}", option=own,
                          file=error.file if own else None, tensor=error.tensor if own else None)


def _close_run(ctx: Context, manifest: Manifest, hasher: Hasher) -> None:
    """Stop the servers, drop the staging area of a complete run, record the manifest."""
    ctx.stop_servers()
    if manifest.status == COMPLETE:
        shutil.rmtree(ctx.out / STAGING, ignore_errors=True)
    for record in manifest.steps.values():
        if record.status in (PENDING, "running") and manifest.status != COMPLETE:
            record.status = PENDING
    hasher.save()
    manifest.save()


def _summary_text(summary: dict[str, Any]) -> str:
    parts = []
    for key, value in summary.items():
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return ", ".join(parts)
