"""The pipeline's steps: each calls the library function its command calls, and writes its
artifact under ``OUT/reports/`` (or, for quantize, the checkpoint files into ``OUT``).

A step declares what its key hashes (``inputs``: paths; ``params``: options) and which artifacts
it leaves (paths relative to OUT; ``"."`` is the checkpoint itself). The table ``STEPS`` is the
order they run in.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fp4forge.calibrate.options import CalibrationOptions
from fp4forge.checkpoint.atomic import replace_dir
from fp4forge.errors import ConfigError, Fp4forgeError, PipelineStepError, ServeError, require_choice
from fp4forge.fidelity.options import FidelityOptions
from fp4forge.pipeline.state import write_json as write_json_file
from fp4forge.quantize.job import QuantizeJob
from fp4forge.serve.options import ServeUpOptions
from fp4forge.serve.recommend import ServeCmdOptions

Progress = Callable[[int, int, str], None]

REPORTS = "reports"
STAGING = ".fp4forge-staging"
CARD = "README.md"
# Entries of OUT that are not part of the checkpoint (its tree hash leaves them out).
NOT_CHECKPOINT = (REPORTS, STAGING, CARD)
BENCH_KINDS = ("perf", "quality")


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """A report under ``reports/``, saying which fp4forge wrote it."""
    from fp4forge import versioned

    write_json_file(path, versioned(doc))


# The pipeline serves on this machine's CPU by default: the smallest workload that says something there.
PIPELINE_PERF_WORKLOAD = "cpu-tiny"


def _pipeline_perf(**given: Any) -> Any:
    """The perf step's ``PerfOptions`` (its server filled in when it runs); ``given`` overrides."""
    from fp4forge.bench.perf import perf_options

    return perf_options(url="", model="", out_dir=Path("bench"), **{"workload": PIPELINE_PERF_WORKLOAD, **given})


# Thinking is on by default (as Laguna's template): a turn is reasoning, </think>, then the answer.
# The trained testbed's longest turns are ~80 tokens; 64 cut a fifth of them (an unread turn).
PIPELINE_QUALITY = {"runs": 2, "max_tokens": 128, "concurrency": 4}


def _pipeline_quality(**given: Any) -> Any:
    """The quality runs' ``RunConfig`` (its server filled in when it runs); ``given`` overrides."""
    from fp4forge.quality.runner import run_config

    return run_config(base_url="", model="", **{**PIPELINE_QUALITY, **given})


@dataclass(frozen=True)
class PipelineOptions:
    """The jobs' own options, nested (``quantize``: a ``QuantizeJob``; ``calibration``:
    ``CalibrationOptions``; ``fidelity``: ``FidelityOptions``; ``perf``: ``PerfOptions``, its
    server filled in when it runs), and the pipeline's. An error's ``option`` is a dotted path
    (``fidelity.numerics``). Every option is checked when the object is made, before any step."""

    quantize: QuantizeJob  # its recipe loaded when made
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    fidelity: FidelityOptions = field(default_factory=FidelityOptions)
    audit_deep: bool = True
    vllm_version: str | None = None
    hardware: str = ServeCmdOptions.hardware  # the serve line and its traps are written for this target
    sibling: Path | None = None  # a checkpoint of the same model to diff against
    serve: bool = False  # serve OUT on this machine (vLLM in vllm_venv, with the plugin on CPU)
    vllm_venv: Path | None = None
    serve_hardware: str = ServeUpOptions.hardware
    serve_timeout_s: float = ServeUpOptions.ready_timeout_s
    bench: tuple[str, ...] = ()  # "perf", "quality"
    perf: Any = field(default_factory=_pipeline_perf)  # fp4forge.bench.perf.PerfOptions
    quality: Any = field(default_factory=_pipeline_quality)  # fp4forge.quality.runner.RunConfig
    quality_categories: tuple[str, ...] = ()
    quality_teacher: bool = False  # also serve SRC and compare the two arms with paired tests
    quality_allow_unreadable: bool = False  # score an arm whose answers are mostly unread (loud warning)
    base_model: str | None = None  # the card's front matter base_model (None: what the source says)

    def __post_init__(self) -> None:
        from fp4forge.quality.suite import load_suite
        from fp4forge.report.card import card_options
        from fp4forge.serve.recommend import HARDWARE

        card_options(base_model=self.base_model)  # the card step's option, checked before any step
        require_choice(self.hardware, HARDWARE, "hardware")
        require_choice(self.serve_hardware, HARDWARE, "serve_hardware")
        unknown = set(self.bench) - set(BENCH_KINDS)
        if unknown:
            raise ConfigError(f"takes {' and/or '.join(BENCH_KINDS)}, got {', '.join(sorted(unknown))}", option="bench")
        if self.quality_categories:
            try:
                load_suite().select(categories=list(self.quality_categories))
            except Fp4forgeError as error:
                raise ConfigError(error.message, option="quality_categories") from None

    @property
    def recipe_spec(self) -> Any:
        """The parsed recipe (a ``quantize.recipe.Recipe``)."""
        return self.quantize.recipe_spec

    def to_json(self) -> dict[str, Any]:
        return _plain(self)

    def value(self, path: str) -> Any:
        """The option at a dotted ``path`` (``fidelity.numerics``), as ``to_json`` writes it."""
        value: Any = self.to_json()
        for part in path.split("."):
            value = value[part]
        return value

    def has_option(self, path: str | None) -> bool:
        """Whether ``path`` names an option of the pipeline (``fidelity.numerics``, ``hardware``)."""
        from dataclasses import fields, is_dataclass

        value: Any = self
        for part in (path or "").split("."):
            if not is_dataclass(value) or part not in {f.name for f in fields(value) if f.init}:
                return False
            value = getattr(value, part)
        return True


