"""`quality compare` as one function: two arms' runs rescored by the suite, then the paired
comparison (noise floor, paired tests, bootstrap CI, flips, verdict). The command line and the
pipeline's quality-teacher step both call :func:`compare_runs`; writing and showing the document
stay with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4forge.errors import ConfigError, ReportError
from fp4forge.quality.report import compare_document
from fp4forge.quality.stats import DEFAULT_ALPHA, DEFAULT_BOOTSTRAP
from fp4forge.quality.runner import RunResult, expand_transcripts, rescore_transcript
from fp4forge.quality.suite import Suite, load_suite

#: One arm: transcripts (files or directories, rescored by the suite) or runs already scored.
Arm = Sequence[Path] | Sequence[RunResult]


@dataclass(frozen=True)
class CompareOptions:
    alpha: float = DEFAULT_ALPHA
    bootstrap: int = DEFAULT_BOOTSTRAP  # resamples of the bootstrap CI
    seed: int = 0  # bootstrap / permutation seed
    allow_unreadable: bool = False  # compare arms whose answers are mostly unread (loud warning)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ConfigError(f"must be between 0 and 1, got {self.alpha}", option="alpha")
        if self.bootstrap < 100:
            raise ConfigError(f"must be at least 100, got {self.bootstrap}", option="bootstrap")


def compare_options(**given: Any) -> CompareOptions:
    """The comparison's options, from `fp4forge quality compare` or the pipeline: the one place
    either makes them (``given``: the fields by name)."""
    return CompareOptions(**given)


def _scored(arm: Arm, suite: Suite) -> list[RunResult]:
    if all(isinstance(item, RunResult) for item in arm):
        return list(arm)  # type: ignore[arg-type]
    return [rescore_transcript(p, suite) for p in expand_transcripts(arm)]  # type: ignore[arg-type]


def compare_runs(arm_a: Arm, arm_b: Arm, options: CompareOptions = CompareOptions(), *, suite: Suite | None = None) -> dict[str, Any]:
    """The comparison document of arm A against arm B."""
    suite = suite or load_suite()
    results_a, results_b = _scored(arm_a, suite), _scored(arm_b, suite)
    if not results_a or not results_b:
        raise ReportError("an arm has no transcripts")
    return compare_document(results_a, results_b, suite, alpha=options.alpha, n_boot=options.bootstrap, seed=options.seed,
                            allow_unreadable=options.allow_unreadable)
