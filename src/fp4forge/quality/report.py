"""Quality reports as data: the score and compare documents, and the one writer of a document's
files. Statistics come from ``stats``; Markdown, tables and plots are ``fp4forge.report``'s
(``quality_tables``, ``quality_plots``; ``quality_files`` writes every document with them).

Documents:
* score:   per run totals, per category earned/max, typed error counts, defect flags (stray
           ``</think>``, tool markup in content...), and an A/A noise floor per arm with >= 2 runs;
* compare: ``stats.compare_arms`` plus what each arm was (endpoint, request parameters), flags;
* kl / determinism: the probe documents from ``probes``.
Files: ``<name>.json`` and ``<name>.md`` (``write_document``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from fp4forge import versioned
from fp4forge.errors import ReportError
from fp4forge.quality.answers import arm_health, refusal_block
from fp4forge.quality.suite import Suite
from fp4forge.quality.runner import RunResult
from fp4forge.quality.scorer import category_totals
from fp4forge.quality.stats import DEFAULT_ALPHA, DEFAULT_BOOTSTRAP, compare_arms, noise_floor

FLAG_KEYS = ("stray_think_tag", "reasoning_in_content", "unparsed_tool_markup", "reasoning_field", "malformed_arguments", "empty_turn")


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


def answers_block(results: list[RunResult], allow_unreadable: bool) -> dict[str, Any]:
    """Per arm: how many turns the suite could read, and whether the arm is refused (``answers``)."""
    by_arm: dict[str, list[RunResult]] = {}
    for result in results:
        by_arm.setdefault(result.arm, []).append(result)
    arms = [(arm, arm_health(r.answers for r in runs), _max_tokens(runs)) for arm, runs in by_arm.items()]
    return refusal_block(arms, allow_unreadable)


def _max_tokens(runs: list[RunResult]) -> Any:
    return (runs[0].header.get("request") or {}).get("max_tokens")


def score_document(results: list[RunResult], suite: Suite, *, allow_unreadable: bool = False) -> dict[str, Any]:
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
        "answers": answers_block(results, allow_unreadable),
        "scenarios": {
            r.path: {sid: {"earned": s.earned, "max": s.max, "errors": [e.kind for e in s.errors]} for sid, s in r.scores.items()}
            for r in results
        },
    }


# -- compare ------------------------------------------------------------------------------------
def compare_document(results_a: list[RunResult], results_b: list[RunResult], suite: Suite, *, alpha: float = DEFAULT_ALPHA,
                     n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, allow_unreadable: bool = False) -> dict[str, Any]:
    """The paired comparison. Its ``answers`` block says whether an arm's answers were unreadable
    (``quality.answers``); when it ``refused``, the statistics are there but are no verdict:
    callers raise ``answers.refusal_error(doc)`` after writing the document."""
    for result in results_a + results_b:
        if not result.complete:
            raise ReportError(f"{result.path} is an incomplete run ({len(result.scores)} scenarios scored): "
                              "comparing it would silently drop scenarios")
    labels_a, labels_b = {r.arm for r in results_a}, {r.arm for r in results_b}
    if labels_a & labels_b and len(labels_a | labels_b) > 1:
        # e.g. `--b B1 B2`: the option takes one path and B2 lands in arm A. Both arms sharing one
        # label (the default "A") is fine; a label on both sides among others is a misgrouping.
        raise ReportError(f"arm A holds runs labelled {_labels(labels_a)} and arm B runs labelled {_labels(labels_b)}: "
                          f"runs of one arm are grouped with the other's (`--b` takes one path: repeat it, or "
                          f"list arm B's runs after `--`)")
    id_sets = {frozenset(r.scores) for r in results_a + results_b}
    if len(id_sets) != 1:
        raise ReportError("the runs do not hold the same scenarios (a partial run among full runs?)")
    categories = {s.id: s.category for s in suite.scenarios}
    requests = {"A": [r.header.get("request") or {} for r in results_a], "B": [r.header.get("request") or {} for r in results_b]}
    stats = compare_arms([run_points(r) for r in results_a], [run_points(r) for r in results_b], categories,
                         alpha=alpha, n_boot=n_boot, seed=seed, requests=requests)
    warnings = [w for r in results_a + results_b for w in r.warnings]
    answers = refusal_block([(f"A ({results_a[0].arm})", arm_health(r.answers for r in results_a), _max_tokens(results_a)),
                             (f"B ({results_b[0].arm})", arm_health(r.answers for r in results_b), _max_tokens(results_b))],
                            allow_unreadable)
    if answers["refused"]:
        # The statistics stay in the document (the evidence); the verdict is the refusal.
        stats["verdict"] = {"label": "refused", "text": "refused to score: " + "; ".join(answers["unreadable"]),
                            "notes": ["docs/quality.md#unreadable-answers says what to change"]}
    elif answers["allowed"]:
        stats["verdict"] = {**stats["verdict"], "text": "UNREADABLE ANSWERS, scored anyway (the verdict measures the serving "
                            "format, not the model): " + stats["verdict"]["text"]}
        warnings += [f"UNREADABLE ANSWERS, scored anyway: {reason}" for reason in answers["unreadable"]]
    digests = {r.header["suite"]["digest"] for r in results_a + results_b}
    if len(digests) > 1:
        warnings.append("the runs were recorded with different suite versions (all re-scored with the current one)")
    return {
        "suite": {"name": suite.name, "version": suite.version, "digest": suite.digest},
        "arms": {"A": arm_description(results_a, suite), "B": arm_description(results_b, suite)},
        **stats,
        "answers": answers,
        "warnings": warnings,
    }


def _labels(labels: set[str]) -> str:
    return ", ".join(repr(label) for label in sorted(labels))


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
    """``<name>.json`` and ``<name>.md`` (the Markdown already rendered) in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(versioned(doc), indent=2) + "\n", encoding="utf-8")
    (out_dir / f"{name}.md").write_text(markdown, encoding="utf-8")
    return [f"{name}.json", f"{name}.md"]
