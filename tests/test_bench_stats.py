"""Statistics of `fp4forge bench` on constructed samples with known answers (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp4forge.bench import stats
from fp4forge.bench.analyze import compare_samples, summarize_samples
from fp4forge.report.bench_tables import summary_markdown

# The published card's middle shape (docs/laguna-card.md#decode-and-ttft): at 633 tokens a
# minority ~316 ms, most ~825 ms (7 kept samples).
SEED_BIMODAL_TTFT = [0.315, 0.318, 0.822, 0.825, 0.828, 0.831, 0.819]


# -- spread -------------------------------------------------------------------------------------
def test_spread_exact_small_case() -> None:
    spread = stats.spread([7, 1, 5, 3, 2, 6, 4])
    assert (spread.n, spread.min, spread.median, spread.max) == (7, 1.0, 4.0, 7.0)
    # Linear interpolation: position (n - 1) * q = 0.6 -> 1 + 0.6; 5.4 -> 6 + 0.4; 5.94 -> 6.94.
    assert spread.p10 == pytest.approx(1.6)
    assert spread.p90 == pytest.approx(6.4)
    assert spread.p99 == pytest.approx(6.94)
    assert len(spread.caveats) == 3  # none of p10 / p90 / p99 is bracketed by 7 samples


def test_quantile_bracketing_sizes() -> None:
    assert stats.min_samples_for_quantile(0.5) == 5
    assert stats.min_samples_for_quantile(0.9) == 29
    assert stats.min_samples_for_quantile(0.1) == 29
    assert stats.min_samples_for_quantile(0.99) == 299
    caveats = stats.spread(list(range(1, 31))).caveats
    assert len(caveats) == 1 and caveats[0].startswith("p99")


def test_spread_of_nothing_is_none() -> None:
    assert stats.spread([]) is None


# -- bootstrap ----------------------------------------------------------------------------------
def test_bootstrap_median_ci_is_seeded_and_brackets_the_median() -> None:
    values = [0.81, 0.79, 0.83, 0.80, 0.82, 0.84, 0.78, 0.80]
    ci = stats.bootstrap_median_ci(values, seed=3)
    assert ci == stats.bootstrap_median_ci(values, seed=3)
    assert ci[0] <= float(np.median(values)) <= ci[1]
    assert stats.bootstrap_median_ci([1.0]) is None


def test_bootstrap_ci_covers_true_median_at_about_nominal_rate() -> None:
    """Repeated draws from a log-normal whose median is exactly 1: about 95 % of CIs cover it."""
    rng = np.random.default_rng(11)
    draws = 300
    covered = 0
    for i in range(draws):
        sample = rng.lognormal(mean=0.0, sigma=0.5, size=40)
        lo, hi = stats.bootstrap_median_ci(sample, resamples=1000, seed=i)
        covered += lo <= 1.0 <= hi
    coverage = covered / draws
    # Percentile bootstrap of a median at n=40 runs a little under nominal; 300 draws give
    # a binomial SD of ~1.3 points.
    assert 0.88 <= coverage <= 0.99, coverage


# -- bimodality ---------------------------------------------------------------------------------
def test_seed_card_bimodal_shape_is_flagged_with_modes() -> None:
    result = stats.detect_bimodality(SEED_BIMODAL_TTFT)
    assert result.bimodal and result.tested
    assert result.p_value < stats.BIMODALITY_ALPHA
    low, high = result.modes
    assert low.centre == pytest.approx(0.3165)
    assert low.share == pytest.approx(2 / 7)
    assert high.centre == pytest.approx(0.825)
    assert high.share == pytest.approx(5 / 7)


def test_tight_unimodal_shape_is_not_flagged() -> None:
    # The seed's 81-token shape: +-1 ms.
    result = stats.detect_bimodality([0.0810, 0.0815, 0.0805, 0.0820, 0.0812, 0.0809, 0.0811])
    assert result.tested and not result.bimodal and result.modes == []


def test_mixture_is_flagged_and_unimodal_is_not_across_draws() -> None:
    rng = np.random.default_rng(5)
    n, draws = 30, 200
    mixture_hits = unimodal_hits = 0
    for _ in range(draws):
        minority = rng.random(n) < 0.3
        mixture = np.where(minority, rng.normal(0.316, 0.01, n), rng.normal(0.825, 0.02, n))
        mixture_hits += stats.detect_bimodality(mixture).bimodal
        unimodal_hits += stats.detect_bimodality(rng.lognormal(np.log(0.5), 0.2, n)).bimodal
    assert mixture_hits / draws >= 0.95
    # Log-normal is exactly the test's null: the false-alarm rate is alpha (1 %).
    assert unimodal_hits / draws <= 0.03


def test_significant_but_close_modes_are_not_reported() -> None:
    # Two real clusters 5 % apart: the test fires, but a median describes them well enough.
    result = stats.detect_bimodality([1.000, 1.001, 1.002, 1.003, 1.050, 1.051, 1.052, 1.053])
    assert result.p_value < stats.BIMODALITY_ALPHA
    assert not result.bimodal
    assert "only" in result.reason


def test_bimodality_needs_two_clusters_of_two() -> None:
    result = stats.detect_bimodality([0.1, 0.9, 0.91])
    assert not result.tested and not result.bimodal
    assert not stats.detect_bimodality([0.5] * 8).bimodal  # no gap at all


def test_gap_statistic_exact_small_case() -> None:
    # n=4: the only admissible split is 2|2. Within SS = 0.5 + 0.5, pooled SD = sqrt(1 / 2),
    # gap = 10 - 1 = 9, so T = 9 / sqrt(0.5).
    statistic, split = stats.gap_statistics(np.array([[0.0, 1.0, 10.0, 11.0]]))
    assert split[0] == 2
    assert statistic[0] == pytest.approx(9 / math.sqrt(0.5))


def test_gap_test_p_value_is_monte_carlo_with_correction() -> None:
    assert stats.gap_test_p_value(float("inf"), 7) == pytest.approx(1 / (stats.NULL_DRAWS + 1))
    assert stats.gap_test_p_value(0.0, 7) == pytest.approx(1.0)


# -- prefill fit --------------------------------------------------------------------------------
LADDER = [81, 160, 320, 633, 1250, 2500, 4700, 9325]


def test_prefill_fit_recovers_known_rate_and_overhead_exactly() -> None:
    rate, overhead = 3300.0, 0.05
    points = [stats.ShapePoint(p, [overhead + p / rate] * 3) for p in LADDER]
    fit = stats.prefill_fit(points)
    assert fit.rate_tok_s == pytest.approx(rate)
    assert fit.intercept_s == pytest.approx(overhead)
    # Knee by hand: floor = 0.05 + 81 / 3300 = 0.07455 s; 2x floor is reached at
    # (0.1491 - 0.05) * 3300 = 327 tokens, so 320 is overhead and 633 the first compute shape.
    assert fit.overhead_floor_s == pytest.approx(overhead + 81 / rate)
    assert [p for p, r in sorted(fit.regimes.items()) if r == stats.OVERHEAD_LABEL] == [81, 160, 320]
    assert fit.fit_prompt_tokens == [633, 1250, 2500, 4700, 9325]


def test_prefill_fit_recovers_rate_under_noise_with_ci() -> None:
    rng = np.random.default_rng(2)
    points = [stats.ShapePoint(p, list(0.25 + p / 3500.0 + rng.normal(0, 0.01, 7))) for p in LADDER]
    fit = stats.prefill_fit(points)
    assert fit.rate_tok_s == pytest.approx(3500.0, rel=0.03)
    assert fit.intercept_s == pytest.approx(0.25, abs=0.02)
    lo, hi = fit.rate_ci_tok_s
    assert lo <= 3500.0 <= hi


def test_prefill_fit_needs_two_shapes_above_the_knee() -> None:
    points = [stats.ShapePoint(p, [0.03]) for p in (32, 256)] + [stats.ShapePoint(1024, [0.1])]
    fit = stats.prefill_fit(points)
    assert fit.rate_tok_s is None and "a rate needs 2" in fit.reason
    assert fit.regimes[1024] == stats.COMPUTE_LABEL


# -- decode flatness ----------------------------------------------------------------------------
def test_decode_flatness_of_the_seed_card_numbers() -> None:
    medians = [27.96, 28.00, 27.51, 27.90, 27.95, 27.80]
    flat = stats.decode_flatness([stats.ShapePoint(p, [m]) for p, m in zip(LADDER, medians)])
    assert flat.flat is True
    assert flat.relative_spread == pytest.approx((28.00 - 27.51) / np.median(medians))


def test_decode_falling_with_context_is_not_flat() -> None:
    falling = stats.decode_flatness([stats.ShapePoint(p, [30.0 - p / 1000.0]) for p in LADDER])
    assert falling.flat is False
    assert falling.change_per_1k_prompt_tokens < 0


# -- ratios and verdicts ------------------------------------------------------------------------
def test_ratio_verdict_by_hand() -> None:
    assert stats.ratio_verdict((0.97, 1.04), higher="up", lower="down") == stats.NO_DIFFERENCE
    assert stats.ratio_verdict((1.01, 1.03), higher="up", lower="down") == stats.NO_DIFFERENCE  # real but under 5 %
    assert stats.ratio_verdict((1.02, 1.3), higher="up", lower="down") == "up"
    assert stats.ratio_verdict((0.7, 0.95), higher="up", lower="down") == "down"
    # covering 1 is not sameness: a CI wider than 1 ± 5 % cannot tell the runs apart
    assert stats.ratio_verdict((0.9, 1.1), higher="up", lower="down") == stats.CANNOT_TELL
    assert stats.ratio_verdict((0.99, 1.3), higher="up", lower="down") == stats.CANNOT_TELL


def test_ratio_of_medians_ci() -> None:
    a = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]
    ratio, lo, hi = stats.bootstrap_ratio_of_medians_ci(a, [2 * x for x in a])
    assert ratio == pytest.approx(2.0)
    assert lo > 1.0


# -- summaries from samples alone ---------------------------------------------------------------
def sample(shape: str, prompt: int, ttft: float, *, decode: float = 50.0, ok: bool = True, warmup: bool = False, load: str = "c1") -> dict:
    return {
        "shape": shape,
        "load": load,
        "mode": "sequential",
        "prompt_tokens": prompt,
        "output_tokens": 16,
        "target_output_tokens": 16,
        "ttft_s": ttft if ok else None,
        "decode_tok_s": decode if ok else None,
        "tpot_s": 1 / decode if ok else None,
        "e2e_s": ttft + 15 / decode if ok else None,
        "ok": ok,
        "warmup": warmup,
        "error_kind": None if ok else "http",
    }


def constructed_run() -> list[dict]:
    samples = [sample("p81", 81, 2.0, warmup=True)]  # a slow warmup that must not count
    samples += [sample("p81", 81, t) for t in (0.080, 0.081, 0.079, 0.080, 0.082, 0.081, 0.080)]
    samples += [sample("p633", 633, t) for t in SEED_BIMODAL_TTFT]
    samples += [sample("p633", 633, 0.0, ok=False)]
    for prompt in (2500, 9325):
        samples += [sample(f"p{prompt}", prompt, 0.05 + prompt / 3300.0 + d) for d in (-0.002, 0.0, 0.001, 0.002, -0.001)]
    return samples


def test_summary_keys_and_bimodal_shape_has_no_median() -> None:
    summary = summarize_samples(constructed_run())
    shapes = {entry["shape"]: entry for entry in summary["shapes"]}
    p81, p633 = shapes["p81"], shapes["p633"]
    assert p81["n"] == 7 and p81["n_warmup"] == 1
    assert p81["median_ttft_s"] == pytest.approx(0.080)
    assert p81["bimodal"] is False and p81["modes"] == []
    assert p633["bimodal"] is True and p633["median_ttft_s"] is None
    assert [m["share"] for m in p633["modes"]] == pytest.approx([2 / 7, 5 / 7])
    assert p633["n_failed"] == 1 and p633["failures_by_kind"] == {"http": 1}
    assert summary["totals"] == {"requests": 26, "warmups": 1, "kept_ok": 24, "failed": 1, "failures_by_kind": {"http": 1}}
    (prefill,) = summary["prefill"]
    # p633 is above the knee but bimodal: labelled, left out of the line.
    assert prefill["excluded_bimodal_shapes"] == ["p633"]
    assert prefill["fit_prompt_tokens"] == [2500, 9325]
    assert prefill["rate_tok_s"] == pytest.approx(3300.0, rel=0.01)
    assert p81["prefill_regime"] == stats.OVERHEAD_LABEL
    assert shapes["p9325"]["prefill_regime"] == stats.COMPUTE_LABEL
    markdown = summary_markdown(summary)
    assert "bimodal: 316.5 (29%) | 825.0 (71%)" in markdown.replace("\\|", "|")
    assert "overhead, not throughput" in markdown


def test_compare_no_difference_and_slower() -> None:
    run_a = constructed_run()
    same = compare_samples(run_a, run_a)
    p81 = next(row for row in same["cells"] if row["shape"] == "p81")
    assert p81["ttft"]["verdict"] == stats.NO_DIFFERENCE
    assert p81["ttft"]["ratio"] == pytest.approx(1.0)
    slower = [dict(s, ttft_s=s["ttft_s"] * 1.5 if s["ttft_s"] else None) for s in run_a]
    p81_slow = next(row for row in compare_samples(run_a, slower)["cells"] if row["shape"] == "p81")
    assert p81_slow["ttft"]["verdict"] == "B slower"
    assert p81_slow["ttft"]["ci"][0] > 1.0
    p633 = next(row for row in same["cells"] if row["shape"] == "p633")
    assert p633["ttft"]["verdict"].startswith("bimodal")


def test_compare_of_noisy_runs_cannot_tell_them_apart() -> None:
    """Two runs with the same median whose samples scatter widely: the ratio's CI covers 1 and
    reaches far beyond 1 ± 5 %, so the verdict is that the runs cannot be told apart, not "no difference"."""
    spread = (0.050, 0.065, 0.072, 0.080, 0.088, 0.097, 0.110)  # median 0.080, ±40 % around it
    run_a = [sample("p81", 81, t) for t in spread]
    run_b = [sample("p81", 81, t) for t in reversed(spread)]
    (row,) = compare_samples(run_a, run_b)["cells"]
    lo, hi = row["ttft"]["ci"]
    assert row["ttft"]["ratio"] == pytest.approx(1.0) and lo < 1.0 - stats.RATIO_SAME_TOLERANCE and hi > 1.0 + stats.RATIO_SAME_TOLERANCE
    assert row["ttft"]["verdict"] == stats.CANNOT_TELL
    # the same median with tight samples: alike within 5 %
    tight = [sample("p81", 81, t) for t in (0.0795, 0.0798, 0.0799, 0.080, 0.0801, 0.0802, 0.0805)]
    (same,) = compare_samples(tight, tight)["cells"]
    assert same["ttft"]["verdict"] == stats.NO_DIFFERENCE


def test_a_prefill_rate_whose_slope_ci_reaches_zero_is_not_established() -> None:
    """Shapes above the knee whose TTFT scatters without growing: the line's slope is positive, its
    CI reaches 0, so the rate has no upper bound and the text says it is not established."""
    from fp4forge.report.bench_tables import prefill_line

    flat = [stats.ShapePoint(81, [0.010, 0.011, 0.009]), stats.ShapePoint(633, [0.10, 0.13, 0.07]),
            stats.ShapePoint(1250, [0.11, 0.08, 0.14]), stats.ShapePoint(2500, [0.105, 0.135, 0.075])]
    fit = stats.prefill_fit(flat)
    assert fit.rate_tok_s is not None and fit.rate_ci_tok_s is not None and fit.rate_ci_tok_s[1] is None
    assert "not established: the slope's 95% CI reaches 0" in prefill_line({**fit.to_json(), "load": "c1"})
    rng = np.random.default_rng(2)  # a real slope: a bounded CI, no such note
    rising = stats.prefill_fit([stats.ShapePoint(p, list(0.25 + p / 3500.0 + rng.normal(0, 0.01, 7))) for p in LADDER])
    assert rising.rate_ci_tok_s[1] is not None and "not established" not in prefill_line({**rising.to_json(), "load": "c1"})
