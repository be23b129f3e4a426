"""`quality run` as one library function: run the suite N times against an endpoint, then score.

``run_and_score`` writes the transcripts (``runner.run_suite``), re-scores them where they finally
live and builds the score document; ``write`` (``fp4forge.report.quality_files.write_score``)
renders it to files. The CLI (``fp4forge quality run``) and the pipeline's quality steps both call
it; the pipeline also passes ``publish``, which moves the finished transcripts from its staging
directory into place before they are scored, so the score document names their real paths.
An arm whose answers the suite cannot read is scored and written all the same (the files are the
evidence) but ``QualityOutcome.refusal`` holds the ``UnreadableAnswersError`` its callers raise
or carry (``quality.answers``); ``allow_unreadable`` makes it a warning in the document instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4forge.errors import UnreadableAnswersError
from fp4forge.quality.answers import refusal_error
from fp4forge.quality.report import score_document
from fp4forge.quality.runner import RunConfig, RunResult, rescore_transcript, run_suite
from fp4forge.quality.suite import Suite, load_suite

ScoreWriter = Callable[[dict[str, Any], Path], Any]


@dataclass
class QualityOutcome:
    """The transcripts of one ``run_and_score``, their re-scored results and the score document."""

    out_dir: Path
    transcripts: list[Path]
    results: list[RunResult]
    document: dict[str, Any]

    @property
    def failed_requests(self) -> int:
        return sum(r.failed_requests for r in self.results)

    @property
    def refusal(self) -> UnreadableAnswersError | None:
        return refusal_error(self.document, file=str(self.out_dir))


def run_and_score(
    config: RunConfig,
    out_dir: Path,
    *,
    only: Sequence[str] | None = None,
    categories: Sequence[str] | None = None,
    suite: Suite | None = None,
    on_scenario: Callable[[int, dict[str, Any]], None] | None = None,
    publish: Callable[[Path], Path] | None = None,
    write: ScoreWriter | None = None,
    allow_unreadable: bool = False,
) -> QualityOutcome:
    """``config.runs`` runs of the suite (or the scenarios ``only`` / ``categories`` select) into
    ``out_dir``; ``publish(out_dir)`` (optional) returns the directory they end up in; scored there.

    Raises ``QualityRunError`` (no server, model not served), ``SuiteError`` (unknown ids or
    categories) before any transcript, and ``IncompleteRunError`` when a run wrote fewer scenarios
    than it should (its transcript, footer included, is kept).
    """
    suite = suite or load_suite()
    scenarios = suite.select(ids=list(only) if only else None, categories=list(categories) if categories else None)
    paths = run_suite(config, suite, out_dir, scenarios=scenarios, on_scenario=on_scenario)
    final = Path(publish(Path(out_dir))) if publish is not None else Path(out_dir)
    transcripts = [final / path.name for path in paths]
    results = [rescore_transcript(path, suite) for path in transcripts]
    document = score_document(results, suite, allow_unreadable=allow_unreadable)
    if write is not None:
        write(document, final)
    return QualityOutcome(final, transcripts, results, document)
