"""Issue 19, finding 5: verdicts only where the statistics support them, fits with their goodness.

The real run is ``tests/fixtures/bench_cpu_run``: samples of `fp4forge pipeline --serve --bench perf`
(workload cpu-tiny, 5 kept samples per shape) against the real vLLM 0.32 CPU server on the tiny
testbed. Its old summary printed "decode NOT flat across context" from a 39 % spread of per-shape
medians of 5 samples each.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fp4forge
from fp4forge.bench import stats
from fp4forge.bench.analyze import analyze_dir, read_samples, summarize_samples
from fp4forge.report.bench_tables import flatness_line, notes, prefill_line

REAL_RUN = Path(__file__).parent / "fixtures" / "bench_cpu_run"


def test_real_run_decode_is_cannot_tell_not_a_verdict() -> None:
    samples, _ = read_samples(REAL_RUN)
    summary = summarize_samples(samples)
    flat = summary["decode_flatness"][0]
    # The old rule read the 39 % spread of four medians of 5 samples each as "NOT flat".
    assert flat["relative_spread"] > stats.DECODE_FLAT_TOLERANCE
    assert flat["verdict"] == stats.CANNOT_TELL and flat["flat"] is None
    assert flat["n"] == 20
    lo, hi = flat["change_across_context_ci"]
    assert lo < 0 < hi and lo < -stats.DECODE_FLAT_TOLERANCE
    line = flatness_line({"load": "c1", **flat})
    assert "cannot tell" in line and "n=20" in line and "NOT flat" not in line


def test_flatness_slope_is_the_least_squares_slope_over_every_sample() -> None:
    samples, _ = read_samples(REAL_RUN)
    flat = summarize_samples(samples)["decode_flatness"][0]
    kept = [s for s in samples if s["ok"] and not s["warmup"]]
    x = np.array([s["prompt_tokens"] for s in kept], float)
    y = np.array([s["decode_tok_s"] for s in kept], float)
    slope = np.sum((x - x.mean()) * (y - y.mean())) / np.sum((x - x.mean()) ** 2)  # by hand
    assert flat["change_per_1k_prompt_tokens"] == pytest.approx(slope * 1000 / flat["median_tok_s"])
    assert flat["change_across_context"] == pytest.approx(slope * (x.max() - x.min()) / flat["median_tok_s"])


def test_flat_needs_the_whole_ci_inside_the_tolerance() -> None:
    rng = np.random.default_rng(0)
    tight = [stats.ShapePoint(p, list(28.0 + rng.normal(0, 0.05, 20))) for p in (100, 1000, 4000, 8000)]
    assert stats.decode_flatness(tight).verdict == stats.FLAT
    noisy = [stats.ShapePoint(p, [22.0, 28.0, 34.0]) for p in (100, 1000, 4000, 8000)]  # slope 0, spread +-6
    assert stats.decode_flatness(noisy).verdict == stats.CANNOT_TELL
    falling = [stats.ShapePoint(p, list(30.0 - p / 1000.0 + rng.normal(0, 0.05, 5))) for p in (100, 1000, 4000, 8000)]
    result = stats.decode_flatness(falling)
    assert result.verdict == stats.FALLS and result.flat is False


def _quadratic_points(noise: float) -> list[stats.ShapePoint]:
    # TTFT = 50 ms + x / 4000 tok/s + 2e-7 s/tok^2 * x^2: at 4,096 tokens the x^2 term is 3.4 s of 4.4 s.
    rng = np.random.default_rng(1)
    return [stats.ShapePoint(p, list(0.05 + p / 4000 + 2e-7 * p * p + rng.normal(0, noise, 5))) for p in (64, 1024, 2048, 3072, 4096)]


def test_curved_ttft_is_named_with_its_test_and_marginal_rates() -> None:
    fit = stats.prefill_fit(_quadratic_points(0.005))
    goodness = fit.goodness
    curvature = goodness["curvature"]
    assert curvature["curved"] is True
    assert curvature["c_s_per_tok2"] == pytest.approx(2e-7, rel=0.05)
    lo, hi = curvature["c_ci"]
    assert 0 < lo <= 2e-7 <= hi
    # marginal rate 1 / (b + 2 c x) at the ends, by hand from the true curve (within the noise)
    rates = curvature["marginal_rate_tok_s"]["rate_tok_s"]
    assert rates[0] == pytest.approx(1 / (1 / 4000 + 2 * 2e-7 * 64), rel=0.1)
    assert rates[1] == pytest.approx(1 / (1 / 4000 + 2 * 2e-7 * 4096), rel=0.1)
    # the straight line through the medians of this curve overstates the overhead: its intercept
    # is far above the shortest prompt's measured TTFT, and the text says so
    assert fit.intercept_s is not None
    line = prefill_line({"load": "c1", **fit.to_json()})
    assert "curved" in line and "no single prefill rate" in line


def test_line_intercept_above_the_shortest_ttft_is_called_out() -> None:
    # Two compute shapes only, on a convex curve: the line through them reaches back to an
    # intercept above the 32-token TTFT that was measured.
    points = [stats.ShapePoint(32, [0.07] * 5), stats.ShapePoint(1024, [1.0] * 5), stats.ShapePoint(1536, [2.0] * 5)]
    fit = stats.prefill_fit(points)
    assert fit.intercept_s == pytest.approx(1.0 - 1024 * (1.0 / 512))  # line through (1024, 1) and (1536, 2): -1.0 s
    assert "negative" in fit.goodness["verdict"]
    points = [stats.ShapePoint(32, [0.07] * 5), stats.ShapePoint(1024, [0.5] * 5), stats.ShapePoint(1536, [0.6] * 5)]
    fit = stats.prefill_fit(points)
    assert fit.intercept_s == pytest.approx(0.5 - 1024 * (0.1 / 512))  # 0.3 s, 4.3x the 70 ms measured
    assert "not a fixed overhead" in fit.goodness["verdict"] and "by construction" in fit.goodness["verdict"]


def test_real_run_line_fits_and_says_how_well(tmp_path: Path) -> None:
    samples, _ = read_samples(REAL_RUN)
    fit = summarize_samples(samples)["prefill"][0]
    goodness = fit["goodness"]
    assert goodness["line_misses"] == []
    assert 0.0 < goodness["r2_line"] <= 1.0
    assert len(goodness["residuals"]) == 4
    assert "R²" in prefill_line(fit)


def test_plots_start_at_zero(tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    del matplotlib
    for name in ("samples.jsonl", "run.json"):
        (tmp_path / name).write_bytes((REAL_RUN / name).read_bytes())
    from fp4forge.report import bench_plots

    captured = {}
    original = bench_plots._plot_decode_vs_context

    def spy(plt, cells, summary):  # type: ignore[no-untyped-def]
        figure = original(plt, cells, summary)
        captured["decode_ylim"] = figure.axes[0].get_ylim()
        return figure

    bench_plots._plot_decode_vs_context = spy
    try:
        summary = analyze_dir(tmp_path, presenter=bench_plots.BENCH_PRESENTER)
    finally:
        bench_plots._plot_decode_vs_context = original
    assert "decode_vs_context.png" in summary["plots"]
    assert json.loads((tmp_path / "summary.json").read_text())["fp4forge_version"] == fp4forge.__version__
    assert captured["decode_ylim"][0] == 0.0
    assert any("cannot tell" in line for line in notes(summary))


def test_real_shared_machine_run_line_misses_and_intercept_is_not_overhead() -> None:
    """The issue's prefill finding on a real run: the line's intercept is 2.5x the measured
    short-prompt TTFT; the summary now says the line misses its points instead of calling the
    intercept a fixed overhead."""
    samples, _ = read_samples(REAL_RUN.with_name("bench_cpu_run_shared"))
    fit = summarize_samples(samples)["prefill"][0]
    floor = fit["overhead_floor_s"]
    assert fit["intercept_s"] > 2 * floor
    goodness = fit["goodness"]
    assert goodness["intercept_over_floor"] == pytest.approx(fit["intercept_s"] / floor)
    assert goodness["line_misses"] == [1024]
    line = prefill_line(fit)
    assert "misses its fitted points at [1024]" in line and "not a fixed overhead" in line
    assert "fixed overhead (intercept)" not in line  # the old wording