def _plain(value: Any) -> Any:
    """Options as JSON: dataclasses as objects of their init fields, paths as strings, a recipe by name."""
    from dataclasses import fields, is_dataclass

    from fp4forge.quantize.recipe import Recipe

    if isinstance(value, Recipe):
        return value.source or value.name
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


SERVERS = "servers"  # reports/servers/<role>.log and .json: each server's whole life


class ServerSlot:
    """A vLLM server the serving steps share (the export, or the BF16 teacher): started by the
    first step that needs it, stopped when the run ends or another model needs the machine.

    While it starts, each log line goes to the step's progress as a live status. When it stops,
    its whole log (not only the start-up) is kept as ``reports/servers/<role>.log`` and the log
    doctor's findings before and after readiness, the steps it served and a path-free command
    (with the environment it ran with) go to ``reports/servers/<role>.json``.
    """

    def __init__(self, ctx: Context, model: Path, role: str) -> None:
        self.ctx = ctx
        self.model = model
        self.role = role
        self.record = None
        self.doctor = None
        self.ready_seconds: float | None = None
        self.ready_line: int | None = None  # log lines up to readiness
        self.steps: list[str] = []
        self._directory = ctx.out / STAGING / "serve-state"

    @property
    def served_name(self) -> str:
        """The name the portable command serves the model under (the directory's name, not this run's random one)."""
        return self.model.resolve().name

    def portable_command(self) -> str | None:
        from fp4forge.serve.launcher import portable_command

        if self.record is None:
            return None
        return portable_command(self.record.command, self.record.env, served_model_name=self.served_name)

    def get(self):  # type: ignore[no-untyped-def]
        if self.record is None:
            from fp4forge.serve.options import serve_up_options, start_server
            from fp4forge.serve.process import startup_status

            venv = self.ctx.options.vllm_venv
            if venv is None:
                raise ServeError("serving needs a vLLM venv", option="vllm_venv")
            self._directory.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            what = f"starting vLLM ({self.role}: {self.served_name})"
            self.ctx.progress(0, 0, what)

            def on_line(line: str) -> None:
                status = startup_status(line)
                if status:
                    self.ctx.progress(0, 0, f"{what}, {time.monotonic() - started:.0f} s: {status}")

            options = serve_up_options(venv=venv, name=f"fp4forge-{self.role}-{os.getpid()}", hardware=self.ctx.options.serve_hardware,
                                       ready_timeout_s=self.ctx.options.serve_timeout_s, directory=self._directory)
            self.record, self.doctor = start_server(self.model, options, on_line=on_line)
            self.ready_seconds = time.monotonic() - started
            self.ready_line = self.doctor.line_count
            self.ctx.progress(0, 0, f"vLLM ({self.role}) ready after {self.ready_seconds:.0f} s")
        if self.ctx.step and self.ctx.step not in self.steps:
            self.steps.append(self.ctx.step)
        return self.record

    def stop(self) -> None:
        if self.record is not None:
            from fp4forge.serve.process import serve_down

            record = self.record
            serve_down([record.name], directory=self._directory)
            self.record = None
            self._keep_life(record)

    def _keep_life(self, record: Any) -> None:
        """The whole log and what the doctor finds in it, before and after readiness."""
        from fp4forge.serve.doctor import diagnose, iter_lines
        from fp4forge.serve.launcher import portable_command

        directory = self.ctx.reports / SERVERS
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / f"{self.role}.log"
        try:
            shutil.copyfile(record.log, log)
            text = log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        try:
            diagnosis = diagnose(iter_lines(text), checkpoint=str(self.model))
        except Fp4forgeError:  # the checkpoint no longer reads: the log alone still says what happened
            diagnosis = diagnose(iter_lines(text), find_checkpoint=False)
        ready = self.ready_line or 0
        findings = [f.to_json() for f in diagnosis.findings]
        write_json(directory / f"{self.role}.json", {
            "role": self.role,
            "model": "." if self.role == "student" else self.served_name,
            "hardware": self.ctx.options.serve_hardware,
            "vllm_version": diagnosis.vllm_version,
            "verdict": diagnosis.verdict.to_json(),  # the doctor's verdict over the whole life
            "command": portable_command(record.command, record.env, served_model_name=self.served_name),
            "env": {k: v for k, v in record.env.items()},
            "ready_seconds": self.ready_seconds,
            "ready_line": ready,
            "log_lines": len(text.splitlines()),
            "served_steps": self.steps,
            "log": f"{self.role}.log",
            "startup_findings": [f for f in findings if f["line"] <= ready],
            "findings_after_ready": [f for f in findings if f["line"] > ready],
        })


