"""What the quality suite can resolve on the shipped testbed, and where it starts to separate.

The suite is played offline (``offline_suite``: the suite's runner, simulated tools and scorer,
transformers' generation), every run sampled at ``temperature`` with its own seed; run k of every
arm uses seed k, so a paired comparison sees the arms' difference under the same draws, and an
arm's runs differ from each other only by the draws (its A/A floor).

1. **Resolution.** The shipped testbed in BF16 against the study's arms (``lab/study/run.py``):
   NVFP4 W4A4 and W4A16 (min-max block scales), FP8 W8A8, INT2 g16 (3.5 bits) and g32 (2.5 bits).
   The students are the ones the study writes (``write_arm_student``); exported ones are played
   through ``fidelity.reference``'s forward with the numerics a server runs, the INT2 arms as
   fake-quantized BF16 copies. Per arm: points per run and the suite's own comparison against BF16
   (``quality.stats.compare_arms``: sign test over scenarios, discordant counts, A/A floor,
   verdict); for the suite: the minimum effect it detects at this size with this many runs.
2. **Separation curve.** Testbeds of the default recipe trained at several lengths (steps) and
   widths (hidden, attention heads and every MLP size times ``width``), seed 0, the largest also
   from seed 1; per build: held-out perplexity, expert-weight kurtosis, and BF16 against the
   2.5-bit arm (``int2-g32-mse``), ``curve_runs`` runs each. GPU builds are exploration: not the
   CPU build the project ships, and never cached.

Each training, student and play is a job of a pool of worker processes (a tiny model leaves a GPU
mostly idle; the CPU that launches its kernels is the limit). Jobs are started in rounds (run 1
of every arm, then run 2, ...) until ``--budget-minutes``; what did not start is listed as not run.
Writes ``OUT/resolution.json`` and ``OUT/resolution.md``; every play's transcript texts and scores
are kept under ``OUT/plays/``, every finished job in ``OUT/jobs.json`` as it finishes
(``--report-only`` writes the report from it). Students and builds go to ``--work``.

    python -m fp4forge.lab.diagnostics.suite_resolution --out OUT --device cuda   # the GPU plan
    python -m fp4forge.lab.diagnostics.suite_resolution --out OUT --toy           # minutes on a CPU
    python -m fp4forge.lab.diagnostics.suite_resolution --out OUT --report-only   # the report again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

BF16 = "bf16"
ARMS = ("nvfp4-w4a4-minmax", "nvfp4-w4a16-minmax", "fp8", "int2-g16-mse", "int2-g32-mse")
CURVE_ARM = "int2-g32-mse"
SHIPPED = "shipped"
PLAYS = "plays"  # under OUT: one record per run
JOBS_FILE = "jobs.json"  # under OUT: every finished job's result, written as they finish


@dataclass(frozen=True)
class Plan:
    runs: int  # sampled runs per arm on the shipped testbed
    curve_runs: int  # sampled runs per arm on each curve build
    curve: tuple[tuple[int, int, int], ...]  # (steps, width, seed) per build
    temperature: float = 0.7
    max_new_tokens: int = 128
    limit: int | None = None  # the first N scenarios (None: the whole suite)
    calibration_samples: int = 32
    eval_windows: int = 24
    workers: int = 14
    # No job starts later: the last plays end near it, within a 10-minute command with start-up and report.
    budget_minutes: float = 8.0


# 2,000 steps of the default recipe take about 1.5 min alone on an H100 (several at once share it);
# lengths 440 / 1,000 / 2,000 at width 1, and the largest, width 2, from two seeds.
GPU_PLAN = Plan(runs=6, curve_runs=3, curve=((440, 1, 0), (1000, 1, 0), (2000, 1, 0), (2000, 2, 0), (2000, 2, 1)))
# Every kind of job once or twice, small: the whole path on a 2-core CPU (the GPU plan's widths and
# second seed go through the same code).
TOY_PLAN = Plan(runs=2, curve_runs=2, curve=((2, 1, 0),), max_new_tokens=12, limit=3, calibration_samples=2,
                eval_windows=2, workers=2, budget_minutes=40.0)


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
    experts = report["weights"]["routed_experts"]
    return {"path": str(model_dir), "steps": steps, "width": width, "seed": seed, "parameters": _parameters(model_dir),
            "heldout_perplexity": report["heldout_perplexity"], "heldout_assistant_perplexity": report["heldout_assistant_perplexity"],
            "expert_kurtosis_median": experts["kurtosis_median"], "expert_kurtosis_max": experts["kurtosis_max"],
            "expert_max_over_rms_median": experts["max_over_rms_median"], "train_seconds": report["timing"]["train_seconds"]}


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


def play_job(out: str, label: str, model_dir: str, source_dir: str, numerics: str | None, seed: int, plan: dict[str, Any],
             device: str) -> dict[str, Any]:
    """One sampled run of the suite against one arm; its record is written under ``OUT/plays``."""
    from transformers import AutoTokenizer

    from fp4forge.lab.diagnostics.offline_suite import play
    from fp4forge.quality.suite import load_suite

    model = _load_player(model_dir, source_dir, numerics, device)
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    scenarios = load_suite().scenarios[: plan["limit"]]
    result = play(model, tokenizer, scenarios, device, plan["max_new_tokens"], plan["temperature"], seed)
    path = Path(out) / PLAYS / label / f"run-{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"arm": label, "model": model_dir, "numerics": numerics, **result}, indent=1) + "\n")
    return {"path": str(path.relative_to(out)), "earned": result["earned"], "max": result["max"], "cut_at_max_tokens": result["cut_at_max_tokens"],
            "turns": result["turns"], "seed": seed}


def run_job(fn: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> tuple[dict[str, Any] | None, str | None, float]:
    """In the worker: the job's result or its error (with the traceback's last lines), and its seconds."""
    started = time.monotonic()
    try:
        return fn(*args), None, time.monotonic() - started
    except Exception as error:  # a failed job is reported, the others go on
        return None, f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}", time.monotonic() - started


# -- the plan as jobs ----------------------------------------------------------------------------
def _play(out: str, device: str, plan: Plan, build: str, arm: str, run: int, source: Callable[[dict[str, Any]], str],
          source_job: str | None) -> Job:
    """Run ``run`` of ``arm`` on ``build``: BF16 is the build itself, any other arm its student."""
    student = None if arm == BF16 else f"student:{build}:{arm}"
    deps = tuple(d for d in (source_job, student) if d)

    def args(done: dict[str, dict[str, Any]]) -> tuple[Any, ...]:
        src = source(done)
        model, numerics = (src, None) if student is None else (done[student]["path"], None if done[student]["dense"] else done[student]["numerics"])
        return (out, f"{build}/{arm}", model, src, numerics, run, asdict(plan), device)

    return Job(f"play:{build}:{arm}:{run}", play_job, args, deps, round=run + 1)


def plan_jobs(work: str, out: str, src: str, plan: Plan, device: str) -> list[Job]:
    """Students and builds go to ``work``, the plays' records to ``out``."""
    jobs = [Job("calibrate", calibrate_job, lambda done: (work, src, plan.calibration_samples))]
    for arm in ARMS:
        exported = not arm.startswith("int2")
        jobs.append(Job(f"student:{SHIPPED}:{arm}", student_job, lambda done, arm=arm, exported=exported: (
            work, src, arm, done["calibrate"]["stats"] if exported else None), ("calibrate",) if exported else ()))
    for steps, width, seed in plan.curve:
        build = build_name(steps, width, seed)
        jobs.append(Job(f"train:{build}", train_job, lambda done, steps=steps, width=width, seed=seed: (work, steps, width, seed, device, plan.eval_windows)))
        jobs.append(Job(f"student:{build}:{CURVE_ARM}", student_job, lambda done, build=build: (work, done[f"train:{build}"]["path"], CURVE_ARM, None),
                        (f"train:{build}",)))
    for run in range(max(plan.runs, plan.curve_runs)):
        if run < plan.runs:
            jobs += [_play(out, device, plan, SHIPPED, arm, run, lambda done: src, None) for arm in (BF16, *ARMS)]
        if run < plan.curve_runs:
            for steps, width, seed in plan.curve:
                build = build_name(steps, width, seed)
                jobs += [_play(out, device, plan, build, arm, run, lambda done, build=build: done[f"train:{build}"]["path"], f"train:{build}")
                         for arm in (BF16, CURVE_ARM)]
    return jobs


