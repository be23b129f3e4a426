"""What a quality comparison could have detected (docs/quality.md#power): the A/A floor measured
only where repeated runs can differ, the fewest one-way discordant scenarios a difference needs,
the sign test's power at the observed discordance, the floor effect. Values by hand (exact
binomial sums written out here), never through the code under test.
"""

from __future__ import annotations

from math import comb

import pytest

from fp4forge.quality.stats import (
    FLOOR_EFFECT_LEVEL,
    GREEDY_DETERMINISTIC,
    compare_arms,
    detectable_one_way_rate,
    floor_effect,
    majority_needed,
    mean_difference_factor,
)

CATEGORIES = {f"s{i}": ("alpha" if i < 10 else "beta") for i in range(20)}
GREEDY = {"temperature": 0.0, "seed": 0}


def run_of(earned: dict[str, int], default: int = 1, maximum: int = 2) -> dict[str, tuple[int, int]]:
    return {sid: (earned.get(sid, default), maximum) for sid in CATEGORIES}


def sampled(seed: int) -> dict[str, float | int]:
    return {"temperature": 0.7, "seed": seed}


def tail_at_least(k: int, n: int, psi: float) -> float:
    """P(Binomial(n, psi) >= k), summed by hand."""
    return sum(comb(n, i) * psi**i * (1 - psi) ** (n - i) for i in range(k, n + 1))


# -- the fewest discordant scenarios ------------------------------------------------------------
def test_min_discordant_by_hand() -> None:
    # 0 the other way: 2/2^5 = 0.0625 > 0.05, 2/2^6 = 0.031 <= 0.05 -> 6
    assert majority_needed(0) == 6
    # 1 the other way: 2 * (1 + M + 1 choose 1) / 2^(M+1): M = 7 gives 16/256 = 0.0625, M = 8 gives 18/512 = 0.035
    assert majority_needed(1) == 8
    # 2 the other way, n = M + 2: 2 * (1 + n + n(n-1)/2) / 2^n = 134/2048 = 0.065 at n = 11, 158/4096 = 0.039 at n = 12
    assert majority_needed(2) == 10
    assert majority_needed(0, alpha=0.01) == 8  # 2/2^7 = 0.0156, 2/2^8 = 0.0078


def test_detectable_share_by_hand() -> None:
    # 6 scenarios: power = P(all 6 discordant one way) = psi^6 = 0.8
    assert detectable_one_way_rate(6) == pytest.approx(0.8 ** (1 / 6), abs=1e-9)
    assert detectable_one_way_rate(5) is None  # fewer scenarios than the test needs
    psi = detectable_one_way_rate(72)
    assert tail_at_least(6, 72, psi) == pytest.approx(0.8, abs=1e-9)
    assert tail_at_least(6, 72, psi - 0.005) < 0.8


def test_power_at_the_observed_discordance_by_hand() -> None:
    runs_b = [run_of({"s1": 2, "s2": 2}), run_of({"s1": 2, "s2": 2})]
    result = compare_arms([run_of({}), run_of({})], runs_b, CATEGORIES, n_boot=500, requests={"A": [GREEDY] * 2, "B": [GREEDY] * 2})
    power = result["power"]
    assert power["observed_discordance"] == pytest.approx(0.1)
    at = {row["q"]: row for row in power["power_at_observed"]}
    # all discordant one way: reject iff >= 6 of 20 scenarios are discordant
    assert at[1.0]["power"] == pytest.approx(tail_at_least(6, 20, 0.1), abs=1e-12)
    assert at[1.0]["power"] == pytest.approx(0.011253, abs=1e-6)
    assert at[0.8]["delta"] == pytest.approx(0.1 * 0.6)
    assert power["min_discordant"] == 6 and power["min_discordant_given_minority"] == {"minority": 0, "majority": 6}
    assert power["descriptive_categories"] is True
    # cannot order, and says what it could have detected: never read as "no regression"
    assert result["verdict"]["ordering"] == "none"
    assert '"cannot order" is not "no regression"' in power["text"]
    assert any(note.startswith("power: ") for note in result["verdict"]["notes"])