@dataclass
class Context:
    src: Path
    out: Path
    options: PipelineOptions
    progress: Progress = lambda done, total, desc: None
    servers: dict[str, ServerSlot] = field(default_factory=dict)
    step: str = ""  # the running step (a server records which steps it served)

    @property
    def reports(self) -> Path:
        return self.out / REPORTS

    def report(self, name: str) -> Path:
        return self.reports / name

    def staging(self, step: str) -> Path:
        """A fresh scratch directory for ``step`` inside OUT (same filesystem: renames are atomic)."""
        path = self.out / STAGING / step
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def slot(self, role: str = "student") -> ServerSlot:
        """The server of ``role`` (student: OUT; teacher: SRC). One runs at a time: on a small
        machine two would slow both and skew what is measured."""
        for other, slot in self.servers.items():
            if other != role:
                slot.stop()
        if role not in self.servers:
            self.servers[role] = ServerSlot(self, self.out if role == "student" else self.src, role)
        return self.servers[role]

    def stop_servers(self) -> None:
        for slot in self.servers.values():
            slot.stop()


# -- steps --------------------------------------------------------------------------------------
def run_calibrate(ctx: Context) -> dict[str, Any]:
    from fp4forge.calibrate.run import calibrate_to_file

    options = replace(ctx.options.calibration, spill_dir=ctx.staging("calibrate"))
    summary = calibrate_to_file(ctx.src, ctx.report("calibration-stats.safetensors"), options, progress=ctx.progress)
    write_json(ctx.report("calibration.json"), {**summary, "statistics": "calibration-stats.safetensors"})
    return {"tokens": summary["tokens"], "experts_without_tokens": len(summary.get("experts_without_tokens", []))}


