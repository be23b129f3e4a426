"""What the quality suite can resolve on the shipped testbed, and where it starts to separate.

The suite is played offline (``offline_suite``: the suite's runner, simulated tools and scorer,
transformers' generation, each turn of every scenario in one batched generation), every run
sampled at ``temperature``; run k of every arm uses seed k (each request's draws depend on the
seed, the scenario and the turn alone), so a paired comparison sees the arms' difference under the
same draws, and an arm's runs differ from each other only by the draws (its A/A floor).

Two parts, each one command that fits a 10-minute slot on one GPU (``--part``):

1. **resolution.** The shipped testbed in BF16 against the study's arms (``lab/study/run.py``):
   NVFP4 W4A4 and W4A16 (min-max block scales), FP8 W8A8, INT2 g16 (3.5 bits) and g32 (2.5 bits).
   The students are the ones the study writes (``write_arm_student``); exported ones are played
   through ``fidelity.reference``'s forward with the numerics a server runs, the INT2 arms as
   fake-quantized BF16 copies. Per arm: points per run and the suite's own comparison against BF16
   (``quality.stats.compare_arms``); for the suite: the A/A comparison and the minimum effect it
   detects at this size with this many runs.
2. **curve.** Testbeds of the default recipe trained at several lengths (steps) and widths
   (hidden, attention heads and every MLP size times ``width``) and seeds; per build: held-out
   perplexity, expert-weight kurtosis, and BF16 against the 2.5-bit arm (``int2-g32-mse``). GPU
   builds are exploration: not the CPU build the project ships, and never cached.

Each training, student and play is a job of a pool of worker processes. Jobs start in rounds (run
1 of every arm, then run 2, ...) while a job of their kind is expected to end before
``--budget-minutes``; at ``--deadline-minutes`` whatever still runs is stopped and named. OUT gets
few plain files, rewritten as jobs finish: ``jobs.json`` (every job), ``plays.tar.gz`` (every
play's per-scenario points and texts), ``resolution.json`` and ``resolution.md`` (the tables,
``suite_resolution_report``). Students and builds go to a fresh folder under ``--work-root``,
removed at the end. ``--report-only --from DIR...`` writes the tables from several output folders
(both parts; more seeds of one part from ``--first-seed``).

    python -m fp4forge.lab.diagnostics.suite_resolution --part resolution --out OUT   # on a GPU
    python -m fp4forge.lab.diagnostics.suite_resolution --part curve --out OUT2
    python -m fp4forge.lab.diagnostics.suite_resolution --report-only --from OUT OUT2 --out DOCS
    python -m fp4forge.lab.diagnostics.suite_resolution --part resolution --toy --out OUT   # minutes on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from fp4forge.checkpoint.atomic import atomic_file, write_json_atomic
from fp4forge.errors import ConfigError
from fp4forge.lab.diagnostics.suite_resolution_report import ARMS, BF16, CURVE_ARM, JOBS_FILE, PLAYS_TAR, SHIPPED, play_name, write_report

PARTS = ("resolution", "curve")


@dataclass(frozen=True)
class Plan:
    runs: int  # sampled runs per arm on the shipped testbed (0: none)
    curve_runs: int  # sampled runs per arm on each curve build
    curve: tuple[tuple[int, int, int], ...]  # (steps, width, seed) per build
    temperature: float = 0.7
    max_new_tokens: int = 128
    limit: int | None = None  # the first N scenarios (None: the whole suite)
    calibration_samples: int = 32
    eval_windows: int = 24
    workers: int = 8
    first_seed: int = 0  # runs use seeds first_seed, first_seed + 1, ...
    # No job starts that is expected to end after the budget; at the deadline what still runs is
    # stopped, then the report: with start-up and installation, within a 9-minute command.
    budget_minutes: float = 6.0
    deadline_minutes: float = 7.0


# On a GPU: more runs than the budget is expected to allow; rounds keep the arms' run counts equal.
# A play is at most 3 batched rounds (the suite's scenarios have up to 3 steps) of up to 128 tokens.
GPU_PLANS = {
    "resolution": Plan(runs=32, curve_runs=0, curve=()),
    # The shipped recipe is 440 steps at width 1; 2,000 steps take about 1.5 min alone on an H100.
    "curve": Plan(runs=0, curve_runs=16, curve=((500, 1, 0), (2000, 1, 0), (2000, 2, 0), (2000, 2, 1))),
}
# Every kind of job, small: the whole path on a 2-core CPU (widths and seeds go through the same code).
_TOY = Plan(runs=0, curve_runs=0, curve=(), max_new_tokens=24, limit=4, calibration_samples=2, eval_windows=2, workers=2,
            budget_minutes=30.0, deadline_minutes=40.0)
TOY_PLANS = {"resolution": replace(_TOY, runs=2), "curve": replace(_TOY, curve_runs=2, curve=((2, 1, 0), (2, 2, 1)))}


def parse_curve(text: str) -> tuple[tuple[int, int, int], ...]:
    """``STEPSxWIDTH@SEED,...`` (e.g. ``500x1@0,2000x2@1``) as (steps, width, seed) triples."""
    builds = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            size, seed = item.split("@")
            steps, width = size.split("x")
            build = (int(steps), int(width), int(seed))
        except ValueError:
            raise ConfigError(f"curve build {item!r} is not STEPSxWIDTH@SEED (e.g. 2000x2@1)") from None
        if build[0] < 1 or build[1] < 1 or build[2] < 0:
            raise ConfigError(f"curve build {item!r}: steps and width must be at least 1, the seed at least 0")
        builds.append(build)
    return tuple(builds)


def build_name(steps: int, width: int, seed: int) -> str:
    return f"s{steps}-w{width}@{seed}"


@dataclass
class Job:
    name: str
    fn: Callable[..., dict[str, Any]]
    args: Callable[[dict[str, dict[str, Any]]], tuple[Any, ...]]  # from the finished jobs' results
    deps: tuple[str, ...] = ()
    round: int = 0  # plays: the run number; 0 for what plays need first
    result: dict[str, Any] | None = None
    error: str | None = None
    seconds: float | None = None

    @property
    def kind(self) -> str:
        """Jobs expected to take alike: a play of one arm on one build (any seed), else the name."""
        return self.name.rsplit(":", 1)[0] if self.name.startswith("play:") else self.name


# -- the jobs (each runs in a worker process) ----------------------------------------------------
def calibrate_job(out: str, src: str, samples: int) -> dict[str, Any]:
    from fp4forge.lab.study.run import calibrate_for_arms, study_options

    options = study_options(calibration_samples=samples, calibration_text_files=(str(Path(src) / "fp4forge-calibration.jsonl"),))
    calibrate_for_arms(src, Path(out) / "stats.safetensors", options)
    return {"stats": str(Path(out) / "stats.safetensors")}


def student_job(out: str, src: str, arm: str, stats: str | None) -> dict[str, Any]:
    from fp4forge.lab.study.run import StudyOptions, write_arm_student

    student = write_arm_student(arm, src, Path(out) / "students" / f"{Path(src).parent.name}-{arm}", StudyOptions(), Path(stats) if stats else None)
    return {"path": str(student.path), "numerics": student.numerics, "bpp": student.bpp, "dense": student.dense}


@contextlib.contextmanager
def _widened(width: int) -> Any:
    """The testbed's model config with hidden size, heads and every MLP size times ``width`` (head
    size kept), for this process's trainings: the recipe's shape lives in ``testbed.tiny``, whose
    source bytes are part of the shipped build's cache key, so the probe varies it from outside."""
    from fp4forge.lab.trained import training

    base = training.tiny_laguna_config

    def config(*args: Any, **kwargs: Any) -> Any:
        made = base(*args, **kwargs)
        for name in ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "num_attention_heads", "num_key_value_heads"):
            setattr(made, name, getattr(made, name) * width)
        made.num_attention_heads_per_layer = [heads * width for heads in made.num_attention_heads_per_layer]
        return made

    training.tiny_laguna_config = config
    try:
        yield
    finally:
        training.tiny_laguna_config = base


