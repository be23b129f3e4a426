"""``fp4forge study SRC OUT``: the quantization study in one resumable run (docs/study.md).

Parts, each written to ``OUT`` the moment it finishes and skipped on a re-run whose settings
match (``OUT/study-state.json`` records the settings digest and the finished parts):

1. ``frontier``: bits per parameter against weight error for every component and arm
   (:func:`fp4forge.lab.study.frontier.compute_frontier`) -> ``frontier.json``, ``frontier.png``.
2. ``calibrate``: activation amax for the exports (``stats.safetensors``): both recipes declare
   activation quantization; the W4A16 arms run the same bytes with BF16 activations.
3. one part per whole-model arm: its student checkpoint under ``arms/<name>/`` and its fidelity
   against the BF16 teacher -> ``arms/<name>.json``. Exported arms use the real exporter (FP8
   W8A8; NVFP4 min-max, MSE block scales, GPTQ; W4A4 and W4A16 numerics on the same bytes);
   the 2-bit arm is a fake-quantized BF16 copy (no exporter writes INT2 groups).
4. ``gemm``: the GEMM microbench at the model's shapes, only where a CUDA GPU is present.
5. ``report``: ``study.json`` and ``study.md`` with the plots.

Serving-latency arms need a running server per arm; the study names them as not run (use
``fp4forge pipeline --serve`` / ``fp4forge bench compare``). Every part that did not run is
listed in the report with its reason; nothing is estimated in its place.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp4forge import versioned
from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.errors import ConfigError, Fp4forgeError
from fp4forge.fidelity.evaluate import FidelityOptions
from fp4forge.lab.study.arms import measure_arm, read_bpp, write_fake_quantized
from fp4forge.lab.study.frontier import (FORMATS, QUANTIZABLE_COMPONENTS, ArmSpec, FrontierOptions, Progress, compute_frontier, frontier_options,
                                         write_frontier)
from fp4forge.stats import bootstrap_mean_ci

STATE_FILE = "study-state.json"
STUDY_JSON = "study.json"
STUDY_MD = "study.md"
# The components the NVFP4 recipe quantizes; the fake-quantized arms take the same ones, so the
# whole-model arms differ in the format only.
ARM_COMPONENTS = ("routed_experts", "attention")
NVFP4_RECIPE = "nvfp4-all-linear"
FP8_RECIPE = "fp8"
ALL_ARMS = ("fp8", "nvfp4-w4a16-minmax", "nvfp4-w4a16-mse", "nvfp4-w4a16-gptq", "nvfp4-w4a4-minmax", "int2-g16-mse", "int2-g32-mse")
# Data-free 2-bit arms, fake-quantized (no exporter writes INT2). g16 asymmetric is the frontier's
# lowest-error 2-bit arm, but its scales and zero points make it 3.5 bits per parameter; g32
# symmetric is the 2-bit arm at 2.5 bits, the size a 2-bit deployment is for.
INT2_ARMS = {
    "int2-g16-mse": ArmSpec("int2", 2, 16, "mse", symmetric=False),
    "int2-g32-mse": ArmSpec("int2", 2, 32, "mse", symmetric=True),
}


@dataclass(frozen=True)
class StudyOptions:
    formats: tuple[str, ...] = FORMATS
    components: tuple[str, ...] = QUANTIZABLE_COMPONENTS
    int_groups: tuple[int | None, ...] = (16, 32, 64, 128, None)
    arms: tuple[str, ...] = ALL_ARMS
    fidelity_samples: int = 16
    fidelity_seq_len: int = 256
    calibration_samples: int = 32
    calibration_seq_len: int = 256
    seed: int = 0
    # Text files instead of the built-in corpus: held-out text for fidelity (e.g. a trained
    # model's own held-out split) and calibration text (activation scales, GPTQ Hessians).
    text_files: tuple[str, ...] = ()
    calibration_text_files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.frontier()  # validates them
        unknown = sorted(set(self.arms) - set(ALL_ARMS))
        if unknown:
            raise ConfigError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ALL_ARMS)}", option="arms")
        for option in ("fidelity_samples", "calibration_samples"):
            if getattr(self, option) < 2:
                raise ConfigError(f"must be at least 2 (a confidence interval needs samples), got {getattr(self, option)}", option=option)
        for option in ("fidelity_seq_len", "calibration_seq_len"):
            if getattr(self, option) < 8:
                raise ConfigError(f"must be at least 8, got {getattr(self, option)}", option=option)
        for option in ("text_files", "calibration_text_files"):
            missing = [name for name in getattr(self, option) if not Path(name).is_file()]
            if missing:
                raise ConfigError(f"no such file: {', '.join(missing)}", option=option)

    def frontier(self) -> FrontierOptions:
        """The frontier part's options."""
        return frontier_options(formats=self.formats, components=self.components, int_groups=self.int_groups)

    def calibration_text(self) -> dict[str, Any]:
        """The calibration samples (activation scales, GPTQ Hessians), as the sample options' fields."""
        files = tuple(Path(p) for p in self.calibration_text_files)
        return {"samples": self.calibration_samples, "seq_len": self.calibration_seq_len, "text_files": files, "builtin_corpus": not files}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class StudyResult:
    out: Path
    doc: dict[str, Any]
    resumed: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**self.doc, "out": str(self.out), "resumed_parts": self.resumed}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _load_state(out: Path, digest: str, source: str) -> dict[str, Any]:
    path = out / STATE_FILE
    if path.is_file():
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            state = {}
        if state.get("digest") == digest and state.get("source") == source:
            return state
        raise ConfigError(f"{out} holds a study with other settings or another source; choose a new OUT or delete it", option="out")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists, is not empty and holds no study; choose a new path", option="out")
    return {"digest": digest, "source": source, "parts": {}}