def run_quantize(ctx: Context) -> dict[str, Any]:
    from fp4forge.quantize.job import run_quantize as quantize_job

    job = replace(ctx.options.quantize, stats=ctx.report("calibration-stats.safetensors"), act_scales=None)
    # The writer builds (and on a re-run resumes) beside its destination, then renames it into
    # place; the staged files then replace the previous checkpoint's, one rename each.
    staged = ctx.out / STAGING / "quantize" / "checkpoint"
    if staged.exists():
        shutil.rmtree(staged)  # a finished export whose move was interrupted: the writer wants a new path
    staged.parent.mkdir(parents=True, exist_ok=True)
    result = quantize_job(ctx.src, staged, job, progress=ctx.progress)
    fresh = {p.name for p in staged.iterdir()}
    for name in sorted(fresh):  # replace first, then drop what the new export no longer has
        os.replace(staged / name, ctx.out / name)
    for old in list(ctx.out.iterdir()):
        if old.name not in NOT_CHECKPOINT and old.name not in fresh:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    shutil.rmtree(staged.parent, ignore_errors=True)
    doc = result.to_json()
    doc["output"] = "."
    write_json(ctx.report("quantize.json"), doc)
    return {"tensors": doc["tensors_written"], "bytes": doc["bytes_written"]}


def run_kv(ctx: Context) -> dict[str, Any]:
    from fp4forge.calibrate import kv

    report = kv.show(ctx.out).to_json()
    report["checkpoint"] = "."
    write_json(ctx.report("kv.json"), report)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    if errors:
        raise PipelineStepError("KV scales: " + "; ".join(f["message"] for f in errors))
    return {"layers": len(report["layers"]), "declared": report["declared"]}


def run_audit(ctx: Context) -> dict[str, Any]:
    from fp4forge.audit.engine import audit_checkpoint
    from fp4forge.audit.options import audit_options
    from fp4forge.audit.shard_facts import shard_facts
    from fp4forge.checkpoint.reader import open_checkpoint

    o = ctx.options
    # the deep audit reduces the values where the export ran (its device), right after the export
    # wrote them: the shards are read from the page cache where memory holds them
    report = audit_checkpoint(str(ctx.out), audit_options(deep=o.audit_deep, vllm_version=_vllm_minor(o), device=o.quantize.device))
    doc = report.to_json()
    doc["checkpoint"] = "."
    write_json(ctx.report("audit.json"), doc)
    facts = shard_facts(open_checkpoint(str(ctx.out)))
    write_json(ctx.report("shards.json"), facts)
    if report.summary["errors"]:
        rules = sorted({f["rule"] for f in doc["findings"] if f["severity"] == "error"})
        raise PipelineStepError(f"the audit found {report.summary['errors']} error(s) ({', '.join(rules)}): see {ctx.report('audit.json')}")
    return dict(report.summary)


def run_bytes(ctx: Context) -> dict[str, Any]:
    from fp4forge.audit.byte_table import byte_table_of

    doc = byte_table_of(str(ctx.out)).to_json()
    doc["checkpoint"] = "."
    write_json(ctx.report("bytes.json"), doc)
    return {"bpp": round(doc["total"]["bpp"] or 0, 3), "experts_bpp": round(doc.get("experts_bpp") or 0, 3)}


def run_diff(ctx: Context) -> dict[str, Any]:
    from fp4forge.audit.diff import diff_checkpoints

    assert ctx.options.sibling is not None
    doc = diff_checkpoints(str(ctx.out), str(ctx.options.sibling)).to_json()
    write_json(ctx.report("diff.json"), {"sibling": str(ctx.options.sibling), **doc})
    return dict(doc.get("summary", {}))


def run_fidelity(ctx: Context) -> dict[str, Any]:
    from fp4forge.fidelity.evaluate import evaluate
    from fp4forge.serve.recommend import target_numerics

    o = ctx.options
    # The MoE input-scale reduction the target's backend applies (one global max, or per expert):
    # fidelity measures the numerics the serve line will run, and says which.
    served = target_numerics(o.hardware, weight_only=o.fidelity.numerics == "w4a16")
    options = replace(o.fidelity, moe_input_scale=served.fidelity_options()["moe_input_scale"])
    doc = evaluate(ctx.src, ctx.out, options, progress=ctx.progress).to_json()
    doc["student"] = "."
    doc["served_numerics"] = {**served.to_json(), "describe": served.describe()}
    write_json(ctx.report("fidelity.json"), doc)
    return {"kl_mean": doc["metrics"]["kl"]["mean"], "top1": doc["metrics"]["top1_agreement"]}