@contextlib.contextmanager
def _loose_determinism(device: str) -> Any:
    """On a GPU, training without deterministic kernels (the router-load bincount has no
    deterministic CUDA kernel): exploration, as ``sweep_trained`` does."""
    from fp4forge.lab.trained import training

    strict = training.deterministic_torch
    if device != "cpu":
        @contextlib.contextmanager
        def loose(threads: int) -> Any:
            yield

        training.deterministic_torch = loose
    try:
        yield
    finally:
        training.deterministic_torch = strict


def train_job(out: str, steps: int, width: int, seed: int, device: str, eval_windows: int) -> dict[str, Any]:
    """One curve build: the default recipe at ``steps`` and ``width`` from ``seed``, on ``device``."""
    from fp4forge.lab.trained.build import build_trained_laguna
    from fp4forge.lab.trained.training import TrainingConfig

    config = replace(TrainingConfig(), steps=steps, eval_windows=eval_windows)
    model_dir = Path(out) / "builds" / build_name(steps, width, seed) / "model"
    with _widened(width), _loose_determinism(device):
        report = build_trained_laguna(model_dir, seed=seed, config=config, device=device).report
    return build_facts(model_dir, report, steps, width, seed)


def build_facts(model_dir: Path, report: dict[str, Any], steps: int, width: int, seed: int) -> dict[str, Any]:
    """A build's size, held-out perplexity and expert-weight tails, from its training report."""
    experts = report["weights"]["routed_experts"]
    return {"path": str(model_dir), "steps": steps, "width": width, "seed": seed, "parameters": _parameters(model_dir),
            "heldout_perplexity": report["heldout_perplexity"], "heldout_assistant_perplexity": report["heldout_assistant_perplexity"],
            "expert_kurtosis_median": experts["kurtosis_median"], "expert_kurtosis_max": experts["kurtosis_max"],
            "expert_max_over_rms_median": experts["max_over_rms_median"], "train_seconds": report["timing"]["train_seconds"]}