def _save_state(out: Path, state: dict[str, Any]) -> None:
    write_text_atomic(out / STATE_FILE, json.dumps(state, indent=1))


# The jobs' options are made where the command line makes them (fp4forge.cli.calibrate,
# fp4forge.cli.quantize): one construction site per options class.
def _fidelity_options(options: StudyOptions, numerics: str, dense_student: bool = False) -> FidelityOptions:
    from fp4forge.cli.calibrate import fidelity_options

    own = dict(numerics=numerics, samples=options.fidelity_samples, seq_len=options.fidelity_seq_len, batch_size=4, seed=options.seed,
               dense_student=dense_student)
    return fidelity_options(own, text=tuple(Path(p) for p in options.text_files), no_builtin=bool(options.text_files))


def _calibration_options(options: StudyOptions) -> Any:
    from fp4forge.cli.calibrate import calibration_options

    text = options.calibration_text()
    return calibration_options(dict(samples=text["samples"], seq_len=text["seq_len"]), text=text["text_files"], no_builtin=not text["builtin_corpus"])


def _fresh(path: Path) -> Path:
    """A leftover of an interrupted part is removed: the part starts over."""
    if path.exists():
        shutil.rmtree(path)
    return path


def _export(src: str, out: Path, recipe: str, block_scales: str, stats: Path | None, progress: Progress = None,
            calibration: dict[str, Any] | None = None, **job: Any) -> None:
    from fp4forge.cli.quantize import quantize_job
    from fp4forge.quantize.job import run_quantize

    made = quantize_job(calibration or {}, {}, recipe=recipe, block_scales=block_scales, stats=stats, threads=1, **job)
    run_quantize(src, _fresh(out), made, progress=progress)


ARM_DESCRIPTIONS = {
    "fp8": "FP8 W8A8 (static per-tensor scales), experts + shared expert + attention + dense MLP",
    "nvfp4-w4a16-minmax": "NVFP4 weights, min-max block scales, BF16 activations (experts + attention)",
    "nvfp4-w4a16-mse": "NVFP4 weights, MSE-searched block scales, BF16 activations (experts + attention)",
    "nvfp4-w4a16-gptq": "NVFP4 weights, GPTQ rounding (per-expert Hessians), BF16 activations (experts + attention)",
    "nvfp4-w4a4-minmax": "NVFP4 weights (min-max) and NVFP4 activations, W4A4 (experts + attention)",
    "int2-g16-mse": "INT2 weights, asymmetric, 16-element groups, searched clipping; weight-only fake quantization (experts + attention)",
    "int2-g32-mse": "INT2 weights, symmetric, 32-element groups, searched clipping; weight-only fake quantization (experts + attention)",
}


@dataclass(frozen=True)
class ArmStudent:
    """An arm's student checkpoint as written, and what measuring it needs."""

    path: Path
    components: tuple[str, ...]  # what the arm quantized (its bits per parameter are over these)
    numerics: str  # w4a4: the checkpoint's activation quantization applied; w4a16: weights only
    bpp: float | None
    dense: bool  # a fake-quantized BF16 copy (no quantization declaration)