# -- running them --------------------------------------------------------------------------------
def _estimate(finished: list[Job]) -> float:
    """A play's expected seconds: the median of the finished ones (0 before any finished)."""
    seconds = sorted(j.seconds for j in finished if j.name.startswith("play:") and j.error is None and j.seconds is not None)
    return seconds[len(seconds) // 2] if seconds else 0.0


def run_jobs(jobs: list[Job], workers: int, budget_s: float, log: Callable[[str], None], on_finish: Callable[[], None]) -> list[str]:
    """Every job whose dependencies succeeded, in order of (round, position), until the budget;
    returns the not-run notes."""
    deadline = time.monotonic() + budget_s
    pending = sorted(jobs, key=lambda j: j.round)  # stable: position within a round
    running: dict[Future, Job] = {}
    finished: list[Job] = []
    done: dict[str, dict[str, Any]] = {}
    failed: set[str] = set()
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        while pending or running:
            for job in list(pending):
                if len(running) >= workers:
                    break
                if any(d in failed for d in job.deps):
                    job.error = "not run: a job it needs failed"
                    failed.add(job.name)
                    pending.remove(job)
                elif all(d in done for d in job.deps) and time.monotonic() + _estimate(finished) <= deadline:
                    running[pool.submit(run_job, job.fn, job.args(done))] = job
                    pending.remove(job)
            if not running:
                break  # the rest cannot start before the budget ends
            ready, _ = wait(running, return_when=FIRST_COMPLETED)
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
    notes = [f"{job.name}: not started within the budget of {max(0.0, budget_s) / 60:.0f} min" for job in pending]
    notes += [f"{job.name}: {job.error.splitlines()[0]}" for job in jobs if job.error]
    return notes


# -- what the runs say ---------------------------------------------------------------------------
def arm_runs(jobs: list[Job], out: Path, build: str, arm: str) -> list[dict[str, Any]]:
    """The finished runs of one arm on one build (their full records), by seed."""
    prefix = f"play:{build}:{arm}:"
    docs = [json.loads((out / j.result["path"]).read_text()) for j in jobs if j.name.startswith(prefix) and j.result]
    return sorted(docs, key=lambda d: d["seed"])


def noise_only_mde(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The smallest mean per-scenario score difference the suite detects (paired, alpha 0.05,
    power 0.8, ``quality.stats.minimum_detectable_effect``) between two arms of ``len(runs)`` runs
    each when the only noise is the sampling: sd(d) = sqrt(2 * mean_i var_i / K), var_i the
    variance of scenario i's score over these K runs. A real effect that differs between scenarios
    adds variance, so this is the floor of what can be detected."""
    import numpy as np

    from fp4forge.quality.stats import minimum_detectable_effect, smallest_significant_discordance

    if len(runs) < 2:
        return None
    ids = [s["id"] for s in runs[0]["scenarios"]]
    by_id = [{s["id"]: s for s in run["scenarios"]} for run in runs]
    scores = np.array([[run[i]["earned"] / max(1, run[i]["max"]) for i in ids] for run in by_id])
    sd = math.sqrt(2 * float(scores.var(axis=0, ddof=1).mean()) / len(runs))
    mde = minimum_detectable_effect(len(ids), sd) if sd > 0 else None  # no run moved: the draws show no noise to scale
    return {"runs_per_arm": len(runs), "scenarios": len(ids), "sd_diff": sd, "mean_fraction": mde,
            "points_of_max": None if mde is None else mde * runs[0]["max"], "max_points": runs[0]["max"],
            "smallest_significant_discordance": smallest_significant_discordance()}


def _compare(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> dict[str, Any] | None:
    from fp4forge.lab.diagnostics.offline_suite import compare_runs

    return compare_runs(runs_a, runs_b) if runs_a and runs_b else None


def _arm_row(name: str, runs: list[dict[str, Any]], against: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    return {"arm": name, **extra, "runs": len(runs), "points_per_run": [r["earned"] for r in runs], "max_points": runs[0]["max"] if runs else None,
            "cut_at_max_tokens": [r["cut_at_max_tokens"] for r in runs], "vs_bf16": _compare(against, runs) if name != BF16 else None}


def summarise(jobs: list[Job], plan: Plan, out: Path) -> dict[str, Any]:
    by_name = {j.name: j for j in jobs}
    bf16 = arm_runs(jobs, out, SHIPPED, BF16)
    resolution = [_arm_row(BF16, bf16, bf16, {"bpp": 16.0})]
    for arm in ARMS:
        student = (by_name[f"student:{SHIPPED}:{arm}"].result if f"student:{SHIPPED}:{arm}" in by_name else None) or {}
        resolution.append(_arm_row(arm, arm_runs(jobs, out, SHIPPED, arm), bf16, {"bpp": student.get("bpp"), "numerics": student.get("numerics")}))
    curve = []
    for steps, width, seed in plan.curve:
        build = build_name(steps, width, seed)
        trained = by_name[f"train:{build}"].result if f"train:{build}" in by_name else None
        if trained is None:
            continue
        base, quantized = arm_runs(jobs, out, build, BF16), arm_runs(jobs, out, build, CURVE_ARM)
        curve.append({"build": build, **{k: v for k, v in trained.items() if k != "path"},
                      "bf16": _arm_row(BF16, base, base, {}), CURVE_ARM: _arm_row(CURVE_ARM, quantized, base, {})})
    return {"resolution": resolution, "aa": _compare(bf16[0::2], bf16[1::2]) if len(bf16) >= 2 else None,
            "mde": noise_only_mde(bf16), "curve": curve}


# -- the report ------------------------------------------------------------------------------------
def _fmt_p(comparison: dict[str, Any] | None) -> str:
    return "" if comparison is None else f"{comparison['sign_test']['p']:.2g}"


def _discordant(comparison: dict[str, Any] | None) -> str:
    """Scenarios favouring BF16 / favouring the arm (A is BF16 in every comparison)."""
    return "" if comparison is None else f"{comparison['sign_test']['favours_a']} / {comparison['sign_test']['favours_b']}"


def _points(row: dict[str, Any]) -> str:
    return ", ".join(map(str, row["points_per_run"])) or "not run"


def _verdict(comparison: dict[str, Any] | None) -> str:
    return "" if comparison is None else comparison["verdict"]["label"]


def resolution_markdown(doc: dict[str, Any]) -> list[str]:
    from fp4forge.report.markdown import table

    rows = [[f"`{r['arm']}`", f"{r['bpp']:.2f}" if r.get("bpp") else "", str(r["runs"]), _points(r), _discordant(r["vs_bf16"]), _fmt_p(r["vs_bf16"]),
             _verdict(r["vs_bf16"])] for r in doc["resolution"]]
    lines = table(["arm", "bits/param", "runs", "points per run", "discordant: BF16 / arm better", "sign p", "verdict"], rows)
    aa, mde = doc["aa"], doc["mde"]
    if aa is not None:
        lines += ["", f"A/A (BF16's even against odd runs): {_discordant(aa)} discordant, sign p = {_fmt_p(aa)}, verdict: {_verdict(aa)}."]
    if mde is not None:
        least = f"the sign test needs at least {mde['smallest_significant_discordance']} discordant scenarios, all one way"
        lines += ["", f"Smallest effect detected with {mde['runs_per_arm']} runs per arm on {mde['scenarios']} scenarios (paired, alpha 0.05, "
                      f"power 0.8, sampling noise only): " + (f"a mean per-scenario score difference of {mde['mean_fraction']:.3f}, "
                      f"about {mde['points_of_max']:.1f} of {mde['max_points']} points; {least}." if mde["mean_fraction"] is not None else
                      f"not estimable, no scenario's score moved between runs; {least}.")]
    return lines


def curve_markdown(doc: dict[str, Any]) -> list[str]:
    from fp4forge.report.markdown import table

    rows = []
    for point in doc["curve"]:
        quantized = point[CURVE_ARM]
        rows.append([point["build"], f"{point['parameters'] / 1e6:.1f} M", str(point["steps"]), str(point["width"]), str(point["seed"]),
                     f"{point['heldout_perplexity']:.3f}", f"{point['expert_kurtosis_median']:.2f} / {point['expert_kurtosis_max']:.2f}",
                     _points(point["bf16"]), _points(quantized), _discordant(quantized["vs_bf16"]), _fmt_p(quantized["vs_bf16"]),
                     _verdict(quantized["vs_bf16"])])
    return table(["build", "params", "steps", "width", "seed", "held-out ppl", "expert kurtosis med / max", "BF16 points",
                  f"`{CURVE_ARM}` points", "discordant", "sign p", "verdict"], rows)


def write_report(out: Path, doc: dict[str, Any]) -> None:
    meta = doc["meta"]
    lines = [f"# Suite resolution ({meta['device']}, {meta['wall_seconds'] / 60:.1f} min)", "",
             f"Testbed: {meta['testbed']['name']} v{meta['testbed']['version']} (sha256 `{meta['testbed']['sha256'][:16]}…`). "
             f"Offline play, temperature {meta['plan']['temperature']}, {meta['plan']['max_new_tokens']} new tokens a turn, "
             f"{'all' if meta['plan']['limit'] is None else meta['plan']['limit']} scenarios; run k of every arm uses seed k.", "",
             "## Resolution: BF16 against each arm", "", *resolution_markdown(doc), "",
             f"## Separation of `{CURVE_ARM}` from BF16 by training length and width", "", *curve_markdown(doc)]
    if meta["not_run"]:
        lines += ["", "## Not run", "", *(f"- {note}" for note in meta["not_run"])]
    (out / "resolution.md").write_text("\n".join(lines) + "\n")
    (out / "resolution.json").write_text(json.dumps(doc, indent=1) + "\n")


def save_jobs(out: Path, jobs: list[Job], meta: dict[str, Any]) -> None:
    """Every job's state so far, so a run stopped from outside still leaves a report (``--report-only``)."""
    doc = {"meta": meta, "jobs": [{"name": j.name, "result": j.result, "error": j.error, "seconds": j.seconds} for j in jobs]}
    tmp = out / (JOBS_FILE + ".partial")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out / JOBS_FILE)


def report(out: Path, notes: list[str] | None = None) -> str:
    """resolution.json and resolution.md from ``OUT/jobs.json`` and the plays' records."""
    saved = json.loads((out / JOBS_FILE).read_text())
    meta, plan = saved["meta"], Plan(**{**saved["meta"]["plan"], "curve": tuple(map(tuple, saved["meta"]["plan"]["curve"]))})
    jobs = [Job(j["name"], play_job, lambda done: (), result=j["result"], error=j["error"], seconds=j["seconds"]) for j in saved["jobs"]]
    if notes is None:  # a run that was stopped: what had not finished
        notes = [f"{j.name}: did not finish before the run ended" for j in jobs if j.result is None and j.error is None]
        notes += [f"{j.name}: {j.error.splitlines()[0]}" for j in jobs if j.error]
    doc = {**summarise(jobs, plan, out), "meta": {**meta, "not_run": notes, "jobs": {j.name: {"seconds": j.seconds, "error": j.error} for j in jobs}}}
    write_report(out, doc)
    return (out / "resolution.md").read_text()


def run(out: Path, work: Path, plan: Plan, device: str) -> str:
    import torch

    from fp4forge.testbed.shipped import shipped_testbed

    out.mkdir(parents=True, exist_ok=True)
    # The workers share the host's cores (set before they start: torch reads it on import).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.workers)))
    testbed = shipped_testbed()
    started = time.monotonic()
    meta = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)", "plan": asdict(plan),
            "testbed": testbed.identity(), "torch": torch.__version__, "wall_seconds": 0.0}
    jobs = plan_jobs(str(work), str(out), str(testbed.path), plan, device)

    def saved() -> None:
        meta["wall_seconds"] = time.monotonic() - started
        save_jobs(out, jobs, meta)

    notes = run_jobs(jobs, plan.workers, plan.budget_minutes * 60, lambda line: print(f"[{time.monotonic() - started:6.0f}s] {line}", flush=True), saved)
    saved()
    return report(out, notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "suite-resolution")), help="results (default: $OUT)")
    parser.add_argument("--work", type=Path, default=None, help="students and builds (default: OUT/../suite-resolution-work)")
    parser.add_argument("--device", default=None, help="cuda (default when one is present) or cpu")
    parser.add_argument("--toy", action="store_true", help="a few scenarios, tiny builds: the whole path in minutes on a CPU")
    parser.add_argument("--budget-minutes", type=float, default=None, help="no job starts after this (default: 8 on a GPU)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from OUT/jobs.json (e.g. of a run stopped from outside)")
    args = parser.parse_args(argv)
    if args.report_only:
        print(report(args.out))
        return 0
    import torch

    plan = TOY_PLAN if args.toy else GPU_PLAN
    plan = replace(plan, **{k: v for k, v in (("budget_minutes", args.budget_minutes), ("workers", args.workers)) if v is not None})
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(run(args.out, args.work or args.out.resolve().parent / "suite-resolution-work", plan, device))
    return 0


if __name__ == "__main__":
    sys.exit(__import__("fp4forge.lab.diagnostics.suite_resolution", fromlist=["main"]).main())
