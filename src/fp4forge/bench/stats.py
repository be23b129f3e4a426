"""Statistics for serving benchmarks: pure functions on lists of numbers, no I/O.

Every rule that turns numbers into a verdict lives here with its threshold as a named constant,
and ``docs/bench.md`` states the same rules in words. Randomness (bootstrap, the bimodality
null distribution) is seeded, so the same samples always give the same summary.

Percentiles are linear interpolation between order statistics (``numpy.percentile``'s default),
the same method vLLM's ``bench serve`` and AIPerf use, so numbers line up with theirs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from fp4forge.stats import bootstrap_ci, median_of_rows, percentile_interval, resample

# -- spread and percentiles ---------------------------------------------------------------------
REPORTED_PERCENTILES = (10, 90, 99)
# A quantile q is "bracketed" by the sample when the chance that every sample lies on one side
# of it is below 5 %: n >= log(0.05) / log(max(q, 1 - q)). Below that n the estimate is an
# interpolation between the most extreme samples, and no distribution-free 95 % interval exists.
QUANTILE_BRACKET_CONFIDENCE = 0.95


def min_samples_for_quantile(q: float, confidence: float = QUANTILE_BRACKET_CONFIDENCE) -> int:
    """Smallest n at which the sample extremes bracket quantile ``q`` with ``confidence`` (p90: 29, p99: 299)."""
    tail = max(q, 1.0 - q)
    return math.ceil(math.log(1.0 - confidence) / math.log(tail))


@dataclass(frozen=True)
class Spread:
    """Order statistics of one metric in one cell. ``median`` is None when it must not be quoted."""

    n: int
    min: float
    median: float | None
    max: float
    p10: float
    p90: float
    p99: float
    caveats: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolation percentile (``numpy.percentile`` default), ``pct`` in 0..100."""
    return float(np.percentile(np.asarray(values, dtype=float), pct))


def spread(values: Sequence[float]) -> Spread | None:
    """min / median / max and p10 / p90 / p99, with a caveat for every percentile the sample cannot bracket."""
    if len(values) == 0:
        return None
    data = np.asarray(values, dtype=float)
    n = len(data)
    caveats = []
    for pct in REPORTED_PERCENTILES:
        needed = min_samples_for_quantile(pct / 100.0)
        if n < needed:
            caveats.append(f"p{pct} from n={n} < {needed}: interpolated between extreme samples, not bracketed")
    return Spread(
        n=n,
        min=float(data.min()),
        median=float(np.median(data)),
        max=float(data.max()),
        p10=percentile(data, 10),
        p90=percentile(data, 90),
        p99=percentile(data, 99),
        caveats=caveats,
    )


# -- bootstrap ----------------------------------------------------------------------------------
BOOTSTRAP_RESAMPLES = 2000
CI_CONFIDENCE = 0.95


