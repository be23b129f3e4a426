"""Plots of a `fp4forge bench perf` run (PNG): TTFT per shape, TTFT vs prompt length with the
prefill fit, decode rate vs context. Also ``BENCH_PRESENTER``, what ``bench.analyze.analyze_dir``
is given to write ``summary.md`` and these plots beside ``summary.json``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fp4forge.bench import stats
from fp4forge.bench.analyze import group_cells, kept_ok, values_of
from fp4forge.report.bench_tables import flatness_claim, prefill_claim, quadratic_claim, summary_markdown
from fp4forge.report.plotting import pyplot, plain_log_scale

PLOT_FILES = {
    "ttft_distribution": "ttft_distribution.png",
    "ttft_vs_prompt": "ttft_vs_prompt.png",
    "decode_vs_context": "decode_vs_context.png",
}


class BenchPresenter:
    """``summary.md`` (``report.bench_tables``) and the three plots, for ``analyze_dir``."""

    def markdown(self, summary: dict[str, Any]) -> str:
        return summary_markdown(summary)

    def plots(self, samples: Sequence[dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> list[str]:
        return write_plots(samples, summary, out_dir)


BENCH_PRESENTER = BenchPresenter()


def write_plots(samples: Sequence[dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> list[str]:
    """The three PNGs; returns the file names written (none when matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return []
    cells = group_cells(samples)
    written = []
    for name, draw in (
        ("ttft_distribution", _plot_ttft_distribution),
        ("ttft_vs_prompt", _plot_ttft_vs_prompt),
        ("decode_vs_context", _plot_decode_vs_context),
    ):
        figure = draw(plt, cells, summary)
        if figure is None:
            continue
        path = Path(out_dir) / PLOT_FILES[name]
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(path.name)
    return written


def _plot_ttft_distribution(plt: Any, cells: dict, summary: dict[str, Any]) -> Any:
    loads = list(dict.fromkeys(e["load"] for e in summary["shapes"]))
    if not loads:
        return None
    figure, axes = plt.subplots(len(loads), 1, figsize=(max(6.0, 1.1 * _max_shapes(summary)), 3.2 * len(loads)), squeeze=False)
    rng = np.random.default_rng(0)
    for axis, load in zip(axes[:, 0], loads):
        entries = [e for e in summary["shapes"] if e["load"] == load]
        for index, entry in enumerate(entries):
            ttft_ms = np.asarray(values_of(kept_ok(cells[(load, entry["shape"])]), "ttft_s")) * 1000.0
            if len(ttft_ms) == 0:
                continue
            axis.scatter(index + rng.uniform(-0.15, 0.15, len(ttft_ms)), ttft_ms, s=14, alpha=0.7, color="tab:blue")
            if entry["bimodal"]:
                for mode in entry["modes"]:
                    axis.hlines(mode["centre"] * 1000.0, index - 0.3, index + 0.3, color="tab:red", linewidth=2)
                    axis.annotate(f"{mode['share']:.0%}", (index + 0.32, mode["centre"] * 1000.0), fontsize=7, color="tab:red", va="center")
            elif entry["median_ttft_s"] is not None:
                axis.hlines(entry["median_ttft_s"] * 1000.0, index - 0.3, index + 0.3, color="black", linewidth=1.5)
                ci = entry.get("median_ttft_ci_s")
                if ci:
                    axis.vlines(index + 0.34, ci[0] * 1000.0, ci[1] * 1000.0, color="black", linewidth=1.0)
        axis.set_xticks(range(len(entries)), [e["shape"] for e in entries], rotation=30, ha="right", fontsize=8)
        plain_log_scale(axis)
        axis.set_ylabel("TTFT (ms, log scale)")
        axis.set_title(f"TTFT per shape, load {load} (black: median, bar: its 95% CI; red: modes of a bimodal shape)", fontsize=9)
    figure.tight_layout()
    return figure


def _plot_ttft_vs_prompt(plt: Any, cells: dict, summary: dict[str, Any]) -> Any:
    figure, axis = plt.subplots(figsize=(7.0, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drew = False
    for index, fit in enumerate(summary["prefill"]):
        load, colour = fit["load"], colours[index % len(colours)]
        entries = [e for e in summary["shapes"] if e["load"] == load]
        for entry in entries:
            ttft_ms = np.asarray(values_of(kept_ok(cells[(load, entry["shape"])]), "ttft_s")) * 1000.0
            if len(ttft_ms):
                drew = True
                marker = "o" if entry["prefill_regime"] == stats.COMPUTE_LABEL else "x"
                axis.scatter([entry["prompt_tokens"]] * len(ttft_ms), ttft_ms, s=12, alpha=0.6, color=colour, marker=marker)
        goodness = fit.get("goodness") or {}
        longest = max((e["prompt_tokens"] for e in entries if e["prompt_tokens"] is not None), default=0)
        if fit.get("slope_s_per_tok") is not None and fit["fit_prompt_tokens"]:
            xs = np.linspace(0, longest, 80)
            ys = (fit["intercept_s"] + fit["slope_s_per_tok"] * xs) * 1000.0
            label = f"{load}: {prefill_claim(fit)}" if fit["rate_tok_s"] else f"{load}: line"
            if goodness.get("line_misses") or (goodness.get("intercept_over_floor") or 0) > 1:
                label += " (misses its points)"
            axis.plot(xs, ys, color=colour, linewidth=1.2, label=label)
        else:
            axis.plot([], [], color=colour, label=f"{load}: no rate ({fit.get('reason')})")
        curvature = goodness.get("curvature")
        if curvature and curvature.get("curved"):
            xs = np.linspace(0, longest, 80)
            ys = (curvature["a_s"] + curvature["b_s_per_tok"] * xs + curvature["c_s_per_tok2"] * xs * xs) * 1000.0
            axis.plot(xs, ys, color=colour, linewidth=1.2, linestyle="--", label=f"{load}: {quadratic_claim(curvature)}")
    if not drew:
        plt.close(figure)
        return None
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("TTFT (ms)")
    axis.set_xlim(left=0)
    axis.set_ylim(bottom=0)  # from zero: a gap between two shapes reads at its true size
    axis.set_title("TTFT vs prompt length (o: compute-dominated, x: overhead, not throughput)", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _plot_decode_vs_context(plt: Any, cells: dict, summary: dict[str, Any]) -> Any:
    figure, axis = plt.subplots(figsize=(7.0, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drew = False
    for index, load in enumerate(dict.fromkeys(e["load"] for e in summary["shapes"])):
        colour = colours[index % len(colours)]
        entries = [e for e in summary["shapes"] if e["load"] == load]
        xs, medians, lows, highs = [], [], [], []
        for entry in entries:
            decode = values_of(kept_ok(cells[(load, entry["shape"])]), "decode_tok_s")
            if not decode:
                continue
            drew = True
            axis.scatter([entry["prompt_tokens"]] * len(decode), decode, s=10, alpha=0.4, color=colour)
            block = entry["decode_tok_s"]
            if block and block["median"] is not None and block["median_ci"]:
                xs.append(entry["prompt_tokens"])
                medians.append(block["median"])
                lows.append(block["median"] - block["median_ci"][0])
                highs.append(block["median_ci"][1] - block["median"])
        if xs:
            # no line joining the medians: the tested trend is the least-squares line below
            axis.errorbar(xs, medians, yerr=[lows, highs], color=colour, marker="s", linestyle="none", capsize=3, label=f"{load}: median, 95% CI")
        flat = next((f for f in summary.get("decode_flatness", []) if f["load"] == load), None)
        if flat and flat.get("line") and flat.get("change_across_context_ci") and flat.get("context_range"):
            slope, intercept = flat["line"]  # the fit the notes state, drawn as fitted
            grid = np.linspace(*flat["context_range"], 40)
            axis.plot(grid, intercept + slope * grid, color=colour, linestyle="--", linewidth=1.0,
                      label=f"{load}: least-squares line, {flatness_claim(flat)}: {flat['verdict']}")
    if not drew:
        plt.close(figure)
        return None
    axis.set_xlabel("prompt tokens (context at the start of decode)")
    axis.set_ylabel("decode tok/s per request")
    axis.set_ylim(bottom=0)  # from zero: a few per cent of wobble must not look like a V
    axis.set_title("Decode rate vs context (y from zero)", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _max_shapes(summary: dict[str, Any]) -> int:
    counts = Counter(e["load"] for e in summary["shapes"])
    return max(counts.values()) if counts else 1