def write_arm_student(name: str, src: str, ckpt: Path, options: StudyOptions, stats: Path | None, progress: Progress = None) -> ArmStudent:
    """Arm ``name``'s student of ``src`` at ``ckpt``: the exporter's checkpoint, or a fake-quantized BF16 copy."""
    if name == "fp8":
        _export(src, ckpt, FP8_RECIPE, "minmax", stats)
        components = ("routed_experts", "shared_expert", "attention", "dense_mlp")
        # The checkpoint's own activation quantization (FP8 static) is applied.
        return ArmStudent(ckpt, components, "w4a4", read_bpp(ckpt, components), dense=False)
    if name.startswith("nvfp4-"):
        method = name.rsplit("-", 1)[1]
        if method == "gptq":
            _export(src, ckpt, NVFP4_RECIPE, "minmax", stats, progress, calibration=options.calibration_text(), method="gptq")
        else:
            # The recipe is W4A4, so the export carries activation scales; w4a16 numerics ignore them.
            _export(src, ckpt, NVFP4_RECIPE, method, stats)
        return ArmStudent(ckpt, ARM_COMPONENTS, "w4a4" if "w4a4" in name else "w4a16", read_bpp(ckpt, ARM_COMPONENTS), dense=False)
    if name in INT2_ARMS:
        bpp = write_fake_quantized(src, _fresh(ckpt), INT2_ARMS[name], ARM_COMPONENTS)["bpp"]
        return ArmStudent(ckpt, ARM_COMPONENTS, "w4a16", bpp, dense=True)
    raise ConfigError(f"unknown arm {name}", option="arms")  # guarded by StudyOptions


def _run_arm(name: str, src: str, out: Path, options: StudyOptions, stats: Path | None, progress: Progress) -> dict[str, Any]:
    student = write_arm_student(name, src, out / "arms" / name / "checkpoint", options, stats, progress)
    fidelity = _fidelity_options(options, student.numerics, dense_student=student.dense)
    result = measure_arm(src, student.path, name, ARM_DESCRIPTIONS[name], options=fidelity, bpp=student.bpp, progress=progress)
    shutil.rmtree(student.path)  # the measurement is what the study keeps; the student is rebuilt on demand
    return result.to_json()


def _frontier_summary(frontier: dict[str, Any]) -> list[dict[str, Any]]:
    """Per component: each format's best arm, and min-max against the searched NVFP4 scales."""
    rows = []
    for component in dict.fromkeys(a["component"] for a in frontier["arms"]):
        arms = [a for a in frontier["arms"] if a["component"] == component]
        for fmt in dict.fromkeys(a["format"] for a in arms):
            for method in dict.fromkeys(a["method"] for a in arms if a["format"] == fmt):
                found = [a for a in arms if a["format"] == fmt and a["method"] == method]
                best = min(found, key=lambda a: a["rel_error"])
                group = "row" if best["group_size"] is None else ("tensor" if best["group_size"] == 0 else f"g{best['group_size']}")
                sym = "" if best.get("symmetric", True) else " asym"
                rows.append({"component": component, "arm": f"{fmt}{sym} {group} {method}", "bpp": best["bpp"], "rel_error": best["rel_error"]})
    return rows


COMPARED_PAIRS = (("fp8", "nvfp4-w4a16-minmax"), ("nvfp4-w4a16-minmax", "nvfp4-w4a4-minmax"), ("nvfp4-w4a4-minmax", "int2-g16-mse"),
                  ("nvfp4-w4a16-minmax", "int2-g16-mse"), ("nvfp4-w4a4-minmax", "int2-g32-mse"), ("int2-g16-mse", "int2-g32-mse"),
                  ("nvfp4-w4a16-mse", "nvfp4-w4a16-minmax"), ("nvfp4-w4a16-gptq", "nvfp4-w4a16-minmax"))


