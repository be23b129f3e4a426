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
    data = np.asarray(values, dtype=float)
    if len(data) < 2:
        return None
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
    tail = (1.0 - confidence) / 2.0
    return float(np.quantile(medians, tail)), float(np.quantile(medians, 1.0 - tail))


def bootstrap_ratio_of_medians_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = CI_CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """median(b) / median(a) and its percentile-bootstrap CI, resampling the two runs independently."""
    data_a = np.asarray(a, dtype=float)
    data_b = np.asarray(b, dtype=float)
    if len(data_a) < 2 or len(data_b) < 2 or np.median(data_a) == 0:
        return None
    rng = np.random.default_rng(seed)
    med_a = np.median(rng.choice(data_a, size=(resamples, len(data_a)), replace=True), axis=1)
    med_b = np.median(rng.choice(data_b, size=(resamples, len(data_b)), replace=True), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = med_b / med_a
    ratios = ratios[np.isfinite(ratios)]
    tail = (1.0 - confidence) / 2.0
    point = float(np.median(data_b) / np.median(data_a))
    return point, float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


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


def prefill_fit(
    points: Sequence[ShapePoint],
    *,
    exclude_from_fit: frozenset[float] = frozenset(),
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> PrefillFit:
    """Prefill rate from TTFT samples per prompt length (concurrency 1 is the meaningful case).

    ``exclude_from_fit``: prompt lengths whose median must not enter the line (bimodal shapes:
    their median sits between two real modes); they still get a regime label.
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
    if len(fit_points) < MIN_FIT_SHAPES:
        reason = f"{len(fit_points)} usable shape(s) above the knee; a rate needs {MIN_FIT_SHAPES}"
        return PrefillFit(None, None, None, None, floor, KNEE_RULE_TEXT, regimes, fit_tokens, reason)
    slope, intercept = line_fit(fit_tokens, [m for _, m in fit_points])
    rate_ci = _bootstrap_rate_ci([p for p, _ in fit_points], resamples=resamples, seed=seed)
    rate = 1.0 / slope if slope > 0 else None
    reason = f"fit over {len(fit_points)} compute-dominated shapes" if rate else "non-positive slope"
    return PrefillFit(rate, rate_ci, slope, intercept, floor, KNEE_RULE_TEXT, regimes, fit_tokens, reason)


def _bootstrap_rate_ci(points: Sequence[ShapePoint], *, resamples: int, seed: int) -> tuple[float, float | None] | None:
    """Resample each shape's samples, refit the medians, invert the slope's percentile interval."""
    rng = np.random.default_rng(seed)
    x = np.asarray([p.prompt_tokens for p in points], dtype=float)
    resampled_medians = np.stack(
        [np.median(rng.choice(np.asarray(p.values, dtype=float), size=(resamples, len(p.values))), axis=1) for p in points],
        axis=1,
    )  # (resamples, shapes)
    x_centred = x - x.mean()
    slopes = (resampled_medians - resampled_medians.mean(axis=1, keepdims=True)) @ x_centred / (x_centred @ x_centred)
    tail = (1.0 - CI_CONFIDENCE) / 2.0
    slope_lo, slope_hi = float(np.quantile(slopes, tail)), float(np.quantile(slopes, 1.0 - tail))
    if slope_hi <= 0:
        return None
    return 1.0 / slope_hi, (1.0 / slope_lo if slope_lo > 0 else None)


# -- decode flatness ----------------------------------------------------------------------------
# Flat when the per-shape median decode rates stay within DECODE_FLAT_TOLERANCE of their own
# median: (max - min) / median <= 5 % (a published card's "flat" was 1.8 %: 27.51-28.00 tok/s,
# docs/laguna-card.md#decode-and-ttft).
DECODE_FLAT_TOLERANCE = 0.05


@dataclass(frozen=True)
class DecodeFlatness:
    flat: bool | None
    relative_spread: float | None
    median_tok_s: float | None
    min_shape_median_tok_s: float | None
    max_shape_median_tok_s: float | None
    change_per_1k_prompt_tokens: float | None  # relative change of decode rate per 1,000 prompt tokens
    tolerance: float
    shapes: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def decode_flatness(points: Sequence[ShapePoint]) -> DecodeFlatness:
    usable = sorted((p for p in points if len(p.values) > 0), key=lambda p: p.prompt_tokens)
    if len(usable) < 2:
        return DecodeFlatness(None, None, None, None, None, None, DECODE_FLAT_TOLERANCE, len(usable))
    medians = np.asarray([np.median(p.values) for p in usable], dtype=float)
    centre = float(np.median(medians))
    relative = float((medians.max() - medians.min()) / centre) if centre > 0 else None
    slope, _ = line_fit([p.prompt_tokens for p in usable], medians)
    per_1k = slope * 1000.0 / centre if centre > 0 else None
    flat = relative is not None and relative <= DECODE_FLAT_TOLERANCE
    return DecodeFlatness(flat, relative, centre, float(medians.min()), float(medians.max()), per_1k, DECODE_FLAT_TOLERANCE, len(usable))


# -- comparing two runs -------------------------------------------------------------------------
NO_DIFFERENCE = "no difference"


def ratio_verdict(ci: tuple[float, float] | None, *, higher: str, lower: str) -> str:
    """"no difference" when the ratio's CI covers 1; otherwise which way it moved."""
    if ci is None:
        return "not enough samples"
    lo, hi = ci
    if lo <= 1.0 <= hi:
        return NO_DIFFERENCE
    return higher if lo > 1.0 else lower