def describe_job(src: str) -> dict[str, Any]:
    """The shipped build's facts, as a curve build's (its training report ships with it)."""
    report = json.loads((Path(src) / "fp4forge-training.json").read_text())
    return build_facts(Path(src), report, report["training"]["steps"], 1, report["seed"])


def _parameters(model_dir: Path) -> int:
    from fp4forge.checkpoint.reader import open_checkpoint

    return sum(math.prod(info.shape) for _shard, info in open_checkpoint(model_dir).tensors())


def _load_player(model_dir: str, source_dir: str, numerics: str | None, device: str) -> Any:
    """A module that generates as the arm is served: BF16 weights as stored, or an exported
    checkpoint through fidelity.reference's forward with ``numerics``."""
    import torch
    from transformers import GenerationConfig, LagunaForCausalLM

    if numerics is None:
        return LagunaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    from fp4forge.fidelity.reference import load_reference

    model = load_reference(model_dir, numerics, dtype=torch.bfloat16, device=device)
    model.generation_config = GenerationConfig.from_pretrained(source_dir)  # the reference clears eos: stop as a server does
    return model


def play_job(plays: str, build: str, arm: str, model_dir: str, source_dir: str, numerics: str | None, seed: int,
             plan: dict[str, Any], device: str) -> dict[str, Any]:
    """One sampled run of the suite against one arm; its record is written under ``plays``."""
    from transformers import AutoTokenizer

    from fp4forge.lab.diagnostics.offline_suite import play
    from fp4forge.quality.suite import load_suite

    model = _load_player(model_dir, source_dir, numerics, device)
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    scenarios = load_suite().scenarios[: plan["limit"]]
    started = time.monotonic()
    result = play(model, tokenizer, scenarios, device, plan["max_new_tokens"], plan["temperature"], seed)
    relative = f"{build}/{arm}/run-{seed}.json"
    path = Path(plays) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"build": build, "arm": arm, "model": model_dir, "numerics": numerics, **result}, indent=1) + "\n")
    return {"path": relative, "earned": result["earned"], "max": result["max"], "cut_at_max_tokens": result["cut_at_max_tokens"],
            "turns": result["turns"], "seed": seed, "play_seconds": time.monotonic() - started}