def _paired_differences(arms: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Per compared pair (a, b): the mean per-sample KL difference b - a with its 95 % paired
    bootstrap interval. Every arm is measured on the same samples (same text, seed and length), so
    sample i of one arm and of the other are the same tokens: resampling the differences keeps the
    pairing, which removes the between-sample spread both arms share."""
    by = {a["name"]: a for a in arms}
    rows = []
    for a, b in COMPARED_PAIRS:
        if a not in by or b not in by:
            continue
        ka, kb = by[a]["kl"].get("per_sample") or [], by[b]["kl"].get("per_sample") or []
        if len(ka) != len(kb) or len(ka) < 2:
            continue
        diffs = [y - x for x, y in zip(ka, kb)]
        lo, hi = bootstrap_mean_ci(diffs, seed=seed)
        rows.append({"a": a, "b": b, "mean": sum(diffs) / len(diffs), "ci95": [lo, hi], "samples": len(diffs)})
    return rows


def _comparisons(arms: list[dict[str, Any]], seed: int = 0) -> list[str]:
    """Per compared pair: ordered when the paired 95 % interval of the difference excludes 0,
    otherwise said to be unresolved; the per-arm intervals are stated beside it."""
    by = {a["name"]: a for a in arms}
    lines = []
    for row in _paired_differences(arms, seed):
        a, b, (lo, hi) = row["a"], row["b"], row["ci95"]
        (alo, ahi), (blo, bhi) = by[a]["kl"]["ci95"], by[b]["kl"]["ci95"]
        disjoint = "disjoint" if ahi < blo or bhi < alo else "overlapping"
        span = f"KL({b}) - KL({a}) = {row['mean']:.3g}, paired 95 % CI [{lo:.3g}, {hi:.3g}] over {row['samples']} samples; per-arm intervals {disjoint}"
        if lo > 0:
            lines.append(f"KL of {a} is below {b}'s ({span})")
        elif hi < 0:
            lines.append(f"KL of {b} is below {a}'s ({span})")
        else:
            lines.append(f"{a} and {b}: the order is not resolved ({span})")
    return lines


def run_study(src: str | Path, out: str | Path, options: StudyOptions = StudyOptions(), *, progress: Progress = None) -> StudyResult:
    """Run (or resume) the study of the BF16 checkpoint ``src`` into ``out``."""
    from fp4forge.lab.study.tables import study_markdown

    src, out = str(src), Path(out)
    state = _load_state(out, options.digest(), src)
    out.mkdir(parents=True, exist_ok=True)
    _save_state(out, state)
    parts = _Parts(out, state)
    not_run: list[dict[str, str]] = []

    started = time.monotonic()
    frontier_doc = _frontier_part(src, options, parts, progress)
    stats = _calibration_part(src, options, parts, progress)
    arms = _arm_parts(src, options, stats, parts, not_run, progress)
    sections = _gemm_part(src, parts, not_run, progress)
    not_run.append({"part": "serving-latency arms", "reason": "the study starts no server; measure them with `fp4forge pipeline --serve` "
                    "or `fp4forge bench compare` against one server per arm"})
    not_run.append({"part": "quality-suite arms", "reason": "the suite needs a served model per arm (`fp4forge quality run` / `quality compare`); "
                    "what it can resolve on the shipped testbed: docs/quality.md#resolving-power-on-the-shipped-testbed"})
    plots = _plots(frontier_doc, arms, out, not_run)
    doc = versioned({
        "format": "fp4forge-study/1",
        "source": src,
        "finished_at": _now(),
        "options": json.loads(json.dumps(asdict(options), default=str)),
        "frontier": frontier_doc,
        "frontier_summary": _frontier_summary(frontier_doc),
        "fidelity": {"samples": options.fidelity_samples, "seq_len": options.fidelity_seq_len,
                     "text": list(options.text_files) or "built-in corpus", "positions": _positions(arms)},
        "arms": sorted(arms, key=lambda a: a["kl"]["mean"]),
        "comparisons": _comparisons(arms, options.seed),
        "paired_differences": _paired_differences(arms, options.seed),
        "sections": sections,
        "plots": plots,
        "not_run": not_run,
        "seconds_this_run": round(time.monotonic() - started, 1),
    })
    write_text_atomic(out / STUDY_JSON, json.dumps(doc, indent=1))
    write_text_atomic(out / STUDY_MD, study_markdown(doc))
    parts.done("report")
    return StudyResult(out, doc, parts.resumed)


class _Parts:
    """The study's finished parts (``OUT/study-state.json``), saved the moment each finishes."""

    def __init__(self, out: Path, state: dict[str, Any]) -> None:
        self.out, self.state, self.resumed = out, state, []

    def resume(self, part: str, *files: Path) -> bool:
        """True (and noted as resumed) when ``part`` finished in an earlier run and its files are there."""
        if part in self.state["parts"] and all(f.is_file() for f in files):
            self.resumed.append(part)
            return True
        return False

    def done(self, part: str) -> None:
        self.state["parts"][part] = True
        _save_state(self.out, self.state)


def _frontier_part(src: str, options: StudyOptions, parts: _Parts, progress: Progress) -> dict[str, Any]:
    out = parts.out
    if not parts.resume("frontier"):
        write_frontier(compute_frontier(src, options.frontier(), progress=progress).to_json(), out)
        parts.done("frontier")
    return json.loads((out / "frontier.json").read_text(encoding="utf-8"))


def study_options(**given: Any) -> StudyOptions:
    """The study's options from what a caller set (the command line, a probe): their one construction site."""
    return StudyOptions(**given)


def calibrate_for_arms(src: str, stats: Path, options: StudyOptions, progress: Progress = None) -> Path:
    """The activation statistics every exported arm needs (every exported recipe quantizes activations)."""
    from fp4forge.calibrate.run import calibrate_to_file

    if stats.exists():
        stats.unlink()
    calibrate_to_file(src, stats, _calibration_options(options), progress=progress)
    return stats


def _calibration_part(src: str, options: StudyOptions, parts: _Parts, progress: Progress) -> Path | None:
    if all(arm in INT2_ARMS for arm in options.arms):
        return None
    stats = parts.out / "stats.safetensors"
    if not parts.resume("calibrate", stats):
        calibrate_for_arms(src, stats, options, progress)
        parts.done("calibrate")
    return stats


def _arm_parts(src: str, options: StudyOptions, stats: Path | None, parts: _Parts, not_run: list[dict[str, str]],
               progress: Progress) -> list[dict[str, Any]]:
    out = parts.out
    arms: list[dict[str, Any]] = []
    (out / "arms").mkdir(exist_ok=True)
    for name in options.arms:
        result_path = out / "arms" / f"{name}.json"
        if not parts.resume(f"arm:{name}", result_path):
            try:
                result = _run_arm(name, src, out, options, stats, progress)
            except Fp4forgeError as error:
                not_run.append({"part": f"arm {name}", "reason": f"failed: {error.message}"})
                continue
            write_text_atomic(result_path, json.dumps(result, indent=1))
            parts.done(f"arm:{name}")
        arms.append(json.loads(result_path.read_text(encoding="utf-8")))
    for name in ALL_ARMS:
        if name not in options.arms:
            not_run.append({"part": f"arm {name}", "reason": "not selected (--arms)"})
    return arms


def _gemm_part(src: str, parts: _Parts, not_run: list[dict[str, str]], progress: Progress) -> list[dict[str, str]]:
    """The GEMM microbench section, where a CUDA GPU is present."""
    gemm_reason = _gemm_unavailable()
    if gemm_reason is not None:
        not_run.append({"part": "GEMM microbench", "reason": gemm_reason})
        return []
    from fp4forge.report.gemm_tables import gemm_markdown, gemm_plot
    from fp4forge.report.plotting import pyplot

    out = parts.out
    if not parts.resume("gemm", out / "gemm.json"):
        from fp4forge.bench.gemm import load_model_config, projection_shapes, run_gemm_bench

        report = run_gemm_bench(projection_shapes(load_model_config(src)), device="cuda", progress=progress)
        write_text_atomic(out / "gemm.json", json.dumps(report.to_json(), indent=1))
        parts.done("gemm")
    gemm = json.loads((out / "gemm.json").read_text(encoding="utf-8"))
    gemm_plot(gemm, out / "gemm.png", pyplot())
    return [{"title": "GEMM microbench", "markdown": "![gemm](gemm.png)\n\n" + gemm_markdown(gemm)}]


def _plots(frontier_doc: dict[str, Any], arms: list[dict[str, Any]], out: Path, not_run: list[dict[str, str]]) -> dict[str, str]:
    from fp4forge.lab.study.tables import arms_plot, frontier_plot
    from fp4forge.report.plotting import pyplot

    plt = pyplot()
    plots = {}
    if frontier_plot(frontier_doc, out / "frontier.png", plt) is not None:
        plots["frontier"] = "frontier.png"
    if arms and arms_plot(arms, out / "arms.png", plt) is not None:
        plots["arms"] = "arms.png"
    if plt is None:
        not_run.append({"part": "plots", "reason": "matplotlib is not installed"})
    return plots


def _positions(arms: list[dict[str, Any]]) -> int | None:
    """Predicted positions each arm was measured on (the same for every arm)."""
    counts = {a.get("positions") for a in arms if a.get("positions") is not None}
    return counts.pop() if len(counts) == 1 else None


def _gemm_unavailable() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not importable"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (the bench times GPU kernels; run `fp4forge bench gemm --config SRC` on one)"
    return None


__all__ = ["ALL_ARMS", "STUDY_JSON", "STUDY_MD", "StudyOptions", "StudyResult", "run_study"]
