"""The tables of ``suite_resolution``: what its runs' files say, from one or several output folders.

Each folder holds ``jobs.json`` (every job's result or error) and ``plays.tar.gz`` (every play's
record: per-scenario points and texts). Folders of different parts (the resolution on the
shipped testbed, the separation curve) and of more runs of the same part (other seeds) are read
together: a run is an arm's play with one seed, and one seed played twice for the same arm is an
error.
"""

from __future__ import annotations

import json
import math
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.checkpoint.atomic import staged_files
from fp4forge.errors import ConfigError

BF16 = "bf16"
ARMS = ("nvfp4-w4a4-minmax", "nvfp4-w4a16-minmax", "fp8", "int2-g16-mse", "int2-g32-mse")
CURVE_ARM = "int2-g32-mse"
SHIPPED = "shipped"
JOBS_FILE = "jobs.json"  # under OUT: every job's result, written as they finish
PLAYS_TAR = "plays.tar.gz"  # under OUT: every finished play's record
# What must agree between folders read together: their runs are compared with each other.
SAME_IN_EVERY_PART = ("temperature", "max_new_tokens", "limit")


@dataclass
class Runs:
    """What one or several output folders hold: job results, play records, notes, metadata."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # job name -> result
    plays: dict[str, dict[str, Any]] = field(default_factory=dict)  # play job name -> its record
    notes: list[str] = field(default_factory=list)  # what failed or did not finish
    parts: list[dict[str, Any]] = field(default_factory=list)  # each folder's meta


def play_name(build: str, arm: str, seed: int) -> str:
    return f"play:{build}:{arm}:{seed}"


def read_plays(tar_path: Path) -> dict[str, dict[str, Any]]:
    """Every play record in ``tar_path`` by its path inside the archive."""
    if not tar_path.is_file():
        return {}
    with tarfile.open(tar_path, "r:gz") as tar:
        return {m.name: json.loads(tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def load_runs(folders: list[Path]) -> Runs:
    """The jobs and plays of every folder, checked to be comparable and not to repeat a run."""
    runs = Runs()
    for folder in folders:
        if not (folder / JOBS_FILE).is_file():
            raise ConfigError(f"{folder}: no {JOBS_FILE} (not an output folder of suite_resolution)")
        saved = json.loads((folder / JOBS_FILE).read_text())
        _check_comparable(runs.parts, saved["meta"], folder)
        runs.parts.append({**saved["meta"], "folder": str(folder)})
        records = read_plays(folder / PLAYS_TAR)
        for job in saved["jobs"]:
            name, result = job["name"], job["result"]
            if result is None:
                runs.notes.append(f"{name}: {(job['error'] or 'did not finish before the run ended').splitlines()[0]}")
                continue
            if name in runs.results and name.startswith("play:"):
                raise ConfigError(f"{folder}: {name} is also in an earlier folder: a seed played twice for one arm")
            if name.startswith("play:"):
                if result["path"] not in records:
                    runs.notes.append(f"{name}: its record is not in {folder / PLAYS_TAR}")
                    continue
                runs.plays[name] = records[result["path"]]
            runs.results.setdefault(name, result)
    return runs


def _check_comparable(parts: list[dict[str, Any]], meta: dict[str, Any], folder: Path) -> None:
    for part in parts:
        for key in SAME_IN_EVERY_PART:
            if part["plan"][key] != meta["plan"][key]:
                raise ConfigError(f"{folder}: {key} {meta['plan'][key]!r} differs from {part['folder']}'s {part['plan'][key]!r}")
        if part["testbed"]["sha256"] != meta["testbed"]["sha256"]:
            raise ConfigError(f"{folder}: played against another shipped testbed than {part['folder']}")


def arm_runs(runs: Runs, build: str, arm: str) -> list[dict[str, Any]]:
    """The finished runs of one arm on one build (their full records), by seed."""
    prefix = f"play:{build}:{arm}:"
    return sorted((doc for name, doc in runs.plays.items() if name.startswith(prefix)), key=lambda d: d["seed"])


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
    return {"arm": name, **extra, "runs": len(runs), "seeds": [r["seed"] for r in runs], "points_per_run": [r["earned"] for r in runs],
            "max_points": runs[0]["max"] if runs else None, "cut_at_max_tokens": [r["cut_at_max_tokens"] for r in runs],
            "vs_bf16": _compare(against, runs) if name != BF16 else None}


def _curve_point(runs: Runs, build: str, facts: dict[str, Any]) -> dict[str, Any]:
    base, quantized = arm_runs(runs, build, BF16), arm_runs(runs, build, CURVE_ARM)
    return {"build": build, **{k: v for k, v in facts.items() if k != "path"},
            "bf16": _arm_row(BF16, base, base, {}), CURVE_ARM: _arm_row(CURVE_ARM, quantized, base, {})}


def summarise(runs: Runs) -> dict[str, Any]:
    """The resolution rows (BF16 and every arm on the shipped testbed, when played), the A/A
    comparison and minimum detectable effect of BF16's runs, and the curve's points (the shipped
    build first when described, then every trained build by width, steps and seed)."""
    bf16 = arm_runs(runs, SHIPPED, BF16)
    resolution = []
    if bf16 or any(arm_runs(runs, SHIPPED, arm) for arm in ARMS):
        resolution = [_arm_row(BF16, bf16, bf16, {"bpp": 16.0})]
        for arm in ARMS:
            student = runs.results.get(f"student:{SHIPPED}:{arm}", {})
            resolution.append(_arm_row(arm, arm_runs(runs, SHIPPED, arm), bf16, {"bpp": student.get("bpp"), "numerics": student.get("numerics")}))
    trained = sorted(((name.split(":", 1)[1], facts) for name, facts in runs.results.items() if name.startswith("train:")),
                     key=lambda item: (item[1]["width"], item[1]["steps"], item[1]["seed"]))
    shipped = runs.results.get(f"describe:{SHIPPED}")
    curve = ([_curve_point(runs, SHIPPED, shipped)] if shipped and bf16 else []) + [_curve_point(runs, b, f) for b, f in trained]
    even, odd = bf16[0::2], bf16[1::2]
    return {"resolution": resolution, "aa": _compare(even, odd) if len(bf16) >= 2 else None, "mde": noise_only_mde(bf16), "curve": curve}


# -- the report ------------------------------------------------------------------------------------
def _fmt_p(comparison: dict[str, Any] | None) -> str:
    return "" if comparison is None else f"{comparison['sign_test']['p']:.2g}"


def _discordant(comparison: dict[str, Any] | None) -> str:
    """Scenarios favouring BF16 / favouring the arm (A is BF16 in every comparison)."""
    return "" if comparison is None else f"{comparison['sign_test']['favours_a']} / {comparison['sign_test']['favours_b']}"


def _mean(row: dict[str, Any]) -> str:
    points = row["points_per_run"]
    return f"{sum(points) / len(points):.1f}" if points else "not run"


def _range(row: dict[str, Any]) -> str:
    points = row["points_per_run"]
    return f"{min(points)}–{max(points)}" if points else ""


def _verdict(comparison: dict[str, Any] | None, names: tuple[str, str] = ("BF16", "the arm")) -> str:
    """The verdict's label with arms A and B named (A is BF16 against every arm)."""
    if comparison is None:
        return ""
    label = comparison["verdict"]["label"]
    return {"A better": f"{names[0]} better", "B better": f"{names[1]} better"}.get(label, label)