def run_serve_cmd(ctx: Context) -> dict[str, Any]:
    from fp4forge.serve.recommend import serve_cmd_options, serve_command

    o = ctx.options
    rec = serve_command(str(ctx.out), serve_cmd_options(hardware=o.hardware, vllm_version=o.vllm_version, venv=None))
    write_json(ctx.report("serve-cmd.json"), rec.to_json())
    return {"hardware": o.hardware, "warnings": len(rec.to_json()["warnings"])}


def run_serve(ctx: Context) -> dict[str, Any]:
    from fp4forge.serve.recommend import cpu_kv_fallback, read_checkpoint_facts

    slot = ctx.slot("student")
    record = slot.get()
    diagnosis = slot.doctor.diagnosis()  # fed the startup log line by line until readiness
    shutil.copyfile(record.log, ctx.report("serve.log"))
    # the same decision serve_up's serve line made (recommend): a declared FP8 KV cache this CPU
    # cannot keep is served unquantized, and the card must say so
    fallback = cpu_kv_fallback(read_checkpoint_facts(str(slot.model)), ctx.options.serve_hardware)
    write_json(ctx.report("serve.json"), {
        "hardware": ctx.options.serve_hardware,
        "vllm_version": diagnosis.vllm_version,
        "command": record.command,  # as run here (this machine's paths, a free port)
        "reproducible_command": slot.portable_command(),  # what the card shows
        "env": dict(record.env),
        "kv_fallback": None if fallback is None else fallback.to_json(),
        "ready_seconds": slot.ready_seconds,
        "log": "serve.log",
        **{k: v for k, v in diagnosis.to_json().items() if k != "vllm_version"},  # verdict, findings
    })
    errors = [f for f in diagnosis.findings if f.severity == "error"]
    if errors:
        raise PipelineStepError("the vLLM log has errors: " + "; ".join(f"[{f.id}] {f.message}" for f in errors))
    return {"findings": len(diagnosis.findings), "ready_s": round(slot.ready_seconds or 0, 1), "verdict": diagnosis.verdict_line}


def run_perf(ctx: Context) -> dict[str, Any]:
    from fp4forge.bench.perf import run_perf as bench_perf
    from fp4forge.bench.runner import CellEvent
    from fp4forge.report.bench_plots import BENCH_PRESENTER

    o = ctx.options
    record = ctx.slot("student").get()
    staged = ctx.staging("perf") / "bench"
    options = replace(o.perf, url=record.base_url, model=record.name, out_dir=staged, server_log=Path(record.log))
    config = options.bench_config
    requests = len(config.shapes) * len(config.points) * (config.warmups + config.samples)
    finished: dict[tuple[str, str], int] = {}

    def on_event(event: CellEvent) -> None:
        finished[(event.load, event.shape)] = event.done + (config.warmups if event.phase != "warmup" else 0)
        ctx.progress(sum(finished.values()), requests, f"bench perf {event.load} {event.shape}")

    result = bench_perf(options, on_event=on_event, presenter=BENCH_PRESENTER, plots=True)
    if result.interrupted:
        raise KeyboardInterrupt
    if result.stopped is not None:
        raise result.stopped
    replace_dir(staged, ctx.report("bench"))
    if result.failed:
        raise PipelineStepError(f"{result.failed} benchmark request(s) failed; see {ctx.report('bench') / 'summary.md'}")
    return {"requests": result.outcome.requests, "kept": result.outcome.kept}


QUALITY_ARMS = {"student": "quantized", "teacher": "bf16-teacher"}
QUALITY_DIRS = {"student": "quality", "teacher": "quality-teacher"}