def run_job(fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> tuple[dict[str, Any] | None, str | None, float]:
    """In the worker: the job's result or its error (with the traceback's last lines), and its seconds."""
    started = time.monotonic()
    try:
        return fn(*args), None, time.monotonic() - started
    except Exception as error:  # a failed job is reported, the others go on
        return None, f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}", time.monotonic() - started


# -- the plan as jobs ----------------------------------------------------------------------------
def _play(plays: str, device: str, plan: Plan, build: str, arm: str, seed: int, source: Callable[[dict[str, Any]], str],
          source_job: str | None) -> Job:
    """Seed ``seed``'s run of ``arm`` on ``build``: BF16 is the build itself, any other arm its student."""
    student = None if arm == BF16 else f"student:{build}:{arm}"
    deps = tuple(d for d in (source_job, student) if d)

    def args(done: dict[str, dict[str, Any]]) -> tuple[Any, ...]:
        src = source(done)
        model, numerics = (src, None) if student is None else (done[student]["path"], None if done[student]["dense"] else done[student]["numerics"])
        return (plays, build, arm, model, src, numerics, seed, asdict(plan), device)

    return Job(play_name(build, arm, seed), play_job, args, deps, round=seed - plan.first_seed + 1)


def plan_jobs(work: str, src: str, plan: Plan, device: str) -> list[Job]:
    """Students and builds go to ``work``, the plays' records to ``work/plays``."""
    plays = str(Path(work) / "plays")
    jobs = []
    if plan.runs:
        jobs.append(Job("calibrate", calibrate_job, lambda done: (work, src, plan.calibration_samples)))
        jobs.append(Job(f"describe:{SHIPPED}", describe_job, lambda done: (src,)))
        for arm in ARMS:
            exported = not arm.startswith("int2")
            jobs.append(Job(f"student:{SHIPPED}:{arm}", student_job, lambda done, arm=arm, exported=exported: (
                work, src, arm, done["calibrate"]["stats"] if exported else None), ("calibrate",) if exported else ()))
    for steps, width, seed in plan.curve:
        build = build_name(steps, width, seed)
        jobs.append(Job(f"train:{build}", train_job, lambda done, steps=steps, width=width, seed=seed: (work, steps, width, seed, device, plan.eval_windows)))
        jobs.append(Job(f"student:{build}:{CURVE_ARM}", student_job, lambda done, build=build: (work, done[f"train:{build}"]["path"], CURVE_ARM, None),
                        (f"train:{build}",)))
    for seed in range(plan.first_seed, plan.first_seed + max(plan.runs, plan.curve_runs)):
        if seed < plan.first_seed + plan.runs:
            jobs += [_play(plays, device, plan, SHIPPED, arm, seed, lambda done: src, None) for arm in (BF16, *ARMS)]
        if seed < plan.first_seed + plan.curve_runs:
            for steps, width, build_seed in plan.curve:
                build = build_name(steps, width, build_seed)
                jobs += [_play(plays, device, plan, build, arm, seed, lambda done, build=build: done[f"train:{build}"]["path"], f"train:{build}")
                         for arm in (BF16, CURVE_ARM)]
    return jobs


