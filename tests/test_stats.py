"""fp4forge.stats, the one bootstrap: its quantile convention against hand-computed values, its
resamples against numpy's own sampler, its coverage on a case with a known answer, and the same
interval from every tool that states one."""

from __future__ import annotations

import numpy as np
import pytest

from fp4forge.errors import ConfigError
from fp4forge.stats import bootstrap_ci, bootstrap_mean_ci, mean_of_rows, median_of_rows, percentile_interval, resample


def test_the_interval_interpolates_linearly_between_order_statistics() -> None:
    # hand-computed: the 25 % and 75 % points of 0, 10, 20, 30, 40 are 10 and 30; the 5 % and 95 %
    # points of 0, 10 lie 5 % and 95 % of the way from 0 to 10
    assert percentile_interval([40.0, 0.0, 30.0, 10.0, 20.0], 0.5) == (10.0, 30.0)
    assert percentile_interval([10.0, 0.0], 0.9) == pytest.approx((0.5, 9.5))
    assert percentile_interval(list(range(101)), 0.9) == pytest.approx((5.0, 95.0))


def test_resamples_are_numpys_draws_with_replacement() -> None:
    # the oracle: numpy's own Generator.choice with replacement, then numpy.percentile on the medians
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    explicit = np.random.default_rng(11).choice(np.asarray(values), size=(500, len(values)), replace=True)
    (ours,) = resample([values], resamples=500, seed=11)
    assert np.array_equal(ours, explicit)
    low, high = np.percentile(np.median(explicit, axis=1), [2.5, 97.5])
    assert bootstrap_ci([values], median_of_rows, resamples=500, seed=11) == pytest.approx((low, high), rel=1e-12)


def test_independent_samples_are_drawn_in_order_from_one_generator() -> None:
    a, b = [1.0, 2.0, 3.0], [10.0, 20.0, 30.0, 40.0]
    rng = np.random.default_rng(5)
    expected_a = np.asarray(a)[rng.integers(0, 3, size=(50, 3))]
    expected_b = np.asarray(b)[rng.integers(0, 4, size=(50, 4))]
    got_a, got_b = resample([a, b], resamples=50, seed=5)
    assert np.array_equal(got_a, expected_a) and np.array_equal(got_b, expected_b)


def test_paired_samples_share_their_indices() -> None:
    a = [0.1, 0.4, 0.2, 0.9, 0.3, 0.5]
    b = [x + 1.0 for x in a]  # b - a is exactly 1 on every unit
    def difference(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return (y - x).mean(axis=1)

    assert bootstrap_ci([a, b], difference, paired=True) == pytest.approx((1.0, 1.0))
    low, high = bootstrap_ci([a, b], difference, paired=False)  # unpaired, the spread of each arm counts
    assert low < 0.95 and high > 1.05


def test_the_mean_interval_covers_the_true_mean_about_as_often_as_it_says() -> None:
    # known answer: samples of 40 from N(2, 1); a 90 % interval should contain 2 in about 90 % of
    # 400 datasets (binomial sd 1.5 %; the percentile bootstrap runs a little under at this n)
    rng = np.random.default_rng(2024)
    hits = 0
    for k in range(400):
        low, high = bootstrap_mean_ci(rng.normal(2.0, 1.0, 40), level=0.9, resamples=400, seed=k)
        hits += low <= 2.0 <= high
    assert 0.85 <= hits / 400 <= 0.92  # measured 0.88; a 95 % interval gives 0.93 here


def test_constant_values_give_a_point_interval_and_the_mean_lies_inside() -> None:
    assert bootstrap_mean_ci([0.25] * 10) == (0.25, 0.25)
    values = [0.1, 0.4, 0.2, 0.9, 0.3, 0.5, 0.2, 0.6]
    low, high = bootstrap_mean_ci(values)
    assert min(values) <= low < float(np.mean(values)) < high <= max(values)


def test_every_tool_states_the_same_interval_for_the_same_values_and_seed() -> None:
    from fp4forge.bench.stats import bootstrap_median_ci
    from fp4forge.quality.stats import paired_bootstrap_ci

    values = list(np.random.default_rng(3).standard_normal(25))
    mean_ci = bootstrap_mean_ci(values, resamples=2000, seed=7)
    assert paired_bootstrap_ci(values, n_boot=2000, seed=7) == mean_ci  # quality's verdicts, the study's arms
    assert bootstrap_median_ci(values, seed=7) == bootstrap_ci([values], median_of_rows, seed=7)
    assert bootstrap_ci([values], mean_of_rows, seed=7) == mean_ci


def test_bad_samples_are_named_errors() -> None:
    with pytest.raises(ConfigError):
        bootstrap_mean_ci([])
    with pytest.raises(ConfigError, match="one length"):
        resample([[1.0, 2.0], [1.0]], paired=True)
    with pytest.raises(ConfigError, match="level"):
        percentile_interval([1.0, 2.0], 1.5)