def resolution_markdown(doc: dict[str, Any]) -> list[str]:
    from fp4forge.report.markdown import table

    if not doc["resolution"]:
        return ["Not played in the folders read."]
    rows = [[f"`{r['arm']}`", f"{r['bpp']:.2f}" if r.get("bpp") else "", str(r["runs"]), _mean(r), _range(r), _discordant(r["vs_bf16"]),
             _fmt_p(r["vs_bf16"]), _verdict(r["vs_bf16"])] for r in doc["resolution"]]
    lines = table(["arm", "bits/param", "runs", "mean points", "range", "discordant BF16 / arm", "sign p", "verdict"], rows)
    aa, mde = doc["aa"], doc["mde"]
    if aa is not None:
        lines += ["", f"A/A (BF16's even against odd runs): {_discordant(aa)} discordant, sign p = {_fmt_p(aa)}, verdict: {_verdict(aa, ('even runs', 'odd runs'))}."]
    if mde is not None:
        least = f"the sign test needs at least {mde['smallest_significant_discordance']} discordant scenarios, all one way"
        lines += ["", f"Smallest effect detected with {mde['runs_per_arm']} runs per arm on {mde['scenarios']} scenarios (paired, alpha 0.05, "
                      f"power 0.8, sampling noise only): " + (f"a mean per-scenario score difference of {mde['mean_fraction']:.3f}, "
                      f"about {mde['points_of_max']:.1f} of {mde['max_points']} points; {least}." if mde["mean_fraction"] is not None else
                      f"not estimable, no scenario's score moved between runs; {least}.")]
    return lines


