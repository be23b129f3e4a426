"""Quality reports: JSON documents, Markdown, PNG plots. Statistics come from ``stats``; tables from
``fp4forge.report.quality_tables``.

Documents:
* score:   per run totals, per category earned/max, typed error counts, defect flags (stray
           ``</think>``, tool markup in content...), and an A/A noise floor per arm with >= 2 runs;
* compare: ``stats.compare_arms`` plus what each arm was (endpoint, request parameters), flags;
* kl / determinism: the probe documents from ``probes``.
Files: ``<name>.json`` and ``<name>.md``; plots ``category_scores.png`` (score per category per arm,
bars = mean over runs, whiskers = min-max over runs: the within-arm noise band) and
``divergence_histogram.png``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from fp4forge.errors import Fp4forgeError
from fp4forge.plotting import pyplot
from fp4forge.quality.suite import Suite
from fp4forge.quality.runner import RunResult
from fp4forge.quality.scorer import category_totals
from fp4forge.quality.stats import DEFAULT_ALPHA, DEFAULT_BOOTSTRAP, compare_arms, noise_floor
from fp4forge.report.quality_tables import compare_markdown, determinism_markdown, kl_markdown, score_markdown

CATEGORY_PLOT = "category_scores.png"
DIVERGENCE_PLOT = "divergence_histogram.png"
FLAG_KEYS = ("stray_think_tag", "reasoning_in_content", "unparsed_tool_markup", "reasoning_field", "malformed_arguments", "empty_turn")


class ReportError(Fp4forgeError):
    """Runs that cannot be compared (incomplete, different scenarios)."""


# -- score --------------------------------------------------------------------------------------
def run_points(result: RunResult) -> dict[str, tuple[int, int]]:
    return {scenario_id: (score.earned, score.max) for scenario_id, score in result.scores.items()}


def flag_counts(result: RunResult) -> dict[str, int]:
    """Scenarios (not turns) showing each defect at least once."""
    return {key: sum(1 for s in result.scores.values() if s.flags.get(key, 0) > 0) for key in FLAG_KEYS}


def error_counts(result: RunResult) -> dict[str, int]:
    return dict(sorted(Counter(error.kind for s in result.scores.values() for error in s.errors).items()))


def run_document(result: RunResult, suite: Suite) -> dict[str, Any]:
    return {
        **result.summary(),
        "request": result.header.get("request"),
        "endpoint": result.header.get("endpoint"),
        "categories": category_totals(list(result.scores.values()), suite.categories),
        "flags": flag_counts(result),
        "errors": error_counts(result),
        "scenarios_fully_correct": sum(1 for s in result.scores.values() if s.fully_correct),
    }


def score_document(results: list[RunResult], suite: Suite) -> dict[str, Any]:
    categories = {s.id: s.category for s in suite.scenarios}
    by_arm: dict[str, list[RunResult]] = {}
    for result in results:
        by_arm.setdefault(result.arm, []).append(result)
    floors = {
        arm: noise_floor([run_points(r) for r in runs], categories)
        for arm, runs in by_arm.items()
        if len(runs) >= 2 and all(r.complete for r in runs)
    }
    return {
        "suite": {"name": suite.name, "version": suite.version, "digest": suite.digest, "scenario_count": len(suite.scenarios)},
        "runs": [run_document(r, suite) for r in results],
        "noise_floor": floors,
        "scenarios": {
            r.path: {sid: {"earned": s.earned, "max": s.max, "errors": [e.kind for e in s.errors]} for sid, s in r.scores.items()}
            for r in results
        },
    }


# -- compare ------------------------------------------------------------------------------------
def compare_document(results_a: list[RunResult], results_b: list[RunResult], suite: Suite, *, alpha: float = DEFAULT_ALPHA,
                     n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict[str, Any]:
    for result in results_a + results_b:
        if not result.complete:
            raise ReportError(f"{result.path} is an incomplete run ({len(result.scores)} scenarios scored): "
                              "comparing it would silently drop scenarios")
    id_sets = {frozenset(r.scores) for r in results_a + results_b}
    if len(id_sets) != 1:
        raise ReportError("the runs do not hold the same scenarios (a --only run among full runs?)")
    categories = {s.id: s.category for s in suite.scenarios}
    stats = compare_arms([run_points(r) for r in results_a], [run_points(r) for r in results_b], categories,
                         alpha=alpha, n_boot=n_boot, seed=seed)
    warnings = [w for r in results_a + results_b for w in r.warnings]
    digests = {r.header["suite"]["digest"] for r in results_a + results_b}
    if len(digests) > 1:
        warnings.append("the runs were recorded with different suite versions (all re-scored with the current one)")
    return {
        "suite": {"name": suite.name, "version": suite.version, "digest": suite.digest},
        "arms": {"A": arm_description(results_a, suite), "B": arm_description(results_b, suite)},
        **stats,
        "warnings": warnings,
    }


def arm_description(results: list[RunResult], suite: Suite) -> dict[str, Any]:
    first = results[0]
    return {
        "label": first.arm,
        "transcripts": [r.path for r in results],
        "endpoint": first.header.get("endpoint"),
        "request": first.header.get("request"),
        "failed_requests": sum(r.failed_requests for r in results),
        "flags_per_run": [flag_counts(r) for r in results],
        "errors_per_run": [error_counts(r) for r in results],
        "points_per_run": [r.earned for r in results],
    }


# -- writing ------------------------------------------------------------------------------------
def write_document(doc: dict[str, Any], out_dir: Path, name: str, markdown: str) -> list[str]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(markdown, encoding="utf-8")
    return [f"{name}.json", f"{name}.md"]


def write_score(doc: dict[str, Any], out_dir: Path) -> list[str]:
    return write_document(doc, out_dir, "score", score_markdown(doc))


def write_compare(doc: dict[str, Any], out_dir: Path, *, plots: bool = True) -> list[str]:
    written = []
    if plots and plot_category_scores(doc, Path(out_dir) / CATEGORY_PLOT):
        written.append(CATEGORY_PLOT)
        doc["plots"] = [CATEGORY_PLOT]
    return write_document(doc, out_dir, "compare", compare_markdown(doc)) + written


def write_kl(doc: dict[str, Any], out_dir: Path) -> list[str]:
    return write_document(doc, out_dir, "kl", kl_markdown(doc))


def write_determinism(doc: dict[str, Any], out_dir: Path, *, plots: bool = True) -> list[str]:
    written = []
    if plots and plot_divergence_histogram(doc, Path(out_dir) / DIVERGENCE_PLOT):
        written.append(DIVERGENCE_PLOT)
        doc["plots"] = [DIVERGENCE_PLOT]
    return write_document(doc, out_dir, "determinism", determinism_markdown(doc)) + written


# -- plots --------------------------------------------------------------------------------------
def plot_category_scores(doc: dict[str, Any], path: Path) -> bool:
    """Per category, each arm's mean fraction of points, whiskers spanning its runs (the noise band)."""
    plt = pyplot()
    if plt is None:
        return False
    rows = list(doc["categories"].items())
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(max(8.0, 0.6 * len(rows) + 2), 4.8))
    width = 0.38
    for offset, arm, colour in ((-width / 2, "a", "tab:blue"), (width / 2, "b", "tab:orange")):
        means, lows, highs = [], [], []
        for _, row in rows:
            scale = row["max"] or 1
            runs = [value / scale for value in row[arm]]
            mean = row[f"mean_{arm}"] / scale
            means.append(mean)
            lows.append(mean - min(runs))
            highs.append(max(runs) - mean)
        label = f"{arm.upper()} ({doc['arms'][arm.upper()]['label']}, {doc['runs'][arm.upper()]} run(s))"
        axis.bar([i + offset for i in range(len(rows))], means, width, yerr=[lows, highs], capsize=3, color=colour, alpha=0.85, label=label)
    axis.set_xticks(range(len(rows)), [name for name, _ in rows], rotation=40, ha="right", fontsize=8)
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("earned / max")
    axis.set_title(f"Score per category (whiskers: min–max over an arm's runs). {doc['verdict']['label']}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def plot_divergence_histogram(doc: dict[str, Any], path: Path) -> bool:
    """First position where a greedy replicate leaves the first replicate's tokens; 'never' last."""
    plt = pyplot()
    if plt is None:
        return False
    greedy = doc["greedy"]
    histogram = {int(k): v for k, v in greedy["first_divergence_histogram"].items()}
    never = greedy["replicate_pairs"] - greedy["diverged"]
    positions = list(range(doc["max_tokens"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(8.0, 3.8))
    axis.bar(positions, [histogram.get(p, 0) for p in positions], color="tab:red", label="diverged at this token")
    axis.bar([len(positions) + 1], [never], color="tab:green", label="never diverged")
    axis.set_xlabel(f"first divergent generated token (the bar at {len(positions) + 1}: identical through {doc['max_tokens']} tokens)")
    axis.set_ylabel("replicates")
    stable = doc["teacher_forced"]["bitwise_stable_fraction"]
    stable_text = "–" if stable is None else f"{stable:.1%}"
    axis.set_title(f"Greedy replicates vs the first ({doc['replicates']} per prompt, {doc['sequences']} prompts); "
                   f"teacher-forced bitwise-stable positions {stable_text}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