def _quality_runs(ctx: Context, role: str) -> Any:
    """N runs of the (selected) suite against the ``role`` server into reports/<dir>/, scored there;
    the ``QualityOutcome``."""
    from fp4forge.quality.evaluate import run_and_score
    from fp4forge.quality.suite import load_suite
    from fp4forge.report.quality_files import write_score

    o = ctx.options
    record = ctx.slot(role).get()
    suite = load_suite()
    categories = list(o.quality_categories) or None
    config = replace(o.quality, base_url=record.base_url, model=record.name, arm=QUALITY_ARMS[role])
    staged = ctx.staging(QUALITY_DIRS[role]) / QUALITY_DIRS[role]
    final = ctx.report(QUALITY_DIRS[role])
    total = len(suite.select(categories=categories)) * o.quality.runs
    finished = [0]

    def on_scenario(run: int, scenario_record: dict[str, Any]) -> None:
        finished[0] += 1
        ctx.progress(finished[0], total, f"quality {QUALITY_ARMS[role]} run {run}")

    def publish(directory: Path) -> Path:
        replace_dir(directory, final)
        return final

    # Scored where the transcripts end up (publish), so the score document names their real paths.
    outcome = run_and_score(config, staged, categories=categories, suite=suite, on_scenario=on_scenario, publish=publish,
                            write=write_score, allow_unreadable=o.quality_allow_unreadable)
    if outcome.failed_requests:
        raise PipelineStepError(f"{outcome.failed_requests} quality request(s) failed; transcripts in {final}")
    return outcome


def _points(results: list[Any]) -> str:
    """Points of max possible per run ("28 / 349, 30 / 349"), never a bare "28 / 28"."""
    return ", ".join(f"{r.earned} / {r.max}" for r in results)


def _answers_summary(block: dict[str, Any]) -> dict[str, str]:
    """An unreadable arm, in the step's summary line. The step itself finishes, so that the card is
    written and carries the refusal (a failed step would stop the pipeline before its card)."""
    if not block.get("unreadable"):
        return {}
    arms = "; ".join(f"{arm}: {h['unread']} of {h['turns']} turns unread ({h['truncated']} cut at max tokens, "
                     f"{h['reasoning_only']} reasoning only)" for arm, h in block["arms"].items() if h["unreadable"])
    return {"REFUSED (not scored)" if block["refused"] else "WARNING (unreadable, scored anyway)": arms}


def run_quality(ctx: Context) -> dict[str, Any]:
    outcome = _quality_runs(ctx, "student")
    return {"runs": len(outcome.results), "points": _points(outcome.results), **_answers_summary(outcome.document["answers"])}


def run_quality_teacher(ctx: Context) -> dict[str, Any]:
    """Arm B: the BF16 teacher through the same suite, then paired tests of the two arms."""
    from fp4forge.quality.compare import compare_options, compare_runs
    from fp4forge.report.quality_files import write_compare

    teacher = _quality_runs(ctx, "teacher").results
    doc = compare_runs([ctx.report(QUALITY_DIRS["student"])], teacher, compare_options(allow_unreadable=ctx.options.quality_allow_unreadable))
    write_compare(doc, ctx.report(QUALITY_DIRS["teacher"]))
    return {"verdict": doc["verdict"]["label"], "diff_points": round(doc["points"]["diff"], 1),
            "teacher points": _points(teacher), **_answers_summary(doc["answers"])}


def run_card(ctx: Context) -> dict[str, Any]:
    from fp4forge.report.card import card_options, write_card

    card = write_card(ctx.out, card_options(reports=ctx.reports, out=ctx.out / CARD, base_model=ctx.options.base_model))
    return {"verdict": card.verdict.decision if card.verdict else "–", "sections": len(card.sections), "not quoted": len(card.missing)}


def _vllm_minor(options: PipelineOptions) -> str:
    from fp4forge.serve.recommend import target_vllm_version

    version = target_vllm_version(options.vllm_version)
    return ".".join(version.split(".")[:2])


# -- the table ----------------------------------------------------------------------------------
Off = Callable[[PipelineOptions], "str | None"]  # why a step does not run, or None


def _always(_: PipelineOptions) -> str | None:
    return None


def _needs_serve(o: PipelineOptions) -> str | None:
    return None if o.serve else "serving not requested (--serve), or no vLLM venv (`make vllm` creates one)"


