"""Analysis: every statistic recomputed from ``samples.jsonl`` alone.

``summarize_samples`` is pure (list of sample dicts in, summary dict out), so a run can be
re-analysed, merged with another (concatenate the files) or analysed on another machine.
``analyze_dir`` adds the optional side files (``run.json``, ``server_metrics.jsonl``) for context
and writes ``summary.json``; a ``SummaryPresenter`` (``fp4forge.report.bench_plots``) writes the
human-facing files beside it (``summary.md``, PNG plots): presentation is not this package's.
``compare_samples`` puts two runs side by side, cell by cell.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fp4forge import versioned
from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.bench import stats
from fp4forge.bench.runner import RUN_FILE, SAMPLES_FILE, SERVER_METRICS_FILE, counters_of, with_means
from fp4forge.errors import ConfigError

SUMMARY_SCHEMA = "fp4forge.bench.summary/1"
COMPARE_SCHEMA = "fp4forge.bench.compare/1"
SUMMARY_FILE = "summary.json"
SUMMARY_MARKDOWN_FILE = "summary.md"
REQUIRED_SAMPLE_KEYS = ("shape", "prompt_tokens", "output_tokens", "ttft_s", "decode_tok_s", "e2e_s", "ok")


# -- reading ------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Objects of a JSON-lines file and the number of unreadable lines (a run killed mid-write
    can leave a truncated last line; everything before it is still good)."""
    records, unreadable = [], 0
    with Path(path).open("r", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                unreadable += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                unreadable += 1
    return records, unreadable


def read_samples(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no {SAMPLES_FILE}; is it the output directory of a `fp4forge bench perf` run?")
    samples, unreadable = read_jsonl(path)
    for record in samples:
        missing = [key for key in REQUIRED_SAMPLE_KEYS if key not in record]
        if missing:
            raise ConfigError(f"{path}: a sample lacks {missing}; not an fp4forge bench samples file", file=str(path))
    return samples, unreadable


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


# -- grouping -----------------------------------------------------------------------------------
def cell_key(sample: dict[str, Any]) -> tuple[str, str]:
    return (str(sample.get("load") or "c1"), str(sample["shape"]))


def group_cells(samples: Iterable[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Samples per (load, shape), in order of first appearance."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for sample in samples:
        cells.setdefault(cell_key(sample), []).append(sample)
    return cells


def ladder_order(cells: dict[tuple[str, str], list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """Cell keys by load point (as first sent), then by prompt length: the shapes ran in random order."""
    loads = list(dict.fromkeys(load for load, _ in cells))

    def key(cell: tuple[str, str]) -> tuple[int, float, str]:
        tokens = [s["prompt_tokens"] for s in cells[cell] if s.get("prompt_tokens") is not None]
        return (loads.index(cell[0]), float(np.median(tokens)) if tokens else float("inf"), cell[1])

    return sorted(cells, key=key)


def kept_ok(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in samples if s["ok"] and not s.get("warmup", False)]


def values_of(samples: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(s[key]) for s in samples if s.get(key) is not None]


# -- per-cell statistics ------------------------------------------------------------------------
def metric_block(values: Sequence[float], *, hide_median: bool = False) -> dict[str, Any] | None:
    """Spread plus a bootstrap CI of the median; the median is withheld when it would mislead."""
    spread = stats.spread(values)
    if spread is None:
        return None
    block = spread.to_json()
    ci = stats.bootstrap_median_ci(values)
    block["median_ci"] = list(ci) if ci else None
    if hide_median:
        block["median"] = None
        block["median_ci"] = None
        block["caveats"] = [*block["caveats"], "bimodal: no median; see modes"]
    return block


def summarize_cell(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    first = samples[0]
    kept = kept_ok(samples)
    measured = [s for s in samples if not s.get("warmup", False)]
    failures = Counter(s.get("error_kind") or "unknown" for s in measured if not s["ok"])
    ttft = values_of(kept, "ttft_s")
    decode = values_of(kept, "decode_tok_s")
    ttft_test = stats.detect_bimodality(ttft)
    decode_test = stats.detect_bimodality(decode)
    prompt_tokens = _median_int(values_of(kept or measured or samples, "prompt_tokens"))
    target_output = first.get("target_output_tokens")
    ttft_block = metric_block(ttft, hide_median=ttft_test.bimodal)
    decode_block = metric_block(decode, hide_median=decode_test.bimodal)
    cached = [s["cached_tokens"] for s in kept if s.get("cached_tokens") is not None]
    return {
        "shape": first["shape"],
        "load": str(first.get("load") or "c1"),
        "mode": first.get("mode", "sequential"),
        "concurrency": first.get("concurrency"),
        "rate_rps": first.get("rate_rps"),
        "prompt_tokens": prompt_tokens,
        "output_tokens": _median_int(values_of(kept, "output_tokens")),
        "target_output_tokens": target_output,
        "n": len(kept),
        "n_failed": sum(failures.values()),
        "failures_by_kind": dict(failures),
        "n_warmup": sum(1 for s in samples if s.get("warmup", False)),
        "median_ttft_s": ttft_block["median"] if ttft_block else None,
        "median_ttft_ci_s": ttft_block["median_ci"] if ttft_block else None,
        "bimodal": ttft_test.bimodal,
        "modes": [_mode_json(m) for m in ttft_test.modes],
        "bimodality": ttft_test.to_json(),
        "ttft_s": ttft_block,
        "median_decode_tok_s": decode_block["median"] if decode_block else None,
        "median_decode_tok_s_ci": decode_block["median_ci"] if decode_block else None,
        "decode_bimodal": decode_test.bimodal,
        "decode_modes": [_mode_json(m) for m in decode_test.modes],
        "decode_tok_s": decode_block,
        "median_tpot_s": _median(values_of(kept, "tpot_s")),
        "tpot_s": metric_block(values_of(kept, "tpot_s")),
        "e2e_s": metric_block(values_of(kept, "e2e_s")),
        "first_chunk_s": metric_block(values_of(kept, "first_chunk_s")),
        "schedule_lag_s": metric_block(values_of(kept, "schedule_lag_s")),
        "short_outputs": sum(1 for s in kept if target_output and s["output_tokens"] < target_output),
        "cached_tokens_total": sum(cached) if cached else None,
        "prefill_regime": None,  # filled in per load by the prefill fit
        "isl_over_ttft_tok_s": None,
        "server": None,
    }


def _mode_json(mode: stats.Mode) -> dict[str, Any]:
    return {"centre": mode.centre, "share": mode.share, "n": mode.n, "min": mode.min, "max": mode.max}


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if values else None


def _median_int(values: Sequence[float]) -> int | None:
    return int(round(float(np.median(values)))) if values else None


# -- the whole run ------------------------------------------------------------------------------
def summarize_samples(
    samples: Sequence[dict[str, Any]],
    *,
    server_metrics: Sequence[dict[str, Any]] = (),
    run: dict[str, Any] | None = None,
    unreadable_lines: int = 0,
) -> dict[str, Any]:
    """Everything ``summary.json`` holds, from samples (plus optional server-side context)."""
    cells = group_cells(samples)
    entries = [summarize_cell(cells[key]) for key in ladder_order(cells)]
    metrics_by_cell = merged_server_metrics(server_metrics)
    for entry in entries:
        entry["server"] = metrics_by_cell.get((entry["load"], entry["shape"]))

    loads = list(dict.fromkeys(entry["load"] for entry in entries))
    prefill, flatness, order = [], [], []
    for load in loads:
        group = [e for e in entries if e["load"] == load]
        load_samples = kept_ok([s for s in samples if cell_key(s)[0] == load])
        order.append({"load": load, "order_correlation": send_order_correlation(load_samples)})
        prefill.append({"load": load, **_prefill_for_load(group, cells, load, load_samples)})
        flatness.append({"load": load, **_flatness_for_load(group, cells, load, load_samples)})

    measured = [s for s in samples if not s.get("warmup", False)]
    failures = Counter(s.get("error_kind") or "unknown" for s in measured if not s["ok"])
    return {
        "schema": SUMMARY_SCHEMA,
        "source": {
            "samples_file": SAMPLES_FILE,
            "lines": len(samples),
            "unreadable_lines": unreadable_lines,
            "run_ids": sorted({str(s.get("run_id")) for s in samples if s.get("run_id")}),
        },
        "run": _run_context(run),
        "totals": {
            "requests": len(samples),
            "warmups": len(samples) - len(measured),
            "kept_ok": len(kept_ok(samples)),
            "failed": sum(failures.values()),
            "failures_by_kind": dict(failures),
        },
        "shapes": entries,
        "prefill": prefill,
        "decode_flatness": flatness,
        "order": order,
        "methods": {
            "order_test": stats.ORDER_TEST_TEXT,
            "percentiles": "linear interpolation (numpy.percentile default, as vLLM bench and AIPerf)",
            "median_ci": f"percentile bootstrap, {stats.BOOTSTRAP_RESAMPLES} resamples, {stats.CI_CONFIDENCE:.0%}, seed 0",
            "bimodality": f"{stats.BIMODALITY_TEST_NAME}; bimodal when p < {stats.BIMODALITY_ALPHA} and modes >= {stats.MIN_MODE_RATIO}x apart",
            "knee": stats.KNEE_RULE_TEXT + "; bimodal shapes are labelled but left out of the line",
            "decode_flat": stats.DECODE_FLAT_TEST_TEXT,
            "prefill_goodness": stats.CURVATURE_TEST_TEXT + f"; the line misses a fitted shape whose median is off by > {stats.LINE_MISS_SHARE:.0%}",
            "decode_tok_s": "(tokens after the first chunk) / (t_last_token - t_first_token) per request",
            "ttft_s": "send -> first chunk carrying generated text, reasoning or a tool call (role-only chunks excluded)",
        },
    }


# -- the order test's inputs: send order and the run's halves in time -----------------------------
def send_order_correlation(kept: Sequence[dict[str, Any]]) -> float | None:
    """Pearson r between each kept request's position in the run (``seq``) and its prompt length
    (None when either is constant or the samples carry no position)."""
    pairs = [(s["seq"], s["prompt_tokens"]) for s in kept if s.get("seq") is not None and s.get("prompt_tokens") is not None]
    if len(pairs) < 3:
        return None
    seq, tokens = (np.asarray(v, dtype=float) for v in zip(*pairs))
    if np.ptp(seq) == 0 or np.ptp(tokens) == 0:
        return None
    return float(np.corrcoef(seq, tokens)[0, 1])


def run_halves(kept: Sequence[dict[str, Any]], key: str) -> stats.RunHalves | None:
    """One load's kept samples of metric ``key`` split at the middle of the run (by ``seq``)."""
    timed = sorted((s for s in kept if s.get("seq") is not None and s.get(key) is not None), key=lambda s: s["seq"])
    if len(timed) < 4:
        return None
    middle = len(timed) // 2
    return stats.RunHalves(_shape_points(timed[:middle], key), _shape_points(timed[middle:], key), send_order_correlation(kept))


def _shape_points(samples: Sequence[dict[str, Any]], key: str) -> list[stats.ShapePoint]:
    by_tokens: dict[float, list[float]] = {}
    for sample in samples:
        by_tokens.setdefault(sample["prompt_tokens"], []).append(float(sample[key]))
    return [stats.ShapePoint(tokens, values) for tokens, values in sorted(by_tokens.items())]


def merged_server_metrics(records: Sequence[dict[str, Any]]) -> dict[tuple[Any, Any], dict[str, float | None] | None]:
    """Per cell, the server's counters summed over its blocks (one per round) and their means."""
    merged: dict[tuple[Any, Any], dict[str, float] | None] = {}
    for record in records:
        key, delta = (record.get("load"), record.get("shape")), record.get("delta")
        if delta is None or (key in merged and merged[key] is None):
            merged[key] = None  # a block without metrics: the cell's totals are unknown
            continue
        total = merged.setdefault(key, {})
        for name, value in counters_of(delta).items():
            total[name] = total.get(name, 0.0) + value
    return {key: None if total is None else with_means(total) for key, total in merged.items()}


def _prefill_for_load(group: list[dict[str, Any]], cells: dict, load: str, kept: Sequence[dict[str, Any]]) -> dict[str, Any]:
    points = [
        stats.ShapePoint(e["prompt_tokens"], values_of(kept_ok(cells[(load, e["shape"])]), "ttft_s"))
        for e in group
        if e["prompt_tokens"] is not None
    ]
    bimodal = frozenset(e["prompt_tokens"] for e in group if e["bimodal"])
    fit = stats.prefill_fit(points, exclude_from_fit=bimodal, halves=run_halves(kept, "ttft_s"))
    for entry in group:
        regime = fit.regimes.get(entry["prompt_tokens"])
        entry["prefill_regime"] = regime
        ttft = entry["ttft_s"]["median"] if entry["ttft_s"] else None
        entry["isl_over_ttft_tok_s"] = entry["prompt_tokens"] / ttft if ttft else None
    doc = fit.to_json()
    doc["excluded_bimodal_shapes"] = [e["shape"] for e in group if e["bimodal"] and e["prefill_regime"] == stats.COMPUTE_LABEL]
    return doc


def _flatness_for_load(group: list[dict[str, Any]], cells: dict, load: str, kept: Sequence[dict[str, Any]]) -> dict[str, Any]:
    points = [
        stats.ShapePoint(e["prompt_tokens"], values_of(kept_ok(cells[(load, e["shape"])]), "decode_tok_s"))
        for e in group
        if e["prompt_tokens"] is not None
    ]
    return stats.decode_flatness(points, halves=run_halves(kept, "decode_tok_s")).to_json()


def _run_context(run: dict[str, Any] | None) -> dict[str, Any] | None:
    if not run:
        return None
    config = run.get("config", {})
    server = run.get("server", {})
    return {
        "run_id": run.get("run_id"),
        "status": run.get("status"),
        "aborted": run.get("aborted"),
        "model": config.get("model"),
        "url": config.get("base_url"),
        "endpoint": config.get("endpoint"),
        "workload": config.get("workload"),
        "prefix_cache_fraction": config.get("prefix_cache_fraction"),
        "server_version": server.get("version"),
        "stream_options": server.get("stream_options"),
        "client": run.get("client"),
        "host": run.get("host"),
        "order": run.get("order"),
    }


class SummaryPresenter(Protocol):
    """Human-facing files of a run directory, written beside ``summary.json``."""

    def markdown(self, summary: dict[str, Any]) -> str:
        """The text of ``summary.md``."""
        ...

    def plots(self, samples: Sequence[dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> list[str]:
        """Draw the plots into ``out_dir``; the file names written (none without matplotlib)."""
        ...


def analyze_dir(run_dir: Path, *, plots: bool = True, presenter: SummaryPresenter | None = None) -> dict[str, Any]:
    """Recompute the summary of a run directory and write summary.json; with a ``presenter``
    also summary.md and (``plots``) the PNG plots, whose names summary.json lists."""
    run_dir = Path(run_dir)
    samples, unreadable = read_samples(run_dir)
    metrics_path = run_dir / SERVER_METRICS_FILE
    server_metrics = read_jsonl(metrics_path)[0] if metrics_path.is_file() else []
    summary = summarize_samples(
        samples,
        server_metrics=server_metrics,
        run=_read_optional_json(run_dir / RUN_FILE),
        unreadable_lines=unreadable,
    )
    summary["plots"] = presenter.plots(samples, summary, run_dir) if plots and presenter is not None else []
    write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(versioned(summary), indent=2) + "\n")
    if presenter is not None:
        write_text_atomic(run_dir / SUMMARY_MARKDOWN_FILE, presenter.markdown(summary))
    return summary


# -- comparing two runs -------------------------------------------------------------------------
def compare_samples(samples_a: Sequence[dict[str, Any]], samples_b: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per matching (load, shape): median(B) / median(A) with a bootstrap CI, and a verdict."""
    cells_a, cells_b = group_cells(samples_a), group_cells(samples_b)
    rows = []
    for key in [k for k in ladder_order(cells_a) if k in cells_b]:
        kept_a, kept_b = kept_ok(cells_a[key]), kept_ok(cells_b[key])
        rows.append(
            {
                "load": key[0],
                "shape": key[1],
                "n_a": len(kept_a),
                "n_b": len(kept_b),
                "ttft": _compare_metric(values_of(kept_a, "ttft_s"), values_of(kept_b, "ttft_s"), higher="B slower", lower="B faster"),
                "decode_tok_s": _compare_metric(
                    values_of(kept_a, "decode_tok_s"), values_of(kept_b, "decode_tok_s"), higher="B faster", lower="B slower"
                ),
            }
        )
    return {
        "schema": COMPARE_SCHEMA,
        "ratio": "median(B) / median(A)",
        "ci": f"{stats.CI_CONFIDENCE:.0%} percentile bootstrap, runs resampled independently; {stats.RATIO_TEST_TEXT}",
        "cells": rows,
        "only_in_a": [f"{load}/{shape}" for load, shape in cells_a if (load, shape) not in cells_b],
        "only_in_b": [f"{load}/{shape}" for load, shape in cells_b if (load, shape) not in cells_a],
    }


def _compare_metric(a: Sequence[float], b: Sequence[float], *, higher: str, lower: str) -> dict[str, Any]:
    test_a, test_b = stats.detect_bimodality(a), stats.detect_bimodality(b)
    if test_a.bimodal or test_b.bimodal:
        # A ratio of medians would compare two arbitrary points of bimodal distributions.
        return {
            "ratio": None,
            "ci": None,
            "verdict": "bimodal: compare the modes, not medians",
            "modes_a": [_mode_json(m) for m in test_a.modes],
            "modes_b": [_mode_json(m) for m in test_b.modes],
        }
    result = stats.bootstrap_ratio_of_medians_ci(a, b)
    if result is None:
        return {"ratio": None, "ci": None, "verdict": "not enough samples"}
    ratio, lo, hi = result
    return {"ratio": ratio, "ci": [lo, hi], "verdict": stats.ratio_verdict((lo, hi), higher=higher, lower=lower)}


def compare_dirs(dir_a: Path, dir_b: Path) -> dict[str, Any]:
    samples_a, _ = read_samples(dir_a)
    samples_b, _ = read_samples(dir_b)
    doc = compare_samples(samples_a, samples_b)
    return {"a": str(dir_a), "b": str(dir_b), **doc}