def bootstrap_median_ci(
    values: Sequence[float],
    *,
    confidence: float = CI_CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile-bootstrap confidence interval of the median; None below 2 samples."""
    if len(values) < 2:
        return None
    return bootstrap_ci([values], median_of_rows, level=confidence, resamples=resamples, seed=seed)


def bootstrap_ratio_of_medians_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = CI_CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """median(b) / median(a) and its percentile-bootstrap CI, resampling the two runs independently."""
    if len(a) < 2 or len(b) < 2 or np.median(a) == 0:
        return None
    resampled_a, resampled_b = resample([a, b], resamples=resamples, seed=seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = median_of_rows(resampled_b) / median_of_rows(resampled_a)
    low, high = percentile_interval(ratios[np.isfinite(ratios)], confidence)
    return float(np.median(b) / np.median(a)), low, high


# -- bimodality ---------------------------------------------------------------------------------
# The test ("two-cluster gap test"), on log values because latencies are right-skewed (a
# log-normal latency is then exactly the null):
#   statistic T = max over splits of the sorted sample into a lower and an upper cluster, each
#                 holding at least MIN_MODE_SAMPLES and MIN_MODE_SHARE of the samples, of
#                 (empty gap between the clusters) / (pooled within-cluster standard deviation);
#   p-value     = share of NULL_DRAWS normal samples of the same n whose T is at least as large
#                 (T is location- and scale-free, so one null per n serves every shape);
#   verdict     = bimodal when p < BIMODALITY_ALPHA and the two modes' centres differ by at
#                 least MIN_MODE_RATIO (closer modes are noise a median describes well enough).
BIMODALITY_ALPHA = 0.01
MIN_MODE_SAMPLES = 2
MIN_MODE_SHARE = 0.10
MIN_MODE_RATIO = 1.10
NULL_DRAWS = 4000
NULL_SEED = 20240607
BIMODALITY_TEST_NAME = "two-cluster gap test on log values (Monte Carlo p-value under a normal null)"


@dataclass(frozen=True)
class Mode:
    centre: float  # median of the cluster, in the metric's own units
    share: float
    n: int
    min: float
    max: float


@dataclass(frozen=True)
class BimodalityResult:
    bimodal: bool
    tested: bool
    statistic: float | None
    p_value: float | None
    mode_ratio: float | None
    modes: list[Mode]  # the two clusters of the best split; reported only when bimodal
    reason: str

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc["test"] = BIMODALITY_TEST_NAME
        doc["alpha"] = BIMODALITY_ALPHA
        doc["min_mode_ratio"] = MIN_MODE_RATIO
        if doc["statistic"] is not None and math.isinf(doc["statistic"]):
            doc["statistic"] = "inf"  # JSON has no infinity
        return doc


def min_cluster_size(n: int) -> int:
    return max(MIN_MODE_SAMPLES, math.ceil(MIN_MODE_SHARE * n))


def gap_statistics(sorted_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """T and its split index for every row of an (rows, n) array of sorted values.

    The split index k puts row[:k] in the lower cluster and row[k:] in the upper one.
    """
    rows, n = sorted_rows.shape
    smallest = min_cluster_size(n)
    best = np.full(rows, -np.inf)
    best_split = np.full(rows, -1)
    cum = np.cumsum(sorted_rows, axis=1)
    cum_sq = np.cumsum(sorted_rows * sorted_rows, axis=1)
    total, total_sq = cum[:, -1], cum_sq[:, -1]
    for k in range(smallest, n - smallest + 1):
        low_sum, low_sq = cum[:, k - 1], cum_sq[:, k - 1]
        high_sum, high_sq = total - low_sum, total_sq - low_sq
        within_ss = (low_sq - low_sum * low_sum / k) + (high_sq - high_sum * high_sum / (n - k))
        pooled_sd = np.sqrt(np.maximum(within_ss, 0.0) / (n - 2))
        gap = sorted_rows[:, k] - sorted_rows[:, k - 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            # Zero spread inside both clusters: any gap is infinitely many SDs; no gap is none.
            t = np.where(pooled_sd > 1e-12 * np.maximum(1.0, np.abs(total / n)), gap / pooled_sd, np.where(gap > 0, np.inf, 0.0))
        better = t > best
        best = np.where(better, t, best)
        best_split = np.where(better, k, best_split)
    return best, best_split


@functools.lru_cache(maxsize=64)
def null_gap_statistics(n: int) -> np.ndarray:
    """T for NULL_DRAWS seeded standard-normal samples of size n, sorted ascending."""
    rng = np.random.default_rng([NULL_SEED, n])
    draws = np.sort(rng.standard_normal((NULL_DRAWS, n)), axis=1)
    statistics, _ = gap_statistics(draws)
    return np.sort(statistics)


def gap_test_p_value(statistic: float, n: int) -> float:
    """Monte Carlo p-value (with the +1 correction, so never 0)."""
    null = null_gap_statistics(n)
    at_least = len(null) - int(np.searchsorted(null, statistic, side="left"))
    return (at_least + 1) / (len(null) + 1)


def detect_bimodality(values: Sequence[float], *, alpha: float = BIMODALITY_ALPHA) -> BimodalityResult:
    """Two-cluster gap test (see the constants above); positive values only (latencies, rates)."""
    data = np.sort(np.asarray(values, dtype=float))
    n = len(data)
    if n < 2 * min_cluster_size(n):
        return BimodalityResult(False, False, None, None, None, [], f"not tested: n={n} < {2 * MIN_MODE_SAMPLES}")
    if np.any(data <= 0):
        return BimodalityResult(False, False, None, None, None, [], "not tested: non-positive values")
    logs = np.log(data)
    statistic_arr, split_arr = gap_statistics(logs[None, :])
    statistic, split = float(statistic_arr[0]), int(split_arr[0])
    lower, upper = data[:split], data[split:]
    modes = [_mode(lower, n), _mode(upper, n)]
    mode_ratio = modes[1].centre / modes[0].centre
    p_value = gap_test_p_value(statistic, n)
    significant = p_value < alpha
    large = mode_ratio >= MIN_MODE_RATIO
    bimodal = significant and large
    if bimodal:
        reason = f"p={p_value:.4f} < {alpha} and modes {mode_ratio:.2f}x apart"
    elif significant:
        reason = f"p={p_value:.4f} < {alpha} but modes only {mode_ratio:.2f}x apart (< {MIN_MODE_RATIO}x)"
    else:
        reason = f"p={p_value:.4f} >= {alpha}"
    return BimodalityResult(bimodal, True, statistic, p_value, mode_ratio, modes if bimodal else [], reason)


def _mode(cluster: np.ndarray, n: int) -> Mode:
    return Mode(
        centre=float(np.median(cluster)),
        share=len(cluster) / n,
        n=len(cluster),
        min=float(cluster.min()),
        max=float(cluster.max()),
    )


# -- prefill: TTFT against prompt length --------------------------------------------------------
# Knee rule: the overhead floor is the median TTFT of the shortest shape. A shape is
# compute-dominated when its median TTFT is at least KNEE_FACTOR times that floor (at least as
# much time goes to prompt-proportional work as to fixed overhead); below it, prompt/TTFT is
# "overhead, not throughput". The rate is 1/slope of an ordinary least-squares line through the
# per-shape median TTFTs of the compute-dominated shapes; the intercept is the fixed overhead.
KNEE_FACTOR = 2.0
OVERHEAD_LABEL = "overhead, not throughput"
COMPUTE_LABEL = "compute-dominated"
MIN_FIT_SHAPES = 2


@dataclass(frozen=True)
class ShapePoint:
    """One shape's samples of a metric, keyed by its prompt length."""

    prompt_tokens: float
    values: Sequence[float]


@dataclass(frozen=True)
class PrefillFit:
    rate_tok_s: float | None
    rate_ci_tok_s: tuple[float, float | None] | None  # upper bound None: slope CI reaches 0
    slope_s_per_tok: float | None
    intercept_s: float | None
    overhead_floor_s: float | None
    knee_rule: str
    regimes: dict[float, str]  # prompt_tokens -> COMPUTE_LABEL | OVERHEAD_LABEL
    fit_prompt_tokens: list[float]
    reason: str
    goodness: dict[str, object] | None = None  # see fit_goodness: R², residuals, curvature, verdict

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc["regimes"] = [{"prompt_tokens": k, "regime": v} for k, v in sorted(self.regimes.items())]
        doc["rate_ci_tok_s"] = list(self.rate_ci_tok_s) if self.rate_ci_tok_s else None  # JSON-shaped
        return doc


KNEE_RULE_TEXT = (
    f"a shape is compute-dominated when its median TTFT >= {KNEE_FACTOR:g} x the median TTFT of the "
    "shortest shape; the rate is 1/slope of a least-squares line through the medians of those shapes"
)


def line_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Ordinary least squares y = intercept + slope * x; returns (slope, intercept)."""
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return float(slope), float(intercept)


# -- the order test -----------------------------------------------------------------------------
# A trend across shapes ("decode rises with context", "TTFT is curved") is also what drift over
# time looks like when the shapes ran in context order. A trend claim therefore stands only when
#   randomized  the send order is unrelated to context: |Pearson r| between each kept request's
#               position in the run and its prompt length is below ORDER_CORRELATION_LIMIT (a
#               run in ascending order has r near 1; seeded random rounds have r near 0), and
#   both halves the same estimate (decode: the least-squares slope; TTFT: the x^2 coefficient),
#               refitted on the first and on the second half of the run in time, has the sign of
#               the whole run's in each half.
# Otherwise the verdict is "cannot tell" and says which condition failed.
ORDER_CORRELATION_LIMIT = 0.5
ORDER_TEST_TEXT = (
    f"a trend stands when the send order is unrelated to context (|r| < {ORDER_CORRELATION_LIMIT} between a request's "
    "position in the run and its prompt length) and the refitted estimate has the whole run's sign in both halves of the run"
)


@dataclass(frozen=True)
class RunHalves:
    """The samples of one load split by time: the first and the second half of the kept requests."""

    first: Sequence[ShapePoint]
    second: Sequence[ShapePoint]
    order_correlation: float | None  # Pearson r of send position against prompt tokens

    @property
    def randomized(self) -> bool:
        return self.order_correlation is not None and abs(self.order_correlation) < ORDER_CORRELATION_LIMIT


def order_test(whole: float, first: float | None, second: float | None, halves: RunHalves | None) -> dict[str, object]:
    """Whether a trend estimated as ``whole`` on the full run survives the order test (see above);
    ``first`` / ``second``: the same estimate on each half (None: too few shapes to refit)."""
    if halves is None:
        return {"tested": False, "survives": True, "reason": "send order not recorded: the order test was not run", "test": ORDER_TEST_TEXT}
    doc: dict[str, object] = {"tested": True, "order_correlation": halves.order_correlation, "first_half": first,
                              "second_half": second, "test": ORDER_TEST_TEXT}
    r = halves.order_correlation
    if not halves.randomized:
        reason = ("the shapes ran in an order that follows context" + (f" (r = {r:+.2f} between send order and prompt tokens)" if r is not None else "")
                  + ": the trend cannot be told from drift over time")
    elif first is None or second is None:
        reason = "a half of the run holds too few shapes to refit the trend"
    elif np.sign(first) != np.sign(whole) or np.sign(second) != np.sign(whole):
        reason = f"the trend does not hold in both halves of the run (first half {first:+.3g}, second half {second:+.3g}): it may be drift"
    else:
        return {**doc, "survives": True, "reason": "holds in both halves of a randomized run"}
    return {**doc, "survives": False, "reason": reason}


def polynomial_coefficient(points: Sequence[ShapePoint], degree: int) -> float | None:
    """The leading least-squares coefficient over every sample (None with too few prompt lengths)."""
    x, y = _all_samples([p for p in points if len(p.values)])
    if len(np.unique(x)) <= degree:
        return None
    return float(np.polyfit(x, y, degree)[0])


def format_r2(value: float | None) -> str:
    """R² as every text and plot label prints it: one format, so the same fit reads the same everywhere."""
    return "–" if value is None else f"{value:.3f}"


def prefill_fit(
    points: Sequence[ShapePoint],
    *,
    exclude_from_fit: frozenset[float] = frozenset(),
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    halves: RunHalves | None = None,
) -> PrefillFit:
    """Prefill rate from TTFT samples per prompt length (concurrency 1 is the meaningful case).

    ``exclude_from_fit``: prompt lengths whose median must not enter the line (bimodal shapes:
    their median sits between two real modes); they still get a regime label. ``halves``: the
    same samples split by time, for the curvature's order test.
    """
    usable = sorted((p for p in points if len(p.values) > 0), key=lambda p: p.prompt_tokens)
    if not usable:
        return PrefillFit(None, None, None, None, None, KNEE_RULE_TEXT, {}, [], "no TTFT samples")
    medians = [float(np.median(p.values)) for p in usable]
    floor = medians[0]
    regimes = {
        p.prompt_tokens: (COMPUTE_LABEL if i > 0 and m >= KNEE_FACTOR * floor else OVERHEAD_LABEL)
        for i, (p, m) in enumerate(zip(usable, medians))
    }
    fit_points = [
        (p, m)
        for p, m in zip(usable, medians)
        if regimes[p.prompt_tokens] == COMPUTE_LABEL and p.prompt_tokens not in exclude_from_fit
    ]
    fit_tokens = [p.prompt_tokens for p, _ in fit_points]
    curve_points = [p for p in usable if p.prompt_tokens not in exclude_from_fit]
    if len(fit_points) < MIN_FIT_SHAPES:
        reason = f"{len(fit_points)} usable shape(s) above the knee; a rate needs {MIN_FIT_SHAPES}"
        goodness = fit_goodness(curve_points, None, None, fit_tokens, floor, resamples=resamples, seed=seed, halves=halves)
        return PrefillFit(None, None, None, None, floor, KNEE_RULE_TEXT, regimes, fit_tokens, reason, goodness)
    slope, intercept = line_fit(fit_tokens, [m for _, m in fit_points])
    rate_ci = _bootstrap_rate_ci([p for p, _ in fit_points], resamples=resamples, seed=seed)
    rate = 1.0 / slope if slope > 0 else None
    reason = f"fit over {len(fit_points)} compute-dominated shapes" if rate else "non-positive slope"
    goodness = fit_goodness(curve_points, slope, intercept, fit_tokens, floor, resamples=resamples, seed=seed, halves=halves)
    return PrefillFit(rate, rate_ci, slope, intercept, floor, KNEE_RULE_TEXT, regimes, fit_tokens, reason, goodness)


# -- goodness of fit ----------------------------------------------------------------------------
# A line through the medians always looks like a rate; whether TTFT is a line is a separate
# question, answered on every sample:
#   residuals   each shape's median against the line (extrapolated to the shapes below the knee);
#               the line "misses" a fitted shape when it is off by more than LINE_MISS_SHARE;
#   intercept   a fixed overhead above the shortest prompt's measured TTFT is not an overhead;
#   curvature   TTFT = a + b*x + c*x^2 by least squares over every sample of every shape (bimodal
#               ones left out, at least 3 prompt lengths); "curved" when the 95 % case-resampling
#               bootstrap CI of c excludes 0 AND the x^2 term is at least CURVATURE_SHARE of the
#               fitted TTFT at the longest prompt (a significant but negligible bend is a line).
LINE_MISS_SHARE = 0.10
CURVATURE_SHARE = 0.05
CURVATURE_TEST_TEXT = (
    f"least squares TTFT = a + b*x + c*x^2 over every sample; curved when the 95 % case-resampling bootstrap "
    f"CI of c excludes 0 and c*x_max^2 >= {CURVATURE_SHARE:.0%} of the fitted TTFT at x_max"
)


def r_squared(x: np.ndarray, y: np.ndarray, coefficients: Sequence[float]) -> float | None:
    """1 - SS_res / SS_tot of a polynomial (``numpy.polyfit`` order) over the points."""
    total = float(np.sum((y - y.mean()) ** 2))
    if total <= 0:
        return None
    residual = float(np.sum((y - np.polyval(coefficients, x)) ** 2))
    return 1.0 - residual / total


def _all_samples(points: Sequence[ShapePoint]) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([np.full(len(p.values), float(p.prompt_tokens)) for p in points]) if points else np.zeros(0)
    y = np.concatenate([np.asarray(p.values, dtype=float) for p in points]) if points else np.zeros(0)
    return x, y


def _case_bootstrap_coefficients(x: np.ndarray, y: np.ndarray, degree: int, *, resamples: int, seed: int) -> np.ndarray:
    """Polynomial coefficients (``polyfit`` order) of case-resampled (x, y) pairs, all resamples
    solved at once; resamples with fewer distinct x than the polynomial needs are skipped."""
    scale = float(np.max(np.abs(x))) or 1.0  # x / scale keeps x^2 well conditioned
    xs, ys = resample([x / scale, y], resamples=resamples, seed=seed, paired=True)
    powers = np.stack([xs**k for k in range(degree, -1, -1)], axis=-1)  # (resamples, n, degree + 1)
    normal = np.einsum("rnk,rnl->rkl", powers, powers)
    rhs = np.einsum("rnk,rn->rk", powers, ys)
    distinct = 1 + np.sum(np.diff(np.sort(xs, axis=1), axis=1) > 0, axis=1)
    keep = distinct > degree
    coefficients = np.linalg.solve(normal[keep], rhs[keep][..., None])[..., 0]
    return coefficients / np.asarray([scale**k for k in range(degree, -1, -1)])


def fit_goodness(
    points: Sequence[ShapePoint],
    slope: float | None,
    intercept: float | None,
    fit_tokens: Sequence[float],
    floor: float | None,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    halves: RunHalves | None = None,
) -> dict[str, object]:
    """How well the prefill line describes TTFT (see the comment above); ``verdict`` says it in words."""
    x, y = _all_samples(points)
    fitted = set(fit_tokens)
    doc: dict[str, object] = {"n_samples": int(len(x)), "shapes": len(points), "line_miss_share": LINE_MISS_SHARE,
                              "curvature_test": CURVATURE_TEST_TEXT}
    residuals, misses = [], []
    if slope is not None and intercept is not None:
        fx, fy = _all_samples([p for p in points if p.prompt_tokens in fitted])
        doc["r2_line"] = r_squared(fx, fy, [slope, intercept]) if len(fx) else None
        for p in points:
            median = float(np.median(p.values))
            predicted = intercept + slope * float(p.prompt_tokens)
            relative = (median - predicted) / predicted if predicted > 0 else None
            residuals.append({"prompt_tokens": p.prompt_tokens, "median_s": median, "line_s": predicted,
                              "relative": relative, "in_fit": p.prompt_tokens in fitted})
            if p.prompt_tokens in fitted and (relative is None or abs(relative) > LINE_MISS_SHARE):
                misses.append(p.prompt_tokens)
        doc["intercept_over_floor"] = intercept / floor if floor else None
    doc["residuals"] = residuals
    doc["line_misses"] = misses
    doc["curvature"] = _curvature(x, y, resamples=resamples, seed=seed)
    if isinstance(doc["curvature"], dict) and doc["curvature"]["curved"]:
        doc["curvature"] = _curvature_order_test(doc["curvature"], points, halves)
    doc["verdict"] = _goodness_verdict(doc, slope, intercept, floor, fit_tokens)
    return doc


def _curvature(x: np.ndarray, y: np.ndarray, *, resamples: int, seed: int) -> dict[str, object] | None:
    distinct = np.unique(x)
    if len(distinct) < 3:
        return None
    c, b, a = (float(v) for v in np.polyfit(x, y, 2))
    boot = _case_bootstrap_coefficients(x, y, 2, resamples=resamples, seed=seed)
    tail = (1.0 - CI_CONFIDENCE) / 2.0
    c_ci = (float(np.quantile(boot[:, 0], tail)), float(np.quantile(boot[:, 0], 1.0 - tail))) if len(boot) else None
    x_max, x_min = float(distinct.max()), float(distinct.min())
    at_max = a + b * x_max + c * x_max * x_max
    share = abs(c) * x_max * x_max / at_max if at_max > 0 else None
    curved = bool(c_ci is not None and (c_ci[0] > 0 or c_ci[1] < 0) and share is not None and share >= CURVATURE_SHARE)

    def marginal_rate(at: float) -> float | None:
        derivative = b + 2.0 * c * at
        return 1.0 / derivative if derivative > 0 else None

    return {
        "a_s": a, "b_s_per_tok": b, "c_s_per_tok2": c, "c_ci": list(c_ci) if c_ci else None,
        "share_at_longest": share, "curved": curved, "r2_quadratic": r_squared(x, y, [c, b, a]),
        "marginal_rate_tok_s": {"prompt_tokens": [x_min, x_max], "rate_tok_s": [marginal_rate(x_min), marginal_rate(x_max)]},
    }


def _curvature_order_test(curvature: dict[str, object], points: Sequence[ShapePoint], halves: RunHalves | None) -> dict[str, object]:
    """A curved TTFT stays curved only when the x² coefficient survives the order test."""
    bimodal_free = {p.prompt_tokens for p in points}

    def refit(half: Sequence[ShapePoint]) -> float | None:
        return polynomial_coefficient([p for p in half if p.prompt_tokens in bimodal_free], 2)

    first, second = (refit(halves.first), refit(halves.second)) if halves is not None else (None, None)
    test = order_test(float(curvature["c_s_per_tok2"]), first, second, halves)  # type: ignore[arg-type]
    return {**curvature, "curved": bool(test["survives"]), "curved_whole_run": True, "order_test": test}


def _goodness_verdict(doc: dict[str, object], slope: float | None, intercept: float | None, floor: float | None,
                      fit_tokens: Sequence[float]) -> str:
    curvature = doc["curvature"]
    parts = []
    if isinstance(curvature, dict) and curvature["curved"]:
        lo, hi = curvature["c_ci"]
        rates = curvature["marginal_rate_tok_s"]
        ends = ", ".join(f"{r:,.0f} tok/s at {t:,.0f}" if r else f"– at {t:,.0f}"
                         for t, r in zip(rates["prompt_tokens"], rates["rate_tok_s"]))
        parts.append(f"TTFT is curved, not a line (x² coefficient 95 % CI [{lo:.3g}, {hi:.3g}] excludes 0; the x² term is "
                     f"{curvature['share_at_longest']:.0%} of TTFT at the longest prompt; quadratic R² "
                     f"{format_r2(curvature['r2_quadratic'])}; {curvature['order_test']['reason']}): no single prefill rate; "
                     f"marginal rate {ends}")
    elif isinstance(curvature, dict) and curvature.get("curved_whole_run"):
        parts.append(f"TTFT may be curved, cannot tell: the whole run's x² coefficient excludes 0, but {curvature['order_test']['reason']}")
    if slope is None or intercept is None:
        return "; ".join(parts) or "no line fitted"
    if len(fit_tokens) < 3:
        parts.append(f"the line passes through its {len(fit_tokens)} fitted medians by construction: its fit is not tested by them")
    elif doc["line_misses"]:
        parts.append(f"the line misses its fitted points at {doc['line_misses']} prompt tokens by more than {LINE_MISS_SHARE:.0%}")
    if floor and intercept > floor:
        parts.append(f"its intercept ({intercept * 1000:,.1f} ms) is {intercept / floor:.1f}× the shortest prompt's measured "
                     f"TTFT ({floor * 1000:,.1f} ms): it is not a fixed overhead")
    elif intercept < 0:
        parts.append(f"its intercept is negative ({intercept * 1000:,.1f} ms): it is not a fixed overhead")
    if not parts:
        r2 = doc.get("r2_line")
        return f"the line fits (every fitted median within {LINE_MISS_SHARE:.0%}" + (f", R² {format_r2(r2)} over its shapes' samples)" if r2 is not None else ")")
    return "; ".join(parts)


def _bootstrap_rate_ci(points: Sequence[ShapePoint], *, resamples: int, seed: int) -> tuple[float, float | None] | None:
    """Resample each shape's samples, refit the medians, invert the slope's percentile interval."""
    x = np.asarray([p.prompt_tokens for p in points], dtype=float)
    resampled = resample([p.values for p in points], resamples=resamples, seed=seed)  # each shape on its own
    resampled_medians = np.stack([median_of_rows(r) for r in resampled], axis=1)  # (resamples, shapes)
    x_centred = x - x.mean()
    slopes = (resampled_medians - resampled_medians.mean(axis=1, keepdims=True)) @ x_centred / (x_centred @ x_centred)
    slope_lo, slope_hi = percentile_interval(slopes, CI_CONFIDENCE)
    if slope_hi <= 0:
        return None
    return 1.0 / slope_hi, (1.0 / slope_lo if slope_lo > 0 else None)


# -- decode flatness ----------------------------------------------------------------------------
# The test: an ordinary least-squares line of decode rate against prompt length over EVERY kept
# sample, its slope's 95 % CI by case-resampling bootstrap (BOOTSTRAP_RESAMPLES, seed 0). The
# change across the measured context is slope * (longest - shortest prompt) / median rate.
#   flat           the whole CI of that change lies within +-DECODE_FLAT_TOLERANCE (an equivalence
#                  test: the data rule out a change larger than the tolerance);
#   falls / rises  the slope's CI excludes 0 (and the change is not shown to be within tolerance);
#   cannot tell    neither: the samples cannot tell a flat rate from a changing one (more samples
#                  would).
# 5 %: a published card's "flat" was 1.8 % (27.51-28.00 tok/s, docs/laguna-card.md#decode-and-ttft).
DECODE_FLAT_TOLERANCE = 0.05
FLAT = "flat"
FALLS = "falls with context"
RISES = "rises with context"
CANNOT_TELL = "cannot tell apart"
DECODE_FLAT_TEST_TEXT = (
    "least-squares slope of decode rate vs prompt tokens over every kept sample, 95 % case-resampling bootstrap CI; "
    f"flat when the CI of the change across the measured context lies within ±{DECODE_FLAT_TOLERANCE:.0%}, "
    "falls/rises when the slope CI excludes 0, else cannot tell apart"
)


@dataclass(frozen=True)
class DecodeFlatness:
    flat: bool | None  # True flat, False falls/rises, None untested or cannot tell
    relative_spread: float | None  # (max - min) / median of the per-shape medians (descriptive only)
    median_tok_s: float | None
    min_shape_median_tok_s: float | None
    max_shape_median_tok_s: float | None
    change_per_1k_prompt_tokens: float | None  # relative change of decode rate per 1,000 prompt tokens
    tolerance: float
    shapes: int
    verdict: str | None = None  # FLAT | FALLS | RISES | CANNOT_TELL
    n: int = 0  # samples in the regression
    change_per_1k_ci: tuple[float, float] | None = None
    change_across_context: float | None = None  # relative, shortest -> longest prompt
    change_across_context_ci: tuple[float, float] | None = None
    context_range: tuple[float, float] | None = None
    r2: float | None = None
    residual_sd_tok_s: float | None = None
    test: str = DECODE_FLAT_TEST_TEXT
    order_test: dict[str, object] | None = None  # a rise or fall only: see order_test()
    line: tuple[float, float] | None = None  # the fitted (slope tok/s per token, intercept tok/s): what plots draw

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        for key in ("change_per_1k_ci", "change_across_context_ci", "context_range", "line"):
            doc[key] = list(doc[key]) if doc[key] is not None else None
        return doc


def decode_flatness(points: Sequence[ShapePoint], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                    halves: RunHalves | None = None) -> DecodeFlatness:
    """The decode-flatness test (see the comment above); a rise or fall must also survive the
    order test on ``halves`` (the samples split by time), else it is "cannot tell apart"."""
    usable = sorted((p for p in points if len(p.values) > 0), key=lambda p: p.prompt_tokens)
    if len(usable) < 2:
        return DecodeFlatness(None, None, None, None, None, None, DECODE_FLAT_TOLERANCE, len(usable))
    medians = np.asarray([np.median(p.values) for p in usable], dtype=float)
    centre = float(np.median(medians))
    relative = float((medians.max() - medians.min()) / centre) if centre > 0 else None
    x, y = _all_samples(usable)
    slope, intercept = line_fit(x, y)
    boot = _case_bootstrap_coefficients(x, y, 1, resamples=resamples, seed=seed)
    tail = (1.0 - CI_CONFIDENCE) / 2.0
    span = float(x.max() - x.min())
    slope_ci = (float(np.quantile(boot[:, 0], tail)), float(np.quantile(boot[:, 0], 1.0 - tail))) if len(boot) else None
    residual_sd = float(np.sqrt(np.sum((y - (intercept + slope * x)) ** 2) / (len(x) - 2))) if len(x) > 2 else None
    if centre <= 0 or slope_ci is None:
        return DecodeFlatness(None, relative, centre, float(medians.min()), float(medians.max()), None, DECODE_FLAT_TOLERANCE,
                              len(usable), CANNOT_TELL, len(x))
    per_1k = slope * 1000.0 / centre
    per_1k_ci = (slope_ci[0] * 1000.0 / centre, slope_ci[1] * 1000.0 / centre)
    change = slope * span / centre
    change_ci = (slope_ci[0] * span / centre, slope_ci[1] * span / centre)
    if -DECODE_FLAT_TOLERANCE <= change_ci[0] and change_ci[1] <= DECODE_FLAT_TOLERANCE:
        verdict, flat = FLAT, True
    elif slope_ci[0] > 0 or slope_ci[1] < 0:
        verdict, flat = (RISES if slope_ci[0] > 0 else FALLS), False
    else:
        verdict, flat = CANNOT_TELL, None
    tested = None
    if verdict in (RISES, FALLS):
        first, second = (_half_slope(halves.first), _half_slope(halves.second)) if halves is not None else (None, None)
        tested = {**order_test(slope, first, second, halves), "claim": verdict}
        if not tested["survives"]:
            verdict, flat = CANNOT_TELL, None
    return DecodeFlatness(
        flat, relative, centre, float(medians.min()), float(medians.max()), per_1k, DECODE_FLAT_TOLERANCE, len(usable),
        verdict, len(x), per_1k_ci, change, change_ci, (float(x.min()), float(x.max())),
        r_squared(x, y, [slope, intercept]), residual_sd, order_test=tested, line=(slope, intercept),
    )


def _half_slope(points: Sequence[ShapePoint]) -> float | None:
    return polynomial_coefficient(points, 1)


# -- comparing two runs -------------------------------------------------------------------------
# "no difference" is an equivalence claim, as "flat" is for decode: the whole CI of the ratio lies
# within 1 ± RATIO_SAME_TOLERANCE. A CI that covers 1 but reaches beyond it cannot tell the runs
# apart (more samples would): a wide interval is not evidence of sameness.
NO_DIFFERENCE = "no difference"
RATIO_SAME_TOLERANCE = 0.05
RATIO_TEST_TEXT = (f"'{NO_DIFFERENCE}' when the whole CI lies within 1 ± {RATIO_SAME_TOLERANCE:.0%}, a direction when it excludes 1, "
                   f"else '{CANNOT_TELL}'")


def ratio_verdict(ci: tuple[float, float] | None, *, higher: str, lower: str) -> str:
    """Whether a ratio's CI shows the runs alike, which way it moved, or neither (see above)."""
    if ci is None:
        return "not enough samples"
    lo, hi = ci
    if 1.0 - RATIO_SAME_TOLERANCE <= lo and hi <= 1.0 + RATIO_SAME_TOLERANCE:
        return NO_DIFFERENCE
    if lo > 1.0 or hi < 1.0:
        return higher if lo > 1.0 else lower
    return CANNOT_TELL
