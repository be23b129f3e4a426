"""The one bootstrap: percentile intervals of any statistic, over paired or independent samples.

Every tool that states a bootstrap interval (the quality verdicts, the bench summaries and fits, fidelity,
the study's arms) resamples here, so the same values and seed give the same interval whichever
tool computed it:

* one random source: ``numpy.random.default_rng(seed)``; a resample of ``n`` items is one draw of
  ``rng.integers(0, n, size=(resamples, n))`` (the draws ``Generator.choice`` with replacement makes);
* **paired** samples (item ``i`` of every sample is one unit: the same scenario, the same text
  sample, the same (x, y) case) share one index draw; **independent** samples are resampled one
  after the other, in the order given, from the same generator;
* one quantile convention: the percentile interval of level ``L`` is
  ``numpy.quantile(values, [(1 - L) / 2, (1 + L) / 2])`` with numpy's default linear interpolation
  between order statistics (the convention of ``bench/stats.py``'s reported percentiles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fp4forge.errors import ConfigError

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95

# A statistic maps the resampled samples, each an array (resamples, n_i), to one value per
# resample (an array whose first axis is the resample).
Statistic = Callable[..., np.ndarray]


def resample(samples: Sequence[Sequence[float]], *, resamples: int = DEFAULT_RESAMPLES, seed: int = 0, paired: bool = False) -> list[np.ndarray]:
    """Bootstrap resamples of each sample, an array (resamples, n_i) per sample; ``paired``
    samples (equal lengths) share one draw of indices."""
    arrays = [np.asarray(sample, dtype=float) for sample in samples]
    if not arrays or any(a.ndim != 1 or a.size == 0 for a in arrays):
        raise ConfigError("a bootstrap needs one or more non-empty samples of numbers")
    rng = np.random.default_rng(seed)
    if not paired:
        return [a[rng.integers(0, a.size, size=(resamples, a.size))] for a in arrays]
    if len({a.size for a in arrays}) != 1:
        raise ConfigError(f"paired samples must have one length each, got {[a.size for a in arrays]}")
    index = rng.integers(0, arrays[0].size, size=(resamples, arrays[0].size))
    return [a[index] for a in arrays]


def percentile_interval(values: np.ndarray | Sequence[float], level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """The central ``level`` interval of ``values`` (linear interpolation between order statistics)."""
    if not 0.0 < level < 1.0:
        raise ConfigError(f"an interval's level is in (0, 1), got {level}")
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(np.asarray(values, dtype=float), [tail, 1.0 - tail])
    return float(low), float(high)


def bootstrap_ci(
    samples: Sequence[Sequence[float]],
    statistic: Statistic,
    *,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    paired: bool = False,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic(*samples)``."""
    return percentile_interval(statistic(*resample(samples, resamples=resamples, seed=seed, paired=paired)), level)


def mean_of_rows(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=1)


def median_of_rows(values: np.ndarray) -> np.ndarray:
    return np.median(values, axis=1)


def bootstrap_mean_ci(values: Sequence[float], *, level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` (the independent units; for paired
    data, the per-unit differences)."""
    return bootstrap_ci([values], mean_of_rows, level=level, resamples=resamples, seed=seed)


__all__ = ["DEFAULT_LEVEL", "DEFAULT_RESAMPLES", "bootstrap_ci", "bootstrap_mean_ci", "mean_of_rows", "median_of_rows", "percentile_interval", "resample"]
