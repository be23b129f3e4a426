"""Intervals of the fidelity numbers, resampling documents (docs/fidelity.md#intervals).

Positions of one document are not independent (a text the student finds hard is hard at every
position), so the unit a bootstrap resamples is the document: each predicted position belongs to
the document of the token it predicts (packing cuts documents into rows, so a row may hold several
documents and a document span several rows). A bootstrap draw takes documents with replacement
and recomputes each number as the run does, over all positions of the drawn documents: KL and top-1
agreement as means per position, perplexity as ``exp`` of the mean negative log-likelihood.

The resampling is ``fp4forge.stats``' (one random source, one quantile convention).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fp4forge.stats import DEFAULT_LEVEL, DEFAULT_RESAMPLES, percentile_interval, resample

# The per-position values summed per unit, and how each reported number is made of the sums.
PER_POSITION = ("kl", "agree", "teacher_nll", "student_nll")
REPORTED = {
    "kl": lambda sums, count: sums["kl"] / count,
    "top1_agreement": lambda sums, count: sums["agree"] / count,
    "teacher_perplexity": lambda sums, count: np.exp(sums["teacher_nll"] / count),
    "student_perplexity": lambda sums, count: np.exp(sums["student_nll"] / count),
}


def unit_sums(values: dict[str, np.ndarray], units: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per unit (documents numbered by ``units``, one per position), the sum of each value and the
    number of positions; units without a position are dropped."""
    present, index = np.unique(units, return_inverse=True)
    counts = np.bincount(index, minlength=present.size).astype(float)
    sums = {name: np.bincount(index, weights=np.asarray(v, dtype=float), minlength=present.size) for name, v in values.items()}
    return sums, counts


def unit_intervals(sums: dict[str, np.ndarray], counts: np.ndarray, *, level: float = DEFAULT_LEVEL,
                   resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, dict[str, float]]:
    """Percentile-bootstrap interval of every reported number, the units resampled together."""
    names = sorted(sums)
    drawn = resample([*(sums[name] for name in names), counts], resamples=resamples, seed=seed, paired=True)
    drawn_sums = {name: rows.sum(axis=1) for name, rows in zip(names, drawn[:-1])}
    drawn_count = drawn[-1].sum(axis=1)
    out = {}
    for reported, make in REPORTED.items():
        low, high = percentile_interval(make(drawn_sums, drawn_count), level)
        out[reported] = {"low": low, "high": high, "level": level}
    return out


def fidelity_intervals(per_position: dict[str, np.ndarray], document_ids: np.ndarray, *,
                       level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """``metrics`` keys: ``intervals``, ``documents`` (units resampled), ``tokens`` (predicted
    positions scored) and ``interval_unit``. ``per_position`` holds ``PER_POSITION`` flat, row
    after row; ``document_ids`` [rows, seq_len] numbers each token's document."""
    # A position predicts the next token: it belongs to that token's document.
    units = np.asarray(document_ids)[:, 1:].reshape(-1)
    sums, counts = unit_sums(per_position, units)
    return {
        "intervals": unit_intervals(sums, counts, level=level, resamples=resamples, seed=seed),
        "documents": int(counts.size),
        "tokens": int(units.size),
        "interval_unit": "document",
    }