# -- the A/A floor ------------------------------------------------------------------------------
def test_greedy_runs_measure_no_floor_and_call_nothing_outside_noise() -> None:
    # B wins one scenario; both arms ran greedy twice, repeating every score.
    runs_a, runs_b = [run_of({}), run_of({})], [run_of({"s1": 2}), run_of({"s1": 2})]
    result = compare_arms(runs_a, runs_b, CATEGORIES, n_boot=500, requests={"A": [GREEDY] * 2, "B": [GREEDY] * 2})
    floor = result["power"]["floor"]
    assert floor["measured"] is False and GREEDY_DETERMINISTIC in floor["why"]
    assert floor["band_points"] is None
    assert result["categories"]["alpha"]["within_noise"] is None  # not "within noise: no" for one scenario
    assert "outside the A/A noise floor" not in result["verdict"]["text"]


def test_greedy_ordering_rests_on_the_paired_tests_and_says_so() -> None:
    gains = {f"s{i}": 2 for i in range(12)}
    result = compare_arms([run_of({}), run_of({})], [run_of(gains), run_of(gains)], CATEGORIES, n_boot=2000,
                          requests={"A": [GREEDY] * 2, "B": [GREEDY] * 2})
    assert result["verdict"]["ordering"] == "B>A"
    assert GREEDY_DETERMINISTIC in result["verdict"]["text"] and "outside the A/A noise floor" not in result["verdict"]["text"]


def test_sampled_runs_with_seeds_measure_the_floor() -> None:
    runs_a = [run_of({}), run_of({"s1": 2, "s2": 2, "s3": 2})]
    runs_b = [run_of({"s4": 2, "s5": 2}), run_of({"s4": 2, "s5": 2, "s6": 2})]
    result = compare_arms(runs_a, runs_b, CATEGORIES, n_boot=500, requests={"A": [sampled(0), sampled(1)], "B": [sampled(0), sampled(1)]})
    floor = result["power"]["floor"]
    assert floor["measured"] is True and floor["arms"]["A"]["kind"] == "sampled"
    assert floor["band_points"] == 3  # arm A moved 3 points between its own runs
    assert "within the noise floor" in " ".join(result["verdict"]["reasons"])
    assert result["categories"]["alpha"]["within_noise"] is True


def sixteen_runs(loss: int) -> list[dict[str, tuple[int, int]]]:
    """16 runs of 20 scenarios (max 4): even runs earn 2 everywhere (40 points), odd runs 4 on
    s10 to s14 (50 points); ``loss``: s0 to s7 earn 2 - loss in every run."""
    low = {f"s{i}": 2 - loss for i in range(8)}
    high = {**low, **{f"s{i}": 4 for i in range(10, 15)}}
    return [run_of(high if k % 2 else low, default=2, maximum=4) for k in range(16)]


def test_sampled_band_is_scaled_to_the_difference_of_means() -> None:
    # Each arm moves 10 points between two single runs (40 vs 50); B loses 1 point on s0 to s7 in
    # every run: means 45 and 37, difference -8. For 16 seeded runs each the band of a
    # difference of means is 10 * sqrt((1/16 + 1/16) / 2) = 10 * 0.25 = 2.5 < 8: ordered.
    result = compare_arms(sixteen_runs(0), sixteen_runs(1), CATEGORIES, n_boot=2000,
                          requests={"A": [sampled(k) for k in range(16)], "B": [sampled(k) for k in range(16)]})
    assert result["points"]["diff"] == pytest.approx(-8.0)
    assert result["sign_test"]["favours_a"] == 8 and result["sign_test"]["p"] == pytest.approx(2 / 2**8)
    band = result["power"]["floor"]["applied_band"]
    assert band["single_run_points"] == 10 and band["factor"] == pytest.approx(0.25) and band["points"] == pytest.approx(2.5)
    assert band["scaled"] is True and band["discordance_guard"] is False
    assert result["verdict"]["ordering"] == "A>B", result["verdict"]
    assert "outside the A/A noise floor (band 2.5 points)" in result["verdict"]["text"] and "16 and 16 sampled runs" in band["why"]
    # why the band is that wide is said once, with the power, not again in the verdict or its notes
    assert not any(band["why"] in line for line in [result["verdict"]["text"], *result["verdict"]["notes"]])


