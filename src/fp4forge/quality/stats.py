"""Statistics for two arms on a small suite: noise floor, paired tests, bootstrap, power, verdict.

Pure functions over plain data: a *run* is a mapping ``scenario id -> (earned, max)``; an *arm* is
a list of runs. Per-scenario scores are fractions ``s_i = earned / max`` so that every scenario
weighs the same (notation of docs/quality.md#statistics-statspy); totals are also reported in points.
Within an arm, the K runs are averaged per scenario before pairing; the run-level data gives the A/A
noise floor.

Tests:
* sign test on ``sign(d_i)``, ``d_i = s_B,i - s_A,i``, exact two-sided, ties dropped:
  ``p = min(1, 2 * sum_{i<=min(b,c)} C(b+c, i) / 2^(b+c))``;
* McNemar on the binary view "fully correct in every run of the arm" (exact, plus the chi-square
  with continuity correction for reference);
* paired bootstrap percentile CI of the mean difference (resampling scenarios, seeded), and a
  sign-flip permutation p (exact up to 16 non-zero differences, Monte Carlo beyond);
* power of the exact sign test for n scenarios (discordance probability psi, share q of
  discordant pairs favouring one arm), and the graded-score minimum detectable effect.

The verdict orders two arms only when every one of these holds: the sign test is significant, the
bootstrap CI excludes 0, the difference of the arms' mean points exceeds the A/A band (what an arm
moved between two of its own runs, scaled to a difference of means where the runs are seeded
samples: ``applied_band``), and, where that band is not scaled, there are more discordant
scenarios between arms than within an arm. Otherwise it says
"cannot order" and lists which condition failed; without two runs of at least one arm there is no
noise floor and it never orders.

The A/A floor is *measured* only where repeated runs can differ: sampled runs (temperature > 0)
with distinct seeds, or greedy runs that did differ (the server's own non-determinism). Greedy runs
that repeat every answer measure nothing ("floor not measured: greedy is deterministic"): the
floor conditions are then not applied, and no per-category difference is called outside noise.
``power_statement`` says what the suite could have detected (docs/quality.md#power).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from fp4forge.errors import ReportError
from fp4forge.stats import bootstrap_mean_ci

Run = Mapping[str, tuple[int, int]]  # scenario id -> (earned, max)

DEFAULT_ALPHA = 0.05
DEFAULT_BOOTSTRAP = 10_000
EXACT_SIGN_FLIP_LIMIT = 16  # 2^16 sign patterns enumerated; Monte Carlo beyond
EPSILON = 1e-12


# -- exact tests --------------------------------------------------------------------------------
def binomial_cdf_half(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2), exactly (integer arithmetic, then one division)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(0, min(k, n) + 1)) / 2**n


def sign_test(b: int, c: int) -> float:
    """Exact two-sided sign test on b discordant pairs one way and c the other."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * binomial_cdf_half(min(b, c), n))


@dataclass(frozen=True)
class McNemar:
    b: int
    c: int
    exact_p: float
    chi2: float
    chi2_p: float


def mcnemar(b: int, c: int) -> McNemar:
    """Exact McNemar (= the sign test on the discordant pairs) and the continuity-corrected chi-square.

    The correction stops at zero: b == c gives chi2 = 0, not (0 - 1)^2 / (b + c).
    """
    n = b + c
    chi2 = (max(0, abs(b - c) - 1) ** 2) / n if n else 0.0
    return McNemar(b, c, sign_test(b, c), chi2, math.erfc(math.sqrt(chi2 / 2.0)))


def smallest_significant_discordance(alpha: float = DEFAULT_ALPHA) -> int:
    """The fewest discordant pairs, all in one direction, that the exact sign test can call (6 at 0.05)."""
    n = 1
    while sign_test(0, n) > alpha:
        n += 1
    return n