def _needs_bench(kind: str) -> Off:
    def off(o: PipelineOptions) -> str | None:
        if kind not in o.bench:
            return f"not requested (--bench {kind})"
        return _needs_serve(o)

    return off


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    run: Callable[[Context], dict[str, Any]]
    artifacts: tuple[str, ...]  # relative to OUT; "." is the checkpoint
    inputs: tuple[str, ...]  # "src", "checkpoint", or report paths relative to reports/
    params: tuple[str, ...] = ()  # PipelineOptions option paths (``fidelity.numerics``) in the key
    off: Off = _always
    options: str = ""  # the nested options its errors are about (``calibration``): they name them by path
    version: int = 1  # bump when a step's code changes what it writes


QUALITY_PARAMS = ("quality.runs", "quality.max_tokens", "quality.concurrency", "quality_categories", "quality_allow_unreadable")
# The sample options that choose the text a step runs (the files' contents are hashed, not their names).
SAMPLE_TEXT = ("samples", "seq_len", "text_files", "builtin_corpus", "tokenizer")

STEPS: tuple[Step, ...] = (
    Step("calibrate", "calibrate activations and KV (layer-streamed)", run_calibrate,
         ("reports/calibration.json", "reports/calibration-stats.safetensors"), ("src",),
         tuple(f"calibration.{name}" for name in SAMPLE_TEXT) + ("calibration.batch_size", "calibration.policy", "calibration.portable"), options="calibration"),
    # version 2: only the source's model-repository files are copied (checkpoint/names.py MODEL_REPO_FILES)
    Step("quantize", "quantize by the recipe", run_quantize, (".", "reports/quantize.json"),
         ("src", "calibration-stats.safetensors", "recipe"),
         ("quantize.layout_format", "quantize.block_scales", "quantize.max_shard_bytes", "quantize.error_report", "quantize.method", "quantize.gptq"),
         options="quantize", version=2),
    Step("kv", "check the FP8 KV scales", run_kv, ("reports/kv.json",), ("checkpoint",)),
    Step("audit", "audit (stops on errors)", run_audit, ("reports/audit.json", "reports/shards.json"), ("checkpoint",),
         ("audit_deep", "vllm_version")),
    Step("bytes", "where the bytes are", run_bytes, ("reports/bytes.json",), ("checkpoint",)),
    Step("diff", "diff against the sibling", run_diff, ("reports/diff.json",), ("checkpoint", "sibling"),
         off=lambda o: None if o.sibling else "no --sibling given"),
    # version 2: every number with its interval over documents, the teacher's readability checked
    Step("fidelity", "fidelity against the BF16 teacher", run_fidelity, ("reports/fidelity.json",), ("src", "checkpoint"),
         tuple(f"fidelity.{name}" for name in SAMPLE_TEXT) + ("fidelity.batch_size", "fidelity.numerics", "fidelity.allow_unreadable", "hardware"),
         options="fidelity", version=2),
    Step("serve-cmd", "the serve line for the target hardware", run_serve_cmd, ("reports/serve-cmd.json",), ("checkpoint",),
         ("hardware", "vllm_version")),
    Step("serve", "serve it here (vLLM) and read the log", run_serve, ("reports/serve.json", "reports/serve.log"),
         ("checkpoint", "vllm"), ("serve_hardware",), off=_needs_serve, version=2),  # 2: a reproducible command, the env
    Step("perf", "bench perf", run_perf, ("reports/bench",), ("checkpoint", "vllm"), ("perf.workload", "perf.mode"),
         off=_needs_bench("perf"), options="perf"),
    # version 2: the arm is labelled "quantized"; 3: answers streamed, unreadable arms refused.
    Step("quality", "bench quality (agentic tool use)", run_quality, ("reports/quality",), ("checkpoint", "vllm"),
         QUALITY_PARAMS,
         off=_needs_bench("quality"), version=3),
    Step("quality-teacher", "quality of the BF16 teacher, paired tests", run_quality_teacher, ("reports/quality-teacher",),
         ("src", "quality", "vllm"),
         QUALITY_PARAMS,
         off=lambda o: _needs_bench("quality")(o) or (None if o.quality_teacher else "not requested (--quality-teacher)"),
         version=2),
)
# The card runs last, always, from whatever artifacts exist; keyed also by which steps finished in
# this run, so that a step turned off (a re-run without --serve) re-renders it.
CARD_STEP = Step("card", "the model card", run_card, (CARD,), ("reports", "steps"), ("base_model",), version=2)