def test_server_band_of_the_same_numbers_is_not_scaled() -> None:
    # The same scores from greedy runs that differ (a server's non-determinism, not i.i.d.
    # draws): the single-run band 10 stays, and |-8| <= 10 cannot order.
    result = compare_arms(sixteen_runs(0), sixteen_runs(1), CATEGORIES, n_boot=2000,
                          requests={"A": [GREEDY] * 16, "B": [GREEDY] * 16})
    band = result["power"]["floor"]["applied_band"]
    assert band["scaled"] is False and band["points"] == 10 and band["discordance_guard"] is True
    assert result["verdict"]["ordering"] == "none"
    assert result["verdict"]["reasons"] == ["the difference (-8.0 points) is within the noise floor (band 10.0 points)"]
    # 8 discordant scenarios between the arms against 5 between one arm's own runs: the guard holds
    assert result["discordant"] == 8 and result["power"]["floor"]["max_discordant"] == 5


def test_the_band_factor_is_one_for_one_run_each() -> None:
    assert mean_difference_factor([1, 1]) == 1.0
    assert mean_difference_factor([16, 16]) == pytest.approx(0.25)
    assert mean_difference_factor([2, 1]) == pytest.approx((3 / 4) ** 0.5)  # (1/2 + 1) / 2
    # two sampled runs against one: 3 points between A's runs -> 3 * sqrt(3/4) = 2.6
    runs_a = [run_of({}), run_of({"s1": 2, "s2": 2, "s3": 2})]
    result = compare_arms(runs_a, [run_of({"s4": 2})], CATEGORIES, n_boot=500, requests={"A": [sampled(0), sampled(1)], "B": [sampled(0)]})
    assert result["power"]["floor"]["applied_band"]["points"] == pytest.approx(3 * 0.75**0.5)


def test_greedy_runs_that_differ_measure_the_servers_nondeterminism() -> None:
    runs_a = [run_of({}), run_of({"s1": 2})]
    result = compare_arms(runs_a, [run_of({}), run_of({})], CATEGORIES, n_boot=500, requests={"A": [GREEDY] * 2, "B": [GREEDY] * 2})
    arms = result["power"]["floor"]["arms"]
    assert arms["A"]["measured"] and arms["A"]["kind"] == "server"
    assert not arms["B"]["measured"] and arms["B"]["kind"] == "greedy"


def test_one_run_per_arm_has_no_floor() -> None:
    result = compare_arms([run_of({})], [run_of({"s1": 2})], CATEGORIES, n_boot=500)
    assert result["power"]["floor"]["measured"] is False and result["power"]["floor"]["repeated"] is False


# -- the floor effect -----------------------------------------------------------------------------
def test_floor_effect_below_the_stated_level() -> None:
    assert FLOOR_EFFECT_LEVEL == 0.20
    assert "below 20%" in floor_effect(0.10, 0.12)
    assert floor_effect(0.10, 0.20) is None  # one arm at the level: not both below it
    low = compare_arms([run_of({}, default=0)] * 2, [run_of({"s1": 1}, default=0)] * 2, CATEGORIES, n_boot=500)
    assert low["power"]["floor_effect"] is not None
    assert any(note.startswith("FLOOR EFFECT") for note in low["verdict"]["notes"])
    high = compare_arms([run_of({})] * 2, [run_of({})] * 2, CATEGORIES, n_boot=500)  # both at 50 %
    assert high["power"]["floor_effect"] is None