def paired_bootstrap_ci(diffs: Sequence[float], *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of mean(diffs), resampling items with replacement (:mod:`fp4forge.stats`)."""
    if len(diffs) == 0:
        return (0.0, 0.0)
    return bootstrap_mean_ci(diffs, level=level, resamples=n_boot, seed=seed)


def sign_flip_p(diffs: Sequence[float], *, n_perm: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> float:
    """Two-sided permutation p of mean(diffs) under random sign flips (exact for few non-zero diffs)."""
    nonzero = np.asarray([d for d in diffs if abs(d) > EPSILON], dtype=float)
    if nonzero.size == 0:
        return 1.0
    observed = abs(nonzero.sum())
    if nonzero.size <= EXACT_SIGN_FLIP_LIMIT:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=nonzero.size)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(n_perm, nonzero.size))
    sums = np.abs(signs @ nonzero)
    return float(np.mean(sums >= observed - EPSILON))


# -- power --------------------------------------------------------------------------------------
def sign_test_power(n: int, psi: float, q: float, alpha: float = DEFAULT_ALPHA) -> float:
    """Exact power of the two-sided sign test with n paired items.

    Each item is discordant with probability psi; a discordant item favours one arm with
    probability q. The gap in pass rate this detects is delta = psi * (2q - 1).
    """
    total = 0.0
    for discordant in range(n + 1):
        p_discordant = math.comb(n, discordant) * psi**discordant * (1 - psi) ** (n - discordant)
        if p_discordant == 0.0:
            continue
        reject = sum(
            math.comb(discordant, k) * q**k * (1 - q) ** (discordant - k)
            for k in range(discordant + 1)
            if sign_test(k, discordant - k) <= alpha
        )
        total += p_discordant * reject
    return total


def minimum_detectable_effect(n: int, sd_diff: float, alpha: float = DEFAULT_ALPHA, power: float = 0.8) -> float:
    """Paired normal approximation: (z_{1-alpha/2} + z_power) * sd(d) / sqrt(n)."""
    z = NormalDist()
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * sd_diff / math.sqrt(n)


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def power_table(n: int, observed_psi: float | None, alpha: float = DEFAULT_ALPHA) -> list[dict[str, float]]:
    psis = sorted({0.1, 0.2, 0.3} | ({round(observed_psi, 4)} if observed_psi else set()))
    return [
        {"psi": psi, "q": q, "delta": round(psi * (2 * q - 1), 4), "power": sign_test_power(n, psi, q, alpha)}
        for psi in psis
        for q in (0.8, 0.9, 1.0)
    ]


#: Both arms below this mean per-scenario score: the suite sits at its floor on the model.
FLOOR_EFFECT_LEVEL = 0.20
#: The power at which the suite's detectable difference is stated.
DETECTABLE_POWER = 0.8


def majority_needed(minority: int, alpha: float = DEFAULT_ALPHA) -> int:
    """The fewest discordant scenarios one way that the exact sign test calls significant when
    ``minority`` go the other way (``minority`` 0: :func:`smallest_significant_discordance`)."""
    majority = max(minority, 1)
    while sign_test(minority, majority) > alpha:
        majority += 1
    return majority


def detectable_one_way_rate(n: int, alpha: float = DEFAULT_ALPHA, power: float = DETECTABLE_POWER) -> float | None:
    """The smallest share psi of scenarios that must differ, all favouring one arm, for the sign
    test to reach ``power`` with ``n`` scenarios: P(Binomial(n, psi) >= k0) = power, k0 the
    smallest significant discordance (bisection; None when k0 > n: no difference is detectable)."""
    if smallest_significant_discordance(alpha) > n:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if sign_test_power(n, middle, 1.0, alpha) < power else (low, middle)
    return high


def floor_effect(mean_a: float, mean_b: float, level: float = FLOOR_EFFECT_LEVEL) -> str | None:
    """The warning when both arms score below ``level`` (mean per-scenario fraction), else None."""
    if mean_a >= level or mean_b >= level:
        return None
    return (f"both arms score below {level:.0%} of the suite (A {mean_a:.1%}, B {mean_b:.1%} per scenario): the suite sits "
            "at its floor on this model, most scenarios tie because both arms fail them, and a tie there says the model "
            "cannot do the task, not that the arms are equal")


def power_statement(n: int, favours_a: int, favours_b: int, means: tuple[float, float], floor: dict[str, Any],
                    alpha: float = DEFAULT_ALPHA) -> dict[str, Any]:
    """What a comparison of ``n`` paired scenarios could have detected (docs/quality.md#power)."""
    discordant = favours_a + favours_b
    psi = discordant / n if n else 0.0
    minority = min(favours_a, favours_b)
    rate = detectable_one_way_rate(n, alpha)
    statement = {
        "floor": floor,
        "alpha": alpha,
        "min_discordant": smallest_significant_discordance(alpha),
        "min_discordant_given_minority": {"minority": minority, "majority": majority_needed(minority, alpha)},
        "observed_discordance": psi,
        "power_at_observed": [{"q": q, "delta": psi * (2 * q - 1), "power": sign_test_power(n, psi, q, alpha)}
                              for q in (0.8, 0.9, 1.0)] if discordant else [],
        "detectable": None if rate is None else {"power": DETECTABLE_POWER, "one_way_share": rate, "scenarios": rate * n},
        "floor_effect": floor_effect(*means),
        "floor_effect_level": FLOOR_EFFECT_LEVEL,
        "descriptive_categories": True,
    }
    statement["text"] = power_text(n, discordant, statement)
    return statement


def power_text(n: int, discordant: int, power: dict[str, Any]) -> str:
    """The statement in words: what difference the suite could have detected at this size."""
    k0, given = power["min_discordant"], power["min_discordant_given_minority"]
    parts = [f"with {n} scenarios at α = {power['alpha']}, a difference needs at least {k0} scenarios that differ all "
             f"one way" + (f" (with the observed {given['minority']} the other way: {given['majority']})" if given["minority"] else "")]
    at_one_way = next((row for row in power["power_at_observed"] if row["q"] == 1.0), None)
    if at_one_way is not None:
        parts.append(f"at the observed discordance ({discordant} of {n} scenarios) the sign test would detect even a "
                     f"one-way difference with power {at_one_way['power']:.2f}")
    detectable = power["detectable"]
    if detectable is None:
        parts.append(f"no difference is detectable: the suite has fewer than {k0} scenarios")
    else:
        parts.append(f"{detectable['power']:.0%} power needs {detectable['one_way_share']:.1%} of scenarios "
                     f"(≈ {detectable['scenarios']:.1f}) to differ all one way; a smaller regression goes undetected, "
                     "so \"cannot order\" is not \"no regression\"")
    return "; ".join(parts)


# -- one arm: the noise floor -------------------------------------------------------------------
def fraction(points: tuple[int, int]) -> float:
    earned, maximum = points
    return earned / maximum if maximum else 0.0


def common_ids(runs: Sequence[Run]) -> list[str]:
    if not runs:
        return []
    shared = set(runs[0])
    for run in runs[1:]:
        shared &= set(run)
    return [i for i in runs[0] if i in shared]  # first run's order


def noise_floor(runs: Sequence[Run], categories: Mapping[str, str]) -> dict[str, Any]:
    """What one arm does between its own runs: flipping scenarios and categories, the spread."""
    ids = common_ids(runs)
    totals = [sum(run[i][0] for i in ids) for run in runs]
    pairs = []
    for (a, run_a), (b, run_b) in itertools.combinations(enumerate(runs), 2):
        moved = [i for i in ids if run_a[i][0] != run_b[i][0]]
        pairs.append({
            "runs": [a + 1, b + 1],
            "discordant": len(moved),
            "discordant_ids": moved,
            "points_diff": totals[b] - totals[a],
            "mean_fraction_diff": float(np.mean([fraction(run_b[i]) - fraction(run_a[i]) for i in ids])) if ids else 0.0,
        })
    flipping = [i for i in ids if len({run[i][0] for run in runs}) > 1]
    per_category: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(categories[i] for i in ids):
        members = [i for i in ids if categories[i] == category]
        earned = [sum(run[i][0] for i in members) for run in runs]
        per_category[category] = {
            "earned_per_run": earned,
            "max": sum(runs[0][i][1] for i in members),
            "spread": max(earned) - min(earned),
            "flipping": [i for i in members if i in flipping],
        }
    measured = len(runs) >= 2
    return {
        "runs": len(runs),
        "measured": measured,
        "scenarios": len(ids),
        "total_per_run": totals,
        "max_points": sum(runs[0][i][1] for i in ids) if runs else 0,
        "spread_points": (max(totals) - min(totals)) if totals else 0,
        "pairs": pairs,
        "flipping_scenarios": flipping,
        "categories": per_category,
        "categories_moved": sum(1 for entry in per_category.values() if entry["spread"] > 0),
        "band_points": max((abs(p["points_diff"]) for p in pairs), default=None),
        "band_fraction": max((abs(p["mean_fraction_diff"]) for p in pairs), default=None),
        "max_discordant": max((p["discordant"] for p in pairs), default=None),
    }


GREEDY_DETERMINISTIC = "floor not measured: greedy is deterministic"


def arm_floor_status(floor: dict[str, Any], requests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Whether one arm's repeated runs measured an A/A floor, and why (``requests``: each run's
    request parameters, ``temperature`` and ``seed``; empty when not recorded)."""
    runs, flips = floor["runs"], len(floor["flipping_scenarios"])
    temperatures = {r.get("temperature") for r in requests}
    seeds = [r.get("seed") for r in requests]
    if runs < 2:
        return {"measured": False, "kind": "one run", "why": "floor not measured: one run (an A/A floor needs two or more)"}
    if not requests or None in temperatures:
        return {"measured": True, "kind": "unrecorded", "why": f"floor measured from {runs} runs (their sampling is not recorded)"}
    if temperatures == {0}:  # greedy (0 == 0.0)
        if flips == 0:
            return {"measured": False, "kind": "greedy",
                    "why": f"{GREEDY_DETERMINISTIC} ({runs} runs at temperature 0 repeat every score; sampled runs "
                           "with seeds measure it)"}
        return {"measured": True, "kind": "server",
                "why": f"floor measured from {runs} greedy runs that differed on {flips} scenarios: the server's "
                       "non-determinism, not sampling noise"}
    if len(set(seeds)) < len(seeds) and flips == 0:
        return {"measured": False, "kind": "one seed", "why": f"floor not measured: {runs} sampled runs with one seed repeat each other"}
    return {"measured": True, "kind": "sampled",
            "why": f"floor measured from {runs} sampled runs (temperature {', '.join(str(t) for t in sorted(temperatures))}, seeds {seeds})"}


def floor_statement(floors: Mapping[str, dict[str, Any]], requests: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The comparison's A/A floor: measured when an arm's runs measured one; its band from those
    arms, and the band the difference of the arms' means is held against (``applied_band``)."""
    arms = {arm: arm_floor_status(floor, requests.get(arm, ())) for arm, floor in floors.items()}
    measured = [floors[arm] for arm, status in arms.items() if status["measured"]]
    band = max((floor["band_points"] for floor in measured), default=None)
    return {
        "measured": bool(measured),
        "why": _floor_why(arms),
        "arms": arms,
        "repeated": any(floor["runs"] >= 2 for floor in floors.values()),
        "band_points": band,
        "max_discordant": max((floor["max_discordant"] for floor in measured), default=None),
        "applied_band": applied_band(band, arms, {arm: floor["runs"] for arm, floor in floors.items()}) if measured else None,
    }


def mean_difference_factor(runs: Sequence[int]) -> float:
    """What the band of two single runs becomes for the difference of two arms' means of i.i.d.
    runs: two single runs differ with SD σ√2, the means of n_a and n_b runs with SD
    σ√(1/n_a + 1/n_b), so the band scales by √((1/n_a + 1/n_b) / 2), exactly 1 for one run each.
    The band it scales is the largest difference over all pairs of runs, which grows with the
    number of runs: the scaled band stays a wide one (several standard errors of the difference
    of means at 16 runs each), not an exact level; its false-ordering rate is not simulated."""
    return math.sqrt(sum(1 / n for n in runs) / len(runs))


def applied_band(band: float, arms: Mapping[str, dict[str, Any]], runs: Mapping[str, int]) -> dict[str, Any]:
    """The band the difference of the arms' mean points must exceed, and whether the count of
    discordant scenarios is compared with one arm's own runs' (``discordance_guard``).

    Scaled to a difference of means only where every repeated arm's runs are seeded samples
    (i.i.d. draws: averaging shrinks their noise). A server's non-determinism among greedy runs,
    or runs of unrecorded sampling, need not shrink that way: their single-run band stays, as
    does the discordance guard. Scaled, the guard is not applied: a scenario whose means over
    several runs differ is not the statistic of two single runs that differ (means of many draws
    rarely tie), and the sign test already weighs how the discordant scenarios split."""
    counts = " and ".join(str(runs[arm]) for arm in runs)
    if all(status["kind"] in ("sampled", "one run") for status in arms.values()):
        factor = mean_difference_factor(list(runs.values()))
        return {"points": band * factor, "single_run_points": band, "scaled": True, "factor": factor, "discordance_guard": False,
                "why": f"{band * factor:.1f} points: the largest difference between two single runs of one arm ({band}) "
                       f"× {factor:.3f} for the difference of the means of {counts} sampled runs"}
    kinds = ", ".join(sorted({status["kind"] for status in arms.values() if status["measured"]}))
    return {"points": float(band), "single_run_points": band, "scaled": False, "factor": 1.0, "discordance_guard": True,
            "why": f"{band} points: the largest difference between two single runs of one arm, not scaled to the means of "
                   f"{counts} runs (floor {kinds}: not seeded i.i.d. samples, so averaging need not shrink it)"}


def _floor_why(arms: Mapping[str, dict[str, Any]]) -> str:
    reasons = {status["why"] for status in arms.values()}
    if len(reasons) == 1:
        return f"{reasons.pop()} (both arms)" if len(arms) > 1 else reasons.pop()
    return "; ".join(f"{arm}: {status['why']}" for arm, status in arms.items())


# -- two arms -----------------------------------------------------------------------------------
def compare_arms(
    runs_a: Sequence[Run],
    runs_b: Sequence[Run],
    categories: Mapping[str, str],
    *,
    alpha: float = DEFAULT_ALPHA,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = 0,
    requests: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The paired comparison of arm A against arm B; ``requests``: per arm, each run's request
    parameters (temperature, seed), which say whether repeated runs measured an A/A floor."""
    if not runs_a or not runs_b:
        raise ReportError("each arm needs at least one run")
    ids = [i for i in common_ids(runs_a) if i in set(common_ids(runs_b))]
    floors = {"A": noise_floor(runs_a, categories), "B": noise_floor(runs_b, categories)}
    floor = floor_statement(floors, requests or {})
    mean_a = {i: float(np.mean([fraction(run[i]) for run in runs_a])) for i in ids}
    mean_b = {i: float(np.mean([fraction(run[i]) for run in runs_b])) for i in ids}
    diffs = [mean_b[i] - mean_a[i] for i in ids]
    favours_a = [i for i, d in zip(ids, diffs) if d < -EPSILON]
    favours_b = [i for i, d in zip(ids, diffs) if d > EPSILON]
    pass_a = {i: all(run[i][0] == run[i][1] for run in runs_a) for i in ids}
    pass_b = {i: all(run[i][0] == run[i][1] for run in runs_b) for i in ids}
    binary = mcnemar(sum(pass_a[i] and not pass_b[i] for i in ids), sum(pass_b[i] and not pass_a[i] for i in ids))
    flips = flip_list(runs_a, runs_b, [i for i in ids if i in set(favours_a) | set(favours_b)], categories, floors)
    n = len(ids)
    discordant = len(favours_a) + len(favours_b)
    means = (float(np.mean(list(mean_a.values()))) if n else 0.0, float(np.mean(list(mean_b.values()))) if n else 0.0)
    points_a = float(np.mean([sum(run[i][0] for i in ids) for run in runs_a]))
    points_b = float(np.mean([sum(run[i][0] for i in ids) for run in runs_b]))
    result = {
        "scenarios": n,
        "max_points": sum(runs_a[0][i][1] for i in ids),
        "runs": {"A": len(runs_a), "B": len(runs_b)},
        "points": {"A": points_a, "B": points_b, "diff": points_b - points_a},
        "mean_fraction": {"A": means[0], "B": means[1]},
        "mean_fraction_diff": float(np.mean(diffs)) if n else 0.0,
        "bootstrap_ci": list(paired_bootstrap_ci(diffs, n_boot=n_boot, seed=seed)),
        "bootstrap": {"resamples": n_boot, "seed": seed, "level": 0.95},
        "sign_test": {"favours_a": len(favours_a), "favours_b": len(favours_b), "ties": n - discordant, "p": sign_test(len(favours_a), len(favours_b))},
        "sign_flip_p": sign_flip_p(diffs, n_perm=n_boot, seed=seed),
        "mcnemar_fully_correct": binary.__dict__,
        "discordant": discordant,
        "discordance_rate": discordant / n if n else 0.0,
        "flips": flips,
        "flips_also_within_arm": sum(1 for f in flips if f["flips_within_a"] or f["flips_within_b"]),
        "noise_floor": floors,
        "categories": category_comparison(runs_a, runs_b, ids, categories, floor_measured=floor["measured"]),
        "power": {**power_statement(n, len(favours_a), len(favours_b), means, floor, alpha), **graded_power(n, diffs, alpha)},
        "alpha": alpha,
    }
    result["verdict"] = verdict(result, alpha)
    return result


def flip_list(runs_a: Sequence[Run], runs_b: Sequence[Run], discordant_ids: list[str], categories: Mapping[str, str],
              floors: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The scenarios whose score differs between the arms, in suite order, with their runs' points."""
    flipping_a, flipping_b = set(floors["A"]["flipping_scenarios"]), set(floors["B"]["flipping_scenarios"])
    flips = []
    for i in discordant_ids:
        mean_a = float(np.mean([fraction(run[i]) for run in runs_a]))
        mean_b = float(np.mean([fraction(run[i]) for run in runs_b]))
        flips.append({
            "id": i, "category": categories[i], "max": runs_a[0][i][1],
            "a": [run[i][0] for run in runs_a], "b": [run[i][0] for run in runs_b],
            "diff_fraction": mean_b - mean_a, "favours": "B" if mean_b > mean_a else "A",
            "flips_within_a": i in flipping_a, "flips_within_b": i in flipping_b,
        })
    return flips


def graded_power(n: int, diffs: Sequence[float], alpha: float) -> dict[str, Any]:
    """The graded-score view: the minimum detectable mean difference and the sign test's power table."""
    sd_diff = float(np.std(diffs, ddof=1)) if n > 1 else 0.0
    return {
        "sd_diff": sd_diff,
        "mde_80": minimum_detectable_effect(n, sd_diff, alpha) if n > 1 and sd_diff > 0 else None,
        "mde_80_by_sd": {str(sd): minimum_detectable_effect(n, sd, alpha) for sd in (0.2, 0.3, 0.4, 0.5)} if n > 1 else {},
        "sign_test": power_table(n, sum(abs(d) > EPSILON for d in diffs) / n if n else None, alpha) if n else [],
    }


def category_comparison(runs_a: Sequence[Run], runs_b: Sequence[Run], ids: list[str], categories: Mapping[str, str],
                        *, floor_measured: bool | None = None) -> dict[str, dict[str, Any]]:
    """Per category: points per run of each arm, the means, the difference and the within-arm spread.

    Descriptive only: about four scenarios per category cannot support a per-category test. Where
    no A/A floor was measured (one run, or greedy runs that repeat every score) no difference is
    called within or outside noise (``floor_measured``; None: whenever an arm ran twice).
    """
    table: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(categories[i] for i in ids):
        members = [i for i in ids if categories[i] == category]
        earned_a = [sum(run[i][0] for i in members) for run in runs_a]
        earned_b = [sum(run[i][0] for i in members) for run in runs_b]
        spread = max(max(earned_a) - min(earned_a), max(earned_b) - min(earned_b))
        measured = (len(runs_a) > 1 or len(runs_b) > 1) if floor_measured is None else floor_measured
        diff = float(np.mean(earned_b) - np.mean(earned_a))
        table[category] = {
            "scenarios": len(members),
            "max": sum(runs_a[0][i][1] for i in members),
            "a": earned_a,
            "b": earned_b,
            "mean_a": float(np.mean(earned_a)),
            "mean_b": float(np.mean(earned_b)),
            "diff": diff,
            "within_arm_spread": spread if measured else None,
            "within_noise": (abs(diff) <= spread) if measured else None,
        }
    return table


def verdict(result: dict[str, Any], alpha: float = DEFAULT_ALPHA) -> dict[str, Any]:
    """Order the arms only when the difference clears every test and the noise floor; a floor that
    was not measured (greedy runs repeat every score) adds no condition and is said so."""
    floor = result["power"]["floor"]
    diff, discordant, sign = result["points"]["diff"], result["discordant"], result["sign_test"]
    if discordant == 0:
        text = "no difference: both arms earned the same points on every scenario"
        if not floor["repeated"]:
            text += " (no noise floor measured: run an arm twice to know how stable that is)"
        return {"ordering": "none", "label": "no difference", "text": text, "reasons": [], "notes": _power_notes(result)}
    reasons = _failed_conditions(result, alpha)
    also = result["flips_also_within_arm"]
    notes = ([f"{also} of the {discordant} discordant scenarios also flip within an arm's own runs", _guard_note(floor["applied_band"])]
             if floor["measured"] else [])
    notes += _power_notes(result)
    if reasons:
        return {"ordering": "none", "label": "cannot order the arms", "text": "cannot order the arms: " + "; ".join(reasons),
                "reasons": reasons, "notes": notes}
    better = "B" if diff > 0 else "A"
    worse = "A" if better == "B" else "B"
    low, high = result["bootstrap_ci"]
    floor_text = (f"outside the A/A noise floor ({_band_size(floor['applied_band'])})" if floor["measured"]
                  else f"{floor['why']}: the ordering rests on the paired tests")
    text = (f"{better} scores higher than {worse}: {abs(diff):.1f} points (mean per-scenario difference "
            f"{result['mean_fraction_diff']:+.3f}, 95% CI [{low:+.3f}, {high:+.3f}]), sign test p = {sign['p']:.3g}, {floor_text}")
    return {"ordering": f"{better}>{worse}", "label": f"{better} better", "text": text, "reasons": [], "notes": notes}


def _failed_conditions(result: dict[str, Any], alpha: float) -> list[str]:
    """The conditions of an ordering that the comparison fails, in words."""
    floor, sign, discordant, diff = result["power"]["floor"], result["sign_test"], result["discordant"], result["points"]["diff"]
    reasons = []
    if not floor["repeated"]:
        reasons.append("no A/A noise floor: run at least one arm twice")
    if sign["p"] >= alpha:
        reasons.append(f"sign test p = {sign['p']:.3f} on {discordant} discordant scenarios "
                       f"({sign['favours_a']} favour A, {sign['favours_b']} favour B; needs p < {alpha})")
    low, high = result["bootstrap_ci"]
    if low <= 0.0 <= high:
        reasons.append(f"the 95% bootstrap CI of the mean difference [{low:+.3f}, {high:+.3f}] includes 0")
    if floor["measured"]:
        band, within = floor["applied_band"], floor["max_discordant"]
        if abs(diff) <= band["points"]:
            reasons.append(f"the difference ({diff:+.1f} points) is within the noise floor ({_band_size(band)})")
        if band["discordance_guard"] and discordant <= within:
            reasons.append(f"{discordant} scenarios differ between the arms, no more than the {within} that differ between one arm's own runs")
    return reasons


def _band_size(band: dict[str, Any]) -> str:
    """The band in a verdict or a reason; why it is that wide is said once, with the power (``A/A band:``)."""
    return f"band {band['points']:.1f} points"


def _guard_note(band: dict[str, Any]) -> str:
    if band["discordance_guard"]:
        return "the count of discordant scenarios must exceed one arm's own runs'"
    return ("the count of discordant scenarios is not held against one arm's own runs' (means of several draws rarely "
            "tie, so it is not the same count): the sign test weighs how they split")


def _power_notes(result: dict[str, Any]) -> list[str]:
    """What the suite could have detected, the floor and a floor effect: beside every verdict."""
    power = result["power"]
    notes = [f"A/A {power['floor']['why']}"]
    if power["floor_effect"]:
        notes.append("FLOOR EFFECT: " + power["floor_effect"])
    return [*notes, "power: " + power["text"]]