# -- running them --------------------------------------------------------------------------------
def expected_seconds(job: Job, finished: list[Job]) -> float:
    """A job's expected seconds: the median of finished jobs of its kind, else of the slowest
    finished play for a play (0 before any finished: nothing to go by)."""
    ok = [j for j in finished if j.error is None and j.seconds is not None]
    alike = sorted(j.seconds for j in ok if j.kind == job.kind)  # type: ignore[misc]
    if alike:
        return alike[len(alike) // 2]
    plays = [j.seconds for j in ok if j.name.startswith("play:")]
    return max(plays) if job.name.startswith("play:") and plays else 0.0  # type: ignore[type-var]


def _start_ready(pending: list[Job], running: dict[Future, Job], finished: list[Job], done: dict[str, dict[str, Any]], failed: set[str],
                 workers: int, budget_end: float, submit: Callable[[Job], Future]) -> None:
    """Start, in order, every pending job whose dependencies succeeded and that is expected to end
    before ``budget_end``, while workers are free; a job whose dependency failed fails too."""
    for job in list(pending):
        if len(running) >= workers:
            return
        if any(d in failed for d in job.deps):
            job.error = "not run: a job it needs failed"
            failed.add(job.name)
            pending.remove(job)
        elif all(d in done for d in job.deps) and time.monotonic() + expected_seconds(job, finished) <= budget_end:
            running[submit(job)] = job
            pending.remove(job)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Stop the workers still running jobs at the deadline (the executor has no public way to end
    a running task: its processes are terminated, then it is shut down)."""
    for process in list(getattr(pool, "_processes", {}).values()):
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def run_jobs(jobs: list[Job], workers: int, budget_s: float, log: Callable[[str], None], on_finish: Callable[[], None],
             deadline_s: float | None = None) -> list[str]:
    """Every job whose dependencies succeeded, in order of (round, position), while it is expected
    to end within ``budget_s``; at ``deadline_s`` (default: no deadline) the jobs still running are
    stopped. Returns the not-run notes."""
    started = time.monotonic()
    deadline = math.inf if deadline_s is None else started + deadline_s
    pending = sorted(jobs, key=lambda j: j.round)  # stable: position within a round
    running: dict[Future, Job] = {}
    finished: list[Job] = []
    done: dict[str, dict[str, Any]] = {}
    failed: set[str] = set()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        while pending or running:
            _start_ready(pending, running, finished, done, failed, workers, started + budget_s, lambda job: pool.submit(run_job, job.fn, job.args(done)))
            if not running:
                break  # the rest cannot start before the budget ends
            ready, _ = wait(running, timeout=None if deadline == math.inf else max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            if not ready:
                for job in running.values():
                    job.error = f"stopped at the deadline of {deadline_s / 60:.1f} min"  # type: ignore[operator]
                    log(f"{job.name}: stopped at the deadline")
                running.clear()
                _stop_workers(pool)
                break
            for future in ready:
                job = running.pop(future)
                job.result, job.error, job.seconds = future.result()
                finished.append(job)
                if job.error:
                    failed.add(job.name)
                else:
                    done[job.name] = job.result or {}
                log(f"{job.name}: {'failed: ' + (job.error or '').splitlines()[0] if job.error else 'done'} in {job.seconds:.0f} s")
                on_finish()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    for job in pending:
        job.error = f"not started within the budget of {max(0.0, budget_s) / 60:.1f} min"
    return [f"{job.name}: {job.error.splitlines()[0]}" for job in jobs if job.error]


# -- the outputs -----------------------------------------------------------------------------------
def pack_plays(plays: Path, tar_path: Path) -> None:
    """Every play record under ``plays`` into ``tar_path`` (replaced whole, never half-written)."""
    with atomic_file(tar_path) as partial, tarfile.open(partial, "w:gz", compresslevel=6) as tar:
        for record in sorted(plays.rglob("*.json")) if plays.is_dir() else ():
            tar.add(record, arcname=record.relative_to(plays).as_posix())


def save_jobs(out: Path, jobs: list[Job], meta: dict[str, Any]) -> None:
    """Every job's state so far, so a run stopped from outside still leaves its report (``--report-only``)."""
    doc = {"meta": meta, "jobs": [{"name": j.name, "result": j.result, "error": j.error, "seconds": j.seconds} for j in jobs]}
    write_json_atomic(out / JOBS_FILE, doc, indent=1)


def run(out: Path, plan: Plan, device: str, work_root: Path | None = None, keep_work: bool = False) -> dict[str, Any]:
    """Run ``plan``; OUT holds jobs.json, plays.tar.gz, resolution.json and resolution.md (also when
    the deadline stopped jobs). Students and builds go to a fresh folder, removed unless ``keep_work``."""
    import torch

    from fp4forge.testbed.shipped import shipped_testbed

    out.mkdir(parents=True, exist_ok=True)
    # The workers share the host's cores (set before they start: torch reads it on import).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.workers)))
    testbed = shipped_testbed()
    work = Path(tempfile.mkdtemp(prefix="suite-resolution-", dir=work_root))
    started = time.monotonic()
    meta = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)", "plan": asdict(plan),
            "testbed": testbed.identity(), "torch": torch.__version__, "wall_seconds": 0.0}
    jobs = plan_jobs(str(work), str(testbed.path), plan, device)
    packed = [0.0]

    def saved(force: bool = False) -> None:
        meta["wall_seconds"] = time.monotonic() - started
        if force or time.monotonic() - packed[0] > 15:  # the archive is rewritten whole: not after every play
            pack_plays(work / "plays", out / PLAYS_TAR)
            packed[0] = time.monotonic()
        save_jobs(out, jobs, meta)

    try:
        log = lambda line: print(f"[{time.monotonic() - started:6.0f}s] {line}", flush=True)  # noqa: E731
        notes = run_jobs(jobs, plan.workers, plan.budget_minutes * 60, log, saved, plan.deadline_minutes * 60)
        saved(force=True)
        for note in notes:
            log(f"not run: {note}")
        return write_report(out, [out])
    finally:
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS, help="resolution: the shipped testbed against every arm; curve: the size curve")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "suite-resolution")), help="results (default: $OUT)")
    parser.add_argument("--work-root", type=Path, default=None, help="where the fresh folder of students and builds goes (default: the temp dir)")
    parser.add_argument("--keep-work", action="store_true", help="keep the students and builds")
    parser.add_argument("--device", default=None, help="cuda (default when one is present) or cpu")
    parser.add_argument("--toy", action="store_true", help="a few scenarios, tiny builds: the whole path in minutes on a CPU")
    parser.add_argument("--runs", type=int, default=None, help="runs per arm (the part's plan by default)")
    parser.add_argument("--first-seed", type=int, default=None, help="the first run's seed (more runs of a part played before)")
    parser.add_argument("--curve", default=None, help="curve builds as STEPSxWIDTH@SEED,... (e.g. 500x1@0,2000x2@1)")
    parser.add_argument("--budget-minutes", type=float, default=None, help="no job starts that is expected to end later")
    parser.add_argument("--deadline-minutes", type=float, default=None, help="jobs still running then are stopped")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--report-only", action="store_true", help="the tables from output folders (--from) into --out")
    parser.add_argument("--from", dest="sources", type=Path, nargs="+", default=None, help="with --report-only: the output folders to read")
    parser.add_argument("--json", action="store_true", help="print resolution.json instead of the Markdown report")
    args = parser.parse_args(argv)
    try:
        if args.report_only:
            doc = write_report(args.out, args.sources or [args.out])
        else:
            if args.part is None:
                parser.error("--part is required (resolution or curve) unless --report-only")
            doc = run(args.out, _plan(args), _device(args.device), args.work_root, args.keep_work)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=1) if args.json else (args.out / "resolution.md").read_text())
    return 0


def _plan(args: argparse.Namespace) -> Plan:
    plan = (TOY_PLANS if args.toy else GPU_PLANS)[args.part]
    count = "runs" if args.part == "resolution" else "curve_runs"
    overrides = {count: args.runs, "first_seed": args.first_seed, "curve": None if args.curve is None else parse_curve(args.curve),
                 "budget_minutes": args.budget_minutes, "deadline_minutes": args.deadline_minutes, "workers": args.workers}
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    if plan.runs < 0 or plan.curve_runs < 0 or plan.first_seed < 0 or plan.workers < 1:
        raise ConfigError("runs and --first-seed must be at least 0, --workers at least 1")
    return plan


def _device(requested: str | None) -> str:
    import torch

    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    sys.exit(__import__("fp4forge.lab.diagnostics.suite_resolution", fromlist=["main"]).main())
