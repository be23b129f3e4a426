"""The files of each quality document: ``<name>.json``, ``<name>.md`` and its plots.

``write_score`` / ``write_compare`` / ``write_kl`` / ``write_determinism`` render the Markdown
(``quality_tables``) and plots (``quality_plots``) and hand them to the one document writer,
``fp4forge.quality.report.write_document``. A plot that was drawn is listed in the document's
``plots`` before the JSON is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp4forge.quality.report import write_document
from fp4forge.report.quality_plots import CATEGORY_PLOT, DIVERGENCE_PLOT, plot_category_scores, plot_divergence_histogram
from fp4forge.report.quality_tables import compare_markdown, determinism_markdown, kl_markdown, score_markdown


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