def curve_markdown(doc: dict[str, Any]) -> list[str]:
    from fp4forge.report.markdown import table

    if not doc["curve"]:
        return ["Not played in the folders read."]
    rows = []
    for point in doc["curve"]:
        quantized = point[CURVE_ARM]
        rows.append([point["build"], f"{point['parameters'] / 1e6:.1f} M", f"{point['heldout_perplexity']:.3f}",
                     f"{point['expert_kurtosis_median']:.2f} / {point['expert_kurtosis_max']:.2f}",
                     f"{_mean(point['bf16'])} ({point['bf16']['runs']})", f"{_mean(quantized)} ({quantized['runs']})",
                     _discordant(quantized["vs_bf16"]), _fmt_p(quantized["vs_bf16"]), _verdict(quantized["vs_bf16"])])
    return table(["build", "params", "held-out ppl", "expert kurtosis med / max", "BF16 mean (runs)", f"`{CURVE_ARM}` mean (runs)",
                  "discordant BF16 / arm", "sign p", "verdict"], rows)


def report_markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    parts = "; ".join(f"{p['device']}, {p['wall_seconds'] / 60:.1f} min" for p in meta["parts"])
    plan, testbed = meta["parts"][0]["plan"], meta["parts"][0]["testbed"]
    lines = [f"# Suite resolution ({parts})", "",
             f"Testbed: {testbed['name']} v{testbed['version']} (sha256 `{testbed['sha256'][:16]}…`). "
             f"Offline play, temperature {plan['temperature']}, {plan['max_new_tokens']} new tokens a turn, "
             f"{'all' if plan['limit'] is None else plan['limit']} scenarios; run k of every arm uses seed k.", "",
             "## Resolution: BF16 against each arm", "", *resolution_markdown(doc), "",
             f"## Separation of `{CURVE_ARM}` from BF16 by training length and width", "",
             "Builds `sSTEPS-wWIDTH@SEED`: the default recipe trained STEPS steps at WIDTH times the hidden, head and MLP "
             "sizes from SEED, on the run's GPU; `shipped` is the shipped CPU build (its runs are the resolution table's). "
             "Means are points per run; discordant: scenarios where BF16 / the arm does better.", "",
             *curve_markdown(doc)]
    if meta["not_run"]:
        lines += ["", "## Not run", "", *(f"- {note}" for note in meta["not_run"])]
    return "\n".join(lines) + "\n"


def write_report(out: Path, folders: list[Path]) -> dict[str, Any]:
    """``OUT/resolution.json`` and ``OUT/resolution.md`` from the output folders ``folders``."""
    runs = load_runs(folders)
    doc = {**summarise(runs), "meta": {"parts": runs.parts, "not_run": runs.notes}}
    with staged_files(out) as stage:  # both or neither: the tables never disagree with their JSON
        stage.path("resolution.md").write_text(report_markdown(doc))
        stage.path("resolution.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc
